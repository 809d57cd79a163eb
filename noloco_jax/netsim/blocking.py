"""Global blocking: how long slow workers hold the others up [NoLoCo Fig. 5B].

Workers' inner-step compute times are i.i.d. log-normal. DiLoCo barriers all
N workers every H steps; NoLoCo only makes each random group wait for its
slowest member. Communication time is ignored. NumPy only, deterministic given
a seed.
"""

from __future__ import annotations

import math

import numpy as np

from noloco_jax.netsim import checks

__all__ = ["simulate_global_blocking"]


def _barrier(clocks: np.ndarray) -> None:
    """DiLoCo: every worker of a trial waits for the slowest one (in place)."""
    clocks[:] = clocks.max(axis=1, keepdims=True)


def _group_wait(clocks: np.ndarray, rng: np.random.Generator, group_size: int) -> None:
    """NoLoCo: fresh random groups; each group waits for its slowest member (in place)."""
    trials, n = clocks.shape
    perm = rng.permuted(np.broadcast_to(np.arange(n), (trials, n)), axis=1)
    grouped = np.take_along_axis(clocks, perm, axis=1).reshape(trials, n // group_size, group_size)
    slowest = np.repeat(grouped.max(axis=2), group_size, axis=1)
    np.put_along_axis(clocks, perm, slowest, axis=1)


def _check_blocking_args(
    num_workers: int, inner_steps: int, diloco_sync_every: int, noloco_sync_every: int,
    group_size: int, sigma2: float, mu: float,
) -> None:
    checks.int_at_least("num_workers", num_workers, 2)
    checks.int_at_least("inner_steps", inner_steps, 1)
    for name, h in (("diloco_sync_every", diloco_sync_every),
                    ("noloco_sync_every", noloco_sync_every)):
        checks.int_at_least(name, h, 1)
        if inner_steps % h:
            raise ValueError(
                f"{name} must divide inner_steps={inner_steps} (1 <= {name} <= "
                f"{inner_steps}), got {h}."
            )
    checks.groups_divide("num_workers", num_workers, group_size)
    checks.non_negative("sigma2", sigma2)
    checks.finite("mu", mu)


def simulate_global_blocking(
    num_workers: int,
    inner_steps: int,
    *,
    diloco_sync_every: int = 100,
    noloco_sync_every: int = 100,
    group_size: int = 2,
    num_trials: int = 1,
    mu: float = 1.0,
    sigma2: float = 0.5,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Total training time of DiLoCo and NoLoCo when slow workers block others (Fig. 5B).

    Every worker's inner-step compute time is i.i.d. LogNormal(μ, σ²) per worker
    per step; communication takes no time. Each worker keeps its own clock.
    DiLoCo sets all clocks to their maximum every ``diloco_sync_every`` steps.
    NoLoCo draws a fresh uniformly random partition into groups of
    ``group_size`` every ``noloco_sync_every`` steps and sets each group's
    clocks to the group maximum. A run ends when the slowest clock stops.
    Both methods see the same compute times (common random numbers), which
    makes their ratio less noisy.

    Args:
      num_workers: N >= 2, a multiple of ``group_size``.
      inner_steps: total inner steps per worker; both sync intervals divide it
        (R = inner_steps / H outer steps).
      diloco_sync_every: H of DiLoCo, >= 1.
      noloco_sync_every: H of NoLoCo, >= 1.
      group_size: n >= 2 of NoLoCo.
      num_trials: independent runs, >= 1.
      mu: μ of the log-normal step time.
      sigma2: σ² >= 0 of the log-normal step time.
      seed: NumPy seed.

    Returns:
      {"diloco": times [num_trials], "noloco": times [num_trials],
       "ratio": diloco / noloco [num_trials]}.
    """
    _check_blocking_args(
        num_workers, inner_steps, diloco_sync_every, noloco_sync_every, group_size, sigma2, mu
    )
    checks.int_at_least("num_trials", num_trials, 1)
    checks.int_at_least("seed", seed, 0)  # NumPy's message named no argument
    step_rng, group_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    chunk = math.gcd(diloco_sync_every, noloco_sync_every)
    diloco = np.zeros((num_trials, num_workers))
    noloco = np.zeros((num_trials, num_workers))
    for done in range(chunk, inner_steps + 1, chunk):
        work = step_rng.lognormal(mu, math.sqrt(sigma2), (num_trials, num_workers, chunk))
        work = work.sum(axis=2)
        diloco += work
        noloco += work
        if done % diloco_sync_every == 0:
            _barrier(diloco)
        if done % noloco_sync_every == 0:
            _group_wait(noloco, group_rng, group_size)
    d, n = diloco.max(axis=1), noloco.max(axis=1)
    return {"diloco": d, "noloco": n, "ratio": d / n}
