"""The routed pipeline simulated on one device: replicas and stages stacked, routing a gather.

All N replicas' full models are stacked on a leading axis (the replicated
layout). Stage s of every replica runs on the micro-batches it currently
holds; at each boundary the activations and their labels are gathered along
the replica axis by that boundary's bijection. ``jax.grad`` through the
gathers sends every gradient back along the path its micro-batch took.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from noloco_jax.models import cross_entropy
from noloco_jax.pipeline.stages import stage_layer_ids

__all__ = ["route_boundary", "routed_losses"]


def route_boundary(x_NxB: jax.Array, perm_BxN: jax.Array) -> jax.Array:
    """Moves micro-batch b held by replica k to replica ``perm[b, k]``.

    Raises:
      ValueError: ``perm_BxN``'s shape is not [B, N] of ``x_NxB`` ([N, B, ...]).
    """
    want = tuple(x_NxB.shape[1::-1])
    if jnp.ndim(x_NxB) < 2 or tuple(jnp.shape(perm_BxN)) != want:  # a gather clamped or dropped
        raise ValueError(f"perm_BxN must have shape [B, N] = {list(want)} for x_NxB of shape "
                         f"{list(jnp.shape(x_NxB))}, got {list(jnp.shape(perm_BxN))}.")
    inv_BxN = jnp.argsort(perm_BxN, axis=-1)  # source of each destination
    b = jnp.arange(x_NxB.shape[1])
    return x_NxB[inv_BxN.T, b[None, :]]


def routed_losses(
    params: Any,
    tokens_NxBxT1: jax.Array,
    perms: jax.Array,
    *,
    graphdef: Any,
    num_stages: int,
) -> jax.Array:
    """Mean next-token loss of the micro-batches each last-stage replica finishes, [N].

    Args:
      params: every replica's full model, leaves with a leading N axis.
      tokens_NxBxT1: replica r's stage-0 micro-batches (one sequence each), [N, B, T + 1].
      perms: destinations per boundary and micro-batch, [S - 1, B, N]
        (``routing.route_perms`` or ``routing.identity_perms``).
      graphdef: the model's graphdef.
      num_stages: S; must divide the model's number of layers.

    Returns:
      [N] losses; their sum's gradient w.r.t. stage s of replica r is the
      mean-loss gradient over exactly the B micro-batches routed through it.
    """
    model = lambda p: nnx.merge(graphdef, p)  # noqa: E731
    num_layers = jax.tree.leaves(params["blocks"])[0].shape[1]
    stages = stage_layer_ids(num_layers, num_stages)
    want = (num_stages - 1, tokens_NxBxT1.shape[1], tokens_NxBxT1.shape[0])
    if tuple(perms.shape) != want:  # JAX would broadcast or clamp a mismatched micro-batch axis
        raise ValueError(f"perms must have shape [S - 1, B, N] = {list(want)}, "
                         f"got {list(perms.shape)}.")  # fmt: skip
    x = jax.vmap(lambda p, t: model(p).embed(t))(params, tokens_NxBxT1[..., :-1])
    y = tokens_NxBxT1[..., 1:]
    for s, ids in enumerate(stages):
        x = jax.vmap(lambda p, h, ids=ids: model(p).run_layers(h, ids))(params, x)
        if s < num_stages - 1:
            x, y = route_boundary(x, perms[s]), route_boundary(y, perms[s])
    logits = jax.vmap(lambda p, h: model(p).head(h))(params, x)
    return jax.vmap(cross_entropy)(logits, y).mean(axis=(1, 2))
