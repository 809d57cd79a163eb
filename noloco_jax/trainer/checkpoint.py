"""Orbax checkpoints of the whole replicated training state plus JSON metadata."""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__ = ["Checkpointer"]


class Checkpointer:
    """Saves and restores ``{"state": replicated TrainState, "meta": JSON}``.

    The state holds every replica's params, slow weights, inner and outer
    optimizer states and the step; "meta" holds the settings, the data
    batcher's description and bookkeeping. Restores go onto an abstract target
    (``jax.eval_shape`` of the state), so NamedTuple types and shardings come
    back as they were saved.
    """

    def __init__(self, directory: str | pathlib.Path, *, keep: int = 2):
        self.directory = pathlib.Path(directory).absolute()
        self.keep = keep
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
            item_names=("state", "meta"),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: Any, meta: dict, *, force: bool = True) -> None:
        self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=force,
        )

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
            ),
        )
        return restored["state"], restored["meta"]

    def read_meta(self, step: int) -> dict:
        restored = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return restored["meta"]

    def quarantine(self, step: int) -> pathlib.Path:
        """Renames an unreadable step's directory to ``<step>.corrupt[-k]`` and forgets it."""
        src = self.directory / str(step)
        dst = self.directory / f"{step}.corrupt"
        k = 0
        while dst.exists():
            k += 1
            dst = self.directory / f"{step}.corrupt-{k}"
        src.rename(dst)
        self._manager.reload()
        return dst

    def saving(self) -> bool:
        """Whether an asynchronous save is still being written."""
        return self._manager.is_saving_in_progress()

    def size_bytes(self, step: int) -> int:
        """Bytes on disk of the checkpoint of ``step`` (0 if there is none)."""
        return sum(f.stat().st_size for f in (self.directory / str(step)).rglob("*") if f.is_file())

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def abstract_like(tree: Any) -> Any:
    """Shape/dtype/sharding skeleton of ``tree`` for restoring onto."""
    return jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
