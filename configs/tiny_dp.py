"""Tiny data-parallel baseline on CPU: gradients all-reduced every step (the paper's "FSDP").

    noloco-train --config=configs/tiny_dp.py --workdir=runs/tiny_dp
"""

from configs import common


def get_config():
    c = common.get_config()
    c.method = "dp"
    return c
