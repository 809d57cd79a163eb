"""``train_and_evaluate``: N replicas of a Llama trained with NoLoCo, DiLoCo or data parallel.

The loop builds the run (``trainer.build``: data, model, programs), restores or initialises
the replicated state, then runs chunks of steps, evaluating and checkpointing at chunk
boundaries, until the run ends or a stop signal arrives.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import pathlib
import signal
import threading
import time
import types
import zlib
from typing import Any, Callable, Iterator

import jax
import numpy as np

from noloco_jax import defaults, determinism, replicas
from noloco_jax.errors import CorruptCheckpointError, UserError, check_int, check_utf8_path
from noloco_jax.data import sources
from noloco_jax.data.token_files import sharded_batches
from noloco_jax.trainer import health
from noloco_jax.trainer import optimizer as optim_lib
from noloco_jax.trainer.build import (DataBundle, Run, build_run, prepare_data, prepare_model,
                                      stage_mesh)
from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.lock import WorkdirLock
from noloco_jax.trainer.observability import Profiler, check_sinks, compile_seconds, make_sinks
from noloco_jax.trainer.resize import check_init_model, check_resume, restore_resized
from noloco_jax.trainer.settings import (TrainSettings, check_delay_windows, check_loadable,
                                         guard_acts, validate, warnings_for)
from noloco_jax.trainer.step import TrainState
from noloco_jax.trainer.writers import MetricWriter, Progress, read_jsonl

__all__ = ["DataBundle", "prepare_data", "prepare_model", "train_and_evaluate", "load_run"]

def _restore_or_init(
    run: Run, target: TrainState, ckpt: Checkpointer, writer: MetricWriter
) -> tuple[TrainState, int]:
    """The newest readable checkpoint (restored onto ``target``), or the fresh state.

    A checkpoint whose data is damaged (checksums, metadata, bytes) is reported, set aside as
    ``<step>.corrupt`` (never deleted or overwritten) and the previous one is used. An error of
    the machine (``CheckpointRestoreError``) or settings that differ stop the run and touch
    nothing. When checkpoints existed but none is readable, the run stops instead of silently
    starting again from step 0.
    """
    for step in reversed(ckpt.all_steps()):
        try:
            meta = ckpt.read_run_meta(step)
            # Settings are compared before the arrays are read: a checkpoint of another
            # topology is refused with a clear error and left untouched, never set aside.
            old_n = check_resume(meta, run.meta, run.settings.allow_resize)  # None: same N
            restored = (ckpt.restore(step, target)[0] if old_n is None
                        else restore_resized(ckpt, step, target, old_n, run.reps))
        except CorruptCheckpointError as err:
            moved = ckpt.quarantine(step)
            message = (f"checkpoint at step {step} is unreadable ({type(err).__name__}: "
                       f"{str(err)[:200]}); moved to {moved.name}, trying the previous one")
            if writer.enabled:  # process 0 speaks for all
                print(f"WARNING: {message}", flush=True)
            writer.write(step, "event", {"event": "corrupt_checkpoint", "detail": message})
            continue
        run.resized_from = old_n  # reported once training goes on (_report_resize)
        run.counted = _counted_at(meta, step, run) if old_n or "counted" in meta else None
        run.streak = None if old_n else meta.get("reset_streak")
        return restored, step
    aside = ckpt.set_aside()
    if aside:
        raise UserError(
            f"no readable checkpoint under {ckpt.directory}: {len(aside)} set aside as corrupt "
            f"({', '.join(p.name for p in aside[:4])}). Refusing to start again from step 0; "
            f"to do that, move the *.corrupt directories out of {ckpt.directory} (or use "
            f"another --workdir)."
        )
    return run.fresh(), 0


def _counted_at(meta: dict, step: int, run: Run) -> tuple[int, int, float]:
    """(step, tokens seen, bytes sent per replica) of a checkpoint, for counts across a resize.

    Checkpoints record both; older ones are counted from their own settings.
    """
    if isinstance(meta.get("counted"), dict):
        return step, meta["counted"]["tokens_seen"], meta["counted"]["bytes_sent_per_replica"]
    old, s = meta["settings"], run.settings
    # A resize may change num_replicas, global_batch_size and outer.group_size: the old ones.
    outer = dataclasses.replace(s.outer, group_size=old.get("outer", {}).get("group_size",
                                                                s.outer.group_size))
    return step, step * old["global_batch_size"] * old["data"]["seq_len"], optim_lib.bytes_sent(
        s.method, outer, run.params0, num_replicas=old["num_replicas"], steps=step,
        fault=s.fault, devices_per_replica=s.mesh.fsdp * s.mesh.tensor)  # fmt: skip


def _report_resize(run: Run, writer: MetricWriter, step: int) -> None:
    if run.resized_from is not None:
        message = (f"resized from {run.resized_from} to {run.settings.num_replicas} replicas "
                   f"at step {step}")  # fmt: skip
        if writer.enabled:  # process 0 speaks for all
            print(message, flush=True)
        writer.write(step, "event", {"event": "resize", "detail": message})


def _next_tokens(run: Run, start: int, count: int) -> Any:
    """Batches for steps [start, start + count): [N, count, B, T + 1], placed for the backend."""
    if jax.process_count() > 1 and run.reps.mesh is not None:  # read this process's replicas
        return sharded_batches(run.data.batcher, run.reps, start, count)
    tokens = np.stack([run.data.batcher.batch(t) for t in range(start, start + count)], axis=1)
    return run.reps.put(tokens)


def train_and_evaluate(
    settings: TrainSettings,
    workdir: str | pathlib.Path,
    *,
    stop_at: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Trains (or resumes) a run in ``workdir``; returns the last metrics.

    A later call with the same settings and data in the same process (a resume, a notebook
    cell run again) reuses this run's compiled programs; a process keeps those of its last
    ``KEEP_COMPILED`` runs.

    Args:
      settings: validated ``TrainSettings``.
      workdir: where checkpoints, metrics.jsonl and TensorBoard files go; a
        workdir that holds a checkpoint is resumed from its latest step.
      stop_at: stop after this step, as if the process died there (tests and experiments):
        no checkpoint is saved unless the step is on the ``checkpoint_every`` grid or is
        ``num_steps`` (the run's end), so a later call resumes from the last one (a stop
        signal, unlike this, saves). An integer >= 0, or None.
      progress: show a console progress bar.

    Returns:
      Dict with the last train and eval metrics, ``"step"`` (the last step trained) and
      ``"eval_step"`` (the step the eval metrics are of; earlier after a stop mid-way);
      ``"stopped_by"``: the stop signal that ended the run before its last step;
      ``"late_signal"``: one that came too late for that (in the last chunk or the last
      save), so the run finished (a caller running more, like an experiment grid, stops).
    """
    if stop_at is not None:  # a float died in the batcher after training, -1 did nothing
        check_int("stop_at", stop_at, minimum=0)
    _check_equal_processes()
    _check_same_settings(settings)
    workdir = _agreed(_check_start, settings, workdir, stop_at)
    lock = WorkdirLock(workdir)
    # Process 0 takes the lock for all; a refusal stops every process, not process 0 alone.
    _agreed(lock.acquire if jax.process_index() == 0 else lambda: None)
    try:
        with _stop_signals() as stop:
            last = _train(settings, workdir, stop_at, progress, stop)
        late = stop.agreed or stop.requested
        if late and "stopped_by" not in last:  # the run finished: its caller is told
            last["late_signal"] = late
        return last
    finally:
        lock.release()


# Settings a process may give for itself: its own copies of files, process 0's metric sinks,
# a profile of one host's steps (the trace changes no chunk).
_PER_HOST = ("data.path", "data.data_dir", "data.tokenizer_path", "model.init_from", "log.",
             "profile_steps")


def _check_same_settings(settings: TrainSettings) -> None:
    """Refuses processes started with different settings (another flag or config file on one
    host): each trained its own replicas with its own (say) learning rate, silently, and the
    checkpoint recorded process 0's."""
    if jax.process_count() == 1:
        return
    fields = {k: v for k, v in defaults.dotted(settings.to_dict()).items()
              if not k.startswith(_PER_HOST)}  # fmt: skip
    mine = np.asarray([zlib.crc32(repr(v).encode()) for v in fields.values()], np.uint32)
    every = _gathered(mine)
    differ = [name for name, column in zip(fields, every.T) if len(set(column.tolist())) > 1]
    if differ:
        shown = ", ".join(f"config.{name}" for name in differ[:5])
        raise UserError(
            f"the {len(every)} processes were started with different settings ({shown} "
            f"differ{'s' if len(differ) == 1 else ''}); start every process with the same "
            f"config file and flags.")


def _check_start(settings: TrainSettings, workdir: str | pathlib.Path, stop_at: int | None
                 ) -> pathlib.Path:  # fmt: skip
    """This process's checks of the run's input before anything runs; returns the workdir."""
    validate(settings)  # settings built as a dataclass, not by from_config, were not checked
    _check_dtype_promotion()
    workdir = _writable_workdir(workdir)
    _check_outside_corpus(settings, workdir)
    check_sinks(settings)
    check_delay_windows(settings, stop_at)  # no run stops inside an overlap window
    return workdir


def _check_dtype_promotion() -> None:
    """Refuses ``jax_numpy_dtype_promotion='strict'``: optax's Adam (its bias correction
    ``b1**count``, a Python float and an int32) raised under it, after the data was prepared."""
    if jax.config.jax_numpy_dtype_promotion == "strict":  # the context manager's value too
        raise UserError(
            "jax_numpy_dtype_promotion: the trainer needs 'standard', got 'strict' (optax's "
            "Adam raises under it). Train outside jax.numpy_dtype_promotion('strict'), or call "
            "jax.config.update('jax_numpy_dtype_promotion', 'standard') (and unset "
            "$JAX_NUMPY_DTYPE_PROMOTION).")  # fmt: skip


def _agreed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on every process; a user error on one process stops them all (alone, it
    left the others waiting in their next collective until the runtime's timeout)."""
    error = None
    try:
        result = fn(*args)
    except (ValueError, FileNotFoundError, NotADirectoryError,
            sources.CorpusUnavailableError) as err:  # the CLI's user errors
        if jax.process_count() == 1:
            raise
        error, result = err, None
    failed = np.flatnonzero(_gathered(np.asarray([error is not None], np.int32)))
    if error is None and failed.size:
        raise UserError(f"process {int(failed[0])} of the run stopped with an error while "
                        f"preparing it; its log names the error and the fix.")
    if error is not None:
        raise error
    return result


def _gathered(x: np.ndarray) -> np.ndarray:
    """Every process's ``x``, one row each (no collective in a single-process run)."""
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils  # noqa: PLC0415

    return np.asarray(multihost_utils.process_allgather(x)).reshape(-1, x.size)


def _check_equal_processes() -> None:
    """Refuses processes that hold different numbers of devices, before the first collective:
    JAX's multi-process helpers (orbax's and the trainer's) lay the devices out as processes x
    devices per process, and died in orbax's first barrier ("cannot reshape array")."""
    if jax.process_count() == 1:
        return
    counts = collections.Counter(d.process_index for d in jax.devices())
    if len(set(counts.values())) > 1:
        shown = ", ".join(f"process {p}: {n}" for p, n in sorted(counts.items())[:8])
        raise UserError(
            f"the {len(counts)} processes hold different numbers of devices ({shown}); JAX's "
            f"multi-process runtime (its barriers and gathers, orbax's checkpoints) needs the "
            f"same number on every process. Give each process as many devices (on CPU: the "
            f"same XLA_FLAGS=--xla_force_host_platform_device_count).")


def _train(settings: TrainSettings, workdir: pathlib.Path, stop_at: int | None, progress: bool,
           stop: types.SimpleNamespace) -> dict[str, Any]:
    ckpt = Checkpointer(workdir / "checkpoints", keep=settings.keep_checkpoints, probe=True)
    first = jax.process_index() == 0
    lines = [*warnings_for(settings), *filter(None, [determinism.warning(settings.deterministic)])]
    for line in lines if first else ():
        print(f"WARNING: {line}", flush=True)
    writer = bar = None
    profiler = Profiler(settings.profile_steps, workdir)
    try:
        run, target = _agreed(build_run, settings)
        writer = MetricWriter(workdir, enabled=first,
                              sinks=lambda: make_sinks(settings, workdir))  # fmt: skip
        state, step = _restore_or_init(run, target, ckpt, writer)
        writer.resume_at(step)  # TensorBoard drops what earlier sessions logged after it
        health.check_counter(state, step)  # the host's step must be the optimizer's step counter
        if step >= settings.num_steps:  # nothing to do: report, write nothing
            ckpt.close()
            writer.close()
            return _already_finished(workdir, step, verbose=first)
        _report_resize(run, writer, step)
        bar = Progress(progress and first, settings.num_steps, step, silent=not first)
        session = _Session(run, ckpt, writer, bar, health.Escalation(run, state, ckpt), stop,
                           array_bytes=sum(x.nbytes for x in jax.tree.leaves(state)))
        end = settings.num_steps if stop_at is None else min(stop_at, settings.num_steps)
        last = _loop(session, state, step, end, profiler)
    except BaseException:
        profiler.close()
        _close_quietly(ckpt, writer, bar)
        raise
    profiler.close()
    try:
        ckpt.close()  # raises CheckpointSaveError if the last save failed
        _report_saves(session, closed=True)
    except BaseException:  # the metric sinks finish either way (W&B's run included), and a
        _close_quietly(None, writer, bar)  # full disk's MetricsWriteError masks not the save's
        raise
    writer.close()
    bar.close()
    return last


@dataclasses.dataclass
class _Session:
    """What the loop writes to while it trains."""

    run: Run
    ckpt: Checkpointer
    writer: MetricWriter
    bar: Progress
    guard: health.Escalation
    stop: types.SimpleNamespace  # .requested: the stop signal's name, or None
    array_bytes: int  # the state's, shown beside each checkpoint's size on disk
    pending: list = dataclasses.field(default_factory=list)  # saves not yet reported
    last: dict = dataclasses.field(default_factory=dict)


def _loop(ses: _Session, state: TrainState, step: int, end: int, profiler: Profiler
          ) -> dict[str, Any]:  # fmt: skip
    """Trains from ``step`` to ``end`` a log chunk at a time; returns the last metrics."""
    s, ses.last["step"] = ses.run.settings, step
    ses.last["nonfinite_resets"] = health.nonfinite_resets(state)  # a resume reports only new ones
    # At step 0, and right after a resize (marked, as it shares its step with the eval before);
    # a signal during start-up writes nothing, so the resume's step-0 eval is the only one.
    stopping = _stop_agreed(ses.stop) is not None
    ses.stop.training = True  # a signal from here on is saved at a chunk's end
    if (step == 0 or ses.run.resized_from) and not stopping:
        _evaluate(ses, state, step, ses.run.resized_from)
    while step < end and not stopping:
        programs = len(ses.run.calls)
        k = min(s.log_every - step % s.log_every, end - step)
        profiler.before_chunk(step, step + k)
        t0, compiled0 = time.perf_counter(), compile_seconds()
        synced = [] if ses.guard.active else None
        state, losses = _run_blocks(ses.run, state, step, k, synced)  # waits for the device
        step += k
        seconds = time.perf_counter() - t0 - (compile_seconds() - compiled0)  # training only
        profiler.after_chunk(step)  # writing the trace is no training either
        stopping = _after_chunk(ses, state, synced, step, _train_metrics(
            ses.run, state, step, k, losses, seconds))
        ses.bar.advance(step, ses.last, compiled=len(ses.run.calls) > programs)
    name = ses.stop.agreed or ses.stop.requested  # (one after the last decision: this one's)
    if name and step < s.num_steps:  # a signal in the last chunk: the run is done
        ses.last["stopped_by"] = name
        saved = ("after saving its checkpoint" if ses.ckpt.latest_step() == step
                 else "before training further (nothing new to save)")
        ses.bar.write(f"{name}: stopped at step {step} {saved}; run the same "
                      f"command again to resume.")  # fmt: skip
    return ses.last


def _after_chunk(ses: _Session, state: TrainState, synced: list | None, step: int,
                 metrics: dict) -> bool:  # fmt: skip
    """Writes the chunk's metrics, then checks, evaluates and checkpoints when due.

    Returns whether a stop signal came before the save decision (the loop stops here, saved);
    one that comes after it stops the loop at the next chunk's end.
    """
    s = ses.run.settings
    ses.writer.write(step, "train", metrics)
    _report_saves(ses)  # the saves that finished during this chunk
    if metrics["nonfinite_resets"] > ses.last.get("nonfinite_resets", 0.0):  # before update
        _report_reset(ses.writer, step, metrics["nonfinite_resets"], ses.bar)
    ses.last.update(metrics, step=step)
    # A failed asynchronous save stops the run now, before a divergence stop names it as kept.
    ses.ckpt.check()
    ses.guard.after_chunk(synced, step)
    health.check_phase_errors(state, step)
    if step % s.eval_every == 0 or step == s.num_steps:
        _evaluate(ses, state, step)
    stopping = _stop_agreed(ses.stop) is not None
    if step % s.checkpoint_every == 0 or step == s.num_steps or stopping:
        ses.guard.check_savable(state, step)
        unrepaired = ses.guard.unrepaired(state, step) if step == s.num_steps else None
        if unrepaired:  # every process checks (a gather); the bar prints on process 0 only
            ses.bar.write(f"WARNING: {unrepaired}")
        _report_saves(ses, wait=True)  # orbax waits for the previous save here anyway
        counted = {k: ses.last[k] for k in ("tokens_seen", "bytes_sent_per_replica")}
        ses.ckpt.save(step, state, {**ses.run.meta, "counted": counted,
                                    "reset_streak": ses.guard.streak.tolist()})  # fmt: skip
        ses.pending.append(step)
    return stopping


def _report_saves(ses: _Session, wait: bool = False, closed: bool = False) -> None:
    """Prints each finished checkpoint's size on disk (``wait``: wait for the saves; ``closed``:
    all are done)."""
    if not ses.pending or (not wait and not closed and ses.ckpt.saving()):
        return
    if wait:
        ses.ckpt.wait()
    for step in ses.pending:
        size = ses.ckpt.size_bytes(step)
        if ses.writer.enabled and size:  # process 0 only
            ses.bar.write(f"checkpoint at step {step}: {_megabytes(size)} on disk "
                          f"({_megabytes(ses.array_bytes)} of arrays, zstd) in "
                          f"{ses.ckpt.directory / str(step)}; the newest {ses.ckpt.keep} kept")
    ses.pending.clear()


def _megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n < 1e9 else f"{n / 1e9:.1f} GB"


def _already_finished(workdir: pathlib.Path, step: int, verbose: bool) -> dict[str, Any]:
    """The last train and eval records of a finished run, printed in one line."""
    last: dict[str, Any] = {}
    path = workdir / "metrics.jsonl"
    for record in read_jsonl(path) if path.exists() else ():
        if record.get("kind") in ("train", "eval") and record["step"] <= step:
            last.update({k: v for k, v in record.items() if k != "kind"})
            if record["kind"] == "eval":  # as the run itself returns
                last["eval_step"] = record["step"]
    last["step"] = step
    if verbose:
        shown = [f"{k} {last[k]:.4g}" for k in _FINAL_METRICS if isinstance(last.get(k), float)]
        print(f"already finished at step {step}; final metrics: {', '.join(shown) or 'none'} "
              f"({path}). Nothing was written; a new run needs another --workdir.", flush=True)
    return last


_FINAL_METRICS = ("val_ppl", "val_ppl_avg_model", "val_ppl_ensemble", "replica_spread",
                  "train_loss")  # fmt: skip


def _close_quietly(ckpt: Checkpointer | None, writer: MetricWriter, bar: Any) -> None:
    """Releases everything while another error is on its way up."""
    for close in filter(None, (getattr(thing, "close", None) for thing in (ckpt, writer, bar))):
        try:
            close()
        except Exception as err:  # noqa: BLE001 - the error in flight matters more
            print(f"WARNING: while stopping: {type(err).__name__}: {str(err)[:300]}", flush=True)


def _stop_agreed(stop: types.SimpleNamespace) -> str | None:
    """The stop signal's name if any process has received one, else None, the same on every
    process at the same point of the loop: preemption notices reach hosts at different moments,
    and one process entering the collective save alone crashed the run without its checkpoint.
    """
    mine = 0 if stop.requested is None else int(signal.Signals[stop.requested])
    signum = int(np.max(_gathered(np.asarray([mine], np.int32))))
    stop.agreed = signal.Signals(signum).name if signum else None
    return stop.agreed


@contextlib.contextmanager
def _stop_signals() -> Iterator[types.SimpleNamespace]:
    """SIGINT/SIGTERM set ``requested``; the loop saves at the next step boundary and returns.

    A second signal of the same kind acts as it would without this handler
    (SIGINT: ``KeyboardInterrupt``; SIGTERM: the process ends); one of the other kind is only
    noted. Before the loop sets ``training`` (the run is being prepared) a stop saves nothing.
    Handlers are installed only in the main thread, and not over a handler set outside Python
    (which could not be put back), and restored on exit.
    """
    stop = types.SimpleNamespace(requested=None, agreed=None, training=False, seen=set())
    previous = {}

    def handle(signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name in stop.seen:  # second signal of this kind: act as if we were not here
            signal.signal(signum, previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        stop.seen.add(name)
        stop.requested = stop.requested or name
        what = ("saving a checkpoint at the end of the current steps, then stopping"
                if stop.training else "stopping when the run's preparation ends, before "
                "training (nothing to save yet)")  # fmt: skip
        print(f"{name} received: {what} (send {name} again to stop at once).", flush=True)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(sig) is not None:  # None: set outside Python, kept as it is
                previous[sig] = signal.signal(sig, handle)
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _evaluate(ses: _Session, state: TrainState, step: int, resized_from: int | None = None
              ) -> None:  # fmt: skip
    metrics = ses.run.evaluate(state.params)
    ses.writer.write(step, "eval", {**metrics, "resized_from": resized_from} if resized_from
                     else metrics)  # fmt: skip
    ses.last.update(metrics, eval_step=step)  # a stop between evaluations: train "step" is later
    line = (f"step {step:6d}  val ppl {metrics['val_ppl']:8.3f} (pooled over replicas)  "
            f"averaged model {metrics['val_ppl_avg_model']:8.3f}  "
            f"spread {metrics['replica_spread']:.2e}")  # fmt: skip
    if "train_loss" in ses.last:
        line += f"  train loss {ses.last['train_loss']:.3f}  {ses.last['tokens_per_sec']:.0f} tok/s"
    ses.bar.write(line)


def load_run(settings: TrainSettings, workdir: str | pathlib.Path) -> tuple[Any, Any, DataBundle]:
    """(graphdef, replicated params, data) of a finished or interrupted run, for analysis.

    Reads only: a ``workdir`` without checkpoints raises ``FileNotFoundError`` and is left
    as it was (no directory is made). The params come back on the run's devices with plain
    (auto) mesh axes, so ``x[i]`` picks replica ``i`` whatever the backend.
    """
    directory = _checkpoint_dir(workdir)
    run, target = build_run(validate(settings))
    ckpt = Checkpointer(directory, keep=settings.keep_checkpoints)
    try:
        step = ckpt.latest_step()
        if step is None:
            raise FileNotFoundError(f"no checkpoint under {directory}.")
        meta = ckpt.read_run_meta(step)
        check_loadable(meta["settings"], run.meta["settings"])  # not "corrupt"
        check_init_model(meta, run.meta, "load the run")
        restored, _ = ckpt.restore(step, target)
    finally:  # its manager's threads and files, also when the checkpoint is refused
        ckpt.close()
    return run.graphdef, jax.tree.map(_auto_axes, restored.params), run.data


def _auto_axes(x: Any) -> Any:
    """``x`` on its devices with every mesh axis auto: indexing an explicit replica axis
    raised JAX's ShardingTypeError ("out sharding could not be resolved")."""
    mesh = getattr(getattr(x, "sharding", None), "mesh", None)
    if not isinstance(mesh, jax.sharding.Mesh):
        return x
    auto = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
    return jax.device_put(x, jax.sharding.NamedSharding(auto, x.sharding.spec))


def _checkpoint_dir(workdir: str | pathlib.Path) -> pathlib.Path:
    """``workdir``'s checkpoint directory, checked before any work (and never created)."""
    workdir = pathlib.Path(workdir).expanduser()
    if not (workdir / "checkpoints").is_dir():
        what = "is a file" if workdir.is_file() else "has no checkpoints/ directory"
        raise FileNotFoundError(f"no checkpoint under {workdir}: it {what}; pass the workdir "
                                f"the run was trained in.")  # fmt: skip
    return workdir / "checkpoints"


def _writable_workdir(workdir: str | pathlib.Path) -> pathlib.Path:
    if not str(workdir).strip():  # Path("") is the current directory
        raise UserError("--workdir is empty; name the run's directory, e.g. "
                        "--workdir=runs/my_run.")  # fmt: skip
    workdir = pathlib.Path(workdir).expanduser()  # --workdir=~/runs/x: no shell expands it
    check_utf8_path("--workdir", workdir)  # it trained until its first save, which failed
    if workdir.exists() and not workdir.is_dir():
        raise UserError(f"--workdir {str(workdir)!r} is a file, not a directory; name a new "
                        f"or existing directory.")  # fmt: skip
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / f".write_probe.{jax.process_index()}.{os.getpid()}"  # one per process
        probe.write_text("ok")
        probe.unlink(missing_ok=True)
    except OSError as err:
        raise ValueError(f"--workdir {str(workdir)!r} is not writable: {err}") from err
    return workdir


# The *.txt files a run writes under its workdir (orbax's commit markers, step 1000's here).
_RUN_TEXT_FILES = tuple(f"checkpoints/1000/{sub}commit_success.txt"
                        for sub in ("", "state/", "meta/"))  # fmt: skip


def _check_outside_corpus(settings: TrainSettings, workdir: pathlib.Path) -> None:
    """Refuses a workdir whose checkpoints the corpus reads: they hold ``*.txt`` files (orbax's
    commit_success.txt), which a later run read as training documents (and this run could not
    resume: its data had changed). A glob that cannot match them ('DIR/**/*.md') is no risk."""
    if settings.data.source != "files" or not settings.data.path:
        return
    if sources.reads_any(settings.data.path, workdir, _RUN_TEXT_FILES):
        raise UserError(
            f"--workdir {str(workdir)!r} lies inside config.data.path={settings.data.path!r}: "
            f"its checkpoints' .txt files would become training text. Put the run's directory "
            f"outside the corpus.")  # fmt: skip


def _run_blocks(run: Run, state: TrainState, step: int, k: int, synced: list | None = None
                ) -> tuple[TrainState, Any]:  # fmt: skip
    """``k`` steps from ``step`` as calls of the two programs; returns the state and [N, k] losses.

    The inner program runs blocks of up to ``run.block`` steps; the sync program runs the
    ``delay + 1`` steps from the step that starts a round's exchange to the one that ends
    the round (one step without delay). Blocks stop where the sync program starts. A
    ``synced`` list gets the guard's reset counters after each sync program.
    """
    losses, end = [], step + k
    while step < end:
        start = end if run.period is None else _window_start(run, step, end)
        if start == step:  # the exchange, the delay's inner steps and the merge
            state, out = _run_window(run, state, step)
            size = run.delay + 1
            if synced is not None:
                synced.append(health.reset_counts(state))
        else:
            size = min(run.block - step % run.block, end - step, start - step)
            run.calls.add(("inner", size))  # each block length compiles once
            state, out = run.inner(state, _next_tokens(run, step, size))
        losses.append(out)
        step += size
    return state, np.concatenate([replicas.to_host(x) for x in losses], axis=1)


def _window_start(run: Run, step: int, end: int) -> int:
    """Steps done when the next sync program starts (its round ends at the next period end)."""
    stop = (step // run.period + 1) * run.period
    start = stop - run.delay - 1
    if start < step or (start == step and stop > end):  # the settings' window rule prevents it
        raise ValueError(f"steps [{step}, {end}) cut the overlap window ending at step {stop} "
                         f"(outer.delay={run.delay}); chunk ends must avoid windows.")
    return start


def _run_window(run: Run, state: TrainState, step: int) -> tuple[TrainState, Any]:
    """The sync program from ``step``: one step, or an overlap window of ``delay + 1`` steps."""
    if not run.delay:
        run.calls.add(("sync", 0))
        return run.sync(state, _next_tokens(run, step, 1))
    stop = step + run.delay + 1  # the step count at which the round ends
    fragment = (stop // run.period - 1) % len(run.sync)
    run.calls.add(("sync", fragment))  # each fragment's window compiles on its first call
    tokens = tuple(_next_tokens(run, t, 1) for t in range(step, stop))
    return run.sync[fragment](state, tokens)


def _train_metrics(run: Run, state: TrainState, step: int, k: int, losses: np.ndarray,
                   seconds: float) -> dict[str, Any]:  # fmt: skip
    """The train record of the ``k`` steps up to ``step``, from their [N, k] losses.

    ``seconds``: the steps' time, less what compiling took (``tokens_per_sec`` is the training's).
    """
    s = run.settings
    n_tokens = k * s.global_batch_size * s.data.seq_len
    losses = np.asarray(losses, np.float64)  # means of float32 losses, without float32 rounding
    finite = np.isfinite(losses)
    guarded = guard_acts(s)
    return {
        # With the guard: the mean over finite replica losses (a replica the guard is
        # resetting is counted apart). Without: a NaN replica makes the loss NaN (both).
        "train_loss": (float(losses[finite].mean()) if finite.any() else float("nan"))
        if guarded else float(losses.mean()),
        "train_loss_last": (float(losses[finite[:, -1], -1].mean()) if finite[:, -1].any() else
                            float("nan")) if guarded else float(losses[:, -1].mean()),
        "train_loss_per_replica": [float(x) for x in losses.mean(1)],
        "nonfinite_replica_steps": int((~finite).sum()),
        "nonfinite_resets": health.nonfinite_resets(state),
        "learning_rate": float(optim_lib.learning_rate_schedule(s.optim, s.num_steps)(step - 1)),
        "tokens_per_sec": n_tokens / seconds,
        **_counts(run, step),
    }


def _counts(run: Run, step: int) -> dict[str, Any]:
    """Tokens seen and bytes sent per replica by ``step``, counted on from the last resize."""
    s = run.settings
    since, tokens, sent = run.counted or (0, 0, 0.0)
    copies = s.num_stages if s.num_stages > 1 and stage_mesh(s) else 1

    def sent_by(steps: int) -> float:
        return optim_lib.bytes_sent(s.method, s.outer, run.params0, num_replicas=s.num_replicas,
                                    steps=steps, fault=s.fault, stage_copies=copies,
                                    devices_per_replica=s.mesh.fsdp * s.mesh.tensor)  # fmt: skip

    before = sent_by(since)  # a run never resized: exactly the direct count
    return {"tokens_seen": tokens + (step - since) * s.global_batch_size * s.data.seq_len,
            "bytes_sent_per_replica": sent_by(step) if sent == before
            else sent + sent_by(step) - before}


def _report_reset(writer: MetricWriter, step: int, total: float, bar: Progress) -> None:
    message = (f"non-finite fast weights caught at a sync by step {step}: the replica was "
               f"excluded from its group and restarted from its slow weights ({total:.0f} so far)")
    writer.write(step, "event", {"event": "nonfinite_reset", "detail": message,
                                 "total": total})  # fmt: skip
    bar.write(f"WARNING: {message}")
