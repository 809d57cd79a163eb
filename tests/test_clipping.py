"""clip_by_global_norm_fused: same clipping as optax's, in a form XLA fuses."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import clip_by_global_norm_fused


def _tree(scale):
    k1, k2 = jax.random.split(jax.random.key(0))
    return {"w": scale * jax.random.normal(k1, (7, 3)), "b": scale * jax.random.normal(k2, (5,))}


@pytest.mark.parametrize("scale", [1e-3, 0.1, 10.0, 1e4])
def test_matches_optax_clip_by_global_norm(scale):
    g = _tree(scale)
    ours, _ = clip_by_global_norm_fused(1.0).update(g, optax.EmptyState())
    ref, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(ref)):
        np.testing.assert_allclose(a, b, rtol=2e-6, atol=0)
    norm = float(optax.tree.norm(g))
    if norm <= 1.0:  # below the threshold the gradient passes bit for bit
        for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(g)):
            np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(optax.tree.norm(ours), 1.0, rtol=1e-6)


def test_zero_and_nonfinite_gradients():
    # Built on the host, shaped as _tree's leaves: the clip's eager ops compiled already.
    zero = jax.tree.map(lambda x: jnp.asarray(np.zeros_like(x)), _tree(1.0))
    out, _ = clip_by_global_norm_fused(1.0).update(zero, optax.EmptyState())
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(out))
    bad = {"w": np.ones((7, 3), np.float32), "b": np.ones(5, np.float32)}
    bad["w"][0, 1] = np.nan
    bad = jax.tree.map(jnp.asarray, bad)
    out, _ = clip_by_global_norm_fused(1.0).update(bad, optax.EmptyState())
    assert np.all(np.isnan(np.asarray(out["b"])))  # NaN is not hidden by the clip


def test_keeps_dtypes():
    g = {"w": jnp.full((4,), 3.0, jnp.bfloat16)}
    out, _ = clip_by_global_norm_fused(1.0).update(g, optax.EmptyState())
    assert out["w"].dtype == jnp.bfloat16


def test_bfloat16_norm_is_summed_in_float32():
    # 600 leaves of 1: a bfloat16 sum of squares stalls at 256 (norm 16, not 24.5)
    g = {f"l{i:03d}": jnp.ones((1,), jnp.bfloat16) for i in range(600)}
    out, _ = clip_by_global_norm_fused(1.0).update(g, optax.EmptyState())
    want = np.asarray(jnp.asarray(1.0 / np.sqrt(600.0), jnp.bfloat16))
    np.testing.assert_array_equal(np.asarray(out["l000"]), [want])


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "1"])
def test_bad_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        clip_by_global_norm_fused(bad)


@pytest.mark.parametrize("bad", [np.float32(0.0), np.float64(-1.0), np.array([1.0, 2.0])])
def test_bad_numpy_max_norm(bad):
    with pytest.raises(ValueError, match="max_norm must be a number > 0"):
        clip_by_global_norm_fused(bad)


def test_injected_and_numpy_max_norm_clip_as_a_python_number():
    g = _tree(1.0)  # norm about 5: clipped (the shapes of the tests above: compiled already)
    assert float(optax.tree.norm(g)) > 1.5
    want, _ = clip_by_global_norm_fused(1.0).update(g, optax.EmptyState())
    injected = optax.inject_hyperparams(clip_by_global_norm_fused)(max_norm=1.0)
    for tx in (injected, clip_by_global_norm_fused(np.float32(1.0))):
        got, _ = tx.update(g, tx.init(g))
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(x, y)


def _weight_sized_buffers(clip):
    """Weight-shaped buffers an update of clip + Adam + apply writes, compiled."""
    params = {"a": jnp.ones((96, 80)), "b": jnp.ones((80, 72))}
    tx = optax.chain(clip, optax.adam(1e-3))

    def step(p, s):
        g = jax.tree.map(lambda x: jnp.sin(x) * 3.0, p)  # a gradient made in the step
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    text = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params)).compile().as_text()
    body = text[text.index("\nENTRY ") :]
    return len(re.findall(r"= f32\[(?:96,80|80,72)\]\{1,0\} fusion\(", body))


def test_clipped_gradient_is_not_written_out():
    # optax's clip is written to memory and read back by Adam's two moments; ours
    # fuses, so each step writes only the new params and moments.
    assert _weight_sized_buffers(clip_by_global_norm_fused(1.0)) < _weight_sized_buffers(
        optax.clip_by_global_norm(1.0)
    )
