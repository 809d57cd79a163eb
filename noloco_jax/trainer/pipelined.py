"""Training steps for pipelined runs (num_stages > 1): simulated, or on a (replica, stage) mesh.

Both keep the replicated layout (every replica's whole model on the leading
axis) and the chunk signature of ``step.train_chunk`` mapped over replicas:
``chunk(state, tokens [N, K, B, T + 1]) -> (state, losses [N, K])``, so the
loop, checkpoints and evaluation are the same as without stages. Each
sequence is one micro-batch; ``B`` micro-batches per replica per step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from noloco_jax import pipeline as pl
from noloco_jax import replicas
from noloco_jax.optim.local_steps import update_and_apply
from noloco_jax.trainer.step import TrainState, phased_scan

__all__ = ["PipelineRunner", "make_pipeline_runner"]


def _route_idx(step: Any, s: Any, pool_size: int) -> jax.Array:
    if s.routing == "fixed":  # pool row 0 is the identity
        return jnp.zeros((s.num_stages - 1, s.batch_per_replica), jnp.int32)
    return pl.route_indices(step, num_boundaries=s.num_stages - 1,
                            num_microbatches=s.batch_per_replica, pool_size=pool_size,
                            seed=s.seed)  # fmt: skip


class PipelineRunner:
    """Chunk functions and state placement for a pipelined run.

    Attributes:
      make_chunk: ``make_chunk(sync_at)`` -> ``chunk(state, tokens)``; ``sync_at``
        is None (phase on the device) or the chunk's sync positions
        (``step.sync_positions``), as in ``step.train_chunk``.
      put: places a replicated state where the chunk expects it.
      backend: "vmap" or "shard_map".
      max_layouts: how many ``sync_at`` layouts are worth a program each (the
        mesh runner compiles one program per phase, not per layout).
    """

    def __init__(self, make_chunk: Callable, put: Callable, backend: str, max_layouts: int):
        self.make_chunk, self.put = make_chunk, put
        self.backend, self.max_layouts = backend, max_layouts


def _sim_runner(s: Any, graphdef: Any, tx: optax.GradientTransformation, pool) -> PipelineRunner:
    reps = replicas.Replicas(s.num_replicas)

    def step(state: TrainState, tokens_NxBxT1: jax.Array, sync_step: bool | None):
        perms = pl.route_perms(pool, _route_idx(state.step, s, len(pool)))

        def total(p):
            losses = pl.routed_losses(p, tokens_NxBxT1, perms, graphdef=graphdef,
                                      num_stages=s.num_stages)  # fmt: skip
            return losses.sum(), losses

        (_, losses), grads = jax.value_and_grad(total, has_aux=True)(state.params)
        apply = reps.map(functools.partial(update_and_apply, tx, sync_step=sync_step,
                                           nonfinite_guard=s.fault.nonfinite_guard))  # fmt: skip
        params, opt_state = apply(grads, state.opt_state, state.params)
        return TrainState(state.step + 1, params, opt_state), losses

    def make_chunk(sync_at: tuple[int, ...] | None) -> Callable:
        def chunk(state, tokens_NxKxBxT1):
            tokens_KxNxBxT1 = jnp.moveaxis(tokens_NxKxBxT1, 1, 0)
            state, losses_KxN = phased_scan(step, state, tokens_KxNxBxT1, sync_at)
            return state, losses_KxN.T

        return jax.jit(chunk, donate_argnums=0)

    return PipelineRunner(make_chunk, lambda t: t, "vmap", max_layouts=2)


def _mesh_runner(s: Any, graphdef: Any, make_tx: Callable, pool) -> PipelineRunner:
    mesh = pl.PipelineMesh(pl.make_pipeline_mesh(s.num_replicas, s.num_stages), graphdef, pool)
    one_step = mesh.train_step(make_tx, nonfinite_guard=s.fault.nonfinite_guard)
    route = jax.jit(functools.partial(_route_idx, s=s, pool_size=len(pool)))

    def make_chunk(sync_at: tuple[int, ...] | None) -> Callable:
        def chunk(state, tokens_NxKxBxT1):
            params, opt_state, step, losses = state.params, state.opt_state, state.step, []
            for k in range(tokens_NxKxBxT1.shape[1]):
                tokens = mesh.put(tokens_NxKxBxT1[:, k])
                phase = None if sync_at is None else k in sync_at
                params, opt_state, loss = one_step(params, opt_state, tokens, route(step),
                                                   sync_step=phase)  # fmt: skip
                step = step + 1
                losses.append(loss)
            return TrainState(step, params, opt_state), jnp.stack(losses, axis=1)

        return chunk

    # One step per program: any layout reuses the inner-step and the sync-step programs.
    return PipelineRunner(make_chunk, mesh.put, "shard_map", max_layouts=10**9)


def make_pipeline_runner(s: Any, graphdef: Any, build_tx: Callable[..., Any]) -> PipelineRunner:
    """The runner for settings ``s`` (backend "auto" uses the mesh when N x S devices exist).

    Args:
      s: the run's ``TrainSettings`` (num_stages > 1).
      graphdef: the model's graphdef.
      build_tx: ``build_tx(stage=None | traced index)`` -> the per-replica optimizer.
    """
    pool = pl.permutation_pool(s.num_replicas, s.routing_pool_size, s.seed)
    need = s.num_replicas * s.num_stages
    use_mesh = s.backend == "shard_map" or (s.backend == "auto" and len(jax.devices()) >= need)
    if use_mesh:
        return _mesh_runner(s, graphdef, lambda stage: build_tx(stage=stage), pool)
    return _sim_runner(s, graphdef, build_tx(stage=None), pool)
