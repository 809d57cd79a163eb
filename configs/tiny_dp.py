"""Tiny data-parallel baseline on CPU: gradients all-reduced every step (the paper's "FSDP").

    noloco-train --config=configs/tiny_dp.py --workdir=runs/tiny_dp
"""

from configs import common


def get_config():
    c = common.get_config()
    c.method = "dp"
    c.keep_checkpoints = 1  # one tiny checkpoint is ~160 MB (README: what a checkpoint holds)
    return c
