"""Parameters as the optimizer's byte counters see them: a shape and a wire dtype, no memory."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_DTYPE_BY_BYTES = {1: "int8", 2: "bfloat16", 4: "float32", 8: "float64"}


def wire_dtype(bytes_per_param: int) -> jnp.dtype:
    """The JAX dtype of ``bytes_per_param`` bytes (bfloat16 for 2, as in the paper)."""
    return jnp.dtype(_DTYPE_BY_BYTES[bytes_per_param])


def params_tree(num_params: int, bytes_per_param: int) -> jax.ShapeDtypeStruct:
    """One flat parameter vector as a ``jax.ShapeDtypeStruct`` (nothing is allocated)."""
    return jax.ShapeDtypeStruct((num_params,), wire_dtype(bytes_per_param))


def bytes_per_param(name: str, value: int) -> int:
    """A byte width as an int, or a ValueError naming ``name`` unless it is 1, 2, 4 or 8."""
    if isinstance(value, bool) or value not in _DTYPE_BY_BYTES:
        raise ValueError(f"{name} must be one of {sorted(_DTYPE_BY_BYTES)}, got {value!r}.")
    return int(value)
