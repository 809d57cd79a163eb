"""Weights & Biases sink, ``jax.profiler`` traces and per-replica diagnostics for the trainer."""

from __future__ import annotations

import collections
import math
import pathlib
import threading
from typing import Any

import jax
import jax.numpy as jnp

from noloco_jax.optim.trees import is_float
from noloco_jax.replicas import to_host
from noloco_jax.trainer.settings import TrainSettings, parse_profile_steps

__all__ = ["WandbSink", "Profiler", "check_sinks", "compile_seconds", "make_sinks",
           "distance_to_mean", "parse_profile_steps"]  # fmt: skip


# JAX's events for the three stages of making a program: disjoint (a trace is timed only
# when no other trace is under way), so their sum is the time spent compiling.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")  # fmt: skip
_COMPILING: collections.Counter = collections.Counter()  # seconds, per thread


def _count_compile(event: str, duration_secs: float, **_: Any) -> None:
    if event in _COMPILE_EVENTS:
        _COMPILING[threading.get_ident()] += duration_secs


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_seconds() -> float:
    """Seconds this thread has spent tracing, lowering and compiling JAX programs so far.

    The difference across a chunk of steps is the part of its time that is no training
    (``tokens_per_sec`` leaves it out).
    """
    return _COMPILING[threading.get_ident()]


def _import_wandb() -> Any:
    try:
        import wandb  # noqa: PLC0415
    except ImportError as err:
        raise ValueError("config.log.wandb=True needs the wandb package: pip install "
                         "'noloco-jax[wandb]' (or set config.log.wandb=False).") from err
    return wandb


class WandbSink:
    """Mirrors metric records to a Weights & Biases run (``--config.log.wandb=True``).

    Runs offline with ``WANDB_MODE=offline`` (files under ``workdir/wandb``, synced later
    with ``wandb sync``). Scalars go under ``<kind>/<name>``; a per-replica list goes as
    ``<kind>/<name>/r<i>``; strings (events) are left out.

    Args:
      workdir: the run's workdir (W&B files go to ``workdir/wandb``).
      project: the W&B project.
      run_name: the run's display name ("" = W&B's default).
      config: the run settings, stored as the W&B run config.
      resume_id: a stable id so a resumed run continues the same W&B run.

    Raises:
      ValueError: the ``wandb`` package is not installed.
    """

    def __init__(self, workdir: str | pathlib.Path, *, project: str, run_name: str,
                 config: dict, resume_id: str) -> None:  # fmt: skip
        wandb = _import_wandb()
        directory = pathlib.Path(workdir)
        (directory / "wandb").mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project, name=run_name or None, config=config, dir=str(directory),
            id=resume_id, resume="allow",
        )  # fmt: skip

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        """Logs one record's numbers at ``step``."""
        out: dict[str, float] = {}
        for key, value in values.items():
            if isinstance(value, (list, tuple)):
                for i, v in enumerate(value):
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        out[f"{kind}/{key}/r{i}"] = float(v)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                out[f"{kind}/{key}"] = float(value)
        if out:
            self._run.log(out, step=step)

    def close(self) -> None:
        self._run.finish()


def check_sinks(s: TrainSettings) -> None:
    """Raises ``ValueError`` now (before any data or checkpoint work) if W&B is asked for but
    not installed."""
    if s.log.wandb:
        _import_wandb()


def make_sinks(s: TrainSettings, workdir: pathlib.Path) -> list[Any]:
    """The extra metric sinks the settings ask for (W&B), for process 0.

    A resumed run continues the same W&B run (``wandb_run_id``).
    """
    if not s.log.wandb:
        return []
    return [WandbSink(workdir, project=s.log.wandb_project, run_name=s.log.wandb_run_name,
                      config=s.to_dict(), resume_id=wandb_run_id(workdir))]  # fmt: skip


def wandb_run_id(workdir: pathlib.Path) -> str:
    """The workdir's W&B run id, kept in ``workdir/wandb_run_id``: a resume continues its run,
    a fresh run in a reused path gets a new one. A workdir with checkpoints from before the
    file existed keeps the path-derived id it used."""
    import hashlib  # noqa: PLC0415
    import uuid  # noqa: PLC0415

    workdir = pathlib.Path(workdir)
    path = workdir / "wandb_run_id"
    if path.is_file():
        return path.read_text().strip()
    if any((workdir / "checkpoints").glob("[0-9]*")):
        run_id = "noloco-" + hashlib.sha256(str(workdir.resolve()).encode()).hexdigest()[:12]
    else:
        run_id = "noloco-" + uuid.uuid4().hex[:12]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(run_id + "\n")
    return run_id


class Profiler:
    """Writes a ``jax.profiler`` trace of the chunks that run steps in ``[A, B)``.

    Steps are fused in chunks of ``log_every``, so the trace covers whole chunks: it starts
    before the first chunk that contains a step >= A and stops after the chunk that reaches
    B. The trace lands in ``workdir/profile`` (TensorBoard's profile plugin reads it); in a
    run of several processes, each writes its own ``workdir/profile/process_<i>`` (on one
    host, or a shared filesystem, their traces had the same file name and one was lost).
    """

    def __init__(self, profile_steps: str, workdir: str | pathlib.Path) -> None:
        self._window = parse_profile_steps(profile_steps)
        self.directory = pathlib.Path(workdir) / "profile"
        if jax.process_count() > 1:
            self.directory /= f"process_{jax.process_index()}"
        self._active = False

    def before_chunk(self, step: int, end: int) -> None:
        """Called with the chunk's first step and the step it will reach."""
        if self._window is None or self._active:
            return
        a, b = self._window
        if step < b and end > a:
            jax.profiler.start_trace(str(self.directory))
            self._active = True

    def after_chunk(self, step: int) -> None:
        """Called with the step reached."""
        if self._active and step >= self._window[1]:
            self.close()

    def close(self) -> None:
        if self._active:
            jax.profiler.stop_trace()
            self._active = False
            self._window = None  # one trace per run


@jax.jit
def _distances(params: Any) -> jax.Array:
    sq = None
    for x in [x for x in jax.tree.leaves(params) if is_float(x)]:  # weights, as replica_spread
        x = x.astype(jnp.float32)
        # Distances do not change with a shift common to all replicas: taking the replicas'
        # max first makes identical replicas exactly 0 (the mean of equal values rounds: 6e-7
        # at N = 3) and near ones exact (replica_spread subtracts replica 0 the same way).
        r = x - x.max(0, keepdims=True)
        d = jnp.sum(jnp.square(r - r.mean(0, keepdims=True)).reshape(r.shape[0], -1), axis=1)
        sq = d if sq is None else sq + d
    return jnp.sqrt(sq)


def distance_to_mean(params: Any) -> list[float]:
    """Each replica's L2 distance ``||theta_r - mean_r' theta_r'||`` over its weights.

    Integer leaves are left out, as ``replica_spread`` leaves them out (they are no weights,
    and a shared integer scalar has no replica axis).

    Args:
      params: replicated parameters (every float leaf has a leading replica axis N).

    Returns:
      N floats.
    """
    return [float(v) for v in to_host(_distances(params))]
