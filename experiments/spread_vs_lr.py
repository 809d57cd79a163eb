"""Fig. 3B in miniature: cross-replica weight spread tracks the inner learning rate.

    python -m experiments.spread_vs_lr [--jobs 2] [--smoke ...]

The paper finds a Pearson correlation of 0.91-0.97 between the spread and the inner learning
rate over training, as its theory (Var ∝ omega^2) predicts. Uses the NoLoCo runs of
experiments.table2 (trained once, shared). Writes experiments/results/spread_vs_lr.{json,md}
and experiments/figures/spread_vs_lr.png.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import app, flags  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax.experiments import harness, table2  # noqa: E402

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)

CONFIG = harness.ROOT / "configs" / "exp_table2.py"


def grid(smoke: bool) -> list[harness.Run]:
    return [r for r in table2.grid(smoke) if r.name.startswith(("noloco", "diloco"))]


def series(run: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps, spread, learning rate) at every evaluation after step 0."""
    lr = {r["step"]: r["learning_rate"] for r in run["train"]}
    pts = [(r["step"], r["replica_spread"], lr[r["step"]]) for r in run["eval"] if r["step"] in lr]
    steps, spread, rate = map(np.asarray, zip(*pts))
    return steps, spread, rate


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def report(results: dict, opts: harness.Options) -> tuple[dict, str]:
    rows, stats = [], {}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in sorted(results):
        steps, spread, rate = series(results[name])
        r = pearson(spread, rate)
        stats[name] = {"pearson": r, "steps": steps.tolist(), "spread": spread.tolist(),
                       "learning_rate": rate.tolist()}  # fmt: skip
        rows.append([name, r, float(spread.max()), int(steps[spread.argmax()])])
        if name.startswith("noloco"):
            ax.plot(steps, spread / spread.max(), label=name, lw=1)
    steps, _, rate = series(results[sorted(results)[0]])
    ax.plot(steps, rate / rate.max(), "k--", label="inner lr (normalised)")
    ax.set_xlabel("inner step")
    ax.set_ylabel("normalised by max")
    ax.set_title("Fig. 3B in miniature: spread vs inner learning rate")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = harness.save_figure(fig, harness.figure_path(opts, "spread_vs_lr"))
    plt.close(fig)
    noloco = [v["pearson"] for k, v in stats.items() if k.startswith("noloco")]
    cmd = "python -m experiments.spread_vs_lr" + (" --smoke" if opts.smoke else "")
    md = (
        "## Spread vs inner learning rate (Fig. 3B)\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "Pearson correlation, over the evaluations after step 0, between the pooled "
        "cross-replica weight std and the inner learning rate (warmup then cosine decay), for "
        "the NoLoCo and DiLoCo runs of the Table 2 grid. Paper (NoLoCo): 0.91-0.97.\n\n"
        + harness.md_table(["run", "Pearson r", "max spread", "step of max"], rows)
        + f"\nNoLoCo runs: r from {min(noloco):.3f} to {max(noloco):.3f} "
        f"(median {float(np.median(noloco)):.3f}).\n\n"
        f"![spread vs lr](../figures/{path.name})\n"
    )
    return stats, md


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = harness.run_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                               name="spread_vs_lr")  # fmt: skip
    stats, md = report(results, opts)
    harness.write_outputs(opts, "spread_vs_lr", stats, md)


if __name__ == "__main__":
    app.run(main)
