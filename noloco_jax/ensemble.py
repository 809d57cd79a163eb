"""Ensembles of K language models scored token by token.

``uniform_mixture`` and ``posterior_mixture`` take ``logp_KxBxT``: each model's
log-probability of the actual next token, ``log p_k(x_t | x_<t)``, for K models,
B sequences, T positions, and return the ensemble's log-probability of the same
tokens, [B, T]. They are vectorised over models and numerically stable (log-sum-exp throughout).

* ``uniform_mixture``: p(x_t) = (1/K) sum_k p_k(x_t). A proper distribution
  over the vocabulary because each p_k is.
* ``posterior_mixture``: Bayesian model averaging over whole sequences,
  weights w_k,t ∝ prior_k · prod_{s<t} p_k(x_s | x_<s) (Gururangan et al.'s
  "branch-train-merge" inference and HDEE's posterior rule); still a convex
  combination of distributions at each position, so normalised.
* ``log_average_mixture``: HDEE's ``simple_avg``, the average of the models'
  log-probabilities, i.e. the normalised geometric mean (a product of experts),
  p(x_t) ∝ exp((1/K) sum_k log p_k(x_t)). It needs the full next-token
  distributions, ``logp_KxBxTxV``, to normalise; HDEE's own code scores the
  unnormalised average (``normalize=False``), which is not a distribution: its
  normaliser Z = sum_v exp(mean_k log p_k(v)) is ≤ 1 (geometric ≤ arithmetic
  mean), so it overstates the loss by -log Z ≥ 0 per token.
* ``estimate_prior``: the prior as the average posterior on a separate dev
  split, to use in ``posterior_mixture``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "uniform_mixture", "log_average_mixture", "posterior_mixture", "estimate_prior", "perplexity",
]


def _check_KxBxT(logp_KxBxT: jax.Array) -> int:
    """K, after checking the shape [K >= 1, B, T] (a 2-D array broadcast silently before)."""
    shape = tuple(jnp.shape(logp_KxBxT))
    if len(shape) != 3 or shape[0] < 1:
        raise ValueError(f"logp_KxBxT must be [K, B, T] with K >= 1 models, got {shape}.")
    return shape[0]


def uniform_mixture(logp_KxBxT: jax.Array) -> jax.Array:
    """log (1/K) sum_k p_k(x_t), [B, T]."""
    k = _check_KxBxT(logp_KxBxT)
    return jax.nn.logsumexp(logp_KxBxT.astype(jnp.float32), axis=0) - jnp.log(k)


def log_average_mixture(
    logp_KxBxTxV: jax.Array, tokens_BxT: jax.Array, *, normalize: bool = True
) -> jax.Array:
    """log of the (normalised) geometric mean of the K distributions at the observed tokens, [B, T].

    Args:
      logp_KxBxTxV: each model's log-probabilities over the whole vocabulary.
      tokens_BxT: the observed tokens.
      normalize: renormalise over the vocabulary (a proper distribution). ``False`` gives
        HDEE's ``simple_avg`` as scored in its code: the plain mean of the log-probabilities.
    """
    shape = tuple(logp_KxBxTxV.shape)
    if len(shape) != 4 or shape[0] < 1 or shape[1:3] != tokens_BxT.shape:  # K = 0: a NaN mean
        raise ValueError(
            f"logp_KxBxTxV must be [K, B, T, V] with K >= 1 models and [B, T] = tokens_BxT.shape "
            f"{tuple(tokens_BxT.shape)}, got {tuple(logp_KxBxTxV.shape)}."
        )
    vocab = logp_KxBxTxV.shape[-1]
    if not jnp.issubdtype(jnp.result_type(tokens_BxT), jnp.integer):  # 1.7 was scored as 1
        raise ValueError(f"tokens_BxT must hold integer token ids in [0, {vocab}), got dtype "
                         f"{jnp.result_type(tokens_BxT)}.")  # fmt: skip
    if not isinstance(tokens_BxT, jax.core.Tracer) and jnp.size(tokens_BxT):
        low, high = int(jnp.min(tokens_BxT)), int(jnp.max(tokens_BxT))
        if not 0 <= low <= high < vocab:
            raise ValueError(f"tokens_BxT must be ids in [0, {vocab}) (the vocabulary of "
                             f"logp_KxBxTxV), got ids from {low} to {high}; a gather would "
                             f"give NaN.")  # fmt: skip
    if not isinstance(normalize, bool):  # "no" was truthy: normalised
        raise ValueError(f"normalize must be True or False, got {normalize!r}.")
    mean = jnp.mean(logp_KxBxTxV.astype(jnp.float32), axis=0)  # [B, T, V]
    if normalize:
        mean = mean - jax.nn.logsumexp(mean, axis=-1, keepdims=True)
    return jnp.take_along_axis(mean, tokens_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]


def _log_weights(logp_KxBxT: jax.Array, log_prior_K: jax.Array) -> jax.Array:
    """Normalised log posterior weights before each position, [K, B, T]."""
    logp = logp_KxBxT.astype(jnp.float32)
    # Evidence of the tokens *before* t: exclusive cumulative sum along T, as the inclusive sum
    # shifted by one (not cumsum - logp, which cancels catastrophically: a very negative or -inf
    # log-prob at t wipes out, or turns into NaN, the evidence before it).
    # Only differences between models matter: subtracting each position's best log-prob keeps
    # the float32 sums small (a long window's totals would otherwise lose the differences).
    top = jnp.max(logp, axis=0, keepdims=True)
    cum = jnp.cumsum(logp - jnp.where(jnp.isfinite(top), top, 0.0), axis=-1)
    before = jnp.concatenate([jnp.zeros_like(cum[..., :1]), cum[..., :-1]], axis=-1)
    logits = before + log_prior_K.astype(jnp.float32)[:, None, None]
    return logits - jax.nn.logsumexp(logits, axis=0, keepdims=True)


def posterior_mixture(logp_KxBxT: jax.Array, prior_K: jax.Array | None = None) -> jax.Array:
    """log sum_k w_k,t p_k(x_t) with w_k,t ∝ prior_k prod_{s<t} p_k(x_s), [B, T].

    Args:
      logp_KxBxT: per-model log-probabilities of the observed tokens.
      prior_K: prior weights of the models (non-negative, normalised here);
        ``None`` means uniform.

    Returns:
      The mixture's log-probabilities of the observed tokens.
    """
    k = _check_KxBxT(logp_KxBxT)
    if prior_K is None:
        log_prior = jnp.full((k,), -jnp.log(k), jnp.float32)
    else:
        prior = jnp.asarray(prior_K, jnp.float32)
        if prior.shape != (k,):  # a length-1 prior broadcast silently to a uniform one
            raise ValueError(f"prior_K must have shape ({k},), one weight per model; got "
                             f"{prior.shape}.")
        if not isinstance(prior, jax.core.Tracer) and not (
                bool((prior >= 0).all()) and 0 < float(prior.sum()) < float("inf")):  # fmt: skip
            raise ValueError(f"prior_K must be finite and non-negative with a positive sum, "
                             f"got {prior}.")  # fmt: skip
        log_prior = jnp.log(prior) - jnp.log(prior.sum())
    log_w = _log_weights(logp_KxBxT, log_prior)
    return jax.nn.logsumexp(log_w + logp_KxBxT.astype(jnp.float32), axis=0)


def estimate_prior(logp_KxBxT: jax.Array) -> jax.Array:
    """Prior over models: their mean posterior weight after whole dev sequences, [K]."""
    _check_KxBxT(logp_KxBxT)
    logp = logp_KxBxT.astype(jnp.float32)
    total = logp.sum(axis=-1)  # [K, B] log-likelihood of each dev sequence
    post = jax.nn.softmax(total, axis=0)
    return post.mean(axis=1)


def perplexity(logp_BxT: jax.Array) -> jax.Array:
    """exp of the mean negative log-probability."""
    return jnp.exp(-jnp.mean(logp_BxT.astype(jnp.float32)))
