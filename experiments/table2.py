"""Table 2 in miniature: validation perplexity of DP, DiLoCo and NoLoCo for N = 4, 8, 16.

    python -m experiments.table2 [--jobs 2] [--part i/k] [--dry_run] [--publish]
                                 [--smoke --data_path DIR --out_dir DIR]

The grid, the metric and the tests are those of the analysis plan (experiments/README.md,
noloco_jax/experiments/plan.py). Writes table2.{json,md} and table2_fig3a.png (the paper's
relative difference (PPL_DiLoCo - PPL_NoLoCo) / PPL_DP over training, its Fig. 3A, at DiLoCo's
sync steps and mid-round) to experiments/runs/results, or with --publish to
experiments/results and experiments/figures. ``--part i/k`` trains a share of the runs and
writes nothing until the last share is done. The grid and the report live in
noloco_jax.experiments.table2.
"""

from __future__ import annotations

from typing import Sequence

from absl import flags

from experiments import options
from noloco_jax.experiments import harness
from noloco_jax.experiments.table2 import CONFIG, grid, report

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = options.train_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                                 name="table2")  # fmt: skip
    if results is None:
        return
    analysis, md = report(results, opts, options.command("experiments.table2"))
    harness.write_outputs(opts, "table2", {**results, "_analysis": analysis}, md)


if __name__ == "__main__":
    options.run(main)
