"""Draws loss, validation perplexity and replica spread of one or more runs to a PNG.

    python -m experiments.plot runs/tiny_noloco runs/tiny_diloco   # -> runs/tiny_noloco/curves.png

The PNG goes into the first run's workdir unless --out names another file.

    python -m experiments.plot runs/tiny_noloco --replicas_png replicas.png   # per-replica panels
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402
from matplotlib.backend_bases import FigureCanvasBase  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax.trainer.writers import read_jsonl  # noqa: E402

OUT = flags.DEFINE_string("out", None, "PNG to write (default: <first workdir>/curves.png).")
REPLICAS = flags.DEFINE_string(
    "replicas_png", None, "Also draw the first run's per-replica loss and distance into this PNG.")

PANELS = [
    ("train", "train_loss", "train loss"),
    ("eval", "val_ppl", "validation perplexity (pooled)"),
    ("eval", "replica_spread", "cross-replica weight std"),
]


def last_per_step(records: list[dict]) -> list[dict]:
    """A resumed run logs steps again after its checkpoint: keep the last record per step."""
    by_step = {r["step"]: r for r in records}
    return [by_step[s] for s in sorted(by_step)]


def _lone(recs: list[dict]) -> str | None:
    """A marker for a line of one point (a run with one record), which no line draws."""
    return "o" if len(recs) == 1 else None


def plot_runs(workdirs: list[pathlib.Path], out: pathlib.Path) -> pathlib.Path:
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 3.6))
    for workdir in workdirs:
        path = workdir / "metrics.jsonl"
        for ax, (kind, key, title) in zip(axes, PANELS):
            recs = [r for r in last_per_step(read_jsonl(path, kind)) if key in r]
            ax.plot([r["step"] for r in recs], [r[key] for r in recs], label=workdir.name,
                    marker=_lone(recs))  # fmt: skip
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[1].set_yscale("log")
    axes[0].legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_replicas(workdir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Each replica's train loss and its L2 distance to the replica mean, one line per replica."""
    path = workdir / "metrics.jsonl"
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    panels = [("train", "train_loss_per_replica", "train loss per replica"),
              ("eval", "distance_to_mean_per_replica", "distance to the replica mean (L2)")]
    for ax, (kind, key, title) in zip(axes, panels):
        recs = [r for r in last_per_step(read_jsonl(path, kind)) if key in r]
        # A resized run (allow_resize) changes the number of replicas: each replica's line
        # covers the records that have it.
        for i in range(max((len(r[key]) for r in recs), default=0)):
            have = [r for r in recs if i < len(r[key])]
            ax.plot([r["step"] for r in have], [r[key][i] for r in have], label=f"replica {i}",
                    lw=1, marker=_lone(have))  # fmt: skip
        ax.set_title(title)
        ax.set_xlabel("step")
    if len(axes[0].lines) <= 16:
        axes[0].legend(fontsize=7)
    fig.suptitle(workdir.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def image_path(flag: str, value: str) -> pathlib.Path:
    """The file ``--flag=value`` names: ``~`` expanded (no shell expands it after ``=``) and
    ``.png`` added to a name without a suffix (matplotlib adds it when it saves); refused before
    drawing when it is a folder, has a suffix matplotlib cannot write, or a file is above it."""
    path = pathlib.Path(value).expanduser()
    if path.is_dir():
        raise app.UsageError(f"--{flag}={value}: a folder; name the image file, e.g. "
                             f"{path / 'curves.png'}.")
    if not path.suffix:
        path = path.with_name(path.name + ".png")
    if path.suffix[1:].lower() not in FigureCanvasBase.get_supported_filetypes():
        raise app.UsageError(f"--{flag}={value}: matplotlib cannot write {path.suffix} files; "
                             f"end the name with .png, .pdf or .svg.")
    for folder in path.parents:
        if folder.exists():
            if not folder.is_dir():
                raise app.UsageError(f"--{flag}={value}: {folder} is a file, not a folder.")
            break
    return path


def main(argv: Sequence[str]) -> None:
    """Plots the runs whose workdirs follow the flags on the command line."""
    workdirs = [pathlib.Path(a) for a in argv[1:]]
    if not workdirs:
        raise app.UsageError("name at least one run's workdir: python -m experiments.plot RUN ...")
    for workdir in workdirs:
        if not (workdir / "metrics.jsonl").is_file():
            raise app.UsageError(f"{workdir}: not a run's workdir (no metrics.jsonl); train it "
                                 f"first with noloco-train --workdir={workdir}.")
    out = image_path("out", OUT.value) if OUT.value else workdirs[0] / "curves.png"
    replicas_png = image_path("replicas_png", REPLICAS.value) if REPLICAS.value else None
    print(f"wrote {plot_runs(workdirs, out)}")
    if replicas_png:
        print(f"wrote {plot_replicas(workdirs[0], replicas_png)}")


if __name__ == "__main__":
    options.run(main)
