"""Exception classes for conditions a user must act on, and the checks that raise them.

``UserError`` is a ``ValueError`` (bad input: the CLI prints the message and
exits with code 2). The ``RuntimeError`` subclasses are failures of the run or
its environment: the CLI exits non-zero, and the message says what was kept.

The ``check_*`` functions are the one family of input checks: each raises
``UserError("<field>: must be <allowed>, got <value>.")``, where the caller names
the field (``"config.outer.sync_every"`` in the settings, ``"sync_every"`` in the
optimizer API). A rule that ties fields together (a group size dividing the replica
count) is one function in the module that needs it, built on these.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, Sequence

__all__ = [
    "check_bool",
    "check_choice",
    "check_int",
    "check_number",
    "check_utf8_path",
    "is_int",
    "require",
    "UserError",
    "WorkdirLockedError",
    "CheckpointSaveError",
    "MetricsWriteError",
    "CorruptCheckpointError",
    "CheckpointRestoreError",
    "TrainingDivergedError",
]


class UserError(ValueError):
    """Bad input or a request the run cannot honour; the message says how to fix it."""


class WorkdirLockedError(UserError):
    """Another live trainer holds the workdir's lock."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoints are untouched."""


class MetricsWriteError(RuntimeError):
    """metrics.jsonl or the TensorBoard files could not be written (a full disk); the
    checkpoints are untouched."""


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's data is damaged (checksum mismatch, missing metadata, bad structure)."""


class CheckpointRestoreError(RuntimeError):
    """A checkpoint could not be read for a reason outside it (memory, permission, I/O)."""


class TrainingDivergedError(RuntimeError):
    """The weights went non-finite in a way the non-finite guard cannot repair."""


def require(ok: bool, field: str, message: str) -> None:
    """Raises ``UserError(f"{field}: {message}")`` unless ``ok``."""
    if not ok:
        raise UserError(f"{field}: {message}")


def is_int(value: Any) -> bool:
    """Whether ``value`` is an integer (Python or NumPy), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(field: str, value: Any, minimum: int = 1, maximum: int | None = None,
              maximum_text: str | None = None) -> int:  # fmt: skip
    """An integer (not a bool) in ``[minimum, maximum]``; returns it as ``int``.

    Args:
      field: the name the message gives the value.
      value: what to check.
      minimum: the smallest allowed value.
      maximum: the largest allowed value; None = no bound.
      maximum_text: how the message writes ``maximum`` (e.g. "2**32 - 1").
    """
    if maximum is None:
        require(is_int(value) and value >= minimum, field,
                f"must be an integer >= {minimum}, got {value!r}.")  # fmt: skip
    else:
        top = maximum_text or maximum
        require(is_int(value) and minimum <= value <= maximum, field,
                f"must be an integer in [{minimum}, {top}], got {value!r}.")  # fmt: skip
    return int(value)


def check_number(field: str, value: Any, low: float = 0, high: float | None = None, *,
                 open_low: bool = False, open_high: bool = False) -> float:  # fmt: skip
    """A finite real number (not a bool) in the interval from ``low`` to ``high``.

    Args:
      field: the name the message gives the value.
      value: what to check.
      low: the lower bound.
      high: the upper bound; None = none.
      open_low: exclude ``low`` itself.
      open_high: exclude ``high`` itself.

    Returns:
      ``float(value)``.
    """
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low)
    if high is None:
        require(ok, field, f"must be a finite number {'>' if open_low else '>='} {low}, got "
                           f"{value!r}.")  # fmt: skip
    else:
        ok = ok and (value < high if open_high else value <= high)
        interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
        require(ok, field, f"must be in {interval}, got {value!r}.")
    return float(value)


def check_choice(field: str, value: Any, allowed: Sequence[Any]) -> None:
    """``value`` is one of ``allowed``."""
    require(value in allowed, field, f"must be one of {list(allowed)}, got {value!r}.")


def check_bool(field: str, value: Any) -> None:
    """``value`` is True or False (not 0 or 1)."""
    require(isinstance(value, bool), field, f"must be True or False, got {value!r}.")


def check_documents(field: str, docs: Any) -> None:
    """``docs`` is a sequence of documents, not one str or bytes (iterated, each character
    was taken for a document of its own); ``TypeError`` naming ``field`` otherwise."""
    if isinstance(docs, (str, bytes)):
        raise TypeError(f"{field} must be a sequence of documents (e.g. a list of str), got one "
                        f"{type(docs).__name__}; pass [{field}] for a single document.")


def check_utf8_path(field: str, path: Any) -> None:
    """A path whose name is UTF-8 text: orbax, tensorstore and array_record take no other.

    A folder named in another encoding (Latin-1 ``caf\\xe9``) reaches Python as lone
    surrogates; a workdir so named trained until its first checkpoint, then failed.

    Args:
      field: the name the message gives the path.
      path: a ``str`` or ``os.PathLike``.
    """
    text = os.fspath(path)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        raise UserError(f"{field}: must be a path whose name is UTF-8 text (orbax, tensorstore "
                        f"and array_record take no other), got '{shown}'; rename the folder or "
                        f"choose another.") from None
