"""The run's first state, made where it lives: no device ever holds more than its share.

The state is one compiled program whose outputs are placed as the run places them (never N
whole replicas on the first device), and a checkpoint restores onto placed shapes alone.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax import models, replicas
from noloco_jax.trainer.step import TrainState

__all__ = ["first_state", "model_init"]


def first_state(target: TrainState, tx: Any, num_replicas: int,
                init: Callable[[Any], Any] | None = None) -> Callable[..., TrainState]:  # fmt: skip
    """The compiled program that makes every replica's step-0 state (identical replicas) in place.

    Args:
      target: the run's placed state shapes (``trainer.aot.abstract_state``).
      tx: the per-replica optimizer.
      num_replicas: N.
      init: ``init(shardings)`` returns one replica's initial params placed with
        ``shardings`` (one per leaf, the run's split of a replica on every replica's
        devices), e.g. ``model_init(cfg, seed)``: then not even one whole replica is ever on
        one device.

    Returns:
      ``make(params=None)``: the state, placed as ``target``. ``params``: one replica's
      initial params instead of ``init``'s (e.g. read from a Hugging Face checkpoint); each
      device receives only its part of them.
    """

    def build(params: Any) -> TrainState:
        single = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
        return replicas.replicate(single, num_replicas)

    program = jax.jit(build, out_shardings=jax.tree.map(lambda x: x.sharding, target))

    def make(params: Any = None) -> TrainState:
        if (params is None) == (init is None):
            raise ValueError("first_state: give params exactly when no init function was given")
        if params is None:
            return program(init(jax.tree.map(_one_replica_sharding, target.params)))
        return program(jax.tree.map(_one_replica_place, target.params, params))

    return make


def model_init(cfg: Any, seed: int) -> Callable[[Any], Any]:
    """``first_state``'s ``init`` for a new model: ``models.init_params(cfg, seed)``'s params.

    The random initialisation is its own program, compiled once per model config and placement
    and reused by every run (any seed, optimizer or method) in the process.
    """
    return lambda shardings: _init_jit(cfg, jax.tree.structure(shardings),
                                       tuple(jax.tree.leaves(shardings)))(np.uint32(seed))


@functools.lru_cache(maxsize=8)  # as many as the trainer keeps of its other programs
def _init_jit(cfg: Any, treedef: Any, shardings: tuple) -> Callable:
    return jax.jit(lambda seed: models.init_params(cfg, seed)[1],
                   out_shardings=jax.tree.unflatten(treedef, shardings))  # fmt: skip


def _one_replica_sharding(target: jax.ShapeDtypeStruct) -> Any:
    """Where one replica's leaf goes: split as the run splits a replica, on every replica's
    devices (the replica axis dropped)."""
    sharding = target.sharding
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    return sharding


def _one_replica_place(target: jax.ShapeDtypeStruct, x: Any) -> jax.Array:
    """``x`` (one replica's host leaf) placed by ``_one_replica_sharding``."""
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, _one_replica_sharding(target),
                                        lambda idx: host[idx])  # fmt: skip
