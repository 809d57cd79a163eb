"""How N replicas run: simulated on one device (``vmap``) or one per device (``shard_map``).

Everything above this module sees trees in the *replicated layout*:

* per-replica leaves carry a leading axis of size N (params, Adam moments,
  slow weights, outer momentum, per-replica RNG keys, ...);
* shared leaves - integer and boolean scalars such as the step and round
  counters, which are identical on all replicas - carry no replica axis. The
  inner optimizer's state inside ``local_steps`` (its ``local_opt_state``) is the
  exception: all of it is per replica, counts included, because the
  non-finite guard restarts one replica's inner optimizer (its moments and
  count; a schedule's position is kept) without touching the others.

Keeping counters shared is what lets ``lax.cond``/``lax.switch`` on them stay
real branches under ``vmap`` (a batched predicate would turn both branches
into a ``select`` and run the outer step, and every group draw, on every
step). Under ``shard_map`` shared leaves are replicated (``P()``) and
per-replica leaves are split over the mesh axis, one replica per device.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

PyTree = Any

__all__ = [
    "Replicas",
    "is_shared_leaf",
    "key_name",
    "replica_axes",
    "replicate",
    "unreplicate",
    "select_replica",
    "make_replicas",
    "replica_mesh",
    "nnx_state_axes",
    "to_host",
]


# Fields whose whole subtree is per replica, whatever the dtypes: the inner
# optimizer's state of ``local_steps`` (the guard resets one replica's) and the
# slow weights (integer leaves of params are per-replica values, not counters).
_PER_REPLICA_FIELDS = frozenset({"local_opt_state", "slow_params"})


def key_name(key: Any) -> str:
    """A pytree path entry's name: the attribute, dict key or sequence index, as a string."""
    return str(getattr(key, "name", getattr(key, "key", getattr(key, "idx", key))))


def is_shared_leaf(x: Any, path: tuple = ()) -> bool:
    """Whether a leaf of a single-replica tree is shared by all replicas.

    Integer (and boolean) scalars are counters and flags that every replica
    holds identically; everything else is per-replica, and so is everything
    under a ``local_opt_state`` or ``slow_params`` field (``LocalStepsState``).

    Args:
      x: the leaf (an array or ``jax.ShapeDtypeStruct``).
      path: its key path in the tree (``jax.tree_util.tree_map_with_path``),
        or the path of an NNX state; ``()`` when unknown.

    Returns:
      True for a shared leaf.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None or getattr(x, "ndim", 1) != 0:
        return False
    if any(key_name(k) in _PER_REPLICA_FIELDS for k in path):
        return False
    return bool(jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.bool_))


def _map_shared(fn: Callable[[bool, Any], Any], tree: PyTree) -> PyTree:
    """``fn(is_shared, leaf)`` over the leaves of a single-replica tree."""
    return jax.tree_util.tree_map_with_path(lambda p, x: fn(is_shared_leaf(x, p), x), tree)


def replica_axes(tree: PyTree) -> PyTree:
    """``vmap`` axes for a single-replica tree: ``None`` if shared, else 0.

    Also right for a tree already in the replicated layout (a per-replica
    scalar has shape [N] there, so it is not taken for a shared one).
    """
    return _map_shared(lambda shared, x: None if shared else 0, tree)


def replicate(tree: PyTree, num_replicas: int) -> PyTree:
    """Copies a single-replica tree to every replica (identical init)."""
    from noloco_jax import errors  # noqa: PLC0415

    errors.check_int("num_replicas", num_replicas, 1)  # 0 gave a tree of no replicas

    def rep(shared: bool, x: Any) -> Any:
        x = jnp.asarray(x)
        return x if shared else jnp.broadcast_to(x[None], (num_replicas, *x.shape))

    return _map_shared(rep, tree)


def select_replica(tree: PyTree, index: int, single_replica_like: PyTree) -> PyTree:
    """Replica ``index``'s view of a replicated tree (``index`` in [-N, N - 1], as a list's).

    An index past the replicas is a ``UserError``: the gather clamped it to the last (or
    first) replica, so its weights came back as another replica's.
    """
    from noloco_jax import errors  # noqa: PLC0415

    axes = replica_axes(single_replica_like)
    leaves = zip(jax.tree.leaves(tree), jax.tree.leaves(axes, is_leaf=_is_none))
    sizes = [jnp.shape(x)[0] for x, a in leaves if a is not None]
    if isinstance(index, (np.ndarray, jax.Array)) and not isinstance(index, jax.core.Tracer):
        if index.ndim != 0:  # [5] was clamped too, and gave every leaf a leading axis of 1
            raise errors.UserError(f"index must be one replica's index (an int or a 0-d array), "
                                   f"got an array of shape {index.shape}.")  # fmt: skip
        if np.issubdtype(index.dtype, np.integer):
            index = int(index)  # a concrete 0-d integer array: checked as an int (not clamped)
    if sizes and not isinstance(index, jax.Array):
        errors.check_int("index", index, -sizes[0], sizes[0] - 1)
    return jax.tree.map(lambda x, a: x if a is None else _pick(x, index), tree, axes)


def _pick(x: Any, index: Any) -> Any:
    """``x[index]``; a replica axis placed on a mesh (``reps.put``, ``reps.map``) is picked
    from by ``_pick_placed``: indexing it raised JAX's ShardingTypeError ("out sharding could
    not be resolved"). A split inside the replica (``mesh.fsdp``, ``mesh.tensor``) stays as
    placed."""
    sharding = getattr(jax.typeof(x), "sharding", None) if isinstance(x, jax.Array) else None
    if sharding is not None and sharding.spec and sharding.spec[0] is not None:
        if x.dtype == jnp.bool_ or _uint_of(x.dtype) is not None:
            return _pick_placed(x, index, sharding)
    if sharding is not None and any(s is not None for s in sharding.spec):
        x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P()))
    return x[index]


@functools.partial(jax.jit, static_argnums=2)  # one program per shape, dtype and placement
def _pick_placed(x: jax.Array, index: Any, sharding: Any) -> jax.Array:
    """``x[index]`` of a replica axis split over the mesh, moving one replica's bytes: each
    replica sends its bits where it is ``index`` and zeros elsewhere, summed as integers (exact:
    a gather of every replica first moved N replicas' bytes to pick one)."""
    spec, n = sharding.spec, x.shape[0]
    axes = spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    names = {a for s in spec if s is not None for a in (s if isinstance(s, tuple) else (s,))}
    i = jnp.clip(jnp.where(index < 0, index + n, index), 0, n - 1)  # as x[index] clamps
    boolean = x.dtype == jnp.bool_

    def pick(local: jax.Array) -> jax.Array:  # local: [n / replicas, ...]
        first = jax.lax.axis_index(axes) * local.shape[0]
        row = jax.lax.dynamic_index_in_dim(local, jnp.clip(i - first, 0, local.shape[0] - 1),
                                           keepdims=False)  # fmt: skip
        bits = row.astype(jnp.uint8) if boolean else jax.lax.bitcast_convert_type(
            row, _uint_of(row.dtype))
        mine = (i >= first) & (i < first + local.shape[0])
        return jax.lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), axes)

    bits = jax.shard_map(pick, mesh=sharding.mesh, in_specs=P(*spec), out_specs=P(*spec[1:]),
                         axis_names=names)(x)  # fmt: skip
    return bits.astype(jnp.bool_) if boolean else jax.lax.bitcast_convert_type(bits, x.dtype)


def _uint_of(dtype: Any) -> Any:
    """The unsigned integer type as wide as ``dtype``, or None where its bits cannot be moved
    as one (PRNG keys, complex and 4-bit types: ``_pick`` gathers those first)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return None
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return None
    info = jnp.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.iinfo(dtype)
    return {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}.get(info.bits)


def nnx_state_axes() -> Any:
    """``nnx.StateAxes`` that keep shared counters unbatched under ``nnx.vmap``.

    Use it for an ``nnx.Optimizer`` holding ``local_steps`` (see the Flax NNX
    recipe in the README): ``nnx.vmap(..., in_axes=(0, nnx_state_axes(), 0),
    axis_name="replica")``. Without it every counter gets the replica axis and
    ``local_steps`` refuses to run (its phase branch would become a select
    that runs the outer step on every step).
    """
    from flax import nnx  # noqa: PLC0415

    def shared(path: tuple, value: Any) -> bool:
        leaf = value.get_value() if hasattr(value, "get_value") else value
        return is_shared_leaf(leaf, path)

    return nnx.StateAxes({shared: None, ...: 0})


def unreplicate(tree: PyTree, single_replica_like: PyTree) -> PyTree:
    """Replica 0's view of a replicated tree."""
    return select_replica(tree, 0, single_replica_like)


def _stacked_axes(tree: PyTree, num_replicas: int, arg: int = 0) -> PyTree:
    """Axes of a tree already in the replicated layout (shared = no leading N)."""

    def axis(path: tuple, x: Any) -> Any:
        if is_shared_leaf(x, path):
            return None
        if getattr(x, "ndim", 0) == 0 or x.shape[0] != num_replicas:
            where = f"argument {arg}" + (jax.tree_util.keystr(path) if path else "")
            same = ("" if getattr(x, "ndim", 0) else
                    " A value the same for every replica (a float, a PRNG key): close over it "
                    "(functools.partial) instead of passing it; only integer and boolean "
                    "scalars are shared.")  # fmt: skip
            if "hyperparams" in where and not getattr(x, "ndim", 0):
                same = (f" An injected hyperparameter (optax.inject_hyperparams) holds one value "
                        f"per replica: set it as reps.put(jnp.full(({num_replicas},), value))."
                        )  # fmt: skip
            raise ValueError(
                f"Replicas.map: {where} needs a leading replica axis of size {num_replicas}, "
                f"got shape {jnp.shape(x)}.{same}")  # fmt: skip
        return 0

    return jax.tree_util.tree_map_with_path(axis, tree)


@dataclasses.dataclass(frozen=True)
class Replicas:
    """Runs per-replica functions over N replicas: the run's topology.

    Attributes:
      num_replicas: N.
      axis_name: the name collectives use (``noloco_outer(axis_name=...)``).
      mesh: ``None`` for simulation with ``vmap`` on one device; otherwise a
        mesh whose first axis is ``axis_name`` (N devices along it). Further
        axes split each replica over several devices (e.g. pipeline stages).
      leaf_axes: for meshes with intra-replica axes, ``leaf_axes(path, leaf)``
        gives the mesh axes of the leading dims of one replica's leaf (``()``:
        the leaf is whole on every device of its replica).
    """

    num_replicas: int
    axis_name: str = "replica"
    mesh: jax.sharding.Mesh | None = None
    leaf_axes: Callable[[tuple, Any], tuple] | None = None

    def __post_init__(self) -> None:
        """Refuses a mesh whose replica axis is missing or not N long (replicas would be lost)."""
        from noloco_jax import errors  # noqa: PLC0415

        errors.check_int("num_replicas", self.num_replicas, 1)
        # An int is a positional axis to lax.psum & co.: they reduced over a leaf's first dim.
        errors.require(isinstance(self.axis_name, str), "axis_name", f"must be a string (the "
                       f"name collectives use), got {self.axis_name!r}.")  # fmt: skip
        if self.mesh is None:
            return
        sizes = dict(zip(self.mesh.axis_names, self.mesh.axis_sizes))
        if sizes.get(self.axis_name) != self.num_replicas:
            raise errors.UserError(
                f"Replicas: the mesh's {self.axis_name!r} axis (axis_name) must have "
                f"num_replicas={self.num_replicas} devices, got mesh axes {sizes}.")

    @property
    def backend(self) -> str:
        return "vmap" if self.mesh is None else "shard_map"

    @property
    def intra_axes(self) -> tuple[str, ...]:
        """The mesh axes inside one replica (none for vmap or a 1-D mesh)."""
        names = () if self.mesh is None else tuple(self.mesh.axis_names)
        return tuple(n for n in names if n != self.axis_name)

    @property
    def manual_axes(self) -> frozenset[str]:
        """The axes functions see per device (collectives); the others the compiler splits."""
        if self.mesh is None:
            return frozenset()
        auto = {n for n, t in zip(self.mesh.axis_names, self.mesh.axis_types)
                if t == jax.sharding.AxisType.Auto}  # fmt: skip
        return frozenset(self.mesh.axis_names) - auto

    def map(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Lifts ``fn`` (one replica's view) to trees in the replicated layout.

        Args:
          fn: a function of single-replica trees that may use collectives over
            ``axis_name`` (and the intra-replica axes). Outputs follow the same
            shared/per-replica rule.

        Returns:
          A function of replicated trees (wrap it in ``jax.jit`` yourself).
        """
        if self.mesh is None:
            return self._vmap(fn)
        return self._shard_map(fn)

    def spec(self, path: tuple, local: Any, full_rank: bool = False, manual_only: bool = False
             ) -> P:  # fmt: skip
        """The spec of a per-replica leaf, given one replica's view of it (``local``).

        ``manual_only``: only the axes ``map``'s functions see per device (the
        specs of ``shard_map``); the compiler places the rest from the inputs.
        """
        inner = tuple(self.leaf_axes(path, local)) if self.leaf_axes else ()
        if manual_only:
            inner = tuple(a if a in self.manual_axes else None for a in inner)
        pad = [None] * (len(local.shape) - len(inner)) if full_rank else []
        return P(self.axis_name, *inner, *pad)

    def _vmap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            in_axes: Any = tuple(_stacked_axes(a, self.num_replicas, i) for i, a in enumerate(args))
            if self.num_replicas == 1:
                # One replica: no batched ops (a size-1 batch axis made XLA:CPU ~1.5x
                # slower), but the axis name stays bound for the collectives.
                args = jax.tree.map(lambda x, a: x if a is None else x[0], args, in_axes,
                                    is_leaf=_is_none)  # fmt: skip
                in_axes = None
            # One trace: the layout rule splits the outputs into per-replica and shared
            # leaves while fn is traced (vmap then refuses a shared leaf that varies).
            layout = []

            def split(*local: Any) -> tuple[list, list]:
                found, treedef = jax.tree_util.tree_flatten_with_path(fn(*local))
                layout.append((treedef, [is_shared_leaf(x, p) for p, x in found]))
                leaves = [(x, shared) for (_, x), shared in zip(found, layout[-1][1])]
                return [x for x, sh in leaves if not sh], [x for x, sh in leaves if sh]

            try:
                per, shared = jax.vmap(split, in_axes=in_axes, out_axes=(0, None),
                                       axis_name=self.axis_name, axis_size=self.num_replicas
                                       )(*args)  # fmt: skip
            except ValueError as err:
                if "but out_axes is None" not in str(err):
                    raise
                raise _varying_scalar_error() from err
            treedef, is_shared = layout[-1]
            per, shared = iter(per), iter(shared)
            return treedef.unflatten([next(shared) if sh else next(per) for sh in is_shared])

        return run

    def _shard_map(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def specs(tree: Any, axes: Any, lead: int) -> Any:
            return jax.tree_util.tree_map_with_path(
                lambda p, x, a: P() if a is None else self.spec(p, _drop(x, lead), manual_only=True),
                tree, axes)

        def run(*args: Any) -> Any:
            try:
                return placed_run(*args)
            except ValueError as err:
                text = str(err)
                if "is P() which implies that the corresponding output value" in text:
                    raise _varying_scalar_error() from err  # a shared (P()) leaf that varies
                if "does not match the specs of the input" not in text:
                    raise
                raise ValueError(
                    f"Replicas.map: an input is not placed over the {self.axis_name!r} mesh "
                    f"axis ({text.split(' for arg: ')[-1].split('.')[0]}). Pass every "
                    f"per-replica input (params, batches) through reps.put(...) outside the "
                    f"jitted step; reps.init places the optimizer state.") from None

        def placed_run(*args: Any) -> Any:
            in_axes = tuple(_stacked_axes(a, self.num_replicas, i) for i, a in enumerate(args))
            in_specs = specs(args, in_axes, 1)

            def call(*local: Any) -> Any:
                return fn(*jax.tree.map(lambda x, a: x if a is None else x[0], local, in_axes,
                                        is_leaf=_is_none))  # fmt: skip

            # One device's view of the outputs, to apply the layout rule to.
            view = jax.eval_shape(jax.shard_map(call, mesh=self.mesh, in_specs=in_specs,
                                                out_specs=P(), axis_names=self.manual_axes,
                                                check_vma=False), *args)  # fmt: skip
            out_axes = jax.tree_util.tree_map_with_path(
                lambda p, s: None if is_shared_leaf(s, p) else 0, view)

            def body(*local: Any) -> Any:
                return jax.tree.map(lambda x, a: x if a is None else x[None], call(*local),
                                    out_axes, is_leaf=_is_none)  # fmt: skip

            return jax.shard_map(body, mesh=self.mesh, in_specs=in_specs,
                                 out_specs=specs(view, out_axes, 0),
                                 axis_names=self.manual_axes)(*args)  # fmt: skip

        return run

    def init(self, tx: Any, params: PyTree) -> PyTree:
        """Every replica's optimizer state, in the replicated layout.

        ``tx.init`` runs per replica, with the shared counters left unbatched
        (``jax.vmap(tx.init)`` would give every replica its own counter and
        ``local_steps`` refuses that). Wrappers that desynchronise replicas
        (``optax.apply_if_finite`` around ``local_steps``) are refused here.

        Args:
          tx: an optax transformation.
          params: the params in the replicated layout (leading axis N).

        Returns:
          The optimizer state, placed like the params.
        """
        from noloco_jax.optim.local_steps import check_composition  # noqa: PLC0415

        init = self.map(tx.init)
        if self.mesh is not None:
            # One compiled call: run op by op, shard_map dispatches every small operation
            # of tx.init separately (5.7 s for the nano model on a replica x stage mesh). Its
            # outputs are placed as put places them: the compiler would leave the moments
            # whole on every device of a split replica.
            places = jax.tree_util.tree_map_with_path(self.sharding_of,
                                                      jax.eval_shape(init, params))
            init = jax.jit(init, out_shardings=places)
        state = init(params)
        check_composition(state)
        return state

    def put(self, tree: PyTree) -> PyTree:
        """Places a replicated tree: split over the mesh, or left as is for vmap.

        With several processes (``jax.distributed``) every process passes the
        same global values and supplies the shards of its own devices.
        """
        if self.mesh is None:
            return tree
        self._check_divides(tree)

        def place(path: tuple, x: Any) -> Any:
            sharding = self.sharding_of(path, x)
            if jax.process_count() == 1:
                return jax.device_put(x, sharding)
            host = np.asarray(x)
            return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])

        return jax.tree_util.tree_map_with_path(place, tree)

    def _check_divides(self, tree: PyTree) -> None:
        """Refuses a leaf the intra-replica axes do not divide, naming it (``check_divides``);
        the placement failed with JAX's error, which names neither the leaf nor the fix."""
        from noloco_jax import sharding  # noqa: PLC0415

        if self.leaf_axes is not sharding.intra_replica_axes:
            return
        local = jax.tree_util.tree_map_with_path(
            lambda p, x: x if is_shared_leaf(x, p) else _drop(x, 1), tree)
        sharding.check_divides(local, dict(zip(self.mesh.axis_names, self.mesh.axis_sizes)))

    def sharding_of(self, path: tuple, x: Any) -> NamedSharding:
        """Where ``put`` places a leaf of a replicated tree on the mesh.

        Full-rank specs, as shard_map outputs carry them: P('r') and P('r', None) are
        different types on an explicit mesh and would make the first call compile twice.
        """
        shared = is_shared_leaf(x, path)
        return NamedSharding(self.mesh, P() if shared else
                             self.spec(path, _drop(x, 1), full_rank=True))  # fmt: skip


def _varying_scalar_error() -> ValueError:
    return ValueError(
        "Replicas.map: an integer or boolean scalar output is computed per replica, but the "
        "replicated layout keeps such scalars shared (one copy for all replicas, for the step "
        "and round counters). An optimizer state built with jax.vmap(tx.init) has such "
        "counters per replica: build it with reps.init(tx, params). So do Flax NNX objects made "
        "with nnx.vmap (an nnx.Rngs count): build each replica inside reps.map (README, 'Flax "
        "NNX, one replica per device'). A per-replica integer of your own must have a shape: "
        "store it as shape [1].")


def to_host(x: Any) -> np.ndarray:
    """A global array's value on this host, also when other processes hold some shards."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _drop(x: Any, lead: int) -> jax.ShapeDtypeStruct:
    """``x``'s shape without its first ``lead`` dims."""
    return jax.ShapeDtypeStruct(tuple(x.shape[lead:]), x.dtype)


def _is_none(x: Any) -> bool:
    return x is None


def make_replicas(
    num_replicas: int,
    *,
    backend: str = "auto",
    axis_name: str = "replica",
    devices: Any = None,
    mesh_shape: dict[str, int] | None = None,
) -> Replicas:
    """Chooses where N replicas run.

    Args:
      num_replicas: N.
      backend: ``"vmap"`` (all replicas on one device), ``"shard_map"`` (one
        replica per device, or per slice of devices with ``mesh_shape``) or
        ``"auto"`` (``shard_map`` when the devices exist and N > 1 or a replica
        spans devices, else ``vmap``).
      axis_name: the replica axis name.
      devices: devices to use for ``shard_map`` (default: the first ones).
      mesh_shape: intra-replica axes, e.g. ``{"fsdp": 4, "tensor": 2}``: each
        replica's leaves are split over F x T devices (``noloco_jax.sharding``).
        With several processes each one holds whole replicas when they fit in it
        (only the outer step then crosses processes).

    Returns:
      A ``Replicas``.

    Example:
      >>> reps = make_replicas(2, mesh_shape={"fsdp": 2, "tensor": 2})  # 8 devices
      >>> reps.mesh.shape
      OrderedDict([('replica', 2), ('fsdp', 2), ('tensor', 2)])
    """
    from noloco_jax import errors, sharding  # noqa: PLC0415

    errors.check_int("num_replicas", num_replicas, 1)
    errors.check_choice("backend", backend, ("auto", "vmap", "shard_map"))
    if mesh_shape is not None and not isinstance(mesh_shape, Mapping):
        raise errors.UserError(f"mesh_shape must be a dict such as {{'fsdp': 4, 'tensor': 2}}, "
                               f"got {mesh_shape!r}.")  # fmt: skip
    shape = {a: (mesh_shape or {}).get(a, 1) for a in sharding.INTRA_AXES}
    unknown = sorted(set(mesh_shape or {}) - set(sharding.INTRA_AXES))
    if unknown or any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1
                      for v in shape.values()):  # fmt: skip
        raise errors.UserError(f"mesh_shape takes {list(sharding.INTRA_AXES)} with integer "
                               f"sizes >= 1, got {mesh_shape!r}.")  # fmt: skip
    shape = {a: int(v) for a, v in shape.items()}
    per_replica = shape[sharding.FSDP] * shape[sharding.TENSOR]
    if per_replica > 1 and axis_name in sharding.INTRA_AXES:
        raise errors.UserError(f"axis_name={axis_name!r} is a mesh axis inside each replica "
                               f"(mesh_shape={mesh_shape!r}); name the replica axis otherwise, "
                               f"e.g. 'replica'.")  # fmt: skip
    all_devices = list(jax.devices() if devices is None else devices)
    if len(set(all_devices)) != len(all_devices):
        raise errors.UserError(f"devices lists a device more than once: {all_devices!r}; give "
                               f"each device once.")  # fmt: skip
    need = num_replicas * per_replica
    chosen = backend
    if backend == "auto":  # a split replica cannot be simulated: it needs its devices
        spans = per_replica > 1 or (num_replicas > 1 and len(all_devices) >= need)
        chosen = "shard_map" if spans else "vmap"
    processes = sorted({getattr(d, "process_index", 0) for d in all_devices})
    if chosen == "vmap":
        if len(processes) > 1:
            why = ("backend='vmap'" if backend == "vmap" else
                   f"backend='auto' with num_replicas={num_replicas} (not one per device of the "
                   f"{len(all_devices)})")  # fmt: skip
            raise errors.UserError(
                f"{why} runs every replica on one device, but the devices belong to "
                f"{len(processes)} processes: the others would train nothing. Use "
                f"num_replicas={len(all_devices)} (config.num_replicas) with backend="
                f"'shard_map' or 'auto'.")  # fmt: skip
        if per_replica > 1:
            raise errors.UserError(f"mesh_shape={mesh_shape!r} splits a replica over devices, "
                                   f"which needs backend='shard_map' or 'auto'.")
        return Replicas(num_replicas, axis_name)
    if len(all_devices) < need and per_replica == 1:
        raise errors.UserError(
            f"backend='shard_map' needs one device per replica: num_replicas={num_replicas} "
            f"but only {_visible(len(all_devices))}. Use backend='vmap', fewer "
            f"replicas, or (on CPU) XLA_FLAGS=--xla_force_host_platform_device_count={need}.")
    if len(all_devices) < need:
        raise errors.UserError(
            f"num_replicas={num_replicas} x fsdp={shape['fsdp']} x tensor={shape['tensor']} = "
            f"{need} devices are needed, {_visible(len(all_devices))}. Use fewer replicas or a "
            f"smaller split (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={need})."
        )
    dims = (num_replicas, *shape.values())
    layout = (f"num_replicas={num_replicas} x fsdp={shape['fsdp']} x tensor={shape['tensor']} "
              f"= {need} of the {len(all_devices)} devices leave")  # fmt: skip
    if per_replica == 1:
        devs, slices = _chosen_devices(all_devices, dims, layout)
        explicit = (jax.sharding.AxisType.Explicit,)
        mesh = (_topology_mesh(devs, (num_replicas,), (axis_name,), explicit) if slices is None
                else jax.sharding.Mesh(slices.reshape(-1), (axis_name,), axis_types=explicit))
        return Replicas(num_replicas, axis_name, mesh)
    auto = jax.sharding.AxisType.Auto
    mesh = replica_mesh(all_devices, dims, (axis_name, *shape),
                        (jax.sharding.AxisType.Explicit, auto, auto), layout)  # fmt: skip
    return Replicas(num_replicas, axis_name, mesh, leaf_axes=sharding.intra_replica_axes)


def replica_mesh(all_devices: list, dims: tuple[int, ...], names: tuple[str, ...],
                 types: tuple, layout: str) -> jax.sharding.Mesh:  # fmt: skip
    """A mesh of ``dims[0]`` replicas of ``dims[1:]`` devices each, from ``all_devices``.

    The replicas are dealt evenly over TPU slices; each replica's devices lie in one slice,
    and in one process where they fit (only the exchange between replicas crosses the slower
    links); otherwise the devices follow the topology's order.

    Raises:
      UserError: the chosen devices leave a process without any (``layout`` starts the
        message: "<what> of the <count> devices leave(s)").
    """
    devs, slices = _chosen_devices(all_devices, dims, layout)
    grid = _whole_replicas_per_process(devs, dims) if slices is None else slices
    if grid is None:
        return _topology_mesh(devs, dims, names, types)
    return jax.sharding.Mesh(grid, names, axis_types=types)


def _chosen_devices(all_devices: list, dims: tuple[int, ...], layout: str
                    ) -> tuple[np.ndarray, np.ndarray | None]:  # fmt: skip
    """The devices of N replicas of ``dims[1:]`` devices each (``_first_devices``) and their
    grid over TPU slices (``_across_slices``; None on one slice).

    Raises:
      UserError: the chosen devices leave a process without any (named by ``layout``, the
        message's start: "<what> of the <count> devices leave(s)").
    """
    from noloco_jax import errors  # noqa: PLC0415

    devs = np.asarray(_first_devices(all_devices, math.prod(dims), dims[0]), dtype=object)
    process = lambda d: getattr(d, "process_index", 0)  # noqa: E731
    idle = sorted({process(d) for d in all_devices} - {process(d) for d in devs})
    if idle:
        raise errors.UserError(
            f"{layout} process(es) {idle[:4]} without any: every process must hold replicas. "
            f"Use num_replicas={len(all_devices) // math.prod(dims[1:])} (config.num_replicas) "
            f"to use every device.")  # fmt: skip
    return devs, _across_slices(devs, dims)


def _topology_mesh(devices: np.ndarray, dims: tuple[int, ...], names: tuple[str, ...],
                   types: tuple) -> jax.sharding.Mesh:  # fmt: skip
    """``jax.make_mesh`` (devices in the topology's order), or the devices in their given order
    where it refuses them: on a TPU, some of a slice's chips that are no whole block of it
    (3 of a v5e-4's 2 x 2; JAX then fails an assertion), or a split that needs a physical axis
    split (fsdp 2 x tensor 4 on a v4's 2 x 2 x 4 chips: NotImplementedError)."""
    try:
        return jax.make_mesh(dims, names, axis_types=types, devices=devices)
    except (AssertionError, ValueError, NotImplementedError):
        return jax.sharding.Mesh(devices.reshape(dims), names, axis_types=types)


def _across_slices(devices: np.ndarray, dims: tuple[int, ...]) -> np.ndarray | None:
    """An (N, F, T) device array for several TPU slices, or ``None`` on one slice.

    The replicas are dealt out over the slices and each replica's F x T devices lie in one
    slice (``jax.make_mesh`` refuses multi-slice devices), and in one process of it when they
    fit (``_whole_replicas_per_process``): only NoLoCo's exchange crosses the slower links
    between slices (DCN) and processes.
    """
    slices = _by_slice(devices)
    if len(slices) == 1:
        return None
    from noloco_jax import errors  # noqa: PLC0415

    if dims[0] % len(slices):
        raise errors.UserError(
            f"num_replicas={dims[0]} must be a multiple of the {len(slices)} TPU slices its "
            f"devices come from (config.num_replicas): each slice holds the same number of "
            f"replicas.")  # fmt: skip
    per_slice = (dims[0] // len(slices), *dims[1:])
    if {len(s) for s in slices.values()} != {math.prod(per_slice)}:  # unequal: the given order
        return np.asarray([d for k in sorted(slices) for d in slices[k]], dtype=object).reshape(dims)
    grids = [_in_one_slice(np.asarray(slices[k], dtype=object), per_slice) for k in sorted(slices)]
    return np.concatenate(grids).reshape(dims)


def _in_one_slice(devices: np.ndarray, dims: tuple[int, ...]) -> np.ndarray:
    """One slice's (n, F, T) device array: whole replicas per process, else the slice's
    topology order, else (part of the slice, no block of it) the given order."""
    from jax.experimental import mesh_utils  # noqa: PLC0415

    grid = _whole_replicas_per_process(devices, dims)
    if grid is not None:
        return grid
    try:
        return mesh_utils.create_device_mesh(dims, list(devices), allow_split_physical_axes=True)
    except (AssertionError, ValueError, NotImplementedError):
        return devices.reshape(dims)


def _visible(n: int) -> str:
    """"1 device is visible" / "8 devices are visible"."""
    return "1 device is visible" if n == 1 else f"{n} devices are visible"


def _by_slice(devices: Any) -> dict[int, list]:
    """The devices of each TPU slice (``slice_index``; 0 where devices have none), in order."""
    slices: dict[int, list] = {}
    for d in devices:
        slices.setdefault(getattr(d, "slice_index", 0), []).append(d)
    return slices


def _first_devices(devices: list, need: int, num_replicas: int) -> list:
    """The first ``need`` devices; over several TPU slices the first ``need / slices`` of each
    (``_across_slices`` gives every slice the same number of replicas; the first ``need`` of
    all could fill one slice and leave another part-filled or empty)."""
    slices = _by_slice(devices)
    share = need // len(slices)
    if len(slices) == 1 or num_replicas % len(slices) or min(map(len, slices.values())) < share:
        return devices[:need]
    return [d for s in slices.values() for d in s[:share]]


def _whole_replicas_per_process(devices: np.ndarray, dims: tuple[int, ...]) -> np.ndarray | None:
    """An (N, F, T) device array that gives each process whole replicas, or ``None``.

    With several processes the replica axis spans the processes and each
    replica's F x T devices lie in one process (their gathers stay on its fast
    links; only the outer step crosses processes). ``None`` when the devices
    belong to one process, or when they cannot be split so (a replica larger
    than a process, or unequal processes): then the usual mesh order is used. A process's
    chips may be split along a physical axis (2 x 2 replicas of a host's 1 x 4 chips).
    """
    from jax.experimental import mesh_utils  # noqa: PLC0415

    groups: dict[int, int] = {}
    for d in devices:
        groups[d.process_index] = groups.get(d.process_index, 0) + 1
    sizes, per_replica = set(groups.values()), int(np.prod(dims[1:]))
    if len(groups) < 2 or len(sizes) > 1 or sizes.pop() % per_replica or dims[0] % len(groups):
        return None
    return mesh_utils.create_hybrid_device_mesh(
        (dims[0] // len(groups), *dims[1:]), (len(groups), *[1] * (len(dims) - 1)),
        list(devices), process_is_granule=True, allow_split_physical_axes=True)
