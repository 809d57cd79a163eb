"""The run's first state is made where it lives (``trainer.state``).

Before, one replica's state was built on the first device and copied N times there before
being split: N whole replicas on one device, which no cluster-sized run survives.
"""

import jax
import numpy as np
import optax
import pytest

from noloco_jax import models
from noloco_jax.trainer import build, loop
from noloco_jax.trainer.checkpoint import Checkpointer
from noloco_jax.trainer.aot import abstract_state
from noloco_jax.trainer.state import first_state
from tests.test_train import tiny_settings

SPLIT = {"fsdp": 2, "tensor": 2}


@pytest.fixture(scope="module")
def built(corpus_dir, data_dir):
    """(settings, run, target) of a run of 2 replicas, each split over fsdp 2 x tensor 2."""
    s = tiny_settings(corpus_dir, data_dir, num_replicas=2, backend="shard_map", mesh=SPLIT)
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        run, target = build.build_run(s)
    return s, run, target


def test_first_state_moves_nothing_between_devices_and_lands_split(built, tmp_path):
    _, run, target = built
    ckpt = Checkpointer(tmp_path / "checkpoints")
    with jax.transfer_guard_device_to_device("disallow_explicit"):
        state, step = loop._restore_or_init(run, target, ckpt, writer=None)
    ckpt.close()
    assert step == 0
    for (path, x), t in zip(jax.tree_util.tree_leaves_with_path(state), jax.tree.leaves(target)):
        assert x.shape == t.shape and x.dtype == t.dtype, path
        assert x.sharding.is_equivalent_to(t.sharding, x.ndim), path
    table = state.params["embedding"]  # [N, V, D]: each device holds 1/(F x T) of a replica's
    shard = table.addressable_shards[0].data.shape
    assert shard[0] == 1 and shard[1] * shard[2] * 4 == table.shape[1] * table.shape[2]


def test_first_state_has_the_models_initial_weights_on_every_replica(built):
    s, run, target = built
    state = run.fresh()
    cfg = build.model_config(s, run.data.tokenizer.vocab_size)
    want = models.init_params(cfg, s.seed)[1]
    for w, got in zip(jax.tree.leaves(want), jax.tree.leaves(state.params)):
        for r in range(s.num_replicas):
            np.testing.assert_array_equal(np.asarray(got)[r], np.asarray(w))
    assert int(state.step) == 0


def test_given_weights_reach_each_device_as_its_part(built):
    """The ``init_from`` path: host weights, each device sent only its part of them."""
    s, run, _ = built
    cfg = build.model_config(s, run.data.tokenizer.vocab_size)
    weights = jax.tree.map(lambda x: np.asarray(x) + 1.0, models.init_params(cfg, s.seed)[1])
    tx = optax.adam(1e-3)
    target = abstract_state(run.reps, tx, weights)
    state = first_state(target, tx, s.num_replicas)(weights)
    for w, got, t in zip(jax.tree.leaves(weights), jax.tree.leaves(state.params),
                         jax.tree.leaves(target.params)):  # fmt: skip
        assert got.sharding.is_equivalent_to(t.sharding, got.ndim)
        assert got.addressable_shards[0].data.shape == t.sharding.shard_shape(t.shape)
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(w, got.shape))
    with pytest.raises(ValueError, match="give params exactly when no init"):
        first_state(target, tx, s.num_replicas)()


def test_a_run_with_another_optimizer_reuses_the_compiled_initialisation(
        built, corpus_dir, data_dir, monkeypatch):  # fmt: skip
    """The random initialisation is its own program, per model and placement: a second run
    that changes only the optimizer (a notebook's next cell) neither traces nor compiles it
    again, and starts from the same weights."""
    s, run, _ = built
    first = run.fresh()
    traced = []
    init_params = models.init_params
    monkeypatch.setattr(models, "init_params", lambda *a: traced.append(a) or init_params(*a))
    s2 = tiny_settings(corpus_dir, data_dir, num_replicas=2, backend="shard_map", mesh=SPLIT,
                       optim={"learning_rate": 1e-3, "warmup_steps": 2})  # fmt: skip
    assert s2.optim != s.optim
    run2, _ = build.build_run(s2)
    traced.clear()  # build_run reads the params' shapes (an abstract trace)
    second = run2.fresh()
    assert traced == []
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(second.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_runs_that_differ_only_in_log_every_share_their_programs(built, corpus_dir, data_dir):
    """log_every only sets how many steps one call of the inner program runs (its batch's
    length): a run that changed it (a notebook's next cell) compiled every program again."""
    s, run, _ = built
    s2 = tiny_settings(corpus_dir, data_dir, num_replicas=2, backend="shard_map", mesh=SPLIT,
                       log_every=4)  # fmt: skip
    run2, _ = build.build_run(s2)
    assert run2.inner is run.inner and run2.sync is run.sync and run2.calls is run.calls
    assert (run.block, run2.block) == (2, 4)
