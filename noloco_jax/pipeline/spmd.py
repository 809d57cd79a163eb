"""The routed pipeline on a 2-D ``(replica, stage)`` device mesh with ``jax.shard_map``.

Device (r, s) holds stage s of replica r: its slice of the stacked blocks
(split over the "stage" mesh axis) plus the embedding / final norm / head,
which are replicated over "stage" but used only by the first / last stage.
The forward pass takes S ticks; at tick t the devices of stage t apply their
blocks, then every device (k, t) sends its micro-batches' activations and
labels to (perm[b, k], t + 1) with ``ppermute`` over both mesh axes, the
bijection chosen per micro-batch from the shared pool by ``lax.switch``
(static permutations, as NoLoCo's groups). Autodiff transposes each
``ppermute``, so gradients retrace the forward path; gradients of the
replicated leaves are summed over "stage" by shard_map's autodiff, so only
their owning stage contributes. Simulation-grade: every device computes every
tick and keeps only its own stage's result.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from noloco_jax.models import cross_entropy
from noloco_jax.optim.local_steps import update_and_apply
from noloco_jax.pipeline.stages import leaf_owner
from noloco_jax.replicas import is_shared_leaf

__all__ = ["PipelineMesh", "make_pipeline_mesh"]

REPLICA, STAGE = "replica", "stage"


def _spec_for(path: tuple, leaf: Any) -> P:
    if getattr(leaf, "ndim", 1) == 0 and is_shared_leaf(leaf, path):
        return P()
    names = [str(getattr(k, "key", getattr(k, "name", k))) for k in path]
    if "blocks" in names:
        return P(REPLICA, STAGE)
    return P(REPLICA)


def _boundary_pairs(perm: np.ndarray, stage: int, num_stages: int) -> list[tuple[int, int]]:
    # Linear device index over (replica, stage) is replica * S + stage.
    return [(k * num_stages + stage, int(perm[k]) * num_stages + stage + 1) for k in range(len(perm))]


class PipelineMesh:
    """Runs routed-pipeline losses and training steps on a ``(replica, stage)`` mesh.

    Args:
      mesh: a 2-D mesh with axes ("replica", "stage").
      graphdef: the model's graphdef.
      pool: the routing permutation pool, [K, N] (``routing.permutation_pool``).
    """

    def __init__(self, mesh: jax.sharding.Mesh, graphdef: Any, pool: np.ndarray):
        self.mesh, self.graphdef, self.pool = mesh, graphdef, np.asarray(pool)
        self.num_replicas = mesh.shape[REPLICA]
        self.num_stages = mesh.shape[STAGE]

    def specs(self, tree: Any) -> Any:
        """Partition specs of a replicated-layout tree (params, grads, optimizer state)."""
        return jax.tree_util.tree_map_with_path(_spec_for, tree)

    def put(self, tree: Any) -> Any:
        return jax.tree.map(
            lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)), tree, self.specs(tree)
        )

    # -------------------------------------------------------------- the local program

    def _route(self, x_BxT: jax.Array, idx_B: jax.Array, boundary: int) -> jax.Array:
        def send(perm: np.ndarray, v: jax.Array) -> jax.Array:
            pairs = _boundary_pairs(perm, boundary, self.num_stages)
            return lax.ppermute(v, (REPLICA, STAGE), pairs)

        branches = [functools.partial(send, p) for p in self.pool]
        moved = [lax.switch(idx_B[b], branches, x_BxT[b]) for b in range(x_BxT.shape[0])]
        return jnp.stack(moved)

    def _local_loss(self, params: Any, tokens_BxT1: jax.Array, idx: jax.Array) -> jax.Array:
        """This device's contribution: its replica's mean loss if it is a last stage, else 0."""
        stage = lax.axis_index(STAGE)
        model = nnx.merge(self.graphdef, params)
        # Inputs and embedding are the same on every stage of a replica; what flows
        # through the pipeline differs per stage, so mark it stage-varying.
        x = lax.pcast(model.embed(tokens_BxT1[:, :-1]), (STAGE,), to="varying")
        y = lax.pcast(tokens_BxT1[:, 1:], (STAGE,), to="varying")
        for t in range(self.num_stages):
            x = jnp.where(stage == t, model.run_layers(x), x)
            if t < self.num_stages - 1:
                x, y = self._route(x, idx[t], t), self._route(y, idx[t], t)
        loss = cross_entropy(model.head(x), y).mean()
        return jnp.where(stage == self.num_stages - 1, loss, 0.0)

    def _loss_and_grads(self, params: Any, tokens: jax.Array, idx: jax.Array):
        def total(p):
            local = self._local_loss(p, tokens, idx)
            return lax.psum(local, (REPLICA, STAGE)), lax.psum(local, STAGE)

        (_, replica_loss), grads = jax.value_and_grad(total, has_aux=True)(params)
        return replica_loss, grads

    # -------------------------------------------------------------- public entry points

    def _squeeze(self, tree: Any) -> Any:
        return jax.tree.map(lambda x, s: x if s == P() else x[0], tree, self.specs(tree))

    def _expand(self, tree: Any, like: Any) -> Any:
        return jax.tree.map(lambda x, s: x if s == P() else x[None], tree, self.specs(like))

    def loss_and_grads(self) -> Callable:
        """``f(params, tokens_NxBxT1, route_idx_Sm1xB) -> (losses [N], grads)``, jitted."""

        def body(params, tokens, idx):
            loss, grads = self._loss_and_grads(self._squeeze(params), tokens[0], idx)
            return loss[None], self._expand(grads, params)

        def run(params, tokens, idx):
            spec = self.specs(params)
            fn = jax.shard_map(body, mesh=self.mesh, in_specs=(spec, P(REPLICA), P()),
                               out_specs=(P(REPLICA), spec))  # fmt: skip
            return fn(params, tokens, idx)

        return jax.jit(run)

    def train_step(
        self,
        tx_for_stage: Callable[[jax.Array], optax.GradientTransformation],
        *,
        nonfinite_guard: bool = False,
    ) -> Callable:
        """The jitted step ``f(params, opt_state, tokens, route_idx, sync_step=None)``.

        Args:
          tx_for_stage: builds the per-device optimizer given the traced local
            stage index (e.g. per-stage clipping, then NoLoCo on axis "replica").
          nonfinite_guard: put a replica whose params are not finite back on its
            slow weights on all its stages (``restore_nonfinite`` over "stage");
            use with ``local_steps(..., nonfinite_guard=True)``. Skipped on steps
            called with ``sync_step=False`` (``update_and_apply``).

        Returns:
          The jitted step, returning ``(params, opt_state, losses [N])``.
          ``sync_step`` (static: None, True or False) is passed to
          ``local_steps`` as the step's phase when not None; each value
          compiles its own program.
        """

        def body(params, opt_state, tokens, idx, sync_step):
            p, s = self._squeeze(params), self._squeeze(opt_state)
            loss, grads = self._loss_and_grads(p, tokens[0], idx)
            tx = tx_for_stage(lax.axis_index(STAGE))
            p, s = update_and_apply(tx, grads, s, p, sync_step=sync_step,
                                    nonfinite_guard=nonfinite_guard, axis_name=STAGE)  # fmt: skip
            return self._expand(p, params), self._expand(s, opt_state), loss[None]

        def run(params, opt_state, tokens, idx, sync_step=None):
            ps, ss = self.specs(params), self.specs(opt_state)
            fn = jax.shard_map(functools.partial(body, sync_step=sync_step), mesh=self.mesh,
                               in_specs=(ps, ss, P(REPLICA), P()),
                               out_specs=(ps, ss, P(REPLICA)))  # fmt: skip
            return fn(params, opt_state, tokens, idx)

        return jax.jit(run, static_argnames="sync_step")


def make_pipeline_mesh(num_replicas: int, num_stages: int, devices: Any = None) -> jax.sharding.Mesh:
    """A (replica, stage) mesh of N x S devices; a clear error when too few exist."""
    devices = list(jax.devices() if devices is None else devices)
    need = num_replicas * num_stages
    if len(devices) < need:
        raise ValueError(
            f"a {num_replicas} x {num_stages} (replica x stage) mesh needs {need} devices, "
            f"{len(devices)} are visible (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count"
            f"={need})."
        )
    arr = np.asarray(devices[:need]).reshape(num_replicas, num_stages)
    return jax.make_mesh((num_replicas, num_stages), (REPLICA, STAGE), devices=arr.ravel())
