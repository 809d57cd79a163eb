"""Llama-style decoder models: config and presets, the Flax NNX model, functional helpers."""

from noloco_jax.models.llama import Llama, apply, count_params, cross_entropy, init_params
from noloco_jax.models.presets import (
    PRESETS,
    LlamaConfig,
    get_preset,
    param_count,
    preset_names,
)

__all__ = [
    "Llama",
    "LlamaConfig",
    "PRESETS",
    "preset_names",
    "get_preset",
    "param_count",
    "init_params",
    "apply",
    "cross_entropy",
    "count_params",
]
