"""Shared machinery for experiment scripts: run a grid of training runs, collect metrics.

Each run is a config file plus dotted overrides, trained into its own workdir
under ``Options.runs_dir``. A run whose workdir already holds its final checkpoint
is not trained again, so an interrupted experiment resumes where it stopped (and
runs shared by two experiments are trained once). ``jobs > 1`` trains runs in
parallel, each in a fresh worker process; ``jobs == 1`` trains in this process.

Provenance: each run's workdir gets ``run_info.json`` (commit, dirty tree, full config,
seeds; ``provenance.run_info``) when it starts; a finished or half-finished run whose recorded
config differs from the grid's is refused, never silently reused; and every report's json
carries ``_provenance``: the commit that wrote it and that of every run in it.

Parts: ``Options.part = (i, k)`` trains only every k-th run of the grid starting at the i-th
(1-based) and writes no report while runs are missing, so a long grid can be spread over
several invocations (or machines sharing ``runs_dir``); the last call writes the report.

Outputs: a re-run writes its report and figures to ``experiments/runs/results``
(git-ignored) and says where; the scripts' ``--publish`` writes the tracked
``experiments/results`` and ``experiments/figures`` instead.

Nothing here reads command-line flags: the scripts of ``experiments/`` turn theirs into
an ``Options`` (``experiments.options``), and notebooks build one directly.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import multiprocessing
import os
import pathlib
import signal
import threading
import uuid
from typing import Any, Callable, Iterator

from ml_collections import config_dict

from noloco_jax import determinism, errors
from noloco_jax.experiments import provenance
from noloco_jax.trainer.lock import WorkdirLock
from noloco_jax.trainer.writers import read_jsonl

ROOT = pathlib.Path(__file__).resolve().parents[2]  # the repository (configs/, experiments/)
RESULTS = ROOT / "experiments" / "results"  # published (tracked): --publish
FIGURES = ROOT / "experiments" / "figures"
RUNS = ROOT / "experiments" / "runs"  # training runs (git-ignored)
SCRATCH = RUNS / "results"  # default for re-runs (git-ignored)

__all__ = ["ROOT", "RESULTS", "FIGURES", "RUNS", "SCRATCH", "Options", "Run", "GridIncomplete",
           "smoke_overrides", "smoke_sync_every", "data_overrides", "load_config", "run_grid",
           "read_run",
           "train_in_processes", "plan_grid", "provenance_entry", "write_outputs", "figure_path", "figure_link", "save_figure",
           "md_table", "RUN_FAILURES"]  # fmt: skip


# A run's own failures (not the code's): raised again naming the run; the scripts print them
# in a line and exit 1, as noloco-train does.
RUN_FAILURES = (errors.TrainingDivergedError, errors.CheckpointSaveError,
                errors.MetricsWriteError, errors.CorruptCheckpointError,
                errors.CheckpointRestoreError)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Options:
    """How an experiment runs and where it writes.

    Attributes:
      smoke: a seconds-long version of every run (``smoke_overrides``), for tests.
      jobs: runs trained in parallel; 1 (or less) trains in this process.
      runs_dir: the runs' workdirs go under it.
      out_dir: reports (``<name>.json``, ``<name>.md``) and, unless it is ``RESULTS``, figures.
      data_path: local text files to train on instead of Shakespeare ("" = the config's data).
      data_dir: TFDS data dir and caches ("" = the config's).
      report_only: re-write the report from ``<out_dir>/<name>.json``, train nothing.
      part: ``(i, k)``: train only runs i, i + k, i + 2k, ... of the grid (1-based, 1 <= i <=
        k; the same runs whatever is done already), then stop with ``GridIncomplete`` if runs
        of other parts are still missing; None trains all.
      dry_run: train nothing; ``run_grid`` lists the runs, done or not, and stops.
    """

    smoke: bool = False
    jobs: int = 2
    runs_dir: pathlib.Path = RUNS
    out_dir: pathlib.Path = SCRATCH
    data_path: str = ""
    data_dir: str = ""
    report_only: bool = False
    part: tuple[int, int] | None = None
    dry_run: bool = False


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: a name (its workdir) and config overrides.

    ``pinned`` overrides apply after the smoke and data overrides (a run length computed for
    the smoke version itself, say); ``overrides`` before them.
    """

    name: str
    overrides: dict[str, Any]
    pinned: dict[str, Any] = dataclasses.field(default_factory=dict)


def smoke_sync_every(sync_every: int) -> int:
    """A run's H in the smoke version: H / 5, at least 1 (the plan's 5, 10, 20, 50 -> 1, 2, 4,
    10), so that runs whose H differs in the full plan (DiLoCo's 20 and NoLoCo's 10, the H
    sweep) still differ, in the same order and ratios."""
    return max(1, int(sync_every) // 5)


def smoke_overrides(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """A seconds-long version of a run with ``overrides``: nano model, a few steps.

    The run's own ``outer.sync_every`` is scaled by ``smoke_sync_every`` (2 where it sets
    none); 12 steps, evaluated every 2, reach 3 sync steps of DiLoCo's smoke H (4): the
    ``plan.LAST_K`` evaluations the reports' metric reads.
    """
    h = (overrides or {}).get("outer.sync_every")
    return {
        "model.preset": "nano", "num_steps": 12, "log_every": 2, "eval_every": 2,
        "checkpoint_every": 12, "global_batch_size": 8, "data.seq_len": 32,
        "data.eval_windows": 4, "optim.warmup_steps": 1, "backend": "vmap",
        "outer.sync_every": 2 if h is None else smoke_sync_every(h),
    }  # fmt: skip


def data_overrides(opts: Options) -> dict[str, Any]:
    """The data overrides ``opts`` asks for (local files, a data dir)."""
    over: dict[str, Any] = {}
    if opts.data_path:
        over.update({"data.source": "files", "data.path": opts.data_path})
    if opts.data_dir:
        over["data.data_dir"] = opts.data_dir
    return over


def load_config(path: str | pathlib.Path, overrides: dict[str, Any]) -> config_dict.ConfigDict:
    """The config file's ``get_config()`` with dotted overrides (``{"outer.sync_every": 10}``).

    The overrides are typed values, applied once by ml_collections' own
    ``update_from_flattened_dict`` on the locked config, with the type rules of
    ``--config.<field>=<value>`` on the command line: a misspelt field is a ``KeyError``,
    a value of the wrong type a ``TypeError``.

    Args:
      path: a config file (``configs/exp_table2.py``).
      overrides: dotted field name -> value.

    Returns:
      The config, unlocked.
    """
    path = pathlib.Path(path)
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


def _train(config: config_dict.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
    """Trains one run; returns its last metrics (``"stopped_by"``: a stop signal ended it;
    ``"late_signal"``: one came in its last chunk, so it finished)."""
    from noloco_jax.trainer import from_config  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    settings = from_config(config)
    determinism.request(settings.deterministic)  # in effect in a worker whose JAX has not started
    return train_and_evaluate(settings, workdir, progress=False)


def _train_logged(config: config_dict.ConfigDict, workdir: pathlib.Path,
                  log: pathlib.Path) -> str | None:  # fmt: skip
    """One run in a worker process of its own, everything it prints into ``log``; returns
    the stop signal that ended it early, if any."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the run handles its own (_worker_start)
    if _stopped_early:
        return _stopped_early[0]  # the grid's parent stopped before this run began
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")  # before TensorFlow loads
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    return _stop_signal(_train(config, workdir))


_stopped_early: list[str] = []  # in a worker: a SIGTERM that came before its run began


def _worker_start() -> None:
    """A worker's first act: a SIGTERM while it waits for a run is noted, not fatal.

    The grid's parent passes its SIGTERM to every worker, and the pool keeps a spare one
    started after each run ends: that one died of it, which broke the pool, so the runs under
    way were sent a second SIGTERM (stopped without saving) and reported as failed.
    """
    signal.signal(signal.SIGTERM, lambda signum, frame: _stopped_early.append("SIGTERM"))


def _stop_signal(last: dict[str, Any] | None) -> str | None:
    """The stop signal a run got, if any: it stops the grid too, even when it came too late
    to stop the run before its last step."""
    return (last or {}).get("stopped_by") or (last or {}).get("late_signal")


def train_in_processes(todo: list[tuple[pathlib.Path, config_dict.ConfigDict]],
                       jobs: int) -> None:  # fmt: skip
    """Trains ``jobs`` runs at a time, each in a fresh process (a spawned worker per run).

    A run is handed to a worker only when one is free, so a stop (Ctrl-C, a SIGTERM of this
    process, a run stopped by a signal, a failed run) starts no further run; the runs under
    way finish or stop first.

    Args:
      todo: (workdir, config) of each run; a run's output goes to ``<workdir>.log``.
      jobs: runs at a time.
    """
    context = multiprocessing.get_context("spawn")
    waiting, stopping = list(todo), []

    def stop() -> None:  # Ctrl-C or SIGTERM: the runs under way save and stop
        stopping.append(True)
        waiting.clear()

    with concurrent.futures.ProcessPoolExecutor(max(1, jobs), mp_context=context,
                                                max_tasks_per_child=1,
                                                initializer=_worker_start) as pool, \
            _sigterm_to_workers(pool, stop):  # fmt: skip
        futures: dict = {}
        interrupted = False
        while waiting or futures:
            while waiting and len(futures) < max(1, jobs):
                workdir, cfg = waiting.pop(0)
                workdir.parent.mkdir(parents=True, exist_ok=True)
                log = workdir.parent / f"{workdir.name}.log"
                futures[pool.submit(_train_logged, cfg, workdir, log)] = (workdir.name, log)
            try:
                done, _ = concurrent.futures.wait(futures,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            except KeyboardInterrupt:  # Ctrl-C reaches the workers too: their runs save and stop
                if interrupted:
                    raise  # a second Ctrl-C: stop at once
                interrupted = True
                stop()
                print("Ctrl-C: the runs under way save and stop; no further run starts (Ctrl-C "
                      "again to stop at once).", flush=True)
                continue
            for fut in done:
                name, log = futures.pop(fut)
                try:
                    stopped = _result(fut, bool(stopping))
                except errors.UserError as err:  # a bad setting or input: the message says all
                    raise errors.UserError(f"run {name}: {err}") from None
                except RUN_FAILURES as err:  # diverged, a save that failed: the message says
                    raise type(err)(f"run {name}: {err} (its log: {log})") from err
                except Exception as err:
                    raise RuntimeError(f"run {name} failed; see {log}") from err
                print(f"{'stopped' if stopped else 'finished'} {name}", flush=True)
                if stopped:  # a signal stopped the run: it stops the grid too
                    waiting.clear()


def _result(fut: concurrent.futures.Future, stopping: bool) -> str | None:
    """``fut``'s stop signal (``_train_logged``); while the grid stops, a worker that the signal
    reached before the trainer's handler (still starting: a KeyboardInterrupt, or killed, which
    breaks the pool) counts as stopped, not as a failed run."""
    try:
        return fut.result()
    except (KeyboardInterrupt, concurrent.futures.BrokenExecutor):
        if not stopping:
            raise
        return "stopped while starting"


@contextlib.contextmanager
def _sigterm_to_workers(pool: Any, stop: Callable[[], None]) -> Iterator[None]:
    """A SIGTERM of this process (``kill PID``, a scheduler) is passed on to the workers, as
    a Ctrl-C reaches them through the terminal: their runs save and stop, and ``stop()`` starts
    no further run. A second SIGTERM is passed on too, then acts as it would without this
    handler. Installed only in the main thread, not over a handler set outside Python, and
    restored on exit.
    """
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is None):  # fmt: skip
        yield
        return
    seen = []

    def handle(signum: int, frame: Any) -> None:
        for worker in list((getattr(pool, "_processes", None) or {}).values()):
            worker.terminate()  # SIGTERM
        if seen:  # the second: stop at once
            signal.signal(signum, previous)
            signal.raise_signal(signum)
            return
        seen.append(signum)
        stop()
        print("SIGTERM: the runs under way save and stop; no further run starts (SIGTERM "
              "again to stop at once).", flush=True)

    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class GridIncomplete(RuntimeError):
    """A part of a grid was trained (``Options.part``); other runs are still missing."""


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
        raise errors.UserError(
            f"--report_only: no saved metrics for {missing} in {out_dir} ({', '.join(names)}.json)."
        )
    return found


def _check_saved_configs(found: dict, planned: list, out_dir: pathlib.Path,
                         smoke: bool = False) -> None:  # fmt: skip
    """Refuses saved metrics (``--report_only``) of a run recorded with another config than
    the grid's (a changed plan, a smoke run's json, other data); a run saved without its
    config (made before run_info) is left to make_results, which flags it, except in the
    smoke version: its report read it with the full plan's settings (table2: H = 20 for the
    smoke H = 2) and died in a ValueError traceback."""
    for run, _, cfg, _ in planned:
        saved = (found[run.name].get("run_info") or {}).get("config")
        if not saved and smoke:
            raise errors.UserError(
                f"--report_only: the metrics of run {run.name} saved in {out_dir} have no "
                f"run_info (config), so the smoke report would read them with the full plan's "
                f"settings; train the smoke grid again (seconds), without --report_only.")
        if not saved:
            continue
        diff = provenance.config_differences(saved, provenance.run_info(cfg, ROOT, {})["config"])
        if diff:
            shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
            raise errors.UserError(
                f"--report_only: the metrics of run {run.name} saved in {out_dir} were trained "
                f"with another config than this grid's ({shown}); give the flags that trained "
                "it (--smoke, --data_path, ...) or train the grid again.")


def _write_atomic(path: pathlib.Path, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file beside it, renamed over ``path``
    once whole: a write that fails part-way (a full disk) leaves the earlier file intact."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")  # unique on a shared disk
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _resumable(workdir: pathlib.Path) -> bool:
    """Whether a run saved a checkpoint to resume from; one stopped before its first starts
    again at step 0 (its earlier records dropped), all of it trained by the code run now."""
    folder = workdir / "checkpoints"
    return folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir())


def _check_run_info(workdir: pathlib.Path, info: dict, done: bool, write: bool) -> dict:
    """The run_info.json a run keeps: the recorded one if it trained before (refused if its
    config differs from ``info``'s), else ``info``, written now if ``write`` (it is about to
    train; a record left by a grid stopped before this run trained, or before it saved a
    checkpoint to resume from, is replaced)."""
    path = workdir / "run_info.json"
    started = done or (workdir / "metrics.jsonl").exists() or (workdir / "checkpoints").exists()
    if started and not path.exists():
        raise errors.UserError(
            f"run {workdir} was trained before runs recorded their code version and config "
            "(no run_info.json), so it cannot be checked against this grid; delete it or "
            "train into another --runs_dir.")  # fmt: skip
    if not started:  # nothing trained yet: whatever code trains it now is its version
        if write:
            workdir.mkdir(parents=True, exist_ok=True)
            _write_atomic(path, json.dumps(info, indent=1, sort_keys=True))
        return info
    saved = json.loads(path.read_text())
    diff = provenance.config_differences(saved.get("config") or {}, info["config"])
    if diff:
        shown = ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in diff.items())
        raise errors.UserError(
            f"run {workdir} was trained with another config ({shown}); use another "
            f"--runs_dir or another run name, or delete that workdir.")
    if write and not done:  # another grid training it now: refused before its record changes
        with WorkdirLock(workdir):
            pass
    if write and not done and not _resumable(workdir):  # it starts again at step 0
        _write_atomic(path, json.dumps(info, indent=1, sort_keys=True))
        return info
    if write and not done and provenance.version_label(saved) != provenance.version_label(info):
        saved.setdefault("resumed_at", []).append(
            {k: info[k] for k in ("commit", "dirty", "diff_sha256")})
        _write_atomic(path, json.dumps(saved, indent=1, sort_keys=True))
    return saved


def plan_grid(config: pathlib.Path, runs: list[Run], opts: Options, runs_subdir: str
              ) -> list[tuple[Run, pathlib.Path, config_dict.ConfigDict, bool]]:  # fmt: skip
    """(run, workdir, config, done) for every run of the grid, configs loaded once."""
    data = data_overrides(opts)
    root = opts.runs_dir / (runs_subdir + ("_smoke" if opts.smoke else ""))
    planned = []
    for run in runs:
        smoke = smoke_overrides(run.overrides) if opts.smoke else {}
        cfg = load_config(config, {**run.overrides, **smoke, **data, **run.pinned})
        planned.append((run, root / run.name, cfg, _done(root / run.name, int(cfg.num_steps))))
    return planned


def _part(todo: list, part: tuple[int, int] | None) -> list:
    if part is None:
        return todo
    i, k = part
    if not 1 <= i <= k:
        raise errors.UserError(f"part must be i/k with 1 <= i <= k, got {i}/{k}.")
    return todo[i - 1::k]


def run_grid(
    config: pathlib.Path,
    runs: list[Run],
    opts: Options,
    *,
    runs_subdir: str,
    name: str | None = None,
) -> dict[str, dict[str, Any]]:
    """Trains every run not yet finished; returns {name: {"train", "eval", "run_info"}}.

    Each run's config is loaded once (``load_config``) and trained as it is; its
    ``run_info.json`` (commit, config, seeds) is written when it starts and checked against
    the grid's config whenever the run is met again. With ``opts.report_only`` nothing is
    trained: the metrics saved by an earlier full run (``<out_dir>/<name>.json``, ``name``
    defaulting to ``runs_subdir``) are returned instead, refused for a run saved with
    another config than the grid's.

    Args:
      config: the config file every run starts from.
      runs: the grid.
      opts: smoke version, parallel jobs, folders, data, part of the grid, dry run.
      runs_subdir: the runs' workdirs go in ``opts.runs_dir / runs_subdir`` (``_smoke`` added
        for the smoke version); experiments sharing runs share it.
      name: the report whose saved metrics ``report_only`` reads.

    Returns:
      Each run's train and eval records and its run_info.

    Raises:
      GridIncomplete: ``opts.part`` or ``opts.dry_run`` left runs untrained, or a run
        stopped before its last step.
      UserError: a run's workdir holds a run trained with another config, or one without
        ``run_info.json`` (made before runs recorded it).
    """
    if opts.report_only:
        found = _saved_metrics(opts.out_dir, [name or runs_subdir, runs_subdir], runs)
        _check_saved_configs(found, plan_grid(config, runs, opts, runs_subdir), opts.out_dir,
                             opts.smoke)  # fmt: skip
        return found
    planned = plan_grid(config, runs, opts, runs_subdir)
    selected = {run.name for run, *_ in _part(planned, opts.part)}
    state = provenance.git_state(ROOT)
    # A dry run checks the recorded runs too (a run of another config is refused, not "done").
    infos = {run.name: _check_run_info(workdir, provenance.run_info(cfg, ROOT, state), done,
                                       write=run.name in selected and not opts.dry_run)
             for run, workdir, cfg, done in planned}  # fmt: skip
    if opts.dry_run:
        for run, workdir, cfg, done in planned:
            print(f"{'done' if done else 'todo'} {run.name} ({cfg.num_steps} steps) {workdir}")
        raise GridIncomplete(f"dry run: {sum(not p[3] for p in planned)} of {len(planned)} "
                             "runs to train.")  # fmt: skip
    todo = [(workdir, cfg) for run, workdir, cfg, done in planned
            if run.name in selected and not done]  # fmt: skip
    if opts.jobs > 1:
        train_in_processes(todo, opts.jobs)
    else:
        for workdir, cfg in todo:
            print(f"training {workdir.name}", flush=True)
            try:
                stopped = _stop_signal(_train(cfg, workdir))
            except (errors.UserError, *RUN_FAILURES) as err:  # the message says which run
                raise type(err)(f"run {workdir.name}: {err}") from err
            if stopped:  # the signal stops the grid too
                break
    missing = [run.name for run, workdir, cfg, _ in planned
               if not _done(workdir, int(cfg.num_steps))]  # fmt: skip
    stopped = [name for name in missing if name in selected]
    if stopped:  # stopped early (a signal) or failed without an error
        raise GridIncomplete(f"runs {stopped} did not reach their last step; run the same "
                             "command again to resume them.")
    if missing:
        raise GridIncomplete(f"part {opts.part[0]}/{opts.part[1]} trained {len(todo)} runs; "
                             f"{len(missing)} of the grid's {len(planned)} are missing "
                             f"(another part trains them): no report until all are done.")
    return {run.name: {**read_run(workdir), "run_info": infos[run.name]}
            for run, workdir, _, _ in planned}  # fmt: skip


def read_run(workdir: pathlib.Path) -> dict[str, list[dict]]:
    """Train and eval records of a run, the last record per step (resumed runs repeat steps)."""
    out: dict[str, dict[int, dict]] = {"train": {}, "eval": {}}
    for rec in read_jsonl(workdir / "metrics.jsonl"):  # a line cut short by a crash: skipped
        out.setdefault(rec["kind"], {})[rec["step"]] = rec
    return {kind: [recs[s] for s in sorted(recs)] for kind, recs in out.items()}


def _provenance(results: dict, runs: dict | None, config: Any) -> dict[str, Any]:
    """The ``_provenance`` entry of a results json (see ``provenance.versions_of``)."""
    runs = results if runs is None else runs
    prov: dict[str, Any] = {
        "writer": provenance.git_state(ROOT),
        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "runs": {name: {k: run["run_info"].get(k) for k in
                        ("commit", "dirty", "diff_sha256", "seed", "outer_seed", "resumed_at")
                        if k in run["run_info"]}
                 for name, run in runs.items()
                 if isinstance(run, dict) and isinstance(run.get("run_info"), dict)},
    }  # fmt: skip
    if config is not None:
        prov["config"] = json.loads(json.dumps(config.to_dict() if hasattr(config, "to_dict")
                                               else config, default=repr))  # fmt: skip
    return prov


def provenance_entry(config: Any = None) -> dict[str, Any]:
    """The ``_provenance`` of a results json written without ``write_outputs`` (simulations):
    the writer's commit, and ``config`` (the experiment's settings) when given."""
    return _provenance({}, {}, config)


def write_outputs(opts: Options, name: str, results: dict, markdown: str, *,
                  runs: dict | None = None, config: Any = None) -> None:  # fmt: skip
    """Writes ``<out_dir>/<name>.json`` and ``.md`` and says where.

    The json gets ``_provenance``: the commit (and dirty state) of the code writing it, and of
    every run in ``runs`` (default: the entries of ``results`` that carry a ``run_info``); a
    ``_provenance`` already in ``results`` (a report re-written from its json) is kept inside
    the new one as ``earlier``.

    Args:
      opts: where (``out_dir``).
      name: the report's name.
      results: what the json holds.
      markdown: the report.
      runs: the ``run_grid`` results the report was made from, when ``results`` is not them.
      config: the settings of an experiment that trains without ``run_grid`` (recorded whole).
    """
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    results = dict(results)
    earlier = results.pop("_provenance", None)  # a report re-written from its saved json
    prov = _provenance(results, runs, config)
    if earlier:
        prov["earlier"] = earlier
    results["_provenance"] = prov
    _write_atomic(opts.out_dir / f"{name}.json", json.dumps(results, indent=1, sort_keys=True))
    _write_atomic(opts.out_dir / f"{name}.md", markdown)
    print(f"wrote {opts.out_dir / (name + '.json')} and {opts.out_dir / (name + '.md')}",
          flush=True)  # fmt: skip


def figure_path(opts: Options, name: str) -> pathlib.Path:
    """Figures go next to the results (experiments/figures when publishing)."""
    folder = FIGURES if opts.out_dir.resolve() == RESULTS.resolve() else opts.out_dir
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.png"


def figure_link(opts: Options, path: pathlib.Path) -> str:
    """The figure's address as the report in ``opts.out_dir`` links it (relative)."""
    return os.path.relpath(path, opts.out_dir)


def save_figure(fig: Any, path: pathlib.Path, dpi: int = 110) -> pathlib.Path:
    """Saves a matplotlib figure and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"wrote {path}", flush=True)
    return path


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def fmt(v: Any) -> str:  # a "|" in a cell ("r (lr | step)") would split it: escaped
        return (f"{v:.4g}" if isinstance(v, float) else str(v)).replace("|", "\\|")

    lines = ["| " + " | ".join(map(fmt, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
