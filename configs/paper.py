"""The paper's settings (Kolehmainen et al. 2025, Sec. 4 and Table 1), shared by paper_*.py.

Adam (no weight decay), global-norm clip 1.0, linear warmup over 1000 steps then cosine to
lr/10 at 25,000 steps, sequences of 1024 tokens, NoLoCo H = 50 / alpha = 0.5 vs DiLoCo
H = 100 / alpha = 0.3, beta = 0.7, groups of 2, bf16 compute.

Not the paper's data: the default corpus stays (byte-level Shakespeare, ~4.5 M tokens, seen
~3,000 times in 25,000 steps of small's batch, twice that for medium, four times for large); the
README's "Training runs" shows how to point it at a local C4.
"""

from configs import common

_SIZES = {
    # preset: (peak inner lr, global batch in tokens, data-parallel replicas N). N is that of
    # a Table 2 row: large ran only at N = 16 (the reference's 7b configs: dp_world_size 16).
    "small": (6e-4, 524_288, 8),
    "medium": (2e-4, 1_048_576, 8),
    "large": (1.2e-4, 2_097_152, 16),
}


def paper_config(size: str, method: str = "noloco", num_replicas: int | None = None):
    """The paper's run for one model size and method ("noloco", "diloco", "dp").

    ``num_replicas``: N; None = the size's N of a Table 2 row (8, 8, 16).
    """
    if size not in _SIZES:
        raise ValueError(f"size must be one of {sorted(_SIZES)}, got {size!r}.")
    lr, batch_tokens, replicas = _SIZES[size]
    c = common.get_config()
    c.method = method
    c.num_replicas = replicas if num_replicas is None else num_replicas
    c.num_steps = 25_000
    c.log_every = 50
    c.eval_every = 500
    c.checkpoint_every = 1000
    c.model.preset = size
    c.model.dtype = "bfloat16"
    c.data.seq_len = 1024
    c.data.eval_windows = 512
    c.global_batch_size = batch_tokens // c.data.seq_len
    c.optim.learning_rate = lr
    c.optim.warmup_steps = 1000
    c.optim.min_lr_ratio = 0.1
    c.optim.clip_norm = 1.0
    if method == "diloco":
        c.outer.sync_every, c.outer.momentum = 100, 0.3
    else:
        c.outer.sync_every, c.outer.momentum = 50, 0.5
    c.outer.learning_rate = 0.7
    return c
