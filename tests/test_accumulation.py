"""Gradient accumulation (``config.optim.micro_batches``, ``trainer.grads.accumulated``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import models
from noloco_jax.trainer import grads
from noloco_jax.trainer.loop import train_and_evaluate
from tests.test_train import tiny_settings

CFG = models.get_preset("nano", vocab_size=256)
STEP = jnp.int32(0)


@pytest.fixture(scope="module")
def model():
    graphdef, params = models.init_params(CFG, 0)
    tokens = jax.random.randint(jax.random.key(1), (16, 33), 0, CFG.vocab_size)
    return graphdef, params, tokens


@pytest.fixture(scope="module")
def whole_batch(model):
    """Loss and gradients of the whole batch in one call (read by the k = 2, 4, 16 cases)."""
    graphdef, params, tokens = model
    return jax.jit(grads.plain(graphdef))(params, tokens, STEP)


def _max_abs(tree):
    return max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("k", [2, 4, 16])
def test_the_mean_over_slices_is_the_whole_batch(model, whole_batch, k):
    graphdef, params, tokens = model
    loss, g = whole_batch
    loss_k, g_k = jax.jit(grads.accumulated(grads.plain(graphdef), k))(params, tokens, STEP)
    # float32 sums in another order: a few ulps of the loss, 1e-6 of the largest gradient.
    np.testing.assert_allclose(loss_k, loss, rtol=1e-6)
    scale = _max_abs(g)
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * scale)


def test_one_slice_is_the_function_itself(model):
    fn = grads.plain(model[0])
    assert grads.accumulated(fn, 1) is fn


def test_slice_i_holds_rows_i_i_plus_k_and_so_on():
    # A grads_fn that returns its rows' first token as the "gradient": the mean over slices
    # is rows i + k j averaged over i, (k - 1) / 2 + k j (contiguous slices would give
    # r (k - 1) / 2 + j), so every device of a split replica keeps its own rows.
    k, rows = 4, 3
    params = {"w": jnp.zeros(rows)}

    def probe(p, tokens, step):
        return jnp.float32(0), {"w": tokens[:, 0].astype(jnp.float32)}

    tokens = jnp.arange(k * rows, dtype=jnp.int32)[:, None]
    _, g = grads.accumulated(probe, k)(params, tokens, STEP)
    np.testing.assert_array_equal(g["w"], (k - 1) / 2 + k * np.arange(rows))


def test_bfloat16_params_get_bfloat16_gradients_summed_in_float32(model):
    graphdef, params, tokens = model
    # Host-side (numpy) casts, slices and sums: each eager op compiled a program of its own.
    low = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
    _, g = jax.jit(grads.accumulated(grads.plain(graphdef), 4))(low, tokens, STEP)
    assert {x.dtype for x in jax.tree.leaves(g)} == {jnp.dtype(jnp.bfloat16)}
    # The reference: the four slices' bf16 gradients, summed in float32, then rounded once.
    slices = [np.asarray(tokens)[i::4] for i in range(4)]
    plain = jax.jit(grads.plain(graphdef))  # one program for the four equal-shaped slices
    per = [jax.tree.map(np.asarray, plain(low, s, STEP)[1]) for s in slices]
    want = jax.tree.map(lambda *xs: (sum(x.astype(np.float32) for x in xs) / 4).astype(
        jnp.bfloat16), *per)  # fmt: skip
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_only_one_slice_of_activations_is_alive(model):
    graphdef, params, tokens = model

    def temp_bytes(k):
        fn = jax.jit(grads.accumulated(grads.plain(graphdef), k))
        return fn.lower(params, tokens, STEP).compile().memory_analysis().temp_size_in_bytes

    whole, quarter = temp_bytes(1), temp_bytes(4)
    assert quarter < 0.5 * whole, (quarter, whole)  # measured 0.30 (4.5 MB of 15.0 MB)


def test_training_with_micro_batches_is_training_with_the_whole_batch(tmp_path, corpus_dir,
                                                                      data_dir):  # fmt: skip
    """vmap with k = 4 (one row per slice) and a replica split over 2 devices with k = 2 train
    as the whole batch does, to float32 rounding."""
    # log_every = sync_every = 4: steps 1-3 are one inner block and step 4 the sync, so each
    # run compiles one inner program (log_every=2 cut them into blocks of 2 and 1: two).
    base = dict(global_batch_size=16, num_steps=4, log_every=4, eval_every=4, checkpoint_every=4)
    runs = {"whole": {}, "k4": {"optim": {"micro_batches": 4}},
            "split_k2": {"optim": {"micro_batches": 2}, "backend": "shard_map",
                         "mesh": {"fsdp": 2}}}  # fmt: skip
    last = {}
    for name, extra in runs.items():
        optim = {"learning_rate": 3e-3, "warmup_steps": 2, **extra.pop("optim", {})}
        s = tiny_settings(corpus_dir, data_dir, optim=optim, **base, **extra)
        last[name] = train_and_evaluate(s, tmp_path / name, progress=False)
    for name in ("k4", "split_k2"):
        np.testing.assert_allclose(last[name]["train_loss_per_replica"],
                                   last["whole"]["train_loss_per_replica"], rtol=2e-6)
        np.testing.assert_allclose(last[name]["val_ppl"], last["whole"]["val_ppl"], rtol=2e-6)
