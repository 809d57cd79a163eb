"""Pure training and evaluation steps for one replica.

They see one replica's view (no replica axis); ``noloco_jax.replicas`` maps
them over the replicas (``vmap``, or ``shard_map`` on a device mesh).
Collectives live inside the optimizer and the gradient functions, on named
axes.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from noloco_jax import errors
from noloco_jax.models import apply, cross_entropy
from noloco_jax.optim.local_steps import restore_nonfinite

__all__ = [
    "TrainState",
    "loss_fn",
    "train_step",
    "run_steps",
    "make_program",
    "make_window_program",
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


GradsFn = Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]]


def train_step(
    state: TrainState,
    tokens_BxT1: jax.Array,
    *,
    grads_fn: GradsFn,
    tx: optax.GradientTransformation,
    sync_step: bool | int | None = None,
    merge_step: bool | int | None = None,
    nonfinite_guard: bool = False,
    guard_axis: str | None = None,
    corrupt: Callable[[Any, jax.Array], Any] | None = None,
) -> tuple[TrainState, jax.Array]:
    """One optimizer step on one replica's batch; returns the new state and the loss.

    Args:
      state: one replica's state.
      tokens_BxT1: its batch.
      grads_fn: ``grads_fn(params, tokens, step) -> (loss, grads)``
        (``trainer.grads``: plain, stage skipping, routed pipeline).
      tx: the optimizer.
      sync_step: the step's phase for ``local_steps`` (True: it ends a round,
        or with a delay starts its exchange; with fragments the fragment's
        index), or None to let it decide on the device.
      merge_step: with ``local_steps(..., delay > 0)`` and a ``sync_step``:
        whether this step merges the pending exchange (True or the fragment).
      nonfinite_guard: put the params of a replica the optimizer's guard caught
        back on its slow weights (``restore_nonfinite``; on sync and merge steps only).
      guard_axis: intra-replica axis for the guard (a replica's stages).
      corrupt: ``corrupt(params, step)`` before the step (fault drills).

    Returns:
      The new state and the loss.
    """
    params = state.params if corrupt is None else corrupt(state.params, state.step)
    loss, grads = grads_fn(params, tokens_BxT1, state.step)
    phase = {k: v for k, v in (("sync_step", sync_step), ("merge_step", merge_step))
             if v is not None}  # fmt: skip
    updates, opt_state = tx.update(grads, state.opt_state, params, **phase)
    params = optax.apply_updates(params, updates)
    merges = merge_step is not None and merge_step is not False  # fragment 0 == False
    if nonfinite_guard and (sync_step is not False or merges):
        params = restore_nonfinite(params, opt_state, guard_axis)
    return TrainState(state.step + 1, params, opt_state), loss


def run_steps(
    state: TrainState,
    tokens_KxBxT1: jax.Array,
    *,
    step_fn: Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]],
) -> tuple[TrainState, jax.Array]:
    """``step_fn`` on each of the K batches in turn, in one loop.

    K is the tokens' leading size, fixed when the program compiles (each K compiles once;
    BENCHMARKS.md: "trip count").

    Returns:
      The new state and the K losses.
    """
    return lax.scan(step_fn, state, tokens_KxBxT1)


def make_program(reps: Any, *, sync_step: bool | None, donate: bool = True, **step_kwargs: Any
                 ) -> Callable:  # fmt: skip
    """``program(state, tokens [N, K, B, T + 1])``: ``run_steps`` of ``train_step`` over
    the replicas of ``reps`` (a ``replicas.Replicas``), jitted with the state donated.

    Args:
      reps: the topology.
      sync_step: the phase of every step it runs (see ``train_step``).
      donate: let the program reuse the state's buffers (the trainer does).
      **step_kwargs: the rest of ``train_step``'s arguments (``grads_fn``, ``tx``, ...).
    """
    step_fn = functools.partial(train_step, sync_step=sync_step, **step_kwargs)
    return jax.jit(reps.map(functools.partial(run_steps, step_fn=step_fn)),
                   donate_argnums=0 if donate else ())


def make_window_program(reps: Any, *, delay: int, fragment: int | None = None,
                        donate: bool = True, **step_kwargs: Any) -> Callable:  # fmt: skip
    """``program(state, tokens)``: one round's overlap window of ``local_steps(..., delay)``.

    The window is the step that starts the exchange, ``delay - 1`` inner steps
    and the step that merges it (``delay + 1`` steps, ``tokens`` one
    [N, 1, B, T + 1] array each), jitted over the replicas of ``reps`` with
    the state donated.

    Args:
      reps: the topology.
      delay: tau >= 1.
      fragment: the fragment whose round it is (None without fragments).
      donate: let the program reuse the state's buffers.
      **step_kwargs: the rest of ``train_step``'s arguments (``grads_fn``, ``tx``, ...).
    """
    flag = True if fragment is None else fragment
    phases = [(flag, False)] + [(False, False)] * (delay - 1) + [(False, flag)]

    def window(state: TrainState, tokens: tuple[jax.Array, ...]) -> tuple[TrainState, jax.Array]:
        losses = []  # unrolled, so the exchange may run during the steps before the merge
        for (sync_step, merge_step), tokens_1xBxT1 in zip(phases, tokens, strict=True):
            state, loss = train_step(state, tokens_1xBxT1[0], sync_step=sync_step,
                                     merge_step=merge_step, **step_kwargs)  # fmt: skip
            losses.append(loss)
        return state, jnp.stack(losses)

    return jax.jit(reps.map(window), donate_argnums=0 if donate else ())


def eval_token_losses(
    params: Any, windows_WxT1: jax.Array, *, graphdef: Any, batch_size: int
) -> jax.Array:
    """Next-token cross-entropy of every position of every window, [W, T] float32.

    Windows are evaluated ``batch_size`` at a time (``lax.map``) to bound memory.
    """
    errors.check_int("batch_size", batch_size)  # 0 was a ZeroDivisionError, 1.5 JAX's TypeError
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
