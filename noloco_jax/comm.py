"""The collectives between replicas, and what each one costs.

The optimizers (``noloco_jax.optim``) and ``noloco_jax.metrics`` (but for
``replica_spread``'s ``psum`` of replica 0's weights) reach other
replicas, and the other model-parallel shards of their replica, only through
this module. The trainer and the pipeline call the few collectives that
belong to them (pipeline stage sends and stage sums, per-replica fault
injection) directly. Everything here works the same whether ``axis_name`` is
bound by ``jax.vmap(..., axis_name=...)`` (N simulated replicas on one device)
or by ``jax.shard_map`` over a mesh axis (one replica per device).

Random groups with static permutations
--------------------------------------
``lax.ppermute`` needs its permutation at trace time, yet NoLoCo re-draws its
groups every outer round. We therefore precompute a *pool* of partitions of
the N replicas into groups of n and select one per round with ``lax.switch``,
the branch index being drawn from ``fold_in(key(seed), round)``: the same on
every replica and host, with no communication.

* n = 2: the pool is the N - 1 perfect matchings of the round-robin
  ("circle method") 1-factorisation of K_N. Every pair of replicas sits in
  exactly one matching, so a replica's partner is uniform over the other
  N - 1 replicas each round, and the compiled program has N - 1 branches.
* n > 2: the pool holds ``pool_size`` (default N - 1) partitions drawn once
  from ``numpy.random.default_rng(seed)``; each groups a random permutation
  by striding, as the reference code does (element k joins group k mod N/n).
* n = N: the single partition {all replicas} (NoLoCo degenerates to DiLoCo).

``groups_for_round`` returns exactly the partition used in a round.

Exchanges inside a group
------------------------
For n a power of two the group sum is a butterfly (recursive doubling):
log2(n) ``ppermute`` calls, each moving one buffer. Otherwise it is n - 1
cyclic shifts inside the groups. Each replica therefore sends
``exchange_steps(n)`` buffers per exchanged tensor, and receives as many;
nothing is ever reduced over all N replicas.

All leaves travel packed in one message per exchange step, each cast to its
wire dtype; the sums equal those of a leaf-by-leaf exchange, bit for bit. Why
it is built this way: experiments/BENCHMARKS.md, "Compiler notes".
"""

from __future__ import annotations

import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from noloco_jax import errors, quantize

PyTree = Any

__all__ = [
    "UnboundAxisError",
    "axis_size",
    "check_group_size",
    "partition_pool",
    "connects_all",
    "pool_index",
    "groups_for_round",
    "presence_mask",
    "own_presence",
    "all_true",
    "group_mean",
    "group_mean_codec",
    "check_exchange_dtype",
    "as_stored",
    "varying_axes",
    "all_replica_mean",
    "all_replica_mean_wire",
    "diloco_bytes_per_sync",
    "exchange_steps",
    "noloco_bytes_per_sync",
    "allreduce_bytes_per_replica",
    "mean_bytes_per_replica",
    "tree_num_elements",
]


class UnboundAxisError(ValueError):
    """Raised when a replica axis name is used where no transformation binds it."""


def axis_size(axis_name: str) -> int:
    """Number of replicas along ``axis_name``, with a helpful error if unbound.

    Args:
      axis_name: the replica axis name.

    Returns:
      The static size of the axis.

    Raises:
      UnboundAxisError: if no enclosing ``jax.vmap`` or ``jax.shard_map`` binds
        ``axis_name``.
    """
    try:
        return int(lax.axis_size(axis_name))
    except NameError as err:
        raise UnboundAxisError(
            f"axis_name={axis_name!r} is not bound where this update runs. Run the "
            f"update inside jax.vmap(fn, axis_name={axis_name!r}) (replicas simulated "
            f"on one device) or inside jax.shard_map over a mesh with an axis named "
            f"{axis_name!r} (one replica per device); for a single replica pass "
            f"axis_name=None."
        ) from err


def check_group_size(num_replicas: int | None, group_size: int, *, field: str = "group_size",
                     replicas_field: str = "num_replicas") -> None:  # fmt: skip
    """The group-size rule: n is an integer >= 2 that divides N (the one check of it).

    Args:
      num_replicas: N; None checks n alone (N is not known yet).
      group_size: n.
      field: the name the message gives n ("config.outer.group_size" in the settings).
      replicas_field: the name the message gives N.

    Raises:
      UserError (a ``ValueError``): naming both fields and the allowed values.
    """
    errors.check_int(field, group_size, minimum=2)
    if num_replicas is not None:
        errors.check_int(replicas_field, num_replicas)
    if num_replicas is not None and num_replicas % group_size:
        allowed = [d for d in range(2, num_replicas + 1) if num_replicas % d == 0]
        raise errors.UserError(f"{field}={group_size} must divide {replicas_field}="
                               f"{num_replicas}; allowed: {allowed}.")  # fmt: skip


def _round_robin_matchings(n: int) -> np.ndarray:
    """The n - 1 perfect matchings of K_n (n even), shape [n - 1, n // 2, 2]."""
    m = n - 1
    out = np.empty((m, n // 2, 2), dtype=np.int32)
    for k in range(m):
        out[k, 0] = (k, m)
        for i in range(1, n // 2):
            out[k, i] = ((k + i) % m, (k - i) % m)
    return out


@functools.lru_cache(maxsize=64)
def partition_pool(
    num_replicas: int, group_size: int, seed: int, pool_size: int | None = None
) -> np.ndarray:
    """The static pool of partitions the outer step chooses from.

    Args:
      num_replicas: N, the number of replicas on the axis.
      group_size: n, the size of each group; must divide N.
      seed: seed of the pool (n > 2) and of the subset of matchings (n = 2 with
        ``pool_size < N - 1``), an integer in [0, 2**32 - 1].
      pool_size: number of partitions, an integer >= 2 (ignored for n = N);
        default N - 1 (all matchings for n = 2).

    Returns:
      Read-only int32 array of shape [pool_size, N // n, n] of replica ids.
    """
    check_group_size(num_replicas, group_size)
    errors.check_int("seed", seed, 0, 2**32 - 1, "2**32 - 1")
    if pool_size is not None:
        errors.check_int("pool_size", pool_size)
    if group_size == num_replicas:
        pool = np.arange(num_replicas, dtype=np.int32)[None, None, :]
    else:
        size = num_replicas - 1 if pool_size is None else pool_size
        if size < 2:
            raise ValueError(
                f"pool_size={size} leaves replicas that never meet: a single partition of "
                f"{num_replicas} replicas into groups of {group_size} never joins one group "
                f"to another. Use pool_size >= 2 (or None for {num_replicas - 1})."
            )
        rng = np.random.default_rng(seed)
        for _ in range(_CONNECT_TRIES):  # the first draw almost always connects
            pool = _draw_pool(num_replicas, group_size, size, rng)
            if connects_all(pool, num_replicas):
                break
        else:
            raise ValueError(
                f"no pool of {size} partitions drawn from seed {seed} connects all "
                f"{num_replicas} replicas (in {_CONNECT_TRIES} draws), so some replicas "
                f"would never exchange weights. Use a larger pool_size."
            )
        pool = np.ascontiguousarray(pool, dtype=np.int32)
    pool.setflags(write=False)
    return pool


_CONNECT_TRIES = 200


def _draw_pool(num_replicas: int, group_size: int, size: int, rng: np.random.Generator
               ) -> np.ndarray:
    """``size`` partitions: round-robin matchings (n = 2) or strided random permutations."""
    if group_size == 2:
        pool = _round_robin_matchings(num_replicas)
        if size > len(pool):
            raise ValueError(
                f"pool_size={size} exceeds the {len(pool)} distinct matchings of "
                f"{num_replicas} replicas."
            )
        if size < len(pool):
            pool = pool[np.sort(rng.choice(len(pool), size, replace=False))]
        return pool
    g = num_replicas // group_size
    perms = np.stack([rng.permutation(num_replicas) for _ in range(size)])
    # Element k of a permutation joins group k mod g (reference grouping).
    return perms.reshape(size, group_size, g).transpose(0, 2, 1)


def connects_all(pool: np.ndarray, num_replicas: int) -> bool:
    """Whether the union of the pool's groups links every replica to every other.

    If it does not, some replicas never exchange weights, directly or through
    others, and their models drift apart for good.

    Args:
      pool: partitions, [K, N // n, n] of replica ids.
      num_replicas: N.

    Returns:
      True when the graph joining members of a common group is connected.
    """
    root = list(range(num_replicas))

    def find(i: int) -> int:
        while root[i] != i:
            root[i] = root[root[i]]
            i = root[i]
        return i

    for group in np.asarray(pool).reshape(-1, np.asarray(pool).shape[-1]):
        for j in group[1:]:
            root[find(int(j))] = find(int(group[0]))
    return len({find(i) for i in range(num_replicas)}) == 1


def pool_index(
    round_index: jax.typing.ArrayLike, pool_size: int, seed: int, stream: int | None = None
) -> jax.Array:
    """Which pool entry outer round ``round_index`` uses (traced, replica-uniform).

    ``stream`` (e.g. a streaming fragment's index) draws from a separate stream;
    ``None`` is the original draw. ``seed`` must be in [0, 2**32 - 1] (the key keeps 32 bits:
    -1 drew seed 2**32 - 1's groups). ``pool_size`` is an integer >= 1.
    """
    errors.check_int("seed", seed, 0, 2**32 - 1, "2**32 - 1")
    errors.check_int("pool_size", pool_size)  # 0, -3 or 1.5 gave index 0 of no pool
    if pool_size == 1:
        return jnp.zeros([], jnp.int32)
    key = jax.random.key(seed)
    if stream is not None:
        key = jax.random.fold_in(jax.random.fold_in(key, 2**31 - 1), stream)
    key = jax.random.fold_in(key, jnp.asarray(round_index, jnp.uint32))
    return jax.random.randint(key, (), 0, pool_size, dtype=jnp.int32)


def presence_mask(
    round_index: jax.typing.ArrayLike, num_replicas: int, dropout_prob: float, seed: int
) -> jax.Array:
    """Which replicas take part in outer round ``round_index``: bool [N].

    Each replica misses a round independently with probability
    ``dropout_prob``, drawn from ``fold_in(fold_in(key(seed), round), 1)`` - a
    stream separate from the group draw, identical on every replica.
    ``dropout_prob`` must be in [0, 1) and ``seed`` in [0, 2**32 - 1], as the optimizers'.
    """
    errors.check_int("num_replicas", num_replicas)
    dropout_prob, seed = _item(dropout_prob), _item(seed)  # a 0-d NumPy array is its number
    if not isinstance(dropout_prob, jax.Array):  # a traced or device value is the caller's
        errors.check_number("dropout_prob", dropout_prob, 0, 1, open_high=True)
    if not isinstance(seed, jax.Array):
        errors.check_int("seed", seed, 0, 2**32 - 1, "2**32 - 1")
    key = jax.random.fold_in(jax.random.key(seed), jnp.asarray(round_index, jnp.uint32))
    return ~jax.random.bernoulli(jax.random.fold_in(key, 1), dropout_prob, (num_replicas,))


def _item(value: Any) -> Any:
    """A 0-d NumPy array as its Python number; anything else as is."""
    return value.item() if isinstance(value, np.ndarray) and value.ndim == 0 else value


def own_presence(
    round_index: jax.typing.ArrayLike, axis_name: str, dropout_prob: float, seed: int
) -> jax.Array:
    """This replica's entry of ``presence_mask``: whether it takes part in the round.

    Args:
      round_index: the outer round.
      axis_name: the replica axis (bound by ``jax.vmap`` or ``jax.shard_map``).
      dropout_prob: probability that a replica misses the round.
      seed: seed of the draw, shared by all replicas.

    Returns:
      A bool scalar.
    """
    mask = presence_mask(round_index, axis_size(axis_name), dropout_prob, seed)
    return mask[lax.axis_index(axis_name)]


def all_true(flag: jax.Array, axis_name: Any) -> jax.Array:
    """True where ``flag`` is True on every member of ``axis_name`` (a bool scalar).

    The optimizers use it so that the model-parallel shards of one replica
    agree on a per-replica decision (the non-finite guard's).
    """
    return lax.pmin(flag.astype(jnp.int32), axis_name) > 0


def groups_for_round(
    round_index: int,
    num_replicas: int,
    group_size: int,
    seed: int,
    *,
    pool_size: int | None = None,
    stream: int | None = None,
) -> np.ndarray:
    """The groups NoLoCo uses in outer round ``round_index``.

    Computed identically on every replica and host from its arguments alone.

    Args:
      round_index: 0-based index of the outer round (the number of outer steps
        taken before it).
      num_replicas: N.
      group_size: n.
      seed: the ``seed`` given to ``noloco_outer``.
      pool_size: the ``pool_size`` given to ``noloco_outer``.
      stream: the fragment index with streaming fragments (``local_steps``'
        ``fragments``); ``None`` otherwise.

    Returns:
      int array [N // n, n]; row g lists the replica ids of group g.

    Example:
      >>> groups_for_round(0, num_replicas=4, group_size=2, seed=0).shape
      (2, 2)
    """
    errors.check_int("round_index", round_index, 0, 2**32 - 1, "2**32 - 1")
    errors.check_int("seed", seed, 0, 2**32 - 1, "2**32 - 1")
    if stream is not None:
        errors.check_int("stream", stream, 0, 2**32 - 1, "2**32 - 1")
    pool = partition_pool(num_replicas, group_size, seed, pool_size)
    idx = int(pool_index(round_index, len(pool), seed, stream))
    return np.array(pool[idx])


def exchange_steps(group_size: int) -> int:
    """Buffers each replica sends (and receives) per exchanged tensor."""
    check_group_size(None, group_size)
    if group_size & (group_size - 1) == 0:
        return int(math.log2(group_size))
    return group_size - 1


def _exchange_perms(partition: np.ndarray) -> list[list[tuple[int, int]]]:
    """Static (source, destination) lists realising the group sum."""
    n = partition.shape[1]
    perms = []
    if n & (n - 1) == 0:  # butterfly: partner differs in one bit of the member index
        for b in range(int(math.log2(n))):
            perms.append(
                [(int(g[j]), int(g[j ^ (1 << b)])) for g in partition for j in range(n)]
            )
        return perms
    for k in range(1, n):  # cyclic shift by k inside every group
        perms.append([(int(g[j]), int(g[(j + k) % n])) for g in partition for j in range(n)])
    return perms


def _position(partition: np.ndarray, axis_name: str) -> jax.Array:
    """This replica's position in its group of ``partition`` [groups, n] (an int32 scalar)."""
    table = np.zeros(partition.size, np.int32)
    table[partition.reshape(-1)] = np.tile(np.arange(partition.shape[1]), partition.shape[0])
    return jnp.asarray(table)[lax.axis_index(axis_name)]


def _uint_of(dtype: Any) -> Any:
    return {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[jnp.dtype(dtype).itemsize]


def _accum_dtype(dtype: Any) -> Any:
    return jnp.promote_types(dtype, jnp.float32)


def _as_words(x: jax.Array, word: Any) -> jax.Array:
    """The raw bits of ``x`` as a flat vector of unsigned ``word``s (no wider than x's)."""
    bits = lax.bitcast_convert_type(x, _uint_of(x.dtype))
    if jnp.dtype(word).itemsize != x.dtype.itemsize:
        bits = lax.bitcast_convert_type(bits, word)  # adds a trailing axis of words
    return bits.reshape(-1)


def _from_words(words: jax.Array, dtype: Any, size: int) -> jax.Array:
    """Inverse of ``_as_words`` for a flat vector of ``size`` elements of ``dtype``."""
    per = jnp.dtype(dtype).itemsize // words.dtype.itemsize
    if per != 1:
        words = lax.bitcast_convert_type(words.reshape(size, per), _uint_of(dtype))
    return lax.bitcast_convert_type(words, dtype)


def _word_dtype(arrays: Sequence[jax.Array], wires: Sequence[Any]) -> Any:
    """dtype of the message carrying ``arrays`` as their ``wires`` dtypes.

    When every array already has the one common wire dtype, the message is of
    that dtype. Otherwise it holds raw bits, as unsigned words as wide as the
    narrowest wire dtype: XLA could otherwise move a narrowing convert across
    the collective and send the wide type after all.
    """
    if all(jnp.dtype(w) == a.dtype for a, w in zip(arrays, wires)) and len(set(wires)) == 1:
        return arrays[0].dtype
    return _uint_of(min(wires, key=lambda w: jnp.dtype(w).itemsize))


def _encode(arrays: Sequence[jax.Array], wires: Sequence[Any]) -> jax.Array:
    """One flat message holding every array cast to its wire dtype, in order."""
    wires = [jnp.dtype(w) for w in wires]
    word = jnp.dtype(_word_dtype(arrays, wires))
    parts = []
    if len(arrays) == 1 and wires[0].itemsize == word.itemsize:
        # One array travels in its own shape (its bits, if not of the word type): flattened,
        # an array the compiler splits inside a replica would first be gathered whole.
        payload = arrays[0].astype(wires[0])
        return payload if wires[0] == word else lax.bitcast_convert_type(payload, word)
    for a, w in zip(arrays, wires):
        payload = a.astype(w)
        parts.append(payload.reshape(-1) if w == word else _as_words(payload, word))
    return jnp.concatenate(parts) if len(parts) > 1 else parts[0]


def _decode(
    message: jax.Array, arrays: Sequence[jax.Array], wires: Sequence[Any]
) -> list[jax.Array]:
    """Inverse of ``_encode``: arrays shaped and typed like ``arrays``.

    Each array is sliced out of the message before it is converted, so the
    conversion fuses into whatever reads that array alone.
    """
    if len(arrays) == 1 and message.shape == arrays[0].shape and message.ndim != 1:
        wire = jnp.dtype(wires[0])
        payload = message if message.dtype == wire else lax.bitcast_convert_type(message, wire)
        return [payload.astype(arrays[0].dtype)]
    out, start = [], 0
    for a, w in zip(arrays, wires):
        w = jnp.dtype(w)
        count = a.size * w.itemsize // message.dtype.itemsize
        chunk = message[start : start + count]
        start += count
        value = chunk if chunk.dtype == w else _from_words(chunk, w, a.size)
        out.append(value.astype(a.dtype).reshape(a.shape))
    return out


def _own_value_travels(group_size: int) -> bool:
    """Whether every message of the group sum carries the sender's own value.

    True for pairs and for cyclic shifts (n not a power of two); false for a
    butterfly of several steps, whose later messages carry partial sums.
    """
    return group_size == 2 or group_size & (group_size - 1) != 0


def _shifts(message: jax.Array, axis_name: str, partition: np.ndarray) -> list[jax.Array]:
    """The messages received in each exchange step when the own value travels."""
    return [lax.ppermute(message, axis_name, perm) for perm in _exchange_perms(partition)]


def _butterfly_sum(
    buffers: Sequence[jax.Array], wires: Sequence[Any], axis_name: str, partition: np.ndarray
) -> list[jax.Array]:
    """Butterfly sum of each flat buffer over the group, in the buffers' dtypes.

    Partial sums travel, so each step sends what the previous one summed: one
    ``ppermute`` of one message holding all buffers per step. On a wire of a smaller
    range than its buffer (float16 ends at 65504), step b's sums of 2**b values travel
    divided by 2**b: a partial mean, not a sum past the wire's range. The scaling is
    exact, but float16 partial means below its smallest normal number (6.1e-5) can lose
    their last subnormal bit (at most 1.5e-8). Wires of the buffer's range (float32,
    bfloat16) send the sums as they are: scaled, a sum below 2**-126 * 2**b became a
    subnormal mean that XLA:CPU flushes to 0 (the group's members then disagreed), and
    the scaling cost a pass over the buffer each way.
    """
    acc = list(buffers)
    narrow = [jnp.finfo(w).maxexp < jnp.finfo(a.dtype).maxexp for a, w in zip(acc, wires)]
    for b, perm in enumerate(_exchange_perms(partition)):
        scale = [float(2**b) if n else 1.0 for n in narrow]
        sent = [a / s if s != 1 else a for a, s in zip(acc, scale)]
        received = _decode(lax.ppermute(_encode(sent, wires), axis_name, perm), acc, wires)
        acc = [a + (r * s if s != 1 else r) for a, r, s in zip(acc, received, scale)]
    return acc


_FLAT_SWITCH_MAX = 32


def _switch(index: jax.Array, branches: Sequence[Any], *operands: Any) -> Any:
    """``lax.switch``, as a two-level tree above 32 branches (compile time: BENCHMARKS.md)."""
    k = len(branches)
    if k == 1:
        return branches[0](*operands)
    if k <= _FLAT_SWITCH_MAX:
        return lax.switch(index, branches, *operands)
    width = math.isqrt(k - 1) + 1  # ceil(sqrt(k))
    index = jnp.clip(jnp.asarray(index, jnp.int32), 0, k - 1)
    outer = [
        functools.partial(_inner_switch, branches[i : i + width]) for i in range(0, k, width)
    ]
    return lax.switch(index // width, outer, index % width, *operands)


def _inner_switch(branches: Sequence[Any], index: jax.Array, *operands: Any) -> Any:
    return lax.switch(index, branches, *operands)


def _buffer_keys(
    leaves: Sequence[jax.Array], wires: Sequence[Any]
) -> list[tuple[Any, Any]]:  # fmt: skip
    """(wire dtype, accumulation dtype) of each leaf: leaves sharing one share a buffer."""
    return [(jnp.dtype(w), jnp.dtype(_accum_dtype(x.dtype))) for x, w in zip(leaves, wires)]


def _pack(leaves: Sequence[jax.Array], keys: Sequence[tuple[Any, Any]]) -> list[jax.Array]:
    """Flat buffers, one per distinct key in order of appearance, in accumulation dtypes."""
    parts: dict[tuple[Any, Any], list[jax.Array]] = {}
    for x, key in zip(leaves, keys):
        parts.setdefault(key, []).append(x.astype(key[1]))
    return [jnp.concatenate([x.reshape(-1) for x in p]) if len(p) > 1 else p[0].reshape(-1)
            if len(leaves) > 1 else p[0] for p in parts.values()]  # fmt: skip


def _unpack(
    buffers: Sequence[jax.Array], leaves: Sequence[jax.Array], keys: Sequence[tuple[Any, Any]]
) -> list[jax.Array]:
    """Inverse of ``_pack``: arrays shaped like ``leaves``, in accumulation dtypes."""
    if len(leaves) == 1 and buffers[0].shape == leaves[0].shape:  # one leaf, in its shape
        return [buffers[0]]
    order = list(dict.fromkeys(keys))
    offsets = [0] * len(order)
    out = []
    for x, key in zip(leaves, keys):
        b = order.index(key)
        out.append(buffers[b][offsets[b] : offsets[b] + x.size].reshape(x.shape))
        offsets[b] += x.size
    return out


def varying_axes(x: jax.Array) -> frozenset:
    """The ``shard_map`` mesh axes ``x`` is typed as varying over (empty outside shard_map)."""
    kind = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(kind, "varying", None) or ())


def _split_by_varying_axes(tree: PyTree) -> tuple[list, Any, list[list[int]]] | None:
    """Leaves, treedef and index groups by varying axes; None when all leaves agree.

    Packing leaves of different ``shard_map`` types (e.g. pipeline-stage-sharded
    blocks and stage-replicated embeddings) into one message would type every
    result as varying over the union of their axes.
    """
    leaves, treedef = jax.tree.flatten(tree)
    kinds = [varying_axes(x) for x in leaves]
    if len(set(kinds)) <= 1:
        return None
    groups = [[i for i, k in enumerate(kinds) if k == kind] for kind in dict.fromkeys(kinds)]
    return leaves, treedef, groups


def _per_kind(fn: Any, tree: PyTree) -> tuple | None:
    """``fn`` (leaf list -> tuple of leaf lists) per kind of leaf, reassembled into trees.

    None when all leaves are of one kind (then call ``fn`` on the tree itself).
    """
    split = _split_by_varying_axes(tree)
    if split is None:
        return None
    leaves, treedef, groups = split
    outs: list[list[Any]] = []
    for idx in groups:
        results = fn([leaves[i] for i in idx])
        outs = outs or [[None] * len(leaves) for _ in results]
        for out, result in zip(outs, results):
            for i, v in zip(idx, result):
                out[i] = v
    return tuple(jax.tree.unflatten(treedef, out) for out in outs)


def _replica_split_by_compiler() -> bool:
    """Inside a ``shard_map`` manual over the replicas whose other axes the compiler splits."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(mesh.manual_axes) and bool(mesh.auto_axes)


def as_stored(tree: PyTree) -> PyTree:
    """``tree``'s narrow float leaves (bfloat16, float16) held as stored, in their own dtypes.

    XLA (excess precision allowed, its default) computes 16-bit arithmetic in
    float32 and dropped the rounding of a bf16 leaf's last op on its way into
    the float32 accumulation, but not on its way into the message: under vmap
    and on one-device replicas a member added its own value unrounded and its
    partner's rounded, so the two members of a group of bf16 leaves (NoLoCo's
    theta with ``slow_dtype=jnp.bfloat16``) disagreed on their mean in most
    elements. The barrier keeps the rounding (nothing to do for 4-byte leaves).

    It holds the leaves' raw bits: XLA:CPU's YNN fusion of an elementwise producer
    with a reduction over replicas (``all_replica_mean`` under ``vmap``) computed
    the bf16 ops in float32 without their roundings through a barrier on the
    values, so the simulation's data-parallel mean of bf16 gradients differed from a
    split replica's in ~45 % of the elements (1 bf16 ulp).

    Args:
      tree: any pytree of arrays (other leaves pass through untouched).

    Returns:
      ``tree`` with the same values, its 16-bit float leaves pinned to their stored bits.
    """
    leaves, treedef = jax.tree.flatten(tree)
    narrow = [i for i, x in enumerate(leaves)
              if jnp.issubdtype(x.dtype, jnp.inexact) and jnp.dtype(x.dtype).itemsize < 4]
    if not narrow:
        return tree
    # One barrier per shard_map type: a barrier types every output as varying over the union
    # of its inputs' axes (stage-replicated leaves came back stage-varying).
    per_kind = _per_kind(lambda part: (as_stored(part),), tree)
    if per_kind is not None:
        return per_kind[0]
    bits = lax.optimization_barrier(
        [lax.bitcast_convert_type(leaves[i], _uint_of(leaves[i].dtype)) for i in narrow])
    for i, b in zip(narrow, bits):
        leaves[i] = lax.bitcast_convert_type(b, leaves[i].dtype)
    return jax.tree.unflatten(treedef, leaves)


def _group_sums(leaves: list, wires: list, axis_name: str, pool: np.ndarray,
                index: jax.typing.ArrayLike) -> list:  # fmt: skip
    """Sums of ``leaves`` over this replica's group, in accumulation dtypes, in one message."""
    leaves = as_stored(leaves)
    if _own_value_travels(pool.shape[-1]):
        # All leaves travel in one message per step, encoded before the switch;
        # the branches hold only the collectives, and what arrives is added in
        # order after it, leaf by leaf.
        sums = [x.astype(_accum_dtype(x.dtype)) for x in leaves]
        message = _encode(sums, wires)
        n = pool.shape[-1]
        if n == 2:  # a + b = b + a: both members already add the same two numbers
            branches = [functools.partial(_shifts, axis_name=axis_name, partition=p)
                        for p in pool]  # fmt: skip
            (received,) = _switch(index, branches, message)
            return [a + r for a, r in zip(sums, _decode(received, sums, wires))]

        def shifted(message: jax.Array, partition: np.ndarray) -> tuple:
            # terms[k] came from position (p - k) mod n; add them in position order, so every
            # member adds the same numbers in the same order (its own value when it travels
            # unrounded, i.e. the wire is the accumulation dtype)
            terms = [sums, *(_decode(r, sums, wires) for r in _shifts(message, axis_name,
                                                                        partition))]  # fmt: skip
            p = _position(partition, axis_name)
            out = None
            for q in range(n):
                term = [lax.select_n((p - q) % n, *t) for t in zip(*terms)]
                out = term if out is None else [a + b for a, b in zip(out, term)]
            return tuple(out)

        branches = [functools.partial(shifted, partition=p) for p in pool]
        return list(_switch(index, branches, message))
    # Partial sums travel: the branches sum flat buffers, one per
    # (wire, accumulation) dtype, sending all of them in one message per step.
    keys = _buffer_keys(leaves, wires)
    buffer_wires = [w for w, _ in dict.fromkeys(keys)]
    branches = [functools.partial(_butterfly_sum, wires=buffer_wires, axis_name=axis_name,
                                  partition=p) for p in pool]  # fmt: skip
    return _unpack(_switch(index, branches, _pack(leaves, keys)), leaves, keys)


def check_exchange_dtype(exchange_dtype: Any) -> None:
    """None, a float dtype of 2 bytes or more, or an 8-bit format name; anything else is a
    ``ValueError``. A 1-byte float dtype is refused: a plain cast to it has no scale, so
    weights past its range (448 for float8_e4m3fn) would arrive as NaN."""
    if exchange_dtype is None or quantize.is_codec(exchange_dtype):
        return
    try:
        dtype = jnp.dtype(exchange_dtype)
        ok = jnp.issubdtype(dtype, jnp.floating)
    except TypeError:
        ok = False
    errors.require(ok, "exchange_dtype", f"must be None, a float dtype (e.g. jnp.bfloat16) or "
                   f"one of {sorted(quantize.FORMATS)}, got {exchange_dtype!r}.")  # fmt: skip
    errors.require(dtype.itemsize > 1, "exchange_dtype", f"a plain cast to the 1-byte {dtype} "
                   f"has no scale (values past its range arrive as NaN or inf); pass the name "
                   f"'float8_e4m3fn' or 'int8' for block-scaled 8-bit codes, got "
                   f"{exchange_dtype!r}.")  # fmt: skip
    errors.require(jax.dtypes.canonicalize_dtype(dtype) == dtype, "exchange_dtype",
                   f"{dtype} needs jax_enable_x64 (JAX holds it as "
                   f"{jax.dtypes.canonicalize_dtype(dtype)}), got {exchange_dtype!r}.")  # fmt: skip


def _check_float_leaves(tree: PyTree, what: str) -> None:
    """Refuses integer and boolean leaves: counters are not averaged, and a butterfly's
    partial sums would travel cast to the leaf's dtype (an int8 sum wraps)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            raise errors.UserError(
                f"tree{jax.tree_util.keystr(path)}: {what} averages float leaves only, got "
                f"dtype {x.dtype}; leave integer and boolean leaves out (optim.trees."
                f"float_leaves).")  # fmt: skip


def group_mean(
    tree: PyTree,
    axis_name: str,
    pool: np.ndarray,
    index: jax.typing.ArrayLike,
    exchange_dtype: Any = None,
    weight: jax.Array | None = None,
) -> PyTree:
    """Mean of ``tree`` over this replica's group in partition ``pool[index]``.

    Args:
      tree: this replica's values (the replica axis is implicit).
      axis_name: the bound replica axis.
      pool: static partitions, [K, N // n, n] (see ``partition_pool``).
      index: traced, replica-uniform int selecting the partition.
      exchange_dtype: dtype of what travels; ``None`` keeps each leaf's dtype.
        The local contribution and the accumulation stay in at least float32,
        so the members of a group agree bit for bit only when nothing is
        rounded on the wire: float32 leaves, or 16-bit leaves whose own values
        travel (n = 2, 3, 5, ...; a butterfly's float32 partial sums travel
        rounded). ``"int8"`` or ``"float8_e4m3fn"``: all leaves travel as one
        block-wise 8-bit message with float32 scales (``noloco_jax.quantize``),
        and every member decodes its own message too, so the group always
        agrees on one mean, bit for bit.
      weight: optional per-replica presence (> 0 present). Present replicas
        average over the present members of their group; an absent replica
        gets its own value back, and its value (even NaN) reaches no one. The
        presence flag travels as one float32 per message.

    Returns:
      A tree like ``tree`` (leaves promoted to at least float32) holding the
      group means.

    Raises:
      UserError (a ``ValueError``): for an integer or boolean leaf.
    """
    check_exchange_dtype(exchange_dtype)
    _check_float_leaves(tree, "group_mean")
    per_kind = _per_kind(lambda part: (group_mean(part, axis_name, pool, index, exchange_dtype,
                                                  weight),), tree)  # fmt: skip
    if per_kind is not None:  # one message per kind of leaf, so no leaf takes another's type
        return per_kind[0]
    if quantize.is_codec(exchange_dtype):
        return _group_mean_codec(tree, axis_name, pool, index, exchange_dtype, weight)[0]
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    wires = [exchange_dtype or x.dtype for x in leaves]
    present = None
    if weight is not None:
        # Absent members (weight 0) contribute nothing - not even NaN - and an
        # absent replica keeps its own value. The flag travels as float32.
        present = _present(weight)
        leaves = [jnp.where(present, x, jnp.zeros_like(x)) for x in leaves]
        leaves.append(present.astype(jnp.float32))
        wires.append(jnp.float32)
    n = pool.shape[-1]
    if len(leaves) > 1 and _replica_split_by_compiler():
        # Each leaf (and the presence flag) travels alone and in its shape: packing split
        # leaves into one flat message would make the compiler move every shard inside
        # the replica first. The sums are the same, leaf by leaf.
        sums = [_group_sums([x], [w], axis_name, pool, index)[0] for x, w in zip(leaves, wires)]
    else:
        sums = _group_sums(leaves, wires, axis_name, pool, index)
    if present is None:
        return jax.tree.unflatten(treedef, [v / n for v in sums])
    *sums, count = sums
    means = [
        jnp.where(present, v / jnp.maximum(count, 1.0), x.astype(v.dtype))
        for x, v in zip(jax.tree.leaves(tree), sums)
    ]
    return jax.tree.unflatten(treedef, means)


def _group_mean_codec(
    tree: PyTree,
    axis_name: str,
    pool: np.ndarray,
    index: jax.typing.ArrayLike,
    fmt: str,
    weight: jax.Array | None = None,
) -> tuple[PyTree, PyTree, PyTree]:
    """``group_mean`` with an 8-bit wire format; also what it sent, and whether it joined.

    All leaves form one float32 vector, sent as ``quantize.encode`` bytes (with
    the presence flag's 4 bytes appended). Each member sums the *decoded*
    messages, its own included, in group-position order, so the members of a
    group compute one mean, bit for bit. With a butterfly the partial sums are
    re-quantised at every step; what "sent" leaves out then also holds this member's share of
    those roundings (a partial sum's error split over its present senders), so that error
    feedback returns them too.
    """
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:  # nothing to send (as group_mean's other wires)
        return tree, tree, tree
    present = _present(weight)
    if present is not None:
        leaves = [jnp.where(present, x, jnp.zeros_like(x)) for x in leaves]
    flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in leaves])
    size = flat.size
    flag = jnp.ones([1], jnp.float32) if present is None else present.astype(jnp.float32)[None]

    def enc(values: jax.Array, count: jax.Array) -> jax.Array:
        message = quantize.encode(values, fmt)
        return message if present is None else jnp.concatenate([message, _as_words(count, jnp.uint8)])

    def dec(message: jax.Array) -> tuple[jax.Array, jax.Array]:
        wire = quantize.wire_bytes(size)
        count = flag if present is None else _from_words(message[wire:], jnp.float32, 1)
        return quantize.decode(message[:wire], size, fmt), count

    def in_order(messages: list, position: jax.Array, source_of: Any) -> tuple:
        """Sum of the decoded messages in group-position order. Every member decodes the same
        bytes in the same order, so the group agrees bit for bit (the compiler cannot fold a
        member's own message back into its unrounded values: the choice is made at run time)."""
        total = count = None
        for q in range(len(messages)):
            values, c = dec(lax.select_n(source_of(q, position), *messages))
            total, count = (values, c) if total is None else (total + values, count + c)
        return total, count

    own = quantize.roundtrip(flat, fmt)
    n = pool.shape[-1]
    if _own_value_travels(n):

        def shifts(message: jax.Array, partition: np.ndarray) -> tuple:
            # messages[k] came from position (p - k) mod n, for k = 0 (its own) to n - 1
            messages = [message, *_shifts(message, axis_name, partition)]
            return in_order(messages, _position(partition, axis_name), lambda q, p: (p - q) % n)

        branches = [functools.partial(shifts, partition=p) for p in pool]
        total, count = _switch(index, branches, enc(flat, flag))
        relayed = jnp.zeros_like(flat)
    else:

        def butterfly(values: jax.Array, count: jax.Array, partition: np.ndarray) -> tuple:
            position = _position(partition, axis_name)
            relayed = jnp.zeros_like(values)
            for b, perm in enumerate(_exchange_perms(partition)):
                mine = enc(values, count)
                if b:  # a re-quantised partial sum: its present senders share its rounding
                    senders = 2.0**b if present is None else jnp.maximum(count[0], 1.0)
                    relayed += (values - dec(mine)[0]) / senders
                pair = [mine, lax.ppermute(mine, axis_name, perm)]
                # the partner's is first when this member holds the higher position
                values, count = in_order(pair, position, lambda q, p: ((p >> b) & 1) ^ q)
            return values, count, relayed

        branches = [functools.partial(butterfly, partition=p) for p in pool]
        total, count, relayed = _switch(index, branches, flat, flag)
    # A present replica alone in its group exchanged nothing: like an absent one, it keeps
    # its exact value rather than its own decoded message.
    joined = jnp.array(True) if present is None else present & (count[0] > 1)
    means, sent, start = [], [], 0
    for x, orig in zip(leaves, jax.tree.leaves(tree)):
        stop = start + x.size
        v = (total[start:stop] / (n if present is None else jnp.maximum(count[0], 1.0)))
        v = v.reshape(x.shape)
        if present is not None:
            v = jnp.where(joined, v, orig.astype(v.dtype))
        means.append(v)
        sent.append((own - relayed)[start:stop].reshape(x.shape))
        start = stop
    trees = (jax.tree.unflatten(treedef, x) for x in (means, sent, [joined] * len(means)))
    return tuple(trees)


def group_mean_codec(
    tree: PyTree,
    axis_name: str,
    pool: np.ndarray,
    index: jax.typing.ArrayLike,
    fmt: str,
    weight: jax.Array | None = None,
) -> tuple[PyTree, PyTree, PyTree]:
    """``group_mean`` with an 8-bit format, what this replica sent, and whether it joined.

    The second output is what error feedback needs: the residual of this
    replica's message is ``tree - sent``. The third, a tree like ``tree`` of
    boolean scalars (one per leaf, typed like its leaf under ``shard_map``), is
    False for a replica whose message nobody used: an absent one, or a present
    one whose partners are all absent (both get their own exact ``tree`` back).
    """
    _check_float_leaves(tree, f"group_mean with exchange_dtype={fmt!r}")
    run = functools.partial(_group_mean_codec, axis_name=axis_name, pool=pool, index=index,
                            fmt=fmt, weight=weight)  # fmt: skip
    per_kind = _per_kind(run, tree)
    return run(tree) if per_kind is None else per_kind


def all_replica_mean(
    tree: PyTree, axis_name: str, weight: jax.Array | None = None, exchange_dtype: Any = None,
    *, absent_takes_mean: bool = False,
) -> PyTree:
    """All-reduce mean over every replica (DiLoCo and data-parallel).

    With ``weight`` (per-replica presence), present replicas average over the
    present ones and an absent replica keeps its own value, or with
    ``absent_takes_mean`` gets their mean too (zeros when none is present). With an
    ``exchange_dtype`` other than the leaves' own float32 (``jnp.bfloat16``,
    ``"int8"``, ``"float8_e4m3fn"``) the mean is ``all_replica_mean_wire``'s; on a
    replica the compiler splits, a plain float wire sends each leaf alone in its own shape
    (the same numbers), so each device sends its share rather than the whole replica.
    Otherwise it is an all-reduce that sums in at least float32 and returns each
    leaf's dtype: a bfloat16 leaf travels as float32 and comes back as its
    correctly rounded mean, the same under ``vmap`` and ``shard_map`` (a sum in
    bfloat16 would round at every addition, differently on each backend). Integer and
    boolean leaves are refused (a ``UserError``): their mean was truncated to the integer.
    """
    check_exchange_dtype(exchange_dtype)
    _check_float_leaves(tree, "all_replica_mean")
    if not _same_as_leaves(tree, exchange_dtype):
        if not quantize.is_codec(exchange_dtype) and _replica_split_by_compiler():
            return _all_replica_mean_by_leaf(tree, axis_name, exchange_dtype, weight,
                                             absent_takes_mean)  # fmt: skip
        return all_replica_mean_wire(tree, axis_name, exchange_dtype, weight,
                                     absent_takes_mean=absent_takes_mean)[0]  # fmt: skip
    present = _present(weight)
    count = None if weight is None else lax.psum(present.astype(jnp.float32), axis_name)
    # A bf16 leaf fresh from bf16 arithmetic (a gradient) is summed as stored: XLA kept its
    # last op unrounded into the float32 sum on whole replicas, not on split ones.
    tree = as_stored(tree)

    def leaf(x: jax.Array) -> jax.Array:
        wide = x.astype(_sum_dtype(x.dtype))
        if present is None:
            return lax.pmean(wide, axis_name).astype(x.dtype)
        total = lax.psum(jnp.where(present, wide, jnp.zeros_like(wide)), axis_name)
        mean = (total / jnp.maximum(count, 1.0)).astype(x.dtype)
        return mean if absent_takes_mean else jnp.where(present, mean, x)

    return jax.tree.map(leaf, tree)


def _sum_dtype(dtype: Any) -> Any:
    """What ``all_replica_mean`` sums a leaf in: floats at least float32, others as they are."""
    return _accum_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else dtype


def _same_as_leaves(tree: PyTree, exchange_dtype: Any) -> bool:
    """Whether ``exchange_dtype`` asks for the plain all-reduce: None, or every leaf's own dtype
    when that is at least float32 wide (a 16-bit wire goes through ``all_replica_mean_wire``,
    which sends 16 bits and sums them in float32)."""
    if exchange_dtype is None:
        return True
    if quantize.is_codec(exchange_dtype):
        return False
    wire = jnp.dtype(exchange_dtype)
    return wire == _sum_dtype(wire) and all(x.dtype == wire for x in jax.tree.leaves(tree))


def _to_wire(rows: jax.Array, wire: Any) -> jax.Array:
    """float32 rows [M, S] as [M, W] unsigned words: 8-bit codes + scales, or raw wire bits."""
    if quantize.is_codec(wire):
        return jax.vmap(lambda r: quantize.encode(r, wire))(rows)
    # Raw bits, so the compiler cannot move the narrowing cast behind the collective.
    return _as_words(rows.astype(wire), _uint_of(wire)).reshape(rows.shape[0], -1)


def _from_wire(words: jax.Array, wire: Any, size: int) -> jax.Array:
    """Inverse of ``_to_wire``: float32 rows [M, size]."""
    if quantize.is_codec(wire):
        return jax.vmap(lambda b: quantize.decode(b, size, wire))(words)
    # Under vmap the collective is a copy, and XLA (excess precision allowed) dropped the
    # narrowing cast before it with the widening one after it: the barrier keeps the rounding.
    words = lax.optimization_barrier(words)
    return lax.bitcast_convert_type(words, jnp.dtype(wire)).astype(jnp.float32)


def _wire_roundtrip(rows: jax.Array, wire: Any) -> jax.Array:
    """``_from_wire(_to_wire(rows))`` without the packing: what a receiver decodes."""
    if quantize.is_codec(wire):
        return jax.vmap(lambda r: quantize.roundtrip(r, wire))(rows)
    return rows.astype(wire).astype(jnp.float32)


def _wire_unit(num_replicas: int, wire: Any) -> int:
    """The flat vector is padded to a multiple of this: N shards of whole scale blocks."""
    return num_replicas * (quantize.BLOCK if quantize.is_codec(wire) else 1)


def _shard_mean(rows: jax.Array, axis_name: str, wire: Any, present: jax.Array | None
                ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Stage 1: all-to-all of the wire rows; this replica's shard of the (present) mean.

    Row j of ``rows`` is the shard that replica j owns. Returns the owner's
    float32 mean of its shard and the count it divided by.
    """
    num, shard = rows.shape
    message = _to_wire(rows, wire)
    width = message.shape[1]
    if present is not None:  # the presence flag rides along, as float32 bits
        flag = _as_words(present.astype(jnp.float32)[None], message.dtype)
        message = jnp.concatenate([message, jnp.broadcast_to(flag, (num, flag.size))], axis=1)
    received = lax.all_to_all(message, axis_name, 0, 0, tiled=True)  # row j: from replica j
    values = _from_wire(received[:, :width], wire, shard)
    if present is None:
        count = jnp.asarray(float(num), jnp.float32)
    else:
        flags = _from_words(received[:, width:].reshape(-1), jnp.float32, num)
        count = jnp.maximum(jnp.sum(flags), 1.0)
    return _over_count(jnp.sum(values, axis=0), count, present), count


def _present(weight: jax.Array | None) -> jax.Array | None:
    """``weight > 0``: a bool mask or a float weight, compared in its own dtype (a Python 0
    beside a bool is refused under ``jax_numpy_dtype_promotion='strict'``)."""
    return None if weight is None else weight > jnp.zeros((), jnp.result_type(weight))


def _over_count(total: jax.Array, count: jax.Array, present: jax.Array | None) -> jax.Array:
    """``total / count`` as both wire paths compute it. A present count is traced, and XLA
    turned the flat path's division by it into a product with its reciprocal (a split
    replica's by-leaf path kept the division): written so, both give the same bits."""
    return total / count if present is None else total * (1.0 / count)


def _all_replica_mean_wire(tree: PyTree, axis_name: str, wire: Any, weight: jax.Array | None,
                           absent_takes_mean: bool) -> tuple[PyTree, PyTree, PyTree]:  # fmt: skip
    leaves, treedef = jax.tree.flatten(tree)
    num = axis_size(axis_name)
    if num == 1 or not leaves:  # nothing to exchange, so nothing is encoded
        zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), tree)
        return tree, zeros, zeros
    present = _present(weight)
    flat = jnp.concatenate([x.astype(jnp.float32).reshape(-1) for x in leaves])
    if present is not None:  # an absent replica contributes nothing, not even NaN
        flat = jnp.where(present, flat, jnp.zeros_like(flat))
    size = flat.size
    rows = jnp.pad(flat, (0, -size % _wire_unit(num, wire))).reshape(num, -1)
    shard = rows.shape[1]
    mean, count = _shard_mean(rows, axis_name, wire, present)
    gathered = lax.all_gather(_to_wire(mean[None], wire)[0], axis_name)  # every owner's shard
    means = _from_wire(gathered, wire, shard).reshape(-1)[:size]
    send_left = (rows - _wire_roundtrip(rows, wire)).reshape(-1)[:size]
    relay = count * (mean - _wire_roundtrip(mean[None], wire)[0])
    mine = lax.axis_index(axis_name)
    # (the _in_dim form: a literal 0 index is int64 under jax_enable_x64, axis_index int32)
    relay_left = lax.dynamic_update_slice_in_dim(jnp.zeros((num, shard), jnp.float32),
                                                 relay[None], mine, 0).reshape(-1)[:size]
    outs: tuple[list, list, list] = ([], [], [])
    start = 0
    for x in leaves:
        stop = start + x.size
        m = means[start:stop].reshape(x.shape).astype(x.dtype)
        outs[0].append(m if present is None or absent_takes_mean else jnp.where(present, m, x))
        outs[1].append(send_left[start:stop].reshape(x.shape))
        outs[2].append(relay_left[start:stop].reshape(x.shape))
        start = stop
    return tuple(jax.tree.unflatten(treedef, o) for o in outs)


def _cut_axis(shape: tuple, num: int) -> int | None:
    """The last axis of ``shape`` that ``num`` divides; None when none does."""
    return next((k for k in reversed(range(len(shape))) if shape[k] % num == 0), None)


def _in_replica_order(own: jax.Array, sent: Any, axis_name: str, num: int) -> jax.Array:
    """[N, ...]: what replicas 0..N-1 hold: ``own`` here, ``sent(s)`` from replica p - s,
    sent by a shift of s (p: this replica). A collective-permute keeps a split array split
    inside the replica, where an all-to-all or all-gather over the replicas gathers it first.

    Shift s arrived from replica (p - s) mod N, so replica order is the shifts reversed and
    rotated: one slice of them written twice, not N selects of N operands.
    """
    terms = [own] + [lax.ppermute(sent(s), axis_name, [(i, (i + s) % num) for i in range(num)])
                     for s in range(1, num)]  # fmt: skip
    backwards = jnp.stack(terms[::-1] * 2)  # row j: the shift (N - 1 - j) mod N
    start = num - 1 - lax.axis_index(axis_name)
    return lax.dynamic_slice_in_dim(backwards, start, num, axis=0)


def _leaf_mean_wire(x: jax.Array, axis_name: str, wire: Any, present: jax.Array | None,
                    count: jax.Array) -> jax.Array:  # fmt: skip
    """Float32 mean of one leaf over a plain float wire, sent in the leaf's own shape.

    The leaf is cut into N parts along the last axis N divides (padded on its last axis
    when none does): element i of that axis is in part i mod N, which replica i mod N
    sums. Each element's mean is the one ``all_replica_mean_wire`` computes (the sum in
    replica order of the wire-rounded values, divided by ``count``, rounded to the wire),
    whichever part it falls in; the bytes are its all-to-all's and all-gather's.
    """
    num = axis_size(axis_name)
    v = x.astype(jnp.float32).reshape(x.shape or (1,))
    if present is not None:  # an absent replica contributes nothing, not even NaN
        v = jnp.where(present, v, jnp.zeros_like(v))
    k = _cut_axis(v.shape, num)
    if k is None:
        k = v.ndim - 1
        v = jnp.pad(v, [(0, 0)] * k + [(0, -v.shape[k] % num)])
    parts = v.reshape(v.shape[:k] + (v.shape[k] // num, num) + v.shape[k + 1 :])
    bits = lax.bitcast_convert_type(parts.astype(wire), _uint_of(wire))
    mine = lax.axis_index(axis_name)

    def part(s: int) -> jax.Array:  # the part replica p + s sums
        return lax.dynamic_index_in_dim(bits, (mine + s) % num, k + 1, keepdims=False)

    terms = _in_replica_order(part(0), part, axis_name, num)
    mean = _over_count(jnp.sum(_from_wire(terms, wire, 0), axis=0), count, present)
    bits = lax.bitcast_convert_type(mean.astype(wire), _uint_of(wire))
    means = jnp.moveaxis(_in_replica_order(bits, lambda s: bits, axis_name, num), 0, k + 1)
    last = x.shape[-1] if x.ndim else 1
    return _from_wire(means, wire, 0).reshape(v.shape)[..., :last].reshape(x.shape)


def _all_replica_mean_by_leaf(tree: PyTree, axis_name: str, wire: Any, weight: jax.Array | None,
                              absent_takes_mean: bool) -> PyTree:  # fmt: skip
    """``all_replica_mean_wire``'s mean over a plain float wire, each leaf sent alone.

    On a replica the compiler splits, one flat message of all leaves made every device
    of the replica gather and send the whole of it; a leaf in its own shape stays split.
    The numbers are the same, element by element (``_leaf_mean_wire``).
    """
    if axis_size(axis_name) == 1 or any(not jnp.issubdtype(x.dtype, jnp.inexact)
                                        for x in jax.tree.leaves(tree)):  # fmt: skip
        return all_replica_mean_wire(tree, axis_name, wire, weight,
                                     absent_takes_mean=absent_takes_mean)[0]  # fmt: skip
    present = _present(weight)
    count = jnp.asarray(float(axis_size(axis_name)), jnp.float32)
    if present is not None:  # the presence flags travel once, as float32
        flags = lax.all_gather(present.astype(jnp.float32), axis_name)
        count = jnp.maximum(jnp.sum(flags), 1.0)

    def leaf(x: jax.Array) -> jax.Array:
        m = _leaf_mean_wire(x, axis_name, wire, present, count).astype(x.dtype)
        return m if present is None or absent_takes_mean else jnp.where(present, m, x)

    return jax.tree.map(leaf, tree)


def all_replica_mean_wire(
    tree: PyTree, axis_name: str, exchange_dtype: Any, weight: jax.Array | None = None,
    *, absent_takes_mean: bool = False,
) -> tuple[PyTree, PyTree, PyTree]:
    """Mean over every replica whose collectives move ``exchange_dtype`` values only.

    Narrow values cannot be summed on the wire (an all-reduce of int8 codes
    overflows and ignores the scales, and the CPU backend widens a bfloat16
    all-reduce to float32), so the sum runs locally, as in a ring all-reduce
    split into its two halves:

    1. All leaves form one float32 vector, padded to N shards (of whole
       256-value scale blocks for 8-bit formats). An ``all_to_all`` sends
       shard j, encoded, to replica j.
    2. Replica j decodes the N versions of its shard, sums them in float32
       and divides by N (by the present count with ``weight``).
    3. An ``all_gather`` sends each owner's encoded mean shard to all.
       Every replica decodes the same bytes, so all hold one bit-identical
       mean.

    Each replica sends ``2 (N - 1)`` encoded shards, the ring all-reduce's
    ``2 (N - 1) / N`` of the whole message (``diloco_bytes_per_sync``).

    Args:
      tree: this replica's values (float leaves).
      axis_name: the bound replica axis.
      exchange_dtype: ``"int8"``, ``"float8_e4m3fn"`` (``noloco_jax.quantize``
        block formats) or a float dtype.
      weight: optional per-replica presence (> 0 present): the present
        replicas average among themselves (the flag travels with step 1 as
        float32) and an absent replica gets its own value back.
      absent_takes_mean: an absent replica gets the present replicas' mean
        too (zeros when none is present), as ``all_replica_mean``.

    Returns:
      ``(mean, send_left, relay_left)``, trees like ``tree``: the mean (in
      each leaf's dtype), what this replica's step-1 encoding left out, and
      what its step-3 encoding of the shard it owns left out, times the count
      it divided by, placed on that shard (zero elsewhere). Adding both to the
      next message is error feedback for the two quantisations: the running
      sum of the means then differs from the exact one by the mean of the
      replicas' last residuals alone.
    """
    check_exchange_dtype(exchange_dtype)
    _check_float_leaves(tree, f"all_replica_mean_wire with exchange_dtype={exchange_dtype!r}")
    run = functools.partial(_all_replica_mean_wire, axis_name=axis_name, wire=exchange_dtype,
                            weight=weight, absent_takes_mean=absent_takes_mean)  # fmt: skip
    per_kind = _per_kind(run, tree)
    return run(tree) if per_kind is None else per_kind


def tree_num_elements(tree: PyTree) -> int:
    """Total number of elements in a pytree of arrays (or ShapeDtypeStructs)."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def _tree_bytes(tree: PyTree, dtype: Any) -> int:
    if quantize.is_codec(dtype):
        return quantize.wire_bytes(tree_num_elements(tree))
    return sum(
        int(np.prod(x.shape)) * jnp.dtype(dtype or x.dtype).itemsize for x in jax.tree.leaves(tree)
    )


def _sent_leaves(params: PyTree) -> list:
    """The leaves an outer step sends: the float ones (integer buffers are neither sent nor
    moved, ``noloco_outer``'s and ``diloco_outer``'s ``float_leaves``), a complex one as the
    real (real, imag) pairs that travel (``optim.trees.as_real``)."""
    def sent(x: Any) -> Any:
        dtype = jnp.result_type(x)
        if not jnp.issubdtype(dtype, jnp.complexfloating):
            return x
        return jax.ShapeDtypeStruct((*jnp.shape(x), 2), jnp.finfo(dtype).dtype)

    return [sent(x) for x in jax.tree.leaves(params)
            if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]  # fmt: skip


def noloco_bytes_per_sync(
    params: PyTree,
    *,
    group_size: int = 2,
    gamma_equals_beta: bool = True,
    exchange_dtype: Any = None,
    with_presence: bool = False,
) -> int:
    """Bytes one replica sends in one NoLoCo outer step.

    With gamma = beta only the fast weights travel (one tensor per leaf);
    otherwise the slow weights travel too (two). Each tensor takes
    ``exchange_steps(group_size)`` messages.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``); only its float
        leaves travel.
      group_size: n.
      gamma_equals_beta: whether ``gamma`` is ``None`` (or equal to beta).
      exchange_dtype: dtype on the wire; ``None`` means the leaves' dtypes;
        ``"int8"``/``"float8_e4m3fn"``: 8-bit codes plus a float32 scale per
        ``quantize.BLOCK`` values.
      with_presence: a float32 presence flag travels with each message (drop-out
        or the non-finite guard enabled).

    Returns:
      Bytes sent per replica per sync (received bytes are equal).
    """
    errors.check_bool("gamma_equals_beta", gamma_equals_beta)  # "no" was truthy
    errors.check_bool("with_presence", with_presence)
    params = _sent_leaves(params)
    tensors = 1 if gamma_equals_beta else 2
    flag = 4 if with_presence else 0
    if quantize.is_codec(exchange_dtype):  # one message of all values, with block scales
        payload = quantize.wire_bytes(tensors * tree_num_elements(params))
    else:
        payload = tensors * _tree_bytes(params, exchange_dtype)
    return exchange_steps(group_size) * (payload + flag)


def diloco_bytes_per_sync(
    params: PyTree, num_replicas: int, *, exchange_dtype: Any = None, with_presence: bool = False
) -> float:
    """Bytes one replica sends in one DiLoCo outer step (``all_replica_mean``).

    ``exchange_dtype=None`` (or the leaves' own float32): an all-reduce summed
    in at least float32, counted as a bandwidth-optimal ring
    (``mean_bytes_per_replica``), with the float32 presence count in the same
    all-reduce when ``with_presence``. Otherwise
    ``all_replica_mean_wire``'s all-to-all and all-gather, exactly: the
    leaves' n values are padded to N shards of S values (S a multiple of
    ``quantize.BLOCK`` for 8-bit formats), and each replica sends 2 (N - 1)
    encoded shards, plus the float32 presence flag with each of the N - 1
    all-to-all messages when ``with_presence``. On a split replica a plain float
    wire sends leaf by leaf, each padded alone (nothing where N divides one of
    its axes), so the count there is close rather than exact.

    Args:
      params: the parameter tree (arrays or ``jax.ShapeDtypeStruct``); only its float
        leaves travel.
      num_replicas: N.
      exchange_dtype: as ``diloco_outer``'s.
      with_presence: drop-out or the non-finite guard enabled.

    Returns:
      Bytes sent per replica per sync (received bytes are equal).
    """
    errors.check_bool("with_presence", with_presence)  # "no" was a TypeError or truthy
    if errors.check_int("num_replicas", num_replicas) == 1:
        return 0.0
    params = _sent_leaves(params)
    if _same_as_leaves(params, exchange_dtype):  # the presence count rides in the all-reduce
        presence = 2 * (num_replicas - 1) / num_replicas * 4 * with_presence
        return mean_bytes_per_replica(params, num_replicas) + presence
    n = tree_num_elements(params)
    unit = _wire_unit(num_replicas, exchange_dtype)
    shard = -(-n // unit) * unit // num_replicas
    if quantize.is_codec(exchange_dtype):
        message = quantize.wire_bytes(shard)
    else:
        message = shard * jnp.dtype(exchange_dtype).itemsize
    return float(2 * (num_replicas - 1) * message + (num_replicas - 1) * 4 * with_presence)


def mean_bytes_per_replica(tree: PyTree, num_replicas: int) -> float:
    """Bytes one replica sends in ``all_replica_mean`` without an exchange dtype (DiLoCo's
    default and data parallel's gradient mean): a ring all-reduce of the leaves at the width
    they are summed in, float32 for 16-bit floats.

    Args:
      tree: the tree being averaged (arrays or ``jax.ShapeDtypeStruct``).
      num_replicas: N.

    Returns:
      Bytes sent per replica.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> mean_bytes_per_replica(jax.ShapeDtypeStruct((1000,), jnp.bfloat16), 4)
      6000.0
    """
    wide = [jax.ShapeDtypeStruct(x.shape, _sum_dtype(x.dtype)) for x in jax.tree.leaves(tree)]
    return allreduce_bytes_per_replica(wide, num_replicas)


def allreduce_bytes_per_replica(params: PyTree, num_replicas: int, *, dtype: Any = None) -> float:
    """Bytes one replica sends in a bandwidth-optimal (ring) all-reduce of ``params``.

    A ring all-reduce is a reduce-scatter followed by an all-gather; each
    replica sends 2 (N - 1) / N buffers. This is the lower bound for any
    all-reduce algorithm, so it flatters DiLoCo and data parallel.

    Args:
      params: the tree being reduced (arrays or ``jax.ShapeDtypeStruct``).
      num_replicas: N.
      dtype: dtype on the wire; ``None`` means the leaves' dtypes.

    Returns:
      Bytes sent per replica.
    """
    if errors.check_int("num_replicas", num_replicas) == 1:
        return 0.0
    return 2.0 * (num_replicas - 1) / num_replicas * _tree_bytes(params, dtype)

