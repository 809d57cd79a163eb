"""One version (issue 23, item 9): results record the commit, config and seed of every run;
make_results refuses results of different commits unless told; a run with the same seed and
code is bit-identical."""

import json
import pathlib
import re
import subprocess

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver

from noloco_jax import errors
from noloco_jax.experiments import harness, provenance

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "tiny_noloco.py"


def _git(repo, *args):
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


@pytest.fixture
def repo(tmp_path):
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "config", "user.email", "t@t")
    _git(tmp_path, "config", "user.name", "t")
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "experiments" / "results" / "a.json").write_text("{}")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "one")
    return tmp_path


def test_git_state_commit_dirty_and_outputs(repo):
    head = _git(repo, "rev-parse", "HEAD").strip()
    assert provenance.git_state(repo) == {"commit": head, "dirty": False, "diff_sha256": None}
    (repo / "experiments" / "results" / "a.json").write_text('{"new": 1}')  # published output
    (repo / "experiments" / "results" / "b.md").write_text("new")
    assert provenance.git_state(repo)["dirty"] is False
    (repo / "code.py").write_text("x = 2\n")
    dirty = provenance.git_state(repo)
    assert dirty["dirty"] is True and len(dirty["diff_sha256"]) == 16
    assert provenance.version_label(dirty) == f"{head[:12]}+dirty.{dirty['diff_sha256']}"
    (repo / "code.py").write_text("x = 3\n")  # another uncommitted change: another version
    assert provenance.git_state(repo)["diff_sha256"] != dirty["diff_sha256"]
    (repo / "code.py").write_text("x = 1\n")
    (repo / "new_module.py").write_text("y = 1\n")  # a new file counts too
    one = provenance.git_state(repo)
    assert one["dirty"] is True
    (repo / "new_module.py").write_text("y = 2\n")  # and so does its content
    assert provenance.git_state(repo)["diff_sha256"] != one["diff_sha256"]
    (repo / "new_module.py").unlink()
    (repo / 'caf\u00e9 "q".py').write_text("z = 1\n")  # a name git quotes without -z
    before = provenance.git_state(repo)["diff_sha256"]
    (repo / 'caf\u00e9 "q".py').write_text("z = 2\n")
    assert provenance.git_state(repo)["diff_sha256"] != before
    assert provenance.git_state(repo.parent)["commit"] is None  # not a checkout
    assert provenance.version_label({"commit": None}) == "unrecorded"


def test_an_installed_copy_inside_another_checkout_records_no_commit(repo):
    """A non-editable install in a project's .venv: harness.ROOT is site-packages, which git
    places in the enclosing project; its commit is not this code's version."""
    site = repo / ".venv" / "lib" / "python3.11" / "site-packages"
    (site / "noloco_jax").mkdir(parents=True)
    (site / "noloco_jax" / "__init__.py").write_text("")
    assert provenance.git_state(site) == {"commit": None, "dirty": None, "diff_sha256": None}
    assert provenance.git_state(repo / "experiments")["commit"] is not None  # tracked files


def test_a_tree_git_status_cannot_read_is_not_recorded_clean(repo):
    """`git status` failing (a damaged index) while `rev-parse HEAD` works gave dirty=False:
    an uncommitted change was labelled the clean commit, which make_results accepts."""
    head = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "code.py").write_text("x = 2\n")
    (repo / ".git" / "index").write_bytes(b"garbage")
    state = provenance.git_state(repo)
    assert state == {"commit": head, "dirty": None, "diff_sha256": None}
    assert provenance.version_label(state) == f"{head[:12]}+dirty.unknown"
    assert provenance.version_label({"commit": head, "dirty": False}) == head[:12]


def _fake_train(trained):
    def train(config, workdir):  # stands in for training: records what it was given
        trained.append(workdir.name)
        (workdir / "checkpoints" / str(config.num_steps)).mkdir(parents=True)
        (workdir / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_ppl": 1.0}\n')

    return train


def test_runs_record_commit_config_and_seed_and_refuse_another_config(monkeypatch, tmp_path):
    trained = []
    monkeypatch.setattr(harness, "_train", _fake_train(trained))
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out")
    runs = [harness.Run("a", {"seed": 3, "outer.seed": 4, "outer.gamma": 0.3})]
    results = harness.run_grid(CONFIG, runs, opts, runs_subdir="grid")
    info = json.loads((tmp_path / "grid" / "a" / "run_info.json").read_text())
    assert info["commit"] == provenance.git_state(ROOT)["commit"] and "dirty" in info
    assert (info["seed"], info["outer_seed"], info["config"]["outer"]["gamma"]) == (3, 4, 0.3)
    assert info["config"]["num_steps"] == harness.load_config(CONFIG, {}).num_steps  # full config
    assert results["a"]["run_info"] == info
    harness.write_outputs(opts, "rep", {"summary": 1}, "md", runs=results)
    saved = json.loads((tmp_path / "out" / "rep.json").read_text())
    prov = saved["_provenance"]
    assert prov["writer"]["commit"] == info["commit"] and prov["runs"]["a"]["seed"] == 3
    assert list(provenance.versions_of(saved)) == [provenance.version_label(info)]
    assert harness.run_grid(CONFIG, runs, opts, runs_subdir="grid") and trained == ["a"]  # reused
    other = [harness.Run("a", {"seed": 3, "outer.seed": 4, "outer.gamma": 0.5})]
    with pytest.raises(ValueError, match=r"another config \(outer.gamma: 0.3 -> 0.5\)"):
        harness.run_grid(CONFIG, other, opts, runs_subdir="grid")
    (tmp_path / "grid" / "a" / "run_info.json").unlink()  # a run of the days before run_info
    with pytest.raises(ValueError, match="no run_info.json"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="grid")


def test_a_dry_run_refuses_a_run_trained_with_another_config(monkeypatch, tmp_path):
    """--dry_run listed a run trained with another config as "done"; the grid then refused it."""
    monkeypatch.setattr(harness, "_train", _fake_train([]))
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path)
    harness.run_grid(CONFIG, [harness.Run("a", {"outer.gamma": 0.3})], opts, runs_subdir="g")
    dry = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, dry_run=True)
    with pytest.raises(ValueError, match=r"another config \(outer.gamma: 0.3 -> 0.5\)"):
        harness.run_grid(CONFIG, [harness.Run("a", {"outer.gamma": 0.5})], dry, runs_subdir="g")


def _stopped_at_a_then_run_at_b(monkeypatch, runs, opts, first_train):
    """The grid stopped (KeyboardInterrupt) by ``first_train`` at commit a, then run to its
    end at commit b; returns the second session's results."""
    a, b = ({"commit": c * 40, "dirty": False, "diff_sha256": None} for c in "ab")
    monkeypatch.setattr(provenance, "git_state", lambda root: a)
    monkeypatch.setattr(harness, "_train", first_train)
    with pytest.raises(KeyboardInterrupt):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    monkeypatch.setattr(provenance, "git_state", lambda root: b)
    monkeypatch.setattr(harness, "_train", _fake_train([]))
    return harness.run_grid(CONFIG, runs, opts, runs_subdir="g")


def test_a_run_that_never_trained_takes_the_version_that_trains_it(monkeypatch, tmp_path):
    """run_info.json is written for every run before the first trains: a grid stopped in its
    first run and re-run from commit B recorded runs B trained entirely as commit A's (with B
    only as resumed_at), and make_results saw mixed commits."""
    runs = [harness.Run(f"r{i}", {"seed": i}) for i in range(2)]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out")

    def stopped(config, workdir):
        raise KeyboardInterrupt

    results = _stopped_at_a_then_run_at_b(monkeypatch, runs, opts, stopped)
    for name in ("r0", "r1"):
        assert results[name]["run_info"]["commit"] == "b" * 40
        assert "resumed_at" not in results[name]["run_info"]
    harness.write_outputs(opts, "rep", {}, "md", runs=results)
    saved = json.loads((tmp_path / "out" / "rep.json").read_text())
    assert list(provenance.versions_of(saved)) == ["b" * 12]


def test_a_run_stopped_before_its_first_checkpoint_takes_the_version_that_restarts_it(
        monkeypatch, tmp_path):
    """A run killed before its first checkpoint (every killed smoke run) starts again at step
    0 and its earlier records are dropped, yet it was recorded as the killed commit's, resumed
    by the new one, and make_results saw mixed commits."""
    runs = [harness.Run("r0", {"seed": 0})]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out")

    def killed(config, workdir):  # what the trainer leaves before its first checkpoint
        (workdir / "checkpoints").mkdir()
        (workdir / "metrics.jsonl").write_text('{"step": -1, "kind": "session"}\n')
        raise KeyboardInterrupt

    info = _stopped_at_a_then_run_at_b(monkeypatch, runs, opts, killed)["r0"]["run_info"]
    assert info["commit"] == "b" * 40 and "resumed_at" not in info


def test_a_run_another_grid_is_training_keeps_its_record(monkeypatch, tmp_path):
    """A second grid sharing a run (table2 and spread_vs_lr at once) rewrote the run_info.json of
    the run the first was training (its version, as resumed by the second) before the
    trainer's lock refused it; it is refused before the record is touched."""
    from noloco_jax.errors import WorkdirLockedError  # noqa: PLC0415
    from noloco_jax.trainer.lock import WorkdirLock  # noqa: PLC0415

    a, b = ({"commit": c * 40, "dirty": False, "diff_sha256": None} for c in "ab")
    runs = [harness.Run("r0", {"seed": 0})]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path)
    monkeypatch.setattr(provenance, "git_state", lambda root: a)
    monkeypatch.setattr(harness, "_train", lambda config, workdir: {"stopped_by": "SIGTERM"})
    with pytest.raises(harness.GridIncomplete):  # its record written, a checkpoint saved
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    workdir = tmp_path / "g" / "r0"
    (workdir / "checkpoints" / "2").mkdir(parents=True)
    record = (workdir / "run_info.json").read_text()
    monkeypatch.setattr(provenance, "git_state", lambda root: b)
    monkeypatch.setattr(harness, "_train", lambda config, workdir: WorkdirLock(workdir).acquire())
    with WorkdirLock(workdir), pytest.raises(WorkdirLockedError, match="in use by another"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    assert (workdir / "run_info.json").read_text() == record


def test_parts_and_dry_run(monkeypatch, tmp_path, capsys):
    trained = []
    monkeypatch.setattr(harness, "_train", _fake_train(trained))
    runs = [harness.Run(f"r{i}", {"seed": i}) for i in range(5)]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, dry_run=True)
    with pytest.raises(harness.GridIncomplete, match="5 of 5 runs to train"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    assert trained == [] and capsys.readouterr().out.count("todo r") == 5
    part = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, part=(2, 2))
    with pytest.raises(harness.GridIncomplete, match="3 of the grid's 5 are missing"):
        harness.run_grid(CONFIG, runs, part, runs_subdir="g")
    assert trained == ["r1", "r3"]
    with pytest.raises(harness.GridIncomplete):  # part 2 again: nothing left to train
        harness.run_grid(CONFIG, runs, part, runs_subdir="g")
    assert trained == ["r1", "r3"]
    first = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, part=(1, 2))
    assert len(harness.run_grid(CONFIG, runs, first, runs_subdir="g")) == 5  # the last part
    assert trained == ["r1", "r3", "r0", "r2", "r4"]
    with pytest.raises(ValueError, match="1 <= i <= k"):
        harness.run_grid(CONFIG, [harness.Run("x", {"seed": 9})],
                         harness.Options(jobs=1, runs_dir=tmp_path, part=(3, 2)), runs_subdir="g")


def test_a_stop_signal_stops_the_whole_grid_not_only_its_run(monkeypatch, tmp_path):
    """SIGTERM / Ctrl-C during a run of an in-process grid stopped that run (saved), and the
    grid went on to train every other run: the signal is now the grid's stop too."""
    trained = []

    def stopped(config, workdir):  # the trainer's answer to a stop signal: saved, returned
        trained.append(workdir.name)
        return {"stopped_by": "SIGTERM", "step": 2}

    monkeypatch.setattr(harness, "_train", stopped)
    runs = [harness.Run(f"r{i}", {"seed": i}) for i in range(3)]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path)
    with pytest.raises(harness.GridIncomplete, match="did not reach their last step"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    assert trained == ["r0"]


def test_a_stop_signal_in_the_last_chunk_of_a_run_stops_the_grid(monkeypatch, tmp_path):
    """A signal in a run's last chunk lets that run finish (no "stopped_by"), and the grid went
    on to train every other run though the trainer had said it was stopping."""
    trained = []
    fake = _fake_train(trained)

    def finished_late(config, workdir):  # the trainer's answer: finished, the signal noted
        fake(config, workdir)
        return {"step": config.num_steps, "late_signal": "SIGINT"}

    monkeypatch.setattr(harness, "_train", finished_late)
    runs = [harness.Run(f"r{i}", {"seed": i}) for i in range(3)]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path)
    with pytest.raises(harness.GridIncomplete, match=r"runs \['r1', 'r2'\] did not reach"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")
    assert trained == ["r0"]


def test_a_part_stopped_by_a_signal_says_its_own_runs_are_left(monkeypatch, tmp_path):
    """A part whose run a signal stopped said it 'trained 2 runs' and that the missing runs
    were another part's, though its own stopped and untrained runs were among them."""
    monkeypatch.setattr(harness, "_train", lambda config, workdir: {"stopped_by": "SIGINT"})
    runs = [harness.Run(f"r{i}", {"seed": i}) for i in range(4)]
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path, part=(1, 2))
    with pytest.raises(harness.GridIncomplete,
                       match=r"runs \['r0', 'r2'\] did not reach their last step"):
        harness.run_grid(CONFIG, runs, opts, runs_subdir="g")


def _results_json(folder, name, commit, dirty=False):
    state = {"commit": commit, "dirty": dirty, "diff_sha256": "ab" if dirty else None}
    prov = {"writer": state, "runs": {"run_a": dict(state, seed=0)}}
    (folder / f"{name}.json").write_text(json.dumps({"run_a": {}, "_provenance": prov}))
    (folder / f"{name}.md").write_text(f"## {name}\n\nbody of {name}\n")


def _make_results(results_dir, *argv):
    from experiments import make_results

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        make_results.main(flags.FLAGS(["make_results", "--results_dir", str(results_dir), *argv]))


def test_make_results_refuses_a_section_page_without_its_results_file(tmp_path):
    from absl import app  # noqa: PLC0415

    results = tmp_path / "results"
    results.mkdir()
    _results_json(results, "table2", "a" * 40)
    (results / "hdee.md").write_text("## hdee\n\nnumbers of unknown provenance\n")
    with pytest.raises(app.UsageError, match=r"hdee\.md has no hdee\.json beside it"):
        _make_results(results)
    assert not (tmp_path / "RESULTS.md").exists()


def test_make_results_refuses_a_results_file_that_is_not_json(tmp_path):
    """A results json cut short (a run killed while it wrote) gave a JSONDecodeError traceback."""
    from noloco_jax.errors import UserError  # noqa: PLC0415

    results = tmp_path / "results"
    results.mkdir()
    (results / "table2.json").write_text('{"_provenance": ')
    with pytest.raises(UserError, match=r"--results_dir: .*table2\.json is not JSON"):
        _make_results(results)
    assert not (tmp_path / "RESULTS.md").exists()


def test_make_results_refuses_mixed_commits_unless_told(tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    _results_json(results, "table2", "a" * 40)
    _results_json(results, "sweeps", "a" * 40)
    _make_results(results)
    page = (tmp_path / "RESULTS.md").read_text()
    assert f"All results below come from commit `{'a' * 12}`" in page and "body of sweeps" in page
    _results_json(results, "sweeps", "b" * 40)
    with pytest.raises(SystemExit) as stop:
        _make_results(results)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "(2 version(s)" in err and "sweeps: run_a" in err and "--allow_mixed_commits" in err
    _make_results(results, "--allow_mixed_commits")
    page = (tmp_path / "RESULTS.md").read_text()
    assert "Code versions of these results" in page and f"`{'b' * 12}`: sweeps: (report)" in page
    _results_json(results, "sweeps", "a" * 40, dirty=True)  # one commit, but a dirty tree
    with pytest.raises(SystemExit):
        _make_results(results)
    (results / "sweeps.json").write_text('{"run_a": {}}')  # made before provenance existed
    with pytest.raises(SystemExit):
        _make_results(results)
    assert "unrecorded" in capsys.readouterr().err


def test_each_benchmark_section_says_which_code_measured_it(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _results_json(results, "table2", "a" * 40)
    env = {"commit": "1234abc", "jax": "0.10.2", "device": "cpu"}
    (results / "bench_overhead.json").write_text(json.dumps({"env": env, "rows": []}))
    (results / "bench_overhead.md").write_text("## overhead\n\nnumbers\n")
    (results / "bench_scaling.json").write_text(json.dumps({"rows": []}))  # before it was recorded
    (results / "bench_scaling.md").write_text("## scaling\n\nnumbers\n")
    _make_results(results)
    page = (tmp_path / "BENCHMARKS.md").read_text()
    assert "numbers\n_Code version: commit `1234abc`; jax 0.10.2, device cpu._" in page
    assert "numbers\n_Code version: not recorded (measured before the benchmarks" in page


def test_committed_pages_are_what_make_results_builds(tmp_path):
    """RESULTS.md and BENCHMARKS.md are built, never edited: rebuilding them from the committed
    experiments/results changes nothing (a section written only into a page would be lost)."""
    import shutil  # noqa: PLC0415

    from experiments import make_results  # noqa: PLC0415

    shutil.copytree(make_results.RESULTS, tmp_path / "results")
    _make_results(tmp_path / "results", "--allow_mixed_commits")
    for page in ("RESULTS.md", "BENCHMARKS.md"):
        built = (tmp_path / page).read_text()
        assert built == (make_results.HERE / page).read_text(), (
            f"experiments/{page} differs from what `python -m experiments.make_results` builds; "
            f"edit experiments/results/ and rebuild it")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from pydoc_data.topics import topics

    folder = tmp_path_factory.mktemp("corpus")
    for i, (_, text) in enumerate(sorted(topics.items())[:20]):
        (folder / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return folder


def _leaves(workdir, config):
    from noloco_jax.trainer import from_config
    from noloco_jax.trainer.loop import load_run

    _, params, _ = load_run(from_config(config), workdir)
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(params)]


@pytest.mark.slow  # two smoke trainings, compile-bound: 30 s idle, 220 s at load 10 (2 cores)
def test_same_seed_same_code_is_bit_identical(corpus, tmp_path):
    """Two smoke NoLoCo runs of one config, one after the other in this process: every logged
    number (but the timings) and every parameter bit agree."""
    over = {"method": "noloco", "num_replicas": 2, "seed": 1, "outer.seed": 1}
    runs = [harness.Run("first", over), harness.Run("second", over)]
    opts = harness.Options(smoke=True, jobs=1, runs_dir=tmp_path, out_dir=tmp_path,
                           data_path=str(corpus), data_dir=str(tmp_path / "data"))  # fmt: skip
    cfg = harness.load_config(CONFIG, {**over, **harness.smoke_overrides(),
                                       **harness.data_overrides(opts)})  # fmt: skip
    results = harness.run_grid(CONFIG, runs, opts, runs_subdir="det")

    def logged(run):
        return {kind: [{k: v for k, v in r.items() if k != "tokens_per_sec"} for r in run[kind]]
                for kind in ("train", "eval")}  # fmt: skip

    assert logged(results["first"]) == logged(results["second"])
    assert len(results["first"]["eval"]) >= 4
    a, b = (_leaves(tmp_path / "det_smoke" / name, cfg) for name in ("first", "second"))
    assert len(a) == len(b) > 0
    assert all(x.dtype == y.dtype and x.tobytes() == y.tobytes() for x, y in zip(a, b))


def test_part_flag_is_checked():
    from absl import app

    from experiments import options

    def parse(*argv):
        with flagsaver.flagsaver():
            flags.FLAGS.unparse_flags()
            flags.FLAGS(["experiments.table2", *argv])
            return options.grid_options()

    assert parse("--part", "2/3").part == (2, 3) and parse().part is None
    assert parse("--dry_run").dry_run
    for bad in ("3/2", "0/2", "x", "1/2/3"):
        with pytest.raises(app.UsageError, match="--part"):
            parse("--part", bad)


def test_report_only_of_a_smoke_json_without_run_info_says_so(tmp_path):
    """A smoke json whose runs lack run_info (saved before runs recorded it) was read with the
    full plan's H: table2's report died in a ValueError traceback ("only 0 evaluations fall on
    a multiple of 20"). The smoke version refuses it naming the run and the folder; the full
    version still reads it (make_results flags it)."""
    out = tmp_path / "out"
    out.mkdir()
    evals = [{"step": s, "val_ppl": 5.0} for s in range(0, 13, 2)]
    (out / "g.json").write_text(json.dumps({"a": {"train": [], "eval": evals}}))
    runs = [harness.Run("a", {"seed": 1})]
    smoke = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=out, report_only=True, smoke=True)
    with pytest.raises(errors.UserError, match=rf"run a saved in {re.escape(str(out))} have no "
                                               rf"run_info"):  # fmt: skip
        harness.run_grid(CONFIG, runs, smoke, runs_subdir="g")
    full = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=out, report_only=True)
    assert harness.run_grid(CONFIG, runs, full, runs_subdir="g")["a"]["eval"] == evals


def test_a_field_the_old_config_lacks_differs_unless_it_is_the_default():
    old = {"seed": 1, "fault": {}}  # recorded before fault.dropout_prob existed (default 0.0)
    assert provenance.config_differences(old, {"seed": 1, "fault": {"dropout_prob": 0.0}}) == {}
    diff = provenance.config_differences(old, {"seed": 1, "fault": {"dropout_prob": 0.25}})
    assert list(diff) == ["fault.dropout_prob"]  # the old run trained with no dropout
    assert diff["fault.dropout_prob"] == (provenance.ABSENT, 0.25)
    assert provenance.config_differences({**old, "gone": 1}, old) == {}  # an option removed


def test_report_only_refuses_saved_metrics_of_another_config(monkeypatch, tmp_path):
    monkeypatch.setattr(harness, "_train", _fake_train([]))
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out")
    runs = [harness.Run("a", {"seed": 1, "outer.gamma": 0.3})]
    harness.write_outputs(opts, "g", harness.run_grid(CONFIG, runs, opts, runs_subdir="g"), "md")
    again = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out", report_only=True)
    assert harness.run_grid(CONFIG, runs, again, runs_subdir="g")["a"]["eval"]  # same grid
    changed = [harness.Run("a", {"seed": 1, "outer.gamma": 0.5})]  # as run_grid would refuse
    with pytest.raises(ValueError, match=r"another config than this grid's \(outer.gamma: 0.3"):
        harness.run_grid(CONFIG, changed, again, runs_subdir="g")
    smoke = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path / "out",
                            report_only=True, smoke=True)  # fmt: skip
    with pytest.raises(ValueError, match="--smoke"):  # full-run numbers in a smoke report
        harness.run_grid(CONFIG, runs, smoke, runs_subdir="g")
