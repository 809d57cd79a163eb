"""Per-domain perplexity of an ensemble of experts under HDEE's three weighting rules.

* ``uniform``: the plain average of the experts' next-token probabilities (log-sum-exp of
  their log-probs minus log K), HDEE's "simple average".
* ``posterior``: Bayesian weights ∝ prior · prod_{s<t} p_k(x_s), uniform prior.
* ``dev_prior``: the same with a prior estimated on the domain's *dev* split (never the
  test text it is scored on, which would leak).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from noloco_jax import ensemble

__all__ = ["RULES", "rule_perplexities", "posterior_weight_on"]

RULES = ("uniform", "posterior", "dev_prior")


def rule_perplexities(logp_test_KxWxT: jax.Array, logp_dev_KxWxT: jax.Array) -> dict[str, float]:
    """Perplexity of the ensemble on the test windows under each rule in ``RULES``."""
    prior = ensemble.estimate_prior(logp_dev_KxWxT)
    mixed = {
        "uniform": ensemble.uniform_mixture(logp_test_KxWxT),
        "posterior": ensemble.posterior_mixture(logp_test_KxWxT),
        "dev_prior": ensemble.posterior_mixture(logp_test_KxWxT, prior),
    }
    return {rule: float(ensemble.perplexity(v)) for rule, v in mixed.items()}


def posterior_weight_on(logp_KxWxT: jax.Array, expert: int) -> float:
    """Mean posterior weight (uniform prior) of ``expert`` after whole windows."""
    post = jax.nn.softmax(jnp.sum(logp_KxWxT.astype(jnp.float32), axis=-1), axis=0)  # [K, W]
    return float(post[expert].mean())
