"""Metric sinks: a JSONL file, TensorBoard event files and the console (with its progress bar)."""

from __future__ import annotations

import errno
import json
import math
import pathlib
import warnings
from typing import Any, Callable, Sequence

from noloco_jax.errors import MetricsWriteError

__all__ = ["MetricWriter", "Progress", "read_jsonl"]


class MetricWriter:
    """Appends one JSON object per record to ``workdir/metrics.jsonl`` and to TensorBoard."""

    def __init__(
        self, workdir: str | pathlib.Path, *, tensorboard: bool = True, enabled: bool = True,
        sinks: Sequence[Any] | Callable[[], Sequence[Any]] = (),
    ):
        """``enabled=False`` (processes other than 0 in a multi-process run) writes nothing.

        ``sinks``: more objects with ``write(step, kind, values)`` and ``close()`` (W&B), or a
        function making them, called at the first record (a run that writes nothing, such as
        one already finished, opens no W&B run).
        """
        self._purge_step: int | None = None
        self.workdir = pathlib.Path(workdir)
        self.enabled = enabled
        self._tensorboard = tensorboard
        self._make_sinks = sinks if callable(sinks) else (lambda: sinks)
        self._sinks: list[Any] = []
        self._jsonl = None
        self._tb = None

    def _open(self) -> None:
        """Opens the sinks at the first record: a run that writes nothing leaves no new file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        path = self.workdir / "metrics.jsonl"
        cut = path.exists() and path.stat().st_size > 0 and _last_byte(path) != b"\n"
        self._jsonl = open(path, "a", encoding="utf-8")
        if cut:  # an earlier session's last line was cut short: keep it a line of its own
            self._jsonl.write("\n")
        if self._tensorboard:
            self._open_tensorboard()
        self._mark_session()
        self._sinks = list(self._make_sinks())

    def _mark_session(self) -> None:
        """A ``session`` record: readers drop what earlier sessions logged after its step."""
        if self._jsonl is not None and self._purge_step is not None:
            start = self._purge_step - 1  # -1: a fresh start, nothing earlier counts
            self._jsonl.write(json.dumps({"step": start, "kind": "session"}) + "\n")

    def _open_tensorboard(self) -> None:
        from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional, slow import)

        self._tb = SummaryWriter(str(self.workdir / "tensorboard"), purge_step=self._purge_step)

    def resume_at(self, step: int) -> None:
        """The run goes on from ``step``: TensorBoard hides what earlier sessions logged after
        it (a run resumed from a checkpoint older than its last records repeats those steps)."""
        self._purge_step = step + 1 if step else 0  # a fresh start: nothing before counts
        self._mark_session()
        if self._tb is not None:  # opened already (a damaged checkpoint was reported)
            self._tb.close()
            self._open_tensorboard()

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        """Logs one record; raises ``MetricsWriteError`` when the disk refuses it (full)."""
        if not self.enabled:
            return
        try:  # a full disk was an OSError traceback
            self._write(step, kind, values)
        except OSError as err:
            raise MetricsWriteError(
                f"could not write the metrics of step {step} under {self.workdir} "
                f"({type(err).__name__}: {err}); the run stopped; the checkpoints already "
                f"written are intact. {_remedy(err)} and run again to resume."
            ) from err

    def _write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if self._jsonl is None:
            self._open()
        clean = {k: _jsonable(v) for k, v in values.items()}
        self._jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                # A per-replica list goes as <kind>/<name>/r<i>, as W&B has it.
                named = ({f"{kind}/{k}/r{i}": x for i, x in enumerate(v)}
                         if isinstance(v, list) else {f"{kind}/{k}": v})  # fmt: skip
                for tag, x in named.items():
                    if isinstance(x, (int, float)) and math.isfinite(x):
                        self._tb.add_scalar(tag, x, step)
            self._tb.flush()
        for sink in self._sinks:
            sink.write(step, kind, clean)

    def close(self) -> None:
        """Closes every sink; raises ``MetricsWriteError`` when the disk refuses what they still
        held (full), as ``write`` does (it was an OSError traceback at the end of a run)."""
        error = None
        sinks, self._sinks = self._sinks, []
        for sink in [*sinks, *(f for f in (self._jsonl, self._tb) if f is not None)]:
            try:
                sink.close()
            except OSError as err:
                error = error or err
        if error is not None:
            raise MetricsWriteError(
                f"could not finish writing the metrics under {self.workdir} "
                f"({type(error).__name__}: {error}); the last records may be missing; the "
                f"checkpoints already written are intact. {_remedy(error)}."
            ) from error


class Progress:
    """The console: a progress bar and the lines printed above it.

    The bar says "compiling…" (no rate, no ETA) until the first chunk of steps is done,
    since that chunk's time is mostly compilation; its rate and ETA count from then on, and
    restart after any later chunk that compiled a program of its own (e.g. the first chunk
    that holds a sync step), so that compile time never enters the ETA.
    Lines go through ``write`` (``tqdm.write``), so they never break into the bar.

    Args:
      enabled: False prints lines only (no bar).
      total: the run's last step.
      initial: the step the run starts (or resumes) at.
      file: the stream of the bar and the lines (default: the bar on stderr, lines on stdout).
      silent: print nothing at all (the other processes of a multi-process run: process 0
        speaks for them).
    """

    COMPILING = "compiling…"

    def __init__(self, enabled: bool, total: int, initial: int, file: Any = None,
                 silent: bool = False) -> None:  # fmt: skip
        self._silent = silent
        self._compiling = True
        self._file = file
        self._total = total
        self._bar = None if not enabled else self._new(
            initial, desc=self.COMPILING, bar_format="{desc} {n_fmt}/{total_fmt} [{elapsed}]")

    def _new(self, initial: int, **kwargs: Any) -> Any:
        """A fresh bar at ``initial``: its clock starts now, and it clears when replaced."""
        from tqdm.auto import tqdm  # noqa: PLC0415

        return tqdm(total=self._total, initial=initial, unit="step", dynamic_ncols=True,
                    file=self._file, leave=False, **kwargs)  # fmt: skip

    def write(self, line: str) -> None:
        """Prints ``line`` above the bar (or alone without one)."""
        if self._silent:
            return
        if self._bar is None:
            print(line, flush=True)
        else:
            self._bar.write(line, file=self._file)  # stdout unless a file was given

    def advance(self, step: int, last: dict[str, Any], compiled: bool = False) -> None:
        """Moves the bar to ``step`` and shows the last train loss and validation perplexity.

        Args:
          step: the step reached.
          last: the latest metrics (``train_loss``, ``val_ppl``).
          compiled: whether the chunk that ended here compiled a program; the rate and ETA
            then count from here.
        """
        if self._bar is None:
            return
        bar = self._bar
        if self._compiling or compiled:  # restart the clock: compile time is not a step's time
            self._compiling = False
            bar.close()
            bar = self._bar = self._new(step)
        else:
            bar.update(step - bar.n)
        post = {"loss": f"{last.get('train_loss', float('nan')):.3f}"}
        if "val_ppl" in last:
            post["val_ppl"] = f"{last['val_ppl']:.2f}"
        bar.set_postfix(post)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.leave = True  # the last bar stays on the console
            self._bar.close()


def _remedy(err: OSError) -> str:
    """What to do about a refused write: free space only helps a full disk or quota."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "Free space"
    return "Make what the error names writable (a file, not a folder)"


def _jsonable(v: Any) -> Any:
    if isinstance(v, (list, tuple)) or getattr(v, "ndim", 0) > 0:
        return [_jsonable(x) for x in list(v)]  # per-replica values
    if getattr(getattr(v, "dtype", None), "kind", "") in ("i", "u", "b"):
        return v.item()  # a NumPy or JAX integer or bool: an exact int or bool, not a float
    try:
        return float(v) if not isinstance(v, (str, bool, int)) else v
    except (TypeError, ValueError):
        return str(v)


def _last_byte(path: pathlib.Path) -> bytes:
    with open(path, "rb") as f:
        f.seek(-1, 2)
        return f.read(1)


def read_jsonl(path: str | pathlib.Path, kind: str | None = None) -> list[dict]:
    """Records of a metrics.jsonl file (optionally only one kind).

    A line cut short (a crash or a full disk while it was written) is skipped with a warning.
    A ``session`` record (a session of the run started at its step) drops the train and eval
    records before it that are past that step: a session killed before its checkpoint, or one
    replaced by a fresh start, logged them (TensorBoard hides them too). Events stay.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                warnings.warn(f"{path}:{number}: skipped a record that is not valid JSON (cut "
                              f"short?): {line[:80]!r}", stacklevel=2)  # fmt: skip
                continue
            if rec.get("kind") == "session":  # events stay: they say what happened
                out = [r for r in out if r.get("kind") == "event" or r["step"] <= rec["step"]]
            elif kind is None or rec.get("kind") == kind:
                out.append(rec)
    return out
