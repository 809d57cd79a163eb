"""The paper's latency model: tree all-reduce against pairwise averaging [NoLoCo §5.3, Fig. 5A].

Only message times count here, no bandwidth. With one message time t_c, a tree
all-reduce (reduce to the root, then broadcast) takes 2·t_c·log2(N) and
pairwise averaging 2·t_c, a ratio of log2(N). With log-normal message times a
tree node waits for the slower of its two children; for two i.i.d. times
E[max(t1, t2)] = (1 + erf(σ/2))·exp(μ + σ²/2) (Eq. 7).
``allreduce_pairwise_ratio`` simulates a whole tree all-reduce and divides by
the cost of pairwise averaging, 2·E[max(t1, t2)]. NumPy only, deterministic
given a seed.
"""

from __future__ import annotations

import math

import numpy as np

from noloco_jax.netsim import checks

__all__ = [
    "paper_allreduce_time",
    "paper_pairwise_time",
    "lognormal_params",
    "expected_max_of_two",
    "expected_max_of_two_mc",
    "simulate_tree_allreduce",
    "allreduce_pairwise_ratio",
]

_MAX_DRAWS_PER_CHUNK = 1 << 22  # bounds the memory of the Monte Carlo loops


def paper_allreduce_time(num_workers: int, message_time: float) -> float:
    """Tree all-reduce time of the paper's Eq. 5, 2·t_c·log2(N).

    Args:
      num_workers: N, an integer >= 2.
      message_time: t_c, the time of one message, > 0.

    Returns:
      2·t_c·log2(N).
    """
    checks.int_at_least("num_workers", num_workers, 2)
    return 2.0 * checks.positive("message_time", message_time) * math.log2(num_workers)


def paper_pairwise_time(message_time: float) -> float:
    """Pairwise (group of two) averaging time of the paper, 2·t_c.

    Args:
      message_time: t_c, > 0.

    Returns:
      2·t_c.
    """
    return 2.0 * checks.positive("message_time", message_time)


def lognormal_params(std_ratio: float, mean: float = 1.0) -> tuple[float, float]:
    """(μ, σ) of the log-normal with the given mean t_c and std/t_c ratio r.

    Args:
      std_ratio: r = std(t)/t_c, >= 0.
      mean: t_c = exp(μ + σ²/2), > 0.

    Returns:
      (μ, σ) with σ² = ln(1 + r²) and μ = ln(t_c) − σ²/2.
    """
    r = checks.non_negative("std_ratio", std_ratio)
    t_c = checks.positive("mean", mean)
    sigma2 = math.log1p(r * r)
    return math.log(t_c) - sigma2 / 2.0, math.sqrt(sigma2)


def expected_max_of_two(mu: float, sigma: float) -> float:
    """E[max(t1, t2)] for i.i.d. t ~ LogNormal(μ, σ²), the paper's Eq. 7.

    Args:
      mu: μ, any finite number.
      sigma: σ >= 0.

    Returns:
      (1 + erf(σ/2))·exp(μ + σ²/2).
    """
    checks.finite("mu", mu)
    s = checks.non_negative("sigma", sigma)
    return (1.0 + math.erf(s / 2.0)) * math.exp(mu + s * s / 2.0)


def expected_max_of_two_mc(
    mu: float, sigma: float, *, num_samples: int = 1_000_000, seed: int = 0
) -> float:
    """Monte Carlo estimate of ``expected_max_of_two``.

    Args:
      mu: μ, finite.
      sigma: σ >= 0.
      num_samples: pairs drawn, >= 1.
      seed: NumPy seed.

    Returns:
      The sample mean of max(t1, t2).
    """
    checks.finite("mu", mu)
    s = checks.non_negative("sigma", sigma)
    n = checks.int_at_least("num_samples", num_samples, 1)
    seed = checks.int_at_least("seed", seed, 0)  # NumPy's message named no argument
    t = np.random.default_rng(seed).lognormal(mu, s, size=(n, 2))
    return float(t.max(axis=1).mean())


def _message_times(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """Log-normal message times of mean 1: exactly 1.0 when σ = 0."""
    if sigma == 0.0:
        return np.ones(shape)
    return np.exp(sigma * rng.standard_normal(shape) - sigma * sigma / 2.0)


def _tree_chunk(
    rng: np.random.Generator, num_workers: int, sigma: float, trials: int
) -> np.ndarray:
    """Tree all-reduce times (mean message time 1) of ``trials`` independent runs."""
    ready = np.zeros((trials, num_workers))
    while ready.shape[1] > 1:  # reduce: a node waits for its slower child's message
        arrive = ready + _message_times(rng, sigma, ready.shape)
        ready = np.maximum(arrive[:, 0::2], arrive[:, 1::2])
    have = ready
    while have.shape[1] < num_workers:  # broadcast: one message per tree edge
        have = np.repeat(have, 2, axis=1)
        have = have + _message_times(rng, sigma, have.shape)
    return have.max(axis=1)


def simulate_tree_allreduce(
    num_workers: int, sigma: float, *, num_trials: int = 10_000, seed: int = 0, mean: float = 1.0
) -> np.ndarray:
    """Monte Carlo times of a binary-tree all-reduce with log-normal message times.

    The N workers are the leaves of a complete binary tree. Going up, a node is
    ready when the slower of its two children's messages has arrived
    (max over children of child ready + message time). Going down, every edge
    carries one message; the all-reduce ends when the last leaf has the result.
    Every message time is drawn independently with mean ``mean`` and log-space
    standard deviation ``sigma``.

    Args:
      num_workers: N, a power of two >= 2.
      sigma: σ >= 0 of the message-time log-normal.
      num_trials: independent all-reduces simulated, >= 1.
      seed: NumPy seed.
      mean: t_c, the mean message time, > 0.

    Returns:
      float array [num_trials] of completion times. With σ = 0 every entry is
      exactly 2·t_c·log2(N) (when t_c = 1).
    """
    n = checks.power_of_two("num_workers", num_workers)
    s = checks.non_negative("sigma", sigma)
    trials = checks.int_at_least("num_trials", num_trials, 1)
    t_c = checks.positive("mean", mean)
    rng = np.random.default_rng(checks.int_at_least("seed", seed, 0))
    per_chunk = max(1, _MAX_DRAWS_PER_CHUNK // (2 * n))
    chunks = [
        _tree_chunk(rng, n, s, min(per_chunk, trials - start))
        for start in range(0, trials, per_chunk)
    ]
    return t_c * np.concatenate(chunks)


def allreduce_pairwise_ratio(
    num_workers: int, std_ratio: float, *, num_trials: int = 10_000, seed: int = 0
) -> tuple[float, float]:
    """E[tree all-reduce] / E[pairwise averaging] against std(t)/t_c (Fig. 5A).

    The numerator is simulated (``simulate_tree_allreduce``); the denominator is
    the paper's pairwise cost 2·E[max(t1, t2)] from the closed form of Eq. 7.
    The ratio does not depend on t_c. At std_ratio = 0 it is exactly log2(N).

    Args:
      num_workers: N, a power of two >= 2.
      std_ratio: r = std(t)/t_c >= 0.
      num_trials: Monte Carlo all-reduces, >= 1.
      seed: NumPy seed.

    Returns:
      (ratio, standard error of the ratio).
    """
    mu, sigma = lognormal_params(std_ratio)
    times = simulate_tree_allreduce(num_workers, sigma, num_trials=num_trials, seed=seed)
    pairwise = 2.0 * expected_max_of_two(mu, sigma)
    stderr = float(times.std(ddof=1) / math.sqrt(times.size)) if times.size > 1 else 0.0
    return float(times.mean() / pairwise), stderr / pairwise
