"""Optax transformations: NoLoCo and DiLoCo outer steps, local steps, data parallel, clipping."""

from noloco_jax.optim.clipping import clip_by_global_norm_fused
from noloco_jax.optim.diloco import DiLoCoOuterState, diloco_outer
from noloco_jax.optim.local_steps import (
    LocalStepsState,
    data_parallel,
    local_steps,
    restore_nonfinite,
)
from noloco_jax.optim.noloco import NoLoCoOuterState, noloco_outer

__all__ = [
    "clip_by_global_norm_fused",
    "DiLoCoOuterState",
    "LocalStepsState",
    "NoLoCoOuterState",
    "data_parallel",
    "diloco_outer",
    "local_steps",
    "noloco_outer",
    "restore_nonfinite",
]
