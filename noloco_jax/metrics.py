"""Cross-replica diagnostics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from noloco_jax import comm
from noloco_jax.optim.trees import is_float

__all__ = ["replica_spread"]


def replica_spread(params: Any, axis_name: str | None) -> jax.Array:
    """The paper's pooled cross-replica weight standard deviation.

    sqrt( sum over leaves and elements of mean_replicas |p - mean_replicas p|^2
          / total number of elements ),

    a population std pooled over every parameter, as logged by the reference
    code (``Model/std``). Computed in float32 on the differences from replica 0
    (the std does not change), so identical replicas give exactly 0 and a small
    spread is not lost to rounding of the weights. This is a diagnostic: it uses
    all-replica means, so call it at evaluation time, not in the training step.

    Args:
      params: this replica's parameter tree.
      axis_name: the replica axis bound by ``jax.vmap`` or ``jax.shard_map``; ``None``
        for a single replica (its spread is 0), as the optimizers take it.

    Returns:
      A float32 scalar, identical on every replica.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> p = jnp.array([[0.0], [2.0]])  # 2 replicas, 1 parameter
      >>> jax.vmap(lambda x: replica_spread(x, "r"), axis_name="r")(p).tolist()
      [1.0, 1.0]
    """
    # One replica: no spread (and no collective, which XLA refuses over a size-1 axis of
    # split leaves).
    if axis_name is None or comm.axis_size(axis_name) == 1:
        return jnp.zeros([], jnp.float32)
    leaves = [x.astype(jnp.complex64 if jnp.iscomplexobj(x) else jnp.float32)
              for x in jax.tree.leaves(params)  # a complex weight keeps its imaginary part
              if is_float(x) and jnp.size(x)]  # weights; empty ones add nothing (0 / 0 was NaN)
    if not leaves:
        return jnp.zeros([], jnp.float32)
    first = jax.lax.axis_index(axis_name) == 0
    refs = jax.lax.psum([jnp.where(first, x, jnp.zeros_like(x)) for x in leaves], axis_name)
    leaves = [x - r for x, r in zip(leaves, refs)]
    means = comm.all_replica_mean(leaves, axis_name)
    sq = sum(jnp.sum(jnp.real((x - m) * jnp.conj(x - m))) for x, m in zip(leaves, means))
    total = comm.tree_num_elements(leaves)
    return jnp.sqrt(comm.all_replica_mean(sq, axis_name) / total)
