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


def main(argv: list[str]) -> None:
    del argv
    if not flags.FLAGS["verbosity"].present:  # orbax/TFDS log every file at INFO
        logging.set_verbosity(logging.WARNING)
    from noloco_jax.trainer import from_config  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    settings = from_config(_CONFIG.value)
    last = train_and_evaluate(settings, _WORKDIR.value, progress=_PROGRESS.value)
    print(json.dumps({k: v for k, v in last.items()}, indent=1, sort_keys=True))


def run() -> None:
    """Console-script entry point."""
    app.run(main)


if __name__ == "__main__":
    run()
