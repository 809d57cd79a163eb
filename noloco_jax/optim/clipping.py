"""Global-norm gradient clipping as one scalar factor on the updates."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax.optim.trees import float_leaves, is_float

__all__ = ["clip_by_global_norm_fused"]


def check_max_norm(max_norm: Any) -> None:
    """A ``ValueError`` unless ``max_norm`` is a number > 0 (not a bool; NaN fails ``> 0``).

    A JAX array (``optax.inject_hyperparams`` passes one) is a value on the device that a
    Python check cannot see, and passes; a NumPy scalar is checked as a number.
    """
    if isinstance(max_norm, jax.Array):
        return
    value = max_norm.item() if isinstance(max_norm, (np.ndarray, np.generic)) \
        and np.ndim(max_norm) == 0 else max_norm  # fmt: skip
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}.")


def clip_by_global_norm_fused(max_norm: float) -> optax.GradientTransformation:
    """Scales the updates by ``min(1, max_norm / ||updates||)``.

    The same clipping as ``optax.clip_by_global_norm`` (equal when the norm is at
    most ``max_norm``, equal up to rounding otherwise; the norm of 16-bit updates is
    summed in float32, where optax sums it in their dtype), written as one scalar
    factor times the updates, which saves a pass over the gradients per step
    (experiments/BENCHMARKS.md, "Compiler notes"). As in optax, a norm above about
    1.8e19 overflows float32's sum of squares and the update is zero, not clipped.

    Args:
      max_norm: the largest global norm let through (> 0); a number, or a JAX array
        (``optax.inject_hyperparams``).

    Returns:
      A stateless ``optax.GradientTransformation``.

    Example:
      >>> import jax.numpy as jnp
      >>> tx = clip_by_global_norm_fused(1.0)
      >>> g, _ = tx.update({"w": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> g["w"].tolist()
      [0.6000000238418579, 0.800000011920929]

    References:
      Pascanu et al., 2013, https://arxiv.org/abs/1211.5063.
    """
    check_max_norm(max_norm)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: Any = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params
        # Squares summed in at least float32 (clip_by_stage_norm's too): in bfloat16 the sum
        # stalls at 256, so the norm read low. Integer leaves: neither counted nor scaled.
        norm = optax.tree.norm(jax.tree.map(
            lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32)), float_leaves(updates)))
        scale = jnp.minimum(1.0, max_norm / norm)  # norm 0 -> inf -> 1; NaN stays NaN
        return jax.tree.map(lambda g: (g * scale).astype(g.dtype) if is_float(g) else g,
                            updates), state  # fmt: skip

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)
