"""Ensemble mixtures: normalised, reduce to a single model, stable, prior estimation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import ensemble

K, B, T, V = 3, 2, 5, 7
# Two models' hand-built observations, [2, 1, 15]: one shape (as in the float64 reference
# test), so that the mixtures' eager ops compile once for those tests.
HAND = (1, 15)


def _logprobs(seed=0):
    logits = 3 * jax.random.normal(jax.random.key(seed), (K, B, T, V))
    return jax.nn.log_softmax(logits, axis=-1)  # [K, B, T, V]


def _observed(logp_KxBxTxV, tokens_BxT):
    """Each model's log-probability of the tokens, [K, B, T] (gathered on the host)."""
    logp, tokens = np.asarray(logp_KxBxTxV), np.asarray(tokens_BxT)
    idx = np.broadcast_to(tokens[None, ..., None], logp.shape[:3] + (1,))
    return jnp.asarray(np.take_along_axis(logp, idx, axis=-1)[..., 0])


@pytest.mark.parametrize("rule", ["uniform", "posterior", "posterior_prior"])
def test_mixtures_are_normalised_over_the_vocabulary(rule):
    logp = _logprobs()
    prefix = np.asarray(jax.random.randint(jax.random.key(1), (B, T), 0, V))
    prior = jnp.array([0.2, 0.5, 0.3])
    for t in range(T):
        total = 0.0
        for v in range(V):  # vary the token at position t, keep the prefix fixed
            tokens = prefix.copy()  # on the host: each (t, v) runs the same compiled ops
            tokens[:, t] = v
            obs = _observed(logp, tokens)
            if rule == "uniform":
                mix = ensemble.uniform_mixture(obs)
            else:
                mix = ensemble.posterior_mixture(obs, prior if rule == "posterior_prior" else None)
            total = total + np.exp(np.asarray(mix)[:, t])
        np.testing.assert_allclose(total, np.ones(B), rtol=1e-5)


def test_single_model_reduces_to_itself():
    obs = _observed(_logprobs(), jax.random.randint(jax.random.key(2), (B, T), 0, V))[:1]
    np.testing.assert_allclose(ensemble.uniform_mixture(obs), obs[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(ensemble.posterior_mixture(obs), obs[0], rtol=1e-6, atol=1e-6)
    assert float(ensemble.perplexity(obs[0])) == pytest.approx(float(jnp.exp(-obs[0].mean())))


def test_identical_models_and_first_position():
    obs = _observed(_logprobs(), jax.random.randint(jax.random.key(3), (B, T), 0, V))
    same = jnp.broadcast_to(obs[:1], obs.shape)
    np.testing.assert_allclose(ensemble.posterior_mixture(same), obs[0], rtol=1e-5, atol=1e-6)
    # At t = 0 there is no evidence yet: the posterior mixture is the prior mixture.
    np.testing.assert_allclose(
        ensemble.posterior_mixture(obs)[:, 0], ensemble.uniform_mixture(obs)[:, 0], rtol=1e-6
    )


@pytest.mark.parametrize("prior,match", [
    ([0.5], r"shape \(3,\)"),  # broadcast to a uniform prior before
    ([0.5, -0.1, 0.6], "non-negative"),  # NaN mixtures before
    ([0.0, 0.0, 0.0], "positive sum"),
    ([np.inf, 1.0, 1.0], "finite"),  # NaN mixtures before
])
def test_a_bad_prior_is_refused(prior, match):
    obs = _observed(_logprobs(), jax.random.randint(jax.random.key(3), (B, T), 0, V))
    assert obs.shape[0] == 3
    with pytest.raises(ValueError, match=rf"^prior_K must .*{match}"):
        ensemble.posterior_mixture(obs, jnp.asarray(prior))


def test_posterior_moves_towards_the_better_model_and_beats_uniform():
    good = np.full((1, *HAND), np.log(np.float32(0.9)))  # inputs built on the host
    bad = np.full((1, *HAND), np.log(np.float32(0.1)))
    obs = jnp.asarray(np.concatenate([good, bad]))
    post, unif = ensemble.posterior_mixture(obs), ensemble.uniform_mixture(obs)
    post, unif = np.asarray(post), np.asarray(unif)
    assert float(post.mean()) > float(unif.mean())
    np.testing.assert_allclose(post[:, -1], np.log(np.float32(0.9)), atol=1e-6)


def test_stable_for_very_unlikely_tokens():
    obs = jnp.asarray(np.stack([np.full(HAND, -1e4, np.float32),
                                np.full(HAND, -2e4, np.float32)]))  # fmt: skip
    for mix in (ensemble.uniform_mixture(obs), ensemble.posterior_mixture(obs)):
        assert bool(np.all(np.isfinite(mix)))
    np.testing.assert_allclose(ensemble.uniform_mixture(obs), -1e4 - np.log(2), rtol=1e-6)


def test_estimated_prior():
    good = np.full((1, *HAND), np.log(np.float32(0.6)))
    bad = np.full((1, *HAND), np.log(np.float32(0.3)))
    prior = np.asarray(ensemble.estimate_prior(jnp.asarray(np.concatenate([good, bad]))))
    np.testing.assert_allclose(prior.sum(), 1.0, rtol=1e-6)
    assert float(prior[0]) > 0.99


def test_log_average_is_the_normalised_geometric_mean():
    logp = _logprobs(4)
    tokens = jax.random.randint(jax.random.key(5), (B, T), 0, V)
    total = sum(jnp.exp(ensemble.log_average_mixture(logp, jnp.full((B, T), v))) for v in range(V))
    np.testing.assert_allclose(total, np.ones((B, T)), rtol=1e-5)  # normalised
    raw = ensemble.log_average_mixture(logp, tokens, normalize=False)
    np.testing.assert_allclose(raw, _observed(logp, tokens).mean(axis=0), rtol=1e-6)  # HDEE's
    # Geometric <= arithmetic mean: the unnormalised average never scores above the mixture,
    # and its normaliser is <= 1, so normalising can only raise the log-probability.
    assert bool(jnp.all(raw <= ensemble.uniform_mixture(_observed(logp, tokens)) + 1e-6))
    assert bool(jnp.all(ensemble.log_average_mixture(logp, tokens) >= raw - 1e-6))


def test_log_average_of_one_model_is_that_model_and_checks_shapes():
    logp = _logprobs(6)[:1]
    tokens = jax.random.randint(jax.random.key(7), (B, T), 0, V)
    want = jnp.take_along_axis(logp[0], tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(ensemble.log_average_mixture(logp, tokens), want, atol=1e-5)
    huge = jnp.full((2, B, T, V), -1e4).at[..., 0].set(0.0)  # stable for tiny probabilities
    assert bool(jnp.all(jnp.isfinite(ensemble.log_average_mixture(huge, tokens))))
    with pytest.raises(ValueError, match="logp_KxBxTxV"):
        ensemble.log_average_mixture(logp[..., 0], tokens)


def test_posterior_matches_a_float64_reference_with_extreme_tokens():
    """A very unlikely (or impossible) token must not erase the evidence before it: the
    exclusive cumulative sum was cumsum - logp, which lost it (9 nats off; NaN for -inf)."""

    def reference(lp):
        lp = np.asarray(lp, np.float64)
        before = np.concatenate([np.zeros_like(lp[..., :1]), np.cumsum(lp, -1)[..., :-1]], -1)
        logits = before - np.log(lp.shape[0])
        logits = logits - np.logaddexp.reduce(logits, axis=0, keepdims=True)
        return np.logaddexp.reduce(logits + lp, axis=0)

    a = np.r_[np.full(9, -5.0), -1e30, np.full(5, -1.0)]
    b = np.full(15, -1.0)
    c = np.r_[np.full(3, -1.0), -np.inf, np.full(11, -1.0)]
    for obs in (np.stack([a, b])[:, None], np.stack([c, 2 * b])[:, None]):
        got = ensemble.posterior_mixture(jnp.asarray(obs, jnp.float32))
        np.testing.assert_allclose(got, reference(obs.astype(np.float32)), atol=1e-5)


def test_out_of_range_tokens_are_refused_by_the_log_average():
    """An id outside the vocabulary was gathered as NaN."""
    logp = jnp.log(jnp.full((2, 1, 3, 4), 0.25))
    for bad in (jnp.asarray([[0, 4, 1]]), jnp.asarray([[0, -1, 1]])):
        with pytest.raises(ValueError, match=r"tokens_BxT must be ids in \[0, 4\)"):
            ensemble.log_average_mixture(logp, bad)
    np.testing.assert_allclose(ensemble.log_average_mixture(logp, jnp.asarray([[0, 3, 1]])),
                               jnp.log(jnp.full((1, 3), 0.25)), rtol=1e-6)


def test_log_average_refuses_no_models():
    """K = 0 models gave a NaN mean instead of an error."""
    with pytest.raises(ValueError, match=r"^logp_KxBxTxV must be \[K, B, T, V\] with K >= 1"):
        ensemble.log_average_mixture(jnp.zeros((0, 1, 3, 4)), jnp.zeros((1, 3), jnp.int32))


def test_log_average_refuses_a_non_bool_normalize():
    """normalize="no" was truthy and renormalised."""
    with pytest.raises(ValueError, match=r"^normalize must be True or False, got 'no'"):
        ensemble.log_average_mixture(jnp.zeros((2, 1, 3, 4)), jnp.zeros((1, 3), jnp.int32),
                                     normalize="no")  # fmt: skip


def test_log_average_refuses_non_integer_tokens():
    """A float id 1.7 was silently truncated and scored as token 1."""
    logp = jnp.log(jnp.full((2, 1, 3, 4), 0.25))
    for bad in (jnp.asarray([[0.0, 1.7, 1.0]]), jnp.asarray([[True, False, True]])):
        with pytest.raises(ValueError, match=r"tokens_BxT must hold integer token ids in \[0, 4\)"):
            ensemble.log_average_mixture(logp, bad)


def test_a_bad_shape_is_refused():
    for bad in (jnp.zeros((2, 3)), jnp.zeros((0, 2, 3))):  # 2-D broadcast; K = 0 gave NaN
        for rule in (ensemble.uniform_mixture, ensemble.posterior_mixture, ensemble.estimate_prior):
            with pytest.raises(ValueError, match=r"^logp_KxBxT must be \[K, B, T\]"):
                rule(bad)
