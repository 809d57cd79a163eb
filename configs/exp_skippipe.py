"""SkipPipe training in miniature: data parallel over N = 4 pipelines of the tiny Llama.

    python -m experiments.skippipe_training      # ~20 min on 2 CPU cores

The 4 blocks form S = 4 stages of one block; each sequence visits stage 0 and
path_length - 1 others (25 % skip: 3 stages, 50 % skip: 2). SkipPipe all-reduces gradients
inside each stage every iteration, i.e. data parallel; the experiment script sets the skip
fields per run.
"""

from configs import exp_table2


def get_config():
    c = exp_table2.get_config()
    c.method = "dp"
    c.num_replicas = 4
    c.skip.num_stages = 4
    c.skip.path_length = 4  # every stage by default; the experiment sets 3 or 2
    return c
