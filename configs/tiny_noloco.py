"""Tiny NoLoCo on CPU: 8 replicas of the ~1M-parameter Llama on offline Shakespeare (bytes).

    noloco-train --config=configs/tiny_noloco.py --workdir=runs/tiny_noloco
    noloco-train --config=configs/tiny_noloco.py:quick --workdir=runs/quick   # a first look

The full run takes about 1.5 minutes on 2 idle CPU cores; validation perplexity falls from ~265
(bytes) to single digits. ``:quick`` trains the same model for 100 steps (sync every 25) in
well under a minute once the corpus is cached.
"""

from configs import common

VARIANTS = ("", "quick")


def get_config(variant: str = ""):
    """The tiny NoLoCo run; ``variant="quick"`` is a shorter first look."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r} of tiny_noloco.py; valid: "
                         f"{[v for v in VARIANTS if v]} (or none).")  # fmt: skip
    c = common.get_config()
    c.keep_checkpoints = 1  # one tiny checkpoint is ~160 MB (README: what a checkpoint holds)
    if variant == "quick":
        c.num_steps = 100
        c.eval_every = 50
        c.checkpoint_every = 100
        c.optim.warmup_steps = 10
        c.outer.sync_every = 25
    return c
