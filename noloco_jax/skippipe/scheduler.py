"""Microbatch path schedules: the full pipeline, cost-agnostic skipping and SkipPipe.

Every stage-0 node ("head") sends ``microbatches`` microbatches; each is an
*agent* that needs a closed node path obeying the ``PathRules``. Four schedules
(reference note §1.5):

* ``"full"`` (DT-FM-like): chains of one node per stage, built by cheapest
  matchings between adjacent stages; the same total number of microbatches is
  spread over the chains, each visiting all S stages.
* ``"skip_agnostic"`` (DT-FM skip): feasible skip paths chosen at random
  (seeded), i.e. with unit costs: the load caps hold, the network is ignored.
* ``"skippipe_no_tc2"``: prioritised planning of the cheapest path per agent
  (links + compute, as if alone on the network) under the load caps.
* ``"skippipe"``: the same with collision avoidance (TC2): agents are planned
  one after another against a reservation table, so a node never runs two
  planned tasks at once and a path that would wait at a busy node is costed
  with that wait. Several priority orders are tried (the first round-robin,
  the rest seeded shuffles) until ``max_restarts`` or ``time_limit_s``; the
  one with the lowest simulated iteration time is kept.

Load caps (SkipPipe's CBS conflict types 1 and 2): a non-first node serves at
most ``memory`` microbatches per iteration, and a later stage at most
``stage_cap`` (default: the largest later stage's size x ``memory``). The node cap makes every skip
schedule deadlock-free in the simulator. A look-ahead keeps enough spare
capacity for the agents still to be planned (a 0/1 matrix with row sums L-1
and column sums <= c_s exists iff sum_s min(c_s, r) >= r (L-1) for r rows).

The result is a pure function of the inputs and ``seed`` as long as
``max_restarts``, not ``time_limit_s``, ends the search.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np
from scipy.optimize import linear_sum_assignment

from noloco_jax import errors
from noloco_jax.netsim import checks
from noloco_jax.skippipe import simulator
from noloco_jax.skippipe.network import Network
from noloco_jax.skippipe.partition import Partition, stage_of_nodes
from noloco_jax.skippipe.paths import PathRules, valid_stage_paths

__all__ = ["SCHEDULES", "Interval", "Schedule", "make_schedule", "full_pipeline_chains"]

SCHEDULES = ("full", "skip_agnostic", "skippipe_no_tc2", "skippipe")


# A task the planner expects a node to run: the same record as a simulated task.
Interval = simulator.TraceEvent


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Paths of one iteration's microbatches.

    Attributes:
      kind: one of ``SCHEDULES``.
      partition: node ids of each stage.
      paths: closed node path ``(head, ..., head)`` of each microbatch.
      stage_paths: stage sequence ``(0, s1, ...)`` of each microbatch.
      planned: the planner's expected task intervals (``skippipe``: with
        collision avoidance; ``skippipe_no_tc2``: each agent as if alone;
        empty for the others).
      node_cap: most microbatches a non-first node serves (skip schedules).
      stage_cap: most microbatches a later stage serves (skip schedules).
      restarts: priority orders tried.
      runtime_s: wall time of the scheduler (not deterministic).
    """

    kind: str
    partition: Partition
    paths: tuple[tuple[int, ...], ...]
    stage_paths: tuple[tuple[int, ...], ...]
    planned: tuple[Interval, ...]
    node_cap: int
    stage_cap: int
    restarts: int
    runtime_s: float


def _fit(reserved: list[tuple[float, float]], ready: float, duration: float) -> float:
    """Earliest start >= ready of a task that overlaps no reserved interval."""
    t = ready
    for s, e in reserved:
        if e <= t + 1e-12:
            continue
        if s >= t + duration - 1e-12:
            break
        t = e
    return t


@dataclasses.dataclass
class _Problem:
    network: Network
    partition: Partition
    rules: PathRules
    memory: int
    message_bytes: float
    stage_cap: int

    def __post_init__(self) -> None:
        self.cost = self.network.cost_matrix(self.message_bytes)
        self.w = self.network.compute_s
        self.stage_of = stage_of_nodes(self.partition)
        self.seqs = valid_stage_paths(self.rules)
        self.members = [np.asarray(p) for p in self.partition]

    def walk(self, mb: int, path: Sequence[int], reserved: list | None) -> list[Interval]:
        """Task intervals of one closed path, fitted around ``reserved`` (None: alone)."""
        tasks = simulator.path_tasks(path)
        factor = {"forward": 1.0, "loss": simulator.LOSS_FACTOR,
                  "backward": simulator.BACKWARD_FACTOR}  # fmt: skip
        out, t, prev = [], 0.0, path[0]
        for node, kind in tasks:
            ready = t + self.cost[prev, node]
            d = self.w[node] * factor[kind]
            start = ready if reserved is None else _fit(reserved[node], ready, d)
            out.append(Interval(node, mb, kind, start, start + d))
            t, prev = start + d, node
        return out


class _Loads:
    """Stage and node loads of the agents planned so far, with the look-ahead test."""

    def __init__(self, prob: _Problem, num_agents: int) -> None:
        self.prob = prob
        self.stage = np.zeros(prob.rules.num_stages, dtype=int)
        self.node = np.zeros(prob.network.num_nodes, dtype=int)
        self.left = num_agents

    def spare(self) -> np.ndarray:
        p = self.prob
        free = np.maximum(p.memory - self.node, 0)
        out = np.array([min(p.stage_cap - self.stage[s], free[p.members[s]].sum())
                        for s in range(p.rules.num_stages)])  # fmt: skip
        out[0] = 0
        return out

    def candidates(self, lookahead: bool) -> list[tuple[int, ...]]:
        spare = self.spare()
        r, k = self.left - 1, self.prob.rules.path_length - 1
        out = []
        for seq in self.prob.seqs:
            if any(spare[s] < 1 for s in seq[1:]):
                continue
            if lookahead:
                after = spare.copy()
                after[list(seq[1:])] -= 1
                if np.minimum(after, r).sum() < r * k:
                    continue
            out.append(seq)
        return out

    def free_nodes(self, stage: int) -> np.ndarray:
        nodes = self.prob.members[stage]
        return nodes[self.node[nodes] < self.prob.memory]

    def add(self, path: Sequence[int]) -> None:
        for n in path[1:-1]:
            self.node[n] += 1
            self.stage[self.prob.stage_of[n]] += 1
        self.left -= 1


def _cheapest_nodes(prob: _Problem, loads: _Loads, head: int,
                    seq: Sequence[int]) -> tuple[float, list[int]]:  # fmt: skip
    """Exact DP for the node path of ``seq`` minimising links + compute (no contention)."""
    c = prob.cost
    fb = prob.w * (1 + simulator.BACKWARD_FACTOR)
    prev_nodes = np.array([head])
    best = np.zeros(1)
    back: list[tuple[np.ndarray, np.ndarray]] = []
    for s in seq[1:]:
        nodes = loads.free_nodes(s)
        total = best[:, None] + c[np.ix_(prev_nodes, nodes)] + c[np.ix_(nodes, prev_nodes)].T
        arg = np.argmin(total, axis=0)
        back.append((nodes, prev_nodes[arg]))
        best = total[arg, np.arange(len(nodes))] + fb[nodes]
        prev_nodes = nodes
    best = best + c[prev_nodes, head] + c[head, prev_nodes]
    i = int(np.argmin(best))
    node = int(prev_nodes[i])
    path = [node]
    for nodes, pred in reversed(back[1:]):
        node = int(pred[int(np.flatnonzero(nodes == node)[0])])
        path.append(node)
    return float(best[i]), [head, *reversed(path), head]


def _timed_nodes(prob: _Problem, loads: _Loads, head: int, seq: Sequence[int],
                 reserved: list) -> list[int]:  # fmt: skip
    """Heuristic DP: forward finish times fitted around ``reserved`` plus backward cost."""
    c, w = prob.cost, prob.w
    start = _fit(reserved[head], 0.0, w[head])
    labels = {head: (start + w[head], 0.0, None)}  # node -> (forward end, backward cost, pred)
    layers = [labels]
    for s in seq[1:]:
        new = {}
        for n in loads.free_nodes(s):
            n = int(n)
            p = min(labels, key=lambda q: (labels[q][0] + c[q, n] + labels[q][1] + c[n, q], q))
            t = _fit(reserved[n], labels[p][0] + c[p, n], w[n])
            new[n] = (t + w[n], labels[p][1] + c[n, p] + simulator.BACKWARD_FACTOR * w[n], p)
        labels = new
        layers.append(labels)
    last = min(labels, key=lambda q: (labels[q][0] + 2 * c[q, head] + labels[q][1], q))
    path = [last]
    for layer in reversed(layers[1:]):
        path.append(layer[path[-1]][2])
    return [*reversed(path), head]


def _plan(prob: _Problem, heads: Sequence[int], order: Sequence[int], mode: str,
          rng: np.random.Generator | None) -> tuple[list, list[Interval]]:  # fmt: skip
    """Prioritised planning of all agents in ``order``; returns paths and planned intervals."""
    loads = _Loads(prob, len(heads))
    reserved: list[list[tuple[float, float]]] = [[] for _ in range(prob.network.num_nodes)]
    paths: list = [None] * len(heads)
    planned: list[Interval] = []
    for mb in order:
        head = heads[mb]
        seqs = loads.candidates(lookahead=True) or loads.candidates(lookahead=False)
        if not seqs:
            raise RuntimeError(f"no feasible path left for microbatch {mb}; raise memory or "
                               f"stage_cap, or lower microbatches (the capacity check counts "
                               f"stage visits only; the order of stages the path rules allow "
                               f"can leave fewer usable)")  # fmt: skip
        if mode == "random":
            seq = seqs[int(rng.integers(len(seqs)))]
            path = [head] + [int(rng.choice(loads.free_nodes(s))) for s in seq[1:]] + [head]
        elif mode == "static":
            path = min((_cheapest_nodes(prob, loads, head, s) for s in seqs),
                       key=lambda cp: cp[0])[1]  # fmt: skip
        else:
            best = None
            for seq in seqs:
                cand = _timed_nodes(prob, loads, head, seq, reserved)
                end = prob.walk(mb, cand, reserved)[-1].end
                if best is None or end < best[0] - 1e-12:
                    best = (end, cand)
            path = best[1]
        loads.add(path)
        paths[mb] = tuple(int(n) for n in path)
        if mode != "random":
            intervals = prob.walk(mb, path, reserved if mode == "timed" else None)
            planned += intervals
            if mode == "timed":
                for iv in intervals:
                    reserved[iv.node].append((iv.start, iv.end))
                    reserved[iv.node].sort()
    return paths, planned


def full_pipeline_chains(network: Network, partition: Partition,
                         message_bytes: float) -> list[tuple[int, ...]]:  # fmt: skip
    """DT-FM-style pipelines: one node per stage, chained by cheapest matchings.

    Args:
      network: the ``Network``.
      partition: node ids of each stage.
      message_bytes: activation bytes per message.

    Returns:
      ``min(stage sizes)`` chains ``(stage-0 node, stage-1 node, ...)``.
    """
    cost = network.cost_matrix(checks.non_negative("message_bytes", message_bytes))
    chains = [[n] for n in partition[0]]
    for nodes in partition[1:]:
        tails = [c[-1] for c in chains]
        rows, cols = linear_sum_assignment(cost[np.ix_(tails, nodes)])
        chains = [chains[r] + [nodes[c]] for r, c in sorted(zip(rows, cols))]
    return [tuple(int(n) for n in c) for c in chains]


def _check_partition(partition: Partition, network: Network, rules: PathRules) -> None:
    """Every stage non-empty; every node of the network in exactly one stage."""
    if len(partition) != rules.num_stages:
        raise ValueError(f"partition must have num_stages={rules.num_stages} stages, "
                         f"got {len(partition)}")  # fmt: skip
    empty = [k for k, nodes in enumerate(partition) if len(nodes) == 0]
    if empty:
        raise ValueError(f"partition: stage(s) {empty} hold no node.")
    nodes = [int(n) for stage in partition for n in stage]
    count = network.num_nodes
    outside = sorted({n for n in nodes if not 0 <= n < count})
    twice = sorted({n for n in nodes if nodes.count(n) > 1})
    missing = sorted(set(range(count)) - set(nodes))
    if outside or twice or missing:
        raise ValueError(f"partition must place each of the network's {count} nodes in exactly "
                         f"one stage: outside the network {outside}, in two places {twice}, "
                         f"left out {missing}.")  # fmt: skip


def _spare_visits(agents: int, visits: int, caps: Sequence[int]) -> int:
    """Stage visits left over when ``agents`` paths each visit ``visits`` distinct later stages.

    A path visits a stage at most once, so a stage of capacity c serves at most
    ``min(c, agents)`` of them; negative: no schedule exists (the look-ahead test).
    """
    return sum(min(c, agents) for c in caps) - agents * visits


def _check(kind: str, partition: Partition, rules: PathRules, microbatches: int, memory: int,
           stage_cap: int | None, time_limit_s: float, max_restarts: int) -> int:  # fmt: skip
    if kind not in SCHEDULES:
        raise ValueError(f"kind must be one of {SCHEDULES}, got {kind!r}")
    for name, value in (("microbatches", microbatches), ("memory", memory),
                        ("max_restarts", max_restarts)):  # fmt: skip
        errors.check_int(name, value)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s}")
    sizes = [len(p) for p in partition]
    cap = max(sizes[1:]) * memory if stage_cap is None else errors.check_int("stage_cap", stage_cap)
    # Only stages some valid path visits serve (e.g. none beyond max_jump from stage 0 when
    # path_length = 2); counting the others let through counts the planner could not place.
    reach = {s for p in valid_stage_paths(rules) for s in p[1:]} if kind != "full" else set()
    caps = [min(cap, n * memory) for s, n in enumerate(sizes[1:], 1) if s in reach]
    heads, visits = sizes[0], rules.path_length - 1
    short = -_spare_visits(heads * microbatches, visits, caps)
    if kind != "full" and short > 0:
        most = max(m for m in range(microbatches) if _spare_visits(heads * m, visits, caps) >= 0)
        raise ValueError(f"microbatches must be <= {most} for these caps (stage visits needed "
                         f"{heads * microbatches * visits}, {short} more than they serve), "
                         f"got {microbatches}")  # fmt: skip
    return cap


def make_schedule(kind: str, network: Network, partition: Partition, rules: PathRules, *,
                  microbatches: int = 3, memory: int = 3, message_bytes: float,
                  stage_cap: int | None = None, seed: int = 0, time_limit_s: float = 10.0,
                  max_restarts: int = 8) -> Schedule:  # fmt: skip
    """Plans the paths of one iteration.

    Args:
      kind: one of ``SCHEDULES``.
      network: the ``Network``.
      partition: node ids of each stage (stage 0 first), e.g. from ``partition_nodes``.
      rules: the ``PathRules`` (``"full"`` ignores ``path_length``: all stages).
      microbatches: microbatches per stage-0 node, >= 1.
      memory: activation slots per node, >= 1; also the per-node load cap.
      message_bytes: activation bytes per message.
      stage_cap: most microbatches per later stage; default the largest later
        stage's size x ``memory``.
      seed: seed of the random paths (``skip_agnostic``) and priority shuffles.
      time_limit_s: wall-clock cap of the ``skippipe`` restarts (> 0).
      max_restarts: priority orders ``skippipe`` tries, >= 1.

    Returns:
      The ``Schedule``.
    """
    _check_partition(partition, network, rules)
    if not (math.isfinite(message_bytes) and message_bytes >= 0):
        raise ValueError(f"message_bytes must be a finite number >= 0, got {message_bytes!r}")
    cap = _check(kind, partition, rules, microbatches, memory, stage_cap, time_limit_s,
                 max_restarts)  # fmt: skip
    errors.check_int("seed", seed, 0)  # NumPy's message named no argument
    t0 = time.perf_counter()
    heads = [h for _ in range(microbatches) for h in partition[0]]  # round-robin priority
    order = list(range(len(heads)))
    if kind == "full":
        chains = full_pipeline_chains(network, partition, message_bytes)
        paths = [chains[i % len(chains)] + (chains[i % len(chains)][0],)
                 for i in range(len(heads))]  # fmt: skip
        planned, restarts = [], 1
    else:
        prob = _Problem(network, partition, rules, memory, message_bytes, cap)
        rng = np.random.default_rng(seed)
        if kind == "skip_agnostic":
            (paths, planned), restarts = _plan(prob, heads, order, "random", rng), 1
        elif kind == "skippipe_no_tc2":
            (paths, planned), restarts = _plan(prob, heads, order, "static", None), 1
        else:
            paths, planned, restarts = _search(prob, heads, order, rng, memory, message_bytes,
                                               time_limit_s, max_restarts, t0)  # fmt: skip
    stage_of = stage_of_nodes(partition)
    return Schedule(kind, partition, tuple(tuple(p) for p in paths),
                    tuple(tuple(stage_of[n] for n in p[:-1]) for p in paths),
                    tuple(sorted(planned, key=lambda iv: (iv.start, iv.node))), memory, cap,
                    restarts, time.perf_counter() - t0)  # fmt: skip


def _search(prob: _Problem, heads: Sequence[int], order: list[int], rng: np.random.Generator,
            memory: int, message_bytes: float, time_limit_s: float, max_restarts: int,
            t0: float) -> tuple[list, list[Interval], int]:  # fmt: skip
    """``skippipe``: timed prioritised planning over several priority orders."""
    best, tried = None, 0
    while tried < max_restarts and (tried == 0 or time.perf_counter() - t0 < time_limit_s):
        if tried:
            order = [int(i) for i in rng.permutation(len(heads))]
        tried += 1
        try:
            paths, planned = _plan(prob, heads, order, "timed", None)
        except RuntimeError:
            if tried == max_restarts and best is None:
                raise
            continue
        span = simulator.simulate(prob.network, paths, memory=memory,
                                  message_bytes=message_bytes).makespan_s  # fmt: skip
        if best is None or span < best[0] - 1e-12:
            best = (span, paths, planned)
    if best is None:
        raise RuntimeError("no feasible skippipe schedule found within time_limit_s")
    return best[1], best[2], tried
