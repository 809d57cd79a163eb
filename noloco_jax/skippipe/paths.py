"""SkipPipe's path rules: which stage orders a microbatch may take.

A microbatch's forward pass visits exactly ``path_length`` of the
``num_stages`` stages. It starts at its own stage-0 node, which also computes
the loss, so the node path is closed: ``(head, n1, ..., n_{L-1}, head)``.
The rules, as SkipPipe's per-agent search enforces them [SkipPipe code,
``a_star_modified.py``; reference note §1.4]:

1. stage 0 first (and last: the path closes at the same stage-0 node);
2. exactly ``path_length`` stages, stage 0 included;
3. each stage at most once;
4. swaps: visiting a stage below the *frontier* (the highest stage reached so
   far) is a swap of distance ``frontier - stage``. Every swap is at most
   ``max_swap_distance`` (1: adjacent only), at most ``max_swaps`` swaps, and
   their distances sum to at most ``max_total_swap_distance``. ``allow_swaps``
   = False forbids them (the ICLR version of SkipPipe);
5. a forward step may land at most ``max_jump`` stages above the frontier.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Sequence

import numpy as np

__all__ = ["MAX_JUMP", "PathRules", "check_stage_path", "check_path", "valid_stage_paths"]

MAX_JUMP = 4
"""SkipPipe's limit: a path lands at most 4 stages above the highest stage it has reached."""


@dataclasses.dataclass(frozen=True)
class PathRules:
    """Shape rules of a microbatch's path.

    Attributes:
      num_stages: pipeline stages S >= 2.
      path_length: stages each microbatch visits, stage 0 included, in [2, S];
        the skip ratio is ``(S - path_length) / S``.
      allow_swaps: whether adjacent swaps of stage order are allowed.
      max_swaps: most swaps per path (SkipPipe: 2).
      max_swap_distance: most stages a swap reaches back below the frontier (1).
      max_total_swap_distance: most summed swap distance per path (2).
      max_jump: most stages one step may land above the frontier (SkipPipe: 4).
    """

    num_stages: int
    path_length: int
    allow_swaps: bool = True
    max_swaps: int = 2
    max_swap_distance: int = 1
    max_total_swap_distance: int = 2
    max_jump: int = MAX_JUMP

    def __post_init__(self) -> None:
        for name in ("num_stages", "path_length", "max_swaps", "max_swap_distance",
                     "max_total_swap_distance", "max_jump"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not isinstance(self.allow_swaps, (bool, np.bool_)):  # "no" was truthy: swaps on
            raise ValueError(f"allow_swaps must be True or False, got {self.allow_swaps!r}")
        if self.num_stages < 2:
            raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
        if not 2 <= self.path_length <= self.num_stages:
            raise ValueError(f"path_length must be in [2, num_stages={self.num_stages}], "
                             f"got {self.path_length}")  # fmt: skip
        for name in ("max_swaps", "max_swap_distance", "max_total_swap_distance"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_jump < 1:
            raise ValueError(f"max_jump must be >= 1, got {self.max_jump}")

    @property
    def skip_ratio(self) -> float:
        """Fraction of stages each microbatch skips, ``(S - path_length) / S``."""
        return (self.num_stages - self.path_length) / self.num_stages


def check_stage_path(stages: Sequence[int], rules: PathRules) -> list[str]:
    """Violations of the rules by a forward stage sequence ``(0, s1, ..., s_{L-1})``.

    Args:
      stages: stages in visiting order, stage 0 first (the return to stage 0
        for the loss is implicit).
      rules: the ``PathRules``.

    Returns:
      Human-readable violations; empty when the path is valid.
    """
    out = []
    stages = list(stages)
    if len(stages) != rules.path_length:
        out.append(f"visits {len(stages)} stages, path_length is {rules.path_length}")
    if not stages or stages[0] != 0:
        out.append("does not start at stage 0")
    if any(not 0 <= s < rules.num_stages for s in stages):
        out.append(f"stage outside [0, {rules.num_stages})")
    if len(set(stages)) != len(stages):
        out.append("visits a stage more than once")
    frontier, swaps, total = 0, 0, 0
    for s in stages[1:]:
        if s > frontier:
            if s - frontier > rules.max_jump:
                out.append(f"jumps {s - frontier} stages above the frontier "
                           f"(max_jump={rules.max_jump})")  # fmt: skip
            frontier = s
            continue
        swaps, total = swaps + 1, total + frontier - s
        if not rules.allow_swaps:
            out.append(f"swap to stage {s} but allow_swaps=False")
        elif frontier - s > rules.max_swap_distance:
            out.append(f"swap of distance {frontier - s} > max_swap_distance="
                       f"{rules.max_swap_distance}")  # fmt: skip
    if rules.allow_swaps and swaps > rules.max_swaps:
        out.append(f"{swaps} swaps > max_swaps={rules.max_swaps}")
    if rules.allow_swaps and total > rules.max_total_swap_distance:
        out.append(f"summed swap distance {total} > max_total_swap_distance="
                   f"{rules.max_total_swap_distance}")  # fmt: skip
    return out


def check_path(nodes: Sequence[int], stage_of: Mapping[int, int] | Sequence[int],
               rules: PathRules, head: int | None = None) -> list[str]:  # fmt: skip
    """Violations of the rules by a closed node path ``(head, n1, ..., head)``.

    Args:
      nodes: node ids in visiting order, ending back at the first node.
      stage_of: stage of each node (a mapping or a sequence indexed by node).
      rules: the ``PathRules``.
      head: the microbatch's own stage-0 node, if it must be checked.

    Returns:
      Human-readable violations; empty when the path is valid.
    """
    nodes = list(nodes)
    if len(nodes) < 3:
        return [f"node path {nodes} is too short"]
    out = []
    if nodes[0] != nodes[-1]:
        out.append("does not end at the stage-0 node it started from")
    if head is not None and nodes[0] != head:
        out.append(f"starts at node {nodes[0]}, not at its own stage-0 node {head}")
    known = stage_of.keys() if isinstance(stage_of, Mapping) else range(len(stage_of))
    unknown = sorted({n for n in nodes if n not in known})  # a sequence would wrap -1 round
    if unknown:
        return out + [f"nodes {unknown} have no stage in stage_of"]
    stages = [stage_of[n] for n in nodes[:-1]]
    if stage_of[nodes[-1]] != 0:
        out.append("does not end at a stage-0 node")
    return out + check_stage_path(stages, rules)


def valid_stage_paths(rules: PathRules) -> tuple[tuple[int, ...], ...]:
    """Every stage sequence the rules allow, in lexicographic order.

    Args:
      rules: the ``PathRules``.

    Returns:
      Tuples ``(0, s1, ..., s_{L-1})``.
    """
    later = range(1, rules.num_stages)
    paths = (p for p in itertools.permutations(later, rules.path_length - 1))
    return tuple(sorted((0, *p) for p in paths if not check_stage_path((0, *p), rules)))
