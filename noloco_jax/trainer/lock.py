"""An exclusive lock on a workdir: one trainer per run directory."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import socket
import warnings

from noloco_jax.errors import UserError, WorkdirLockedError

__all__ = ["WorkdirLock"]


class WorkdirLock:
    """``flock`` on ``<workdir>/.lock``, holding the owner's pid and host.

    The kernel drops the lock when its process dies, so a lock file left by a
    dead process is stale by construction and is simply taken over.

    Args:
      workdir: the run directory (must exist).
    """

    def __init__(self, workdir: str | pathlib.Path) -> None:
        self.path = pathlib.Path(workdir) / ".lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        """Takes the lock or raises ``WorkdirLockedError`` naming the holder (``UserError``
        when the lock file cannot be opened); on a filesystem without file locks it warns and
        goes on unlocked."""
        try:  # a lock file of another user (a run under sudo) or a folder was a traceback
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserError(
                f"--workdir {str(self.path.parent)!r}: its lock file {str(self.path)!r} cannot "
                f"be opened ({type(err).__name__}: {err}); make it this user's (a run of "
                f"another user or under sudo left it) or remove it if no trainer uses the "
                f"workdir, or use another --workdir.") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise WorkdirLockedError(
                f"--workdir {str(self.path.parent)!r} is in use by another trainer "
                f"(pid {holder}); wait for it to finish, stop it, or use another --workdir."
            ) from None
        except OSError as err:  # no flock on this filesystem (e.g. Lustre without -o flock)
            os.close(fd)
            warnings.warn(f"--workdir {str(self.path.parent)!r} cannot be locked ({err}); "
                          f"training without the one-trainer-per-workdir check.")  # fmt: skip
            return
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "WorkdirLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
