"""How one replica's leaves split over its devices: ``fsdp`` and ``tensor`` mesh axes.

A replica may span several devices (a slice of a pod): every per-replica leaf
(params, slow weights, Adam moments, outer momentum) is split over the
intra-replica axes by one table of logical rules, keyed by the parameter's
name (optimizer-state leaves carry their parameter's name in their path):

* ``fsdp`` splits the model dimension D of every weight (ZeRO-3 style; the
  compiler gathers a layer's weights when it needs them);
* ``tensor`` splits attention heads and the MLP hidden dimension
  (Megatron-style).

Activations split their batch over ``fsdp`` (``shard_batch``): each of a
replica's F devices runs its own share of the replica's sequences with
gathered weights, so activation memory and compute per device fall with F
as well.

NoLoCo and DiLoCo stay unchanged: their collectives run over the "replica"
axis only, so each device exchanges its own shard with the devices holding
the same shard in the partner replicas. The 8-bit exchanges of NoLoCo and
DiLoCo pack the replica into one flat message instead, and each device then
sends all of it (``trainer.settings.packs_replica``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["FSDP", "TENSOR", "INTRA_AXES", "LLAMA_RULES", "intra_replica_axes", "check_divides",
           "path_names", "shard_batch", "gather_whole", "batch_split", "whole_lookups"]

FSDP, TENSOR = "fsdp", "tensor"
INTRA_AXES = (FSDP, TENSOR)

# Parameter name -> mesh axis of each dim (stacked blocks: the leading layer dim is None).
LLAMA_RULES: dict[str, tuple] = {
    "wq": (None, FSDP, TENSOR, None),  # [L, D, H, Dh]
    "wk": (None, FSDP, TENSOR, None),
    "wv": (None, FSDP, TENSOR, None),
    "wo": (None, TENSOR, None, FSDP),  # [L, H, Dh, D]
    "w_gate": (None, FSDP, TENSOR),  # [L, D, F]
    "w_up": (None, FSDP, TENSOR),
    "w_down": (None, TENSOR, FSDP),  # [L, F, D]
    "embedding": (TENSOR, FSDP),  # [V, D]
    "lm_head": (FSDP, TENSOR),  # [D, V]
}

# What each dim of those leaves is, for error messages.
_ATTN = ("layers", "model dimension", "heads", "head dimension")
_KV = ("layers", "model dimension", "key/value heads", "head dimension")
_MLP_IN = ("layers", "model dimension", "MLP hidden units")
_DIM_NAMES: dict[str, tuple] = {
    "wq": _ATTN, "wk": _KV, "wv": _KV, "wo": ("layers", "heads", "head dimension", "model dimension"),
    "w_gate": _MLP_IN, "w_up": _MLP_IN, "w_down": ("layers", "MLP hidden units", "model dimension"),
    "embedding": ("vocabulary", "model dimension"), "lm_head": ("model dimension", "vocabulary"),
}  # fmt: skip
_COUNTED = ("heads", "key/value heads", "MLP hidden units")  # "more than the 4 heads"


def path_names(path: tuple) -> list[str]:
    """The names along a pytree key path (dict keys, attribute names; other keys as text)."""
    return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _rule(path: tuple, local: Any, rules: dict[str, tuple]) -> tuple[str, tuple]:
    """(parameter name, mesh axis of each dim) of one replica's leaf; ("", ()) if whole."""
    for name in reversed(path_names(path)):
        rule = rules.get(name)
        if rule is not None and len(rule) == len(local.shape):
            return name, rule
    return "", ()


def intra_replica_axes(path: tuple, local: Any, rules: dict[str, tuple] = LLAMA_RULES) -> tuple:
    """The intra-replica mesh axis of each dim of one replica's leaf (``()``: whole)."""
    return _rule(path, local, rules)[1]


def check_divides(tree: Any, axis_sizes: dict[str, int], rules: dict[str, tuple] = LLAMA_RULES,
                  *, pad_vocab: bool = True) -> None:  # fmt: skip
    """Raises ``ValueError`` naming the leaf and dim a mesh axis does not divide.

    Args:
      tree: one replica's params (or any tree of its leaves).
      axis_sizes: e.g. ``{"fsdp": 4, "tensor": 2}``.
      rules: the logical rules.
      pad_vocab: whether a vocabulary it does not divide may be padded
        (``config.model.vocab_size``; not an ``init_from`` checkpoint's table).

    Raises:
      UserError: (a ``ValueError``) e.g. ``mesh.tensor=8 is more than the 4 key/value
        heads (dim 2 of ['blocks']['attn']['wk']) it splits; choose a divisor of 4.``
    """
    import jax  # noqa: PLC0415

    from noloco_jax.errors import UserError  # noqa: PLC0415

    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name, rule = _rule(path, x, rules)
        for dim, axis in enumerate(rule):
            size = axis_sizes.get(axis, 1) if axis else 1
            if size > 1 and x.shape[dim] % size:
                names = _DIM_NAMES.get(name, ()) if rules is LLAMA_RULES else ()
                where = f"dim {dim} of {jax.tree_util.keystr(path).removesuffix('.value')}"
                raise UserError(_not_dividing(f"mesh.{axis}={size}", size, x.shape[dim], where,
                                              names[dim] if names else "", pad_vocab))  # fmt: skip


def _not_dividing(setting: str, size: int, n: int, where: str, what: str, pad_vocab: bool = True
                  ) -> str:  # fmt: skip
    if size > n and what in _COUNTED:
        return f"{setting} is more than the {n} {what} ({where}) it splits; choose a divisor of {n}."
    pad = ""
    if what == "vocabulary" and pad_vocab:  # 50257 or 65 ids often have no useful divisor
        pad = (f" or pad the vocabulary to a multiple of {size} (config.model.vocab_size="
               f"{-(-n // size) * size})")
    what = f"the {what}, " if what else ""
    return f"{setting} does not divide {where} ({what}size {n}); choose a divisor of {n}{pad}."


def shard_batch(x: Any) -> Any:
    """Splits dim 0 (the batch) of an activation over the ``fsdp`` mesh axis, when there is one.

    Without it the compiler follows the weights' split and every device of a
    replica computes all of the replica's sequences (activation memory and
    compute do not fall with F). The other dims are left to the compiler.

    Args:
      x: an activation whose first dim is the batch, inside a program over a
        mesh with a compiler-placed ``fsdp`` axis (``make_replicas(...,
        mesh_shape={"fsdp": F})``).

    Returns:
      ``x``, constrained; unchanged where no such axis exists (``vmap``, a 1-D
      mesh, pipeline stages, F = 1) or F does not divide the batch.
    """
    import jax  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    if batch_split(x) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, P(FSDP, *[P.UNCONSTRAINED] * (x.ndim - 1)))


def gather_whole(table: Any) -> Any:
    """A table made whole on every device of its replica where ``whole_lookups()`` says so.

    For the embedding table before its lookup. FSDP gathers every other
    weight before use in the same way.
    """
    import jax  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    if not whole_lookups():
        return table
    return jax.lax.with_sharding_constraint(table, P(*[None] * table.ndim))


def whole_lookups() -> bool:
    """Whether a lookup here (a gather by index) must read a whole table.

    True where the batch is split over ``fsdp`` and ``tensor`` splits too:
    the compiler of jax 0.10.2 cannot build a lookup whose result is split by
    batch there (experiments/BENCHMARKS.md, compiler notes).
    """
    import jax  # noqa: PLC0415

    mesh = jax.sharding.get_abstract_mesh()
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    return batch_split(None) > 1 and sizes.get(TENSOR, 1) > 1


def batch_split(x: Any = None) -> int:
    """How many ways ``shard_batch`` splits the batch here (of ``x``, if given): F, or 1.

    Args:
      x: an activation whose first dim is the batch, or None.

    Returns:
      The size of the compiler-placed ``fsdp`` axis of the current mesh when it
      has one (and it divides ``x``'s batch), else 1.
    """
    import jax  # noqa: PLC0415

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or FSDP not in mesh.axis_names:
        return 1
    kind = dict(zip(mesh.axis_names, mesh.axis_types))[FSDP]
    size = dict(zip(mesh.axis_names, mesh.axis_sizes))[FSDP]
    if kind == jax.sharding.AxisType.Manual or (x is not None and x.shape[0] % size):
        return 1
    return size
