"""Training that survives faults and refuses bad input (the trainer level of issue 6)."""

import multiprocessing

import numpy as np
import pytest

from noloco_jax import determinism
from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.writers import read_jsonl
from tests.helpers import copy_run, logged_records, tensorboard_view, variant
from tests.test_train import _losses, tiny_settings


def test_injected_nan_is_caught_reset_and_logged(tmp_path, corpus_dir, data_dir):  # noqa: F811
    # Replica 1's weights become NaN before update 5 (step index 4): the losses of
    # updates 5 and 6 are NaN; the sync after update 6 (syncs every 3) finds its fast
    # weights non-finite, excludes it from its pair, resets its Adam moments and puts
    # its weights back on its slow weights (restore_nonfinite on the sync step; the
    # loop passes the phase from the host, as log_every = sync_every).
    s = tiny_settings(corpus_dir, data_dir, num_steps=12, log_every=3, eval_every=6,
                      checkpoint_every=6, outer={"sync_every": 3},
                      fault={"inject_nan_step": 4, "inject_nan_replica": 1})  # fmt: skip
    train_and_evaluate(s, tmp_path, stop_at=9, progress=False)  # a crash: checkpoint 6 holds the count
    last = train_and_evaluate(s, tmp_path, progress=False)
    events = read_jsonl(tmp_path / "metrics.jsonl", "event")
    # One event, not repeated after the resume (the resumed run's first chunk re-reported it).
    assert [(e["event"], e["step"], e["total"]) for e in events] == [("nonfinite_reset", 6, 1)]
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert sum(r["nonfinite_replica_steps"] for r in train) == 2
    assert np.isfinite(last["val_ppl"]) and np.isfinite(last["train_loss_last"])
    assert last["val_ppl"] < 100  # training went on: nothing else was poisoned


def test_fast_weights_left_non_finite_after_the_last_sync_are_warned(
        tmp_path, corpus_dir, data_dir, capsys, monkeypatch):  # noqa: F811 (fmt: skip)
    # The run also stands for a GPU whose JAX started without deterministic ops (the trainer
    # cannot set the flag once the backend runs): its first lines say so.
    monkeypatch.setattr(determinism, "_platform", lambda: "gpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    # Replica 1 goes NaN before update 5; syncs every 4, so the run's last step (5) has no
    # sync to repair it: the run ends, its checkpoint holds finite slow weights (the guard's
    # check), and its NaN fast weights were saved without a word.
    s = tiny_settings(corpus_dir, data_dir, num_steps=5, log_every=1, eval_every=5,
                      checkpoint_every=5, outer={"sync_every": 4},
                      fault={"inject_nan_step": 4, "inject_nan_replica": 1})  # fmt: skip
    last = train_and_evaluate(s, tmp_path, progress=False)
    assert last["step"] == 5 and not np.isfinite(last["val_ppl"])
    out = capsys.readouterr().out
    assert "WARNING: the fast weights of replica(s) [1] are non-finite at the last step 5" in out
    assert (f"WARNING: config.deterministic=True, but JAX started its GPU backend without "
            f"{determinism.FLAG}=true") in out
    assert Checkpointer(tmp_path / "checkpoints").latest_step() == 5


@pytest.mark.slow  # the guard's positive case is test_injected_nan_is_caught_reset_and_logged
def test_without_guard_nan_spreads(tmp_path, corpus_dir, data_dir):  # noqa: F811
    from noloco_jax.errors import TrainingDivergedError  # noqa: PLC0415

    s = tiny_settings(corpus_dir, data_dir, num_steps=8,
                      fault={"inject_nan_step": 4, "nonfinite_guard": False})  # fmt: skip
    with pytest.raises(TrainingDivergedError):  # the run no longer "succeeds" (issue 17)
        train_and_evaluate(s, tmp_path, progress=False)
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert not np.isfinite(train[-1]["train_loss"])  # the NaN spread past its replica


@pytest.mark.parametrize("method", ["noloco", "diloco"])
def test_dropout_trains_without_blocking(tmp_path, corpus_dir, data_dir, method):  # noqa: F811
    # Evaluated at steps 0 and 8, saved at 8 (host-only fields: the same programs).
    s = tiny_settings(corpus_dir, data_dir, method=method, num_steps=8, eval_every=8,
                      checkpoint_every=8, outer={"sync_every": 2},
                      fault={"dropout_prob": 0.3})  # fmt: skip
    last = train_and_evaluate(s, tmp_path, progress=False)
    assert np.isfinite(last["val_ppl"]) and last["step"] == 8


@pytest.fixture(scope="module")
def reference(noloco_run):
    """The session's uninterrupted 12-step run: (settings, workdir, train losses).

    Its checkpoints are those of steps 8 and 12 (one every 4 steps, the newest two kept).
    Tests read it; a test that damages or resumes it works on a copy.
    """
    s, run, _ = noloco_run
    assert Checkpointer(run / "checkpoints").all_steps() == [8, 12]
    return s, run, _losses(run)


def _replayed(run, step):
    """The train losses logged at ``step`` in ``run``: the copied record, then the replay's."""
    return [r["train_loss"] for r in logged_records(run, "train") if r["step"] == step]


def test_corrupt_latest_checkpoint_is_reported_and_the_previous_used(tmp_path, reference):
    s, finished, losses = reference
    run = copy_run(finished, tmp_path / "run")
    for f in (run / "checkpoints" / "12").rglob("*"):
        if f.is_file() and f.stat().st_size > 0 and "meta" not in f.parts:
            f.write_bytes(b"\\x00garbage")
    train_and_evaluate(s, run, progress=False)
    events = read_jsonl(run / "metrics.jsonl", "event")
    assert events and events[0]["event"] == "corrupt_checkpoint" and events[0]["step"] == 12
    assert (run / "checkpoints" / "12.corrupt").is_dir()  # set aside, not deleted
    assert len(_replayed(run, 10)) == 2  # resumed from step 8 ...
    assert _losses(run) == losses  # ... on the same trajectory
    assert _replayed(run, 12) == [losses[-1]] * 2
    # TensorBoard shows steps 10 and 12 once: the purge follows the checkpoint restored (8),
    # not the newest one (12), which was set aside
    shown = tensorboard_view(run / "tensorboard")
    steps = [step for tag, step in shown if tag == "train/train_loss"]
    assert steps == sorted(set(steps)) and steps[-1] == 12


def test_interrupted_save_leaves_the_previous_checkpoint_restorable(tmp_path, reference):
    s, finished, losses = reference
    run = copy_run(finished, tmp_path / "run")
    # What a save killed mid-write leaves behind: orbax's unfinished temporary directory
    # (the save of step 12 never finished).
    partial = run / "checkpoints" / "12.orbax-checkpoint-tmp-1700000000"
    (run / "checkpoints" / "12").rename(partial)
    for f in list(partial.rglob("*"))[::2]:
        if f.is_file():
            f.unlink()
    assert Checkpointer(run / "checkpoints").latest_step() == 8
    last = train_and_evaluate(s, run, progress=False)
    assert last["step"] == 12 and Checkpointer(run / "checkpoints").latest_step() == 12
    assert _replayed(run, 12) == [losses[-1]] * 2  # steps 9-12 trained again, the same way


_KILLED_MID_SAVE = r"""
import json, os, sys
from noloco_jax.trainer import checkpoint, loop, settings

real_save = checkpoint.Checkpointer.save

def save(self, step, state, meta, **kwargs):
    real_save(self, step, state, meta, **kwargs)  # orbax writes asynchronously
    if step == 8:
        os._exit(9)  # the process dies with the step-8 write in flight

checkpoint.Checkpointer.save = save
loop.train_and_evaluate(settings.from_config(json.loads(sys.argv[1])), sys.argv[2],
                        progress=False)
"""


def test_process_killed_during_a_save_resumes_without_loss(tmp_path, reference):
    import json
    import os
    import pathlib
    import subprocess
    import sys

    s, _, losses = reference
    root = pathlib.Path(__file__).resolve().parents[1]
    run = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TF_CPP_MIN_LOG_LEVEL": "3"}
    killed = subprocess.run([sys.executable, "-c", _KILLED_MID_SAVE, json.dumps(s.to_dict()),
                             str(run)], capture_output=True, text=True, env=env, cwd=root,
                            timeout=600)  # fmt: skip
    assert killed.returncode == 9, killed.stderr[-2000:]
    last = train_and_evaluate(s, run, progress=False)  # restart after the crash
    assert last["step"] == 12 and Checkpointer(run / "checkpoints").latest_step() == 12
    assert _losses(run) == losses  # nothing lost, same trajectory as without a crash


def test_refused_resume_leaves_the_checkpoint_untouched(tmp_path, reference):
    s, finished, _ = reference
    run = copy_run(finished, tmp_path / "run")
    files = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match="cannot resume.*group_size"):
        train_and_evaluate(variant(s, outer={"group_size": 4}), run, progress=False)
    after = {p: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    assert after == files


def test_workdir_not_writable(tmp_path, corpus_dir, data_dir):  # noqa: F811
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    s = tiny_settings(corpus_dir, data_dir)
    with pytest.raises(ValueError, match="--workdir .*a_file/run.* is not writable"):
        train_and_evaluate(s, blocker / "run", progress=False)
    with pytest.raises(ValueError, match="--workdir .*a_file' is a file, not a directory"):
        train_and_evaluate(s, blocker, progress=False)  # was "[Errno 17] File exists"


def test_a_workdir_under_the_home_directory_is_expanded(tmp_path, monkeypatch):
    """``--workdir=~/runs/x``: no shell expands a tilde after '=', and the run went into a
    folder named '~' under the current directory (load_run looked there too)."""
    from noloco_jax.trainer.loop import _checkpoint_dir, _writable_workdir  # noqa: PLC0415

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert _writable_workdir("~/runs/x") == tmp_path / "home" / "runs" / "x"
    assert not (tmp_path / "~").exists()
    (tmp_path / "home" / "runs" / "x" / "checkpoints").mkdir()
    assert _checkpoint_dir("~/runs/x") == tmp_path / "home" / "runs" / "x" / "checkpoints"


def _probe_many(workdir: str, times: int) -> int:
    """How often ``times`` writability probes of ``workdir`` failed (run in a worker process)."""
    from noloco_jax.trainer.loop import _writable_workdir  # noqa: PLC0415

    fails = 0
    for _ in range(times):
        try:
            _writable_workdir(workdir)
        except ValueError:
            fails += 1
    return fails


def test_processes_probing_one_workdir_at_once_do_not_collide(tmp_path):
    # The processes of a multi-process run probe the workdir together; with one shared probe
    # file one could delete the other's (measured: 3 and 4 failures in 2 x 2000 probes).
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        fails = pool.starmap(_probe_many, [(str(tmp_path), 1500)] * 2)
    assert fails == [0, 0]


def test_too_few_devices_for_replicas_or_stages(tmp_path, corpus_dir, data_dir):  # noqa: F811
    s = tiny_settings(corpus_dir, data_dir, num_replicas=16, global_batch_size=16,
                      backend="shard_map")  # fmt: skip
    with pytest.raises(ValueError, match="one device per replica: num_replicas=16.*8 devices"):
        train_and_evaluate(s, tmp_path / "a", progress=False)
    s = tiny_settings(corpus_dir, data_dir, num_stages=2, num_replicas=8, global_batch_size=16,
                      backend="shard_map")  # fmt: skip
    with pytest.raises(ValueError, match="8 x 2 .* needs 16 devices"):
        train_and_evaluate(s, tmp_path / "b", progress=False)
