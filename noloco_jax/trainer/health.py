"""Health of the train state between chunks: divergence, non-finite weights, counters.

The optimizer's non-finite guard repairs a replica at a sync; ``Escalation`` reads its
per-replica counters on the host and stops a run that cannot learn, and refuses to
checkpoint weights the guard will not repair.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax import replicas
from noloco_jax.errors import TrainingDivergedError
from noloco_jax.optim.local_steps import find_local_steps_state
from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.settings import ROUND_METHODS, guard_acts
from noloco_jax.trainer.step import TrainState

__all__ = ["Escalation", "MAX_CONSECUTIVE_RESETS", "check_counter", "check_phase_errors",
           "finite_replicas", "nonfinite_resets", "per_replica_finite", "per_replica_resets",
           "reset_counts"]


def check_counter(state: TrainState, step: int) -> None:
    """Raises ``ValueError`` when a restored optimizer counter is not the run's ``step``."""
    found = find_local_steps_state(state.opt_state)
    if found is None:
        return
    counts = replicas.to_host(found.count)
    if not (counts == step).all():
        raise ValueError(f"the optimizer's step counter {counts} does not match the run's step "
                         f"{step}; the checkpoint's optimizer state is inconsistent.")  # fmt: skip


def check_phase_errors(state: TrainState, step: int) -> None:
    """Every step's phase (inner, sync) as the host ran it agreed with the optimizer's counter."""
    found = find_local_steps_state(state.opt_state)
    if found is not None and replicas.to_host(found.phase_errors).any():
        raise RuntimeError(f"internal error: by step {step} the trainer ran a sync step where the "
                           f"optimizer's counter has none, or the reverse (phase_errors > 0).")


# A replica caught by the guard at this many consecutive syncs stops the run.
MAX_CONSECUTIVE_RESETS = 3


class Escalation:
    """Stops runs that cannot learn, reading the guard's per-replica reset counters.

    Escalates (``TrainingDivergedError``, no checkpoint written) when every
    replica was caught at every sync of a chunk, or one replica at
    ``MAX_CONSECUTIVE_RESETS`` consecutive syncs, counted across chunks (the
    loop reads the counters after each sync program). ``check_savable``
    refuses to checkpoint weights the guard will not repair, so the last
    finite checkpoint is never rotated out.
    """

    def __init__(self, run: Any, state: TrainState, ckpt: Checkpointer) -> None:
        s = run.settings
        self.active = guard_acts(s)  # the optimizer builds the guard on the same rule
        self._ckpt, self._settings = ckpt, s
        self._before = per_replica_resets(state, s.num_replicas)
        kept = run.streak is not None and len(run.streak) == s.num_replicas  # saved, same N
        self.streak = np.asarray(run.streak if kept else [0] * s.num_replicas, np.int64)

    def after_chunk(self, synced: list, stop: int) -> None:
        """``synced``: the counters after each of the chunk's syncs (``reset_counts``), in order."""
        if not self.active or not synced:
            return
        every, worst = True, self.streak
        for counts in synced:
            now = _per_replica(counts, self._settings.num_replicas)
            caught, self._before = now > self._before, now
            every &= caught.all()
            self.streak = np.where(caught, self.streak + 1, 0)
            worst = np.maximum(worst, self.streak)
        if every:
            self._fail(f"every replica's weights were non-finite at the sync(s) up to step {stop}")
        if (worst >= MAX_CONSECUTIVE_RESETS).any():
            i = int(np.argmax(worst))
            self._fail(f"replica {i}'s weights were non-finite at {int(worst[i])} consecutive "
                       f"syncs")  # fmt: skip

    def check_savable(self, state: TrainState, step: int) -> None:
        """Raises instead of checkpointing weights the guard will not put back."""
        found = find_local_steps_state(state.opt_state)
        tree = found.slow_params if (self.active and found is not None) else state.params
        ok = finite_replicas(tree)
        if not ok.all():
            which = "slow weights" if tree is not state.params else "weights"
            self._fail(f"the {which} of replica(s) {np.flatnonzero(~ok).tolist()} are "
                       f"non-finite at step {step}")  # fmt: skip

    def unrepaired(self, state: TrainState, step: int) -> str | None:
        """A warning when, at the run's last step, some replica's fast weights are non-finite:
        the guard repairs them at a sync, and none is left (the last step is not a sync step)."""
        if not self.active:
            return None
        ok = finite_replicas(state.params)
        if ok.all():
            return None
        # A larger num_steps resumes only with a constant schedule (check_resume_compatible).
        extend = ("resuming with a larger num_steps repairs them at the next sync"
                  if self._settings.optim.min_lr_ratio == 1 else
                  "this run cannot be extended to repair them (a larger num_steps resumes only "
                  "with optim.min_lr_ratio=1, a constant schedule)")  # fmt: skip
        return (f"the fast weights of replica(s) {np.flatnonzero(~ok).tolist()} are non-finite "
                f"at the last step {step}, after the last sync: no sync is left to repair them, "
                f"so their evaluation is NaN. Their slow weights are finite and checkpointed; "
                f"{extend}. A run whose num_steps is a multiple of outer.sync_every ends on a "
                f"sync, which repairs them.")

    def _fail(self, what: str) -> None:
        s = self._settings
        kept = self._ckpt.latest_step()
        kept_text = (f"the last checkpoint (step {kept}) is kept" if kept is not None
                     else "no checkpoint was written")  # fmt: skip
        guard = ""
        if not self.active and s.method in ROUND_METHODS and s.num_replicas > 1:
            guard = " or turn on config.fault.nonfinite_guard"
        elif not self.active and s.fault.nonfinite_guard:
            guard = " (the non-finite guard acts for noloco and diloco with 2+ replicas only)"
        elif s.num_stages > 1 and s.routing == "random":
            guard = (". With random routing between stages one replica's NaN reaches every "
                     "replica along the routes, so the guard cannot isolate it; "
                     "config.routing='fixed' keeps replicas apart")  # fmt: skip
        raise TrainingDivergedError(
            f"training diverged: {what}; the run cannot learn and was stopped, {kept_text}. "
            f"Lower config.optim.learning_rate (now {s.optim.learning_rate}), raise optim.eps "
            f"(now {s.optim.eps}) or clip harder{guard}."
        )


def per_replica_resets(state: TrainState, num_replicas: int) -> np.ndarray:
    """[N] float64: how many times the guard has reset each replica so far."""
    found = find_local_steps_state(state.opt_state)
    if found is None:
        return np.zeros(num_replicas)
    return _per_replica(found.nonfinite_resets, num_replicas)


def reset_counts(state: TrainState) -> jax.Array | None:
    """A copy of the guard's reset counters, taken without waiting for the device (the next
    program donates the state); the loop takes one after each sync program."""
    found = find_local_steps_state(state.opt_state)
    return None if found is None else jnp.copy(found.nonfinite_resets)


def _per_replica(counts: Any, num_replicas: int) -> np.ndarray:
    counts = np.asarray(replicas.to_host(counts), np.float64)
    return counts.reshape(num_replicas, -1).max(1)


def finite_replicas(tree: Any) -> np.ndarray:
    """[N] bool on the host: replica i's float leaves of ``tree`` are all finite."""
    return np.stack([replicas.to_host(v) for v in per_replica_finite(tree)]).all(0)


@jax.jit
def per_replica_finite(tree: Any) -> list[jax.Array]:
    """Per float leaf, [N] bool: replica i's values are all finite (leading axis = replica).

    A list, stacked on the host: with a replica split over devices the shardings differ.
    """
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return [jnp.isfinite(x).reshape(x.shape[0], -1).all(1) for x in leaves]


def nonfinite_resets(state: TrainState) -> float:
    """The guard's resets so far, summed over replicas (0 without outer rounds)."""
    found = find_local_steps_state(state.opt_state)
    return float(replicas.to_host(found.nonfinite_resets).sum()) if found is not None else 0.0
