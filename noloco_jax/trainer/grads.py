"""Gradient functions ``grads_fn(params, tokens, step) -> (loss, grads)`` for ``train_step``.

Each is written for one replica (one device's view on a mesh), with any
communication as collectives over named axes:

* ``plain``: the model's loss on the batch;
* ``skipping``: every sequence through a random subset of stages (SkipPipe);
* ``routed``: a pipeline with random routing between replicas, simulated
  (each replica holds all its stages; routing over "replica");
* ``routed_on_mesh``: the same on a ``(replica, stage)`` device mesh;

and ``accumulated`` wraps one to take the batch in micro-batches (gradient accumulation).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from noloco_jax import pipeline as pl
from noloco_jax.pipeline.routed import REPLICA, STAGE
from noloco_jax.skippipe.training import SkipConfig, skip_value_and_grad
from noloco_jax.trainer.step import GradsFn, loss_fn

__all__ = ["plain", "skipping", "routed", "routed_on_mesh", "per_stage", "accumulated"]


def plain(graphdef: Any) -> GradsFn:
    """Loss and gradients of the whole model on the batch."""

    def grads_fn(params: Any, tokens: jax.Array, step: jax.Array):
        return jax.value_and_grad(loss_fn)(params, tokens, graphdef=graphdef)

    return grads_fn


def accumulated(grads_fn: GradsFn, micro_batches: int) -> GradsFn:
    """``grads_fn`` over ``micro_batches`` slices of the batch, one after another.

    Gradient accumulation: the loss and gradients are the means over the slices, which for a
    mean loss over equal slices are the whole batch's (to float rounding), while only one
    slice's activations are alive at a time. Slice ``i`` holds rows ``i, i + k, i + 2k, ...``,
    so on a replica split over devices every device keeps its own rows (when ``mesh.fsdp``
    divides the rows of a slice; the settings warn otherwise). Sums run in float32 and the
    gradients come back in their own dtype.

    Args:
      grads_fn: a per-replica ``grads_fn`` whose gradients do not depend on the row index
        (``plain``); 1 returns it unchanged.
      micro_batches: k >= 1, a divisor of the batch.

    Returns:
      A ``grads_fn`` with the same signature.
    """
    if micro_batches == 1:
        return grads_fn

    def fn(params: Any, tokens: jax.Array, step: jax.Array):
        rows = tokens.shape[0] // micro_batches
        slices = tokens.reshape(rows, micro_batches, *tokens.shape[1:]).swapaxes(0, 1)

        def add(total: Any, tokens_slice: jax.Array) -> tuple[Any, None]:
            loss, grads = grads_fn(params, tokens_slice, step)
            return jax.tree.map(lambda t, x: t + x.astype(t.dtype), total, (loss, grads)), None

        # zeros_like keeps the params' replica axis (under shard_map), as the sums must.
        zeros = jax.tree.map(lambda p: jnp.zeros_like(p, jnp.promote_types(p.dtype, jnp.float32)),
                             params)  # fmt: skip
        loss0 = jnp.zeros_like(jax.tree.leaves(params)[0], jnp.float32, shape=())
        (loss, grads), _ = lax.scan(add, (loss0, zeros), slices)
        grads = jax.tree.map(lambda g, p: (g / micro_batches).astype(p.dtype), grads, params)
        return loss / micro_batches, grads

    return fn


def skipping(graphdef: Any, cfg: SkipConfig) -> GradsFn:
    """Each sequence through its own random stage path (drawn per step and replica)."""

    def grads_fn(params: Any, tokens: jax.Array, step: jax.Array):
        return skip_value_and_grad(params, tokens, step, graphdef=graphdef, cfg=cfg,
                                   full_loss=loss_fn, axis_name=REPLICA)  # fmt: skip

    return grads_fn


def _route_idx(step: jax.Array, tokens: jax.Array, pool: np.ndarray, num_stages: int, seed: int,
               fixed: bool) -> jax.Array:  # fmt: skip
    """Pool index of each boundary and micro-batch (a row of ``tokens``), [S - 1, B]."""
    if fixed:  # pool row 0 is the identity
        return jnp.zeros((num_stages - 1, tokens.shape[0]), jnp.int32)
    return pl.route_indices(step, num_boundaries=num_stages - 1, num_microbatches=tokens.shape[0],
                            pool_size=len(pool), seed=seed)  # fmt: skip


def routed(graphdef: Any, pool: np.ndarray, num_stages: int, *, seed: int,
           fixed: bool = False) -> GradsFn:  # fmt: skip
    """The routed pipeline simulated under ``vmap``: every replica holds all its stages and
    routing gathers over "replica"."""

    def grads_fn(params: Any, tokens: jax.Array, step: jax.Array):
        idx = _route_idx(step, tokens, pool, num_stages, seed, fixed)
        loss = functools.partial(pl.routed_loss, graphdef=graphdef, pool=pool,
                                 num_stages=num_stages, gather=True)  # fmt: skip
        return jax.value_and_grad(loss)(params, tokens, idx)

    return grads_fn


def routed_on_mesh(graphdef: Any, pool: np.ndarray, num_stages: int, *, seed: int,
                   fixed: bool = False) -> GradsFn:  # fmt: skip
    """The routed pipeline on a ``(replica, stage)`` mesh; the loss is the replica's."""

    def grads_fn(params: Any, tokens: jax.Array, step: jax.Array):
        idx = _route_idx(step, tokens, pool, num_stages, seed, fixed)

        def total(p):
            local = pl.routed_loss_on_mesh(p, tokens, idx, graphdef=graphdef, pool=pool,
                                           num_stages=num_stages)  # fmt: skip
            return lax.psum(local, (REPLICA, STAGE)), lax.psum(local, STAGE)

        (_, loss), grads = jax.value_and_grad(total, has_aux=True)(params)
        return loss, grads

    return grads_fn


def per_stage(build_tx: Callable[..., Any]) -> optax.GradientTransformationExtraArgs:
    """The local stage's optimizer on a ``(replica, stage)`` mesh (per-stage clipping).

    Args:
      build_tx: ``build_tx(stage=None | traced stage index)`` -> the optimizer;
        its state must not depend on the stage.
    """

    def update(updates: Any, state: Any, params: Any = None, **extra: Any):
        return build_tx(stage=lax.axis_index(STAGE)).update(updates, state, params, **extra)

    return optax.GradientTransformationExtraArgs(build_tx().init, update)
