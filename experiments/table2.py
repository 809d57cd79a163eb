"""Table 2 in miniature: final validation perplexity of DP, DiLoCo and NoLoCo for N = 4, 8, 16.

    python -m experiments.table2 [--jobs 2] [--publish] [--smoke --data_path DIR --out_dir DIR]

Writes table2.{json,md} and table2_fig3a.png (the paper's relative difference
(PPL_DiLoCo - PPL_NoLoCo) / PPL_DP over training, its Fig. 3A) to
experiments/runs/results, or with --publish to experiments/results and
experiments/figures. The grid and the report live in noloco_jax.experiments.table2.
"""

from __future__ import annotations

from typing import Sequence

from absl import app, flags

from experiments import options
from noloco_jax.experiments import harness
from noloco_jax.experiments.table2 import CONFIG, grid, report

for _name in options.GRID_FLAGS:
    flags.declare_key_flag(_name)


def main(argv: Sequence[str]) -> None:
    options.start(argv)
    opts = options.grid_options()
    results = harness.run_grid(CONFIG, grid(opts.smoke), opts, runs_subdir="table2",
                               name="table2")  # fmt: skip
    harness.write_outputs(opts, "table2", results, report(results, opts))


if __name__ == "__main__":
    app.run(main)
