"""Pipeline stages with random routing between replicas (the paper's DP x PP setting)."""

from noloco_jax.pipeline.routing import (
    identity_perms,
    permutation_pool,
    route_indices,
    route_perms,
    sequence_paths,
)
from noloco_jax.pipeline.simulated import route_boundary, routed_losses
from noloco_jax.pipeline.spmd import PipelineMesh, make_pipeline_mesh
from noloco_jax.pipeline.stages import clip_by_stage_norm, leaf_owner, stage_layer_ids

__all__ = [
    "PipelineMesh",
    "clip_by_stage_norm",
    "identity_perms",
    "leaf_owner",
    "make_pipeline_mesh",
    "permutation_pool",
    "route_boundary",
    "route_indices",
    "route_perms",
    "routed_losses",
    "sequence_paths",
    "stage_layer_ids",
]
