"""NoLoCo on the paper's noisy quadratic (SGD inner steps): gamma x n grid and inner-lr scaling.

    python -m experiments.quadratic_theory      # ~2 min on 2 CPU cores
"""

from ml_collections import config_dict


def get_config():
    c = config_dict.ConfigDict()
    c.num_replicas = 16
    c.dim = 8
    c.sync_every = 10
    c.num_rounds = 240
    c.learning_rate = 0.7  # beta
    c.momentum = 0.5  # alpha
    c.inner_lr = 0.05  # omega
    c.inner_lrs = (0.1, 0.05, 0.025, 0.0125)
    c.gammas = (0.2, 0.3, 0.45, 0.7, 1.0, 1.2, 1.4, 1.5, 1.6, 1.7, 1.8, 2.2)
    c.group_sizes = (2, 4)
    c.seed = 0
    return c
