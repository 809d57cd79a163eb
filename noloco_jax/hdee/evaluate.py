"""Per-domain perplexity of an ensemble of experts under HDEE's weighting rules.

* ``log_average``: HDEE's ``simple_avg``, the mean of the experts' log-probabilities,
  renormalised over the vocabulary (a normalised geometric mean, product of experts).
* ``uniform``: the plain average of the experts' probabilities (a linear mixture), for
  comparison; not one of HDEE's rules.
* ``posterior``: Bayesian weights ∝ prior · prod_{s<t} p_k(x_s), uniform prior.
* ``dev_prior``: the same with a prior estimated on the domain's *dev* split (never the
  test text it is scored on, which would leak; HDEE's code estimates it on the test loader).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp

from noloco_jax import ensemble

__all__ = ["RULES", "rule_perplexities", "posterior_weight_on"]

RULES = ("log_average", "uniform", "posterior", "dev_prior")


def rule_perplexities(
    logp_test_KxWxTxV: jax.Array, targets_WxT: jax.Array, logp_dev_KxWxT: jax.Array
) -> dict[str, float]:
    """Perplexity of the ensemble on the test windows under each rule in ``RULES``.

    Args:
      logp_test_KxWxTxV: the K experts' next-token log-distributions on the test windows.
      targets_WxT: the test windows' next tokens.
      logp_dev_KxWxT: the experts' log-probabilities of the dev windows' tokens (for the prior).
    """
    logp_test_KxWxTxV = jnp.asarray(logp_test_KxWxTxV)
    targets_WxT = jnp.asarray(targets_WxT)
    k, w, t = logp_test_KxWxTxV.shape[:3]
    if targets_WxT.shape != (w, t):
        raise ValueError(f"targets_WxT must have shape {(w, t)}, got {tuple(targets_WxT.shape)}.")
    if logp_dev_KxWxT.ndim != 3 or logp_dev_KxWxT.shape[0] != k or logp_dev_KxWxT.shape[1] < 1:
        raise ValueError(f"logp_dev_KxWxT must be [K={k}, W >= 1, T], got "
                         f"{tuple(logp_dev_KxWxT.shape)}.")  # fmt: skip
    if w < 1:  # the mean over no tokens is NaN, for every rule
        raise ValueError(f"logp_test_KxWxTxV must hold W >= 1 test windows, got "
                         f"{tuple(logp_test_KxWxTxV.shape)} (a split shorter than seq_len + 1?).")
    idx = jnp.broadcast_to(targets_WxT[None, ..., None], (k, w, t, 1)).astype(jnp.int32)
    test = jnp.take_along_axis(logp_test_KxWxTxV, idx, axis=-1)[..., 0]
    prior = ensemble.estimate_prior(logp_dev_KxWxT)
    mixed = {
        "log_average": ensemble.log_average_mixture(logp_test_KxWxTxV, targets_WxT),
        "uniform": ensemble.uniform_mixture(test),
        "posterior": ensemble.posterior_mixture(test),
        "dev_prior": ensemble.posterior_mixture(test, prior),
    }
    return {rule: float(ensemble.perplexity(v)) for rule, v in mixed.items()}


def posterior_weight_on(logp_KxWxT: jax.Array, expert: int) -> float:
    """Mean posterior weight (uniform prior) of ``expert`` after whole windows."""
    k = logp_KxWxT.shape[0]
    if isinstance(expert, bool) or not isinstance(expert, numbers.Integral) or not 0 <= expert < k:
        raise ValueError(f"expert must be an integer in [0, {k}), got {expert!r}.")  # jax clamps
    post = jax.nn.softmax(jnp.sum(logp_KxWxT.astype(jnp.float32), axis=-1), axis=0)  # [K, W]
    return float(post[expert].mean())
