"""Timing helpers for the benchmarks: variants measured side by side, interleaved.

CPUs here are shared and noisy, so every benchmark reports ratios of variants timed in the
same process, alternating A, B, A, B, ... so that slow periods hit every variant alike, and
the median of the repetitions.
"""

from __future__ import annotations

import json
import pathlib
import platform
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from noloco_jax.experiments import harness
from noloco_jax.experiments.harness import ROOT, SCRATCH  # noqa: F401  (ROOT: for the scripts)

md_table = harness.md_table  # the benchmark pages' tables, written as the results pages'


def block(x: Any) -> Any:
    return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def interleaved(fns: dict[str, Callable[[], Any]], reps: int) -> dict[str, list[float]]:
    """Seconds per call of every fn, called round-robin ``reps`` times after one warm-up."""
    for fn in fns.values():
        block(fn())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            block(fn())
            times[name].append(time.perf_counter() - t0)
    return times


class Carried:
    """``fn(carry, *args)`` called with its own previous output, so ``carry`` can be donated.

    Use it as a variant in ``interleaved``: each call runs ``carry = fn(carry, *args)[0]``
    when ``fn`` returns a tuple (state, aux), else ``carry = fn(carry, *args)``, like a
    training loop that hands each step's state to the next with ``donate_argnums=0``.
    """

    def __init__(self, fn: Callable[..., Any], carry: Any, *args: Any) -> None:
        self.fn, self.carry, self.args = fn, carry, args

    def __call__(self) -> Any:
        out = self.fn(self.carry, *self.args)
        self.carry = out[0] if isinstance(out, tuple) else out
        return out


def summary(times: list[float]) -> dict[str, float]:
    q = np.percentile(times, [25, 50, 75])
    return {"median_s": float(q[1]), "q25_s": float(q[0]), "q75_s": float(q[2]),
            "reps": len(times)}  # fmt: skip


def ratio(times: dict[str, list[float]], a: str, b: str) -> float:
    return statistics.median(times[a]) / statistics.median(times[b])


def paired_ratios(times: dict[str, list[float]], a: str, b: str) -> dict[str, float]:
    """Quartiles of ``a / b`` taken round by round of ``interleaved``.

    The two calls of one round ran back to back, so a slow period that spans a
    round cancels in its ratio; this resolves smaller differences than the
    ratio of medians when the machine's speed drifts.
    """
    q = np.percentile(np.asarray(times[a]) / np.asarray(times[b]), [25, 50, 75])
    return {"median": float(q[1]), "q25": float(q[0]), "q75": float(q[2])}


def git_commit() -> str:
    """The short hash of the checked-out commit (``unknown`` outside a git checkout)."""
    import subprocess  # noqa: PLC0415

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def environment() -> dict[str, str]:
    """Where a benchmark ran: device, library versions and the code's commit.

    The commit is ``$NOLOCO_JAX_COMMIT`` when set (a copy of the tree without ``.git``, as on a
    lent GPU machine), else ``git rev-parse --short HEAD``.
    """
    import os  # noqa: PLC0415

    import flax
    import optax

    return {
        "commit": os.environ.get("NOLOCO_JAX_COMMIT") or git_commit(),
        "device": str(jax.devices()[0].device_kind),
        "num_devices": str(jax.device_count()),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
    }  # fmt: skip


def write(name: str, results: dict, markdown: str, out_dir: pathlib.Path = SCRATCH) -> None:
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    (out_dir / f"{name}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {out_dir / (name + '.json')} and {out_dir / (name + '.md')}", flush=True)


class TrainerChunk:
    """The trainer's two programs for a chunk of ``k`` steps that starts on a round boundary.

    ``chunk(state, tokens [N, k, B, T + 1]) -> (state, losses [N, k])`` runs blocks of
    ``min(k, H)`` steps: the inner program for the block's inner steps, the sync program for
    its last step when that ends a round, as ``trainer.loop`` does. ``phase="device"`` runs
    one program with the phase decided on the device instead (``sync_step=None``).

    Args:
      reps: the ``replicas.Replicas``.
      k: steps per chunk.
      sync_every: H, or None for methods without rounds.
      phase: "host" (the trainer) or "device".
      donate: donate the state, as the trainer does (False: call it again on one state).
      **step_kwargs: ``train_step``'s arguments (``grads_fn``, ``tx``, ...).
    """

    def __init__(self, reps: Any, k: int, sync_every: int | None, phase: str = "host",
                 donate: bool = True, **step_kwargs: Any) -> None:  # fmt: skip
        from noloco_jax.trainer.step import make_program  # noqa: PLC0415

        host = phase == "host" and sync_every is not None
        self.k, self.h = k, sync_every
        self.block = min(k, sync_every) if host else k
        self.inner = make_program(reps, sync_step=False if host else None, donate=donate,
                                  **step_kwargs)  # fmt: skip
        self.sync = (make_program(reps, sync_step=True, donate=donate, **step_kwargs) if host
                     else None)  # fmt: skip

    def __call__(self, state: Any, tokens: Any) -> tuple[Any, Any]:
        import jax.numpy as jnp  # noqa: PLC0415

        losses = []
        for b in range(0, self.k, self.block):
            ends = self.sync is not None and (b + self.block) % self.h == 0
            inner = self.block - ends
            # As the trainer does, each program gets only its own batches; no slice for a
            # chunk that is one block (a slice is a device op the trainer does not run).
            whole = b == 0 and inner == self.k
            if inner:  # H = 1: every step is a sync step
                state, out = self.inner(state, tokens if whole else tokens[:, b:b + inner])
                losses.append(out)
            if ends:
                state, out = self.sync(state, tokens[:, b + inner:b + self.block])
                losses.append(out)
        return state, losses[0] if len(losses) == 1 else jnp.concatenate(losses, axis=1)

    def memory(self, state: Any, tokens: Any) -> Any:
        """``memory_analysis()`` of the larger of the two compiled programs."""
        ends = self.sync is not None and self.block % self.h == 0  # as ``__call__`` runs it
        progs = [(self.inner, tokens[:, : self.block - ends])] if self.block - ends else []
        if self.sync is not None:
            progs.append((self.sync, tokens[:, :1]))
        mems = [f.lower(state, t).compile().memory_analysis() for f, t in progs]
        return max(mems, key=lambda m: m.temp_size_in_bytes + m.output_size_in_bytes)


PAPER_VOCAB = 128_002  # the reference code's Llama-3 vocabulary
# Sequences per replica per step in the paper's runs: global batch / DP of Table 2 (small:
# 0.5M tokens over 8 replicas; medium: 1M over 16; large: 2M over 16), 1024 tokens each.
PAPER_BATCH = {"small": 64, "medium": 64, "large": 128, "nano": 4}
CHIPS = {"H100 (80 GiB)": 80 * 2**30, "TPU v5e (16 GiB)": 16 * 2**30}  # memory a run must fit


def paper_settings(size: str, method: str = "noloco", *, num_replicas: int = 1,
                   batch_per_replica: int = 1, seq_len: int = 1024, fsdp: int = 1,
                   tensor: int = 1, remat: bool = False, micro_batches: int = 1
                   ) -> Any:  # fmt: skip
    """The trainer's settings of a paper run (configs/paper.py) on split replicas.

    Args:
      size: a paper size ("small", "medium", "large") or a smaller preset (its
        settings are paper-small's with the preset swapped in).
      method: "noloco", "diloco" or "dp".
      num_replicas: N.
      batch_per_replica: sequences per replica per step.
      seq_len: tokens per sequence.
      fsdp: F, devices each replica's weights split over.
      tensor: T, devices its heads and MLP split over.
      remat: recompute activations in the backward pass.
      micro_batches: slices of the batch per step (gradient accumulation).

    Returns:
      Validated ``TrainSettings`` with ``backend="shard_map"``.
    """
    from configs import paper  # noqa: PLC0415
    from noloco_jax.trainer import settings as st  # noqa: PLC0415

    c = paper.paper_config(size if size in paper._SIZES else "small", method, num_replicas)
    c.model.preset, c.backend = size, "shard_map"
    c.global_batch_size, c.data.seq_len = batch_per_replica * num_replicas, seq_len
    c.mesh.fsdp, c.mesh.tensor, c.model.remat = fsdp, tensor, remat
    c.optim.micro_batches = micro_batches
    return st.from_config(c)
