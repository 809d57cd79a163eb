"""Each experiment script runs its --smoke version end to end and writes its outputs, and every
script of experiments/ starts as ``python -m experiments.NAME`` with working ``--help``."""

import importlib
import json
import math
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from absl.testing import flagsaver
from pydoc_data.topics import topics

from noloco_jax.experiments import harness
# Imported here, outside run_main's flagsaver: it imports array_record, which defines absl flags
# at import, and a flag defined inside a flagsaver is deleted when the context exits, so a later
# training run in the same worker failed with AttributeError (seen when xdist ordered it so).
from noloco_jax.data import sources  # noqa: F401
from tests.helpers import run_forked

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("exp")
    corpus = base / "corpus"
    corpus.mkdir()
    for i, (_, text) in enumerate(sorted(topics.items())[:40]):
        (corpus / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return base, corpus


def run_main(module, *argv):
    """``module.main`` as ``python -m`` runs it: the flags parsed from ``argv`` first."""
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        module.main(flags.FLAGS([module.__name__, *argv]))


def _run(script, dirs, *extra):
    base, corpus = dirs
    run_main(importlib.import_module(f"experiments.{script}"), "--smoke", "--jobs", "1",
             "--data_path", str(corpus), "--data_dir", str(base / "data"), "--runs_dir",
             str(base / "runs"), "--out_dir", str(base / "out"), *extra)  # fmt: skip
    out = base / "out"
    return json.loads((out / f"{script}.json").read_text()), (out / f"{script}.md").read_text()


def test_table2_smoke(dirs):
    results, md = _run("table2", dirs)
    assert {"dp_n2_s0", "diloco_n2_s1", "noloco_n2_s0", "diloco_h10_n2_s0"} <= set(results)
    assert "python -m experiments.table2 --smoke" in md and "| N = 2 |" in md
    assert "paired by seed" in md and "| N = 2 | noloco-diloco |" in md
    tests = results["_analysis"]["sizes"]["2"]["tests"]
    assert tests["noloco-diloco"]["n"] == 2 and tests["noloco-diloco_h10"]["n"] == 1
    assert results["noloco_n2_s0"]["run_info"]["seed"] == 0  # provenance of every run
    assert set(results["_provenance"]["runs"]) == {k for k in results if not k.startswith("_")}
    assert (dirs[0] / "out" / "table2_fig3a.png").stat().st_size > 1000
    assert "![Fig. 3A in miniature](table2_fig3a.png)" in md  # linked as ../figures/ before


def test_spread_vs_lr_smoke_reuses_table2_runs(dirs):
    stats, md = _run("spread_vs_lr", dirs)
    runs = {k: v for k, v in stats.items() if not k.startswith("_")}  # _provenance
    assert runs and all(-1.0 <= v["pearson"] <= 1.0 for v in runs.values())
    assert "partial r (lr \\| step)" in md and "mid-round" in md  # the header cell, escaped


def test_sweeps_smoke(dirs):
    results, md = _run("sweeps", dirs)
    assert any(k.startswith("sweep_gamma_2.2") for k in results)
    assert "### gamma" in md and "outside" in md


def test_quadratic_theory_smoke(dirs):
    results, md = _run("quadratic_theory", dirs)
    verdicts = {(r["gamma"], r["bounded"]) for r in results["records"] if r["gamma"] is not None}
    assert (0.7, True) in verdicts and (2.2, False) in verdicts
    assert "spread / omega" in md
    # the rule the page states is the one applied: the cap of 10 was applied but not stated
    assert "below 1.5x the second-quarter mean and below 10." in md


def test_quadratic_theory_bounded_rule():
    from experiments import quadratic_theory

    assert quadratic_theory.bounded(0.10, 0.14)  # below 1.5 x 0.10
    assert not quadratic_theory.bounded(0.10, 0.16)  # grew by more than half
    assert not quadratic_theory.bounded(20.0, 25.0)  # slow growth, but above 10
    assert not quadratic_theory.bounded(0.10, float("nan"))


def test_plot_script_on_a_smoke_run(dirs, tmp_path):
    from experiments import plot

    png = plot.plot_runs([dirs[0] / "runs" / "table2_smoke" / "noloco_n2_s0"], tmp_path / "c.png")
    assert png.stat().st_size > 1000


def test_plot_image_flags_expand_a_tilde_and_refuse_what_cannot_be_written(tmp_path, monkeypatch,
                                                                          capsys):  # fmt: skip
    """--out=~/c drew into a folder named '~' under the current directory and said 'wrote ~/c'
    (matplotlib wrote c.png); a folder as --out said 'wrote <folder>' and wrote <folder>.png; a
    file above it or a suffix matplotlib cannot write: a traceback after drawing."""
    from absl import app

    from experiments import plot

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(
        '{"kind": "train", "step": 1, "train_loss": 3.0, "train_loss_per_replica": [3.0, 3.1]}\n'
        '{"kind": "eval", "step": 1, "val_ppl": 9.0}\n')
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run_main(plot, "--out=~/c", "--replicas_png=~/r.svg", str(run))
    assert (tmp_path / "c.png").is_file() and (tmp_path / "r.svg").is_file()
    assert not (tmp_path / "~").exists()
    assert capsys.readouterr().out.split("\n")[0] == f"wrote {tmp_path / 'c.png'}"
    for bad in (str(run), str(run / "metrics.jsonl" / "c.png"), "c.bogus"):
        with pytest.raises(app.UsageError, match=f"--out={bad}: "):
            run_main(plot, f"--out={bad}", str(run))
    assert not (tmp_path / "run.png").exists()


@pytest.mark.slow  # same harness as test_table2_smoke; ~30 s each
def test_routing_ablation_smoke(dirs):
    results, md = _run("routing_ablation", dirs)
    assert {"local_pp2_random_n2_s1", "local_pp2_fixed_n2_s0", "noloco_pp2_n2"} <= set(results)
    assert "weight std ratio" in md and "2 paired seeds" in md
    assert results["_analysis"]["test_val_ppl"]["n"] == 2  # paired by seed


@pytest.mark.slow  # same harness as test_table2_smoke; ~30 s each
def test_dropout_smoke(dirs):
    results, md = _run("dropout", dirs)
    assert "dropout_noloco_p0.3_n2" in results and "DiLoCo (wait)" in md
    assert "dropout_diloco_resync_p0.3_n2" in results and "DiLoCo (skip, re-sync)" in md


def test_skippipe_training_smoke(dirs):
    results, md = _run("skippipe_training", dirs)
    assert {"full", "skip50", "skip50_full10"} <= set(results)
    assert "50 % of stages" in md
    analysis = results["_analysis"]
    assert set(analysis["robustness"]["skip50"]) >= {"full_model", "0.75", "0.5",
                                                     "normally_trained_full_model"}  # fmt: skip
    eq = analysis["equal_time"]["skip50"]  # the full pipeline with a schedule ending there
    assert eq["full_equal_time_steps"] < results["full"]["eval"][-1]["step"]
    assert "full_until_skip50" in results and "schedule ending there" in md
    # --report_only rewrites the report from the json alone (it read the checkpoints: a crash).
    shutil.rmtree(dirs[0] / "runs" / "skippipe_smoke")
    again, md_again = _run("skippipe_training", dirs, "--report_only")
    assert md_again == md and again["_analysis"] == analysis


def test_a_full_run_does_not_take_a_smoke_runs_simulated_times(tmp_path):
    from experiments import skippipe_training  # noqa: PLC0415

    (tmp_path / "skippipe_schedules.json").write_text(json.dumps({
        "command": "python -m experiments.skippipe_schedules --smoke",
        "training_iteration_times": {"full": 1.0}}))  # fmt: skip
    published = json.loads((harness.RESULTS / "skippipe_schedules.json").read_text())
    assert skippipe_training._iteration_times(tmp_path, smoke=False) == published[
        "training_iteration_times"]  # fmt: skip
    assert skippipe_training._iteration_times(tmp_path, smoke=True) == {"full": 1.0}


def test_skippipe_equal_time_full_runs_fit_in_the_skip_runs_time():
    from experiments import skippipe_training  # noqa: PLC0415

    # 600 steps, log chunks of 10: skip25 at 4.95 s of the full pipeline's 10 s per iteration
    # has 2970 s, 29.7 chunks of the full pipeline: 29 fit (290 steps, 2900 s), 30 overrun.
    times = {"full": 10.0, "skip25": 4.95, "skip50": 3.0}
    runs = skippipe_training.grid(False)
    steps = {r.name: r.pinned["num_steps"]
             for r in skippipe_training.equal_time_runs(runs, times, False)}  # fmt: skip
    # skip50_full10: (9 x 3 + 10) / 10 = 3.7 s -> 2220 s, 22.2 chunks -> 220 steps
    assert steps == {"full_until_skip25": 290, "full_until_skip50": 180,
                     "full_until_skip50_full10": 220}  # fmt: skip
    exact = skippipe_training.equal_time_runs(runs, {"full": 10.0, "skip25": 5.0}, False)
    assert exact[0].pinned["num_steps"] == 300  # a budget of exactly 30 chunks keeps all 30


@pytest.mark.slow  # two training processes next to the same two runs in this one (~1-2 min)
def test_parallel_jobs_train_the_same_runs_as_in_process(dirs, tmp_path):
    from noloco_jax.experiments import table2

    base, corpus = dirs
    runs = [r for r in table2.grid(True) if r.name in ("noloco_n2_s0", "dp_n2_s0")]

    def losses(jobs):
        opts = harness.Options(smoke=True, jobs=jobs, runs_dir=tmp_path / f"jobs{jobs}",
                               out_dir=tmp_path, data_path=str(corpus),
                               data_dir=str(base / "data"))  # fmt: skip
        results = harness.run_grid(table2.CONFIG, runs, opts, runs_subdir="table2")
        return {name: ([(r["step"], r["train_loss"]) for r in run["train"]],
                       [(r["step"], r["val_ppl"]) for r in run["eval"]])
                for name, run in results.items()}  # fmt: skip

    parallel = losses(2)
    assert (tmp_path / "jobs2" / "table2_smoke" / "dp_n2_s0.log").exists()
    assert parallel == losses(1)


def test_skippipe_schedules_smoke(tmp_path, capsys):
    from experiments import skippipe_schedules

    run_main(skippipe_schedules, "--smoke", "--out_dir", str(tmp_path))
    wrote = f"wrote {tmp_path / 'skippipe_schedules.json'} and {tmp_path / 'skippipe_schedules.md'}"
    assert wrote in capsys.readouterr().out  # says what it wrote
    results = json.loads((tmp_path / "skippipe_schedules.json").read_text())
    assert set(results["training_iteration_times"]) == {"full", "skip25", "skip50"}
    assert all(v > 0 for v in results["training_iteration_times"].values())
    md = (tmp_path / "skippipe_schedules.md").read_text()
    assert "python -m experiments.skippipe_schedules --smoke" in md and "SkipPipe vs full" in md


def test_skippipe_schedules_summary_std_over_seeds_is_the_sample_std():
    from experiments import skippipe_schedules

    def rec(length, kind, seed, span):
        return {"network": "net", "nodes": 18, "stages": 4, "path_length": length,
                "skip_pct": 0 if length == 4 else 25, "schedule": kind, "seed": seed,
                "makespan_s": span, "scheduler_s": 0.0}  # fmt: skip

    spans = {"full": [10.0, 12.0, 14.0], "skippipe": [5.0, 6.0]}
    records = [rec(4, "full", s, v) for s, v in enumerate(spans["full"])]
    records += [rec(3, "skippipe", s, v) for s, v in enumerate(spans["skippipe"])]
    (row,) = skippipe_schedules.summarise(records)
    # by hand: full mean 12, sum of squares 8 over n - 1 = 2 -> 2.0; skippipe 0.5 / 1 -> sqrt 0.5
    assert row["full"]["std_s"] == pytest.approx(2.0)
    assert row["skippipe"]["std_s"] == pytest.approx(0.5**0.5)
    assert row["skippipe"]["vs_full_pct"] == pytest.approx(100 * (5.5 / 12 - 1))
    (one,) = skippipe_schedules.summarise(records[:1] + records[3:4])
    assert one["full"]["std_s"] == 0.0  # one seed: no spread, not nan


def test_comm_quality_report_prints_a_small_p_as_it_is_not_as_zero():
    from experiments import comm_quality

    published = json.loads((harness.RESULTS / "comm_quality.json").read_text())
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["experiments.comm_quality"])
        md = comm_quality.report(published["_rows"], harness.Options())
    # NoLoCo tau = 5: p = 0.00048 read "0.000"; the other p's keep their three decimals
    assert "| noloco | tau5 | 11.7742 ± 0.0346 | +0.4212 vs f32 | 0.0005 | 0/3 |" in md
    assert "| diloco | P2 | 11.1969 ± 0.0185 | +0.1867 vs f32 | 0.002 | 0/3 |" in md
    assert comm_quality.p_text(0.0004) == "0.0004" and comm_quality.p_text(0.0296) == "0.030"


def test_hdee_report_prints_a_small_chance_probability_as_it_is_not_as_zero():
    from experiments import hdee

    published = json.loads((harness.RESULTS / "hdee.json").read_text())
    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["experiments.hdee"])
        md = hdee.report(published, hdee._settings(False), harness.Options())
    # 17 of 17 by chance: (2/3)^17 = 0.00101; it read "P = 0.00"
    assert "even a clean sweep would have P = 0.001." in md
    # the page's other chance probabilities keep their two decimals: 16 / 17 is 0.0096
    assert "| log_average | all | 16 / 17 | 0.01 |" in md and "(P = 0.28)" in md
    assert hdee.chance_p(0.0044) == "0.004" and hdee.chance_p(0.005) == "0.01"
    # The saved json's keys are sorted: --report_only listed the domains alphabetically,
    # training and held-out mixed, and the ensembles' compute in another order than the page.
    page = (harness.RESULTS / "hdee.md").read_text().splitlines()
    changed = [(a, b) for a, b in zip(page, md.splitlines()) if a != b]
    assert len(page) == len(md.splitlines()) and len(changed) == 1
    assert "sweep would have P = 0.00." in changed[0][0]  # the one line the P fix changes


def test_hdee_report_only_of_a_json_without_runs_names_it(tmp_path):
    """--report_only of an hdee.json holding no seed's runs died in a KeyError traceback
    ('difficulty', or 'zlib'); it is a UserError naming the file (the CLI exits 2)."""
    from experiments import hdee
    from noloco_jax.errors import UserError  # noqa: PLC0415

    path = tmp_path / "hdee.json"
    for saved in ({}, {"difficulty": {}, "seeds": {}}, []):
        path.write_text(json.dumps(saved))
        with pytest.raises(UserError, match=f"--report_only: {re.escape(str(path))} holds no "):
            run_main(hdee, "--smoke", "--report_only", "--out_dir", str(tmp_path))
    assert not (tmp_path / "hdee.md").exists()


@pytest.mark.slow  # 40 s to 2 min (CPU load): a few dozen small programs to compile (3 sizes x group shapes)
def test_hdee_smoke(tmp_path):
    from experiments import hdee

    run_main(hdee, "--smoke", "--out_dir", str(tmp_path))
    results = json.loads((tmp_path / "hdee.json").read_text())
    seed = results["seeds"]["0"] if "0" in results["seeds"] else results["seeds"][0]
    assert len(set(seed["compute"].values())) == 1  # equal compute, as accounted
    assert set(seed["ppl"]) == {"M_Ho-I_Ho", "M_Ho-I_He", "M_He-I_Ho"}
    md = (tmp_path / "hdee.md").read_text()
    assert "python -m experiments.hdee --smoke" in md and "heterogeneous lowest" in md
    # --report_only without --smoke wrote "T = 150 steps, delta = 75, 16 x 64 tokens" above
    # the smoke run's numbers (and recorded those settings as the json's config).
    from noloco_jax.errors import UserError  # noqa: PLC0415

    with pytest.raises(UserError, match="steps: 4 -> 150"):
        run_main(hdee, "--report_only", "--out_dir", str(tmp_path))
    assert (tmp_path / "hdee.md").read_text() == md
    run_main(hdee, "--smoke", "--report_only", "--out_dir", str(tmp_path))
    assert "T = 4 steps" in (tmp_path / "hdee.md").read_text()


def test_reruns_write_to_experiments_runs_unless_published(tmp_path, monkeypatch):
    from experiments import options

    def parse(*argv):
        with flagsaver.flagsaver():
            flags.FLAGS.unparse_flags()
            flags.FLAGS(["experiments.table2", *argv])
            return options.grid_options()

    scratch = ROOT / "experiments" / "runs" / "results"
    assert parse().out_dir == scratch == harness.SCRATCH
    assert harness.figure_path(parse(), "x").parent == scratch
    published = parse("--publish")
    assert published.out_dir == ROOT / "experiments" / "results"
    assert harness.figure_path(published, "x") == ROOT / "experiments" / "figures" / "x.png"
    assert parse("--publish", "--out_dir", "/tmp/o").out_dir == pathlib.Path("/tmp/o")
    assert parse("--out_dir=/tmp/o", "--publish").out_dir == pathlib.Path("/tmp/o")  # any order
    assert parse("--runs_dir", "/tmp/r", "--jobs=1").runs_dir == pathlib.Path("/tmp/r")
    old = parse("--out-dir", "/tmp/o", "--runs-dir=/tmp/r", "--data-path", "d", "--report-only")
    assert (old.out_dir, old.runs_dir, old.data_path, old.report_only) == (
        pathlib.Path("/tmp/o"), pathlib.Path("/tmp/r"), "d", True)  # the argparse spellings
    # --data_path is read as the trainer reads it: ~ and ** globs (both were refused)
    (tmp_path / "texts" / "deep").mkdir(parents=True)
    (tmp_path / "texts" / "deep" / "a.txt").write_text("text")
    monkeypatch.setenv("HOME", str(tmp_path))
    for given in ("~/texts", f"{tmp_path}/texts/**/*.txt"):
        assert parse(f"--data_path={given}").data_path == given


def test_untracked_outputs_are_git_ignored():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = ["experiments/runs/results/table2.json", "experiments/runs/results/sweeps.png",
               "runs/quick/metrics.jsonl", "curves.png", "runs/colab/tiny_noloco/metrics.jsonl"]
    out = subprocess.run(["git", "check-ignore", *outputs], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert sorted(out.stdout.split()) == sorted(outputs), out.stdout


# ---------------------------------------------------------------- python -m and --help

SCRIPTS = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for folder in (ROOT / "experiments", ROOT / "experiments" / "bench")
    for p in folder.glob("*.py")
    # the package and its shared helpers (memory_flags: two benchmarks' flags)
    if p.stem not in ("__init__", "options", "common", "memory_flags")
)

# Imports every script in one interpreter (the imports of JAX and TensorFlow are paid once),
# each as if alone: its flags are removed before the next, since two scripts may define one
# name differently (--replicas is a count in demo, a list in comm_volume).
_EACH_ALONE = r"""
import importlib, json, sys
from absl import app, flags, logging

before = set(flags.FLAGS)
found = {}
for name in sys.argv[1:]:
    module = importlib.import_module(name)
    found[name] = {"main": callable(getattr(module, "main", None)), "doc": module.__doc__ or "",
                   "help": flags.FLAGS.module_help(module),
                   "flags": [f.name for f in flags.FLAGS.get_key_flags_for_module(module)]}
    for flag in set(flags.FLAGS) - before:
        delattr(flags.FLAGS, flag)
    for loaded in [m for m in sys.modules if m.split(".")[0] == "experiments"]:
        del sys.modules[loaded]
print(json.dumps(found))
"""


def test_every_script_is_a_module_with_main_usage_and_flags(user_error_runs):
    assert len(SCRIPTS) >= 20 and "experiments.bench.overhead" in SCRIPTS
    code, stderr, stdout = user_error_runs[_AT["each_alone"]]  # python -c _EACH_ALONE *SCRIPTS
    assert code == 0, stderr[-3000:]
    found = json.loads(stdout.splitlines()[-1])
    assert sorted(found) == SCRIPTS
    for name, script in found.items():
        assert script["main"], name
        assert f"python -m {name}" in script["doc"], name  # the usage line --help prints
        for flag in script["flags"]:
            shown = f"--{flag}:" in script["help"] or f"--[no]{flag}:" in script["help"]
            assert shown, (name, flag)


HELP = [("experiments.table2", "--helpshort"), ("experiments.bench.compile_scale", "--helpshort"),
        ("experiments.plot", "-h")]  # "unknown flag 'h'"


@pytest.mark.parametrize("script,ask", HELP)
def test_help_through_python_m(script, ask, user_error_runs):
    """The first through a real ``python -m``; the others in the forked runner (runpy, as the
    user errors below), which spares them an interpreter's imports of JAX each."""
    if (script, ask) == HELP[0]:
        proc = subprocess.run([sys.executable, "-m", script, ask], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        code, stderr, stdout = proc.returncode, proc.stderr, proc.stdout
    else:
        code, stderr, stdout = user_error_runs[len(USER_ERRORS) + HELP.index((script, ask)) - 1]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert code == 0, code  # absl's own exit status after help is 1
    assert f"python -m {script}" in stdout  # the module's usage, then its flags
    shown = {"experiments.table2": ["--jobs:", "--[no]smoke:", "--out_dir:"],
             "experiments.bench.compile_scale": ["--[no]shard_map:", "--[no]smoke:", "--ns:"],
             "experiments.plot": ["--replicas_png:", "--out:"]}[script]  # fmt: skip
    assert all(flag in stdout for flag in shown), stdout


USER_ERRORS = [
    ("experiments.plot", [], "plot: error: name at least one run's workdir"),  # UsageError
    ("experiments.hdee_stability", ["--nope"], "hdee_stability: error: Unknown command line "
     "flag 'nope'"),  # a flag absl refuses
    ("experiments.hdee_stability", ["--before=/no/such.json"],
     "hdee_stability: error: --before: no file '/no/such.json'"),  # a UserError
    ("experiments.bench.throughput", ["--case=small,8"], "throughput: error: --case='small,8': "
     "expected preset,batch,seq_len,steps,reps"),
    ("experiments.dropout", ["--report_only", "--out_dir=/nonexistent_results"],
     "dropout: error: --report_only: no saved metrics for"),  # was a FileNotFoundError traceback
    # Each of these ran, wrote files or lost data; or printed a traceback:
    ("experiments.demo", ["--dry_run"], "demo: error: --dry_run: this script does not read it"),
    ("experiments.demo", ["--replicas=3"], "demo: error: flag --replicas=3: must be even"),
    ("experiments.hdee", ["--smoke", "--dry_run"], "hdee: error: --dry_run: this script does "
     "not read it"),  # it trained for 37 s and wrote its report
    ("experiments.network_model", ["--replicas=0"], "network_model: error: --replicas apply "
     "only to a sync report"),  # the whole experiment ran, the flag ignored
    ("experiments.make_results", ["--results_dir=/nope"], "make_results: error: "
     "--results_dir=/nope: no experiment results"),  # wrote "Not yet run" pages into /
    ("experiments.bench.comm_volume", ["--sections=bogus"], "comm_volume: error: flag "
     "--sections=['bogus']: takes replicas and/or split"),  # wrote an empty table
    ("experiments.bench.routing_compile", ["--reps=0"], "routing_compile: error: flag --reps=0"),
    ("experiments.bench.comm_volume", ["--smoke", "--replicas=64"], "comm_volume: error: "
     "--replicas: --smoke sets its own"),  # the flag was silently replaced
    ("experiments.pilot_cost", ["--smoke", "--presets=small"], "pilot_cost: error: --presets: "
     "--smoke sets its own"),
    ("experiments.bench.gpu", ["--smoke", "--batch=4", "--reps=2"], "gpu: error: --batch "
     "--reps: --smoke sets its own"),  # ignored, yet shown in the page's command
    ("experiments.bench.diloco_exchange", ["--smoke", "--replicas=8"], "diloco_exchange: error: "
     "--replicas: --smoke sets its own"),
    ("experiments.bench.sharded_memory", ["--devices=0"], "sharded_memory: error: flag "
     "--devices=0"),  # a RuntimeError traceback from the CPU backend
    ("experiments.pilot_cost", ["--lengths=a,b"], "pilot_cost: error: flag --lengths=['a', "
     "'b']: takes two different step counts above the plan's warmup of 80 steps"),
    ("experiments.pilot_cost", ["--lengths=50,102"], "pilot_cost: error: flag --lengths=['50', "
     "'102']: takes two different step counts above the plan's warmup of 80 steps and "
     "multiples of its log_every=5"),  # failed on config.optim.warmup_steps, never set
    ("experiments.pilot_cost", ["--lengths=100,0100"], "pilot_cost: error: flag --lengths=['100', "
     "'0100']: takes two different step counts"),  # both timed, then a ZeroDivisionError
    ("experiments.plot", ["/nope/run"], "plot: error: /nope/run: not a run's workdir"),
    ("experiments.table2", ["--data_path=/nope"], "table2: error: --data_path=/nope: no such "
     "file"),  # every run failed with a traceback
    ("experiments.fig3b_review", ["--table2=/nope.json"], "fig3b_review: error: --table2: no "
     "file '/nope.json'"),
    ("experiments.hdee_stability", ["--before=README.md"], "hdee_stability: error: --before: "
     "README.md is not JSON"),
    ("experiments.table2", ["--smoke", "--runs_dir=README.md"], "table2: error: "
     "--runs_dir=README.md: README.md is a file, not a folder"),  # a traceback after the runs
    ("experiments.quadratic_theory", ["--smoke", "--out_dir=README.md/x"], "quadratic_theory: "
     "error: --out_dir=README.md/x: README.md is a file, not a folder"),
    ("experiments.streaming_netsim", ["--smoke", "--out_dir=README.md"], "streaming_netsim: "
     "error: --out_dir=README.md: README.md is a file, not a folder"),
    ("experiments.hdee_stability", ["--before=experiments/results/table2.json"],  # KeyError
     "hdee_stability: error: --before: experiments/results/table2.json is not an hdee.json"),
    ("experiments.fig3b_review", ["--table2=experiments/results/hdee.json"], "fig3b_review: "
     "error: --table2: experiments/results/hdee.json has no NoLoCo runs"),  # ValueError
    ("experiments.bench.compile_scale", ["--smoke", "--baseline=experiments/results/"
     "bench_comm_volume.json"], "compile_scale: error: --baseline: experiments/results/"
     "bench_comm_volume.json is not a results json of this script"),  # KeyError after compiling
    ("experiments.network_model", ["--smoke", "--seed=-1"], "network_model: error: flag "
     "--seed=-1"),  # a NumPy ValueError traceback
    ("experiments.network_model", ["--smoke", "--fig_dir=README.md"], "network_model: error: "
     "--fig_dir=README.md: README.md is a file, not a folder"),  # a FileExistsError traceback
]


_PUBLISH = ("from absl import flags\nfrom experiments import options\n"
            "for name in options.OUT_FLAGS:\n    flags.declare_key_flag(name)\n"
            "flags.FLAGS(['prog', '--smoke', '--publish'])\noptions._check_shared_flags()\n")


def test_smoke_with_publish_is_refused_before_any_script_runs(user_error_runs):
    """It overwrote experiments/results/network_model.* and two figures with smoke numbers.
    Checked on the flags alone (a process of its own, so no script's flags stay in this one,
    and no script's main runs: a regression cannot overwrite the published pages)."""
    code, stderr, _ = user_error_runs[_AT["publish"]]  # python -c _PUBLISH, a forked child
    assert code != 0 and "--smoke with --publish would overwrite" in stderr


# HOME is the folder given: the child's own environment, as a shell would set it.
_TILDE = ("import os, sys\nos.environ['HOME'] = sys.argv[1]\n"
          "from absl import flags\nfrom experiments import options\n"
          "flags.FLAGS(['prog', '--out_dir=~/pages', '--runs_dir=~/runs'])\n"
          "print(options.out_dir(), options.grid_options().runs_dir)\n")


def test_out_and_runs_dirs_expand_a_tilde(user_error_runs, tilde_home):
    """--out_dir=~/pages: no shell expands a tilde after '=', so the pages went into a folder
    named '~' under the current directory (as --workdir did before 6018be7)."""
    code, stderr, stdout = user_error_runs[_AT["tilde"]]  # python -c _TILDE HOME, forked
    assert code == 0, stderr
    assert stdout.split() == [str(tilde_home / "pages"), str(tilde_home / "runs")]


_COMMANDS = """
import json, sys
from absl import flags
from experiments import options
import experiments.bench.compile_scale, experiments.bench.comm_volume
flags.FLAGS(['prog', *json.loads(sys.argv[1])])
print(json.dumps([options.command('experiments.bench.compile_scale'),
                  options.command('experiments.table2'),
                  options.command('experiments.bench.comm_volume', values={'sections': 'split'})]))
"""


COMMAND_ARGV = ["--ns=8,16", "--label=new code", "--shard-map", "--smoke", "--out_dir=/tmp/mine",
                "--runs_dir=/tmp/runs", "--data_dir=/tmp/tfds", "--jobs=1", "--part=1/2",
                "--dry_run", "--report_only", "--verbosity=1", "--no_traffic=false",
                "--data_path=my corpus", "--splits=2x2", "--replicas=8,16,32,64"]  # fmt: skip


def test_report_command_keeps_result_flags_and_leaves_out_where_to_write(user_error_runs):
    """A report's command carried --smoke only: a page made with --ns or --replicas showed a
    command that makes another table. Now every flag given that changes the numbers, as
    --name=value, --smoke first then by name; flags that say where to write or how to spread
    the runs stay out (no machine's paths on the published pages), as do defaults given."""
    # python -c _COMMANDS COMMAND_ARGV, in a forked child (user_error_runs)
    code, stderr, stdout = user_error_runs[_AT["commands"]]
    assert code == 0, stderr[-3000:]
    scale, table2, split = json.loads(stdout.strip().splitlines()[-1])
    rest = "--splits=2x2"  # the flags of every script this process imported
    assert scale == ("python -m experiments.bench.compile_scale --smoke --data_path='my corpus' "
                     f"--label='new code' --ns=8,16 --shard_map {rest}")
    assert table2.startswith("python -m experiments.table2 --smoke --data_path='my corpus' ")
    assert split.endswith("--sections=split --shard_map --splits=2x2")
    for command in (scale, table2, split):
        assert "/tmp" not in command and "jobs" not in command and "part" not in command


@pytest.fixture(scope="module")
def tilde_home(tmp_path_factory):
    """The HOME of test_out_and_runs_dirs_expand_a_tilde's child."""
    return tmp_path_factory.mktemp("home")


# The cases of user_error_runs after USER_ERRORS and HELP[1:], by name: the tests of this file
# that run a command of their own in a fresh process (python -m, or python -c some code).
_OWN = ("publish", "tilde", "commands", "fig3b_review", "each_alone")
_AT = {name: len(USER_ERRORS) + len(HELP) - 1 + i for i, name in enumerate(_OWN)}


@pytest.fixture(scope="module")
def user_error_runs(tilde_home):
    """[exit status, stderr, stdout] of each case of USER_ERRORS, then of HELP[1:], then of
    the commands of ``_AT``, each in a child forked from one process that imported JAX once
    (``helpers.run_forked``)."""
    cases = [[script, args] for script, args, _ in USER_ERRORS]
    cases += [[script, [ask]] for script, ask in HELP[1:]]
    cases += [["-c", [_PUBLISH]], ["-c", [_TILDE, str(tilde_home)]],  # in the order of _OWN
              ["-c", [_COMMANDS, json.dumps(COMMAND_ARGV)]], ["experiments.fig3b_review", []],
              ["-c", [_EACH_ALONE, *SCRIPTS]]]
    return run_forked(cases, ROOT, timeout=300)


@pytest.mark.parametrize("case", range(len(USER_ERRORS)),
                         ids=[f"{s}-{' '.join(a)}" for s, a, _ in USER_ERRORS])  # fmt: skip
def test_user_errors_print_two_lines_and_exit_2(case, user_error_runs):
    script, _, says = USER_ERRORS[case]
    code, stderr, _ = user_error_runs[case]
    assert code == 2, stderr[-3000:]
    last = stderr.strip().splitlines()[-2:]
    assert last[0].startswith(says), stderr[-3000:]
    assert last[1] == f"(python -m {script} --help lists the flags.)"
    assert "Traceback" not in stderr and "flags:" not in stderr, stderr[-3000:]


def test_a_diverged_run_of_a_grid_is_named_in_a_line_and_exits_1(monkeypatch, tmp_path, capsys):
    """It was a traceback (as for a bug) that did not say which run of the grid diverged."""
    from experiments import options  # noqa: PLC0415
    from noloco_jax.errors import TrainingDivergedError  # noqa: PLC0415

    def diverged(config, workdir):
        raise TrainingDivergedError("training diverged: the weights are non-finite")

    monkeypatch.setattr(harness, "_train", diverged)
    opts = harness.Options(jobs=1, runs_dir=tmp_path, out_dir=tmp_path)
    runs = [harness.Run("ok", {"seed": 0})]

    def main(argv):
        harness.run_grid(ROOT / "configs" / "exp_table2.py", runs, opts, runs_subdir="g")

    with flagsaver.flagsaver():
        flags.FLAGS.unparse_flags()
        flags.FLAGS(["x"])
        with pytest.raises(SystemExit) as stop:
            options._reporting(main)(["x"])
    assert stop.value.code == 1
    assert "error: run ok: training diverged" in capsys.readouterr().err


def test_every_script_runs_main_through_options_run():
    for name in SCRIPTS:
        source = (ROOT / (name.replace(".", "/") + ".py")).read_text()
        assert "options.run(main)" in source and "app.run(" not in source, name


def test_comm_quality_metric_and_paired_test_by_hand():
    from experiments import comm_quality  # noqa: PLC0415

    evals = [{"step": s, "val_ppl": v} for s, v in [(50, 9.0), (100, 8.0), (150, 7.5),
                                                       (200, 7.0), (250, 6.5), (300, 6.0)]]
    assert comm_quality.sync_metric(evals, 20) == pytest.approx((8.0 + 7.0 + 6.0) / 3)
    assert math.isnan(comm_quality.sync_metric(evals[:3], 20))  # one sync-step eval only
    got = comm_quality.paired(np.array([5.0, 6.0, 7.5]), np.array([5.5, 6.0, 8.0]))
    # differences -0.5, 0, -0.5: mean -1/3, sd 0.2887, t = -2.0 with 2 dof -> p = 0.1835
    assert got["diff"] == pytest.approx(-1 / 3) and got["better"] == 2 and got["n"] == 3
    assert got["p"] == pytest.approx(0.18350, abs=1e-4)


def test_comm_quality_compares_each_option_with_its_own_baseline():
    """The 4-block fragment runs are paired with the 4-block P = 1 run, the rest with f32."""
    from experiments import comm_quality as cq  # noqa: PLC0415

    offset = {"f32": 0.0, "L4_P1": -1.0, "L4_P4": -0.5}  # L4_P4 is 0.5 worse than L4_P1
    results = {cq.run_name(m, o, s): {"eval": [{"step": t, "val_ppl": 10.0 + s
                                                + offset.get(o, 0.25)} for t in (100, 200, 300)]}
               for m in cq.METHODS for o in cq.OPTIONS for s in cq.SEEDS}  # fmt: skip
    rows = {(r["method"], r["option"]): r for r in cq.summarise(results, smoke=False)}
    assert rows["noloco", "L4_P4"]["baseline"] == "L4_P1"
    assert rows["noloco", "L4_P4"]["diff"] == pytest.approx(0.5)
    assert rows["diloco", "tau5"]["baseline"] == "f32"
    assert rows["diloco", "tau5"]["diff"] == pytest.approx(0.25)
    assert "diff" not in rows["noloco", "L4_P1"] and "diff" not in rows["noloco", "f32"]


@pytest.mark.slow  # 8 smoke runs (~2 min)
def test_comm_quality_smoke(dirs):
    _, md = _run("comm_quality", dirs)
    assert "python -m experiments.comm_quality --smoke" in md and "int8_ef" in md


@pytest.mark.slow  # two training processes (~30 s); --smoke was accepted and ignored (2000-step runs)
def test_pilot_cost_smoke(tmp_path):
    _script("pilot_cost", "--smoke", "--out_dir", str(tmp_path))
    results = json.loads((tmp_path / "pilot_cost.json").read_text())
    assert [t["steps"] for t in results["timed"]] == [10, 20]
    assert {"fixed_s", "per_step_s"} <= set(results["fits"]["nano"])
    assert "python -m experiments.pilot_cost --smoke" in (tmp_path / "pilot_cost.md").read_text()


def test_fig3b_review_reads_the_published_table2_runs(user_error_runs):
    code, stderr, out = user_error_runs[_AT["fig3b_review"]]  # its own process (forked):
    assert code == 0, stderr[-3000:]  # scripts may share flag names
    assert "| noloco_n8_s0 | 38 |" in out and "13 NoLoCo runs: partial r" in out


def _script(name, *argv):
    done = subprocess.run([sys.executable, "-m", f"experiments.{name}", *argv],
                          capture_output=True, text=True, timeout=600,
                          cwd=pathlib.Path(__file__).resolve().parents[1])  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout



def test_readme_plan_cost_is_the_pilot_fit_and_the_grids():
    """experiments/README.md section 10 gave dropout's 4 runs as 0.35 h; the pilot's fit gives
    0.34 h. The launch commands' run counts are the grids' (new runs only)."""
    from experiments import dropout, sweeps, table2  # noqa: PLC0415
    from noloco_jax.experiments import plan  # noqa: PLC0415

    readme = " ".join((ROOT / "experiments" / "README.md").read_text(encoding="utf-8").split())
    fit = json.loads((ROOT / "experiments" / "results" / "pilot_cost.json").read_text())
    nano = fit["fits"]["nano"]
    run_h = (nano["fixed_s"] + plan.REGIME["num_steps"] * nano["per_step_s"]) / 3600
    for name, runs, digits in (("table2", 42, 1), ("sweeps", 24, 1), ("dropout", 4, 2)):
        assert f"{name} {runs} runs, {runs * run_h:.{digits}f} h" in readme, name
    assert f"measured as above: {70 * run_h:.1f} h" in readme
    seen: set[str] = set()
    for module in (table2, sweeps, dropout):  # "# 42 runs", "# 24 more", "# 6 more"
        new = {r.name for r in module.grid(False)} - seen
        seen |= new
        name = module.__name__.split(".")[-1]
        assert f"experiments.{name} --jobs 2 --publish # {len(new)} " in readme, name
