"""Trainer with Hugging Face assets: --config.model.init_from and --config.data.tokenizer=hf.

Needs the ``[hf]`` extra (transformers, torch CPU, tokenizers); nothing is downloaded: the
tokenizer is trained here by ``tokenizers`` and the model is a random LlamaForCausalLM.
"""

from __future__ import annotations

import json
import types

import jax
import numpy as np
import pytest
from pydoc_data.topics import topics

from noloco_jax.trainer import settings as settings_lib
from noloco_jax import models
from noloco_jax.trainer.hf_init import export_run
from noloco_jax.trainer.loop import load_run, prepare_data, train_and_evaluate
from noloco_jax.trainer.writers import read_jsonl


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    for i, (name, text) in enumerate(sorted(topics.items())[:30]):
        (d / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus_dir):
    """A BPE tokenizer.json (vocab 300, eos '</s>') and a random Llama of that vocabulary."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    d = tmp_path_factory.mktemp("hf")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "</s>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train([str(p) for p in sorted(corpus_dir.iterdir())], trainer)
    tok.save(str(d / "tokenizer.json"))
    vocab = tok.get_vocab_size()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(d)
    return d


def _settings(corpus_dir, data_dir, hf_dir, **model):
    return settings_lib.from_config({
        "method": "noloco", "num_replicas": 2, "backend": "vmap", "global_batch_size": 4,
        "num_steps": 4, "log_every": 2, "eval_every": 2, "checkpoint_every": 4,
        "model": {"init_from": str(hf_dir), **model},
        "data": {"source": "files", "path": str(corpus_dir), "data_dir": str(data_dir),
                 "seq_len": 32, "eval_windows": 4, "tokenizer": "hf",
                 "tokenizer_path": str(hf_dir)},
        "optim": {"warmup_steps": 1}, "outer": {"sync_every": 2},
    })  # fmt: skip


def test_init_from_starts_every_replica_at_the_hf_weights(tmp_path, corpus_dir, hf_dir):
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    s = _settings(corpus_dir, tmp_path / "data", hf_dir)
    last = train_and_evaluate(s, tmp_path / "run", progress=False)
    assert last["step"] == 4 and np.isfinite(last["train_loss"])
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl", "eval")[0]
    assert first["step"] == 0 and first["replica_spread"] == 0.0
    # Step-0 validation loss equals transformers' own loss of that model on the same windows.
    windows = prepare_data(s).eval_windows
    assert windows.max() >= 256  # BPE merges are used: ids beyond the byte range
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dir).float().eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(windows[:, :-1].astype(np.int64))).logits
        ce = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), torch.from_numpy(windows[:, 1:].astype(np.int64)),
            reduction="none",
        ).mean(1)  # fmt: skip
    np.testing.assert_allclose(first["val_loss"], float(ce.mean()), rtol=1e-5)
    # Export the trained, replica-averaged model; transformers gives the same logits.
    out = export_run(s, tmp_path / "run", tmp_path / "export")
    graphdef, params, _ = load_run(s, tmp_path / "run")
    avg = jax.tree.map(lambda x: x.mean(0), params)
    ours = np.asarray(models.apply(graphdef, avg, windows[:2, :-1]))
    exported = transformers.LlamaForCausalLM.from_pretrained(out).float().eval()
    with torch.no_grad():
        theirs = exported(torch.from_numpy(windows[:2, :-1].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-5, rtol=0)
    assert not np.allclose(ours, logits[:2].numpy(), atol=1e-3)  # it did train
    # Its special ids are the run's tokenizer's (transformers assumed Llama's 1 and 2).
    tok = prepare_data(s).tokenizer
    assert (exported.config.eos_token_id, exported.config.bos_token_id) == (tok.eos_id,
                                                                            tok.bos_id)


def test_hf_bad_inputs(tmp_path, corpus_dir, hf_dir):
    data = tmp_path / "data"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        s = _settings(corpus_dir, data, hf_dir, init_from=str(tmp_path / "nope"))
        train_and_evaluate(s, tmp_path / "a", progress=False)
    # A Llama whose vocabulary is smaller than the tokenizer's (a larger one is padded: fine).
    other = tmp_path / "other"
    other.mkdir()
    config = json.loads((hf_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    (other / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    s = _settings(corpus_dir, data, hf_dir, init_from=str(other))
    with pytest.raises(ValueError, match=r"config\.model\.init_from=.* has a vocabulary of 200 "
                                         r"ids but the 'hf' tokenizer has 300"):  # fmt: skip
        train_and_evaluate(s, tmp_path / "b", progress=False)
    with pytest.raises(ValueError, match=r"config\.model\.vocab_size=384 differs from the "
                                         r"init_from model's 300; set it to 0"):  # fmt: skip
        train_and_evaluate(_settings(corpus_dir, data, hf_dir, vocab_size=384), tmp_path / "b2",
                           progress=False)  # fmt: skip
    (other / "config.json").write_text(json.dumps({**config, "model_type": "mistral",
                                                    "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(ValueError, match="'mistral' model.*only Llama"):
        train_and_evaluate(s, tmp_path / "c", progress=False)
    with pytest.raises(FileNotFoundError, match="holds no tokenizer.json"):
        s = _settings(corpus_dir, data, hf_dir)
        s = settings_lib.from_config({**s.to_dict(), "data": {**s.to_dict()["data"],
                                                              "tokenizer_path": str(other)}})
        train_and_evaluate(s, tmp_path / "d", progress=False)
    with pytest.raises(ValueError, match="data.tokenizer_path"):
        settings_lib.from_config({"data": {"tokenizer": "hf"}})


def test_hf_tokenizer_ends_documents_only_where_the_loader_does(tmp_path, hf_dir):
    """A document that spells '</s>' out got an end-of-document id inside it; an eos_token of
    tokenizer_config.json missing from the vocabulary was silently replaced by another."""
    import shutil  # noqa: PLC0415

    from noloco_jax.data.hf_tokenizer import HFTokenizer  # noqa: PLC0415

    tok = HFTokenizer(hf_dir)
    assert tok.eos_id not in tok.encode("x</s> y").tolist()
    assert tok.decode(tok.encode("a doc that says </s> in it")) == "a doc that says </s> in it"
    other = tmp_path / "tok"
    other.mkdir()
    shutil.copy(hf_dir / "tokenizer.json", other / "tokenizer.json")
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(ValueError, match=r"eos_token '<\|im_end\|>' is not in the vocabulary"):
        HFTokenizer(other)


def test_export_run_checks_replica_before_reading_the_run(tmp_path, monkeypatch):
    """A bool or float replica passed the range check: True/False indexed as masks and failed in
    save_llama ("a replica axis left in?"), 1.0 as an IndexError."""
    import types  # noqa: PLC0415

    from noloco_jax.models import hf  # noqa: PLC0415
    from noloco_jax.trainer import build, loop  # noqa: PLC0415

    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8)  # fmt: skip
    reps = [models.init_params(cfg, i)[1] for i in range(2)]
    data = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=16, eos_id=0))
    run = (None, jax.tree.map(lambda *x: np.stack(x), *reps), data)
    monkeypatch.setattr(loop, "load_run", lambda s, workdir: run)
    monkeypatch.setattr(build, "model_config", lambda s, v: cfg)
    s = types.SimpleNamespace(num_replicas=2)
    for replica in (True, False, 1.0, -1, 2):
        with pytest.raises(ValueError, match=r"replica must be None or an int in \[0, 2\)"):
            export_run(s, tmp_path / "run", tmp_path / "out", replica=replica)
    out = export_run(s, tmp_path / "run", tmp_path / "out", replica=np.int64(1))
    exported = hf.load_llama(out)[2]
    np.testing.assert_array_equal(exported["embedding"][...], reps[1]["embedding"][...])


def test_export_run_of_one_replica_split_over_devices(tmp_path, monkeypatch):
    """mesh.fsdp=2: export_run(replica=1) died in JAX's explicit-sharding gather ("out
    sharding could not be resolved"); the replica is exported as it is, copied to the host
    from its own shards (every replica was copied to the host to keep one)."""
    from noloco_jax import replicas  # noqa: PLC0415
    from noloco_jax.models import hf  # noqa: PLC0415
    from noloco_jax.trainer import build, hf_init, loop  # noqa: PLC0415

    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8)  # fmt: skip
    reps = [models.init_params(cfg, i)[1] for i in range(2)]
    split = replicas.make_replicas(2, mesh_shape={"fsdp": 2})
    params = split.put(jax.tree.map(lambda *x: np.stack(x), *reps))
    assert not params["embedding"][...].sharding.is_fully_replicated  # spread over the mesh
    data = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=16, eos_id=0))
    monkeypatch.setattr(loop, "load_run", lambda s, workdir: (None, params, data))
    monkeypatch.setattr(build, "model_config", lambda s, v: cfg)
    whole = []  # weights copied to the host with every replica (to keep one of them)
    monkeypatch.setattr(hf_init, "to_host",  # (the finiteness check copies N flags: fine)
                        lambda x: (x.ndim > 1 and whole.append(x.shape)) or np.asarray(x))
    out = export_run(types.SimpleNamespace(num_replicas=2), tmp_path / "run", tmp_path / "out",
                     replica=1)  # fmt: skip
    exported = hf.load_llama(out)[2]
    for x, y in zip(jax.tree.leaves(exported), jax.tree.leaves(reps[1])):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert whole == []  # replica 1's shards alone were read


def test_export_run_refuses_non_finite_weights(tmp_path, monkeypatch):
    """A replica left NaN at the run's last step (the guard repairs it only at a sync) made the
    exported averaged model all NaN, written without an error; a finite replica still exports."""
    from noloco_jax.models import hf  # noqa: PLC0415
    from noloco_jax.trainer import build, loop  # noqa: PLC0415

    cfg = models.LlamaConfig(vocab_size=16, hidden_size=8, num_layers=1, num_heads=2,
                             mlp_hidden_size=8)  # fmt: skip
    reps = [models.init_params(cfg, i)[1] for i in range(2)]
    params = jax.tree.map(lambda a, b: np.stack([a, np.full_like(b, np.nan)]), *reps)
    data = types.SimpleNamespace(tokenizer=types.SimpleNamespace(vocab_size=16, eos_id=0))
    monkeypatch.setattr(loop, "load_run", lambda s, workdir: (None, params, data))
    monkeypatch.setattr(build, "model_config", lambda s, v: cfg)
    s = types.SimpleNamespace(num_replicas=2)
    for replica in (None, 1):
        with pytest.raises(ValueError, match=r"replica\(s\) \[1\] are non-finite"):
            export_run(s, tmp_path / "run", tmp_path / "out", replica=replica)
    assert not (tmp_path / "out").exists()
    out = export_run(s, tmp_path / "run", tmp_path / "out", replica=0)
    np.testing.assert_array_equal(hf.load_llama(out)[2]["embedding"][...],
                                  reps[0]["embedding"][...])  # fmt: skip


def test_a_padded_hf_checkpoint_trains_and_exports_its_padded_table(tmp_path, corpus_dir, hf_dir):
    """A checkpoint whose embedding is larger than its tokenizer (384 rows for 300 ids, as
    many Hub models pad theirs) was refused as a vocabulary mismatch."""
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    padded = tmp_path / "padded"
    config = transformers.LlamaConfig(**{**json.loads((hf_dir / "config.json").read_text()),
                                         "vocab_size": 384})  # fmt: skip
    torch.manual_seed(1)
    transformers.LlamaForCausalLM(config).float().eval().save_pretrained(padded)
    s = _settings(corpus_dir, tmp_path / "data", hf_dir, init_from=str(padded))
    last = train_and_evaluate(s, tmp_path / "run", progress=False)
    assert last["step"] == 4 and np.isfinite(last["train_loss"])
    out = export_run(s, tmp_path / "run", tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 384
    exported = transformers.LlamaForCausalLM.from_pretrained(out)
    assert exported.get_input_embeddings().weight.shape == (384, 32)


def test_an_init_from_config_changed_in_the_same_process_is_not_run_by_old_programs(
        tmp_path, corpus_dir, hf_dir):  # fmt: skip
    """The compiled programs and evaluator were kept by the settings alone: after config.json's
    rope_theta and rms_norm_eps changed under the same init_from path, a second run in the
    process evaluated (and trained) the model of the old config.json."""
    from noloco_jax.models import hf  # noqa: PLC0415
    from noloco_jax.trainer.build import build_run  # noqa: PLC0415

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").symlink_to(hf_dir / "model.safetensors")
    config = json.loads((hf_dir / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config))
    s = _settings(corpus_dir, tmp_path / "data", hf_dir, init_from=str(model))

    def val_loss() -> float:
        run = build_run(s)[0]
        return float(run.evaluate(run.fresh().params)["val_loss"])

    before = val_loss()
    rope = {**config.get("rope_parameters", {}), "rope_theta": 3.0}
    (model / "config.json").write_text(json.dumps({**config, "rope_theta": 3.0,
                                                   "rope_parameters": rope, "rms_norm_eps": 0.5}))
    after = val_loss()
    windows = prepare_data(s).eval_windows
    _, graphdef, params = hf.load_llama(model)
    logp = jax.nn.log_softmax(models.apply(graphdef, params, windows[:, :-1]))
    ce = -np.take_along_axis(np.asarray(logp), windows[:, 1:, None].astype(np.int64), -1).mean()
    assert after != before
    np.testing.assert_allclose(after, ce, rtol=1e-5)
