"""Exception classes the trainer raises for conditions a user must act on.

``UserError`` is a ``ValueError`` (bad input: the CLI prints the message and
exits with code 2). The ``RuntimeError`` subclasses are failures of the run or
its environment: the CLI exits non-zero, and the message says what was kept.
"""

from __future__ import annotations

__all__ = [
    "UserError",
    "WorkdirLockedError",
    "CheckpointSaveError",
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


class CorruptCheckpointError(RuntimeError):
    """A checkpoint's data is damaged (checksum mismatch, missing metadata, bad structure)."""


class CheckpointRestoreError(RuntimeError):
    """A checkpoint could not be read for a reason outside it (memory, permission, I/O)."""


class TrainingDivergedError(RuntimeError):
    """The weights went non-finite in a way the non-finite guard cannot repair."""
