"""Small tree helpers shared by the optimizer modules."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["is_float", "float_leaves", "zeros_where_none"]


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
