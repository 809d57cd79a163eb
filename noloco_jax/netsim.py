"""How long a sync takes: the paper's latency model and a bandwidth + latency model.

Three parts, all NumPy (no JAX except for byte counts) and deterministic given a seed.

1. The paper's latency model [NoLoCo §5.3, Fig. 5A]. With one message time
   t_c, a tree all-reduce (reduce to the root, then broadcast) takes
   2·t_c·log2(N) and pairwise averaging 2·t_c, a ratio of log2(N). With
   log-normal message times a tree node waits for the slower of its two
   children; for two i.i.d. times E[max(t1, t2)] = (1 + erf(σ/2))·exp(μ + σ²/2)
   (Eq. 7). ``allreduce_pairwise_ratio`` simulates a whole tree all-reduce and
   divides by the cost of pairwise averaging, 2·E[max(t1, t2)].
2. Global blocking [Fig. 5B]. Workers' inner-step compute times are
   i.i.d. log-normal; DiLoCo barriers all N workers every H steps, NoLoCo only
   makes each random pair wait for its slower member. Communication time is
   ignored. ``simulate_global_blocking`` returns both total times.
3. Beyond the paper: a ``Link`` with bandwidth and latency, the time of one
   ring / tree all-reduce or NoLoCo group exchange, and ``sync_report``, which
   answers "P parameters, N replicas, a link of B Gbit/s and L ms: how long does
   each method's sync take, and what fraction of wall time is communication?"
   The same report is printed by ``python -m noloco_jax.netsim``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any, Sequence

import numpy as np

__all__ = [
    "Link",
    "DATACENTER",
    "INTERNET",
    "paper_allreduce_time",
    "paper_pairwise_time",
    "lognormal_params",
    "expected_max_of_two",
    "expected_max_of_two_mc",
    "simulate_tree_allreduce",
    "allreduce_pairwise_ratio",
    "simulate_global_blocking",
    "ring_allreduce_time",
    "tree_allreduce_time",
    "group_exchange_time",
    "sync_report",
    "streaming_sync",
    "report_markdown",
    "main",
]

METHODS = ("dp", "diloco", "noloco")
ALLREDUCE_ALGORITHMS = ("ring", "tree")
_DTYPE_BY_BYTES = {1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}
_MAX_DRAWS_PER_CHUNK = 1 << 22  # bounds the memory of the Monte Carlo loops


# --------------------------------------------------------------------------- validation


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and > 0, got {value!r}.")
    return float(value)


def _non_negative(name: str, value: float) -> float:
    if not (isinstance(value, (int, float, np.integer, np.floating)) and value >= 0):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}.")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}.")
    return float(value)


def _int_at_least(name: str, value: int, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}.")
    return int(value)


def _power_of_two(name: str, value: int) -> int:
    value = _int_at_least(name, value, 2)
    if value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 2, got {value}.")
    return value


def _groups_divide(name: str, num_replicas: int, group_size: int) -> None:
    _int_at_least("group_size", group_size, 2)
    if num_replicas % group_size:
        raise ValueError(
            f"{name} must be a multiple of group_size={group_size} (>= {group_size}), "
            f"got {num_replicas}."
        )


# --------------------------------------------------------------------------- 1. paper model


def paper_allreduce_time(num_workers: int, message_time: float) -> float:
    """Tree all-reduce time of the paper's Eq. 5, 2·t_c·log2(N).

    Args:
      num_workers: N, an integer >= 2.
      message_time: t_c, the time of one message, > 0.

    Returns:
      2·t_c·log2(N).
    """
    _int_at_least("num_workers", num_workers, 2)
    return 2.0 * _positive("message_time", message_time) * math.log2(num_workers)


def paper_pairwise_time(message_time: float) -> float:
    """Pairwise (group of two) averaging time of the paper, 2·t_c.

    Args:
      message_time: t_c, > 0.

    Returns:
      2·t_c.
    """
    return 2.0 * _positive("message_time", message_time)


def lognormal_params(std_ratio: float, mean: float = 1.0) -> tuple[float, float]:
    """(μ, σ) of the log-normal with the given mean t_c and std/t_c ratio r.

    Args:
      std_ratio: r = std(t)/t_c, >= 0.
      mean: t_c = exp(μ + σ²/2), > 0.

    Returns:
      (μ, σ) with σ² = ln(1 + r²) and μ = ln(t_c) − σ²/2.
    """
    r = _non_negative("std_ratio", std_ratio)
    t_c = _positive("mean", mean)
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
    if not math.isfinite(mu):
        raise ValueError(f"mu must be a finite number, got {mu!r}.")
    s = _non_negative("sigma", sigma)
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
    if not math.isfinite(mu):
        raise ValueError(f"mu must be a finite number, got {mu!r}.")
    s = _non_negative("sigma", sigma)
    n = _int_at_least("num_samples", num_samples, 1)
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
    n = _power_of_two("num_workers", num_workers)
    s = _non_negative("sigma", sigma)
    trials = _int_at_least("num_trials", num_trials, 1)
    t_c = _positive("mean", mean)
    rng = np.random.default_rng(seed)
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


# --------------------------------------------------------------------------- 2. global blocking


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
    group_size: int, sigma2: float,
) -> None:
    _int_at_least("num_workers", num_workers, 2)
    _int_at_least("inner_steps", inner_steps, 1)
    for name, h in (("diloco_sync_every", diloco_sync_every),
                    ("noloco_sync_every", noloco_sync_every)):
        _int_at_least(name, h, 1)
        if inner_steps % h:
            raise ValueError(
                f"{name} must divide inner_steps={inner_steps} (1 <= {name} <= "
                f"{inner_steps}), got {h}."
            )
    _groups_divide("num_workers", num_workers, group_size)
    _non_negative("sigma2", sigma2)


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
        num_workers, inner_steps, diloco_sync_every, noloco_sync_every, group_size, sigma2
    )
    _int_at_least("num_trials", num_trials, 1)
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


# --------------------------------------------------------------------------- 3. links


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point network link, the same for every pair of replicas.

    Attributes:
      bandwidth_gbps: bandwidth in Gbit/s (1e9 bits per second), > 0, per
        direction (links are full duplex).
      latency_ms: one-way latency of one message in milliseconds, >= 0.
    """

    bandwidth_gbps: float
    latency_ms: float

    def __post_init__(self) -> None:
        _positive("bandwidth_gbps", self.bandwidth_gbps)
        _non_negative("latency_ms", self.latency_ms)

    @property
    def bytes_per_second(self) -> float:
        """Bandwidth in bytes per second."""
        return self.bandwidth_gbps * 1e9 / 8.0

    @property
    def latency_s(self) -> float:
        """Latency in seconds."""
        return self.latency_ms / 1e3


DATACENTER = Link(bandwidth_gbps=100.0, latency_ms=0.01)
INTERNET = Link(bandwidth_gbps=1.0, latency_ms=50.0)


def ring_allreduce_time(num_bytes: float, num_replicas: int, link: Link) -> float:
    """Time of a ring all-reduce of a ``num_bytes`` buffer.

    Reduce-scatter then all-gather: 2(N − 1) sequential hops of latency, and
    2(N − 1)/N · num_bytes sent by every replica.

    Args:
      num_bytes: size of the buffer being reduced, >= 0.
      num_replicas: N >= 2.
      link: the link between neighbours.

    Returns:
      Seconds.
    """
    b = _non_negative("num_bytes", num_bytes)
    n = _int_at_least("num_replicas", num_replicas, 2)
    hops = 2 * (n - 1)
    return hops * link.latency_s + hops / n * b / link.bytes_per_second


def tree_allreduce_time(num_bytes: float, num_replicas: int, link: Link) -> float:
    """Time of a binary-tree all-reduce (reduce to the root, then broadcast).

    2·ceil(log2 N) sequential hops, each carrying the whole buffer.

    Args:
      num_bytes: size of the buffer being reduced, >= 0.
      num_replicas: N >= 2.
      link: the link between tree neighbours.

    Returns:
      Seconds.
    """
    b = _non_negative("num_bytes", num_bytes)
    n = _int_at_least("num_replicas", num_replicas, 2)
    hops = 2 * math.ceil(math.log2(n))
    return hops * (link.latency_s + b / link.bytes_per_second)


def group_exchange_time(num_bytes_sent: float, link: Link, *, group_size: int = 2) -> float:
    """Time of one NoLoCo group exchange.

    ``exchange_steps(n)`` sequential messages (butterfly for powers of two,
    n − 1 shifts otherwise), each paying the latency once. Links are full
    duplex, so sending and receiving overlap and the transfer time is the
    replica's sent bytes over the bandwidth.

    Args:
      num_bytes_sent: bytes one replica sends in the exchange (all messages
        together, as ``comm.noloco_bytes_per_sync`` reports), >= 0.
      link: the link between group members.
      group_size: n >= 2.

    Returns:
      Seconds.
    """
    from noloco_jax import comm

    b = _non_negative("num_bytes_sent", num_bytes_sent)
    n = _int_at_least("group_size", group_size, 2)
    return comm.exchange_steps(n) * link.latency_s + b / link.bytes_per_second


# --------------------------------------------------------------------------- report


def _wire_dtype(bytes_per_param: int) -> Any:
    """The JAX dtype of ``bytes_per_param`` bytes (bfloat16 for 2, as in the paper)."""
    import jax.numpy as jnp

    return jnp.dtype(_DTYPE_BY_BYTES[bytes_per_param])


def _params_tree(num_params: int, bytes_per_param: int) -> Any:
    """One flat parameter vector as a ``jax.ShapeDtypeStruct`` (nothing is allocated)."""
    import jax

    return jax.ShapeDtypeStruct((num_params,), _wire_dtype(bytes_per_param))


def _bytes_per_param(name: str, value: int) -> int:
    if isinstance(value, bool) or value not in _DTYPE_BY_BYTES:
        raise ValueError(f"{name} must be one of {sorted(_DTYPE_BY_BYTES)}, got {value!r}.")
    return int(value)


def _num_params(value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"num_params must be a whole number >= 1, got {value!r}.")
    if not (math.isfinite(value) and value >= 1 and float(value).is_integer()):
        raise ValueError(f"num_params must be a whole number >= 1, got {value!r}.")
    return int(value)


def _allreduce_time(algorithm: str, num_bytes: float, num_replicas: int, link: Link) -> float:
    if algorithm == "ring":
        return ring_allreduce_time(num_bytes, num_replicas, link)
    return tree_allreduce_time(num_bytes, num_replicas, link)


def _row(method: str, sync_every: int, num_bytes: float, sync_s: float, step_s: float) -> dict:
    comm_s = sync_s / sync_every
    return {
        "method": method,
        "sync_every": sync_every,
        "bytes_per_sync": float(num_bytes),
        "sync_time_s": sync_s,
        "syncs_per_step": 1.0 / sync_every,
        "comm_per_step_s": comm_s,
        "compute_per_step_s": step_s,
        "comm_fraction": comm_s / (step_s + comm_s),
    }


def sync_report(
    num_params: float,
    num_replicas: int,
    link: Link,
    *,
    step_time_s: float,
    noloco_sync_every: int = 50,
    diloco_sync_every: int = 100,
    bytes_per_param: int = 4,
    group_size: int = 2,
    gamma_equals_beta: bool = True,
    exchange_bytes_per_param: int | None = None,
    allreduce: str = "ring",
) -> list[dict[str, Any]]:
    """Sync time and communication share of data parallel, DiLoCo and NoLoCo.

    Bytes come from ``noloco_jax.comm`` applied to a ``jax.ShapeDtypeStruct``
    of ``num_params`` parameters, so they are the ones the optimizers report.
    Data parallel all-reduces the gradients every inner step, DiLoCo the outer
    gradient every ``diloco_sync_every`` steps (both with ``allreduce``), and
    NoLoCo runs one group exchange every ``noloco_sync_every`` steps.
    Communication is assumed not to overlap compute.

    Args:
      num_params: P, a whole number >= 1.
      num_replicas: N >= 2, a multiple of ``group_size``.
      link: the link between any two replicas.
      step_time_s: compute time of one inner step per replica, > 0.
      noloco_sync_every: H of NoLoCo, >= 1.
      diloco_sync_every: H of DiLoCo, >= 1.
      bytes_per_param: bytes of one parameter and gradient, one of 1, 2, 4, 8.
      group_size: NoLoCo group size n >= 2.
      gamma_equals_beta: NoLoCo with γ = β sends only the fast weights.
      exchange_bytes_per_param: NoLoCo's bytes per parameter on the wire
        (``exchange_dtype``); ``None`` means ``bytes_per_param``.
      allreduce: "ring" or "tree", the all-reduce of data parallel and DiLoCo.

    Returns:
      One dict per method ("dp", "diloco", "noloco") with keys method,
      sync_every, bytes_per_sync (bytes one replica sends per sync; for the
      all-reduces the ring count ``comm.allreduce_bytes_per_replica``, also
      with ``allreduce="tree"``, where only the time changes), sync_time_s,
      syncs_per_step, comm_per_step_s, compute_per_step_s and comm_fraction
      = comm / (compute + comm) per inner step.
    """
    from noloco_jax import comm

    p = _num_params(num_params)
    n = _int_at_least("num_replicas", num_replicas, 2)
    _groups_divide("num_replicas", n, group_size)
    step_s = _positive("step_time_s", step_time_s)
    h_noloco = _int_at_least("noloco_sync_every", noloco_sync_every, 1)
    h_diloco = _int_at_least("diloco_sync_every", diloco_sync_every, 1)
    bpp = _bytes_per_param("bytes_per_param", bytes_per_param)
    xbpp = bpp if exchange_bytes_per_param is None else exchange_bytes_per_param
    xbpp = _bytes_per_param("exchange_bytes_per_param", xbpp)
    if allreduce not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_ALGORITHMS}, got {allreduce!r}.")

    tree = _params_tree(p, bpp)
    ar_bytes = comm.allreduce_bytes_per_replica(tree, n)
    ar_time = _allreduce_time(allreduce, p * bpp, n, link)
    nl_bytes = comm.noloco_bytes_per_sync(
        tree, group_size=group_size, gamma_equals_beta=gamma_equals_beta,
        exchange_dtype=_wire_dtype(xbpp),
    )
    nl_time = group_exchange_time(nl_bytes, link, group_size=group_size)
    return [
        _row("dp", 1, ar_bytes, ar_time, step_s),
        _row("diloco", h_diloco, ar_bytes, ar_time, step_s),
        _row("noloco", h_noloco, nl_bytes, nl_time, step_s),
    ]


def streaming_sync(
    num_params: float,
    link: Link,
    *,
    step_time_s: float,
    sync_every: int = 50,
    fragments: int = 1,
    delay_steps: int = 0,
    exchange: str = "float32",
    group_size: int = 2,
) -> dict[str, Any]:
    """One NoLoCo replica's communication with streaming fragments, overlap and 8-bit exchange.

    Every H / P steps one fragment (1/P of the parameters) is exchanged; with an
    overlap of ``delay_steps`` inner steps the exchange runs behind that many
    steps of compute, so only what does not fit there stalls the replica.

    Args:
      num_params: parameters of the model, a whole number >= 1.
      link: the link between group members.
      step_time_s: compute time of one inner step, > 0.
      sync_every: H, >= 1, a multiple of ``fragments``.
      fragments: P >= 1.
      delay_steps: tau, 0 <= tau < H / P (the next fragment's exchange must not
        start before this one is applied).
      exchange: "float32", "bfloat16", "int8" or "float8_e4m3fn" on the wire
        (the 8-bit formats with a float32 scale per ``quantize.BLOCK`` values).
      group_size: n >= 2.

    Returns:
      A dict with bytes_per_sync (one fragment), sync_time_s, peak_gbps (the
      bandwidth one exchange uses), exposed_per_step_s (stall per inner step,
      amortized), comm_fraction (stall / (compute + stall)) and
      hidden_above_gbps (the bandwidth above which the overlap hides the
      exchange completely; inf without overlap, nan when even an infinite
      bandwidth cannot because of latency).
    """
    from noloco_jax import comm, quantize

    p = _num_params(num_params)
    step_s = _positive("step_time_s", step_time_s)
    h = _int_at_least("sync_every", sync_every, 1)
    frags = _int_at_least("fragments", fragments, 1)
    if h % frags:
        raise ValueError(f"fragments={frags} must divide sync_every={h}.")
    stride = h // frags
    tau = _int_at_least("delay_steps", delay_steps, 0)
    if tau >= stride:
        raise ValueError(f"delay_steps={tau} must be < sync_every / fragments = {stride}.")
    if exchange not in ("float32", "bfloat16", *quantize.FORMATS):
        raise ValueError(f"exchange must be float32, bfloat16, int8 or float8_e4m3fn, "
                         f"got {exchange!r}.")  # fmt: skip
    wire = exchange if quantize.is_codec(exchange) else _wire_dtype({"float32": 4,
                                                                    "bfloat16": 2}[exchange])
    fragment = _params_tree(-(-p // frags), 4)
    nbytes = comm.noloco_bytes_per_sync(fragment, group_size=group_size, exchange_dtype=wire)
    sync_s = group_exchange_time(nbytes, link, group_size=group_size)
    exposed = max(0.0, sync_s - tau * step_s)
    per_step = exposed / stride
    latency = comm.exchange_steps(group_size) * link.latency_s
    if tau == 0:
        hidden = math.inf
    elif latency >= tau * step_s:
        hidden = math.nan
    else:
        hidden = nbytes * 8 / (tau * step_s - latency) / 1e9
    return {
        "fragments": frags, "delay_steps": tau, "exchange": exchange,
        "bytes_per_sync": float(nbytes), "sync_time_s": sync_s,
        "exposed_per_step_s": per_step, "comm_fraction": per_step / (step_s + per_step),
        "hidden_above_gbps": hidden,
    }  # fmt: skip


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


def report_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of ``sync_report`` rows.

    Args:
      rows: the list ``sync_report`` returns.

    Returns:
      A markdown table, one line per method.
    """
    head = (
        "| method | sync every (steps) | MB sent / replica / sync | sync time (s) "
        "| comm / inner step (s) | compute / inner step (s) | comm fraction |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['sync_every']} | {_fmt(r['bytes_per_sync'] / 1e6)} "
            f"| {_fmt(r['sync_time_s'])} | {_fmt(r['comm_per_step_s'])} "
            f"| {_fmt(r['compute_per_step_s'])} | {r['comm_fraction']:.1%} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m noloco_jax.netsim",
        description="Sync time and communication share of data parallel, DiLoCo and NoLoCo "
        "for a model of P parameters on N replicas over one link (no compute/comm overlap).",
    )
    add = parser.add_argument
    add("--params", type=float, required=True, help="number of parameters P, e.g. 125e6")
    add("--replicas", type=int, required=True, help="number of replicas N (>= 2)")
    add("--bandwidth-gbps", type=float, required=True, help="link bandwidth in Gbit/s")
    add("--latency-ms", type=float, required=True, help="one-way message latency in ms")
    add("--step-time", type=float, required=True, help="compute time of one inner step (s)")
    add("--bytes-per-param", type=int, default=4, help="bytes per parameter (1, 2, 4, 8)")
    add("--group-size", type=int, default=2, help="NoLoCo group size n")
    add("--exchange-bytes-per-param", type=int, default=None,
        help="bytes per parameter NoLoCo sends (default: --bytes-per-param)")
    add("--noloco-sync-every", type=int, default=50, help="NoLoCo inner steps per sync")
    add("--diloco-sync-every", type=int, default=100, help="DiLoCo inner steps per sync")
    add("--allreduce", choices=ALLREDUCE_ALGORITHMS, default="ring",
        help="all-reduce algorithm of DP and DiLoCo")
    add("--gamma-differs", action="store_true",
        help="NoLoCo with gamma != beta (slow weights travel too: twice the bytes)")
    return parser


def _check_cli(args: argparse.Namespace) -> None:
    """Checks the command-line values, naming the flag in each error."""
    for flag in ("params", "bandwidth_gbps", "step_time"):
        _positive("--" + flag.replace("_", "-"), getattr(args, flag))
    _non_negative("--latency-ms", args.latency_ms)
    for flag in ("replicas", "group_size"):
        _int_at_least("--" + flag.replace("_", "-"), getattr(args, flag), 2)
    if args.replicas % args.group_size:
        raise ValueError(
            f"--replicas must be a multiple of --group-size={args.group_size}, "
            f"got {args.replicas}."
        )
    if not float(args.params).is_integer():
        raise ValueError(f"--params must be a whole number >= 1, got {args.params!r}.")
    for flag in ("noloco_sync_every", "diloco_sync_every"):
        _int_at_least("--" + flag.replace("_", "-"), getattr(args, flag), 1)
    _bytes_per_param("--bytes-per-param", args.bytes_per_param)
    if args.exchange_bytes_per_param is not None:
        _bytes_per_param("--exchange-bytes-per-param", args.exchange_bytes_per_param)


def main(argv: Sequence[str] | None = None) -> int:
    """Prints the ``sync_report`` table for the command-line arguments.

    Args:
      argv: arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
      0 on success.

    Raises:
      ValueError: naming the flag, when a value is out of range.
    """
    args = _parser().parse_args(argv)
    _check_cli(args)
    link = Link(bandwidth_gbps=args.bandwidth_gbps, latency_ms=args.latency_ms)
    rows = sync_report(
        args.params, args.replicas, link,
        step_time_s=args.step_time,
        noloco_sync_every=args.noloco_sync_every,
        diloco_sync_every=args.diloco_sync_every,
        bytes_per_param=args.bytes_per_param,
        group_size=args.group_size,
        gamma_equals_beta=not args.gamma_differs,
        exchange_bytes_per_param=args.exchange_bytes_per_param,
        allreduce=args.allreduce,
    )
    print(
        f"P = {args.params:.4g} parameters, N = {args.replicas} replicas, link "
        f"{args.bandwidth_gbps:g} Gbit/s and {args.latency_ms:g} ms, {args.allreduce} "
        f"all-reduce, {args.step_time:g} s compute per inner step:\n"
    )
    print(report_markdown(rows))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
