"""Llama-style decoder-only transformer in Flax NNX, with stacked blocks applied by ``scan``.

Architecture: token embedding -> L pre-norm blocks (RMSNorm -> causal multi-head attention
with RoPE -> residual; RMSNorm -> SwiGLU MLP -> residual) -> final RMSNorm -> output head
(untied by default; ``tie_embeddings`` reuses the input table). Grouped-query attention when
``num_kv_heads`` < ``num_heads``. No biases. All L blocks live in one ``Block`` whose
parameters carry a leading axis of size L, so ``run_layers`` can apply any sequence of them
with one ``jax.lax.scan`` (compile time does not grow with L).

Dimension key:
  B: batch size
  T: sequence length
  D: hidden size (model width)
  N: number of attention (query) heads
  G: number of key/value heads (N when not grouped)
  H: head dimension, D // N
  F: SwiGLU MLP hidden size
  V: vocabulary size
  L: number of decoder blocks
  K: number of layer indices given to ``run_layers``
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from noloco_jax.models.presets import LlamaConfig
from noloco_jax.sharding import gather_whole, shard_batch, whole_lookups

__all__ = [
    "Llama",
    "Block",
    "apply_rope",
    "causal_attention",
    "init_params",
    "apply",
    "cross_entropy",
    "count_params",
]

INIT_STD = 0.02  # normal init of embeddings and all projection kernels


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], cfg: LlamaConfig) -> nnx.Param:
    init = jax.nn.initializers.normal(INIT_STD)
    return nnx.Param(init(rngs.params(), shape, jnp.dtype(cfg.param_dtype)))


def apply_rope(x_BxTxNxH: jax.Array, positions_T: jax.Array, theta: float) -> jax.Array:
    """Rotates query/key features by position (RoPE, HF-Llama "rotate half" layout).

    Feature pairs are (i, i + H/2) with frequency theta^(-2i/H). The rotation is computed in
    float32 and cast back to the input dtype.

    Args:
      x_BxTxNxH: queries or keys.
      positions_T: integer position of each token.
      theta: RoPE base frequency.

    Returns:
      The rotated array, same shape and dtype as ``x_BxTxNxH``.
    """
    h = x_BxTxNxH.shape[-1]
    inv_freq_Hh = theta ** (-jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    angles_TxHh = positions_T.astype(jnp.float32)[:, None] * inv_freq_Hh[None, :]
    angles_1xTx1xH = jnp.concatenate([angles_TxHh, angles_TxHh], axis=-1)[None, :, None, :]
    x = x_BxTxNxH.astype(jnp.float32)
    x1, x2 = jnp.split(x, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    out = x * jnp.cos(angles_1xTx1xH) + rotated * jnp.sin(angles_1xTx1xH)
    return out.astype(x_BxTxNxH.dtype)


def causal_attention(
    q_BxTxNxH: jax.Array, k_BxTxNxH: jax.Array, v_BxTxNxH: jax.Array
) -> jax.Array:
    """Causal softmax attention via ``jax.nn.dot_product_attention`` (softmax in float32).

    ``dot_product_attention`` with no ``implementation`` always uses the XLA kernel, which
    materialises [B, N, T, T] scores. On GPU with bf16 inputs we ask for cuDNN flash attention
    instead, and fall back to XLA when cuDNN rejects the shapes or is missing: when tracing
    it, or when XLA compiles it (cuDNN builds its graph only then, forward and backward, so
    ``_cudnn_compiles`` compiles it once per shape on its own first).

    Args:
      q_BxTxNxH: queries (RoPE applied).
      k_BxTxNxH: keys (RoPE applied).
      v_BxTxNxH: values.

    Returns:
      o_BxTxNxH, in the input dtype.
    """
    if q_BxTxNxH.dtype == jnp.bfloat16 and jax.default_backend() == "gpu":
        shapes = (q_BxTxNxH.shape, k_BxTxNxH.shape, v_BxTxNxH.shape)
        if _cudnn_compiles(shapes, jnp.dtype(q_BxTxNxH.dtype).name):
            return _cudnn_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH, is_causal=True)


def _cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


@functools.cache
def _cudnn_compiles(shapes: tuple[tuple[int, ...], ...], dtype: str) -> bool:
    """Whether cuDNN attention traces and compiles, with its gradient, for these shapes.

    A refusal at compile time (no cuDNN engine for the graph) would otherwise escape the
    fallback: it comes when the whole step compiles. A failure only the partitioned step
    has (a layout cuDNN's partitioner refuses) is not seen here.
    """
    def loss(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return _cudnn_attention(q, k, v).astype(jnp.float32).sum()

    args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
    try:
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    except (NotImplementedError, RuntimeError, ValueError):
        return False  # unsupported head dim, GPU or cuDNN version: use the XLA kernel
    return True


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis with a learned scale (init ones).

    Statistics are taken in float32; the output is in the compute dtype.
    """

    def __init__(self, cfg: LlamaConfig):
        self.eps = cfg.norm_eps
        self.dtype = jnp.dtype(cfg.dtype)
        self.scale = nnx.Param(jnp.ones((cfg.hidden_size,), jnp.dtype(cfg.param_dtype)))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x = x_BxTxD.astype(jnp.float32)
        mean_sq_BxTx1 = jnp.mean(x * x, axis=-1, keepdims=True)
        y_BxTxD = x * jax.lax.rsqrt(mean_sq_BxTx1 + self.eps)
        scale_1x1xD = self.scale[...].astype(jnp.float32).reshape(1, 1, -1)
        return (y_BxTxD * scale_1x1xD).astype(self.dtype)


class Attention(nnx.Module):
    """Causal self-attention with RoPE; projections stored as [D,N,H], [D,G,H] and [N,H,D].

    With G < N key/value heads (grouped-query attention) query head i reads key/value head
    i // (N / G), as Hugging Face's ``repeat_kv``.
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, n, g, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        self.dtype = jnp.dtype(cfg.dtype)
        self.wq = _param(rngs, (d, n, h), cfg)
        self.wk = _param(rngs, (d, g, h), cfg)
        self.wv = _param(rngs, (d, g, h), cfg)
        self.wo = _param(rngs, (n, h, d), cfg)

    def _project(self, x_BxTxD: jax.Array, w: nnx.Param) -> jax.Array:
        return jnp.einsum("btd,dnh->btnh", x_BxTxD, w[...].astype(self.dtype))

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        positions_T = jnp.arange(x_BxTxD.shape[1])
        q_BxTxNxH = apply_rope(self._project(x_BxTxD, self.wq), positions_T, self.theta)
        k_BxTxNxH = apply_rope(self._project(x_BxTxD, self.wk), positions_T, self.theta)
        v_BxTxNxH = self._project(x_BxTxD, self.wv)
        o_BxTxNxH = causal_attention(q_BxTxNxH, k_BxTxNxH, v_BxTxNxH)
        return jnp.einsum("btnh,nhd->btd", o_BxTxNxH, self.wo[...].astype(self.dtype))


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.mlp_hidden_size
        self.dtype = jnp.dtype(cfg.dtype)
        self.w_gate = _param(rngs, (d, f), cfg)
        self.w_up = _param(rngs, (d, f), cfg)
        self.w_down = _param(rngs, (f, d), cfg)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        gate_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, self.w_gate[...].astype(self.dtype))
        up_BxTxF = jnp.einsum("btd,df->btf", x_BxTxD, self.w_up[...].astype(self.dtype))
        hidden_BxTxF = jax.nn.silu(gate_BxTxF) * up_BxTxF
        return jnp.einsum("btf,fd->btd", hidden_BxTxF, self.w_down[...].astype(self.dtype))


class Block(nnx.Module):
    """One pre-norm decoder block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        x_BxTxD = x_BxTxD + self.attn(self.attn_norm(x_BxTxD))
        return x_BxTxD + self.mlp(self.mlp_norm(x_BxTxD))


def _stacked_blocks(cfg: LlamaConfig, rngs: nnx.Rngs) -> Block:
    """Creates L blocks as one Block whose parameters have a leading axis of size L."""

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(layer_rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=layer_rngs)

    return make(rngs)


class Llama(nnx.Module):
    """Llama-style decoder: embed -> run_layers -> head.

    Attributes:
      cfg: the model config.
      embedding: input token table, [V, D].
      blocks: all decoder blocks, every parameter stacked with a leading L axis.
      final_norm: RMSNorm before the output head.
      lm_head: untied output projection, [D, V] (absent with ``cfg.tie_embeddings``: the
        head is ``embedding.T``).
    """

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.dtype = jnp.dtype(cfg.dtype)
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg)
        self.blocks = _stacked_blocks(cfg, rngs)
        self.final_norm = RMSNorm(cfg)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, (cfg.hidden_size, cfg.vocab_size), cfg)

    def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
        """Maps token ids [B, T] to float32 next-token logits [B, T, V]."""
        return self.head(self.run_layers(self.embed(tokens_BxT)))

    def embed(self, tokens_BxT: jax.Array) -> jax.Array:
        """Looks up token embeddings.

        Args:
          tokens_BxT: integer token ids in [0, V). Ids >= V give NaN rows; negative ids
            wrap around as NumPy indices do (the data loaders refuse them).

        Returns:
          x_BxTxD in the compute dtype.
        """
        if tokens_BxT.ndim != 2:
            raise ValueError(f"tokens must be [B, T], got shape {tokens_BxT.shape}")
        if tokens_BxT.shape[1] > self.cfg.max_seq_len:
            raise ValueError(
                f"sequence length {tokens_BxT.shape[1]} exceeds max_seq_len "
                f"{self.cfg.max_seq_len}"
            )
        # Looked up in at least float32: the lookup's gradient is a scatter-add over every
        # occurrence of a token, which in bfloat16 rounds at each addition (a frequent
        # token's row lost most of its gradient).
        table_VxD = gather_whole(self.embedding[...])
        table_VxD = table_VxD.astype(jnp.promote_types(table_VxD.dtype, jnp.float32))
        x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0)
        return shard_batch(x_BxTxD.astype(self.dtype))

    def run_layers(self, x_BxTxD: jax.Array, layer_ids: jax.Array | None = None) -> jax.Array:
        """Applies decoder blocks in sequence with one ``jax.lax.scan``.

        Args:
          x_BxTxD: residual stream; cast to the compute dtype (the scan carry's dtype).
          layer_ids: None for all L blocks in order; otherwise a 1-D integer array [K] (may be
            traced; any order, repeats allowed, K may be 0) of block indices to apply in that
            order. Each step gathers that block's parameters from the stacked ones. Traced
            out-of-range indices are clamped by the gather; concrete ones raise ValueError.

        Returns:
          x_BxTxD after the selected blocks.
        """
        x_BxTxD = x_BxTxD.astype(self.dtype)
        graphdef, stacked = nnx.split(self.blocks)

        def apply_block(x_BxTxD: jax.Array, block_params: nnx.State) -> tuple[jax.Array, None]:
            return shard_batch(nnx.merge(graphdef, block_params)(x_BxTxD)), None

        if self.cfg.remat:  # keep only each block's input; recompute the rest backward
            apply_block = jax.checkpoint(apply_block)

        if layer_ids is None:
            x_BxTxD, _ = jax.lax.scan(apply_block, x_BxTxD, stacked)
            return x_BxTxD

        ids_K = self._check_layer_ids(layer_ids)

        def gather_and_apply(x_BxTxD: jax.Array, i: jax.Array) -> tuple[jax.Array, None]:
            block_params = jax.tree.map(
                lambda a: jax.lax.dynamic_index_in_dim(a, i, axis=0, keepdims=False), stacked
            )
            return apply_block(x_BxTxD, block_params)

        x_BxTxD, _ = jax.lax.scan(gather_and_apply, x_BxTxD, ids_K)
        return x_BxTxD

    def _check_layer_ids(self, layer_ids: Any) -> jax.Array:
        # Range-check concrete values with NumPy: a jnp op, even on a concrete array, is
        # staged inside a trace (scan, vmap, jit) and could not be inspected; tracers are
        # clamped by the gather instead.
        if not isinstance(layer_ids, jax.core.Tracer):
            host = np.asarray(layer_ids)
            if host.ndim != 1 or not np.issubdtype(host.dtype, np.integer):
                raise ValueError(f"layer_ids must be a 1-D int array, got {host.dtype}{host.shape}")
            if host.size and (host.min() < 0 or host.max() >= self.cfg.num_layers):
                raise ValueError(
                    f"layer_ids must lie in [0, {self.cfg.num_layers}), got range "
                    f"[{host.min()}, {host.max()}]"
                )
        ids_K = jnp.asarray(layer_ids)
        if ids_K.ndim != 1 or not jnp.issubdtype(ids_K.dtype, jnp.integer):
            raise ValueError(f"layer_ids must be a 1-D int array, got {ids_K.dtype}{ids_K.shape}")
        return ids_K.astype(jnp.int32)

    def head(self, x_BxTxD: jax.Array) -> jax.Array:
        """Final RMSNorm and output projection (``lm_head``, or ``embedding.T`` when tied).

        Args:
          x_BxTxD: residual stream after the blocks.

        Returns:
          logits_BxTxV in float32 (the matmul accumulates into float32).
        """
        h_BxTxD = self.final_norm(x_BxTxD)
        if self.cfg.tie_embeddings:
            w_DxV = self.embedding[...].T.astype(self.dtype)
        else:
            w_DxV = self.lm_head[...].astype(self.dtype)
        logits_BxTxV = jnp.einsum("btd,dv->btv", h_BxTxD, w_DxV, preferred_element_type=jnp.float32)
        return shard_batch(logits_BxTxV)


def _split_new_model(cfg: LlamaConfig, key: jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(Llama(cfg, rngs=nnx.Rngs(key)))


# One compiled program per config instead of hundreds of small eager ops.
_init_state = jax.jit(lambda cfg, key: _split_new_model(cfg, key)[1], static_argnums=0)


def init_params(cfg: LlamaConfig, seed: int | jax.Array) -> tuple[nnx.GraphDef, nnx.State]:
    """Initialises a Llama and splits it into its static graph and its parameter pytree.

    Same result as ``nnx.split(Llama(cfg, rngs=nnx.Rngs(seed)))`` up to float rounding (the
    initialisation runs as one jitted program).

    Args:
      cfg: the model config.
      seed: integer seed of the parameter RNG (equal seeds give equal parameters), or a typed
        PRNG key. It may be traced, so per-replica parameters can be drawn with
        ``jax.vmap(lambda s: init_params(cfg, s)[1])(seeds)``.

    Returns:
      (graphdef, params): params is an ``nnx.State`` pytree whose leaves are arrays.
    """
    is_key = isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key)
    key = seed if is_key else jax.random.key(seed)
    graphdef, _ = jax.eval_shape(functools.partial(_split_new_model, cfg), key)
    # Parameter values depend only on the shapes and param_dtype: share one compiled init
    # between configs that differ in compute dtype, sequence length, RoPE or norm settings.
    shape_cfg = dataclasses.replace(
        cfg, dtype="float32", max_seq_len=1, rope_theta=1.0, norm_eps=1.0
    )
    return graphdef, _init_state(shape_cfg, key)


def apply(graphdef: nnx.GraphDef, params: nnx.State, tokens_BxT: jax.Array) -> jax.Array:
    """Runs the model as a pure function of its parameters.

    Args:
      graphdef: static structure from ``init_params``.
      params: parameter pytree from ``init_params`` (or one of the same structure).
      tokens_BxT: integer token ids in [0, vocab_size).

    Returns:
      logits_BxTxV in float32.

    Raises:
      ValueError: a concrete ``tokens_BxT`` holds an id outside [0, vocab_size) (the lookup
        gave NaN logits past the table and wrapped -1 to its last row).
    """
    model = nnx.merge(graphdef, params)
    if not isinstance(tokens_BxT, jax.core.Tracer) and jnp.size(tokens_BxT) and \
            jnp.issubdtype(jnp.result_type(tokens_BxT), jnp.integer):
        with jax.ensure_compile_time_eval():  # concrete ids closed over in a jit: no tracers
            low, high = int(jnp.min(tokens_BxT)), int(jnp.max(tokens_BxT))
        vocab = model.cfg.vocab_size
        if not 0 <= low <= high < vocab:
            raise ValueError(f"tokens_BxT must be ids in [0, {vocab}) (the model's vocab_size), "
                             f"got ids from {low} to {high}.")  # fmt: skip
    return model(tokens_BxT)


def cross_entropy(logits_BxTxV: jax.Array, targets_BxT: jax.Array) -> jax.Array:
    """Per-token cross-entropy -log softmax(logits)[target], computed in float32.

    Args:
      logits_BxTxV: unnormalised next-token scores.
      targets_BxT: integer target ids in [0, V).

    Returns:
      loss_BxT in float32.
    """
    logp_BxTxV = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
    if whole_lookups():  # the compiler cannot split this gather here (sharding.whole_lookups)
        picked_BxTxV = logp_BxTxV * jax.nn.one_hot(targets_BxT, logp_BxTxV.shape[-1],
                                                   dtype=logp_BxTxV.dtype)  # fmt: skip
        return -jnp.sum(picked_BxTxV, axis=-1)  # the one nonzero term: the same value
    target_logp_BxTx1 = jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)
    return -target_logp_BxTx1[..., 0]


def count_params(params: Any) -> int:
    """Sums the sizes of all leaves of a pytree (arrays or ShapeDtypeStructs).

    Args:
      params: a parameter pytree, e.g. from ``init_params`` or ``jax.eval_shape`` of it.

    Returns:
      The total number of scalars (including any replica axis the leaves carry).
    """
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
