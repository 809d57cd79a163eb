"""The analysis plan of the paper comparisons, fixed before the runs (issue 23), as data.

Everything a verdict depends on is decided here and read by the grids and the reports:
the training regime of the Table 2 family of runs, the seeds per cell, the control, the
primary metric and the test. ``experiments/README.md`` states the same plan in words; change
both together, and only before the runs they decide.

The regime moves toward the paper's: NoLoCo takes 200 outer rounds (H = 10) and DiLoCo 100
(H = 20) in 2,000 inner steps, warmup 4 % of the steps (the paper: 500 / 250 rounds, warmup
1000 of 25,000 steps). The ``nano`` preset was chosen from the measured cost per run
(``python -m experiments.pilot_cost``; experiments/README.md has the numbers).
Evaluations every 25 steps fall, for DiLoCo (H = 20), on a sync step every 4th time
(steps 100, 200, ...) and mid-round otherwise; for NoLoCo (H = 10) every other time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["REGIME", "METHODS", "SIZES", "SEEDS", "DP_SEEDS", "ALPHA", "LAST_K",
           "PRIMARY", "SECONDARY", "SWEEPS", "SWEEP_SEEDS", "ROUTING", "cell_seeds"]  # fmt: skip

# Applied on top of configs/exp_table2.py by every run of the Table 2 family (table2, sweeps,
# spread_vs_lr, dropout), so that runs they share are one run.
REGIME: dict[str, Any] = {
    "model.preset": "nano",
    "num_steps": 2000,
    "optim.warmup_steps": 80,  # 4 % of the steps
    "log_every": 5,  # divides H = 10 and 20 and the eval cadence
    "eval_every": 25,  # DiLoCo sync step every 4th evaluation, NoLoCo every 2nd
    "checkpoint_every": 500,  # an interrupted run loses at most 500 steps
    "keep_checkpoints": 1,
}

# The methods of a Table 2 cell. ``diloco_h10`` is the control: DiLoCo at NoLoCo's H, so that
# the NoLoCo - DiLoCo difference can be split into method and sync frequency.
METHODS: dict[str, dict[str, Any]] = {
    "dp": {"method": "dp"},
    "diloco": {"method": "diloco", "outer.sync_every": 20, "outer.momentum": 0.3},
    "noloco": {"method": "noloco", "outer.sync_every": 10, "outer.momentum": 0.5},
    "diloco_h10": {"method": "diloco", "outer.sync_every": 10, "outer.momentum": 0.3},
}

SIZES = (4, 8, 16)
SEEDS = {4: 3, 8: 7, 16: 3}  # paired seeds of the outer methods per replica count N
DP_SEEDS = 1  # data parallel: the reference of the DP gap, one seed
ALPHA = 0.05  # two-sided
LAST_K = 3  # the primary metric averages this many evaluations

# Primary: pooled validation PPL (the paper's metric) averaged over the last LAST_K
# evaluations that fall on a sync step of the reference DiLoCo (H = 20), the same steps for
# every method of a cell. Secondary: the same average of NoLoCo's averaged-model PPL.
PRIMARY = "val_ppl"
SECONDARY = "val_ppl_avg_model"

# NoLoCo's own settings, 3 seeds each at N = 8 (the baseline value is the Table 2 run).
SWEEPS: dict[str, tuple[str, tuple[float, ...], float]] = {
    "gamma": ("outer.gamma", (0.3, 1.2, 1.6), 0.7),
    "group_size": ("outer.group_size", (4, 8), 2),
    "sync_every": ("outer.sync_every", (5, 20, 50), 10),
}
SWEEP_SEEDS = 3

# Fig. 4 (random vs fixed routing, no outer steps): replicas, stages of the tiny preset's 4
# blocks, paired seeds.
ROUTING = {"replicas": 8, "stages": 4, "seeds": 3}


def cell_seeds(method: str, n: int, smoke: bool = False) -> tuple[int, ...]:
    """The seeds of one (method, N) cell of Table 2.

    Args:
      method: a key of ``METHODS``.
      n: replicas.
      smoke: the seconds-long test version (2 seeds of NoLoCo and DiLoCo, 1 of the others).

    Returns:
      Seeds 0, 1, ... as many as the plan asks for.
    """
    if method == "dp":
        return tuple(range(DP_SEEDS))
    if smoke:
        return (0, 1) if method in ("noloco", "diloco") else (0,)
    return tuple(range(SEEDS[n]))
