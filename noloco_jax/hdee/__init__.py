"""HDEE in miniature: offline domains of measured difficulty, embarrassingly parallel domain
experts in homogeneous and heterogeneous equal-compute ensembles, and their evaluation.

References:
  HDEE: heterogeneous domain expert ensembles, arXiv 2502.19385. How this miniature and its
  analysis plan differ from HDEE's released configs: experiments/README.md, section 7.
"""

from noloco_jax.hdee.domains import (
    HELD_OUT_DOMAINS,
    TRAINING_DOMAINS,
    DomainSplits,
    assign_tiers,
    difficulty_bits_per_byte,
    make_domains,
    ngram_bits_per_byte,
)
from noloco_jax.hdee.evaluate import RULES, posterior_weight_on, rule_perplexities
from noloco_jax.hdee.experts import (
    ENSEMBLES,
    ExpertPlan,
    compute,
    plan_ensemble,
    size_config,
    token_logprobs,
    train_group,
)

__all__ = [
    "HELD_OUT_DOMAINS", "TRAINING_DOMAINS", "DomainSplits", "assign_tiers",
    "difficulty_bits_per_byte", "make_domains", "ngram_bits_per_byte", "RULES", "posterior_weight_on",
    "rule_perplexities", "ENSEMBLES", "ExpertPlan", "compute", "plan_ensemble", "size_config",
    "token_logprobs", "train_group",
]  # fmt: skip
