"""Table 2 in miniature: final validation perplexity of DP, DiLoCo and NoLoCo for N = 4, 8, 16.

    python experiments/table2.py [--jobs 2] [--publish] [--smoke --data-path DIR --out-dir DIR]

Writes table2.{json,md} and table2_fig3a.png (the paper's relative difference
(PPL_DiLoCo - PPL_NoLoCo) / PPL_DP over training, its Fig. 3A) to
experiments/runs/results, or with --publish to experiments/results and
experiments/figures. The grid and the report live in noloco_jax.experiments.table2.
"""

from __future__ import annotations

import argparse

import harness
from noloco_jax.experiments.table2 import CONFIG, grid, report

__all__ = ["CONFIG", "grid", "report", "main"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_common_flags(parser)
    args = parser.parse_args()
    results = harness.run_grid(CONFIG, grid(args.smoke), args,
                               runs_subdir="table2", name="table2")
    harness.write_outputs(args, "table2", results, report(results, args))


if __name__ == "__main__":
    main()
