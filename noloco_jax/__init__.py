"""noloco_jax: NoLoCo, DiLoCo and data-parallel training as composable optax transformations."""

from noloco_jax.comm import groups_for_round
from noloco_jax.metrics import replica_spread
from noloco_jax.optim.clipping import clip_by_global_norm_fused
from noloco_jax.optim.diloco import DiLoCoOuterState, diloco_outer
from noloco_jax.optim.local_steps import (
    LocalStepsState,
    data_parallel,
    local_steps,
    restore_nonfinite,
)
from noloco_jax.optim.noloco import NoLoCoOuterState, noloco_outer

__version__ = "0.1.0"

__all__ = [
    "DiLoCoOuterState",
    "LocalStepsState",
    "NoLoCoOuterState",
    "clip_by_global_norm_fused",
    "data_parallel",
    "diloco_outer",
    "groups_for_round",
    "local_steps",
    "noloco_outer",
    "replica_spread",
    "restore_nonfinite",
]
