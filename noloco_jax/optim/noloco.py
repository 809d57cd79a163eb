"""The NoLoCo outer optimizer: heavy-ball momentum over random small groups.

Notation (paper -> code): alpha = ``momentum``, beta = ``learning_rate``,
gamma = ``gamma``, n = ``group_size``, phi = slow weights (``params``),
theta = fast weights after the inner steps.

Derivation of what is computed
------------------------------
For replica i in its group G of this round, the paper (Eq. 1-3, with the sign
of the beta term as in its Appendix A.2 and the reference code) updates

    delta_i <- alpha delta_i + beta mean_G(theta - phi) - gamma (phi_i - mean_G phi)
    phi_i   <- phi_i + delta_i.

Writing mean_G(theta - phi) = mean_G theta - mean_G phi and regrouping,

    delta_i <- alpha delta_i - beta g_i,
    g_i      = (phi_i - mean_G theta) + (gamma / beta - 1) (phi_i - mean_G phi),

which is ``optax.sgd(beta, momentum=alpha)`` (heavy ball, not Nesterov) applied
to the group pseudo-gradient g_i. With gamma = beta (the reference code, and
our default ``gamma=None``) the second term vanishes, so only theta has to
travel: half the bytes of the reference, which sends phi and theta - phi.

The input is the local pseudo-gradient ``outer_grad = phi_i - theta_i`` (DiLoCo
convention: positive means "descend"), so theta_i = phi_i - outer_grad.

With ``local_steps(..., delay=tau)`` this step runs tau steps before its round ends, on
theta and phi of that step; phi does not move until the merge, so the gamma pull is the one
above with phi and mean_G phi of that step (derivation: ``noloco_jax.optim.local_steps``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax import comm, errors, quantize
from noloco_jax.comm import check_exchange_dtype
from noloco_jax.optim.trees import (BATCHED_COUNTER_FIX, as_real, check_scalar_round,
                                    float_leaves, from_real, is_batched, like_dtypes,
                                    zeros_where_none)

__all__ = [
    "NoLoCoOuterState",
    "noloco_outer",
    "check_dropout_prob",
    "check_error_feedback",
    "check_momentum",
    "check_rate",
    "check_static_args",
    "rate_at",
    "INJECT_STATIC_ARGS",
]


class NoLoCoOuterState(NamedTuple):
    """State of the transformation returned by ``noloco_outer``.

    Attributes:
      round: int32 scalar, outer rounds taken so far; selects this round's
        groups, identically on every replica.
      sgd_state: state of ``optax.sgd(learning_rate, momentum)``; its trace is
        the heavy-ball buffer (delta = -learning_rate * trace).
      residual: with ``error_feedback``, what the last 8-bit message left out
        (added to the next one); ``None`` otherwise.
    """

    round: jax.Array
    sgd_state: optax.OptState
    residual: Any = None


def check_rate(name: str, value: Any) -> Any:
    """An outer rate (beta, alpha, gamma): a finite number >= 0; arrays and schedules pass.

    Arrays and callables come from ``optax.inject_hyperparams`` and optax
    schedules (``ScalarOrSchedule``); they are values on the device, which a
    Python check cannot see. A NumPy scalar (or 0-d array) is a host number and
    is checked as one. ``name`` is the field the message names.
    """
    return value if _on_device(value) else errors.check_number(name, _number(value))


def check_momentum(name: str, value: Any) -> Any:
    """The outer momentum alpha: in [0, 1) (heavy ball diverges from 1 on); arrays pass, as in
    ``check_rate``. A schedule is refused: ``optax.sgd`` takes a constant momentum (one of
    ``optax.inject_hyperparams`` arrives as an array)."""
    errors.require(not callable(value), name, f"must be a number in [0, 1) or an array, not a "
                   f"schedule (wrap the optimizer in optax.inject_hyperparams to schedule it), "
                   f"got {value!r}.")  # fmt: skip
    if _on_device(value):
        return value
    return errors.check_number(name, _number(value), 0, 1, open_high=True)


def _on_device(value: Any) -> bool:
    """An array or a schedule: a value a Python check cannot see (a NumPy scalar it can)."""
    return callable(value) or isinstance(value, jax.Array) or (
        isinstance(value, np.ndarray) and value.ndim > 0)


def _number(value: Any) -> Any:
    """A NumPy scalar or 0-d array as a Python number."""
    return value.item() if isinstance(value, (np.ndarray, np.generic)) else value


def check_dropout_prob(value: Any, field: str = "dropout_prob") -> float:
    """The drop-out rule: a probability in [0, 1) (1 would leave no round); returns it."""
    return errors.check_number(field, value, 0, 1, open_high=True)


def check_error_feedback(error_feedback: bool, exchange_dtype: Any, *,
                         field: str = "error_feedback",
                         dtype_field: str = "exchange_dtype") -> None:  # fmt: skip
    """Error feedback needs an 8-bit exchange (only quantisation leaves a residual).

    Args:
      error_feedback: whether it is asked for.
      exchange_dtype: what travels (a dtype, or a name such as "int8").
      field: the name the message gives ``error_feedback``.
      dtype_field: the name the message gives ``exchange_dtype``.
    """
    errors.check_bool(field, error_feedback)
    if error_feedback and not quantize.is_codec(exchange_dtype):
        raise errors.UserError(
            f"{field} needs an 8-bit {dtype_field} ({', '.join(quantize.FORMATS)}), got "
            f"{dtype_field}={exchange_dtype!r}.")  # fmt: skip


def rate_at(value: Any, round_index: jax.Array) -> Any:
    """A rate's value in outer round ``round_index`` (a schedule is indexed by round)."""
    return value(round_index) if callable(value) else value


def _pseudo_gradient(
    outer_grad: optax.Updates,
    phi: optax.Params,
    round_index: jax.Array,
    *,
    axis_name: str,
    group_size: int,
    gamma_over_beta: Any,
    seed: int,
    pool_size: int | None,
    exchange_dtype: Any,
    dropout_prob: float = 0.0,
    active: jax.Array | None = None,
    stream: int | None = None,
    residual: Any = None,
) -> tuple[optax.Updates, Any]:
    """g_i = phi_i - mean_G theta + (gamma / beta - 1)(phi_i - mean_G phi), and the residual.

    Means run over the *present* members of the group: a replica that drops
    out of the round (or is marked inactive) neither sends nor uses anything
    and takes a local-only step (its g is its own pseudo-gradient); its
    partners average without it.
    """
    num_replicas = comm.axis_size(axis_name)
    if num_replicas == 1:  # a group of one: mean_G theta = theta, mean_G phi = phi
        return outer_grad, residual
    pool = comm.partition_pool(num_replicas, group_size, seed, pool_size)
    index = comm.pool_index(round_index, len(pool), seed, stream)
    present = None
    if dropout_prob > 0:
        present = comm.own_presence(round_index, axis_name, dropout_prob, seed)
    if active is not None:
        present = active if present is None else present & active
    theta = jax.tree.map(lambda p, g: p - g, phi, outer_grad)
    travel = theta if gamma_over_beta is None else (theta, phi)
    complex_like, travel = travel, as_real(travel)  # complex leaves travel as real pairs
    if residual is None:
        bar = comm.group_mean(travel, axis_name, pool, index, exchange_dtype, present)
    else:  # error feedback: send value + residual; keep what the 8-bit message left out
        # (the sum in the residual's float32: in bf16 it rounded the residual away)
        plain, travel = travel, jax.tree.map(lambda x, e: x.astype(e.dtype) + e, travel, residual)
        bar, sent, joined = comm.group_mean_codec(travel, axis_name, pool, index,
                                                  exchange_dtype, present)  # fmt: skip
        kept = lambda x, s, e: (x - s).astype(e.dtype)  # noqa: E731
        if present is None:
            residual = jax.tree.map(kept, travel, sent, residual)
        else:  # absent, or present with no partner: nothing was used, so the residual
            # stays and the local-only step uses its own theta, not theta + residual
            residual = jax.tree.map(lambda x, s, e, j: jnp.where(j, kept(x, s, e), e),
                                    travel, sent, residual, joined)  # fmt: skip
            bar = jax.tree.map(lambda b, x, j: jnp.where(j, b, x), bar, plain, joined)
    bar = from_real(bar, complex_like)
    if gamma_over_beta is None:
        return jax.tree.map(lambda p, tb: (p - tb).astype(p.dtype), phi, bar), residual
    theta_bar, phi_bar = bar
    coef = gamma_over_beta - 1.0
    g = jax.tree.map(
        lambda p, tb, pb: (p - tb + coef * (p - pb)).astype(p.dtype), phi, theta_bar, phi_bar
    )
    return g, residual


INJECT_STATIC_ARGS = ("group_size", "seed", "dropout_prob", "pool_size", "exchange_dtype",
                      "error_feedback", "nesterov")
"""Arguments to keep static in ``optax.inject_hyperparams(noloco_outer, static_args=...)``."""


def check_static_args(module: str = "noloco", **values: Any) -> None:
    """Raises if a structural argument is an array (e.g. injected by ``inject_hyperparams``).

    ``module`` names the ``noloco_jax.optim`` module whose ``INJECT_STATIC_ARGS`` to use.
    A ``seed`` must also be an integer in [0, 2**32 - 1], as the trainer's.
    """
    for name, value in values.items():
        if isinstance(value, (jax.Array, np.ndarray)):
            raise ValueError(
                f"{name} shapes the compiled exchange and must be a Python number, got an "
                f"array. With optax.inject_hyperparams pass "
                f"static_args=noloco_jax.optim.{module}.INJECT_STATIC_ARGS."
            )
    if "seed" in values:
        errors.check_int("seed", values["seed"], 0, 2**32 - 1, "2**32 - 1")


def _gamma_over_beta(gamma: Any, beta: Any) -> Any:
    """gamma / beta as a function of the round; ``None`` where gamma = beta (only theta travels)."""
    if gamma is None:
        return lambda _: None
    gamma = check_rate("gamma", gamma)
    if isinstance(gamma, float) and isinstance(beta, float):
        if gamma == beta:
            return lambda _: None
        if beta == 0:
            raise ValueError("gamma must be None or 0 when learning_rate is 0.")
        return lambda _: gamma / beta
    if callable(gamma):
        raise ValueError("gamma must be a number or an array, not a schedule.")
    if callable(beta):  # the momentum buffer would carry gamma / beta_k of earlier rounds
        raise errors.UserError(
            "gamma: a gamma of its own needs a constant learning_rate, not a schedule (the "
            "pull would be rescaled by the schedule's later values); pass gamma=None (gamma "
            "follows the schedule) or a number as learning_rate.")  # fmt: skip

    def ratio(round_index: jax.Array) -> jax.Array:
        b = jnp.asarray(rate_at(beta, round_index), jnp.float32)
        return jnp.where(b > 0, gamma / jnp.where(b > 0, b, 1.0), 1.0)

    return ratio


def noloco_outer(
    learning_rate: optax.ScalarOrSchedule = 0.7,
    momentum: float | jax.Array = 0.5,
    gamma: float | jax.Array | None = None,
    group_size: int = 2,
    axis_name: str | None = "replica",
    seed: int = 0,
    exchange_dtype: Any = None,
    *,
    pool_size: int | None = None,
    dropout_prob: float = 0.0,
    nesterov: bool = False,
    error_feedback: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """NoLoCo's outer step: momentum on the pseudo-gradient of a random group.

    Each call is one outer round. The replicas along ``axis_name`` are split
    into groups of ``group_size`` drawn afresh each round (see
    ``groups_for_round``); every replica averages only with its own group,
    through ``ppermute``, so no collective ever spans all replicas. Use it as
    the ``outer`` of ``local_steps``.

    Args:
      learning_rate: beta, the outer learning rate (paper: 0.7): a number, a
        JAX array (``optax.inject_hyperparams``) or an optax schedule of the
        outer round. As in ``optax.sgd``, it scales the momentum buffer.
      momentum: alpha, momentum (paper: 0.5 for NoLoCo); a number or array.
      gamma: pull towards the group's mean slow weights; ``None`` means
        gamma = beta (the reference code), which lets only the fast weights
        travel. The paper's range (Eq. 74, reconstructed) is
        alpha sqrt(n / (2 (n - 1))) < gamma < sqrt(n (2 + alpha^2) / (2 (n - 1))); on the
        noisy quadratic it is the spread's stability limit only at alpha = 0.5, n = 2
        (``quadratic.gamma_bounds``).
        A gamma of its own needs a constant beta: with a schedule it is
        refused, and an injected beta must not change between rounds nor be 0
        (the update is beta times a pseudo-gradient holding gamma / beta, so a
        round with beta = 0 drops the pull; a Python-number 0 with a Python-number gamma is
        refused, array ones are not checked).
      group_size: n, replicas per group (paper: 2); must divide the number of
        replicas on the axis (a lone replica, N = 1, needs no group).
      axis_name: the replica axis bound by ``jax.vmap`` or ``jax.shard_map``;
        ``None`` runs one replica alone (momentum on its own pseudo-gradient).
      seed: seeds the group draws; identical on all replicas.
      exchange_dtype: dtype of the tensors sent to the group (e.g.
        ``jnp.bfloat16`` halves the bytes of float32 params); local state keeps
        its dtype and sums run in at least float32. ``"int8"`` or
        ``"float8_e4m3fn"``: block-wise 8-bit codes with float32 scales
        (``noloco_jax.quantize``), 1/4 + 1/256 of float32's bytes (0.254); the 1-byte
        dtype ``jnp.float8_e4m3fn`` (a plain cast, no scales) is refused. What travels
        is the fast weights theta (and phi when gamma != beta): a partner
        needs theta_j itself, and no reference short of theta_j is shared by
        the two (their phi differ), so differences cannot be sent instead.
      pool_size: number of precompiled partitions to draw from (default N - 1;
        see ``noloco_jax.comm``). Lower it to bound compile time at large N. For
        group_size > 2 the default pool lets some pairs meet far more often than
        others (README, "pool_size"); a larger pool evens that out.
      dropout_prob: each replica misses each outer round with this probability
        (``comm.presence_mask``, deterministic from ``seed``): it takes a
        local-only step and its partners average without it. Nothing blocks.
        The draw depends on the round only, not on ``stream``: with streaming
        fragments a replica absent in round r misses every fragment's exchange
        of round r (an outage, not independent message losses).
      error_feedback: with an 8-bit ``exchange_dtype``, each replica adds
        the residual of its last message to the next (kept in the state), so
        quantisation errors do not accumulate over rounds.
      nesterov: Nesterov momentum instead of heavy ball (the reference code's
        and the default): delta = -beta (g + alpha (alpha m + g)) with m the
        buffer, as ``optax.sgd(..., nesterov=True)``.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``update(outer_grad, state,
      params, active=None)`` takes ``outer_grad = phi - theta`` and ``params =
      phi`` and returns delta, so that ``optax.apply_updates(phi, delta)`` is
      the new phi. ``active`` (a per-replica bool, e.g. "my weights are
      finite") removes a replica from this round like a drop-out; ``stream``
      (an int, e.g. a streaming fragment's index) draws the groups from a
      stream of its own (``groups_for_round(..., stream=)``). Non-float
      leaves (integer buffers) are neither sent nor moved (their delta is 0).

    Example:
      >>> import jax.numpy as jnp
      >>> from noloco_jax import replicas
      >>> tx = noloco_outer(axis_name="replica")
      >>> reps = replicas.make_replicas(4, backend="vmap")
      >>> phi = jnp.zeros((4, 3))                       # 4 replicas
      >>> theta = jnp.arange(12.0).reshape(4, 3)
      >>> state = reps.init(tx, phi)                    # the round counter stays shared
      >>> delta, state = reps.map(tx.update)(phi - theta, state, phi)
      >>> delta.shape, int(state.round)
      ((4, 3), 1)

    References:
      Kolehmainen et al., "NoLoCo: No-all-reduce Low Communication Training
      Method for Large Models", 2025. https://arxiv.org/abs/2506.10911
    """
    beta = check_rate("learning_rate", learning_rate)
    alpha = check_momentum("momentum", momentum)
    gamma_over_beta = _gamma_over_beta(gamma, beta)
    check_static_args(group_size=group_size, seed=seed, dropout_prob=dropout_prob,
                      exchange_dtype=exchange_dtype, error_feedback=error_feedback)
    check_exchange_dtype(exchange_dtype)
    check_error_feedback(error_feedback, exchange_dtype)
    comm.check_group_size(None, group_size)  # N is the axis size, known when traced
    if pool_size is not None:
        errors.check_int("pool_size", pool_size)
    dropout_prob = check_dropout_prob(dropout_prob)
    errors.check_bool("nesterov", nesterov)
    sgd = optax.sgd(beta, momentum=alpha, nesterov=nesterov)

    def init_fn(params: optax.Params) -> NoLoCoOuterState:
        phi = float_leaves(params)
        residual = None
        if error_feedback:
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), as_real(phi))
            residual = zeros if gamma_over_beta(0) is None else (zeros, zeros)
        return NoLoCoOuterState(jnp.zeros([], jnp.int32), sgd.init(phi), residual)

    def update_fn(
        outer_grad: optax.Updates,
        state: NoLoCoOuterState,
        params: optax.Params | None = None,
        active: jax.Array | None = None,
        stream: int | None = None,
        **extra_args: Any,
    ) -> tuple[optax.Updates, NoLoCoOuterState]:
        del extra_args
        if params is None:
            raise ValueError("noloco_outer.update needs params= the slow weights phi.")
        if is_batched(state.round):
            raise ValueError(BATCHED_COUNTER_FIX.replace("local_steps: its step", "noloco_outer: "
                                                         "its round"))  # fmt: skip
        check_scalar_round(state.round, "noloco_outer")
        phi, outer_grad = float_leaves(params), float_leaves(outer_grad)
        residual = state.residual
        if axis_name is None:
            g = outer_grad  # a group of one: mean_G theta = theta
        else:
            g, residual = _pseudo_gradient(
                outer_grad,
                phi,
                state.round,
                axis_name=axis_name,
                group_size=group_size,
                gamma_over_beta=gamma_over_beta(state.round),
                seed=seed,
                pool_size=pool_size,
                exchange_dtype=exchange_dtype,
                dropout_prob=dropout_prob,
                active=active,
                stream=stream,
                residual=residual,
            )
        delta, sgd_state = sgd.update(g, state.sgd_state, phi)
        delta, sgd_state = like_dtypes(delta, phi), like_dtypes(sgd_state, state.sgd_state)
        delta = zeros_where_none(delta, params)
        return delta, NoLoCoOuterState(optax.safe_int32_increment(state.round), sgd_state,
                                       residual)  # fmt: skip

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
