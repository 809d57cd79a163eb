"""Small tree helpers shared by the optimizer modules."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = [
    "is_float",
    "float_leaves",
    "zeros_where_none",
    "like_dtypes",
    "is_batched",
    "as_real",
    "from_real",
    "BATCHED_COUNTER_FIX",
    "check_scalar_round",
]


def is_float(x: Any) -> bool:
    """Whether a leaf (array or ``ShapeDtypeStruct``) holds floating-point values."""
    return bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact))


def float_leaves(tree: Any) -> Any:
    """``tree`` with every non-float leaf replaced by ``None`` (optax's "no update")."""
    return jax.tree.map(lambda x: x if is_float(x) else None, tree)


def zeros_where_none(partial: Any, like: Any) -> Any:
    """``partial`` (a ``float_leaves`` tree) with its ``None`` leaves filled by zeros of ``like``."""
    return jax.tree.map(
        lambda u, x: u if u is not None or x is None else jnp.zeros_like(x), partial, like,
        is_leaf=lambda v: v is None,
    )  # fmt: skip


def like_dtypes(tree: Any, like: Any) -> Any:
    """``tree`` cast leaf by leaf to ``like``'s dtypes (a state keeps its dtypes across steps).

    A float32 hyperparameter (``optax.inject_hyperparams``) turns a bfloat16 momentum float32;
    the step that does not sync keeps bfloat16, and ``lax.cond`` refuses the two branches.
    """
    return jax.tree.map(lambda x, y: x.astype(y.dtype), tree, like)


def as_real(tree: Any) -> Any:
    """``tree`` with each complex leaf as a real array of (real, imag) pairs on a last axis.

    The exchanges send and sum real numbers: a wire cast dropped the imaginary part, and
    a packed message could not take a complex leaf's bits.
    """
    return jax.tree.map(
        lambda x: jnp.stack([x.real, x.imag], -1) if jnp.iscomplexobj(x) else x, tree)


def from_real(tree: Any, like: Any) -> Any:
    """Inverse of ``as_real``: the leaves that are complex in ``like`` put back together."""
    return jax.tree.map(
        lambda r, x: jax.lax.complex(r[..., 0], r[..., 1]).astype(x.dtype)
        if jnp.iscomplexobj(x) else r, tree, like)  # fmt: skip


def is_batched(x: Any) -> bool:
    """Whether ``x`` is being traced with a ``vmap`` batch axis (no public API says so)."""
    try:
        from jax._src.interpreters import batching  # noqa: PLC0415
    except ImportError:  # pragma: no cover - a future JAX; the check is then skipped
        return False
    if not isinstance(x, batching.BatchTracer):
        return False
    return x.batch_dim is not None and not isinstance(x.batch_dim, batching.NotMapped)


BATCHED_COUNTER_FIX = (
    "local_steps: its step counter is batched over a vmap axis (jax.vmap(tx.init) gives "
    "every replica its own counter, and optax.apply_if_finite around local_steps makes one "
    "replica's counter differ from the others'), so the sync branch would become a select "
    "that runs the outer step and every group exchange on every step. Keep the counters "
    "shared: build the state with noloco_jax.replicas.make_replicas(N).init(tx, params) and "
    "step with .map(tx.update) (or jax.vmap with the state's in_axes and out_axes "
    "replicas.replica_axes(state)); "
    "with Flax NNX build the nnx.Optimizer under nnx.vmap(..., "
    "out_axes=replicas.nnx_state_axes()) and step it under nnx.vmap(..., in_axes=(..., "
    "replicas.nnx_state_axes(), ...)): an optimizer built with out_axes=0 has a counter per "
    "replica, which the step's nnx_state_axes() then maps as a replica axis. For "
    "non-finite steps use local_steps(..., nonfinite_guard=True) instead of apply_if_finite, "
    "with params = noloco_jax.restore_nonfinite(params, opt_state) after optax.apply_updates."
)


def check_scalar_round(round_index: Any, who: str, what: str = "round") -> None:
    """Refuses a ``what`` counter with a shape (a ``jax.vmap`` whose default ``out_axes=0``
    gave the shared counter a replica axis), naming the fix; it failed in the group draw's
    ``fold_in`` (``local_steps``: in ``lax.cond``) with advice to use ``jax.vmap``."""
    if jnp.ndim(round_index) != 0:
        raise ValueError(
            f"{who}.update got a {what} counter of shape {jnp.shape(round_index)}; the shared "
            "counters are scalars. A jax.vmap over the replicas needs "
            "replicas.replica_axes(state) as the state's out_axes as well as its in_axes (the "
            "default out_axes=0 gave the counter a replica axis); or step with "
            "noloco_jax.replicas.make_replicas(N).map(...).")
