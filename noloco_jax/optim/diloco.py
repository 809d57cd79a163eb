"""The DiLoCo outer optimizer: momentum on the all-replica mean pseudo-gradient.

As the NoLoCo reference code runs it: ``g = mean_all(phi - theta)``, then
``optax.sgd(learning_rate, momentum, nesterov)``; the reference uses heavy-ball
momentum (``nesterov=False``) with alpha = 0.3, beta = 0.7 and H = 100.

What travels with a narrow ``exchange_dtype``
---------------------------------------------
DiLoCo already averages the pseudo-gradients phi - theta, and every replica
holds the same phi, so sending them instead of theta loses nothing:
mean(phi - theta) = phi - mean(theta). A block-wise absmax code errs by at most
half a step, absmax / 254 for int8, per value. For theta the absmax is that of
the weights; for phi - theta it is that of H inner steps, which for Adam
(steps of about the learning rate each) is at most about H times the
learning rate, with no common offset. Where that is smaller than the
weights, the same code errs less in absolute terms, and phi moves by only
beta times the error.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from noloco_jax import comm, errors
from noloco_jax.optim.noloco import (
    check_dropout_prob,
    check_error_feedback,
    check_exchange_dtype,
    check_momentum,
    check_rate,
    check_static_args,
)
from noloco_jax.optim.trees import (as_real, check_scalar_round, float_leaves, from_real,
                                    like_dtypes, zeros_where_none)

__all__ = ["DiLoCoOuterState", "diloco_outer", "INJECT_STATIC_ARGS"]

INJECT_STATIC_ARGS = ("seed", "dropout_prob", "exchange_dtype", "error_feedback", "nesterov",
                      "resync_absent")
"""Arguments to keep static in ``optax.inject_hyperparams(diloco_outer, static_args=...)``."""


class DiLoCoOuterState(NamedTuple):
    """State of the transformation returned by ``diloco_outer``.

    Attributes:
      round: int32 scalar, outer rounds taken so far (selects drop-outs).
      sgd_state: state of ``optax.sgd(learning_rate, momentum, nesterov)``.
      residual: with ``error_feedback``, what this replica's last 8-bit
        messages left out (float32, shaped like the params), added to its next
        pseudo-gradient before it is encoded; ``None`` otherwise.
    """

    round: jax.Array
    sgd_state: optax.OptState
    residual: Any = None


def _wire_mean(
    grad: optax.Updates, residual: Any, axis_name: str, exchange_dtype: Any,
    present: jax.Array | None, resync: bool = False,
) -> tuple[optax.Updates, Any]:  # fmt: skip
    """The mean pseudo-gradient over ``exchange_dtype`` messages, and the new residual."""
    if residual is None:
        return comm.all_replica_mean(grad, axis_name, present, exchange_dtype,
                                     absent_takes_mean=resync), None  # fmt: skip
    send = jax.tree.map(lambda g, e: g.astype(jnp.float32) + e, grad, residual)
    mean, send_left, relay_left = comm.all_replica_mean_wire(
        send, axis_name, exchange_dtype, present, absent_takes_mean=resync)
    mean = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, grad)
    if present is not None:  # an absent replica sent nothing: its residual stays, and it
        if not resync:  # steps on its own gradient (resync: on the shared mean)
            mean = jax.tree.map(lambda m, g: jnp.where(present, m, g), mean, grad)
        send_left = jax.tree.map(lambda s, e: jnp.where(present, s, e), send_left, residual)
    return mean, jax.tree.map(jnp.add, send_left, relay_left)


def diloco_outer(
    learning_rate: optax.ScalarOrSchedule = 0.7,
    momentum: float | jax.Array = 0.3,
    nesterov: bool = False,
    axis_name: str | None = "replica",
    *,
    dropout_prob: float = 0.0,
    seed: int = 0,
    exchange_dtype: Any = None,
    error_feedback: bool = False,
    resync_absent: bool = False,
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
        local-only step. Its slow weights then leave the shared ones for good:
        DiLoCo has no pull back and, unless ``resync_absent``, nothing re-sends
        it the shared weights when it returns. The alternative, waiting for
        it, changes only wall time (see netsim).
      seed: seeds the drop-outs.
      exchange_dtype: what the pseudo-gradients phi - theta travel as.
        ``None`` (or the params' own dtype, when it is float32 or wider): an
        all-reduce, as before; a 16-bit params' own dtype takes the wire path below. A
        narrower float dtype (``jnp.bfloat16``), ``"int8"`` or
        ``"float8_e4m3fn"`` (block-wise 8-bit codes with a float32 scale per
        256 values, ``noloco_jax.quantize``): an all-to-all and an all-gather
        of the encoded values, summed in float32 in between
        (``comm.all_replica_mean_wire``); every replica gets the same mean,
        for 8-bit formats 1/4 + 1/256 of a float32 ring all-reduce's bytes
        (plus padding to whole blocks). A 1-byte float dtype (``jnp.float8_e4m3fn``: a
        plain cast, no scales) is refused.
        The pseudo-gradient quantises well where the weights would not: it
        is the change of H inner steps, small and centred on zero, so a
        block's scale follows the size of the update rather than of the
        weights, and the same relative error is a far smaller absolute one.
      error_feedback: with an 8-bit ``exchange_dtype``, each replica adds what
        its last messages left out (its own encoding, and the encoding of the
        mean shard it relays) to its next pseudo-gradient (kept in the state),
        so quantisation errors do not accumulate over rounds.
      resync_absent: an absent replica (drop-out, or ``active=False``) sends
        nothing but takes the present replicas' shared step (a momentum-only
        step when none is present), as when a returning replica is sent the
        shared weights: its progress of the round is lost and every replica's
        slow weights stay one. A replica the non-finite guard of ``local_steps``
        catches keeps its own slow weights, unless ``local_steps(...,
        resync_caught=True)`` (what the trainer sets with ``fault.resync_absent``):
        then it takes this shared step too.

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
    check_static_args("diloco", seed=seed, dropout_prob=dropout_prob,
                      exchange_dtype=exchange_dtype, error_feedback=error_feedback)
    check_exchange_dtype(exchange_dtype)
    check_error_feedback(error_feedback, exchange_dtype)
    errors.check_bool("resync_absent", resync_absent)
    beta = check_rate("learning_rate", learning_rate)
    alpha = check_momentum("momentum", momentum)
    errors.check_bool("nesterov", nesterov)
    sgd = optax.sgd(beta, momentum=alpha, nesterov=nesterov)
    dropout_prob = check_dropout_prob(dropout_prob)

    def init_fn(params: optax.Params) -> DiLoCoOuterState:
        phi = float_leaves(params)
        residual = None
        if error_feedback:
            residual = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), as_real(phi))
        return DiLoCoOuterState(jnp.zeros([], jnp.int32), sgd.init(phi), residual)

    def update_fn(
        outer_grad: optax.Updates,
        state: DiLoCoOuterState,
        params: optax.Params | None = None,
        active: jax.Array | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, DiLoCoOuterState]:
        del extra_args
        check_scalar_round(state.round, "diloco_outer")
        full, params, outer_grad = params, float_leaves(params), float_leaves(outer_grad)
        residual = state.residual
        if axis_name is not None:
            comm.axis_size(axis_name)  # clear error if unbound
            own = outer_grad
            present = active
            if dropout_prob > 0:
                mine = comm.own_presence(state.round, axis_name, dropout_prob, seed)
                present = mine if present is None else present & mine
            if exchange_dtype is None:
                outer_grad = comm.all_replica_mean(outer_grad, axis_name, weight=present,
                                                   absent_takes_mean=resync_absent)  # fmt: skip
            else:
                outer_grad, residual = _wire_mean(as_real(outer_grad), residual, axis_name,
                                                  exchange_dtype, present, resync_absent)
                outer_grad = from_real(outer_grad, own)  # complex leaves travel as real pairs
            # A wire's mean comes back in at least float32; the momentum keeps phi's dtype (a
            # bfloat16 trace would turn float32 after one round: a retrace, a failed cond).
            outer_grad = like_dtypes(outer_grad, own)
        delta, sgd_state = sgd.update(outer_grad, state.sgd_state, params)
        delta, sgd_state = like_dtypes(delta, outer_grad), like_dtypes(sgd_state, state.sgd_state)
        delta = zeros_where_none(delta, full) if full is not None else delta
        return delta, DiLoCoOuterState(optax.safe_int32_increment(state.round), sgd_state,
                                       residual)  # fmt: skip

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

