"""Command-line entry point: ``noloco-train`` or ``python -m noloco_jax.train``.

    noloco-train --config=configs/tiny_noloco.py --workdir=runs/tiny_noloco \
        --config.num_replicas=4 --config.outer.group_size=2

Intentionally short: flags in, typed settings out, the loop lives in
``noloco_jax.trainer``. Restarting with the same --workdir resumes.
"""

from __future__ import annotations

import json
import pathlib
import sys

_REPO = pathlib.Path(__file__).resolve().parents[1]
if (_REPO / "configs").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # config files import shared defaults as `configs.common`

import os  # noqa: E402

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
    "config",
    str(_REPO / "configs" / "tiny_noloco.py"),
    "Experiment config file (a get_config() returning a ConfigDict).",
    lock_config=True,
)
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/tiny_noloco", "Checkpoints and metrics go here; an existing run resumes."
)
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None,
    "host:port of process 0 for multi-process training (jax.distributed); unset = one process "
    "(or auto-detected on Slurm/TPU pods with --distributed).")  # fmt: skip
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Call jax.distributed.initialize() with cluster auto-detection.")


def main(argv: list[str]) -> None:
    del argv
    if not flags.FLAGS["verbosity"].present:  # orbax/TFDS log every file at INFO
        logging.set_verbosity(logging.WARNING)
    _maybe_initialize_distributed()
    from noloco_jax.trainer import from_config  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    settings = from_config(_CONFIG.value)
    last = train_and_evaluate(settings, _WORKDIR.value, progress=_PROGRESS.value)
    print(json.dumps({k: v for k, v in last.items()}, indent=1, sort_keys=True))


def _maybe_initialize_distributed() -> None:
    """Joins a multi-process run before JAX touches any device."""
    if _COORDINATOR.value is None and not _DISTRIBUTED.value:
        return
    import jax  # noqa: PLC0415

    if _COORDINATOR.value is None:
        jax.distributed.initialize()  # Slurm, TPU pods, GCE: detected from the environment
        return
    if _NUM_PROCESSES.value is None or _PROCESS_ID.value is None:
        raise app.UsageError("--coordinator_address needs --num_processes and --process_id.")
    if not 0 <= _PROCESS_ID.value < _NUM_PROCESSES.value:
        raise app.UsageError(
            f"--process_id={_PROCESS_ID.value} must be in [0, --num_processes="
            f"{_NUM_PROCESSES.value}).")  # fmt: skip
    jax.distributed.initialize(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
    )


def run() -> None:
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
