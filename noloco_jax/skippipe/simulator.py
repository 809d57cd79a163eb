"""Discrete-event simulation of one training iteration over given microbatch paths.

Each microbatch follows its closed node path ``(head, n1, ..., n_{L-1}, head)``:

    F(head) -> F(n1) -> ... -> F(n_{L-1}) -> loss(head)
            -> B(n_{L-1}) -> ... -> B(n1) -> B(head)

with forward ``w``, backward ``1.5 w`` and loss ``w / 4`` (``w`` = the node's
``compute_s``), and the link time of one activation message between
consecutive nodes (links are pure delays: no bandwidth sharing). Every node
runs one task at a time, first come first served by arrival time. A node holds
a microbatch's activations from the start of its forward to the end of its
backward; a forward starts only while fewer than ``memory`` microbatches are
held, otherwise it waits (and later-arriving losses/backwards may pass it).
All microbatches are ready at their head at time 0. The iteration time
(makespan) is the end of the last backward on a stage-0 node, as in
SkipPipe's ``com_sym.py`` [reference note §1.5].
"""

from __future__ import annotations

import dataclasses
import heapq
from typing import NamedTuple, Sequence

import numpy as np

from noloco_jax import errors
from noloco_jax.netsim import checks
from noloco_jax.skippipe.network import Network

__all__ = ["TraceEvent", "SimResult", "simulate", "memory_from_trace",
           "path_tasks"]

BACKWARD_FACTOR = 1.5
LOSS_FACTOR = 0.25
_KIND_ORDER = {"backward": 0, "loss": 1, "forward": 2}


class TraceEvent(NamedTuple):
    """One task executed by a node."""

    node: int
    microbatch: int
    kind: str  # "forward", "loss" or "backward"
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Outcome of ``simulate``.

    Attributes:
      makespan_s: end of the last backward on a stage-0 node.
      finish_s: (M,) end of each microbatch's last backward.
      trace: every task, sorted by (start, node).
      max_memory: (N,) most microbatches held at once on each node.
    """

    makespan_s: float
    finish_s: np.ndarray
    trace: tuple[TraceEvent, ...]
    max_memory: np.ndarray


def path_tasks(path: Sequence[int]) -> list[tuple[int, str]]:
    """(node, "forward" | "loss" | "backward") in the order one micro-batch runs them on a
    closed path (its first node computes the loss)."""
    inner = list(path[:-1])
    return ([(n, "forward") for n in inner] + [(path[0], "loss")]
            + [(n, "backward") for n in reversed(inner)])  # fmt: skip


def _check(network: Network, paths: Sequence[Sequence[int]], memory: int,
           message_bytes: float) -> None:  # fmt: skip
    errors.check_int("memory", memory)
    checks.non_negative("message_bytes", message_bytes)
    if not paths:
        raise ValueError("paths must hold at least one microbatch path")
    for i, p in enumerate(paths):
        if len(p) < 2 or p[0] != p[-1]:
            raise ValueError(f"paths[{i}] must be a closed node path (head, ..., head), got {p}")
        if len(set(p[:-1])) != len(p) - 1:
            raise ValueError(f"paths[{i}] visits a node twice: {p}")
        if any(not 0 <= n < network.num_nodes for n in p):
            raise ValueError(f"paths[{i}] has a node outside [0, {network.num_nodes})")


def simulate(network: Network, paths: Sequence[Sequence[int]], *, memory: int,
             message_bytes: float) -> SimResult:  # fmt: skip
    """Simulates one iteration.

    Args:
      network: the ``Network`` (link times and per-node ``w``).
      paths: closed node path of each microbatch, ``(head, ..., head)``.
      memory: activation slots per node, >= 1.
      message_bytes: bytes of one activation (or gradient) message, >= 0.

    Returns:
      A ``SimResult``.

    Raises:
      RuntimeError: if the run deadlocks (forwards waiting for memory in a
        cycle), which the schedulers' node caps rule out.
    """
    _check(network, paths, memory, message_bytes)
    w = network.compute_s
    dur = {"forward": 1.0, "loss": LOSS_FACTOR, "backward": BACKWARD_FACTOR}
    tasks = [path_tasks(p) for p in paths]
    n = network.num_nodes
    queues: list[list[tuple]] = [[] for _ in range(n)]  # (arrival, kind order, mb, step)
    busy = [False] * n
    held = np.zeros(n, dtype=int)
    max_mem = np.zeros(n, dtype=int)
    # (time, 0 = arrival / 1 = task end, seq, mb, step); arrivals first at equal times.
    events: list[tuple] = [(0.0, 0, mb, mb, 0) for mb in range(len(paths))]
    heapq.heapify(events)
    seq = len(paths)
    trace: list[TraceEvent] = []
    finish = np.full(len(paths), np.nan)

    def try_start(node: int, now: float) -> None:
        nonlocal seq
        if busy[node]:
            return
        for item in sorted(queues[node]):
            _, _, mb, step = item
            kind = tasks[mb][step][1]
            if kind == "forward" and held[node] >= memory:
                continue
            queues[node].remove(item)
            if kind == "forward":
                held[node] += 1
                max_mem[node] = max(max_mem[node], held[node])
            end = now + w[node] * dur[kind]
            busy[node] = True
            trace.append(TraceEvent(node, mb, kind, now, end))
            heapq.heappush(events, (end, 1, seq, mb, step))
            seq += 1
            return

    while events:
        now, is_end, _, mb, step = heapq.heappop(events)
        node, kind = tasks[mb][step]
        if not is_end:
            queues[node].append((now, _KIND_ORDER[kind], mb, step))
            try_start(node, now)
            continue
        busy[node] = False
        if kind == "backward":
            held[node] -= 1
        if step + 1 < len(tasks[mb]):
            nxt = tasks[mb][step + 1][0]
            heapq.heappush(events, (now + network.link_time(node, nxt, message_bytes), 0, seq,
                                    mb, step + 1))  # fmt: skip
            seq += 1
        else:
            finish[mb] = now
        try_start(node, now)
    if np.isnan(finish).any():
        raise RuntimeError(f"deadlock: {int(np.isnan(finish).sum())} microbatches never "
                           "finished (forwards waiting for memory in a cycle)")  # fmt: skip
    trace.sort(key=lambda e: (e.start, e.node, e.microbatch))
    return SimResult(float(finish.max()), finish, tuple(trace), max_mem)


def memory_from_trace(trace: Sequence[TraceEvent], num_nodes: int) -> np.ndarray:
    """Most microbatches held at once per node, recomputed from a trace.

    A node holds a microbatch from its forward's start to its backward's end.

    Args:
      trace: the ``SimResult.trace``.
      num_nodes: N.

    Returns:
      (N,) peak number of held microbatches.
    """
    spans: dict[tuple[int, int], list[float]] = {}
    for e in trace:
        if e.kind == "forward":
            spans.setdefault((e.node, e.microbatch), [e.start, np.inf])[0] = e.start
        elif e.kind == "backward":
            spans.setdefault((e.node, e.microbatch), [-np.inf, e.end])[1] = e.end
    out = np.zeros(num_nodes, dtype=int)
    for node in range(num_nodes):
        points = sorted((t, d) for (nd, _), (a, b) in spans.items() if nd == node
                        for t, d in ((a, 1), (b, -1)))  # fmt: skip
        level = 0
        for _, d in points:  # at equal times releases (-1) come first
            level += d
            out[node] = max(out[node], level)
    return out
