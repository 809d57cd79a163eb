"""Refuses a run whose training state cannot fit, before anything is allocated."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from noloco_jax.errors import UserError, check_choice, check_int

__all__ = ["state_bytes_per_device", "available_bytes", "check_fits"]

_GIB = 1024**3


def state_bytes_per_device(abstract_params: Any, tx: Any, *, num_replicas: int,
                           backend: str, num_stages: int = 1) -> int:  # fmt: skip
    """Bytes of the replicated training state (params + optimizer state) on one device.

    Args:
      abstract_params: one replica's params (arrays or ``jax.ShapeDtypeStruct``).
      tx: the optimizer; its state is sized with ``jax.eval_shape(tx.init, ...)``.
      num_replicas: N.
      backend: "vmap" (all replicas on one device) or "shard_map" (one per device).
      num_stages: stages a replica's blocks are split over on a (replica, stage) mesh (1
        when stages are simulated); embedding, head and final norm are on every stage device.

    Returns:
      A lower bound: gradients and activations come on top.

    Raises:
      ValueError: ``num_replicas`` or ``num_stages`` is not an integer >= 1, or ``backend``
        is not "vmap" or "shard_map".
    """
    from noloco_jax.pipeline.routed import stage_leaf_axes  # noqa: PLC0415

    check_int("num_replicas", num_replicas)
    check_int("num_stages", num_stages)
    check_choice("backend", backend, ("vmap", "shard_map"))

    def share(path: tuple, x: Any) -> int:  # the blocks split over the stages, the rest not
        n = int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        return n // num_stages if num_stages > 1 and stage_leaf_axes(path, x) else n

    trees = (abstract_params, jax.eval_shape(tx.init, abstract_params))
    per_replica = sum(share(path, x) for tree in trees
                      for path, x in jax.tree_util.tree_flatten_with_path(tree)[0])  # fmt: skip
    return per_replica * (num_replicas if backend == "vmap" else 1)


def available_bytes(device: Any) -> tuple[int | None, str]:
    """(free bytes, what was measured) for ``device``: its allocator, or for a CPU device the
    host's free RAM; ``None`` for an accelerator without allocator statistics (the host's RAM
    says nothing of its memory)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without allocator statistics
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)), str(device)
    if device.platform != "cpu":
        return None, str(device)
    return _host_available(), "the host's available memory (CPU devices share it)"


def _host_available() -> int:
    """MemAvailable (free plus reclaimable page cache), else the free pages."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(per_device: int, devices_used: int, *, preset: str, backend: str,
               init_from: str = "") -> None:
    """Raises ``UserError`` with the estimate, the free memory and the remedy when it cannot fit.

    Args:
      per_device: ``state_bytes_per_device``.
      devices_used: this process's devices holding a share of the state (a CPU device's
        share is in this host's RAM; other processes' devices are on their hosts).
      preset: the model preset (named in the message).
      init_from: the Hugging Face checkpoint the model comes from, if any (named instead of
        the preset, which it replaces).
      backend: the replica backend (named in the message).
    """
    device = jax.local_devices()[0]  # this process's (multi-process: others are not addressable)
    free, where = available_bytes(device)
    need = per_device * (devices_used if device.platform == "cpu" else 1)
    if free is None or need <= free:  # None: unknown; XLA reports running out itself
        return
    model = f"model.init_from={init_from!r}" if init_from else f"model.preset={preset!r}"
    spread = ("CPU devices share this memory, so spreading the state over more of them "
              "(shard_map, mesh splits, stages) does not shrink it. Use"
              if device.platform == "cpu" else
              "Put fewer replicas on each device (backend='shard_map' with one device per "
              "replica), split each replica over several devices (config.mesh.fsdp, "
              "config.mesh.tensor), split layers over pipeline stages on a replica x stage "
              "mesh (num_stages, with N x S devices), or use")  # fmt: skip
    raise UserError(
        f"the training state needs at least {need / _GIB:.1f} GiB ({per_device / _GIB:.1f} GiB "
        f"per device, {model}, backend={backend!r}) but {where} has "
        f"{free / _GIB:.1f} GiB free. {spread} fewer replicas, a smaller "
        f"model.preset or model.param_dtype='bfloat16'."
    )
