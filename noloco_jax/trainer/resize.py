"""Resuming with another number of replicas (``--config.allow_resize=True``).

N -> N / k (k an integer): replicas ``k i .. k i + k - 1`` merge into new replica ``i``: every
per-replica float leaf (fast weights theta, slow weights phi, outer momentum, Adam moments) is
their mean, over the finite values (a replica whose weights broke, which the non-finite guard would
reset at its next sync, does not spread NaN to its partners); a per-replica integer scalar (a
counter such as Adam's step count, equal on every replica unless the non-finite guard restarted
one) takes the largest, so merged moments are not bias-corrected as if they were young; other
integer leaves (a PRNG key) take the first replica's. N -> k N: replica ``i`` is cloned into
``k i .. k i + k - 1``. Shared leaves (the step and round counters, no replica axis) are kept.
Which leaves carry the replica axis comes from ``replicas.replica_axes``, never from field names,
so any replicated optimizer state works.

Both keep the replica mean of every float leaf, so the averaged model is unchanged. After
the resize the run continues as if it had started with the new N: the data batcher deals the
windows into the new number of shards (same seed; each replica's shard changes) at the same
step, and NoLoCo's group draws continue from the shared round counter over the new N.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from noloco_jax import replicas
from noloco_jax.optim.local_steps import LocalStepsState
from noloco_jax.trainer.settings import check_resume_compatible

__all__ = ["RESIZE_FIELDS", "check_init_model", "check_resume", "resize_state", "restore_resized"]

# Settings a resize may change (with allow_resize); everything else must match. NoLoCo's
# group size must divide the new N, and no state depends on it.
RESIZE_FIELDS = ("num_replicas", "global_batch_size", "outer.group_size")
_BATCHER_FIELDS = ("num_replicas", "batch_size")


def _with(d: dict, source: dict, keys: tuple[str, ...]) -> dict:
    """``d`` with the values of ``keys`` (dotted for nested ones) taken from ``source``."""
    out = dict(d)
    for key in keys:
        head, _, rest = key.partition(".")
        if rest and isinstance(source.get(head), dict):
            out[head] = _with(out.get(head, {}), source[head], (rest,))
        elif not rest and key in source:
            out[key] = source[key]
    return out


def check_resume(saved_meta: dict, current_meta: dict, allow_resize: bool) -> int | None:
    """Checks a checkpoint's settings against the run's; returns its N when it must be resized.

    Args:
      saved_meta: the checkpoint's metadata (``settings`` and ``batcher``).
      current_meta: the run's.
      allow_resize: ``config.allow_resize``.

    Returns:
      None when the replica count is unchanged, else the checkpoint's replica count.

    Raises:
      ValueError: settings that may not change did, or N changed without ``allow_resize``, or
        neither count divides the other.
    """
    from noloco_jax.data.batches import ReplicaBatcher  # noqa: PLC0415

    check_init_model(saved_meta, current_meta, "resume")
    saved, current = saved_meta["settings"], current_meta["settings"]
    old_n, new_n = saved["num_replicas"], current["num_replicas"]
    resize = old_n != new_n and allow_resize
    if resize and max(old_n, new_n) % min(old_n, new_n):
        raise ValueError(f"config.allow_resize: the checkpoint has {old_n} replicas; resuming "
                         f"with {new_n} needs one count to divide the other.")  # fmt: skip
    # A resize compares everything but the fields it changes (taken from the current run).
    try:
        check_resume_compatible(_with(saved, current, RESIZE_FIELDS if resize else ()), current)
    except ValueError as err:
        if old_n == new_n or resize:
            raise
        raise ValueError(f"{err} To merge or clone replicas ({old_n} -> {new_n}), set "
                         f"--config.allow_resize=True.") from None  # fmt: skip
    batcher, fields = current_meta["batcher"], _BATCHER_FIELDS if resize else ()
    ReplicaBatcher.check_compatible(_with(saved_meta["batcher"], batcher, fields), batcher)
    return old_n if resize else None


# Model config fields that come from settings, not the config.json: the settings check them
# (model.remat may change on resume and load).
_FROM_SETTINGS = ("dtype", "param_dtype", "remat")


def check_init_model(saved_meta: dict, current_meta: dict, verb: str) -> None:
    """Refuses to ``verb`` (resume, load the run) once the ``init_from`` config.json changed
    since the checkpoint: only its path is a setting, and the weights would run under another
    rope_theta or eps. Checkpoints older than this check record no model config."""
    saved, current = saved_meta.get("init_model"), current_meta.get("init_model")
    if saved is None or current is None:
        return
    saved, current = ({k: v for k, v in m.items() if k not in _FROM_SETTINGS}
                      for m in (saved, current))  # fmt: skip
    if saved == current:
        return
    changed = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}"
                        for k in sorted(saved.keys() | current.keys())
                        if saved.get(k) != current.get(k))  # fmt: skip
    raise ValueError(f"cannot {verb}: config.model.init_from's config.json changed since the "
                     f"checkpoint was written ({changed}). Put the original config.json back, "
                     f"or start a new run in another --workdir.")


def _resize_leaf(x: Any, axis: Any, new_n: int) -> Any:
    if axis is None:
        return x
    x = np.asarray(x)  # on the host, one leaf at a time (no device gathers a whole leaf)
    old_n = x.shape[0]
    if new_n >= old_n:
        return np.repeat(x, new_n // old_n, axis=0)
    groups = x.reshape(new_n, old_n // new_n, *x.shape[1:])
    if jnp.issubdtype(x.dtype, jnp.floating):  # the mean of the finite values
        wide = groups.astype(np.float32)
        finite = np.isfinite(wide)
        mean = np.where(finite, wide, 0).sum(1) / np.maximum(finite.sum(1), 1)
        return np.where(finite.any(1), mean, wide.mean(1)).astype(x.dtype)
    if groups.ndim == 2 and jnp.issubdtype(x.dtype, jnp.integer):  # a counter per replica
        return groups.max(1)  # the longest history (a guard reset restarts Adam's count)
    return groups[:, 0]  # other integers (e.g. a PRNG key): the first replica's


def resize_state(state: Any, new_n: int) -> Any:
    """Merges (mean) or clones the replica axis of a replicated-layout tree to ``new_n``.

    Args:
      state: a tree in the replicated layout (per-replica leaves lead with N, shared ones not).
      new_n: the new replica count; N must divide it or be divisible by it.

    Returns:
      The tree with N replaced by ``new_n`` on every per-replica leaf.
    """
    axes = replicas.replica_axes(state)
    resized = jax.tree.map(lambda x, a: _resize_leaf(x, a, new_n), state, axes)
    is_local = lambda x: isinstance(x, LocalStepsState)  # noqa: E731

    def keep_total(old: Any, new: Any) -> Any:  # reset counts are summed or moved, not averaged
        if not is_local(old) or jnp.ndim(old.nonfinite_resets) == 0:
            return new
        return new._replace(nonfinite_resets=_resize_count(old.nonfinite_resets, new_n))

    return jax.tree.map(keep_total, state, resized, is_leaf=is_local)


def _resize_count(x: Any, new_n: int) -> np.ndarray:
    """Per-replica counts for ``new_n`` replicas with the same total: merged replicas add
    theirs up, and a cloned replica's count stays with its first clone."""
    x = np.asarray(x)
    old_n = x.shape[0]
    if new_n < old_n:
        return x.reshape(new_n, old_n // new_n, *x.shape[1:]).sum(1)
    out = np.zeros((new_n, *x.shape[1:]), x.dtype)
    out[:: new_n // old_n] = x
    return out


def restore_resized(ckpt: Any, step: int, state: Any, old_n: int, reps: Any) -> Any:
    """Restores a checkpoint of ``old_n`` replicas and resizes it to ``state``'s layout.

    Args:
      ckpt: the ``Checkpointer``.
      step: the checkpoint's step.
      state: the new run's state target, placed shapes or arrays (gives structure, N and
        the shardings).
      old_n: the checkpoint's replica count.
      reps: the new run's ``Replicas`` (places the result).

    Returns:
      The resized state, placed for the new run.
    """
    axes = replicas.replica_axes(state)
    layout = _old_layout(old_n, state, axes)

    def old_shape(x: Any, axis: Any, sharding: Any) -> jax.ShapeDtypeStruct:
        shape = x.shape if axis is None else (old_n, *x.shape[1:])
        return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)

    abstract = jax.tree.map(old_shape, state, axes, layout)
    restored, _ = ckpt.restore(step, abstract)
    resized = resize_state(restored, reps.num_replicas)
    if reps.mesh is None:  # vmap: the whole state on the run's one device
        return jax.device_put(resized, jax.tree.leaves(state)[0].sharding)
    return reps.put(resized)


def _old_layout(old_n: int, state: Any, axes: Any) -> Any:
    """Per-leaf shardings to read an ``old_n``-replica checkpoint with, so that no device holds
    the whole of it: the old replicas spread over the devices (in as many groups as divide
    ``old_n`` and fit), each split inside as the new run splits a replica (``mesh.fsdp``, ...)."""
    first = jax.tree.leaves(state)[0].sharding
    mesh = first.mesh if isinstance(first, NamedSharding) else None  # None: vmap
    names = ("replica",) if mesh is None else tuple(mesh.axis_names)
    inner = () if mesh is None else tuple(mesh.devices.shape[1:])  # one replica's devices
    devices = np.array(jax.devices())
    room = devices.size // math.prod(inner)  # old replicas that fit side by side
    d = max(k for k in range(1, min(old_n, room) + 1) if old_n % k == 0)
    if jax.process_count() > 1 or d * math.prod(inner) == 1:  # one device (each process its own)
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.tree.map(lambda _: device, state)
    grid = jax.sharding.Mesh(devices[: d * math.prod(inner)].reshape(d, *inner), names)

    def spec(x: Any, axis: Any) -> NamedSharding:
        if mesh is not None:
            return NamedSharding(grid, x.sharding.spec)  # the run's split of the leaf
        return NamedSharding(grid, P() if axis is None else P(names[0]))

    return jax.tree.map(spec, state, axes)
