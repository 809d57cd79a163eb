"""Fig. 3B after the plan: does the spread follow the lr once the warmup is left out?

    python -m experiments.fig3b_review [--table2 PATH]

The plan's test (``spread_vs_lr``) gives the partial r of the replicas' spread and the inner
learning rate given the step, on NoLoCo's mid-round evaluations, with the p-value of
independent points. Two reasons to doubt it, checked here on the Table 2 runs (``table2.json``,
trains nothing, writes nothing): the two evaluations inside the warmup, where lr and spread
both rise from zero, may carry it; and neighbouring evaluations are autocorrelated. For each
NoLoCo run this prints the partial r on the mid-round evaluations after the warmup, its
p-value for independent points, the lag-1 autocorrelations of both residual series, Bartlett's
effective n for AR(1) residuals and the p-value at that n
(``stats.partial_correlation_ar1``), then the range of r and how many runs stay below 0.05
each way.
"""

from __future__ import annotations

import pathlib
from typing import Sequence

import numpy as np
from absl import flags

from experiments import options
from experiments.spread_vs_lr import series
from noloco_jax.errors import UserError
from noloco_jax.experiments import harness, plan, stats

TABLE2 = flags.DEFINE_string("table2", None, "The table2.json to read (default: the published "
                             "experiments/results/table2.json).")  # fmt: skip


def review(run: dict) -> dict:
    """The after-warmup, mid-round partial r of one run, with and without autocorrelation."""
    config = run["run_info"]["config"]
    steps, spread, rate = series(run)
    keep = (steps % config["outer"]["sync_every"] != 0) & (steps > config["optim"]["warmup_steps"])
    return stats.partial_correlation_ar1(spread[keep], rate[keep], steps[keep])


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    path = pathlib.Path(TABLE2.value) if TABLE2.value else harness.RESULTS / "table2.json"
    runs = options.read_json("table2", path)
    if not isinstance(runs, dict) or not any(name.startswith("noloco_") for name in runs):
        raise UserError(f"--table2: {path} has no NoLoCo runs (noloco_*); give the table2.json "
                        f"that experiments.table2 wrote.")
    rows = {name: review(run) for name, run in sorted(runs.items())
            if name.startswith("noloco_")}  # fmt: skip
    print(harness.md_table(["run", "points", "partial r", "p", "lag-1 spread", "lag-1 lr",
                            "n_eff", "p (n_eff)"],
                           [[name, r["n"], f"{r['r']:.2f}", f"{r['p']:.2g}", f"{r['lag1_x']:.2f}",
                             f"{r['lag1_y']:.2f}", f"{r['n_eff']:.1f}", f"{r['p_eff']:.2g}"]
                            for name, r in rows.items()]))  # fmt: skip
    r = np.array([v["r"] for v in rows.values()])
    below = sum(v["p"] < plan.ALPHA for v in rows.values())
    below_eff = sum(v["p_eff"] < plan.ALPHA for v in rows.values())
    print(f"{len(rows)} NoLoCo runs: partial r {r.min():.2f} to {r.max():.2f}; p < {plan.ALPHA} "
          f"in {below} of {len(rows)} as independent points, in {below_eff} of {len(rows)} at "
          f"the effective n.")  # fmt: skip


if __name__ == "__main__":
    options.run(main)
