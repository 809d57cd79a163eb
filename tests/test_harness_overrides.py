"""The experiment harness (noloco_jax.experiments.harness) applies overrides with ml_collections' own parsing."""

from __future__ import annotations

import concurrent.futures
import json
import pathlib

import pytest

from noloco_jax.experiments import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "tiny_noloco.py"


class _Threads(concurrent.futures.ThreadPoolExecutor):
    """The process pool's part, in threads (``harness.train_in_processes``' stand-in)."""

    def __init__(self, jobs, mp_context=None, max_tasks_per_child=None, initializer=None):
        super().__init__(jobs)


def _threads_with_workers(terminated: list) -> type:
    """``_Threads`` with two stand-in worker processes whose ``terminate()`` (the SIGTERM the
    grid passes on) appends to ``terminated``."""

    class Worker:
        def terminate(self):
            terminated.append(1)

    class Threads(_Threads):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._processes = {1: Worker(), 2: Worker()}

    return Threads


def test_overrides_are_typed_like_the_cli():
    cfg = harness.load_config(CONFIG, {"outer.sync_every": 7, "optim.learning_rate": 1,
                                       "outer.gamma": 0.3, "model.preset": "nano"})  # fmt: skip
    assert (cfg.outer.sync_every, cfg.outer.gamma, cfg.model.preset) == (7, 0.3, "nano")
    assert isinstance(cfg.optim.learning_rate, float) and cfg.optim.learning_rate == 1.0
    cfg.extra_field = 1  # the returned config is unlocked again, as before
    assert harness.load_config(str(CONFIG), {}).model.preset == "tiny"  # a str path (crashed)


def test_misspelt_or_mistyped_overrides_are_errors():
    with pytest.raises(KeyError, match="gama"):  # was silently added as a new field
        harness.load_config(CONFIG, {"outer.gama": 1.0})
    with pytest.raises(KeyError, match="nosuch"):
        harness.load_config(CONFIG, {"nosuch.x": 1})
    with pytest.raises(TypeError, match="seq_len"):
        harness.load_config(CONFIG, {"data.seq_len": "long"})


def test_a_grid_loads_each_run_once_and_trains_the_config_as_loaded(monkeypatch, tmp_path):
    loaded, trained = [], {}
    real_load = harness.load_config

    def load(path, overrides):
        loaded.append(dict(overrides))
        return real_load(path, overrides)

    def train(config, workdir):  # stands in for training: records what it was given
        trained[workdir.name] = config
        (workdir / "checkpoints" / str(config.num_steps)).mkdir(parents=True)  # finished
        (workdir / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_ppl": 1.0}\n')

    monkeypatch.setattr(harness, "load_config", load)
    monkeypatch.setattr(harness, "_train", train)
    odd_path = "a dir/with=signs,'quotes'"  # no command line between the grid and the run
    runs = [harness.Run("a", {"outer.gamma": 0.3}), harness.Run("b", {"outer.sync_every": 7})]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, data_path=odd_path)
    results = harness.run_grid(CONFIG, runs, opts, runs_subdir="grid")
    assert len(loaded) == 2 and sorted(trained) == ["a", "b"]
    assert trained["a"].outer.gamma == 0.3 and trained["b"].outer.sync_every == 7
    assert all(c.data.path == odd_path and c.data.source == "files" for c in trained.values())
    assert results["a"]["eval"][0]["val_ppl"] == 1.0


def test_a_run_refused_in_a_worker_is_a_user_error_naming_the_run(tmp_path):
    """It was a RuntimeError pointing at a log (deleted with pilot_cost's temporary folder)."""
    from noloco_jax.errors import UserError  # noqa: PLC0415

    bad = harness.load_config(CONFIG, {"num_replicas": 0})
    with pytest.raises(UserError, match=r"run bad: config\.num_replicas: must be an integer"):
        harness.train_in_processes([(tmp_path / "bad", bad)], jobs=1)


def test_a_run_stopped_by_a_signal_in_a_worker_starts_no_further_run(monkeypatch, tmp_path):
    """--jobs > 1 handed every run to the pool at once, so after Ctrl-C (each worker's run
    stopped and saved) the pool went on to train every run still queued."""

    trained = []

    def train_logged(config, workdir, log):
        trained.append(workdir.name)
        return "SIGINT"

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _Threads)
    monkeypatch.setattr(harness, "_train_logged", train_logged)
    cfg = harness.load_config(CONFIG, {})
    harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(3)], jobs=1)
    assert trained == ["r0"]


def test_ctrl_c_in_the_parent_of_the_workers_lets_their_runs_stop(monkeypatch, tmp_path,
                                                                   capsys):  # fmt: skip
    """One Ctrl-C under --jobs 2 (the workers stopped and saved) ended the parent with a
    KeyboardInterrupt traceback and exit 130, as a crash; it now waits for the runs under way,
    starts no other, and the grid ends as a stopped one. A second Ctrl-C stops at once."""

    wait, calls = concurrent.futures.wait, []

    def interrupted_wait(*args, **kwargs):
        calls.append(1)
        if len(calls) in interrupts:
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    trained = []
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _Threads)
    monkeypatch.setattr(concurrent.futures, "wait", interrupted_wait)
    monkeypatch.setattr(harness, "_train_logged", lambda c, w, log: trained.append(w.name))
    cfg = harness.load_config(CONFIG, {})
    interrupts = {1}
    try:
        harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(4)], jobs=2)
    except KeyboardInterrupt:  # not raised on: pytest would end the whole session
        pytest.fail("one Ctrl-C reached the grid's caller as a KeyboardInterrupt")
    assert sorted(trained) == ["r0", "r1"] and "no further run starts" in capsys.readouterr().out
    interrupts, trained[:] = {1, 2}, []
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(4)], jobs=2)


def test_a_sigterm_of_the_parent_of_the_workers_stops_their_runs(monkeypatch, tmp_path, capsys):
    """``kill PID`` of the grid's parent under --jobs 2 ended the parent alone: its workers,
    which a plain SIGTERM does not reach as Ctrl-C does, trained on. It is now passed on to
    them, as Ctrl-C is, and starts no other run; a second SIGTERM is passed on too, then acts
    as it would without the grid."""
    import signal  # noqa: PLC0415

    terminated, outside = [], []
    wait, calls = concurrent.futures.wait, []

    def signalled_wait(*args, **kwargs):
        calls.append(1)
        for _ in range(signals if len(calls) == 1 else 0):
            signal.raise_signal(signal.SIGTERM)
        return wait(*args, **kwargs)

    trained = []
    workers = _threads_with_workers(terminated)
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", workers)
    monkeypatch.setattr(concurrent.futures, "wait", signalled_wait)
    monkeypatch.setattr(harness, "_train_logged", lambda c, w, log: trained.append(w.name))
    # Without the grid's handler a SIGTERM lands here (it would end pytest).
    previous = signal.signal(signal.SIGTERM, lambda *a: outside.append(1))
    try:
        cfg = harness.load_config(CONFIG, {})
        signals = 1
        harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(4)], jobs=2)
        assert sorted(trained) == ["r0", "r1"] and len(terminated) == 2 and not outside
        assert "no further run starts" in capsys.readouterr().out
        signals, terminated[:], trained[:] = 2, [], []
        calls.clear()
        harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(4)], jobs=2)
        assert len(terminated) == 4 and outside == [1]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ctrl_c_that_reaches_a_worker_still_starting_counts_it_as_stopped(monkeypatch, tmp_path,
                                                                          capsys):  # fmt: skip
    """Ctrl-C under --jobs 2 that reached a worker still importing (before the trainer's
    handler) interrupted it or killed it (the pool broke), and the grid ended in a traceback:
    the worker's KeyboardInterrupt, or RuntimeError('run r0 failed; see log'). Such a worker now
    counts as stopped; without a Ctrl-C it still fails the grid."""

    wait, calls = concurrent.futures.wait, []

    def interrupted_wait(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 and interrupt:
            raise KeyboardInterrupt
        return wait(*args, **kwargs)

    def train_logged(config, workdir, log):
        trained.append(workdir.name)
        raise failure  # interrupted while importing, or killed (the pool breaks)

    trained = []
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _Threads)
    monkeypatch.setattr(concurrent.futures, "wait", interrupted_wait)
    monkeypatch.setattr(harness, "_train_logged", train_logged)
    cfg = harness.load_config(CONFIG, {})
    todo = [(tmp_path / f"r{i}", cfg) for i in range(4)]
    for failure in (KeyboardInterrupt(), concurrent.futures.process.BrokenProcessPool()):
        interrupt, trained[:] = True, []
        calls.clear()
        try:
            harness.train_in_processes(todo, jobs=2)
        except KeyboardInterrupt:  # not raised on: pytest would end the whole session
            pytest.fail("a worker's KeyboardInterrupt reached the grid's caller")
        assert sorted(trained) == ["r0", "r1"] and "stopped r0" in capsys.readouterr().out
    interrupt = False  # a worker that fails on its own still fails the grid
    with pytest.raises(RuntimeError, match="run r[01] failed"):
        harness.train_in_processes(todo, jobs=2)


def test_a_sigterm_that_kills_a_worker_still_starting_counts_it_as_stopped(monkeypatch, tmp_path,
                                                                           capsys):  # fmt: skip
    """``kill PID`` of the grid's parent under --jobs 2 passed the SIGTERM to a worker still
    importing (before the trainer's handler), which died, and the grid raised
    RuntimeError('run r0 failed; see log') from BrokenProcessPool. Such a worker now counts as
    stopped; without a SIGTERM a broken pool still fails the grid."""
    import signal  # noqa: PLC0415

    wait, calls = concurrent.futures.wait, []

    def signalled_wait(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1 and signalled:
            signal.raise_signal(signal.SIGTERM)
        return wait(*args, **kwargs)

    def train_logged(config, workdir, log):
        trained.append(workdir.name)
        raise concurrent.futures.process.BrokenProcessPool("terminated abruptly")

    trained, outside = [], []
    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", _threads_with_workers([]))
    monkeypatch.setattr(concurrent.futures, "wait", signalled_wait)
    monkeypatch.setattr(harness, "_train_logged", train_logged)
    previous = signal.signal(signal.SIGTERM, lambda *a: outside.append(1))
    try:
        cfg = harness.load_config(CONFIG, {})
        todo = [(tmp_path / f"r{i}", cfg) for i in range(4)]
        signalled = True
        harness.train_in_processes(todo, jobs=2)
        assert sorted(trained) == ["r0", "r1"] and not outside
        assert "stopped r0" in capsys.readouterr().out
        signalled, trained[:] = False, []
        calls.clear()
        with pytest.raises(RuntimeError, match="run r[01] failed"):
            harness.train_in_processes(todo, jobs=2)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _quick_or_wait_for_sigterm(config, workdir, log):
    """A worker's run (spawned workers import it from here): r0 ends at once, r1 waits for
    its SIGTERM as the trainer does and reports it."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    if workdir.name == "r0":
        return None
    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("SIGTERM"))
    (workdir.parent / "r1.running").touch()
    deadline = time.monotonic() + 60
    while not got and time.monotonic() < deadline:
        time.sleep(0.05)
    return got[0] if got else None


def _catches_sigterm(pid):
    status = pathlib.Path(f"/proc/{pid}/status").read_text()
    caught = next(line for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(caught.split()[1], 16) >> 14 & 1)  # bit 15 - 1: SIGTERM


@pytest.mark.skipif(not pathlib.Path("/proc/self/status").exists(), reason="reads /proc")
def test_a_sigterm_of_the_grid_with_a_spare_worker_lets_the_run_under_way_stop(
        monkeypatch, tmp_path, capsys):  # fmt: skip
    """After a run ends the pool starts a spare worker; the grid's SIGTERM, passed on to it,
    killed it, which broke the pool: the run under way was sent a second SIGTERM (stopped
    without saving) and the grid died with 'run r1 failed'. The spare now only notes it."""
    import signal  # noqa: PLC0415
    import time  # noqa: PLC0415

    pools, wait, calls = [], concurrent.futures.wait, []

    class Recorded(concurrent.futures.ProcessPoolExecutor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pools.append(self)

    def wait_then_sigterm(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # r0 has ended, r1 runs: SIGTERM once its spare worker is up
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (
                    (tmp_path / "r1.running").exists() and len(pools[0]._processes) == 2
                    and all(_catches_sigterm(p) for p in pools[0]._processes)):  # fmt: skip
                time.sleep(0.1)
            signal.raise_signal(signal.SIGTERM)
        return wait(*args, **kwargs)

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Recorded)
    monkeypatch.setattr(concurrent.futures, "wait", wait_then_sigterm)
    monkeypatch.setattr(harness, "_train_logged", _quick_or_wait_for_sigterm)
    previous = signal.signal(signal.SIGTERM, lambda *a: pytest.fail("SIGTERM reached pytest"))
    try:
        cfg = harness.load_config(CONFIG, {})
        harness.train_in_processes([(tmp_path / f"r{i}", cfg) for i in range(2)], jobs=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    assert "finished r0" in out and "stopped r1" in out, out


def test_read_run_skips_a_line_cut_short_by_a_crash(tmp_path):
    # The writer starts a fresh line after a cut one and read_jsonl skips it; read_run raised
    # a JSONDecodeError on it at the end of a grid.
    from noloco_jax.trainer.writers import MetricWriter  # noqa: PLC0415

    w = MetricWriter(tmp_path, tensorboard=False)
    w.write(5, "eval", {"val_ppl": 9.0})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 10, "kind": "train", "train_lo')  # killed mid-record
    w = MetricWriter(tmp_path, tensorboard=False)  # the resumed session appends
    w.write(10, "eval", {"val_ppl": 8.0})
    w.close()
    with pytest.warns(UserWarning):
        run = harness.read_run(tmp_path)
    assert [(e["step"], e["val_ppl"]) for e in run["eval"]] == [(5, 9.0), (10, 8.0)]


def test_a_report_that_fails_part_way_leaves_the_earlier_one_intact(tmp_path, monkeypatch):
    """write_outputs wrote in place: a full disk part-way through left the earlier report's
    json truncated (lost, and --report_only could no longer read it)."""
    opts = harness.Options(out_dir=tmp_path)
    harness.write_outputs(opts, "table2", {"noloco_n8_s0": {"eval": []}}, "good")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    write_text = pathlib.Path.write_text

    def disk_full(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        harness.write_outputs(opts, "table2", {"noloco_n8_s1": {"eval": []}}, "new")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before  # no temporary left
    assert "noloco_n8_s0" in json.loads(before["table2.json"])


def test_smoke_runs_keep_the_sync_periods_the_full_plan_tells_apart(tmp_path):
    """smoke_overrides set H = 2 after every run's own overrides: in the smoke, Table 2's control
    diloco_h10 had diloco's config (a comparison with a copy) and the H sweep swept nothing.
    Now each run's H is scaled (smoke_sync_every), and the reports' period still finds the
    plan's LAST_K evaluations, each a sync step of every run."""
    import math

    from experiments import dropout, routing_ablation, sweeps
    from noloco_jax.experiments import plan, table2

    opts = harness.Options(smoke=True, runs_dir=tmp_path)

    def configs(module, subdir):
        grid = harness.plan_grid(module.CONFIG, module.grid(True), opts, subdir)
        return {run.name: cfg for run, _, cfg, _ in grid}

    t2 = configs(table2, "table2")
    h = {m: t2[f"{m}_n2_s0"].outer.sync_every for m in ("noloco", "diloco", "diloco_h10")}
    assert h["diloco_h10"] == h["noloco"] < h["diloco"]  # as 10, 10, 20 in the full plan
    assert t2["diloco_h10_n2_s0"].to_dict() != t2["diloco_n2_s0"].to_dict()
    sw = configs(sweeps, "table2")
    swept = {cfg.outer.sync_every for name, cfg in sw.items()
             if name.startswith(("sweep_sync_every_", "noloco_"))}  # fmt: skip
    assert len(swept) == 2  # the smoke's H sweep: one value besides the baseline
    assert sweeps.metric_period(True) == h["diloco"]  # the period table2 reads from its runs
    for name, grid in (("routing", configs(routing_ablation, "routing")),
                       ("dropout", configs(dropout, "table2"))):  # fmt: skip
        assert grid["noloco_" + ("pp1_n2" if name == "routing" else "n2_s0")].outer.sync_every \
            < grid["diloco_" + ("pp1_n2" if name == "routing" else "n2_s0")].outer.sync_every
    for cfg in [*t2.values(), *sw.values()]:
        assert h["diloco"] % cfg.outer.sync_every == 0 or cfg.method == "dp"
        aligned = cfg.num_steps // math.lcm(h["diloco"], cfg.eval_every)
        assert aligned >= plan.LAST_K
    assert [harness.smoke_sync_every(v) for v in (5, 10, 20, 50)] == [1, 2, 4, 10]


def test_md_table_escapes_a_pipe_inside_a_cell():
    from experiments.bench import common  # noqa: PLC0415

    for md_table in (harness.md_table, common.md_table):
        table = md_table(["run", "partial r (lr | step)"], [["a", "max |d|"], ["b", 0.5]])
        lines = table.splitlines()
        # every line has 3 unescaped pipes: 2 cells, as many as the delimiter row
        assert [line.replace("\\|", "").count("|") for line in lines] == [3, 3, 3, 3]
        assert lines[0] == "| run | partial r (lr \\| step) |"
        assert lines[2] == "| a | max \\|d\\| |" and lines[3] == "| b | 0.5 |"
