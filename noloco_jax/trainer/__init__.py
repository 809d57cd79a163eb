"""Trainer pieces: settings, optimizer assembly, pure steps, checkpoints, metric writers, loop."""

from noloco_jax.trainer.loop import train_and_evaluate  # noqa: F401  (needs models, data)
from noloco_jax.trainer.settings import TrainSettings, from_config
from noloco_jax.trainer.step import TrainState, eval_window_losses, train_chunk, train_step

__all__ = [
    "TrainSettings",
    "TrainState",
    "eval_window_losses",
    "from_config",
    "train_and_evaluate",
    "train_chunk",
    "train_step",
]
