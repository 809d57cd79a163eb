"""One replica's routed-pipeline loss, with the routing as ``ppermute`` over named axes.

At every stage boundary each micro-batch's activations (and labels) move from
replica k to replica ``perm[k]``, the bijection drawn per micro-batch from the
shared pool (``routing.permutation_pool``) and chosen with ``lax.switch``, as
NoLoCo's groups are. Autodiff transposes each ``ppermute``, so gradients retrace
the path their micro-batch took.

Two views of the same math:

* ``routed_loss``: a replica holds all its stages (simulation under ``vmap``,
  or one replica per device); routing is over the ``replica`` axis.
* ``routed_loss_on_mesh``: device (r, s) of a ``(replica, stage)`` mesh holds
  stage s of replica r (the stacked blocks split over "stage"); the forward
  pass takes S ticks and routing goes from (k, s) to (perm[k], s + 1).
  Simulation-grade: every device computes every tick and keeps its own.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from noloco_jax import errors
from noloco_jax.models import cross_entropy
from noloco_jax.pipeline.stages import stage_layer_ids
from noloco_jax.sharding import path_names

__all__ = ["REPLICA", "STAGE", "routed_loss", "routed_loss_on_mesh", "stage_leaf_axes",
           "make_pipeline_mesh"]  # fmt: skip

REPLICA, STAGE = "replica", "stage"


def _route(x_BxD: jax.Array, idx_B: jax.Array, pool: np.ndarray, axes: Any,
           pairs: Callable[[np.ndarray], list]) -> jax.Array:  # fmt: skip
    """Sends micro-batch b along ``pairs(pool[idx_B[b]])`` (a static permutation per branch)."""
    branches = [functools.partial(lax.ppermute, axis_name=axes, perm=pairs(perm)) for perm in pool]
    return jnp.stack([lax.switch(idx_B[b], branches, x_BxD[b]) for b in range(x_BxD.shape[0])])


def _route_gathered(x_BxD: jax.Array, idx_B: jax.Array, pool: np.ndarray, axis: str) -> jax.Array:
    """``_route`` under ``vmap``: each replica picks, from every replica's micro-batches, the one
    sent to it. One gather, where ``_route`` compiles a switch over the pool per micro-batch."""
    sources = jnp.asarray(np.argsort(pool, axis=1).astype(np.int32))  # [K, N]: who sends to j
    src_B = sources[idx_B, lax.axis_index(axis)]
    return lax.all_gather(x_BxD, axis)[src_B, jnp.arange(x_BxD.shape[0])]


def _check_idx(idx_Sm1xB: jax.Array, num_stages: int, num_microbatches: int) -> None:
    """A ValueError unless the routing indices are [S - 1, B] (JAX would clamp or broadcast)."""
    want = (num_stages - 1, num_microbatches)
    if tuple(idx_Sm1xB.shape) != want:
        raise ValueError(f"idx_Sm1xB must have shape [S - 1, B] = {list(want)}, "
                         f"got {list(idx_Sm1xB.shape)}.")  # fmt: skip


def _check_pool(pool: np.ndarray, axis: str) -> None:
    """A ValueError unless the pool's bijections are of the ``axis`` replicas (the gather
    clamped out-of-range sources, giving a wrong loss silently)."""
    n = lax.axis_size(axis)
    errors.require(np.shape(pool)[-1] == n, "pool", f"must hold bijections of the {n} replicas "
                   f"of axis {axis!r}, got shape {list(np.shape(pool))}.")  # fmt: skip


def routed_loss(params: Any, tokens_BxT1: jax.Array, idx_Sm1xB: jax.Array, *, graphdef: Any,
                pool: np.ndarray, num_stages: int, axis_name: str = REPLICA,
                gather: bool = False) -> jax.Array:  # fmt: skip
    """Mean loss of the micro-batches this replica finishes as a last stage.

    Args:
      params: this replica's whole model.
      tokens_BxT1: this replica's stage-0 micro-batches (one sequence each).
      idx_Sm1xB: pool index of every boundary's and micro-batch's bijection
        (``routing.route_indices``; shared by all replicas).
      graphdef: the model's graphdef.
      pool: the routing pool, [K, N].
      num_stages: S; must divide the model's layers.
      axis_name: the replica axis.
      gather: route by gathering every replica's micro-batches (for ``vmap``, where that is
        a copy on one device; compile time no longer grows with pool size x micro-batches),
        instead of one ``ppermute`` per pool entry. Not for one replica per device: there
        the gather sends every replica's activations to every device (N times the traffic).

    Returns:
      The scalar loss. Under ``vmap``/``shard_map`` over replicas, the gradient
      each replica receives is that of the sum of all replicas' losses.
    """
    _check_idx(idx_Sm1xB, num_stages, tokens_BxT1.shape[0])
    _check_pool(pool, axis_name)
    model = nnx.merge(graphdef, params)
    num_layers = jax.tree.leaves(params["blocks"])[0].shape[0]
    pairs = lambda perm: [(k, int(perm[k])) for k in range(len(perm))]  # noqa: E731
    x, y = model.embed(tokens_BxT1[:, :-1]), tokens_BxT1[:, 1:]
    route = (functools.partial(_route_gathered, pool=pool, axis=axis_name) if gather else
             functools.partial(_route, pool=pool, axes=axis_name, pairs=pairs))  # fmt: skip
    for s, ids in enumerate(stage_layer_ids(num_layers, num_stages)):
        x = model.run_layers(x, ids)
        if s < num_stages - 1:
            x, y = route(x, idx_Sm1xB[s]), route(y, idx_Sm1xB[s])
    return cross_entropy(model.head(x), y).mean()


def routed_loss_on_mesh(params: Any, tokens_BxT1: jax.Array, idx_Sm1xB: jax.Array, *,
                        graphdef: Any, pool: np.ndarray, num_stages: int) -> jax.Array:  # fmt: skip
    """``routed_loss`` on device (r, s) of a ``(replica, stage)`` mesh.

    Args: as ``routed_loss``; ``params`` hold this stage's blocks only.

    Returns:
      This device's share: its replica's loss on the last stage, 0 on the
      others (``lax.psum`` over "stage" gives the replica's loss).
    """
    _check_idx(idx_Sm1xB, num_stages, tokens_BxT1.shape[0])
    mesh_stages = lax.axis_size(STAGE)  # the pairs address device (r, s) as r * S + s
    errors.require(num_stages == mesh_stages, "num_stages", f"must equal the mesh's {STAGE!r} "
                   f"axis size {mesh_stages}, got {num_stages}.")  # fmt: skip
    _check_pool(pool, REPLICA)
    stage = lax.axis_index(STAGE)
    model = nnx.merge(graphdef, params)

    def pairs(perm: np.ndarray, t: int) -> list:  # linear device index: replica * S + stage
        return [(k * num_stages + t, int(perm[k]) * num_stages + t + 1) for k in range(len(perm))]

    # Inputs and embedding are the same on every stage of a replica; what flows
    # through the pipeline differs per stage, so mark it stage-varying.
    x = lax.pcast(model.embed(tokens_BxT1[:, :-1]), (STAGE,), to="varying")
    y = lax.pcast(tokens_BxT1[:, 1:], (STAGE,), to="varying")
    for t in range(num_stages):
        x = jnp.where(stage == t, model.run_layers(x), x)
        if t < num_stages - 1:
            route = functools.partial(_route, idx_B=idx_Sm1xB[t], pool=pool, axes=(REPLICA, STAGE),
                                      pairs=functools.partial(pairs, t=t))  # fmt: skip
            x, y = route(x), route(y)
    return jnp.where(stage == num_stages - 1, cross_entropy(model.head(x), y).mean(), 0.0)


def stage_leaf_axes(path: tuple, local: Any) -> tuple[str, ...]:
    """Mesh axes of a replica's leaf on a ``(replica, stage)`` mesh: blocks split by layer."""
    return (STAGE,) if "blocks" in path_names(path) else ()


def make_pipeline_mesh(num_replicas: int, num_stages: int,
                       devices: Any = None) -> jax.sharding.Mesh:  # fmt: skip
    """A (replica, stage) mesh of N x S devices; a clear error when too few exist.

    Laid out as ``make_replicas`` lays out N replicas of S devices: the replicas are dealt
    evenly over TPU slices, each replica's stages lie in one slice (and in one process where
    they fit), and no process is left without replicas.
    """
    from noloco_jax import replicas  # noqa: PLC0415

    errors.check_int("num_replicas", num_replicas)
    errors.check_int("num_stages", num_stages)
    devices = list(jax.devices() if devices is None else devices)
    need, dims = num_replicas * num_stages, (num_replicas, num_stages)
    layout = f"a {num_replicas} x {num_stages} (replica x stage) mesh"
    if len(devices) < need:
        raise ValueError(f"{layout} needs {need} devices, {len(devices)} are visible (on CPU: "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={need}).")  # fmt: skip
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    return replicas.replica_mesh(devices, dims, (REPLICA, STAGE), explicit,
                                 f"{layout} on {need} of the {len(devices)} devices leaves")
