"""Metric sinks: a JSONL file, TensorBoard event files and the console."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

__all__ = ["MetricWriter", "read_jsonl"]


class MetricWriter:
    """Appends one JSON object per record to ``workdir/metrics.jsonl`` and to TensorBoard."""

    def __init__(
        self, workdir: str | pathlib.Path, *, tensorboard: bool = True, enabled: bool = True
    ):
        """``enabled=False`` (processes other than 0 in a multi-process run) writes nothing."""
        self.workdir = pathlib.Path(workdir)
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        self._tensorboard = tensorboard

    def _open(self) -> None:
        """Opens the sinks at the first record: a run that writes nothing leaves no new file."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.workdir / "metrics.jsonl", "a", encoding="utf-8")
        if self._tensorboard:
            from tensorboardX import SummaryWriter  # noqa: PLC0415 (optional, slow import)

            self._tb = SummaryWriter(str(self.workdir / "tensorboard"))

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._jsonl is None:
            self._open()
        clean = {k: _jsonable(v) for k, v in values.items()}
        self._jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()

    def close(self) -> None:
        if self._jsonl is None:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any) -> Any:
    try:
        return float(v) if not isinstance(v, (str, bool, int)) else v
    except (TypeError, ValueError):
        return str(v)


def read_jsonl(path: str | pathlib.Path, kind: str | None = None) -> list[dict]:
    """Records of a metrics.jsonl file (optionally only one kind)."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                if kind is None or rec.get("kind") == kind:
                    out.append(rec)
    return out
