"""Random routing between pipeline stages (the paper's SWARM-like DP x PP setting).

For every micro-batch b and every stage boundary s -> s + 1, a bijection of the
N replicas decides which replica of stage s + 1 receives the activations (and
the labels) that replica k of stage s produced: ``perm[s, b, k]``. Gradients
retrace the same path (autodiff through the routing). Evaluation uses fixed
(identity) routing.

As with NoLoCo's groups (``noloco_jax.comm``), ``ppermute`` needs static
permutations, so bijections come from a seeded pool shared by the one-device
simulation and the device-mesh version; each (step, micro-batch, boundary)
draws a pool index from ``fold_in(key(seed), step)``, identically on every
device with no communication. With N! <= ``pool_size`` the pool holds every
permutation, so routing is exactly uniform.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from noloco_jax import errors

__all__ = [
    "permutation_pool",
    "route_indices",
    "route_perms",
    "identity_perms",
    "sequence_paths",
]


def permutation_pool(num_replicas: int, pool_size: int = 64, seed: int = 0) -> np.ndarray:
    """Static bijections of the replicas, int32 [K, N]: ``pool[i, k]`` = destination of k.

    Args:
      num_replicas: N.
      pool_size: the most permutations kept; all N! of them when N! <= pool_size.
      seed: seed of the random choice when N! > pool_size.

    Returns:
      A read-only array with distinct rows; row 0 is the identity (fixed routing).

    Raises:
      UserError (a ``ValueError``): num_replicas or pool_size not an integer >= 1, or seed
        not an integer >= 0 (checked before the cache, where True would hit 1's entry).
    """
    return _permutation_pool(errors.check_int("num_replicas", num_replicas),
                             errors.check_int("pool_size", pool_size),
                             errors.check_int("seed", seed, minimum=0))  # fmt: skip


@functools.lru_cache(maxsize=32)
def _permutation_pool(num_replicas: int, pool_size: int, seed: int) -> np.ndarray:
    if math.factorial(num_replicas) <= pool_size:
        pool = np.array(list(itertools.permutations(range(num_replicas))), np.int32)
    else:
        rng = np.random.default_rng(seed)
        rows: dict[tuple[int, ...], None] = {tuple(range(num_replicas)): None}
        while len(rows) < pool_size:
            rows[tuple(rng.permutation(num_replicas).tolist())] = None
        pool = np.array(list(rows), np.int32)
    pool.setflags(write=False)
    return pool


def route_indices(
    step: jax.typing.ArrayLike, *, num_boundaries: int, num_microbatches: int, pool_size: int,
    seed: int,
) -> jax.Array:  # fmt: skip
    """Pool indices for one training step, int32 [S - 1, B] (traced, device-uniform).

    ``pool_size`` is the pool's length, an integer >= 1; ``seed`` an integer in [0, 2**32 - 1],
    as the trainer's (the key keeps 32 bits).
    """
    errors.check_int("pool_size", pool_size)
    errors.check_int("seed", seed, 0, 2**32 - 1, "2**32 - 1")
    key = jax.random.fold_in(jax.random.key(seed), jnp.asarray(step, jnp.uint32))
    return jax.random.randint(key, (num_boundaries, num_microbatches), 0, pool_size, jnp.int32)


def route_perms(pool: np.ndarray, indices: jax.Array) -> jax.Array:
    """Destination replica of every holder: int32 [S - 1, B, N]."""
    return jnp.asarray(pool)[indices]


def identity_perms(num_boundaries: int, num_microbatches: int, num_replicas: int) -> jax.Array:
    """Fixed routing: replica k's stage s always feeds replica k's stage s + 1."""
    ident = jnp.arange(num_replicas, dtype=jnp.int32)
    return jnp.broadcast_to(ident, (num_boundaries, num_microbatches, num_replicas))


def sequence_paths(perms: np.ndarray) -> np.ndarray:
    """Replica visited at every stage by the sequence that starts at replica r, micro-batch b.

    Args:
      perms: [S - 1, B, N] destinations.

    Returns:
      int [N, B, S]; ``paths[r, b, s]`` is the replica of stage s that processes it.
    """
    perms = np.asarray(perms)
    num_boundaries, num_mb, n = perms.shape
    paths = np.empty((n, num_mb, num_boundaries + 1), np.int64)
    paths[:, :, 0] = np.arange(n)[:, None]
    for s in range(num_boundaries):
        paths[:, :, s + 1] = perms[s][np.arange(num_mb), paths[:, :, s]]
    return paths
