"""Which parameters each pipeline stage owns, and per-stage gradient clipping.

A model of L stacked blocks is split into S stages of L / S consecutive
blocks. Stage 0 also owns the token embedding; the last stage owns the final
norm and the output head (and computes the loss). Every replica holds all of
its stages, so the replicated layout of the rest of the library is unchanged:
stage s of replica r is a slice of replica r's params.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from noloco_jax import errors, replicas
from noloco_jax.optim.clipping import check_max_norm
from noloco_jax.optim.trees import is_float

__all__ = ["check_stages", "stage_layer_ids", "leaf_owner", "clip_by_stage_norm"]

_OWNERS = {"blocks": "blocks", "embedding": "first", "final_norm": "last", "lm_head": "last"}


def check_stages(num_layers: int, num_stages: int, field: str = "num_stages") -> None:
    """The stage rule: S is an integer >= 1 that divides the L layers (the one check of it).

    Args:
      num_layers: L, the model's blocks.
      num_stages: S.
      field: the name the message gives S ("config.num_stages", "config.skip.num_stages").

    Raises:
      UserError (a ``ValueError``): naming the field and the allowed values.
    """
    errors.check_int(field, num_stages)
    if num_layers % num_stages:
        allowed = [d for d in range(1, num_layers + 1) if num_layers % d == 0]
        raise errors.UserError(f"{field}={num_stages} must divide the model's {num_layers} "
                               f"layers; allowed: {allowed}.")  # fmt: skip


def stage_layer_ids(num_layers: int, num_stages: int) -> list[np.ndarray]:
    """Block indices of each stage: ``[s * L/S, (s + 1) * L/S)``."""
    errors.check_int("num_layers", num_layers)  # 0 or -2 gave every stage no layers
    check_stages(num_layers, num_stages)
    per = num_layers // num_stages
    return [np.arange(s * per, (s + 1) * per, dtype=np.int32) for s in range(num_stages)]


def leaf_owner(path: tuple) -> str:
    """"blocks" (split over stages by layer), "first" or "last" stage."""
    name = replicas.key_name(path[0])
    if name not in _OWNERS:
        raise ValueError(f"parameter {jax.tree_util.keystr(path)} belongs to no pipeline stage.")
    return _OWNERS[name]


def _stage_sq_norms(
    updates: Any, num_stages: int, stage: jax.Array | None, stage_axis: str
) -> jax.Array:
    """Squared gradient norm of each stage, [S].

    On a (replica, stage) mesh every device adds only what its own stage owns,
    and the S-vector is summed over the stage axis (S floats inside one
    replica's pipeline), so every device knows every stage's norm.
    """
    total = jnp.zeros([num_stages], jnp.float32)
    mine = None if stage is None else jax.nn.one_hot(stage, num_stages, dtype=jnp.float32)
    for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
        if not is_float(g):  # integer leaves: neither counted nor scaled
            continue
        g = g.astype(jnp.float32)
        owner = leaf_owner(path)
        if owner == "blocks":  # on the mesh, the local slice is this stage's blocks
            per_layer = jnp.sum(jnp.square(g).reshape(g.shape[0], -1), axis=1)
            sq = per_layer.reshape(num_stages, -1).sum(1) if stage is None else per_layer.sum()
        else:
            target = 0 if owner == "first" else num_stages - 1
            sq = jax.nn.one_hot(target, num_stages, dtype=jnp.float32) * jnp.sum(jnp.square(g))
        total = total + (sq if stage is None else mine * sq)
    return total if stage is None else jax.lax.psum(total, stage_axis)


class ClipByStageNormState(NamedTuple):
    """No state (``optax.EmptyState`` equivalent, kept explicit for readability)."""


def clip_by_stage_norm(
    max_norm: float, num_stages: int, *, stage: jax.Array | None = None, stage_axis: str = "stage"
) -> optax.GradientTransformation:
    """Clips each pipeline stage's gradient to global norm ``max_norm`` on its own.

    In the reference code every pipeline rank clips only its own parameters.
    With ``stage=None`` the updates are a replica's whole model (all stages,
    blocks stacked on their leading axis); with ``stage`` given they are one
    device's local view on a (replica, stage) mesh: its block slice plus the
    embedding / head replicated over ``stage_axis``, which get their owning
    stage's factor on every device.

    Args:
      max_norm: the clipping threshold (> 0).
      num_stages: S.
      stage: the local stage index on a (replica, stage) mesh, or None.
      stage_axis: the mesh axis of the stages (used with ``stage``).

    Returns:
      A stateless ``optax.GradientTransformation``.
    """
    check_max_norm(max_norm)
    errors.check_int("num_stages", num_stages)

    def update_fn(updates, state, params=None):
        del params
        if stage is None:  # a whole replica: its stacked blocks must split into S stages
            for path, g in jax.tree_util.tree_flatten_with_path(updates)[0]:
                if leaf_owner(path) == "blocks":
                    check_stages(g.shape[0], num_stages)
        norms = jnp.sqrt(_stage_sq_norms(updates, num_stages, stage, stage_axis))
        scale = jnp.minimum(1.0, max_norm / jnp.maximum(norms, 1e-30))

        def clip(path, g):
            if not is_float(g):
                return g
            owner = leaf_owner(path)
            if owner == "blocks":
                if stage is None:
                    per_layer = jnp.repeat(scale, g.shape[0] // num_stages)
                    return (g * per_layer.reshape((-1,) + (1,) * (g.ndim - 1))).astype(g.dtype)
                return (g * scale[stage]).astype(g.dtype)
            return (g * scale[0 if owner == "first" else num_stages - 1]).astype(g.dtype)

        return jax.tree_util.tree_map_with_path(clip, updates), state

    return optax.GradientTransformation(lambda params: ClipByStageNormState(), update_fn)
