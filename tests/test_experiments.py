"""Each experiment script runs its --smoke version end to end and writes its outputs."""

import importlib
import json
import pathlib
import subprocess
import sys

import pytest
from pydoc_data.topics import topics

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    base = tmp_path_factory.mktemp("exp")
    corpus = base / "corpus"
    corpus.mkdir()
    for i, (_, text) in enumerate(sorted(topics.items())[:40]):
        (corpus / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    return base, corpus


def _run(script, dirs, monkeypatch, *extra):
    base, corpus = dirs
    argv = [f"{script}.py", "--smoke", "--jobs", "1", "--data-path", str(corpus),
            "--data-dir", str(base / "data"), "--runs-dir", str(base / "runs"),
            "--out-dir", str(base / "out"), *extra]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    importlib.import_module(script).main()
    out = base / "out"
    return json.loads((out / f"{script}.json").read_text()), (out / f"{script}.md").read_text()


def test_table2_smoke(dirs, monkeypatch):
    results, md = _run("table2", dirs, monkeypatch)
    assert {"dp_n2_s0", "diloco_n2_s1", "noloco_n2_s0"} <= set(results)
    assert "python experiments/table2.py --smoke" in md and "| N = 2 |" in md
    assert "paired by seed" in md
    assert (dirs[0] / "out" / "table2_fig3a.png").stat().st_size > 1000


def test_spread_vs_lr_smoke_reuses_table2_runs(dirs, monkeypatch):
    stats, md = _run("spread_vs_lr", dirs, monkeypatch)
    assert all(-1.0 <= v["pearson"] <= 1.0 for v in stats.values())
    assert "Pearson" in md


def test_sweeps_smoke(dirs, monkeypatch):
    results, md = _run("sweeps", dirs, monkeypatch)
    assert any(k.startswith("sweep_gamma_2.2") for k in results)
    assert "### gamma" in md and "outside" in md


def test_quadratic_theory_smoke(dirs, monkeypatch):
    results, md = _run("quadratic_theory", dirs, monkeypatch)
    verdicts = {(r["gamma"], r["bounded"]) for r in results["records"] if r["gamma"] is not None}
    assert (0.7, True) in verdicts and (2.2, False) in verdicts
    assert "spread / omega" in md


def test_plot_script_on_a_smoke_run(dirs, monkeypatch, tmp_path):
    import plot

    png = plot.plot_runs([dirs[0] / "runs" / "table2_smoke" / "noloco_n2_s0"], tmp_path / "c.png")
    assert png.stat().st_size > 1000


@pytest.mark.slow  # same harness as test_table2_smoke; ~30 s each
def test_routing_ablation_smoke(dirs, monkeypatch):
    results, md = _run("routing_ablation", dirs, monkeypatch)
    assert {"local_pp2_random_n2", "local_pp2_fixed_n2", "noloco_pp2_n2"} <= set(results)
    assert "weight std ratio" in md


@pytest.mark.slow  # same harness as test_table2_smoke; ~30 s each
def test_dropout_smoke(dirs, monkeypatch):
    results, md = _run("dropout", dirs, monkeypatch)
    assert "dropout_noloco_p0.3_n2" in results and "DiLoCo (wait)" in md


def test_skippipe_training_smoke(dirs, monkeypatch):
    results, md = _run("skippipe_training", dirs, monkeypatch)
    assert {"full", "skip50", "skip50_full10"} <= set(results)
    assert "50 % of stages" in md


def test_skippipe_schedules_smoke(tmp_path, capsys):
    import skippipe_schedules

    skippipe_schedules.main(["--smoke", "--out-dir", str(tmp_path)])
    wrote = f"wrote {tmp_path / 'skippipe_schedules.json'} and {tmp_path / 'skippipe_schedules.md'}"
    assert wrote in capsys.readouterr().out  # says what it wrote
    results = json.loads((tmp_path / "skippipe_schedules.json").read_text())
    assert set(results["training_iteration_times"]) == {"full", "skip25", "skip50"}
    assert all(v > 0 for v in results["training_iteration_times"].values())
    md = (tmp_path / "skippipe_schedules.md").read_text()
    assert "python experiments/skippipe_schedules.py --smoke" in md and "SkipPipe vs full" in md


@pytest.mark.slow  # 40 s to 2 min (CPU load): a few dozen small programs to compile (3 sizes x group shapes)
def test_hdee_smoke(tmp_path):
    import hdee

    hdee.main(["--smoke", "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "hdee.json").read_text())
    seed = results["seeds"]["0"] if "0" in results["seeds"] else results["seeds"][0]
    assert len(set(seed["compute"].values())) == 1  # equal compute, as accounted
    assert set(seed["ppl"]) == {"M_Ho-I_Ho", "M_Ho-I_He", "M_He-I_Ho"}
    md = (tmp_path / "hdee.md").read_text()
    assert "python experiments/hdee.py --smoke" in md and "heterogeneous lowest" in md


def test_reruns_write_to_experiments_runs_unless_published():
    import argparse

    import harness

    def parse(*argv):
        parser = argparse.ArgumentParser()
        harness.add_common_flags(parser)
        return parser.parse_args(list(argv))

    scratch = ROOT / "experiments" / "runs" / "results"
    assert parse().out_dir == scratch == harness.SCRATCH
    assert harness.figure_path(parse(), "x").parent == scratch
    published = parse("--publish")
    assert published.out_dir == ROOT / "experiments" / "results" and published.publish
    assert harness.figure_path(published, "x") == ROOT / "experiments" / "figures" / "x.png"
    assert parse("--publish", "--out-dir", "/tmp/o").out_dir == pathlib.Path("/tmp/o")
    import skippipe_schedules  # a script with its own parser

    assert skippipe_schedules._parse([]).out_dir == scratch


def test_untracked_outputs_are_git_ignored():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    outputs = ["experiments/runs/results/table2.json", "experiments/runs/results/sweeps.png",
               "runs/quick/metrics.jsonl", "curves.png", "runs/colab/tiny_noloco/metrics.jsonl"]
    out = subprocess.run(["git", "check-ignore", *outputs], cwd=ROOT, capture_output=True,
                         text=True)  # fmt: skip
    assert sorted(out.stdout.split()) == sorted(outputs), out.stdout
