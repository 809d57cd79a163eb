"""Training with skipped stages: paths obey the rules, skipped blocks get no gradient."""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from noloco_jax import models, skippipe
from noloco_jax.skippipe import training as skipping
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.step import loss_fn
from tests.test_train import tiny_settings

CFG = models.get_preset("nano", vocab_size=64, num_layers=4, max_seq_len=64)


@pytest.mark.parametrize("swaps", [False, True])
def test_paths_obey_the_rules(swaps):
    paths = np.asarray(skipping.sample_stage_paths(jax.random.key(0), num_stages=6,
                                                   path_length=4, num_paths=500, swaps=swaps))
    assert paths.shape == (500, 4) and (paths[:, 0] == 0).all()
    for p in paths:
        assert len(set(p.tolist())) == 4 and set(p[1:].tolist()) <= set(range(1, 6))
        backs = [i for i in range(1, 3) if p[i + 1] < p[i]]
        assert len(backs) <= (1 if swaps else 0)
        for i in backs:  # only adjacent positions are swapped: re-sorting them restores order
            q = p.copy()
            q[i], q[i + 1] = q[i + 1], q[i]
            assert (np.diff(q[1:]) > 0).all()
    assert swaps == any((np.diff(p[1:]) < 0).any() for p in paths)
    with pytest.raises(ValueError, match="path_length"):
        skipping.sample_stage_paths(jax.random.key(0), num_stages=4, path_length=5, num_paths=1)
    with pytest.raises(ValueError, match="num_paths: must be an integer >= 1, got 0"):
        skipping.sample_stage_paths(jax.random.key(0), num_stages=4, path_length=2, num_paths=0)


@pytest.mark.parametrize("num_stages, path_length", [(8, 3), (10, 4)])
@pytest.mark.parametrize("swaps", [False, True])
def test_paths_keep_skippipes_jump_limit_and_are_uniform(num_stages, path_length, swaps):
    """No step lands more than 4 stages above the frontier; a swap reaches back one stage."""
    rules = skippipe.PathRules(num_stages=num_stages, path_length=path_length,
                               allow_swaps=swaps, max_swaps=1)  # fmt: skip
    paths = np.asarray(skipping.sample_stage_paths(
        jax.random.key(1), num_stages=num_stages, path_length=path_length, num_paths=6000,
        swaps=swaps)).tolist()  # fmt: skip
    bad = [(p, skippipe.check_stage_path(p, rules)) for p in paths]
    assert not [b for b in bad if b[1]], bad[:3]
    if swaps:
        assert any(p != sorted(p) for p in paths)
        return
    valid = [p for p in skippipe.valid_stage_paths(rules) if list(p) == sorted(p)]
    counts = collections.Counter(map(tuple, paths))
    assert set(counts) == set(valid)  # every valid sorted path is drawn, and only those
    observed = [counts[p] for p in valid]
    assert scipy.stats.chisquare(observed).pvalue > 1e-3, observed  # uniform over them


def test_layer_ids_and_zero_gradient_for_skipped_blocks():
    ids = skipping.layer_ids_for(jnp.array([[0, 2]]), layers_per_stage=2)
    assert ids.tolist() == [[0, 1, 4, 5]]
    graphdef, params = models.init_params(CFG, 0)
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 1, 64)
    paths = jnp.array([[0, 2], [0, 3]])  # 4 layers as 4 stages of 1: stage 1 skipped by both
    grads = jax.jit(jax.grad(lambda p: skipping.skip_loss_fn(
        p, tokens, skipping.layer_ids_for(paths, 1), graphdef=graphdef)))(params)  # fmt: skip
    wq = np.abs(np.asarray(grads["blocks"]["attn"]["wq"][...])).reshape(4, -1).max(1)
    assert wq[1] == 0 and (wq[[0, 2, 3]] > 0).all()


def test_full_path_equals_the_ordinary_loss():
    graphdef, params = models.init_params(CFG, 0)
    tokens = jax.random.randint(jax.random.key(2), (3, 9), 1, 64)
    ids = jnp.broadcast_to(jnp.arange(4), (3, 4))
    skip = jax.jit(lambda p: skipping.skip_loss_fn(p, tokens, ids, graphdef=graphdef))
    full = jax.jit(lambda p: loss_fn(p, tokens, graphdef=graphdef))
    np.testing.assert_allclose(skip(params), full(params), rtol=1e-6)


def test_skip_training_run(tmp_path, corpus_dir, data_dir):  # noqa: F811
    # Syncing every 2 steps: the 1-step inner program and the sync program, no 2-step one.
    s = tiny_settings(corpus_dir, data_dir, num_steps=8, outer={"sync_every": 2},
                      skip={"num_stages": 2, "path_length": 1, "full_every": 4})  # fmt: skip
    last = train_and_evaluate(s, tmp_path, progress=False)
    assert np.isfinite(last["val_ppl"]) and last["val_ppl"] < 250


def test_skip_settings_validation(corpus_dir, data_dir):  # noqa: F811
    with pytest.raises(ValueError, match="skip.path_length"):
        tiny_settings(corpus_dir, data_dir, skip={"num_stages": 2, "path_length": 3})
    with pytest.raises(ValueError, match="cannot be combined"):
        tiny_settings(corpus_dir, data_dir, num_stages=2, skip={"num_stages": 2, "path_length": 1})


@pytest.mark.parametrize("kwargs, field", [
    ({"num_stages": 4, "path_length": 4, "layers_per_stage": 2}, "layers_per_stage"),  # 8 != 4
    ({"num_stages": 2, "path_length": 2, "layers_per_stage": 0}, "layers_per_stage"),
    ({"num_stages": 4, "path_length": 2, "layers_per_stage": 1, "full_every": -1}, "full_every"),
])  # fmt: skip
def test_skip_config_must_match_the_model(kwargs, field):
    """Traced block ids beyond the model were clamped: the wrong blocks trained, silently."""
    graphdef, params = models.init_params(CFG, 0)
    tokens = jax.random.randint(jax.random.key(1), (1, 2, 9), 1, 64)

    def run():
        cfg = skipping.SkipConfig(**kwargs)
        return jax.vmap(lambda p, t: skipping.skip_value_and_grad(
            p, t, jnp.int32(0), graphdef=graphdef, cfg=cfg, full_loss=loss_fn),
            axis_name="replica")(jax.tree.map(lambda a: a[None], params), tokens)  # fmt: skip

    with pytest.raises(ValueError, match=rf"^{field}: "):
        run()
