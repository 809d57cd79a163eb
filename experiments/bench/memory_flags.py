"""The flags of the two memory benchmarks (micro_batches, sharded_memory), defined once.

Both read ``--sizes`` and ``--usable``; defined in each, the two could disagree, and importing
both in one process died with absl's DuplicateFlagError. A script lists them with
``flags.declare_key_flag`` (``KEY_FLAGS``) so its ``--help`` shows them.
"""

from __future__ import annotations

from absl import flags

from experiments.bench import common

SIZES = flags.DEFINE_list("sizes", ["small", "medium", "large"], "Paper model sizes.")
flags.register_validator("sizes", lambda v: bool(v) and set(v) <= set(common.PAPER_BATCH),
                         message=f"takes sizes with a paper batch (common.PAPER_BATCH), "
                                 f"comma-separated: {list(common.PAPER_BATCH)}")  # fmt: skip
USABLE = flags.DEFINE_float(
    "usable", 0.9, "Fraction of a chip's memory a program may use (the runtime keeps some).")
flags.register_validator("usable", lambda v: 0 < v <= 1, message="takes a fraction in (0, 1]")

KEY_FLAGS = ("sizes", "usable")
