"""The DiLoCo outer optimizer: momentum on the all-replica mean pseudo-gradient.

As the NoLoCo reference code runs it: ``g = mean_all(phi - theta)``, then
``optax.sgd(learning_rate, momentum, nesterov)``; the reference uses heavy-ball
momentum (``nesterov=False``) with alpha = 0.3, beta = 0.7 and H = 100.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from noloco_jax import comm
from noloco_jax.optim.noloco import check_dropout_prob, check_rate, check_static_args
from noloco_jax.optim.trees import float_leaves, zeros_where_none

__all__ = ["DiLoCoOuterState", "diloco_outer"]


class DiLoCoOuterState(NamedTuple):
    """State of the transformation returned by ``diloco_outer``.

    Attributes:
      round: int32 scalar, outer rounds taken so far (selects drop-outs).
      sgd_state: state of ``optax.sgd(learning_rate, momentum, nesterov)``.
    """

    round: jax.Array
    sgd_state: optax.OptState


def diloco_outer(
    learning_rate: optax.ScalarOrSchedule = 0.7,
    momentum: float | jax.Array = 0.3,
    nesterov: bool = False,
    axis_name: str | None = "replica",
    *,
    dropout_prob: float = 0.0,
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """DiLoCo's outer step: SGD with momentum on the mean of all pseudo-gradients.

    Same contract as ``noloco_outer``: ``update(outer_grad, state, params)``
    takes ``outer_grad = phi - theta`` and returns delta with
    ``phi_new = optax.apply_updates(phi, delta)``. The mean spans every replica
    on ``axis_name`` (an all-reduce, the global blocking step NoLoCo removes).

    Args:
      learning_rate: outer learning rate beta (paper baseline: 0.7); a number,
        a JAX array (``optax.inject_hyperparams``) or a schedule of the round.
      momentum: alpha (paper baseline: 0.3; DiLoCo's own paper: 0.9).
      nesterov: Nesterov momentum (the DiLoCo paper) instead of heavy ball (the
        NoLoCo reference baseline).
      axis_name: replica axis bound by ``jax.vmap``/``jax.shard_map``; ``None``
        for a single replica.
      dropout_prob: each replica misses each round with this probability
        (``comm.presence_mask`` with ``seed``). DiLoCo then "skips" it: the
        present replicas all-reduce among themselves and an absent one takes a
        local-only step (so its slow weights leave the shared ones). The
        alternative, waiting for it, changes only wall time (see netsim).
      seed: seeds the drop-outs.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax.numpy as jnp
      >>> from noloco_jax import replicas
      >>> tx = diloco_outer(axis_name="replica")
      >>> reps = replicas.make_replicas(4, backend="vmap")
      >>> phi, theta = jnp.zeros((4, 3)), jnp.ones((4, 3))
      >>> delta, _ = reps.map(tx.update)(phi - theta, reps.init(tx, phi), phi)
      >>> round(float(delta[0, 0]), 6)  # 0.7 * mean(theta - phi)
      0.7

    References:
      Douillard et al., "DiLoCo: Distributed Low-Communication Training of
      Language Models", 2023. https://arxiv.org/abs/2311.08105
    """
    check_static_args(seed=seed, dropout_prob=dropout_prob)
    beta = check_rate("learning_rate", learning_rate)
    alpha = check_rate("momentum", momentum)
    sgd = optax.sgd(beta, momentum=alpha, nesterov=bool(nesterov))
    dropout_prob = check_dropout_prob(dropout_prob)

    def init_fn(params: optax.Params) -> DiLoCoOuterState:
        return DiLoCoOuterState(jnp.zeros([], jnp.int32), sgd.init(float_leaves(params)))

    def update_fn(
        outer_grad: optax.Updates,
        state: DiLoCoOuterState,
        params: optax.Params | None = None,
        active: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, DiLoCoOuterState]:
        del extra_args
        full, params, outer_grad = params, float_leaves(params), float_leaves(outer_grad)
        if axis_name is not None:
            comm.axis_size(axis_name)  # clear error if unbound
            present = active
            if dropout_prob > 0:
                mine = comm.own_presence(state.round, axis_name, dropout_prob, seed)
                present = mine if present is None else present & mine
            outer_grad = comm.all_replica_mean(outer_grad, axis_name, weight=present)
        delta, sgd_state = sgd.update(outer_grad, state.sgd_state, params)
        delta = zeros_where_none(delta, full) if full is not None else delta
        return delta, DiLoCoOuterState(optax.safe_int32_increment(state.round), sgd_state)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

