"""Table 2 in miniature: DP vs DiLoCo vs NoLoCo on the tiny Llama, offline Shakespeare (bytes).

    python -m experiments.table2            # the grid of the plan: ~3.6 CPU h (experiments/README.md)

Equal inner steps (600) and tokens (32 x 64 per step, split over the N replicas) for every
method. The paper's H = 50 / 100 over 25k steps gives 500 / 250 outer rounds; here H is scaled
to the short run keeping its 1:2 ratio: NoLoCo H = 10 (60 rounds), DiLoCo H = 20 (30 rounds).
The script overrides method, N, seed and the per-method outer settings.

The Table 2 family of experiments (table2, sweeps, spread_vs_lr, dropout) applies the regime of
the analysis plan on top (noloco_jax/experiments/plan.py: nano, 2,000 steps, H = 10 / 20,
experiments/README.md); skippipe_training and routing_ablation use this file as it is.
"""

from configs import common


def get_config():
    c = common.get_config()
    c.num_steps = 600
    c.log_every = 10  # divides both H (10, 20) and the eval cadence: rounds fit the chunks
    c.eval_every = 50
    c.checkpoint_every = 600
    c.keep_checkpoints = 1
    c.backend = "vmap"
    c.outer.sync_every = 10
    return c


METHODS = {
    "dp": {"method": "dp"},
    "diloco": {"method": "diloco", "outer.sync_every": 20, "outer.momentum": 0.3},
    "noloco": {"method": "noloco", "outer.sync_every": 10, "outer.momentum": 0.5},
}
