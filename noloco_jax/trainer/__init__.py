"""Trainer pieces: settings, optimizer assembly, pure steps, checkpoints, metric writers, loop.

The loop itself is ``noloco_jax.trainer.loop.train_and_evaluate`` (imported on
demand: it pulls in the data layer).
"""

from noloco_jax.trainer.settings import TrainSettings, from_config
from noloco_jax.trainer.step import TrainState, eval_window_losses, run_steps, train_step

__all__ = [
    "TrainSettings",
    "TrainState",
    "eval_window_losses",
    "from_config",
    "run_steps",
    "train_step",
]
