"""Hugging Face Llama checkpoints: import into the Flax ``Llama`` and export back.

A checkpoint directory holds ``config.json`` (a ``LlamaForCausalLM`` config) and one or more
``*.safetensors`` files: as transformers, ``model.safetensors``, else the shards
``model.safetensors.index.json`` lists, else every ``*.safetensors`` of the folder (a tensor
stored in two of them is an error). Both formats are plain JSON and raw little-endian arrays,
so this module reads and writes them with NumPy alone (bfloat16 through ``ml_dtypes``, which
JAX already needs): importing or exporting needs neither ``torch`` nor ``transformers``.
Tensors are memory-mapped, so a checkpoint is read once, tensor by tensor.

Layout mapping (HF Linear weights are [out, in]; ours are [in, ...] with heads split out):

  model.embed_tokens.weight [V, D]                 -> embedding [V, D]
  layers.i.self_attn.q_proj.weight [N H, D]        -> blocks.attn.wq[i] [D, N, H]
  layers.i.self_attn.k_proj / v_proj [G H, D]      -> blocks.attn.wk[i] / wv[i] [D, G, H]
  layers.i.self_attn.o_proj.weight [D, N H]        -> blocks.attn.wo[i] [N, H, D]
  layers.i.mlp.gate_proj / up_proj [F, D]          -> blocks.mlp.w_gate[i] / w_up[i] [D, F]
  layers.i.mlp.down_proj.weight [D, F]             -> blocks.mlp.w_down[i] [F, D]
  layers.i.input_layernorm / post_attention_layernorm [D] -> blocks.attn_norm / mlp_norm
  model.norm.weight [D]                            -> final_norm.scale
  lm_head.weight [V, D]                            -> lm_head [D, V] (absent when tied)

HF's RoPE uses the same "rotate half" pairing as ``apply_rope``, so q/k need no permutation.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from noloco_jax.models.llama import Llama
from noloco_jax.models.presets import LlamaConfig
from noloco_jax.sharding import path_names

__all__ = [
    "config_from_hf",
    "config_to_hf",
    "read_config",
    "load_llama",
    "save_llama",
    "read_safetensors",
    "write_safetensors",
]

_ST_DTYPES = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"), "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"), "I8": np.dtype("i1"), "U8": np.dtype("u1"), "BOOL": np.dtype("?"),
}  # fmt: skip
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
# Tensors some checkpoints carry that hold no parameters (recomputed from the config).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# config.json fields without a default here (transformers' defaults are Llama-7B's sizes).
_HF_SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size")  # fmt: skip


# ------------------------------------------------------------------ safetensors


def read_safetensors(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Memory-maps every tensor of one ``.safetensors`` file.

    Args:
      path: the file.

    Returns:
      ``{name: read-only array}``; the arrays are views of the mapped file.

    Raises:
      ValueError: the file is not a valid safetensors file or uses an unknown dtype.
    """
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n <= 0 or 8 + n > size:
            raise ValueError(f"{path} is not a safetensors file (bad header length).")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not a safetensors file (header: {err}).") from err
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file (header is not a JSON object).")
    header.pop("__metadata__", None)
    if not header:
        return {}
    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        try:
            kind, shape = info["dtype"], [int(d) for d in info["shape"]]
            begin, end = (8 + n + int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}: header entry {name!r} is not a tensor's dtype, shape and "
                             f"data_offsets ({err!r}).") from None  # fmt: skip
        if not isinstance(kind, str) or kind not in _ST_DTYPES:  # a list is unhashable
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {kind}.")
        dtype = _ST_DTYPES[kind]
        fits = min(shape, default=0) >= 0 and 8 + n <= begin and end <= size
        if not fits or end - begin != math.prod(shape) * np.dtype(dtype).itemsize:
            raise ValueError(f"{path}: tensor {name!r} ({kind} {shape}) does not fit its bytes "
                             f"{begin}..{end} of a {size}-byte file (a truncated or damaged "
                             f"file?).")  # fmt: skip
        out[name] = mapped[begin:end].view(dtype).reshape(shape)
    return out


def write_safetensors(path: str | pathlib.Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes ``{name: array}`` as one ``.safetensors`` file (metadata ``format=pt``).

    Args:
      path: the file to write (replaced atomically).
      tensors: C-contiguous arrays of a dtype safetensors knows.
    """
    path = pathlib.Path(path)
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    arrays = {}
    for name, value in tensors.items():
        arr = np.ascontiguousarray(value)
        dtype = arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype
        if dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved as safetensors.")
        arrays[name] = arr.astype(dtype, copy=False)
        header[name] = {"dtype": _ST_NAMES[dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}  # fmt: skip
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for arr in arrays.values():
            f.write(arr.tobytes())
    tmp.replace(path)


def _checkpoint_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"no *.safetensors file in the Hugging Face checkpoint directory {str(directory)!r} "
            f"(PyTorch .bin checkpoints are not supported: re-save the model with "
            f"save_pretrained(..., safe_serialization=True))."
        )
    index = directory / "model.safetensors.index.json"
    if (directory / "model.safetensors").is_file():  # transformers reads it before an index
        files = [directory / "model.safetensors"]
    elif index.is_file():  # the shards it lists (a stale file beside them is not read)
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, AttributeError) as err:
            raise ValueError(f"{index} is not a safetensors index ({err!r}).") from None
        files = [directory / name for name in listed]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shards that are not there: {missing}.")
    out: dict[str, np.ndarray] = {}
    for f in files:
        tensors = read_safetensors(f)
        twice = sorted(set(tensors) & set(out))
        if twice:
            raise ValueError(f"tensors stored in more than one file of {str(directory)!r}, e.g. "
                             f"{twice[0]!r} again in {f.name}; remove the stale file.")
        out.update(tensors)
    return out


# ------------------------------------------------------------------ config


def _read_config(directory: str | pathlib.Path) -> tuple[pathlib.Path, dict]:
    directory = pathlib.Path(directory).expanduser()
    if not directory.is_dir():
        what = "is a file, not a directory" if directory.exists() else "does not exist"
        raise FileNotFoundError(
            f"Hugging Face checkpoint directory {str(directory)!r} {what} (it must hold "
            f"config.json and *.safetensors, e.g. what save_pretrained wrote)."
        )
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{str(directory)!r} holds no config.json; it is not a Hugging "
                                f"Face model directory.")  # fmt: skip
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}, not an object; a Hugging "
                         f"Face config.json is one object of settings.")  # fmt: skip
    return directory, d


def _rope_theta(d: dict) -> float:
    params = d.get("rope_parameters") or {}
    scaling = d.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"config.json sets {key}={value!r}; it must be an object "
                             f"(e.g. {{\"rope_type\": \"default\"}}) or null.")
    # Both keys are read (transformers merges them): a default type in one must not hide a
    # scaling in the other.
    kinds = {params.get("rope_type"), scaling.get("rope_type", scaling.get("type"))} - {None}
    scaled = sorted(kinds - {"default"})
    if scaled:
        raise ValueError(
            f"config.json uses RoPE scaling {scaled[0]!r}; only the default (unscaled) RoPE of the "
            f"original Llama is supported."
        )
    # Passed on as written: LlamaConfig refuses 0 (transformers divides by 0**x), strings and
    # bools, which float() would have turned into numbers or errors naming no field.
    # transformers 5 also reads one in rope_scaling, which then replaces rope_parameters whole
    # (transformers 4 reads only the top one): a rope_parameters beside it is read by neither.
    places = (("at the top", d), ("in rope_parameters", {} if scaling else params),
              ("in rope_scaling", scaling))  # fmt: skip
    thetas = [(where, x["rope_theta"]) for where, x in places if x.get("rope_theta") is not None]
    if any(t != thetas[0][1] for _, t in thetas):
        given = " and ".join(f"{t} {where}" for where, t in thetas)
        raise ValueError(f"config.json gives two rope_theta values, {given}; make them "
                         f"agree.")  # fmt: skip
    return thetas[0][1] if thetas else 10000.0


def config_from_hf(
    d: dict, *, dtype: str = "float32", param_dtype: str = "float32", max_seq_len: int = 0
) -> LlamaConfig:
    """The ``LlamaConfig`` of a Hugging Face ``LlamaConfig`` dict (``config.json``).

    Args:
      d: the parsed config.json.
      dtype: our compute dtype.
      param_dtype: our parameter dtype.
      max_seq_len: 0 = the checkpoint's ``max_position_embeddings``.

    Returns:
      The config.

    Raises:
      ValueError: not a Llama config, or a Llama variant we do not implement (biases, another
        activation, scaled RoPE, a head dim other than hidden_size / num_attention_heads).
    """
    model_type = d.get("model_type")
    archs = d.get("architectures") or []
    # model_type decides what transformers builds; architectures only when it is missing.
    if model_type not in ("llama", None) or (model_type is None and "LlamaForCausalLM"
                                             not in archs):  # fmt: skip
        raise ValueError(
            f"config.json describes a {model_type!r} model (architectures {archs}); only Llama "
            f"checkpoints (model_type 'llama', LlamaForCausalLM) can be imported."
        )
    for flag in ("attention_bias", "mlp_bias"):
        if d.get(flag):
            raise ValueError(f"config.json sets {flag}=true; the Llama here has no biases.")
    if d.get("hidden_act", "silu") not in ("silu", "swish"):  # one function in transformers
        raise ValueError(f"config.json sets hidden_act={d['hidden_act']!r}; only 'silu' "
                         f"(SwiGLU; 'swish' is the same) is supported.")  # fmt: skip
    missing = [k for k in _HF_SIZES if k not in d]
    if missing:
        raise ValueError(f"config.json has no {missing}; a Llama config.json sets all of "
                         f"{list(_HF_SIZES)}.")  # fmt: skip
    tie = d.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):  # bool("false") is True: a silently tied head
        raise ValueError(f"config.json's tie_word_embeddings must be true or false, got "
                         f"{tie!r}.")  # fmt: skip
    heads = d["num_attention_heads"]
    kv = d.get("num_key_value_heads") or heads
    cfg = LlamaConfig(
        vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads, mlp_hidden_size=d["intermediate_size"],
        max_seq_len=max_seq_len or d.get("max_position_embeddings", 2048),
        rope_theta=_rope_theta(d), norm_eps=d.get("rms_norm_eps", 1e-6), dtype=dtype,
        param_dtype=param_dtype, num_kv_heads=0 if kv == heads else kv,
        tie_embeddings=tie,
    )  # fmt: skip
    if d.get("head_dim") not in (None, cfg.head_dim):  # checked once the heads are valid
        raise ValueError(
            f"config.json sets head_dim={d['head_dim']}, but the Llama here needs "
            f"hidden_size / num_attention_heads = {cfg.head_dim}."
        )
    return cfg


def read_config(directory: str | pathlib.Path, **kwargs: Any) -> LlamaConfig:
    """The ``LlamaConfig`` of a checkpoint directory's config.json (no weights read).

    Args:
      directory: the Hugging Face checkpoint directory.
      **kwargs: ``dtype``, ``param_dtype``, ``max_seq_len`` as for ``config_from_hf``.

    Returns:
      The config.
    """
    return config_from_hf(_read_config(directory)[1], **kwargs)


def config_to_hf(cfg: LlamaConfig, *, torch_dtype: str = "float32") -> dict:
    """The Hugging Face ``config.json`` dict of ``cfg`` (a ``LlamaForCausalLM``)."""
    rope = {"rope_type": "default", "rope_theta": float(cfg.rope_theta)}
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.mlp_hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": float(cfg.norm_eps), "rope_theta": float(cfg.rope_theta),
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_embeddings,
        "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "initializer_range": 0.02, "torch_dtype": torch_dtype,
        "dtype": torch_dtype,
    }  # fmt: skip


# ------------------------------------------------------------------ weights


def _layer_maps(cfg: LlamaConfig) -> dict[str, tuple[str, Callable, Callable]]:
    """ours -> (HF name template, HF->ours, ours->HF) for one block's [out, in] weights."""
    d, n, g, h = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    p = "model.layers.{}."
    return {
        "blocks.attn.wq": (p + "self_attn.q_proj.weight", lambda w: w.T.reshape(d, n, h),
                           lambda w: w.reshape(d, n * h).T),
        "blocks.attn.wk": (p + "self_attn.k_proj.weight", lambda w: w.T.reshape(d, g, h),
                           lambda w: w.reshape(d, g * h).T),
        "blocks.attn.wv": (p + "self_attn.v_proj.weight", lambda w: w.T.reshape(d, g, h),
                           lambda w: w.reshape(d, g * h).T),
        "blocks.attn.wo": (p + "self_attn.o_proj.weight", lambda w: w.T.reshape(n, h, d),
                           lambda w: w.reshape(n * h, d).T),
        "blocks.mlp.w_gate": (p + "mlp.gate_proj.weight", np.transpose, np.transpose),
        "blocks.mlp.w_up": (p + "mlp.up_proj.weight", np.transpose, np.transpose),
        "blocks.mlp.w_down": (p + "mlp.down_proj.weight", np.transpose, np.transpose),
        "blocks.attn_norm.scale": (p + "input_layernorm.weight", np.asarray, np.asarray),
        "blocks.mlp_norm.scale": (p + "post_attention_layernorm.weight", np.asarray, np.asarray),
    }  # fmt: skip


def _top_maps(cfg: LlamaConfig) -> dict[str, tuple[str, Callable, Callable]]:
    out = {
        "embedding": ("model.embed_tokens.weight", np.asarray, np.asarray),
        "final_norm.scale": ("model.norm.weight", np.asarray, np.asarray),
    }
    if not cfg.tie_embeddings:
        out["lm_head"] = ("lm_head.weight", np.transpose, np.transpose)
    return out


def _name(path: tuple) -> str:
    return ".".join(k for k in path_names(path) if k != "value")


def _abstract_model(cfg: LlamaConfig) -> tuple[nnx.GraphDef, nnx.State]:
    return nnx.split(nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0))))


def load_llama(
    directory: str | pathlib.Path,
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    max_seq_len: int = 0,
    host: bool = False,
) -> tuple[LlamaConfig, nnx.GraphDef, nnx.State]:
    """Imports a Hugging Face Llama checkpoint directory.

    Args:
      directory: holds ``config.json`` and ``*.safetensors`` (``save_pretrained`` output).
      dtype: compute dtype of the returned config.
      param_dtype: the parameters are cast to this dtype.
      max_seq_len: 0 = the checkpoint's ``max_position_embeddings``.
      host: leave the parameters as NumPy arrays in host memory (the trainer then sends each
        device only its part); else they are JAX arrays on the default device.

    Returns:
      (cfg, graphdef, params), as ``init_params`` returns them (``models.apply`` runs it).

    Raises:
      FileNotFoundError: a missing directory, config.json or safetensors file.
      ValueError: a non-Llama config, or tensors missing or of the wrong shape.
    """
    directory, d = _read_config(directory)
    cfg = config_from_hf(d, dtype=dtype, param_dtype=param_dtype, max_seq_len=max_seq_len)
    tensors = _checkpoint_tensors(directory)
    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"the checkpoint in {str(directory)!r} has no tensor {name!r}.")
        used.add(name)
        return tensors[name]

    graphdef, abstract = _abstract_model(cfg)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    shapes = {_name(p): tuple(x.shape) for p, x in flat}  # ours, e.g. blocks.mlp.w_up: [L, D, F]

    def convert(name: str, to: Callable, shape: tuple[int, ...]) -> np.ndarray:
        value = get(name)
        try:  # a reshape to config.json's heads and head_dim may fail
            out = to(value)
        except ValueError:
            out = None
        if out is None or tuple(out.shape) != shape:  # checked per layer, before np.stack
            raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, which does not fit "
                             f"config.json's vocab_size, hidden_size, intermediate_size, heads "
                             f"and head_dim.")  # fmt: skip
        return out

    ours = {k: convert(hf, to, shapes[k]) for k, (hf, to, _) in _top_maps(cfg).items()}
    for k, (hf, to, _) in _layer_maps(cfg).items():
        ours[k] = np.stack([convert(hf.format(i), to, shapes[k][1:])
                            for i in range(cfg.num_layers)])  # fmt: skip
    if cfg.tie_embeddings and "lm_head.weight" in tensors:  # some tied checkpoints store it too
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ValueError(
                "config.json ties the output head to the embedding (tie_word_embeddings), but "
                "the checkpoint's lm_head.weight differs from model.embed_tokens.weight; set "
                "tie_word_embeddings to false to load the stored head.")
        used.add("lm_head.weight")
    extra = sorted(k for k in set(tensors) - used if not k.endswith(_IGNORED_SUFFIXES))
    if extra:
        raise ValueError(f"the checkpoint holds tensors the Llama here has no place for: "
                         f"{extra[:5]}{' ...' if len(extra) > 5 else ''}.")  # fmt: skip
    pdtype = jnp.dtype(param_dtype)

    def fill(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
        value = ours[_name(path)]  # shape checked by convert
        value = np.asarray(value, np.float32) if value.dtype != pdtype else value
        return np.asarray(value, pdtype) if host else jnp.asarray(value, pdtype)

    return cfg, graphdef, jax.tree_util.tree_map_with_path(fill, abstract)


def save_llama(
    directory: str | pathlib.Path, cfg: LlamaConfig, params: Any, *, dtype: str = "float32",
    eos_token_id: int | None = None, bos_token_id: int | None = None,
) -> pathlib.Path:
    """Exports one replica's parameters as a Hugging Face ``LlamaForCausalLM`` directory.

    Args:
      directory: created if needed; gets ``config.json`` and ``model.safetensors``.
      cfg: the model config.
      params: single-replica parameters (``init_params`` layout, no replica axis).
      dtype: "float32" or "bfloat16", the dtype of the saved tensors.
      eos_token_id: the tokenizer's end-of-text id; given, ``config.json`` names it and
        ``bos_token_id`` (None: the tokenizer puts none first). Left out, transformers
        assumes Llama's 1 and 2, which generation then stops at.
      bos_token_id: the tokenizer's first-token id, if any (with ``eos_token_id``).

    Returns:
      The directory (``LlamaForCausalLM.from_pretrained(directory)`` loads it).
    """
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}.")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ours = {_name(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    _, abstract = _abstract_model(cfg)
    flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
    expected = {_name(p): tuple(x.shape) for p, x in flat}
    got = {k: tuple(v.shape) for k, v in ours.items()}
    if got != expected:
        raise ValueError(f"params do not match the config's single-replica layout (a replica "
                         f"axis left in?): {got} vs {expected}.")  # fmt: skip
    out_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    tensors = {}
    for k, (hf, _, back) in _top_maps(cfg).items():
        tensors[hf] = back(ours[k])
    for k, (hf, _, back) in _layer_maps(cfg).items():
        for i in range(cfg.num_layers):
            tensors[hf.format(i)] = back(ours[k][i])
    tensors = {k: np.ascontiguousarray(v.astype(out_dtype)) for k, v in tensors.items()}
    write_safetensors(directory / "model.safetensors", tensors)
    config = config_to_hf(cfg, torch_dtype=dtype)
    if eos_token_id is not None:
        config.update(bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory

