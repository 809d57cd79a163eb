"""End-to-end training: each method, resume exactness, vmap == shard_map, CLI, bad configs."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

from noloco_jax.errors import UserError
from noloco_jax.trainer import settings as settings_lib
from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.writers import read_jsonl
from tests.helpers import copy_run, variant

ROOT = pathlib.Path(__file__).resolve().parents[1]


def tiny_settings(corpus_dir, data_dir, **overrides):
    base = {
        "method": "noloco",
        "num_replicas": 4,
        "backend": "vmap",
        "global_batch_size": 8,
        "num_steps": 12,
        "log_every": 2,
        "eval_every": 4,
        "checkpoint_every": 4,
        "model": {"preset": "nano"},
        "data": {
            "source": "files",
            "path": str(corpus_dir),
            "data_dir": str(data_dir),
            "seq_len": 32,
            "eval_windows": 8,
        },
        "optim": {"learning_rate": 3e-3, "warmup_steps": 2},
        "outer": {"sync_every": 4},  # log_every and sync_every must divide one another
    }
    for key, value in overrides.items():
        if isinstance(value, dict):
            base[key] = {**base.get(key, {}), **value}
        else:
            base[key] = value
    return settings_lib.from_config(base)


def _losses(workdir):
    by_step = {r["step"]: r["train_loss"] for r in read_jsonl(workdir / "metrics.jsonl", "train")}
    return [by_step[s] for s in sorted(by_step)]


# DiLoCo syncs every 2 steps: each 2-step chunk is an inner step and the sync step, two programs
# to compile (every 4 compiled a 2-step inner program too).
SYNC_EVERY = {"noloco": 6, "diloco": 2, "dp": 1, "local": 1}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, corpus_dir, data_dir, noloco_run):
    """``finished(method)``: (settings, workdir, last metrics) of a 12-step run of that method.

    Each run is trained once, on first use, and shared by the tests that only read it (a test
    that trains further copies it first). NoLoCo's is the session's ``noloco_run``.
    """
    runs = {"noloco": noloco_run}

    def get(method):
        if method not in runs:
            s = tiny_settings(corpus_dir, data_dir, method=method,
                              outer={"sync_every": SYNC_EVERY[method]})  # fmt: skip
            workdir = tmp_path_factory.mktemp(method)
            runs[method] = s, workdir, train_and_evaluate(s, workdir, progress=False)
        return runs[method]

    return get


@pytest.mark.parametrize("method", list(SYNC_EVERY))
def test_tiny_run_each_method(finished, method):
    _, workdir, last = finished(method)
    assert last["step"] == 12
    evals = read_jsonl(workdir / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [0, 4, 8, 12]
    for key in ("val_ppl", "val_ppl_avg_model", "replica_spread", "val_ppl_best_replica",
                "val_ppl_ensemble"):
        assert np.isfinite(evals[-1][key]), key
    e = evals[-1]  # a mixture's log-loss is at most the mean member log-loss (Jensen)
    assert e["val_ppl_ensemble"] <= e["val_ppl"] * (1 + 1e-6)
    assert e["val_ppl_best_replica"] <= e["val_ppl"] <= e["val_ppl_worst_replica"]
    assert evals[-1]["val_ppl"] < evals[1]["val_ppl"] < evals[0]["val_ppl"] < 300  # from ~256
    train = read_jsonl(workdir / "metrics.jsonl", "train")
    assert train[-1]["tokens_per_sec"] > 0
    assert (train[-1]["bytes_sent_per_replica"] > 0) == (method != "local")
    if method == "dp":
        assert evals[-1]["replica_spread"] == 0.0  # replicas stay bit-identical
    else:
        assert evals[-1]["replica_spread"] > 0
    assert Checkpointer(workdir / "checkpoints").all_steps() == [8, 12]
    assert list((workdir / "tensorboard").glob("events.*"))


def test_streaming_fragments_with_an_8_bit_exchange_train(tmp_path, corpus_dir, data_dir):
    # Evaluated at steps 0 and 12 only, saved at 12 only (host-only fields: same programs).
    s = tiny_settings(corpus_dir, data_dir, eval_every=12, checkpoint_every=12,
                      outer={"sync_every": 4, "fragments": 2, "exchange_dtype": "int8",
                             "error_feedback": True})  # fmt: skip
    last = train_and_evaluate(s, tmp_path, progress=False)
    evals = read_jsonl(tmp_path / "metrics.jsonl", "eval")
    assert last["step"] == 12 and evals[-1]["val_ppl"] < evals[0]["val_ppl"]
    assert 0 < evals[-1]["replica_spread"] < 1.0


def test_interrupted_and_resumed_run_is_bit_identical(tmp_path, noloco_run):
    s, full, _ = noloco_run  # sync_every 6: resumes mid-round
    parts = tmp_path / "parts"
    train_and_evaluate(s, parts, stop_at=6, progress=False)  # checkpoint at 4, "crash" at 6
    assert Checkpointer(parts / "checkpoints").latest_step() == 4
    train_and_evaluate(s, parts, progress=False)  # resumes from 4
    assert _losses(full) == _losses(parts)  # exact equality, not closeness
    evals_full = read_jsonl(full / "metrics.jsonl", "eval")
    evals_parts = {r["step"]: r for r in read_jsonl(parts / "metrics.jsonl", "eval")}
    assert evals_full[-1]["val_ppl"] == evals_parts[12]["val_ppl"]


def test_a_run_with_the_same_settings_reuses_the_compiled_programs(tmp_path, noloco_run):
    from noloco_jax.trainer import build  # noqa: PLC0415

    s = noloco_run[0]
    first, _ = build.build_run(s)
    again, _ = build.build_run(s)  # a resume, a notebook cell run again: nothing to compile
    assert (again.inner, again.sync, again.evaluate) == (first.inner, first.sync, first.evaluate)
    assert again.calls is first.calls  # so the bar does not report a compile that did not happen
    # The real loop compiled each block length once, and the sync step once: no recompiles.
    lengths = {key for name, key in first.calls if name == "inner"}
    assert lengths and first.inner._cache_size() == len(lengths) and first.sync._cache_size() == 1
    host_only = variant(s, eval_every=6, keep_checkpoints=5, data={"data_dir": str(tmp_path)})
    assert build.build_run(host_only)[0].inner is first.inner  # fields the programs never read
    other_lr = build.build_run(variant(s, optim={"learning_rate": 1e-3}))[0]
    assert other_lr.inner is not first.inner and other_lr.evaluate is first.evaluate  # same model
    # Anything that shapes the programs (here the schedule, through num_steps) builds new ones,
    # and the process keeps the newest KEEP_COMPILED (the other tests' programs are put back).
    kept = build._COMPILED.copy()
    try:
        others = [build.build_run(variant(s, num_steps=n))[0]
                  for n in range(13, 14 + build.KEEP_COMPILED)]  # fmt: skip
        assert len({id(r.inner) for r in [first, *others]}) == len(others) + 1
        assert all(r.evaluate is first.evaluate for r in others)  # one model: one evaluator
        assert len(build._COMPILED) == build.KEEP_COMPILED
        assert build.build_run(s)[0].inner is not first.inner  # evicted, so built again
    finally:
        build._COMPILED.clear()
        build._COMPILED.update(kept)


def test_tokens_per_sec_leaves_the_compile_time_out(noloco_run):
    # The chunks to steps 2 and 6 compile the inner and the sync programs: seconds against a
    # tenth of a second of steps. Counted as training, they logged 20-30x fewer tok/s.
    _, workdir, _ = noloco_run
    rates = [r["tokens_per_sec"] for r in read_jsonl(workdir / "metrics.jsonl", "train")]
    assert min(rates) > np.median(rates) / 10, rates


def test_vmap_and_shard_map_train_the_same(tmp_path, noloco_run):
    s, vmap, _ = noloco_run  # the losses only: no evaluation or checkpoint before the end
    train_and_evaluate(variant(s, backend="shard_map", eval_every=12, checkpoint_every=12),
                       tmp_path, progress=False)  # fmt: skip
    np.testing.assert_allclose(_losses(vmap), _losses(tmp_path), rtol=2e-5)


def test_resume_with_changed_topology_is_refused(tmp_path, noloco_run):
    s, finished_run, _ = noloco_run
    run = copy_run(finished_run, tmp_path / "run")
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    with pytest.raises(ValueError, match="cannot resume.*num_replicas: 4 -> 2"):
        train_and_evaluate(variant(s, num_replicas=2), run, progress=False)
    # The refused checkpoint is left exactly where it was (not set aside as corrupt).
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before
    assert not any("corrupt" in name for name in before)


def test_unknown_preset(tmp_path, corpus_dir, data_dir):
    # Refused with the settings, before a workdir is made (it failed at the model's build).
    with pytest.raises(ValueError, match=r"config\.model\.preset: must be one of .*'nano'.*"
                                         r"got 'huge'"):  # fmt: skip
        tiny_settings(corpus_dir, data_dir, model={"preset": "huge"})
    assert not any(tmp_path.iterdir())


def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path, corpus_dir, data_dir):
    """Ids from model.vocab_size up would be outside the embedding table."""
    s = tiny_settings(corpus_dir, data_dir, model={"preset": "nano", "vocab_size": 100})
    with pytest.raises(ValueError, match=r"config\.model\.vocab_size=100 is smaller than the "
                                         r"'byte' tokenizer's vocabulary of 256 .*set it to 0 "
                                         r"\(take the tokenizer's\) or to at least 256, e\.g\. "
                                         r"256 \(a multiple of 128\)"):  # fmt: skip
        train_and_evaluate(s, tmp_path, progress=False)


@pytest.fixture(scope="module")
def padded_run(tmp_path_factory, corpus_dir, data_dir):
    """(settings, workdir, last metrics) of a 4-step NoLoCo run with a padded vocabulary (384
    ids for the byte tokenizer's 256) and AdamW's weight decay masked off the norms, trained
    to step 2, then resumed to step 4 (evaluations and checkpoints every 2 steps).

    One run for the padded-vocabulary and the masked-decay tests, which only read it.
    """
    s = tiny_settings(corpus_dir, data_dir, num_steps=4, eval_every=2, checkpoint_every=2,
                      model={"preset": "nano", "vocab_size": 384},
                      optim={"weight_decay": 0.1, "decay_norms": False})  # fmt: skip
    workdir = tmp_path_factory.mktemp("padded")
    train_and_evaluate(s, workdir, stop_at=2, progress=False)
    return s, workdir, train_and_evaluate(s, workdir, progress=False)


def test_a_padded_vocabulary_trains_exports_and_resumes_only_as_itself(tmp_path, corpus_dir,
                                                                       data_dir, monkeypatch,
                                                                       padded_run):  # fmt: skip
    """model.vocab_size above the tokenizer's (a table padded to a multiple of 128, as
    nanoGPT pads GPT-2's 50,257 to 50,304) was refused as a mismatch."""
    from noloco_jax.models import hf  # noqa: PLC0415
    from noloco_jax.trainer import build  # noqa: PLC0415
    from noloco_jax.trainer import hf_init  # noqa: PLC0415
    from noloco_jax.trainer.hf_init import export_run  # noqa: PLC0415
    from noloco_jax.trainer.loop import load_run  # noqa: PLC0415

    load = hf_init.load_llama
    short = dict(num_steps=4, eval_every=2, checkpoint_every=4)
    s, run, last = padded_run
    run = copy_run(run, tmp_path / "run")  # a refused resume below
    assert last["step"] == 4 and np.isfinite(last["train_loss"]) and np.isfinite(last["val_loss"])
    _, params, data = load_run(s, tmp_path / "run")
    assert data.tokenizer.vocab_size == 256
    assert params["embedding"].shape == (4, 384, 64) and params["lm_head"].shape == (4, 64, 384)
    meta = Checkpointer(tmp_path / "run" / "checkpoints").read_meta(4)
    assert (meta["vocab_size"], meta["tokenizer_vocab_size"]) == (384, 256)
    # The export keeps the padded table; its config.json names the model's vocabulary.
    out = export_run(s, tmp_path / "run", tmp_path / "export")
    exported = json.loads((out / "config.json").read_text())
    assert exported["vocab_size"] == 384
    # The byte tokenizer's end id (0) and no first token; transformers assumed Llama's 1 and 2.
    assert (exported["eos_token_id"], exported["bos_token_id"]) == (0, None)
    assert hf.load_llama(out)[2]["embedding"].shape == (384, 64)
    # Resuming with another vocabulary is refused, as any changed model setting.
    with pytest.raises(ValueError, match=r"cannot resume.*vocab_size: 384 -> 0"):
        train_and_evaluate(variant(s, model={"vocab_size": 0}), tmp_path / "run", progress=False)
    # A padded Hugging Face checkpoint (384 ids for a 256-id tokenizer) is a valid start (one
    # trains in test_train_hf.py::test_a_padded_hf_checkpoint_trains_and_exports_its_padded_table).
    # Local steps only: one inner program to compile (no sync); the method plays no part here.
    s = tiny_settings(corpus_dir, data_dir, method="local", model={"init_from": str(out)},
                      **short)  # fmt: skip
    assert build.model_config(s, data.tokenizer.vocab_size).vocab_size == 384
    # Only init_from's path is a setting: a resume (or a load) after its config.json changed
    # ran the restored weights under the new RMSNorm epsilon, silently.
    train_and_evaluate(s, tmp_path / "tuned", progress=False)
    # model.remat may change on resume and load; it was recorded with the config.json and
    # refused as a change of it.
    remat = variant(s, model={"remat": True})
    assert train_and_evaluate(remat, tmp_path / "tuned", progress=False)["step"] == 4
    load_run(remat, tmp_path / "tuned")
    # Exporting the init_from run read the Hugging Face weights twice (load_run, then again
    # only for the model's config); once now, the config read from config.json alone.
    reads = []
    monkeypatch.setattr(hf_init, "load_llama", lambda *a, **k: reads.append(a) or load(*a, **k))
    export_run(s, tmp_path / "tuned", tmp_path / "export_tuned")
    assert len(reads) == 1
    (out / "config.json").write_text(json.dumps({**exported, "rms_norm_eps": 0.5}))
    changed = r"init_from's config.json changed since the checkpoint was written \(norm_eps: "
    with pytest.raises(ValueError, match=rf"cannot resume: config.model.{changed}1e-06 -> 0.5"):
        train_and_evaluate(s, tmp_path / "tuned", progress=False)
    with pytest.raises(ValueError, match=rf"cannot load the run: config.model.{changed}"):
        load_run(s, tmp_path / "tuned")


def test_settings_made_as_a_dataclass_are_checked_too(tmp_path):
    """TrainSettings built directly (not by from_config) were never validated: num_replicas=0
    died in a ZeroDivisionError, a bad method trained as something else."""
    from noloco_jax.trainer.loop import load_run  # noqa: PLC0415

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    for bad, match in ((dict(num_replicas=0), r"config\.num_replicas: must be an integer >= 1"),
                       (dict(method="bogus"), r"config\.method")):  # fmt: skip
        s = settings_lib.TrainSettings(**bad)
        with pytest.raises(ValueError, match=match):
            train_and_evaluate(s, tmp_path / "run", progress=False)
        with pytest.raises(ValueError, match=match):
            load_run(s, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_missing_corpus_path(tmp_path, data_dir):
    s = tiny_settings(tmp_path / "nowhere", data_dir)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        train_and_evaluate(s, tmp_path / "run", progress=False)


def test_empty_corpus(tmp_path, data_dir):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    s = tiny_settings(empty, data_dir)
    with pytest.raises(ValueError, match="empty"):
        train_and_evaluate(s, tmp_path / "run", progress=False)


# The command line's own run (in-process, exit status, printed metrics) is tested in
# test_cli.py, and as a real `python -m noloco_jax.train` process in test_multihost.py.
def test_plot_draws_next_to_the_run(tmp_path, noloco_run):
    workdir = copy_run(noloco_run[1], tmp_path / "run")
    stray = ROOT / "curves.png"
    stray_before = stray.exists()
    plot = [sys.executable, "-m", "experiments.plot", str(workdir)]
    drawn = subprocess.run(plot, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert drawn.returncode == 0, drawn.stderr[-3000:]
    png = workdir / "curves.png"  # next to the run, never into the current folder
    assert drawn.stdout.strip() == f"wrote {png}" and png.stat().st_size > 1000
    assert stray.exists() == stray_before


# ---------------------------------------------------------------- pipeline stages


@pytest.mark.slow  # resume is covered by test_interrupted_and_resumed_run_is_bit_identical
def test_pipelined_noloco_run_resumes_bit_identically(tmp_path, corpus_dir, data_dir):
    s = tiny_settings(corpus_dir, data_dir, num_stages=2, num_steps=8, checkpoint_every=4)
    full = tmp_path / "full"
    last = train_and_evaluate(s, full, progress=False)
    assert np.isfinite(last["val_ppl"]) and last["replica_spread"] > 0
    parts = tmp_path / "parts"
    train_and_evaluate(s, parts, stop_at=6, progress=False)
    train_and_evaluate(s, parts, progress=False)
    assert _losses(full) == _losses(parts)


@pytest.mark.slow  # fixed routing == independent replicas is unit-tested in test_pipeline.py
def test_fixed_routing_without_clipping_equals_no_pipeline(tmp_path, corpus_dir, data_dir):
    common = {"num_steps": 4, "checkpoint_every": 4, "optim": {"clip_norm": 0.0}}
    flat = tiny_settings(corpus_dir, data_dir, **common)
    piped = tiny_settings(corpus_dir, data_dir, num_stages=2, routing="fixed", **common)
    train_and_evaluate(flat, tmp_path / "flat", progress=False)
    train_and_evaluate(piped, tmp_path / "piped", progress=False)
    np.testing.assert_allclose(_losses(tmp_path / "piped"), _losses(tmp_path / "flat"), rtol=1e-5)


def test_stages_must_divide_layers(tmp_path, corpus_dir, data_dir):
    s = tiny_settings(corpus_dir, data_dir, num_stages=3)
    with pytest.raises(ValueError, match="num_stages=3 must divide the model's 2 layers"):
        train_and_evaluate(s, tmp_path, progress=False)


@pytest.mark.parametrize("batch_size", [0, -1, 1.5])
def test_eval_window_losses_refuses_a_bad_batch_size(batch_size):
    """0 was a ZeroDivisionError, -1 and 1.5 TypeErrors from JAX's reshape."""
    from noloco_jax.trainer import step  # noqa: PLC0415

    with pytest.raises(ValueError, match="^batch_size: must be an integer >= 1"):
        step.eval_window_losses(None, np.zeros((3, 9), np.int32), graphdef=None,
                                batch_size=batch_size)  # fmt: skip


def test_an_awkward_number_of_eval_windows_is_padded_not_run_one_by_one():
    """17 windows ran as 17 batches of one; now as two of 16 with the padding dropped."""
    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax import models, replicas  # noqa: PLC0415
    from noloco_jax.trainer import evaluate, step  # noqa: PLC0415

    assert [evaluate.eval_layout(w) for w in (17, 40, 8, 64)] == [(16, 32), (10, 40), (8, 8),
                                                                  (16, 64)]  # fmt: skip
    graphdef, params = models.init_params(models.get_preset("nano", vocab_size=256), 0)
    windows = np.random.default_rng(0).integers(0, 256, (17, 17)).astype(np.int32)
    got = evaluate.make_evaluator(replicas.Replicas(2), graphdef, windows)(
        replicas.replicate(params, 2))  # fmt: skip
    each = step.eval_window_losses(params, jnp.asarray(windows), graphdef=graphdef, batch_size=1)
    assert got["val_loss"] == pytest.approx(float(each.mean()), rel=1e-6)
    assert got["val_ppl_avg_model"] == pytest.approx(float(np.exp(each.mean())), rel=1e-6)
    # A second evaluator of the same model and topology (a second run in one process) reuses
    # the compiled programs, on its own windows; another model gets its own.
    before = evaluate._programs.cache_info()
    other = np.random.default_rng(1).integers(0, 256, (17, 17)).astype(np.int32)
    again = evaluate.make_evaluator(replicas.Replicas(2), graphdef, other)(
        replicas.replicate(params, 2))  # fmt: skip
    each = step.eval_window_losses(params, jnp.asarray(other), graphdef=graphdef, batch_size=1)
    assert again["val_loss"] == pytest.approx(float(each.mean()), rel=1e-6) != got["val_loss"]
    assert evaluate._programs.cache_info().hits == before.hits + 1
    graphdef2, _ = models.init_params(models.get_preset("nano", vocab_size=128), 0)
    evaluate.make_evaluator(replicas.Replicas(2), graphdef2, other % 128)
    assert evaluate._programs.cache_info().misses == before.misses + 1


@pytest.mark.parametrize("args, field", [((5, 0), "limit"), ((5, 2.5), "limit"),
                                         ((0, 16), "num_windows"), ((-3, 16), "num_windows")])
def test_eval_layout_refuses_a_limit_or_window_count_below_1(args, field):
    """They died in max() ("max() arg is an empty sequence") or range() (a TypeError)."""
    from noloco_jax.trainer import evaluate  # noqa: PLC0415

    with pytest.raises(ValueError, match=rf"{field}: must be an integer >= 1, got"):
        evaluate.eval_layout(*args)


def test_an_evaluator_of_no_windows_says_why():
    """A validation split shorter than one window (eval_windows gives none) died in
    eval_layout with "max() arg is an empty sequence"."""
    from noloco_jax import data, models, replicas  # noqa: PLC0415
    from noloco_jax.trainer import evaluate  # noqa: PLC0415

    graphdef, _ = models.init_params(models.get_preset("nano", vocab_size=256), 0)
    windows = data.eval_windows(np.arange(10), seq_len=16)
    assert windows.shape == (0, 17)
    with pytest.raises(ValueError, match="at least one validation window.*fewer than seq_len"):
        evaluate.make_evaluator(replicas.Replicas(2), graphdef, windows)


def test_an_evaluator_refuses_negative_token_ids():
    """-1 (a padding id) was wrapped to the last id by the gathers: a finite, wrong val_loss
    (5.5656 instead of 5.5732 on the nano model)."""
    from noloco_jax import models, replicas  # noqa: PLC0415
    from noloco_jax.trainer import evaluate  # noqa: PLC0415

    graphdef, _ = models.init_params(models.get_preset("nano", vocab_size=256), 0)
    windows = np.random.default_rng(0).integers(0, 256, (5, 9)).astype(np.int32)
    windows[:, -1] = -1
    with pytest.raises(ValueError, match=r"token ids >= 0, got -1"):
        evaluate.make_evaluator(replicas.Replicas(2), graphdef, windows)


def test_an_evaluator_refuses_token_ids_outside_the_models_vocabulary():
    """Ids of a 256-id tokenizer on a 128-id model: every val_ppl was NaN (the gathers fill
    out-of-range rows with NaN), with no word of why."""
    from noloco_jax import models, replicas  # noqa: PLC0415
    from noloco_jax.trainer import evaluate  # noqa: PLC0415

    graphdef, _ = models.init_params(models.get_preset("nano", vocab_size=128), 0)
    windows = np.random.default_rng(0).integers(0, 128, (5, 9)).astype(np.int32)
    evaluate.make_evaluator(replicas.Replicas(2), graphdef, windows)  # 127 at most: fine
    windows[:, -1] = 128
    with pytest.raises(ValueError, match=r"token id 128, outside .* must be in \[0, 128\)"):
        evaluate.make_evaluator(replicas.Replicas(2), graphdef, windows)


@pytest.mark.parametrize("stop_at", [-3, 2.5, True, "4"])
def test_stop_at_must_be_an_integer_of_at_least_0(tmp_path, corpus_dir, data_dir, stop_at):
    """-3 trained nothing and returned as if done; 2.5 trained, then died with a TypeError in
    the batcher; True trained one step."""
    s = tiny_settings(corpus_dir, data_dir)
    with pytest.raises(ValueError, match=r"stop_at: must be an integer >= 0, got"):
        train_and_evaluate(s, tmp_path, stop_at=stop_at, progress=False)
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before anything was written


def test_a_weight_decay_masked_off_the_norms_trains_and_resumes(padded_run):
    """optim.decay_norms=False: AdamW's masked state goes through a round, the checkpoint and
    a resume from it (``padded_run`` stops at step 2 and resumes; the decay itself:
    test_settings)."""
    _, workdir, _ = padded_run
    steps = [r["step"] for r in read_jsonl(workdir / "metrics.jsonl", "train")]
    assert steps == [2, 4] and np.isfinite(read_jsonl(workdir / "metrics.jsonl", "eval")[-1][
        "val_ppl"])  # fmt: skip


# ---------------------------------------------------------------- float32 master weights


def _master_settings(corpus_dir, data_dir, slow_dtype="float32", **overrides):
    """bf16 params, 8 steps, a sync every 2 (the resume at step 4 lands on a sync; each
    2-step chunk is one inner step and the sync step: two programs to compile, not three)."""
    return tiny_settings(corpus_dir, data_dir, num_steps=8, eval_every=4, checkpoint_every=4,
                         model={"preset": "nano", "param_dtype": "bfloat16"},
                         outer={"sync_every": 2, "slow_dtype": slow_dtype}, **overrides)


@pytest.fixture(scope="module")
def master_run(tmp_path_factory, corpus_dir, data_dir):
    """(settings, workdir) of a finished bf16 NoLoCo run with float32 slow weights."""
    s = _master_settings(corpus_dir, data_dir)
    workdir = tmp_path_factory.mktemp("master")
    train_and_evaluate(s, workdir, progress=False)
    return s, workdir


def _final_checksums(workdir):
    ckpt = Checkpointer(workdir / "checkpoints")
    return ckpt.read_meta(ckpt.latest_step())["checksums"]


@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_outer_slow_dtype_float32_keeps_master_weights_of_bf16_params(corpus_dir, data_dir,
                                                                      method):
    """outer.slow_dtype="float32": phi and the outer momentum in float32, theta in bf16 (the
    trainer never passed slow_dtype: a bf16 run kept its slow weights and momentum in bf16)."""
    import jax  # noqa: PLC0415

    from noloco_jax.optim.local_steps import find_local_steps_state  # noqa: PLC0415
    from noloco_jax.trainer import build  # noqa: PLC0415

    def floats(tree):
        return {str(x.dtype) for x in jax.tree.leaves(tree)
                if jax.numpy.issubdtype(x.dtype, jax.numpy.floating)}

    def dtypes(slow_dtype):
        s = _master_settings(corpus_dir, data_dir, slow_dtype, method=method)
        state = build.build_run(s)[1]  # the placed shapes the trainer restores onto
        found = find_local_steps_state(state.opt_state)
        return floats(state.params), floats(found.slow_params), floats(found.outer_state)

    assert dtypes("float32") == ({"bfloat16"}, {"float32"}, {"float32"})
    assert dtypes("") == ({"bfloat16"}, {"bfloat16"}, {"bfloat16"})  # the default: as before


def test_a_master_weights_run_trains_and_resumes_bit_identically(tmp_path, master_run):
    s, full = master_run
    evals = read_jsonl(full / "metrics.jsonl", "eval")
    assert evals[-1]["val_ppl"] < evals[0]["val_ppl"] and np.isfinite(_losses(full)).all()
    train_and_evaluate(s, tmp_path, stop_at=6, progress=False)  # checkpoint at 4, "crash" at 6
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 4
    train_and_evaluate(s, tmp_path, progress=False)  # resumes from the float32 slow weights
    assert _losses(full) == _losses(tmp_path)  # exact equality, not closeness
    assert _final_checksums(full) == _final_checksums(tmp_path)
    assert read_jsonl(tmp_path / "metrics.jsonl", "eval")[-1]["val_ppl"] == evals[-1]["val_ppl"]


def test_a_master_weights_run_trains_the_same_under_shard_map(tmp_path, master_run):
    s, vmap = master_run  # the losses only: no evaluation or checkpoint before the end
    train_and_evaluate(variant(s, backend="shard_map", eval_every=8, checkpoint_every=8),
                       tmp_path, progress=False)  # fmt: skip
    np.testing.assert_allclose(_losses(vmap), _losses(tmp_path), rtol=2e-5)


def test_strict_dtype_promotion_is_refused_before_the_run(corpus_dir, data_dir, tmp_path):
    """Under jax_numpy_dtype_promotion='strict' the run prepared its data, evaluated step 0,
    then crashed inside optax's Adam (b1**count) with a TypePromotionError."""
    s = tiny_settings(corpus_dir, data_dir)
    refused = r"jax_numpy_dtype_promotion: the trainer needs 'standard', got 'strict'"
    with jax.numpy_dtype_promotion("strict"), pytest.raises(UserError, match=refused):
        train_and_evaluate(s, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
