"""Pipeline stages with random routing between replicas (the paper's DP x PP setting)."""

from noloco_jax.pipeline.routing import (
    identity_perms,
    permutation_pool,
    route_indices,
    route_perms,
    sequence_paths,
)
from noloco_jax.pipeline.simulated import route_boundary, routed_losses
from noloco_jax.pipeline.routed import (make_pipeline_mesh, routed_loss, routed_loss_on_mesh,
                                        stage_leaf_axes)
from noloco_jax.pipeline.stages import clip_by_stage_norm, leaf_owner, stage_layer_ids

__all__ = [
    "clip_by_stage_norm",
    "identity_perms",
    "leaf_owner",
    "make_pipeline_mesh",
    "permutation_pool",
    "route_boundary",
    "route_indices",
    "route_perms",
    "routed_loss",
    "routed_loss_on_mesh",
    "routed_losses",
    "stage_leaf_axes",
    "sequence_paths",
    "stage_layer_ids",
]
