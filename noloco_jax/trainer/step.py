"""Pure, module-level training and evaluation steps for one replica.

They see one replica's view (no replica axis); ``noloco_jax.replicas`` maps
them over N replicas with ``vmap`` or ``shard_map``. Collectives, if any, live
inside the optimizer on the axis "replica".
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from noloco_jax.models import apply, cross_entropy
from noloco_jax.optim.local_steps import update_and_apply

__all__ = [
    "TrainState",
    "loss_fn",
    "train_step",
    "train_chunk",
    "phased_scan",
    "sync_positions",
    "eval_token_losses",
    "eval_window_losses",
]


class TrainState(NamedTuple):
    """One replica's training state.

    Attributes:
      step: int32 scalar, optimizer steps taken (shared by all replicas).
      params: the model parameters (fast weights).
      opt_state: the optimizer state (slow weights, moments, counters).
    """

    step: jax.Array
    params: Any
    opt_state: optax.OptState


def loss_fn(params: Any, tokens_BxT1: jax.Array, *, graphdef: Any) -> jax.Array:
    """Mean next-token cross-entropy of a batch of windows [B, T + 1]."""
    logits_BxTxV = apply(graphdef, params, tokens_BxT1[:, :-1])
    return cross_entropy(logits_BxTxV, tokens_BxT1[:, 1:]).mean()


def _inject_nan(params: Any, step: jax.Array, at_step: int, replica: int, axis: str) -> Any:
    """NaN weights for ``replica`` at ``at_step`` (a fault drill for tests and demos)."""
    hit = (step == at_step) & (lax.axis_index(axis) == replica)
    return jax.tree.map(lambda p: jnp.where(hit, jnp.full_like(p, jnp.nan), p), params)


def train_step(
    state: TrainState,
    tokens_BxT1: jax.Array,
    *,
    graphdef: Any,
    tx: optax.GradientTransformation,
    nonfinite_guard: bool = False,
    inject_nan_step: int = -1,
    inject_nan_replica: int = 0,
    axis_name: str = "replica",
    skip: Any = None,
    sync_step: bool | None = None,
) -> tuple[TrainState, jax.Array]:
    """One optimizer step on one replica's batch; returns the new state and the loss.

    With ``nonfinite_guard`` the params of a replica the optimizer's guard
    caught are put back on its slow weights (``restore_nonfinite``). With ``skip`` (a
    ``skipping.SkipConfig``) every sequence runs through a random subset of the stages.
    ``sync_step`` (True/False) tells ``local_steps`` the step's phase statically; the
    repair then runs on sync steps only (``update_and_apply``). With ``sync_step=None``
    it runs after every step.
    """
    params = state.params
    if inject_nan_step >= 0:
        params = _inject_nan(params, state.step, inject_nan_step, inject_nan_replica, axis_name)
    if skip is None:
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens_BxT1, graphdef=graphdef)
    else:
        from noloco_jax.trainer.skipping import skip_value_and_grad  # noqa: PLC0415

        loss, grads = skip_value_and_grad(params, tokens_BxT1, state.step, graphdef=graphdef,
                                          cfg=skip, full_loss=loss_fn, axis_name=axis_name)
    params, opt_state = update_and_apply(tx, grads, state.opt_state, params, sync_step=sync_step,
                                         nonfinite_guard=nonfinite_guard)  # fmt: skip
    return TrainState(state.step + 1, params, opt_state), loss


def sync_positions(first_step: int, num_steps: int, sync_every: int) -> tuple[int, ...]:
    """Positions in a chunk of ``num_steps`` steps from ``first_step`` that end a round.

    A step ends a round (runs ``local_steps``' outer update) when the number of
    steps taken after it is a multiple of ``sync_every``.
    """
    return tuple(p for p in range(num_steps) if (first_step + p + 1) % sync_every == 0)


def train_chunk(
    state: TrainState,
    tokens_KxBxT1: jax.Array,
    *,
    sync_at: tuple[int, ...] | None = None,
    **step_kwargs: Any,
) -> tuple[TrainState, jax.Array]:
    """K consecutive ``train_step``s fused with ``lax.scan``; returns the K losses.

    Args:
      state: one replica's state.
      tokens_KxBxT1: the K batches.
      sync_at: the chunk positions whose step is a sync step of ``local_steps``
        (``sync_positions``), known on the host. The chunk is then compiled as
        scans of inner-only steps around the sync steps, so an inner step is
        exactly the inner optimizer's step: no ``lax.cond``, no extra pass over
        the weights. ``None`` decides the phase on the device every step.
      **step_kwargs: passed to ``train_step``.

    Returns:
      The new state and the K losses.
    """

    def step(s: TrainState, tokens: jax.Array, sync_step: bool | None):
        return train_step(s, tokens, sync_step=sync_step, **step_kwargs)

    return phased_scan(step, state, tokens_KxBxT1, sync_at)


def phased_scan(
    step: Callable[[Any, Any, bool | None], tuple[Any, jax.Array]],
    carry: Any,
    xs: Any,
    sync_at: tuple[int, ...] | None,
) -> tuple[Any, jax.Array]:
    """``lax.scan`` of ``step(carry, x, sync_step)`` with the sync steps known on the host.

    Args:
      step: one training step; ``sync_step`` is None (phase decided on the
        device), or True/False (the step does / does not end a round).
      carry: the state.
      xs: the K steps' inputs, stacked on the leading axis of every leaf.
      sync_at: positions in ``[0, K)`` of the sync steps, or None.

    Returns:
      The final carry and the K stacked outputs.
    """
    k = jax.tree.leaves(xs)[0].shape[0]
    at = lambda i, j: jax.tree.map(lambda x: x[i:j], xs)  # noqa: E731

    def scan(c: Any, part: Any, sync_step: bool | None):
        return lax.scan(lambda c, x: step(c, x, sync_step), c, part)

    if sync_at is None:
        return scan(carry, xs, None)
    valid = all(isinstance(p, int) and 0 <= p < k for p in sync_at)
    if not valid or len(set(sync_at)) != len(sync_at):
        raise ValueError(f"sync_at must hold distinct chunk positions in [0, {k}), "
                         f"got {sync_at!r}.")  # fmt: skip
    outs, start = [], 0
    for p in sorted(sync_at) + [k]:
        if p - start > 1:
            carry, out = scan(carry, at(start, p), False)
            outs.append(out)
        elif p - start == 1:
            carry, out = _step_in_a_loop(step, carry, at(start, p), False)
            outs.append(out)
        if p < k:
            carry, out = _step_in_a_loop(step, carry, at(p, p + 1), True)
            outs.append(out)
        start = p + 1
    return carry, jnp.concatenate(outs)


def _step_in_a_loop(
    step: Callable, carry: Any, x_1: Any, sync_step: bool
) -> tuple[Any, jax.Array]:
    """``step`` on the one input in ``x_1`` (leading axis 1), as a loop body run once.

    XLA updates a loop's carried state in place; the same step as straight-line
    code kept about two more weight-sized temporaries (measured on paper-small).
    The trip count goes through an optimization barrier, so XLA cannot see it
    is 1 and inline the loop (as it does with a length-1 ``lax.scan``).
    Returns the carry and the output with a leading axis of 1.
    """
    once = lax.optimization_barrier(jnp.int32(1))
    x = jax.tree.map(lambda v: v[0], x_1)
    shape = jax.eval_shape(lambda c: step(c, x, sync_step)[1], carry)
    # Derived from the input, so that under shard_map it varies over replicas like the output.
    seed = jax.tree.leaves(x)[0].ravel()[0]
    out0 = jnp.zeros(shape.shape, shape.dtype) + (seed * 0).astype(shape.dtype)

    def body(c):
        i, s, _ = c
        s, out = step(s, x, sync_step)
        return i + 1, s, out.astype(shape.dtype)

    _, carry, out = lax.while_loop(lambda c: c[0] < once, body, (jnp.int32(0), carry, out0))
    return carry, out[None]


def eval_token_losses(
    params: Any, windows_WxT1: jax.Array, *, graphdef: Any, batch_size: int
) -> jax.Array:
    """Next-token cross-entropy of every position of every window, [W, T] float32.

    Windows are evaluated ``batch_size`` at a time (``lax.map``) to bound memory.
    """
    num = windows_WxT1.shape[0]
    if num % batch_size:
        raise ValueError(f"{num} eval windows are not divisible by batch_size={batch_size}.")
    batches = windows_WxT1.reshape(num // batch_size, batch_size, windows_WxT1.shape[-1])

    def one(tokens_BxT1: jax.Array) -> jax.Array:
        logits = apply(graphdef, params, tokens_BxT1[:, :-1])
        return cross_entropy(logits, tokens_BxT1[:, 1:]).astype(jnp.float32)

    return lax.map(one, batches).reshape(num, -1)


def eval_window_losses(
    params: Any, windows_WxT1: jax.Array, *, graphdef: Any, batch_size: int
) -> jax.Array:
    """Mean cross-entropy of each validation window, [W]."""
    return eval_token_losses(params, windows_WxT1, graphdef=graphdef, batch_size=batch_size).mean(-1)
