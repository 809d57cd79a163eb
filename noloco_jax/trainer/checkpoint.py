"""Orbax checkpoints of the whole replicated training state plus JSON metadata.

Every save records a checksum of each array in the metadata and every restore
verifies it, so damaged bytes (bit rot, a partial copy) are reported as a
corrupt checkpoint instead of being trained on. A failed save raises
``CheckpointSaveError`` at once and leaves no orbax thread behind.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import logging
import pathlib
import sys
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from noloco_jax.errors import CheckpointRestoreError, CheckpointSaveError, CorruptCheckpointError
from noloco_jax.replicas import to_host

__all__ = ["Checkpointer", "abstract_like", "fingerprint", "is_environment_error"]

# Errors of the machine, not of the checkpoint's bytes: restoring stops, nothing is set aside.
_ENV_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EIO, errno.ENOSPC, errno.ENOMEM,
                         errno.EROFS, errno.EDQUOT, errno.ESTALE, errno.ETIMEDOUT,
                         errno.EMFILE, errno.ENFILE})  # fmt: skip
_ENV_MARKERS = ("RESOURCE_EXHAUSTED", "PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED",
                "Out of memory", "out of memory", "Permission denied",
                "os_error_code='13'", "os_error_code='5'", "os_error_code='28'")  # fmt: skip


def is_environment_error(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is the machine's fault.

    Out of memory, permission and I/O errors say nothing about the checkpoint's
    data, so a checkpoint that fails with one must not be set aside as corrupt.

    Args:
      err: the exception raised while reading a checkpoint.

    Returns:
      True for memory, permission and I/O errors; False for anything else
      (missing files, bad bytes, a wrong structure), which means corrupt data.
    """
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if (isinstance(err, (MemoryError, PermissionError))
                or (isinstance(err, OSError) and err.errno in _ENV_ERRNOS)
                or any(marker in str(err) for marker in _ENV_MARKERS)):  # fmt: skip
            return True
        err = err.__cause__ or err.__context__
    return False


def _leaf_fingerprint(x: jax.Array) -> jax.Array:
    """Two wrapping uint32 sums of the leaf's raw bits: plain and position-weighted.

    Any single flipped bit changes both sums (the weights are odd), and a
    permutation of values changes the weighted one.
    """
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.uint8)
    uint = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = jax.lax.bitcast_convert_type(x, uint).astype(jnp.uint32).reshape(-1)
    weights = jnp.arange(bits.size, dtype=jnp.uint32) * jnp.uint32(2654435761) | jnp.uint32(1)
    return jnp.stack([bits.sum(dtype=jnp.uint32), (bits * weights).sum(dtype=jnp.uint32)])


_fingerprints = jax.jit(lambda tree: jax.tree.map(_leaf_fingerprint, tree))


def fingerprint(tree: Any) -> dict[str, str]:
    """Checksums of every array in ``tree``, keyed by its path.

    Args:
      tree: a pytree of (possibly sharded) arrays.

    Returns:
      ``{path: "xxxxxxxx-xxxxxxxx"}`` (two hex uint32 sums per leaf).
    """
    sums = jax.tree_util.tree_flatten_with_path(_fingerprints(tree))[0]
    return {jax.tree_util.keystr(path): "{:08x}-{:08x}".format(*to_host(value))
            for path, value in sums}  # fmt: skip


class Checkpointer:
    """Saves and restores ``{"state": replicated TrainState, "meta": JSON}``.

    The state holds every replica's params, slow weights, inner and outer
    optimizer states and the step; "meta" holds the settings, the data
    batcher's description, bookkeeping and the arrays' checksums. Restores go
    onto an abstract target (``jax.eval_shape`` of the state), so NamedTuple
    types and shardings come back as they were saved.

    Args:
      directory: where the step directories go.
      keep: how many checkpoints to keep.
      probe: check at once that ``directory`` is a writable directory (a
        trainer's first save may be far away); raises ``CheckpointSaveError``.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 2, probe: bool = False):
        self.directory = pathlib.Path(directory).absolute()
        self.keep = keep
        self._pending: int | None = None  # the step of the last save started
        _no_orbax_tracebacks()
        if probe:
            _probe_writable(self.directory)
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True,
                # Synchronous directory creation: when it fails, save() raises at once
                # (asynchronous creation left threads waiting 20 minutes for it).
                async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
            ),
            # Handlers, not names: item_metadata (the saved dtypes) needs them before a restore.
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()},
        )  # fmt: skip

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Starts an asynchronous save; raises ``CheckpointSaveError`` if it cannot start.

        Errors of the asynchronous part surface in ``check`` or ``close``.
        """
        self.wait()  # orbax would wait for the previous save anyway; its error names its step
        meta = {**meta, "checksums": fingerprint(state)}
        self._pending = step
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._reported(lambda: self._manager.save(step, args=args, force=True))

    def check(self) -> None:
        """Raises ``CheckpointSaveError`` if a finished asynchronous save failed.

        Orbax's ``check_for_errors`` missed a failed write (its save thread keeps the error);
        waiting on a save that is no longer in progress returns at once or raises it.
        """
        if not self.saving():
            self.wait()
        self._reported(self._manager.check_for_errors)

    def _reported(self, call: Callable[[], Any]) -> None:
        """Runs ``call``; any failure to write is raised as a ``CheckpointSaveError``."""
        try:
            call()
        except Exception as err:  # noqa: BLE001 - any failure to write is reported the same way
            raise self._save_error(err) from err

    def _save_error(self, err: Exception) -> CheckpointSaveError:
        step = self._pending
        # Orbax's list and the disk: the list has already dropped the step the save would
        # replace, and the disk may be gone (a file where the directory was).
        on_disk = {int(p.name) for p in self.directory.glob("*") if p.name.isdigit()}
        good = sorted((on_disk | set(self.all_steps())) - {step})
        kept = (f"the checkpoint of step {good[-1]} is intact" if good else
                "there is no earlier checkpoint")  # was "the run stopped and no earlier checkpoint"
        again = "to resume" if good else "(it starts from step 0)"
        what = f"of step {step} " if step is not None else ""
        return CheckpointSaveError(
            f"could not write the checkpoint {what}under {self.directory} "
            f"({type(err).__name__}: {str(err)[:300]}); the run stopped and {kept}. Fix the "
            f"directory (space, inodes, a file in its place) and run again {again}."
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restores and verifies step ``step``, then casts it to ``abstract_state``'s dtypes.

        Float arrays are read in the dtype they were saved in (their checksums are of those
        bytes) and then cast: a bf16-param checkpoint written before Adam's moments were
        widened to float32 (d91698f) resumes with its moments widened exactly.

        Raises:
          CorruptCheckpointError: the data is damaged (checksums differ, bad
            bytes or structure, missing files).
          CheckpointRestoreError: memory, permission or I/O errors.
        """
        error = None
        with _quiet_abandoned_reads() as failed:
            try:
                saved = self._saved_dtypes(step, abstract_state)
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(saved), meta=ocp.args.JsonRestore()
                    ),
                )
            except Exception as err:  # noqa: BLE001 - classified below
                # Keep only the message: err's frames must die inside the block (its docstring).
                error = _restore_error(self.directory, step, err)
                failed.append(error)
        if error is not None:
            raise _stop_every_process(step, self.directory, error)
        state, meta = restored["state"], restored["meta"]
        _verify(state, meta, step)
        return _cast_like(state, abstract_state), meta

    def _saved_dtypes(self, step: int, abstract_state: Any) -> Any:
        """``abstract_state`` with each float leaf in the float dtype it was saved in."""
        meta = jax.tree.leaves(self._manager.item_metadata(step)["state"])
        saved = {m.name: m.dtype for m in meta if isinstance(getattr(m, "dtype", None), np.dtype)}

        def as_saved(x: Any, name: str) -> Any:
            dtype = saved.get(name, x.dtype)
            if not _float_cast(dtype, x.dtype):
                return x
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=getattr(x, "sharding", None))

        names = ocp.tree.get_param_names(abstract_state, include_empty_nodes=False)
        return jax.tree.map(as_saved, abstract_state, names)

    def read_meta(self, step: int) -> dict:
        """The JSON metadata of ``step`` (same errors as ``restore``)."""
        try:
            restored = self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception as err:  # noqa: BLE001
            raise _restore_error(self.directory, step, err) from err
        meta = restored["meta"]
        if not isinstance(meta, dict):
            raise CorruptCheckpointError(f"checkpoint {step}: its metadata is not a JSON object.")
        return meta

    def read_run_meta(self, step: int) -> dict:
        """``read_meta``, refused as corrupt when it lacks what a resume reads (the settings,
        with the replica count the arrays' shapes need, and the batcher's position)."""
        meta = self.read_meta(step)
        missing = [k for k in ("settings", "batcher") if not isinstance(meta.get(k), dict)]
        if not missing and "num_replicas" not in meta["settings"]:
            missing = ["settings.num_replicas"]
        if missing:
            raise CorruptCheckpointError(f"checkpoint {step}: its metadata lacks {missing}.")
        return meta

    def quarantine(self, step: int) -> pathlib.Path:
        """Renames an unreadable step's directory to ``<step>.corrupt[-k]`` and forgets it.

        With several processes on one shared directory, process 0 renames it while the others
        wait, so every process names the same directory and none renames a missing one.
        """
        _barrier(f"noloco_quarantine_{step}_start")
        src = self.directory / str(step)
        dst = self.directory / f"{step}.corrupt"
        k = 0
        while dst.exists():
            k += 1
            dst = self.directory / f"{step}.corrupt-{k}"
        if _first_process():
            src.rename(dst)
        _barrier(f"noloco_quarantine_{step}_done")
        self._manager.reload()
        return dst

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._manager.is_saving_in_progress()

    def size_bytes(self, step: int) -> int:
        """Bytes on disk of the checkpoint of ``step`` (0 if there is none)."""
        return sum(f.stat().st_size for f in (self.directory / str(step)).rglob("*") if f.is_file())

    def set_aside(self) -> list[pathlib.Path]:
        """Step directories set aside as corrupt by earlier runs (none if there is no directory);
        one that cannot be listed raises, never read as none set aside (a silent restart)."""
        if not self.directory.is_dir():
            return []
        return sorted(p for p in self.directory.iterdir() if ".corrupt" in p.name)

    def wait(self) -> None:
        self._reported(self._manager.wait_until_finished)

    def close(self) -> None:
        """Waits for the last save, then releases orbax's threads even when it failed."""
        error = None
        for call in (self._manager.wait_until_finished, self._manager.close):
            try:
                call()
            except Exception as err:  # noqa: BLE001
                error = error or err
        if error is not None:
            raise self._save_error(error) from error


def _barrier(name: str) -> None:
    """Waits until every process gets here (nothing to wait for with one process)."""
    if _several_processes():
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices(name)


def _first_process() -> bool:
    return jax.process_index() == 0


def _several_processes() -> bool:
    return jax.process_count() > 1


def _stop_every_process(step: int, directory: pathlib.Path, err: Exception) -> Exception:
    """A read error of this process alone, in a run of several: stop, do not set it aside.

    The others read their parts and went on into the next collective; they cannot be told to
    go back to an older checkpoint, so every process stops (they fail as this one exits).
    """
    if not _several_processes() or not isinstance(err, CorruptCheckpointError):
        return err
    return CheckpointRestoreError(
        f"checkpoint {step} could not be read in this run of several processes ({_brief(err)}); "
        f"one process cannot go back to an older checkpoint alone, so every process stops. "
        f"Move {directory / str(step)} out of {directory} (the previous checkpoint is then "
        f"used) and start every process again.")


def _drop_orbax_traceback(record: logging.LogRecord) -> bool:
    """Keeps an orbax error's line but not its traceback: the run reports the error itself."""
    if "orbax" in record.pathname and record.levelno >= logging.ERROR:
        record.exc_info, record.exc_text = None, None
    return True


def _no_orbax_tracebacks() -> None:
    """A failed background save logged two tracebacks (40 lines) before the run's message."""
    log = logging.getLogger("absl")
    if _drop_orbax_traceback not in log.filters:
        log.addFilter(_drop_orbax_traceback)


def _probe_writable(directory: pathlib.Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".write_probe_{jax.process_index()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        raise CheckpointSaveError(
            f"checkpoints cannot be written under {directory} ({type(err).__name__}: {err}); "
            f"fix or remove that path and run again."
        ) from err


@contextlib.contextmanager
def _quiet_abandoned_reads() -> Iterator[list]:
    """Silences the read tasks orbax abandons when one read of a damaged checkpoint fails.

    Each would print its traceback and TensorStore spec (hundreds of lines) when collected;
    the caller reports the failure itself, in one line, and must drop the error's traceback
    inside this block and append it to the yielded list, so that the reads are collected here.
    A read that succeeded abandons nothing, and skips the collection: a full ``gc.collect``
    takes seconds in a process that holds many compiled programs (1.5 s each in the tests).
    Reads still in flight report later, when TensorStore finishes them or the collector closes
    them: after a failure, the process's hook drops those reports (``_abandoned_read``).
    """
    log = logging.getLogger("asyncio")
    level, hook = log.level, sys.unraisablehook
    log.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda _: None
    failed: list = []
    try:
        yield failed
    finally:
        if failed:
            gc.collect()  # the abandoned tasks report (here, silently) when collected
        sys.unraisablehook = _dropping_abandoned_reads(hook) if failed else hook
        log.setLevel(level)


def _abandoned_read(unraisable: Any) -> bool:
    """Whether an unraisable exception reports an orbax read that a failed restore abandoned:
    its coroutine (one shard's read) closed by the collector, or TensorStore's callback into
    the event loop the restore had closed."""
    if getattr(unraisable.object, "__name__", None) == "_read_array_index_and_device_put":
        return True
    tb = unraisable.exc_traceback
    return (isinstance(unraisable.exc_value, RuntimeError) and tb is not None
            and str(unraisable.exc_value) == "Event loop is closed"
            and tb.tb_frame.f_code.co_name == "call_soon_threadsafe")  # fmt: skip


def _dropping_abandoned_reads(hook: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``hook`` for every unraisable exception but the reports of abandoned reads."""
    if getattr(hook, "drops_abandoned_reads", False):
        return hook

    def drop(unraisable: Any) -> None:
        if not _abandoned_read(unraisable):
            hook(unraisable)

    drop.drops_abandoned_reads = True  # type: ignore[attr-defined]
    return drop


def _brief(err: Exception) -> str:
    """The error's first line, without TensorStore's spec dump."""
    text = str(err).split(" See full TensorStore details")[0]
    return text.strip().splitlines()[0][:300] if text.strip() else type(err).__name__


def _restore_error(directory: pathlib.Path, step: int, err: Exception) -> Exception:
    if is_environment_error(err):
        return CheckpointRestoreError(
            f"could not read the checkpoint of step {step} under {directory} "
            f"({type(err).__name__}: {_brief(err)}). This is an error of the machine "
            f"(memory, permission, I/O), not of the checkpoint: nothing was changed. Fix it "
            f"and run again."
        )
    return CorruptCheckpointError(f"checkpoint {step}: {type(err).__name__}: {_brief(err)}")


def _verify(state: Any, meta: dict, step: int) -> None:
    """Compares the restored arrays' checksums with the saved ones (if recorded)."""
    saved = meta.get("checksums") if isinstance(meta, dict) else None
    if saved is None:
        return  # written before checksums were recorded
    now = fingerprint(state)
    bad = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
    if bad:
        raise CorruptCheckpointError(
            f"checkpoint {step}: {len(bad)} array(s) differ from their saved checksums "
            f"(first: {bad[0]}); its bytes are damaged."
        )


def _float_cast(a: Any, b: Any) -> bool:
    """Whether dtypes ``a`` and ``b`` are two different float dtypes (the casts restore makes)."""
    return a != b and jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating)


def _cast_like(state: Any, abstract_state: Any) -> Any:
    """``state``'s float leaves cast to ``abstract_state``'s float dtypes where they differ
    (the leaves ``_saved_dtypes`` read as saved); any other leaf is kept as restored (a PRNG
    key, which ``abstract_like`` describes as uint32, has no ``astype``)."""
    return jax.tree.map(lambda x, t: x.astype(t.dtype) if _float_cast(x.dtype, t.dtype) else x,
                        state, abstract_state)  # fmt: skip


def abstract_like(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of ``tree`` for restoring onto."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
