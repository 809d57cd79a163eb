"""Llama model configuration, named size presets and the analytic parameter count.

Dimension key:
  V: vocabulary size
  D: hidden size (model width)
  L: number of decoder blocks
  N: number of attention (query) heads
  K: number of key/value heads (K == N: plain MHA; K < N: grouped-query attention)
  H: head dimension, D // N
  F: SwiGLU MLP hidden size
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

__all__ = ["LlamaConfig", "PRESETS", "preset_names", "get_preset", "param_count"]

_DTYPES = ("float32", "bfloat16")
_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "mlp_hidden_size",
    "max_seq_len",
)


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-style decoder.

    Attributes:
      vocab_size: V, number of token ids.
      hidden_size: D, residual stream width.
      num_layers: L, number of decoder blocks.
      num_heads: N, attention (query) heads.
      mlp_hidden_size: F, SwiGLU hidden width.
      max_seq_len: longest sequence the model accepts.
      rope_theta: RoPE base frequency.
      norm_eps: RMSNorm epsilon.
      dtype: compute dtype of activations and matmuls ("float32" or "bfloat16").
      param_dtype: storage dtype of the parameters ("float32" or "bfloat16").
      num_kv_heads: K, key/value heads; 0 (default) = num_heads (plain multi-head attention),
        fewer = grouped-query attention (each K/V head serves N / K query heads).
      tie_embeddings: if True the output head is the transposed input embedding (one [V, D]
        table, as in many small Llama-family models); False (default) = separate ``lm_head``.
      remat: if True each decoder block's activations are recomputed in the backward pass
        instead of kept from the forward pass (``jax.checkpoint``): only the residual stream
        between blocks is stored, at the cost of one more forward pass. The same forward
        numbers; gradients equal to rounding (3e-8 in float32 on nano).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    mlp_hidden_size: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    dtype: str = "float32"
    param_dtype: str = "float32"
    num_kv_heads: int = 0
    tie_embeddings: bool = False
    remat: bool = False

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LlamaConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not (ok and 0 < value < math.inf):  # NaN and inf fail too
                raise ValueError(f"LlamaConfig.{name} must be a finite number > 0, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig.hidden_size / num_heads (head dim {self.head_dim}) must be even "
                "for RoPE"
            )
        kv = self.num_kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 0 or (
            kv and self.num_heads % kv
        ):
            raise ValueError(
                f"LlamaConfig.num_kv_heads must be 0 (= num_heads) or a divisor of num_heads "
                f"({self.num_heads}), got {kv!r}"
            )
        for name in ("tie_embeddings", "remat"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"LlamaConfig.{name} must be True or False, got {getattr(self, name)!r}"
                )
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if value not in _DTYPES:
                raise ValueError(f"LlamaConfig.{name} must be one of {_DTYPES}, got {value!r}")

    @property
    def head_dim(self) -> int:
        """H, the per-head width D // N."""
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        """K, the number of key/value heads (``num_kv_heads`` or, when 0, ``num_heads``)."""
        return self.num_kv_heads or self.num_heads


# Name -> LlamaConfig kwargs without vocab_size. Approximate totals at vocab 256 in the comments.
PRESETS: dict[str, dict[str, Any]] = {
    # CPU-sized models for tests and quick experiments.
    "nano": dict(hidden_size=64, num_layers=2, num_heads=4, mlp_hidden_size=256),  # 0.16M
    "tiny": dict(hidden_size=128, num_layers=4, num_heads=4, mlp_hidden_size=512),  # 1.1M
    "mini": dict(hidden_size=320, num_layers=6, num_heads=8, mlp_hidden_size=1280),  # 10.0M
    # NoLoCo paper sizes. The paper's table lists 16 heads for "small", but the reference
    # code trains it with 12 heads (head dim 64); we follow the code.
    "small": dict(hidden_size=768, num_layers=12, num_heads=12, mlp_hidden_size=3072),
    "medium": dict(hidden_size=2048, num_layers=24, num_heads=32, mlp_hidden_size=8192),
    "large": dict(hidden_size=4096, num_layers=32, num_heads=32, mlp_hidden_size=16384),
}


def preset_names() -> list[str]:
    """Returns the preset names, smallest first."""
    return list(PRESETS)


def get_preset(name: str, *, vocab_size: int, **overrides: Any) -> LlamaConfig:
    """Builds the config of a named preset.

    Args:
      name: one of ``preset_names()``.
      vocab_size: V, the model's vocabulary size: the tokenizer's, or larger (a padded
        table, e.g. to a multiple of 128).
      **overrides: any other LlamaConfig field, replacing the preset's value.

    Returns:
      The validated LlamaConfig.

    Raises:
      ValueError: unknown preset name or override field, or an invalid resulting config.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid presets: {preset_names()}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig field(s) {unknown}; valid fields: {sorted(fields)}")
    return LlamaConfig(**{**PRESETS[name], **overrides, "vocab_size": vocab_size})


def param_count(cfg: LlamaConfig, *, non_embedding: bool = False) -> int:
    """Counts the model's parameters from the config alone.

    Per block: q and o projections (2 D^2), k and v projections (2 D K H; 2 D^2 without
    grouped-query attention), SwiGLU gate, up, down (3 D F) and two RMSNorm scales (2 D);
    plus the final RMSNorm scale (D). Embeddings are the input table and, unless tied, the
    output head (2 V D untied, V D tied). No biases.

    Args:
      cfg: the model config.
      non_embedding: if True, leave out the input embedding and the output head.

    Returns:
      The number of scalar parameters.
    """
    if not isinstance(non_embedding, bool):  # "no" was truthy: embeddings left out
        raise ValueError(f"non_embedding must be True or False, got {non_embedding!r}.")
    d, f = cfg.hidden_size, cfg.mlp_hidden_size
    kv_width = cfg.kv_heads * cfg.head_dim
    per_block = 2 * d * d + 2 * d * kv_width + 3 * d * f + 2 * d
    body = cfg.num_layers * per_block + d
    if non_embedding:
        return body
    return body + (1 if cfg.tie_embeddings else 2) * cfg.vocab_size * d
