"""Hugging Face Llama interop: import/export against transformers' own LlamaForCausalLM.

Needs the optional ``[hf]`` extra (transformers, torch CPU, tokenizers); skipped without it.
Nothing is downloaded: the HF models are built from a config with random weights.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from noloco_jax import models
from noloco_jax.models import hf

# Float32 logits of the same weights in two frameworks: measured max |diff| 1.8e-7 at these
# sizes (|logits| < 1); 1e-5 absolute leaves room for summation order only.
ATOL = 1e-5
TOKENS = np.array([[1, 5, 9, 3, 60, 2, 7, 11, 0, 63, 4, 4]], np.int32)


def _hf_model(tie: bool, kv_heads: int):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=32,
        rms_norm_eps=1e-5, rope_theta=500.0, tie_word_embeddings=tie,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # HF inits norms to ones; random scales test their mapping too
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    import torch  # noqa: PLC0415

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


@pytest.mark.parametrize("tie,kv_heads", [(False, 2), (True, 4), (True, 1)])
def test_import_matches_transformers_logits(tmp_path, tie, kv_heads):
    model = _hf_model(tie, kv_heads)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg, graphdef, params = hf.load_llama(tmp_path)
    assert (cfg.kv_heads, cfg.tie_embeddings, cfg.rope_theta, cfg.norm_eps) == (
        kv_heads, tie, 500.0, 1e-5)  # fmt: skip
    assert models.count_params(params) == models.param_count(cfg) == model.num_parameters()
    ours = np.asarray(models.apply(graphdef, params, TOKENS))
    np.testing.assert_allclose(ours, _hf_logits(model, TOKENS), atol=ATOL, rtol=0)


@pytest.mark.parametrize("tie,kv_heads", [(False, 2), (True, 0)])
def test_export_loads_in_transformers_with_same_logits(tmp_path, tie, kv_heads):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    cfg = models.LlamaConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                             mlp_hidden_size=48, max_seq_len=32, num_kv_heads=kv_heads,
                             tie_embeddings=tie)  # fmt: skip
    graphdef, params = models.init_params(cfg, 3)
    hf.save_llama(tmp_path, cfg, params)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).float().eval()
    ours = np.asarray(models.apply(graphdef, params, TOKENS))
    np.testing.assert_allclose(_hf_logits(loaded, TOKENS), ours, atol=ATOL, rtol=0)
    # And back: the round trip is exact.
    cfg2, _, params2 = hf.load_llama(tmp_path, max_seq_len=32)
    assert cfg2 == cfg
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(params2)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_default_presets_keep_their_shapes_and_numbers():
    """num_kv_heads=0 and untied stay the defaults: the nano preset's params are unchanged."""
    cfg = models.get_preset("nano", vocab_size=32)
    assert (cfg.kv_heads, cfg.tie_embeddings) == (cfg.num_heads, False)
    _, params = models.init_params(cfg, 0)
    assert "lm_head" in params and params["blocks"]["attn"]["wk"][...].shape == (2, 64, 4, 16)
    gqa = models.get_preset("nano", vocab_size=32, num_kv_heads=2, tie_embeddings=True)
    _, gparams = models.init_params(gqa, 0)
    assert "lm_head" not in gparams
    assert models.count_params(gparams) == models.param_count(gqa) < models.param_count(cfg)


def test_safetensors_round_trip_bfloat16(tmp_path):
    import ml_dtypes  # noqa: PLC0415

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3),
               "b": np.ones((4,), ml_dtypes.bfloat16), "c": np.zeros((0,), np.int64)}  # fmt: skip
    hf.write_safetensors(tmp_path / "x.safetensors", tensors)
    back = hf.read_safetensors(tmp_path / "x.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)


def test_bad_checkpoint_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load_llama(tmp_path / "missing")
    (tmp_path / "model.safetensors").write_bytes(b"")  # a file was said not to exist
    with pytest.raises(FileNotFoundError, match="model.safetensors' is a file, not a directory"):
        hf.load_llama(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        hf.load_llama(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))  # fmt: skip
    with pytest.raises(ValueError, match="'gpt2' model.*only Llama"):
        hf.load_llama(tmp_path)
    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf.config_to_hf(cfg)))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        hf.load_llama(tmp_path)
    bad = {**hf.config_to_hf(cfg), "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        hf.config_from_hf(bad)
    with pytest.raises(ValueError, match="num_kv_heads"):
        models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                           mlp_hidden_size=8, num_kv_heads=3)  # fmt: skip


def _saved(tmp_path, **cfg_over):
    """A tiny random Llama saved in HF format (no transformers needed), and its config."""
    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8, **cfg_over)  # fmt: skip
    _, params = models.init_params(cfg, 0)
    return hf.save_llama(tmp_path / "hf", cfg, params), cfg


def _edit_config(directory, **changes):
    d = json.loads((directory / "config.json").read_text())
    d.update(changes)
    (directory / "config.json").write_text(json.dumps(d))


def test_configs_transformers_reads_otherwise_are_refused(tmp_path):
    """Each was accepted, and its logits differed from transformers' (review: up to 0.76)."""
    directory, _ = _saved(tmp_path)
    # model_type decides what transformers builds, whatever architectures says
    _edit_config(directory, model_type="mistral", sliding_window=8)
    with pytest.raises(ValueError, match="'mistral' model"):
        hf.load_llama(directory)
    # a default rope_parameters must not hide an old-style scaled rope_scaling
    _edit_config(directory, model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0})
    with pytest.raises(ValueError, match="RoPE scaling 'llama3'"):
        hf.load_llama(directory)
    # two rope_theta values: transformers 5 reads rope_parameters', we read the top one
    _edit_config(directory, rope_scaling=None, rope_theta=5e5)
    with pytest.raises(ValueError, match="two rope_theta values"):
        hf.load_llama(directory)
    # rope_theta 0 (transformers: 1 / 0**x) was replaced by the default 10000 silently
    _edit_config(directory, rope_theta=0, rope_parameters=None)
    with pytest.raises(ValueError, match="rope_theta must be a finite number > 0, got 0"):
        hf.load_llama(directory)


def test_swish_is_silu():
    """transformers' ACT2FN maps 'swish' to SiLU: such a Llama was refused."""
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    assert hf.config_from_hf({**d, "hidden_act": "swish"}) == hf.config_from_hf(d)
    with pytest.raises(ValueError, match="hidden_act='gelu'; only 'silu'"):
        hf.config_from_hf({**d, "hidden_act": "gelu"})


@pytest.mark.parametrize("change, says", [
    (dict(num_attention_heads=0), "num_heads must be an int >= 1"),  # was ZeroDivisionError
    (dict(intermediate_size=None), r"no \['intermediate_size'\]"),  # was KeyError
    (dict(vocab_size=None, hidden_size=None), r"no \['vocab_size', 'hidden_size'\]"),
])  # fmt: skip
def test_a_config_without_sizes_or_heads_is_a_value_error(change, says):
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    d = {k: v for k, v in {**d, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=says):
        hf.config_from_hf(d)


@pytest.mark.parametrize("key, value", [
    ("rms_norm_eps", None),  # was TypeError from float()
    ("rms_norm_eps", "abc"),  # was float()'s ValueError, naming no field
    ("rms_norm_eps", True),  # was taken as 1.0
    ("rope_theta", "abc"),
    ("rope_theta", True),
])  # fmt: skip
def test_a_non_numeric_eps_or_rope_theta_is_a_value_error_naming_it(key, value):
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    field = {"rms_norm_eps": "norm_eps", "rope_theta": "rope_theta"}[key]
    with pytest.raises(ValueError, match=f"{field} must be a finite number > 0, got {value!r}"):
        hf.config_from_hf({**d, key: value, "rope_parameters": None})


@pytest.mark.parametrize("value", ["false", 0, None])
def test_tie_word_embeddings_must_be_a_json_bool(value):
    """bool() read the string "false" as True: the head was silently tied to the embedding."""
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    with pytest.raises(ValueError, match=f"tie_word_embeddings must be true or false, got "
                                         f"{value!r}"):  # fmt: skip
        hf.config_from_hf({**d, "tie_word_embeddings": value})
    assert hf.config_from_hf({**d, "tie_word_embeddings": False}).tie_embeddings is False


def test_a_config_json_that_is_not_an_object_is_a_value_error(tmp_path):
    """A JSON list, or a rope_scaling / rope_parameters that is a string, was AttributeError."""
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="holds a JSON list, not an object"):
        hf.read_config(tmp_path)
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    for key in ("rope_scaling", "rope_parameters"):
        with pytest.raises(ValueError, match=f"{key}='linear'; it must be an object"):
            hf.config_from_hf({**d, key: "linear"})


def test_a_tied_config_with_a_different_stored_head_is_refused(tmp_path):
    directory, cfg = _saved(tmp_path, tie_embeddings=True)
    tensors = dict(hf.read_safetensors(directory / "model.safetensors"))
    tensors["lm_head.weight"] = np.array(tensors["model.embed_tokens.weight"]) + 1.0
    hf.write_safetensors(directory / "model.safetensors", tensors)
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens"):
        hf.load_llama(directory)  # it dropped the stored head silently
    tensors["lm_head.weight"] = np.array(tensors["model.embed_tokens.weight"])
    hf.write_safetensors(directory / "model.safetensors", tensors)
    assert hf.load_llama(directory)[0].tie_embeddings  # an equal copy is fine


def test_damaged_files_and_sizes_name_the_tensor(tmp_path):
    directory, _ = _saved(tmp_path)
    path = directory / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:-40])  # truncated
    with pytest.raises(ValueError, match="tensor .* does not fit its bytes .* truncated"):
        hf.load_llama(directory)
    path.write_bytes(data)
    _edit_config(directory, hidden_size=12, head_dim=6)
    with pytest.raises(ValueError, match="has shape .* which does not fit config.json"):
        hf.load_llama(directory)  # was numpy's "cannot reshape array of size ..."


@pytest.mark.parametrize("name", ["model.layers.1.mlp.gate_proj.weight",
                                  "model.layers.1.input_layernorm.weight"])
def test_a_layer_tensor_of_the_wrong_shape_is_named(tmp_path, name):
    """Was numpy's "all input arrays must have the same shape" from stacking the layers."""
    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=2, num_heads=2,
                             mlp_hidden_size=8)  # fmt: skip
    directory = hf.save_llama(tmp_path / "hf", cfg, models.init_params(cfg, 0)[1])
    tensors = dict(hf.read_safetensors(directory / "model.safetensors"))
    tensors[name] = np.zeros((9, *tensors[name].shape[1:]), np.float32)
    hf.write_safetensors(directory / "model.safetensors", tensors)
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape .* does not fit config.json"):
        hf.load_llama(directory)


@pytest.mark.parametrize("header, says", [
    ([1, 2], "header is not a JSON object"),  # was TypeError
    ({"w": {"shape": [2], "data_offsets": [0, 8]}}, "entry 'w' is not a tensor's dtype"),
    ({"w": 5}, "entry 'w' is not a tensor's dtype"),  # was TypeError
    ({"w": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}},
     "unsupported dtype"),  # a list is unhashable: was TypeError
    ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}}, "does not fit its bytes"),
])  # fmt: skip
def test_a_malformed_safetensors_header_is_a_value_error(tmp_path, header, says):
    """The last header was read: its tensor held 8 bytes of the JSON header as weights."""
    blob = json.dumps(header).encode()
    (tmp_path / "x.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bytes(8))
    with pytest.raises(ValueError, match=says):
        hf.read_safetensors(tmp_path / "x.safetensors")


def test_shards_follow_the_index_and_a_tensor_stored_twice_is_refused(tmp_path):
    directory, _ = _saved(tmp_path)
    tensors = dict(hf.read_safetensors(directory / "model.safetensors"))
    names = sorted(tensors)
    half = {n: np.array(tensors[n]) for n in names[: len(names) // 2]}
    rest = {n: np.array(tensors[n]) for n in names[len(names) // 2 :]}
    hf.write_safetensors(directory / "model-00001-of-00002.safetensors", half)
    hf.write_safetensors(directory / "model-00002-of-00002.safetensors", rest)
    assert sorted(hf._checkpoint_tensors(directory)) == names  # model.safetensors alone
    (directory / "model.safetensors").rename(directory / "stale.safetensors")
    with pytest.raises(ValueError, match="more than one file"):  # no index: every file
        hf._checkpoint_tensors(directory)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        **{n: "model-00001-of-00002.safetensors" for n in half},
        **{n: "model-00002-of-00002.safetensors" for n in rest}}}))  # fmt: skip
    assert sorted(hf._checkpoint_tensors(directory)) == names  # the index wins


def test_model_safetensors_is_read_before_an_index_as_transformers_does(tmp_path):
    """save_llama over a sharded checkpoint left its index: load_llama read the old shards
    while transformers (model.safetensors first) read the new weights."""
    directory, cfg = _saved(tmp_path)
    old = {k: np.array(v) + 1.0 for k, v in hf.read_safetensors(directory / "model.safetensors")
           .items()}  # fmt: skip
    hf.write_safetensors(directory / "model-00001-of-00001.safetensors", old)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        n: "model-00001-of-00001.safetensors" for n in old}}))  # fmt: skip
    new = hf.read_safetensors(directory / "model.safetensors")
    loaded = hf.load_llama(directory)[2]
    np.testing.assert_array_equal(loaded["embedding"][...], new["model.embed_tokens.weight"])


def test_a_rope_theta_in_rope_scaling_is_read_or_refused_when_it_disagrees():
    """transformers 5 reads rope_scaling's rope_theta (500 here); it was ignored and the model
    ran at 10000 (logits off from transformers'), also beside another value at the top."""
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    d = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_parameters")}
    scaling = {"rope_type": "default", "rope_theta": 500.0}
    assert hf.config_from_hf({**d, "rope_scaling": scaling}).rope_theta == 500.0
    with pytest.raises(ValueError, match="two rope_theta values, 10000.0 at the top and 500.0 "
                                         "in rope_scaling"):  # fmt: skip
        hf.config_from_hf({**d, "rope_theta": 10000.0, "rope_scaling": scaling})


def test_a_rope_theta_in_rope_parameters_beside_a_rope_scaling_is_not_read():
    """transformers 5 replaces rope_parameters by a non-empty rope_scaling (and 4 never reads
    rope_parameters): the model ran at rope_parameters' 500, transformers at 10000."""
    d = hf.config_to_hf(models.LlamaConfig(vocab_size=16, hidden_size=16, num_layers=1,
                                           num_heads=2, mlp_hidden_size=16))  # fmt: skip
    d = {k: v for k, v in d.items() if k != "rope_theta"}
    d.update(rope_parameters={"rope_type": "default", "rope_theta": 500.0},
             rope_scaling={"rope_type": "default"})  # fmt: skip
    assert hf.config_from_hf(d).rope_theta == 10000.0
