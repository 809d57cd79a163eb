"""The run's first state, made where it lives: no device ever holds more than its share.

The state is one compiled program whose outputs are placed as the run places them (never N
whole replicas on the first device), and a checkpoint restores onto placed shapes alone.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax import replicas
from noloco_jax.trainer.step import TrainState

__all__ = ["first_state"]


def first_state(target: TrainState, tx: Any, num_replicas: int,
                init: Callable[[], Any] | None = None) -> Callable[..., TrainState]:  # fmt: skip
    """The compiled program that makes every replica's step-0 state (identical replicas) in place.

    Args:
      target: the run's placed state shapes (``trainer.aot.abstract_state``).
      tx: the per-replica optimizer.
      num_replicas: N.
      init: a traceable function returning one replica's initial params (the model's
        initialiser): then not even one whole replica is ever on one device.

    Returns:
      ``make(params=None)``: the state, placed as ``target``. ``params``: one replica's
      initial params instead of ``init()`` (e.g. read from a Hugging Face checkpoint); each
      device receives only its part of them.
    """

    def build(params: Any) -> TrainState:
        params = init() if params is None else params
        single = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
        return replicas.replicate(single, num_replicas)

    program = jax.jit(build, out_shardings=jax.tree.map(lambda x: x.sharding, target))

    def make(params: Any = None) -> TrainState:
        if (params is None) == (init is None):
            raise ValueError("first_state: give params exactly when no init function was given")
        if params is not None:
            params = jax.tree.map(_one_replica_place, target.params, params)
        return program(params)

    return make


def _one_replica_place(target: jax.ShapeDtypeStruct, x: Any) -> jax.Array:
    """``x`` (one replica's leaf) split as the run splits a replica, on every replica's devices."""
    sharding = target.sharding
    if isinstance(sharding, NamedSharding):  # drop the replica axis: the same on each replica
        sharding = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])
