"""Fig. 3B in miniature: cross-replica weight spread tracks the inner learning rate.

    python -m experiments.spread_vs_lr [--jobs 2] [--smoke ...]

The paper finds a Pearson correlation of 0.91-0.97 between the spread and the inner learning
rate over training, as its theory (Var ∝ omega^2) predicts. Uses the NoLoCo and DiLoCo runs of
experiments.table2 (trained once, shared). Besides the paper's correlation over all
evaluations, it correlates on the mid-round evaluations only (a sync step resets DiLoCo's
spread to zero, so evaluations alternating between sync and mid-round steps make a
correlation of their own), and against the null a correlation must beat: any schedule that
falls with time correlates with a spread that falls with time, so the learning rate must
explain the spread beyond the step (partial correlation given the step). Writes experiments/results/spread_vs_lr.{json,md}
and experiments/figures/spread_vs_lr.png.
"""

from __future__ import annotations

from typing import Sequence

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from absl import flags  # noqa: E402

from experiments import options  # noqa: E402
from noloco_jax.experiments import harness, stats, table2  # noqa: E402

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
    return stats.pearson(a, b)


def correlations(run: dict, period: int) -> dict:
    """The paper's r over all evaluations, and on the mid-round ones: r with the lr, r with
    the step (the null), and the partial r with the lr given the step."""
    steps, spread, rate = series(run)
    mid = steps % period != 0
    out = {"pearson": pearson(spread, rate), "period": period, "mid_round_points": int(mid.sum()),
           "steps": steps.tolist(), "spread": spread.tolist(), "learning_rate": rate.tolist()}
    if mid.sum() >= 4:
        part = stats.partial_correlation(spread[mid], rate[mid], steps[mid])
        out.update(mid_r_lr=part["r_xy"], mid_r_step=part["r_xc"], mid_partial_lr=part["r"],
                   mid_partial_p=part["p"])  # fmt: skip
    return out


def _row(name: str, st: dict) -> list:
    def f(key):
        return f"{st[key]:.3f}" if key in st else "n/a"

    partial = f"{f('mid_partial_lr')} (p = {st['mid_partial_p']:.2g})" if "mid_partial_lr" in st else "n/a"
    return [name, f"{st['pearson']:.3f}", st["mid_round_points"], f("mid_r_lr"), f("mid_r_step"),
            partial, f"{max(st['spread']):.3g}"]  # fmt: skip


def report(results: dict, opts: harness.Options) -> tuple[dict, str]:
    rows, out = [], {}
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name in sorted(results):
        out[name] = correlations(results[name], table2.sync_period(results[name]))
        rows.append(_row(name, out[name]))
        if name.startswith("noloco"):
            steps, spread, _ = series(results[name])
            ax.plot(steps, spread / spread.max(), label=name, lw=1)
    steps, _, rate = series(results[sorted(results)[0]])
    ax.plot(steps, rate / rate.max(), "k--", label="inner lr (normalised)")
    ax.set_xlabel("inner step")
    ax.set_ylabel("normalised by max")
    ax.set_title("Fig. 3B in miniature: spread vs inner learning rate")
    ax.legend(fontsize=6)
    fig.tight_layout()
    path = harness.save_figure(fig, harness.figure_path(opts, "spread_vs_lr"))
    plt.close(fig)
    cmd = options.command("experiments.spread_vs_lr")
    noloco = [v["mid_partial_lr"] for k, v in out.items()
              if k.startswith("noloco") and "mid_partial_lr" in v]  # fmt: skip
    summary = (f"NoLoCo runs, partial r (lr | step) on mid-round evaluations: from "
               f"{min(noloco):.3f} to {max(noloco):.3f} (median {float(np.median(noloco)):.3f}) "
               f"over {len(noloco)} runs.\n\n") if noloco else ""
    md = (
        "## Spread vs inner learning rate (Fig. 3B)\n\n"
        f"```bash\n{cmd}\n```\n\n"
        "Pooled cross-replica weight std vs the inner learning rate (warmup then cosine decay) "
        "for the NoLoCo and DiLoCo runs of the Table 2 grid. 'all': the paper's Pearson r "
        "over every evaluation after step 0 (paper, NoLoCo: 0.91-0.97). 'mid-round': only "
        "evaluations between the run's own sync steps; r with the lr, r with the step (the null "
        "any decaying schedule would match), and the partial r of spread and lr given the step "
        "(two-sided p, n − 3 degrees of freedom).\n\n"
        + harness.md_table(["run", "r all", "mid-round points", "r (lr)", "r (step)",
                            "partial r (lr | step)", "max spread"], rows)  # fmt: skip
        + "\n" + summary + f"![spread vs lr]({harness.figure_link(opts, path)})\n"
    )
    return out, md


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = options.train_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                                 name="spread_vs_lr")  # fmt: skip
    if results is None:
        return
    out, md = report(results, opts)
    harness.write_outputs(opts, "spread_vs_lr", out, md, runs=results)


if __name__ == "__main__":
    options.run(main)
