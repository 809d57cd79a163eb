"""HDEE in miniature: domain experts in three equal-compute ensembles (not a TrainSettings run).

    python -m experiments.hdee            # 3 seeds, 17 domains: 11 min wall, 454 CPU s measured

Experts are the nano Llama (d = 64, 2 blocks, byte vocabulary) with MLP widths S / M / L =
128 / 256 / 384 (S + L = 2 M); T = 150 steps per expert, delta = 75 (easy 75, medium 150,
hard 225 in the heterogeneous-steps ensemble).
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.experiment = "hdee"
    c.model = ml_collections.ConfigDict({"preset": "nano", "vocab_size": 256})
    c.mlp_widths = ml_collections.ConfigDict({"S": 128, "M": 256, "L": 384})
    c.num_chars = 200_000  # per domain, before the 80/10/10 split
    c.seq_len = 64
    c.batch_size = 16
    c.learning_rate = 3e-3
    c.seed_steps = 300  # seed model per size on the mixture of training domains
    c.steps = 150  # T
    c.delta = 75
    c.eval_windows = 64  # per domain and split
    c.seeds = [0, 1, 2]
    # Tiers by measured difficulty: "seed_model" (the M seed model's dev bits/byte, per seed),
    # "ngram" (a byte 3-gram's dev bits/byte) or "zlib" (compressed bits/byte of the train text).
    c.difficulty = "seed_model"
    return c
