"""Reading communication volume off compiled HLO text.

Used by tests and benchmarks to prove which collectives a compiled step
contains and how many bytes they move, instead of trusting arithmetic.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import numpy as np

__all__ = [
    "CollectiveOp", "collective_ops", "bytes_by_computation", "compiled_text",
    "source_target_pairs", "replica_groups", "crossing_bytes",
]  # fmt: skip

_KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(_KINDS) + r")(-start)?\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction: its kind, enclosing computation and bytes."""

    kind: str
    computation: str
    bytes: int
    in_entry: bool
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute: (source, target) devices
    groups: tuple[tuple[int, ...], ...] = ()  # reductions and gathers: the device groups


def _shape_bytes(shape_text: str, is_start: bool) -> int:
    arrays = _ARRAY.findall(shape_text)
    if is_start:  # async start: (operand, output, contexts...) -> count the operand once
        arrays = arrays[:1]
    total = 0
    for dtype, dims in arrays:
        if dtype not in _DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
    return total


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective instruction in an HLO module's text."""
    ops = []
    computation, in_entry = "", False
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = _HEADER.match(line)
            if m:
                computation, in_entry = m.group(1), line.startswith("ENTRY")
            continue
        m = _INSTR.match(line)
        if m:
            shape_text, kind, start = m.groups()
            nbytes = _shape_bytes(shape_text, bool(start))
            ops.append(CollectiveOp(kind, computation, nbytes, in_entry, source_target_pairs(line),
                                    replica_groups(line)))  # fmt: skip
    return ops


_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_GROUPS = re.compile(r"replica_groups=(\{(?:\{[\d,]*\},?)*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


def source_target_pairs(line: str) -> tuple[tuple[int, int], ...]:
    """The ``(source, target)`` device pairs of a collective-permute instruction."""
    m = _PAIRS.search(line)
    if not m:
        return ()
    return tuple((int(a), int(b)) for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1)))


def replica_groups(line: str) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective: the ``{{0,1},{2,3}}`` form or the iota form
    ``[G,S]<=[d0,d1,...]T(perm)`` (devices ``iota(d).transpose(perm)`` in G rows of S)."""
    m = _GROUPS.search(line)
    if not m:
        return ()
    text = m.group(1)
    if text.startswith("{"):
        return tuple(tuple(int(x) for x in g.split(",") if x)
                     for g in re.findall(r"\{([\d,]*)\}", text[1:-1]))  # fmt: skip
    shape, dims, perm = re.fullmatch(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text).groups()
    ints = lambda t: [int(x) for x in t.split(",")]  # noqa: E731
    ids = np.arange(int(np.prod(ints(dims)))).reshape(ints(dims))
    if perm:
        ids = ids.transpose(ints(perm))
    return tuple(tuple(int(x) for x in row) for row in ids.reshape(ints(shape)))


def bytes_by_computation(hlo_text: str, kind: str) -> dict[str, int]:
    """Bytes moved by collectives of ``kind``, summed per HLO computation.

    For a step whose exchange sits in ``lax.switch`` branches, each branch is
    its own computation, so each value is the bytes of one branch.
    """
    out: dict[str, int] = collections.defaultdict(int)
    for op in collective_ops(hlo_text):
        if op.kind == kind:
            out[op.computation] += op.bytes
    return dict(out)


def crossing_bytes(ops: list[CollectiveOp], replica_of: dict[int, int]) -> dict[str, int]:
    """Bytes per device of the collectives that join devices of different replicas, by kind.

    A collective-permute crosses when one of its pairs does; a reduction or
    gather when one of its device groups spans replicas (no groups: all
    devices, so it crosses when there are several replicas).

    Args:
      ops: ``collective_ops`` of a compiled program.
      replica_of: device id -> the replica it belongs to.

    Returns:
      ``{kind: bytes}`` of the crossing collectives (operand bytes on one
      device, each instruction counted once).
    """
    out: dict[str, int] = collections.defaultdict(int)
    several = len(set(replica_of.values())) > 1
    for op in ops:
        links = op.pairs or op.groups
        if op.kind == "collective-permute":
            crosses = any(replica_of[a] != replica_of[b] for a, b in op.pairs)
        else:
            crosses = any(len({replica_of[d] for d in g}) > 1 for g in links) if links else several
        if crosses:
            out[op.kind] += op.bytes
    return dict(out)


def compiled_text(jitted, *args, **kwargs) -> str:
    """Optimized HLO text of ``jitted`` (a ``jax.jit`` function) for these args."""
    return jitted.lower(*args, **kwargs).compile().as_text()
