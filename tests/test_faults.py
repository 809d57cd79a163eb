"""Faults at the optimizer level: drop-outs that block nothing, NaN that poisons no one."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import (
    comm,
    diloco_outer,
    groups_for_round,
    local_steps,
    noloco_outer,
    replicas,
    restore_nonfinite,
)
from tests.helpers import random_tree


def test_presence_mask_is_deterministic_and_has_the_right_rate():
    masks = np.stack([np.asarray(comm.presence_mask(r, 16, 0.3, seed=1)) for r in range(400)])
    again = np.stack([np.asarray(comm.presence_mask(r, 16, 0.3, seed=1)) for r in range(400)])
    assert np.array_equal(masks, again)
    assert abs(1 - masks.mean() - 0.3) < 0.02  # 6400 draws: 4 sigma ~ 0.023
    assert np.asarray(comm.presence_mask(0, 16, 0.0, seed=1)).all()


@pytest.mark.parametrize("p, seed, field", [(30.0, 0, "dropout_prob"), (-0.5, 0, "dropout_prob"),
                                             (float("nan"), 0, "dropout_prob"),
                                             (1.0, 0, "dropout_prob"), (0.3, -1, "seed")])
def test_presence_mask_refuses_what_the_optimizers_refuse(p, seed, field):
    """dropout_prob=30 (a percentage) marked every replica absent, -0.5 or NaN every one
    present, and seed=-1 drew a mask no optimizer can use, all without a word."""
    with pytest.raises(ValueError, match=f"{field}: must be"):
        comm.presence_mask(0, 4, p, seed)


def test_presence_mask_takes_traced_and_device_values():
    """Its checks are for Python numbers; a jitted caller's seed or rate is its own."""
    want = comm.presence_mask(3, 8, 0.25, 5)
    got = jax.jit(lambda p, seed: comm.presence_mask(3, 8, p, seed))(0.25, 5)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(comm.presence_mask(3, 8, jnp.float32(0.25), 5), want)


def test_presence_mask_takes_zero_d_numpy_values():
    """A 0-d NumPy rate or seed is its number: both were refused as out of range ('got
    array(0.25)'); an out-of-range one is still refused."""
    want = comm.presence_mask(3, 8, 0.25, 5)
    np.testing.assert_array_equal(comm.presence_mask(3, 8, np.asarray(0.25), 5), want)
    np.testing.assert_array_equal(comm.presence_mask(3, 8, 0.25, np.asarray(5)), want)
    with pytest.raises(ValueError, match=r"dropout_prob: must be in \[0, 1\), got 30\.0"):
        comm.presence_mask(3, 8, np.asarray(30.0), 5)


def _numpy_round(phi, theta, delta, groups, present, alpha, beta):
    """NoLoCo with gamma = beta over the *present* members; absent: local-only."""
    new_delta = np.empty_like(delta)
    for g in groups:
        members = [i for i in g if present[i]]
        for i in g:
            mean_theta = theta[members].mean(0) if present[i] else theta[i]
            new_delta[i] = alpha * delta[i] + beta * (mean_theta - phi[i])
    return phi + new_delta, new_delta


@pytest.mark.parametrize("n", [2, 4])
def test_noloco_dropout_matches_numpy(n):
    num, p, seed = 8, 0.3, 5
    tx = noloco_outer(0.7, 0.5, group_size=n, seed=seed, dropout_prob=p)
    reps = replicas.make_replicas(num, backend="vmap")
    phi = np.asarray(jax.random.normal(jax.random.key(0), (num, 6)), np.float64)
    state = replicas.replicate(tx.init(jnp.zeros(6)), num)
    step = jax.jit(reps.map(lambda f, s, t: tx.update(f - t, s, f)))
    phi_j, delta = jnp.asarray(phi, jnp.float32), np.zeros_like(phi)
    saw_absent = False
    for r in range(6):
        theta = phi + 0.1 * np.asarray(jax.random.normal(jax.random.key(r + 1), phi.shape))
        present = np.asarray(comm.presence_mask(r, num, p, seed))
        saw_absent |= not present.all()
        d, state = step(phi_j, state, jnp.asarray(theta, jnp.float32))
        phi_j = phi_j + d
        phi, delta = _numpy_round(phi, theta, delta, groups_for_round(r, num, n, seed), present,
                                  0.5, 0.7)  # fmt: skip
        np.testing.assert_allclose(phi_j, phi, rtol=1e-5, atol=1e-5)
    assert saw_absent


def test_diloco_skip_averages_over_present_replicas():
    num, p, seed = 8, 0.3, 2
    tx = diloco_outer(1.0, 0.0, dropout_prob=p, seed=seed)
    reps = replicas.make_replicas(num, backend="vmap")
    theta = jax.random.normal(jax.random.key(3), (num, 4))
    state = replicas.replicate(tx.init(jnp.zeros(4)), num)
    d, _ = jax.jit(reps.map(lambda f, s, t: tx.update(f - t, s, f)))(jnp.zeros((num, 4)), state,
                                                                      theta)  # fmt: skip
    present = np.asarray(comm.presence_mask(0, num, p, seed))
    assert not present.all()
    want = np.where(present[:, None], np.asarray(theta)[present].mean(0), np.asarray(theta))
    np.testing.assert_allclose(d, want, rtol=1e-6)


@pytest.mark.parametrize("wire", [{}, {"exchange_dtype": jnp.bfloat16},
                                  {"exchange_dtype": "int8"},
                                  {"exchange_dtype": "int8", "error_feedback": True}])
def test_diloco_resync_absent_keeps_one_set_of_slow_weights(wire):
    """Absent replicas take the present ones' step; with none present, a momentum-only step."""
    num, alpha, beta = 4, 0.3, 0.7
    tx = diloco_outer(beta, alpha, resync_absent=True, **wire)
    skip = diloco_outer(beta, alpha, **wire)
    reps = replicas.make_replicas(num, backend="vmap")
    update = jax.jit(reps.map(lambda g, s, f, a, t=tx: t.update(g, s, f, active=a)))
    update_skip = jax.jit(reps.map(lambda g, s, f, a, t=skip: t.update(g, s, f, active=a)))
    phi = jnp.zeros((num, 256))
    state, state_skip = reps.init(tx, phi), reps.init(skip, phi)
    m = np.zeros(256)  # the shared heavy-ball buffer, float path only
    for r, act in enumerate([[1, 1, 1, 1], [1, 0, 1, 1], [0, 0, 1, 0], [0, 0, 0, 0]]):
        active = jnp.array(act, bool)
        theta = phi + jax.random.normal(jax.random.key(r), (num, 256))
        delta, state = update(phi - theta, state, phi, active)
        same, state_skip = update_skip(phi - theta, state_skip, phi, active)
        present = np.asarray(act, bool)
        np.testing.assert_array_equal(delta[present], same[present])  # present: unchanged
        np.testing.assert_array_equal(delta, np.broadcast_to(delta[0], delta.shape))  # one step
        if not wire:
            g = (np.asarray(phi - theta)[present].mean(0) if present.any() else np.zeros(256))
            m = alpha * m + g
            np.testing.assert_allclose(delta[0], -beta * m, rtol=1e-5, atol=1e-6)
        phi = phi + delta


def _nan_guard_run(guard: bool):
    num = 4
    tx = local_steps(optax.sgd(0.1), noloco_outer(1.0, 0.0, seed=0), 2, nonfinite_guard=guard)
    reps = replicas.make_replicas(num, backend="vmap")
    params0 = random_tree(jax.random.key(9))
    params = replicas.replicate(params0, num)
    state = replicas.replicate(tx.init(params0), num)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return restore_nonfinite(optax.apply_updates(p, u), s), s

    step = jax.jit(reps.map(step))
    grads = [random_tree(jax.random.key(20 + t), num) for t in range(2)]
    params, state = step(params, state, grads[0])
    before_sync = params
    params = jax.tree.map(lambda x: x.at[0].set(jnp.nan), params)  # replica 0 blows up
    params, state = step(params, state, grads[1])  # sync step
    return params0, before_sync, grads, params, state


def test_nonfinite_replica_is_reset_and_poisons_no_one():
    params0, before, grads, params, state = _nan_guard_run(guard=True)
    groups = groups_for_round(0, 4, 2, seed=0)
    pair = next(g for g in groups if 0 in g)
    partner = int(pair[pair != 0][0])
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))
    theta = jax.tree.map(lambda b, g: b - 0.1 * g, before, grads[1])  # after the inner step
    for k in params:
        # the broken replica is back on its last slow weights (the shared start)
        np.testing.assert_allclose(params[k][0], params0[k], rtol=1e-6)
        # its partner took a local-only step: with lr 1, momentum 0, phi <- its own theta
        np.testing.assert_allclose(params[k][partner], theta[k][partner], rtol=1e-6)
        others = [i for i in range(4) if i not in (0, partner)]
        mean = np.asarray(theta[k])[others].mean(0)
        for i in others:  # the other pair averaged as usual
            np.testing.assert_allclose(params[k][i], mean, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(state.nonfinite_resets, [1.0, 0.0, 0.0, 0.0])


def _replica_0_reset_at_a_sync(inner: optax.GradientTransformation):
    """The state of 4 replicas after two steps of local_steps(inner, H = 2) with the guard,
    replica 0's weights NaN at the second (the sync catches it)."""
    num = 4
    tx = local_steps(inner, noloco_outer(seed=0), 2, nonfinite_guard=True)
    reps = replicas.make_replicas(num, backend="vmap")
    params = replicas.replicate(random_tree(jax.random.key(9)), num)
    state = reps.init(tx, params)
    step = jax.jit(reps.map(lambda p, s, g: tx.update(g, s, p)[1]))
    grads = random_tree(jax.random.key(3), num)
    state = step(params, state, grads)
    broken = jax.tree.map(lambda x: x.at[0].set(jnp.nan), params)
    state = step(broken, state, grads)  # the sync step catches replica 0
    np.testing.assert_array_equal(state.nonfinite_resets, [1.0, 0.0, 0.0, 0.0])
    return state


_SCHEDULE = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 20)


def test_a_reset_replica_keeps_its_place_in_the_learning_rate_schedule():
    """Fresh Adam moments and bias correction, the schedule where the others are: the reset
    replica re-warmed up and then trailed the others' cosine (5x their rate at the end)."""
    state = _replica_0_reset_at_a_sync(optax.adam(_SCHEDULE))
    adam, sched = state.local_opt_state[0], state.local_opt_state[-1]
    np.testing.assert_array_equal(adam.count, [0, 2, 2, 2])  # fresh bias correction
    np.testing.assert_array_equal(sched.count, [2, 2, 2, 2])  # the schedule goes on


def test_a_reset_replica_keeps_its_place_in_an_injected_schedule():
    """optax.inject_hyperparams makes an InjectStatefulHyperparamsState: its count restarted
    at 0 for the reset replica (its learning rate warmed up again from 0)."""
    injected = _replica_0_reset_at_a_sync(
        optax.inject_hyperparams(optax.adam)(learning_rate=_SCHEDULE)).local_opt_state
    np.testing.assert_array_equal(injected.inner_state[0].count, [0, 2, 2, 2])  # fresh Adam
    np.testing.assert_array_equal(injected.count, [2, 2, 2, 2])  # the schedule goes on
    lr = np.asarray(injected.hyperparams["learning_rate"])
    np.testing.assert_array_equal(lr, np.full(lr.shape[0], lr[1]))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_restore_puts_back_only_the_broken_replica(backend):
    # An inner step (no sync): replica 2's params are NaN and go back to its slow
    # weights; the others keep theirs bit for bit.
    num = 4
    tx = local_steps(optax.sgd(0.1), noloco_outer(seed=0), 10**6, nonfinite_guard=True)
    reps = replicas.make_replicas(num, backend=backend)
    slow = random_tree(jax.random.key(1), num)
    state = reps.put(jax.vmap(tx.init)(slow))
    params = jax.tree.map(lambda s: s + 1.0, slow)
    params = jax.tree.map(lambda x: x.at[2, 0].set(jnp.nan), params)
    out = jax.jit(reps.map(restore_nonfinite))(reps.put(params), state)
    out, params, slow = jax.tree.map(np.asarray, (out, params, slow))
    for k in params:
        np.testing.assert_array_equal(out[k][2], slow[k][2])
        np.testing.assert_array_equal(np.delete(out[k], 2, 0), np.delete(params[k], 2, 0))
    healthy = jax.tree.map(lambda s: s + 1.0, slow)
    again = jax.jit(reps.map(restore_nonfinite))(reps.put(healthy), state)
    for k in healthy:
        np.testing.assert_array_equal(np.asarray(again[k]), healthy[k])


def test_restore_on_a_healthy_step_selects_no_weights():
    # Regression: a jnp.where(ok, params, phi) read phi and rewrote every weight on
    # every step (+12 % per step on paper-small). Putting phi back is now a loop
    # that runs only for a broken replica, so no select touches the weights.
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2, nonfinite_guard=True)
    params = random_tree(jax.random.key(2))
    jaxpr = jax.make_jaxpr(restore_nonfinite)(params, tx.init(params)).jaxpr
    names = [e.primitive.name for e in jaxpr.eqns]
    assert "while" in names and "select_n" not in names, names


def test_guard_and_restore_take_params_without_a_float_leaf():
    """They stacked the finiteness of no leaves at all: a ValueError from jnp.stack."""
    params = {"step": jnp.ones(2, jnp.int32)}
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 1, nonfinite_guard=True)
    state = tx.init(params)
    updates, state = tx.update(params, state, params)
    assert float(state.nonfinite_resets) == 0
    assert restore_nonfinite(params, state) is not None


def test_restore_under_masked_local_steps_puts_back_only_its_leaves():
    """chain(masked(local_steps), masked(sgd)) is allowed (check_composition), but the masked
    slow weights (MaskedNode where local_steps does not act) broke restore_nonfinite's tree_map."""
    params = {"a": jnp.ones(2), "b": jnp.full(2, 5.0)}
    ls = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 1, nonfinite_guard=True)
    tx = optax.chain(optax.masked(ls, {"a": True, "b": False}),
                     optax.masked(optax.sgd(0.1), {"a": False, "b": True}))  # fmt: skip
    state = tx.init(params)
    out = restore_nonfinite({"a": jnp.array([jnp.nan, 3.0]), "b": jnp.full(2, 7.0)}, state)
    np.testing.assert_array_equal(out["a"], [1.0, 1.0])  # back on its slow weights
    np.testing.assert_array_equal(out["b"], [7.0, 7.0])  # not local_steps': untouched
    out = restore_nonfinite({"a": jnp.full(2, 3.0), "b": jnp.array([jnp.nan, 7.0])}, state)
    np.testing.assert_array_equal(out["a"], [3.0, 3.0])  # its own leaves are finite


def test_without_the_guard_nan_spreads_to_the_partner():
    _, _, _, params, _ = _nan_guard_run(guard=False)
    finite = np.array([bool(jnp.all(jnp.isfinite(params["w"][i]))) for i in range(4)])
    assert finite.sum() == 2  # the broken replica and its partner


def test_guard_bytes_include_the_presence_flag():
    params = {"w": jnp.zeros((10,))}
    assert comm.noloco_bytes_per_sync(params, with_presence=True) == 40 + 4
    assert comm.noloco_bytes_per_sync(params, group_size=4, with_presence=True) == 2 * (40 + 4)


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
def test_dropout_prob_range(bad):
    with pytest.raises(ValueError, match="dropout_prob"):
        noloco_outer(dropout_prob=bad)
    with pytest.raises(ValueError, match="dropout_prob"):
        diloco_outer(dropout_prob=bad)


@pytest.mark.parametrize("outer", [{}, {"delay": 1, "sync_every": 4},
                                   {"exchange_dtype": "int8", "error_feedback": True}])
def test_diloco_resync_absent_also_resyncs_a_replica_the_guard_caught(outer):
    """fault.resync_absent: a replica the non-finite guard leaves out (active=False) takes the
    round's shared step as a dropped-out one does. local_steps kept its old slow weights and
    momentum, so its slow weights stayed apart for good (resync_absent changed nothing)."""
    from noloco_jax.trainer.optimizer import build_optimizer  # noqa: PLC0415
    from noloco_jax.trainer.settings import FaultSettings, OptimSettings, OuterSettings  # noqa

    num, o = 4, OuterSettings(**{"sync_every": 2, "momentum": 0.3, **outer})
    tx = build_optimizer("diloco", OptimSettings(warmup_steps=0), o, num_steps=10,
                         num_replicas=num, fault=FaultSettings(resync_absent=True))
    reps = replicas.make_replicas(num, backend="vmap")
    params = replicas.replicate(random_tree(jax.random.key(9)), num)
    state = reps.init(tx, params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return restore_nonfinite(optax.apply_updates(p, u), s), s

    step = jax.jit(reps.map(step))
    for t in range(2 * o.sync_every):  # replica 0 breaks before the first round's sync
        if t == o.sync_every - o.delay - 1:
            params = jax.tree.map(lambda x: x.at[0].set(jnp.nan), params)
        params, state = step(params, state, random_tree(jax.random.key(20 + t), num))
    found = state[-1]
    np.testing.assert_array_equal(found.nonfinite_resets, [1.0, 0.0, 0.0, 0.0])
    for tree in (found.slow_params, found.outer_state.sgd_state):  # one set, momentum too
        for x in jax.tree.leaves(tree):
            np.testing.assert_array_equal(x, np.broadcast_to(x[1], x.shape))
