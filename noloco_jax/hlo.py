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
    "source_target_pairs", "replica_groups", "EntryGraph", "entry_graph", "crossing_bytes",
]  # fmt: skip

_KINDS = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "ragged-all-to-all",
          "all-to-all")  # fmt: skip
_DTYPE_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16,
    "s32": 32, "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128,
}  # fmt: skip
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,<=]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" + "|".join(_KINDS)
                    + r")(-start)?\(")  # fmt: skip
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


@dataclasses.dataclass(frozen=True)
class CollectiveOp:
    """One collective instruction: its kind, the computation that runs it and its bytes."""

    kind: str
    computation: str
    bytes: int
    in_entry: bool
    pairs: tuple[tuple[int, int], ...] = ()  # collective-permute: (source, target) devices
    groups: tuple[tuple[int, ...], ...] = ()  # reductions and gathers: the device groups


def _bits(dtype: str) -> int:
    if dtype.startswith("f8"):  # f8e4m3fn, f8e5m2, ...
        return 8
    if dtype not in _DTYPE_BITS:  # never a silent 0
        raise ValueError(f"hlo: element type {dtype!r} has no known width; add it to _DTYPE_BITS.")
    return _DTYPE_BITS[dtype]


def _tuple_elements(shape_text: str) -> list[str]:
    """The top-level elements of a tuple shape ``(a, (b, c), ...)``; a non-tuple is one element."""
    text = shape_text.strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return parts + [text[start:i]]
        elif ch == "," and depth == 1:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _shape_bytes(shape_text: str, kind: str, is_start: bool) -> int:
    """Bytes of an instruction's result, as its synchronous form has it.

    An async start holds more: ``(operands, outputs, contexts...)`` for a permute (its
    operands count: element 0), a gather, scatter or all-to-all (its outputs count, as in
    the synchronous form: element 1; each element a tuple when combined), and the results
    for an all-reduce (all of them: combined operands). Dynamic dimensions (``<=1000``)
    count at their bound.
    """
    if is_start and kind != "all-reduce":
        parts = _tuple_elements(shape_text)
        shape_text = parts[0 if kind == "collective-permute" else min(1, len(parts) - 1)]
    arrays = _ARRAY.findall(shape_text)
    bits = 0
    for dtype, dims in arrays:
        sizes = [int(d.removeprefix("<=")) for d in dims.split(",") if d]
        bits += int(np.prod(sizes)) * _bits(dtype) if sizes else _bits(dtype)
    return -(-bits // 8)


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
    """Every collective instruction in an HLO module's text.

    A collective inside an async wrapper that XLA prints unsugared (``async-start(...),
    calls=%wrapper``, e.g. a group of several collectives) counts in the computation whose
    ``async-start`` runs it, as the sugared form (``reduce-scatter-start``) does.
    """
    runner, entry = _async_runners(hlo_text)
    ops, computation = [], ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = _HEADER.match(line)
            if m:
                computation = runner.get(m.group(1), m.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            shape_text, kind, start = m.groups()
            nbytes = _shape_bytes(shape_text, kind, bool(start))
            ops.append(CollectiveOp(kind, computation, nbytes, computation == entry,
                                    source_target_pairs(line), replica_groups(line)))  # fmt: skip
    return ops


_ASYNC_CALLS = re.compile(r"\sasync-start\(.*\bcalls=%?([\w.\-]+)")


def _async_runners(hlo_text: str) -> tuple[dict[str, str], str]:
    """{async-wrapped computation: the computation whose async-start runs it (through any
    nesting)} and the entry computation's name."""
    caller, computation, entry = {}, "", ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = _HEADER.match(line)
            computation = m.group(1) if m else computation
            entry = computation if m and line.startswith("ENTRY") else entry
            continue
        m = _ASYNC_CALLS.search(line)
        if m:
            caller[m.group(1)] = computation
    runner = {}
    for wrapped, outer in caller.items():
        seen = {wrapped}
        while outer in caller and outer not in seen:
            seen.add(outer)
            outer = caller[outer]
        runner[wrapped] = outer
    return runner, entry


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
      ``{kind: bytes}`` of the crossing collectives (on one device, each instruction counted
      once, a collective in a loop body too): a permute's or reduction's operand bytes, a
      gather's or scatter's result bytes.
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


@dataclasses.dataclass(frozen=True)
class EntryGraph:
    """The data dependencies between the instructions of a module's entry computation.

    Attributes:
      operands: each entry instruction's operands (entry instructions only).
      params: the entry parameters by the argument path JAX records in their
        metadata (e.g. ``"args[1][0]"``); arguments JAX pruned as unused are absent.
      outputs: the operands of the root tuple, in output order (the root
        itself for a single output).
      holders: for each collective kind, the entry instructions that run one:
        the collective itself, or a conditional, loop or call whose
        computations (at any depth) contain one.
    """

    operands: dict[str, tuple[str, ...]]
    params: dict[str, str]
    outputs: tuple[str, ...]
    holders: dict[str, frozenset[str]]

    def ancestors(self, name: str) -> set[str]:
        """Every instruction ``name`` depends on (transitively), itself excluded."""
        seen: set[str] = set()
        todo = list(self.operands[name])
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(self.operands[x])
        return seen

    def descendants(self, name: str) -> set[str]:
        """Every instruction that depends on ``name`` (transitively), itself excluded."""
        users: dict[str, list[str]] = collections.defaultdict(list)
        for x, ops in self.operands.items():
            for o in ops:
                users[o].append(x)
        seen: set[str] = set()
        todo = list(users[name])
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo.extend(users[x])
        return seen


_DEFINES = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_REFS = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def _computations(hlo_text: str) -> tuple[dict[str, list[tuple[str, str, bool]]], str]:
    """{computation: [(instruction, rest of its line, is_root)]} and the entry's name."""
    comps: dict[str, list[tuple[str, str, bool]]] = {}
    current, entry = None, ""
    for line in hlo_text.splitlines():
        if line and not line[0].isspace():
            m = _HEADER.match(line)
            current = m.group(1) if m else None
            if m and line.startswith("ENTRY"):
                entry = current
            if current is not None:
                comps[current] = []
            continue
        m = _DEFINES.match(line) if current is not None else None
        if m:
            comps[current].append((m.group(2), m.group(3), bool(m.group(1))))
    return comps, entry


def _holding(comps: dict, kind: str) -> set[str]:
    """The computations that contain a ``kind`` collective, directly or through calls."""
    direct = {c for c, instrs in comps.items() if any(_is_kind(r, kind) for _, r, _ in instrs)}
    calls = {c: {r for _, rest, _ in instrs for r in _REFS.findall(rest) if r in comps}
             for c, instrs in comps.items()}  # fmt: skip
    holding, grew = set(direct), True
    while grew:
        new = {c for c, called in calls.items() if called & holding} - holding
        holding |= new
        grew = bool(new)
    return holding


def _is_kind(rest: str, kind: str) -> bool:
    return re.search(r"\s" + re.escape(kind) + r"(-start)?\(", " " + rest) is not None


def entry_graph(hlo_text: str, kinds: tuple[str, ...] = _KINDS) -> EntryGraph:
    """The dependency graph of the entry computation of an HLO module's text.

    Args:
      hlo_text: e.g. ``compiled_text(...)``.
      kinds: the collective kinds whose holders to find.

    Returns:
      An ``EntryGraph``.
    """
    comps, entry = _computations(hlo_text)
    names = {i for i, _, _ in comps[entry]}
    operands, params, outputs = {}, {}, ()
    holding = {kind: _holding(comps, kind) for kind in kinds}
    holders: dict[str, set[str]] = {kind: set() for kind in kinds}
    for name, rest, is_root in comps[entry]:
        body = rest.split(", metadata=")[0]
        refs = _REFS.findall(body)
        operands[name] = tuple(r for r in refs if r in names)
        if " parameter(" in " " + body:
            op = _OP_NAME.search(rest)
            params[op.group(1) if op else name] = name
        for kind in kinds:
            if _is_kind(body, kind) or any(r in holding[kind] for r in refs):
                holders[kind].add(name)
        if is_root:
            outputs = operands[name] if re.search(r"\stuple\(", " " + body) else (name,)
    return EntryGraph(operands, params, outputs,
                      {k: frozenset(v) for k, v in holders.items()})  # fmt: skip
