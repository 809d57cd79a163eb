"""Observability: W&B sink (offline), jax.profiler traces, per-replica loss and distance."""

from __future__ import annotations

import errno
import io
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from pydoc_data.topics import topics

from noloco_jax import models
from noloco_jax.errors import MetricsWriteError
from noloco_jax.trainer import settings as settings_lib
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.observability import make_sinks
from noloco_jax.trainer.writers import MetricWriter, read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[1]
N = 4


def _settings(tmp, **over):
    corpus = tmp / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i, (name, text) in enumerate(sorted(topics.items())[:30]):
            (corpus / f"{i:02d}_{name}.txt").write_text(text, encoding="utf-8")
    base = {
        "method": "noloco", "num_replicas": N, "backend": "vmap", "global_batch_size": 8,
        "num_steps": 6, "log_every": 2, "eval_every": 2, "checkpoint_every": 6,
        "model": {"preset": "nano"}, "optim": {"warmup_steps": 1}, "outer": {"sync_every": 2},
        "data": {"source": "files", "path": str(corpus), "data_dir": str(tmp / "data"),
                 "seq_len": 32, "eval_windows": 4},
    }  # fmt: skip
    base.update(over)
    return settings_lib.from_config(base)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run with W&B (offline) and a profile of steps [2, 4)."""
    pytest.importorskip("wandb")
    tmp = tmp_path_factory.mktemp("obs")
    mp = pytest.MonkeyPatch()
    mp.setenv("WANDB_MODE", "offline")
    mp.setenv("WANDB_SILENT", "true")
    s = _settings(tmp, profile_steps="2:4",
                  log={"wandb": True, "wandb_project": "p", "wandb_run_name": "tiny"})  # fmt: skip
    try:
        train_and_evaluate(s, tmp / "run", progress=False)
    finally:
        mp.undo()
    return tmp / "run", s


def test_wandb_offline_run_is_written(run):
    workdir, _ = run
    runs = list((workdir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].glob("run-*.wandb"))
    assert len(files) == 1
    log = files[0].read_bytes()  # the run's records (protobuf): the metric names are in it
    for key in (b"eval/val_ppl", b"train/train_loss", b"train/train_loss_per_replica/r3",
                b"eval/distance_to_mean_per_replica/r0"):
        assert key in log, key


def test_profile_trace_is_written(run):
    workdir, _ = run
    traces = list((workdir / "profile").rglob("*.xplane.pb"))
    assert len(traces) == 1 and traces[0].stat().st_size > 0


def test_per_replica_loss_and_distance_in_jsonl(run):
    workdir, _ = run
    train = read_jsonl(workdir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [2, 4, 6]
    for r in train:
        per = r["train_loss_per_replica"]
        assert len(per) == N and np.isfinite(per).all()
        assert np.mean(per) == pytest.approx(r["train_loss"], rel=1e-5)
    assert len({round(x, 6) for x in train[-1]["train_loss_per_replica"]}) == N  # differ
    evals = read_jsonl(workdir / "metrics.jsonl", "eval")
    assert evals[0]["step"] == 0 and evals[0]["distance_to_mean_per_replica"] == [0.0] * N
    cfg = models.get_preset("nano", vocab_size=256)
    for r in evals[1:]:
        d = np.asarray(r["distance_to_mean_per_replica"])
        assert d.shape == (N,) and (d > 0).all()
        # The pooled spread is their root mean square over replicas and elements.
        pooled = np.sqrt(np.mean(d**2) / models.param_count(cfg))
        assert pooled == pytest.approx(r["replica_spread"], rel=1e-3)


@pytest.mark.parametrize("num", [3, 8])
def test_distance_to_mean_is_exact_for_identical_and_nearly_identical_replicas(num):
    """Identical replicas at N = 3 showed distances of 6e-7 (the mean of equal values rounds)."""
    from noloco_jax.trainer.observability import distance_to_mean  # noqa: PLC0415

    x = 0.02 * np.random.default_rng(0).normal(size=(1, 4000)).astype(np.float32) + 0.3
    assert distance_to_mean({"w": np.repeat(x, num, axis=0)}) == [0.0] * num
    near = (x + np.linspace(0, 1e-8, num, dtype=np.float32)[:, None]).astype(np.float32)
    wide = near.astype(np.float64)
    exact = np.sqrt(((wide - wide.mean(0)) ** 2).sum(1))
    np.testing.assert_allclose(distance_to_mean({"w": near}), exact, rtol=1e-3)


def test_distance_to_mean_leaves_out_integer_leaves_as_the_spread_does():
    """An integer leaf was pooled as a weight ([8.72, 8.72] instead of [1, 1]) and a shared
    integer scalar, which has no replica axis, crashed ("axis 0 is out of bounds")."""
    from noloco_jax.trainer.observability import distance_to_mean  # noqa: PLC0415

    w = np.array([[0.0], [2.0]], np.float32)
    counts = np.array([[0, 0, 0], [10, 10, 10]], np.int32)
    assert distance_to_mean({"w": w, "count": counts}) == [1.0, 1.0]
    assert distance_to_mean({"w": w, "step": np.array(3, np.int32)}) == [1.0, 1.0]


@pytest.mark.parametrize("num", [3, 8])
def test_replica_spread_is_exact_for_identical_and_nearly_identical_replicas(num):
    import jax  # noqa: PLC0415

    from noloco_jax import replica_spread  # noqa: PLC0415

    spread = jax.jit(jax.vmap(lambda q: replica_spread(q, "r"), axis_name="r"))
    x = 1000.0 + np.random.default_rng(0).normal(size=5000).astype(np.float32)
    same = np.broadcast_to(x, (num, 5000)).astype(np.float32)
    assert float(spread(same)[0]) == 0.0  # the mean of 3 equal values used to round away
    # Replicas up to 1e-3 apart around weights of 1000: a mean of the weights rounds at
    # 6e-5 (this spread came out 1% high, and identical replicas' as 4e-5).
    near = (same + np.linspace(0, 1e-3, num, dtype=np.float32)[:, None]).astype(np.float32)
    exact = np.sqrt(np.mean((near.astype(np.float64) - near.mean(0, dtype=np.float64)) ** 2))
    assert float(spread(near)[0]) == pytest.approx(exact, rel=1e-4)


def test_replica_spread_of_empty_weights_is_zero():
    """Float leaves with no elements gave 0 / 0 = NaN (a tree of no float leaves gave 0)."""
    import jax  # noqa: PLC0415

    from noloco_jax import replica_spread  # noqa: PLC0415

    spread = jax.jit(jax.vmap(lambda q: replica_spread(q, "r"), axis_name="r"))  # as it runs
    assert spread({"w": np.zeros((2, 0), np.float32)}).tolist() == [0.0, 0.0]
    tree = {"w": np.zeros((2, 0), np.float32), "v": np.array([[0.0], [2.0]], np.float32)}
    assert spread(tree).tolist() == [1.0, 1.0]


def test_replica_spread_counts_the_imaginary_part_of_complex_weights():
    """A complex leaf was cast to float32, dropping its imaginary part: replicas holding 1j
    and -1j (a spread of 1) gave 0."""
    import jax  # noqa: PLC0415

    from noloco_jax import replica_spread  # noqa: PLC0415

    spread = jax.jit(jax.vmap(lambda q: replica_spread(q, "r"), axis_name="r"))  # as it runs
    assert spread(np.array([[1j], [-1j]], np.complex64)).tolist() == [1.0, 1.0]
    tree = {"z": np.array([[1 + 1j], [-1 - 1j]], np.complex64),
            "v": np.array([[0.0], [2.0]], np.float32)}
    assert float(spread(tree)[0]) == pytest.approx(np.sqrt((2.0 + 1.0) / 2), rel=1e-6)


def test_replica_spread_of_a_single_replica_takes_axis_name_none():
    """axis_name=None (one replica, as the optimizers take it) raised an UnboundAxisError whose
    advice was to pass axis_name=None."""
    from noloco_jax import replica_spread  # noqa: PLC0415

    assert float(replica_spread({"w": np.arange(3.0, dtype=np.float32)}, None)) == 0.0


def test_plot_draws_per_replica_panels(run, tmp_path):
    workdir, _ = run
    png = tmp_path / "replicas.png"
    cmd = [sys.executable, str(ROOT / "experiments" / "plot.py"), str(workdir), "--out",
           str(tmp_path / "curves.png"), "--replicas_png", str(png)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**__import__("os").environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert png.stat().st_size > 1000


def test_wandb_run_id_is_kept_for_a_resume_and_new_for_a_fresh_run(tmp_path):
    from noloco_jax.trainer.observability import wandb_run_id  # noqa: PLC0415

    first = wandb_run_id(tmp_path / "run")
    assert first.startswith("noloco-") and wandb_run_id(tmp_path / "run") == first  # a resume
    (tmp_path / "run" / "wandb_run_id").unlink()  # rm -rf runs/x, then a fresh run in runs/x
    assert wandb_run_id(tmp_path / "run") != first  # was the same, path-derived id
    old = tmp_path / "old"
    (old / "checkpoints" / "8").mkdir(parents=True)  # a run from before the file existed
    import hashlib  # noqa: PLC0415

    legacy = "noloco-" + hashlib.sha256(str(old.resolve()).encode()).hexdigest()[:12]
    assert wandb_run_id(old) == legacy == (old / "wandb_run_id").read_text().strip()


def test_wandb_missing_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    s = _settings(tmp_path, log={"wandb": True})
    with pytest.raises(ValueError, match=r"config.log.wandb=True needs the wandb package"):
        make_sinks(s, tmp_path)


def test_each_process_of_a_multi_process_run_profiles_into_its_own_folder(monkeypatch, tmp_path):
    """Two processes on one host wrote <profile>/plugins/profile/<time>/<host>.xplane.pb, the
    same file when they started in the same second: one trace was lost."""
    import jax  # noqa: PLC0415

    from noloco_jax.trainer.observability import Profiler  # noqa: PLC0415

    assert Profiler("2:4", tmp_path).directory == tmp_path / "profile"
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert Profiler("2:4", tmp_path).directory == tmp_path / "profile" / "process_1"


@pytest.mark.parametrize("bad", ["5", "4:2", "a:b", "1:2:3", "-1:3", 7])
def test_bad_profile_steps(tmp_path, bad):
    with pytest.raises(ValueError, match="config.profile_steps: must be 'A:B'"):
        _settings(tmp_path, profile_steps=bad)


def test_a_line_cut_short_by_a_crash_is_skipped_with_a_warning_and_later_records_kept(tmp_path):
    """A partial last line made the next record unparseable: every reader failed on the file."""
    (tmp_path / "metrics.jsonl").write_text('{"step": 2, "kind": "train", "loss": 1.0}\n'
                                            '{"step": 4, "kind": "tr')  # fmt: skip
    writer = MetricWriter(tmp_path, tensorboard=False)
    writer.write(4, "train", {"loss": 0.5})
    writer.close()
    with pytest.warns(UserWarning, match=r"metrics.jsonl:2: skipped a record"):
        records = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [(r["step"], r["loss"]) for r in records] == [(2, 1.0), (4, 0.5)]


def test_plot_of_a_resized_run_draws_each_replica_while_it_exists(tmp_path):
    """A run resized 4 -> 2 (allow_resize) logs shorter per-replica lists after the resize;
    plot_replicas indexed every record by the first record's length: IndexError."""
    import json  # noqa: PLC0415

    from experiments.plot import plot_replicas  # noqa: PLC0415

    recs = [{"step": 2, "kind": "train", "train_loss_per_replica": [5.0, 5.1, 4.9, 5.0]},
            {"step": 2, "kind": "eval", "distance_to_mean_per_replica": [0.1, 0.2, 0.1, 0.2]},
            {"step": 2, "kind": "eval", "distance_to_mean_per_replica": [0.1, 0.1],
             "resized_from": 4},
            {"step": 4, "kind": "train", "train_loss_per_replica": [4.0, 4.1]},
            {"step": 4, "kind": "eval", "distance_to_mean_per_replica": [0.1, 0.1]}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    png = plot_replicas(tmp_path, tmp_path / "replicas.png")
    assert png.stat().st_size > 1000


def test_train_loss_last_leaves_out_an_infinite_loss_as_train_loss_does(tmp_path):
    """With the guard, both means are over finite losses; np.nanmean dropped NaN, not inf."""
    import types  # noqa: PLC0415

    import jax.numpy as jnp  # noqa: PLC0415

    from noloco_jax.trainer.loop import _train_metrics  # noqa: PLC0415

    s = _settings(tmp_path)
    run = types.SimpleNamespace(settings=s, counted=None, params0={"w": jnp.zeros((3,))})
    losses = np.array([[2.0, 3.0], [2.0, np.inf], [2.0, np.nan], [2.0, 3.0]])
    m = _train_metrics(run, types.SimpleNamespace(opt_state=()), 2, 2, losses, 1.0)
    assert m["train_loss"] == pytest.approx(14 / 6)
    assert m["train_loss_last"] == 3.0
    assert m["nonfinite_replica_steps"] == 2


def test_metric_sinks_close_after_a_failed_final_save_and_a_finished_run_opens_none(
        tmp_path, monkeypatch):  # fmt: skip
    """A failed final save (raised by the checkpointer's close) skipped the writer's close, so
    the W&B run was never finished; and a finished run, which says "Nothing was written",
    started (and finished) a W&B run at every such call."""
    from noloco_jax.trainer import loop  # noqa: PLC0415

    opened, records, closed = [], [], []

    class Sink:
        def write(self, step, kind, values):
            records.append((step, kind))

        def close(self):
            closed.append(1)

    real_close = loop.Checkpointer.close

    def fail(self):  # the saves finish, then the last one reports its failure
        real_close(self)
        raise OSError("No space left on device")

    monkeypatch.setattr(loop, "make_sinks", lambda s, workdir: opened.append(1) or [Sink()])
    monkeypatch.setattr(loop.Checkpointer, "close", fail)
    s = _settings(tmp_path, num_steps=2, eval_every=2, checkpoint_every=2)
    with pytest.raises(OSError, match="No space left"):
        train_and_evaluate(s, tmp_path / "run", progress=False)
    assert closed == [1] and (2, "train") in records and (2, "eval") in records
    monkeypatch.setattr(loop.Checkpointer, "close", real_close)
    train_and_evaluate(s, tmp_path / "run", progress=False)  # already finished
    assert len(opened) == 1


def test_a_failed_final_save_is_reported_when_the_metrics_cannot_be_flushed_either(
        tmp_path, monkeypatch):  # fmt: skip
    """A full disk at the end of a run fails the last save and the sinks' flush: the writer's
    MetricsWriteError ("the checkpoints already written are intact") replaced the save's
    CheckpointSaveError, so the lost final checkpoint went unreported."""
    from noloco_jax.errors import CheckpointSaveError  # noqa: PLC0415
    from noloco_jax.trainer import loop  # noqa: PLC0415

    real_close = loop.Checkpointer.close

    def fail(self):
        real_close(self)
        raise CheckpointSaveError("could not write the checkpoint of step 2")

    class FullSink:
        def write(self, step, kind, values):
            pass

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(loop, "make_sinks", lambda s, workdir: [FullSink()])
    monkeypatch.setattr(loop.Checkpointer, "close", fail)
    s = _settings(tmp_path, num_steps=2, eval_every=2, checkpoint_every=2)
    with pytest.raises(CheckpointSaveError, match="checkpoint of step 2"):
        train_and_evaluate(s, tmp_path / "run", progress=False)


def test_a_full_disk_at_the_writer_s_close_is_a_metrics_write_error(tmp_path, monkeypatch):
    """close() at the end of a run let a full disk's OSError out as a traceback, where
    write() raises MetricsWriteError (a short run failure, CLI exit 1)."""
    from noloco_jax.trainer import writers  # noqa: PLC0415

    class FullAtClose(io.TextIOWrapper):
        def close(self):
            super().close()
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_open(path, mode="r", **kwargs):
        return FullAtClose(open(path, "ab"), **kwargs) if mode == "a" else open(path, mode,
                                                                                **kwargs)

    monkeypatch.setattr(writers, "open", full_open, raising=False)
    writer = MetricWriter(tmp_path, tensorboard=False)
    writer.write(1, "train", {"loss": 1.0})
    with pytest.raises(MetricsWriteError, match=r"could not finish writing the metrics under .*"
                                                r"No space left on device"):  # fmt: skip
        writer.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1]


def test_a_write_refused_for_another_reason_than_space_does_not_say_free_space(tmp_path):
    """Any refused write (a metrics.jsonl that is a folder, or read-only) told the user to
    "Free space", which cannot help; only a full disk or quota still says so."""
    (tmp_path / "metrics.jsonl").mkdir()
    writer = MetricWriter(tmp_path, tensorboard=False)
    with pytest.raises(MetricsWriteError) as caught:
        writer.write(0, "eval", {"val_loss": 1.0})
    assert "IsADirectoryError" in str(caught.value) and "Free space" not in str(caught.value)
    assert "Make what the error names writable" in str(caught.value)


def test_numpy_and_jax_integers_and_bools_are_logged_exactly(tmp_path):
    """A NumPy or JAX integer went through float(): np.int64(2**53 + 1) was logged as
    9007199254740992.0, np.int64(7) as 7.0 and np.bool_(True) as 1.0, where Python's int and
    bool are written as they are."""
    import jax.numpy as jnp  # noqa: PLC0415

    writer = MetricWriter(tmp_path)  # TensorBoard too: it takes the exact values as well
    writer.write(1, "train", {"big": np.int64(2**53 + 1), "count": jnp.asarray(7),
                              "flag": np.bool_(True), "per_replica": np.array([1, 2]),
                              "loss": np.float32(1.5)})  # fmt: skip
    writer.close()
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert rec == {"step": 1, "kind": "train", "big": 2**53 + 1, "count": 7, "flag": True,
                   "per_replica": [1, 2], "loss": 1.5}  # fmt: skip
    assert [type(rec[k]) for k in ("big", "count", "flag")] == [int, int, bool]


def test_a_new_session_hides_what_an_abandoned_one_logged_past_its_start(tmp_path):
    """A run killed before its first checkpoint and started again with another log_every kept
    the first session's records (steps 3 and 6 beside the new 4 and 8); so did a resume that
    stopped before the old session's last step. Readers now see only the run that counts."""
    first = MetricWriter(tmp_path, tensorboard=False)
    first.resume_at(0)
    for step in (3, 6):
        first.write(step, "train", {"train_loss": 9.0})
    first.write(6, "event", {"event": "nonfinite_reset"})
    first.close()
    again = MetricWriter(tmp_path, tensorboard=False)  # killed before a checkpoint: from 0
    again.resume_at(0)
    for step in (4, 8):
        again.write(step, "train", {"train_loss": 5.0})
    again.close()
    resumed = MetricWriter(tmp_path, tensorboard=False)  # from a checkpoint at 4
    resumed.write(4, "event", {"event": "corrupt_checkpoint"})  # before resume_at
    resumed.resume_at(4)
    resumed.write(6, "train", {"train_loss": 4.0})
    resumed.close()
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert [(r["step"], r["train_loss"]) for r in train] == [(4, 5.0), (6, 4.0)]
    events = read_jsonl(tmp_path / "metrics.jsonl", "event")
    assert [r["event"] for r in events] == ["nonfinite_reset", "corrupt_checkpoint"]


def test_plot_draws_a_run_with_one_record(tmp_path):
    """A line of one point has no segment: without a marker, a run with one eval record (or
    a replica in one record) drew an empty panel."""
    import json  # noqa: PLC0415

    import matplotlib.image as mpimg  # noqa: PLC0415

    from experiments.plot import plot_runs  # noqa: PLC0415

    recs = [{"step": 0, "kind": "eval", "val_ppl": 20.0, "replica_spread": 0.1},
            {"step": 2, "kind": "train", "train_loss": 3.0}]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    img = mpimg.imread(plot_runs([tmp_path], tmp_path / "c.png"))[..., :3]
    c0 = np.array([0x1F, 0x77, 0xB4]) / 255  # the first line's colour
    eval_panels = img[:, img.shape[1] // 3:]  # no legend there: a C0 pixel is the record
    assert (np.abs(eval_panels - c0).max(-1) < 0.1).sum() > 0


def test_tensorboard_gets_per_replica_scalars(tmp_path):
    """Per-replica lists reached metrics.jsonl and W&B (<kind>/<name>/r<i>) but not
    TensorBoard, which took only int and float values."""
    scalars = {}

    class Recorder:
        def add_scalar(self, tag, value, step):
            scalars[tag] = (value, step)

        def flush(self):
            pass

        def close(self):
            pass

    class Writer(MetricWriter):
        def _open_tensorboard(self):
            self._tb = Recorder()

    writer = Writer(tmp_path)
    writer.write(2, "train", {"train_loss": 3.0, "train_loss_per_replica": [3.0, float("nan")]})
    writer.close()
    assert scalars == {"train/train_loss": (3.0, 2), "train/train_loss_per_replica/r0": (3.0, 2)}


def test_writing_the_profile_is_not_counted_in_tokens_per_sec(tmp_path, monkeypatch):
    """The trace was stopped (and written, seconds on a GPU) before the chunk's time was read,
    so the profiled chunk's tokens_per_sec counted the writing as training time."""
    import types  # noqa: PLC0415

    import jax  # noqa: PLC0415

    from noloco_jax.trainer import loop  # noqa: PLC0415
    from noloco_jax.trainer.observability import Profiler  # noqa: PLC0415

    clock, seconds = [0.0], []

    def tick(dt):
        clock[0] += dt

    def steps(run, state, step, k, synced=None):  # each chunk trains for 1 s
        tick(1.0)
        return state, np.zeros((N, k))

    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(jax.profiler, "start_trace", lambda *a, **k: None)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: tick(100.0))  # a long write
    monkeypatch.setattr(loop, "_run_blocks", steps)
    monkeypatch.setattr(loop, "_train_metrics", lambda *a: seconds.append(a[-1]) or {})
    monkeypatch.setattr(loop, "_after_chunk", lambda *a: False)
    monkeypatch.setattr(loop.health, "nonfinite_resets", lambda state: 0.0)
    run = types.SimpleNamespace(settings=types.SimpleNamespace(log_every=2, num_steps=6),
                                calls=set(), resized_from=None)  # fmt: skip
    ses = types.SimpleNamespace(
        run=run, guard=types.SimpleNamespace(active=False), last={},
        stop=types.SimpleNamespace(requested=None, agreed=None, training=False),
        bar=types.SimpleNamespace(advance=lambda *a, **k: None))  # fmt: skip
    loop._loop(ses, None, 2, 6, Profiler("2:4", tmp_path))
    assert seconds == [1.0, 1.0]
