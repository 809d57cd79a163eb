"""Tiny DiLoCo baseline on CPU: all-reduce outer step every H = 100 steps, alpha = 0.3.

    noloco-train --config=configs/tiny_diloco.py --workdir=runs/tiny_diloco
"""

from configs import common


def get_config():
    c = common.get_config()
    c.method = "diloco"
    c.outer.sync_every = 100
    c.outer.momentum = 0.3
    c.keep_checkpoints = 1  # one tiny checkpoint is ~160 MB (README: what a checkpoint holds)
    return c
