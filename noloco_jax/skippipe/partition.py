"""Node-to-stage assignment: which nodes hold which stage of the model.

SkipPipe reuses DT-FM's allocation (a genetic algorithm minimising a pipeline
cost) [reference note §1.5]. This is a simpler stand-in: seeded random starts
followed by a swap local search minimising the *pipeline cost*, the sum over
adjacent stages s, s+1 of the cheapest one-to-one matching between their nodes
(link time of one activation message). Stage 0 is the biggest stage: it holds
the embedding and the loss, so every microbatch starts and ends there.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from noloco_jax import errors
from noloco_jax.netsim import checks
from noloco_jax.skippipe.network import Network

__all__ = ["default_stage_sizes", "partition_nodes", "pipeline_cost", "stage_of_nodes"]

Partition = tuple[tuple[int, ...], ...]


def default_stage_sizes(num_nodes: int, num_stages: int) -> tuple[int, ...]:
    """Stage sizes with a bigger stage 0: ``N // S`` nodes per later stage, the rest in stage 0.

    18 nodes / 4 stages -> (6, 4, 4, 4); 20 / 6 -> (5, 3, 3, 3, 3, 3); 42 / 8 ->
    (7, 5, ..., 5), SkipPipe's settings.

    Args:
      num_nodes: N >= num_stages.
      num_stages: S >= 2.

    Returns:
      S sizes summing to N.
    """
    errors.check_int("num_stages", num_stages, 2)
    errors.check_int("num_nodes", num_nodes, num_stages, None)
    base = num_nodes // num_stages
    return (num_nodes - base * (num_stages - 1),) + (base,) * (num_stages - 1)


def _matching_cost(cost: np.ndarray, a: Sequence[int], b: Sequence[int]) -> float:
    sub = cost[np.ix_(a, b)]
    rows, cols = linear_sum_assignment(sub)
    return float(sub[rows, cols].sum())


def pipeline_cost(partition: Partition, cost: np.ndarray) -> float:
    """Sum over adjacent stages of the cheapest matching between their nodes.

    Args:
      partition: node ids of each stage.
      cost: (N, N) link times.

    Returns:
      The cost in seconds.
    """
    return sum(_matching_cost(cost, partition[s], partition[s + 1])
               for s in range(len(partition) - 1))  # fmt: skip


def _local_search(stage: np.ndarray, sizes: Sequence[int], cost: np.ndarray,
                  max_sweeps: int) -> tuple[float, np.ndarray]:  # fmt: skip
    def groups(st):
        return tuple(tuple(int(n) for n in np.flatnonzero(st == s)) for s in range(len(sizes)))

    best = pipeline_cost(groups(stage), cost)
    n = len(stage)
    for _ in range(max_sweeps):
        improved = False
        for i in range(n):
            for j in range(i + 1, n):
                if stage[i] == stage[j]:
                    continue
                stage[i], stage[j] = stage[j], stage[i]
                c = pipeline_cost(groups(stage), cost)
                if c < best - 1e-12:
                    best, improved = c, True
                else:
                    stage[i], stage[j] = stage[j], stage[i]
        if not improved:
            break
    return best, stage


def partition_nodes(network: Network, stage_sizes: Sequence[int], *, message_bytes: float,
                    seed: int = 0, restarts: int = 2,
                    max_sweeps: int = 3) -> Partition:  # fmt: skip
    """Assigns nodes to stages, minimising ``pipeline_cost`` by swap local search.

    Args:
      network: the ``Network``.
      stage_sizes: nodes per stage (stage 0 first), summing to N.
      message_bytes: activation bytes per message, for the link times.
      seed: seed of the random starts; the result is a pure function of it.
      restarts: random starts (the best result is kept), >= 1.
      max_sweeps: passes over all node pairs per start, >= 0.

    Returns:
      Node ids of each stage, each tuple sorted.
    """
    sizes = [errors.check_int(f"stage_sizes[{k}]", s) for k, s in enumerate(stage_sizes)]
    if len(sizes) < 2:
        raise ValueError(f"stage_sizes must be >= 2 sizes, each >= 1, got {sizes}")
    if sum(sizes) != network.num_nodes:
        raise ValueError(f"stage_sizes must sum to num_nodes={network.num_nodes}, got {sum(sizes)}")
    errors.check_int("restarts", restarts)
    errors.check_int("max_sweeps", max_sweeps, 0)
    errors.check_int("seed", seed, 0)  # NumPy's message named no argument
    cost = network.cost_matrix(checks.non_negative("message_bytes", message_bytes))
    rng = np.random.default_rng(seed)
    base = np.repeat(np.arange(len(sizes)), sizes)
    best = None
    for _ in range(restarts):
        c, stage = _local_search(rng.permutation(base), sizes, cost, max_sweeps)
        if best is None or c < best[0] - 1e-12:
            best = (c, stage.copy())
    stage = best[1]
    return tuple(tuple(int(n) for n in np.flatnonzero(stage == s)) for s in range(len(sizes)))


def stage_of_nodes(partition: Partition) -> tuple[int, ...]:
    """Stage of each node, indexed by node id (nodes 0..N-1, each in exactly one stage)."""
    out = {int(n): s for s, nodes in enumerate(partition) for n in nodes}
    if sorted(int(n) for nodes in partition for n in nodes) != list(range(len(out))):
        raise ValueError(f"partition must place each of the nodes 0..N-1 in exactly one stage, "
                         f"got {partition}")  # fmt: skip
    return tuple(out[n] for n in range(len(out)))
