"""The paper's Fig. 4 ablation in miniature, and pipelines vs none for NoLoCo/DiLoCo.

    python -m experiments.routing_ablation      # ~15 min on 2 CPU cores

Tiny Llama (4 layers). Ablation: no outer steps at all (method "local": independent
replicas), random vs fixed routing between stages, at N = 8 replicas of S = 4 stages of one
block, 3 paired seeds (``plan.ROUTING``; the script sets these). Then NoLoCo and DiLoCo with
PP = 2 (random routing) vs PP = 1 at N = 4, the defaults below, reusing the Table 2 settings.
"""

from configs import exp_table2


def get_config():
    c = exp_table2.get_config()
    c.num_replicas = 4
    c.num_stages = 2
    return c
