"""Shared machinery for experiment scripts: run a grid of training runs, collect metrics.

Each run is a config file plus dotted overrides, trained into its own workdir
under ``--runs-dir``. A run whose workdir already holds its final checkpoint is
not trained again, so an interrupted experiment resumes where it stopped (and
runs shared by two experiments are trained once). ``jobs > 1`` trains runs in
parallel as ``noloco-train`` subprocesses; ``jobs == 1`` trains in-process.

Outputs: a re-run writes its report and figures to ``experiments/runs/results``
(git-ignored) and says where; ``--publish`` writes the tracked
``experiments/results`` and ``experiments/figures`` instead.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.util
import json
import os
import pathlib
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (configs/, experiments/)
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RESULTS = ROOT / "experiments" / "results"  # published (tracked): --publish
FIGURES = ROOT / "experiments" / "figures"
SCRATCH = ROOT / "experiments" / "runs" / "results"  # default for re-runs (git-ignored)

__all__ = ["ROOT", "RESULTS", "FIGURES", "SCRATCH", "Run", "add_common_flags", "add_out_flags",
           "smoke_overrides", "data_overrides", "load_config", "run_grid", "read_run",
           "write_outputs", "figure_path", "save_figure", "md_table"]  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: a name (its workdir) and config overrides."""

    name: str
    overrides: dict[str, Any]


class _Publish(argparse.Action):
    """``--publish``: write the tracked results (``--out-dir`` given later still wins)."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        namespace.out_dir = RESULTS
        namespace.publish = True


def add_out_flags(parser: argparse.ArgumentParser, default: pathlib.Path = SCRATCH) -> None:
    """``--out-dir`` (default: ``experiments/runs/results``, git-ignored) and ``--publish``."""
    parser.add_argument("--out-dir", type=pathlib.Path, default=default,
                        help=f"where results go (default {default.relative_to(ROOT)})")
    parser.add_argument("--publish", nargs=0, action=_Publish, default=False,
                        help="write the tracked experiments/results and experiments/figures")


def add_common_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--smoke", action="store_true", help="seconds-long version for tests")
    parser.add_argument("--jobs", type=int, default=2, help="runs trained in parallel")
    parser.add_argument("--runs-dir", type=pathlib.Path, default=ROOT / "experiments" / "runs")
    add_out_flags(parser)
    parser.add_argument("--data-path", default="", help="local text files instead of Shakespeare")
    parser.add_argument("--data-dir", default="", help="TFDS data dir and caches")
    parser.add_argument("--report-only", action="store_true",
                        help="re-write the report from <out-dir>/<name>.json, train nothing")


def smoke_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """A seconds-long version of any run: nano model, a few steps."""
    over = {
        "model.preset": "nano", "num_steps": 8, "log_every": 2, "eval_every": 4,
        "checkpoint_every": 8, "global_batch_size": 8, "data.seq_len": 32,
        "data.eval_windows": 4, "optim.warmup_steps": 1, "backend": "vmap",
        "outer.sync_every": 2,
    }  # fmt: skip
    return over


def data_overrides(args: argparse.Namespace) -> dict[str, Any]:
    over: dict[str, Any] = {}
    if args.data_path:
        over.update({"data.source": "files", "data.path": args.data_path})
    if args.data_dir:
        over["data.data_dir"] = args.data_dir
    return over


def load_config(path: pathlib.Path, overrides: dict[str, Any]):
    """The config file's ``get_config()`` with dotted overrides (``{"outer.sync_every": 10}``).

    Overrides go through ml_collections' own ``update_from_flattened_dict`` on the locked
    config, the same type rules as ``--config.<field>=<value>`` on the CLI: a misspelt field
    is a ``KeyError``, a value of the wrong type a ``TypeError``.
    """
    spec = importlib.util.spec_from_file_location(f"_exp_cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    cfg.lock()
    cfg.update_from_flattened_dict(dict(overrides))
    cfg.unlock()
    return cfg


def _done(workdir: pathlib.Path, num_steps: int) -> bool:
    ckpt = workdir / "checkpoints" / str(num_steps)
    return ckpt.is_dir() and (workdir / "metrics.jsonl").exists()


def _cli(config: pathlib.Path, workdir: pathlib.Path, overrides: dict[str, Any]) -> list[str]:
    cmd = [sys.executable, "-m", "noloco_jax.train", f"--config={config}", f"--workdir={workdir}",
           "--noprogress"]  # fmt: skip
    return cmd + [f"--config.{k}={v}" for k, v in overrides.items()]


def _train_one(config: pathlib.Path, workdir: pathlib.Path, overrides: dict[str, Any],
               in_process: bool) -> None:  # fmt: skip
    if in_process:
        from noloco_jax.trainer import from_config  # noqa: PLC0415
        from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

        train_and_evaluate(from_config(load_config(config, overrides)), workdir, progress=False)
        return
    log = workdir.parent / f"{workdir.name}.log"
    workdir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    with open(log, "w") as f:
        proc = subprocess.run(_cli(config, workdir, overrides), stdout=f, stderr=subprocess.STDOUT,
                              env=env, cwd=ROOT)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"run {workdir.name} failed; see {log}")


def _saved_metrics(out_dir: pathlib.Path, names: list[str], runs: list[Run]) -> dict:
    """The runs' metrics from earlier reports (``<out_dir>/<name>.json``, first match wins)."""
    found: dict[str, Any] = {}
    for name in names:
        path = out_dir / f"{name}.json"
        if path.exists():
            saved = json.loads(path.read_text())
            found.update({r.name: saved[r.name] for r in runs
                          if r.name not in found and isinstance(saved.get(r.name), dict)
                          and "eval" in saved[r.name]})  # fmt: skip
    missing = sorted({r.name for r in runs} - set(found))
    if missing:
        raise FileNotFoundError(
            f"--report-only: no saved metrics for {missing} in {out_dir} ({', '.join(names)}.json)."
        )
    return found


def run_grid(
    config: pathlib.Path,
    runs: list[Run],
    args: argparse.Namespace,
    *,
    runs_subdir: str,
    name: str | None = None,
) -> dict[str, dict[str, list[dict]]]:
    """Trains every run not yet finished; returns {name: {"train": [...], "eval": [...]}}.

    With ``--report-only`` nothing is trained: the metrics saved by an earlier
    full run (``<out-dir>/<name>.json``, ``name`` defaulting to ``runs_subdir``)
    are returned instead.
    """
    if getattr(args, "report_only", False):
        return _saved_metrics(args.out_dir, [name or runs_subdir, runs_subdir], runs)
    common = {**(smoke_overrides(args) if args.smoke else {}), **data_overrides(args)}
    root = args.runs_dir / (runs_subdir + ("_smoke" if args.smoke else ""))
    todo = []
    for run in runs:
        overrides = {**run.overrides, **common}
        num_steps = int(load_config(config, overrides).num_steps)
        if not _done(root / run.name, num_steps):
            todo.append((run, overrides))
    in_process = args.jobs <= 1
    if in_process:
        for run, overrides in todo:
            print(f"training {run.name}", flush=True)
            _train_one(config, root / run.name, overrides, True)
    else:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            futures = {
                pool.submit(_train_one, config, root / run.name, overrides, False): run.name
                for run, overrides in todo
            }
            for fut in concurrent.futures.as_completed(futures):
                fut.result()
                print(f"finished {futures[fut]}", flush=True)
    return {run.name: read_run(root / run.name) for run in runs}


def read_run(workdir: pathlib.Path) -> dict[str, list[dict]]:
    """Train and eval records of a run, the last record per step (resumed runs repeat steps)."""
    out: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    with open(workdir / "metrics.jsonl", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.setdefault(rec["kind"], {})[rec["step"]] = rec
    return {kind: [recs[s] for s in sorted(recs)] for kind, recs in out.items()}


def write_outputs(args: argparse.Namespace, name: str, results: dict, markdown: str) -> None:
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{name}.json").write_text(json.dumps(results, indent=1, sort_keys=True))
    (args.out_dir / f"{name}.md").write_text(markdown)
    print(f"wrote {args.out_dir / (name + '.json')} and {args.out_dir / (name + '.md')}",
          flush=True)  # fmt: skip


def figure_path(args: argparse.Namespace, name: str) -> pathlib.Path:
    """Figures go next to the results (experiments/figures when publishing)."""
    folder = FIGURES if args.out_dir.resolve() == RESULTS.resolve() else args.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"


def save_figure(fig: Any, path: pathlib.Path, dpi: int = 110) -> pathlib.Path:
    """Saves a matplotlib figure and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}", flush=True)
    return path


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
