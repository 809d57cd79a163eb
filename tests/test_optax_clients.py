"""The optimizer core as an optax user drives it: the documented paths, Flax NNX, optax's
wrappers, schedules, low-precision params and the traps each of them used to hide."""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
import jax.extend as jex
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import noloco_jax
from noloco_jax import comm, data_parallel, diloco_outer, local_steps, noloco_outer, replicas
from noloco_jax.optim.local_steps import check_composition
from noloco_jax.optim.noloco import INJECT_STATIC_ARGS
from tests.helpers import random_tree, step_fn

N = 4


def _outside_branches(jaxpr):
    """Equations that run on every step: all but those inside ``cond`` branches."""
    out = []
    for e in jaxpr.eqns:
        if e.primitive.name == "cond":
            out.append(e)
            continue
        out.append(e)
        for sub in jex.core.jaxprs_in_params(e.params):
            out += _outside_branches(getattr(sub, "jaxpr", sub))
    return out


def _assert_outer_work_only_in_a_branch(closed, weight_shapes):
    eqns = _outside_branches(closed.jaxpr)
    conds = [e for e in eqns if e.primitive.name == "cond"]
    assert any(len(e.params["branches"]) == 2 for e in conds)  # the sync branch
    selects = [e for e in eqns if e.primitive.name == "select_n"
               and tuple(e.outvars[0].aval.shape) in weight_shapes]  # fmt: skip
    assert not selects  # a batched phase turns the branch into a select over the weights
    assert not [e for e in conds if len(e.params["branches"]) > 2]  # group draw: sync only


# ------------------------------------------------------------------ 1. the fast path


def test_documented_path_keeps_the_sync_branch_a_real_cond():
    tx = local_steps(optax.adam(1e-3), noloco_outer(), sync_every=50)
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    state = reps.init(tx, params)
    closed = jax.make_jaxpr(reps.map(tx.update))(params, state, params)
    _assert_outer_work_only_in_a_branch(closed, {(N, 3, 2), (N, 5)})
    assert state.count.shape == () and state.outer_state.round.shape == ()
    assert state.local_opt_state[0].count.shape == (N,)  # per replica: the guard resets it


def test_vmapped_init_is_refused_with_the_fix():
    tx = local_steps(optax.adam(1e-3), noloco_outer(), sync_every=50)
    params = jnp.zeros((N, 4))
    state = jax.vmap(tx.init)(params)  # batches the counters
    with pytest.raises(ValueError, match="make_replicas\\(N\\).init"):
        jax.vmap(tx.update, axis_name="replica")(params, state, params)


def test_a_plain_vmap_without_the_state_out_axes_names_them():
    """The refusal's hint, jax.vmap with in_axes=replica_axes(state), left out_axes=0: the
    next step died in lax.cond with 'Pred must be a scalar'."""
    tx = local_steps(optax.sgd(0.1), noloco_outer(), 2)
    params = jnp.ones((N, 3))
    state = replicas.make_replicas(N, backend="vmap").init(tx, params)
    axes = replicas.replica_axes(state)
    bad = jax.vmap(tx.update, in_axes=(0, axes, 0), axis_name="replica")
    _, moved = bad(params, state, params)
    with pytest.raises(ValueError, match="out_axes"):
        bad(params, moved, params)
    good = jax.vmap(tx.update, in_axes=(0, axes, 0), out_axes=(0, axes), axis_name="replica")
    for _ in range(2):
        _, state = good(params, state, params)
    assert state.count.shape == () and int(state.outer_state.round) == 1


@pytest.mark.parametrize("outer", [noloco_outer(), diloco_outer(dropout_prob=0.3)])
def test_an_outer_step_vmapped_without_the_state_out_axes_names_them(outer):
    """The outer steps alone died in the group / drop-out draw's fold_in ('Use jax.vmap for
    batching') when a vmap's default out_axes=0 gave the round counter a replica axis."""
    params = jnp.ones((N, 3))
    state = replicas.make_replicas(N, backend="vmap").init(outer, params)
    bad = jax.vmap(outer.update, in_axes=(0, replicas.replica_axes(state), 0),
                   axis_name="replica")  # fmt: skip
    _, moved = bad(params, state, params)
    with pytest.raises(ValueError, match="round counter of shape .*out_axes"):
        bad(params, moved, params)


class _Linear(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x)


def _nnx_replicas(tx):
    @nnx.vmap(in_axes=0, out_axes=0)
    def make_model(key):
        return _Linear(nnx.Rngs(key))

    model = make_model(jax.random.split(jax.random.key(0), N))

    @nnx.vmap(in_axes=0, out_axes=replicas.nnx_state_axes())
    def make_opt(m):
        return nnx.Optimizer(m, tx, wrt=nnx.Param)

    return model, make_opt(model)


def _nnx_step(model, opt, x):
    loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    opt.update(model, grads)
    return loss


def test_flax_nnx_recipe_keeps_counters_shared_and_trains():
    tx = local_steps(optax.adam(1e-2), noloco_outer(), sync_every=3)
    model, opt = _nnx_replicas(tx)
    step = nnx.jit(nnx.vmap(_nnx_step, in_axes=(0, replicas.nnx_state_axes(), 0),
                            axis_name="replica"))  # fmt: skip
    x = jax.random.normal(jax.random.key(1), (N, 5, 3))
    graphdef, flat = nnx.split((model, opt))

    def pure(flat, x):
        m, o = nnx.merge(graphdef, flat)
        return step(m, o, x)

    _assert_outer_work_only_in_a_branch(jax.make_jaxpr(pure)(flat, x), {(N, 3, 2), (N, 2)})
    for _ in range(3):
        step(model, opt, x)
    k = np.asarray(model.linear.kernel[...])
    slow = np.asarray(opt.opt_state.slow_params["linear"]["kernel"][...])
    np.testing.assert_allclose(k, slow, rtol=1e-6)  # step 3 synced: theta = phi (f32 rounding)
    assert opt.opt_state.count[...].shape == () and int(opt.opt_state.count[...]) == 3


@pytest.fixture(scope="module")
def nnx_vmap_recipe():
    """(tx, batches [6, N, 5, 3], nnx.state((model, optimizer)) after a step on each batch) of
    the nnx.vmap recipe with NoLoCo (sync_every=3): the reference of both backends' cases."""
    tx = local_steps(optax.adam(1e-2), noloco_outer(), sync_every=3)
    xs = jax.random.normal(jax.random.key(1), (6, N, 5, 3))
    model, opt = _nnx_replicas(tx)  # the nnx.vmap recipe
    vstep = nnx.jit(nnx.vmap(_nnx_step, in_axes=(0, replicas.nnx_state_axes(), 0),
                             axis_name="replica"))  # fmt: skip
    for x in xs:
        vstep(model, opt, x)
    return tx, xs, nnx.state((model, opt))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_flax_nnx_on_a_mesh_equals_the_vmap_recipe(nnx_vmap_recipe, backend):
    """The README's mesh recipe: each replica built on its own device, a pure step over
    nnx.split state; one replica per device gives the nnx.vmap recipe's numbers."""
    tx, xs, want = nnx_vmap_recipe

    reps = replicas.make_replicas(N, backend=backend)

    def make(key):
        m = _Linear(nnx.Rngs(key))
        return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    graphdef = nnx.graphdef(nnx.eval_shape(lambda: make(jax.random.key(0))))
    keys = reps.put(jax.random.split(jax.random.key(0), N))
    state = jax.jit(reps.map(lambda k: nnx.state(make(k))))(keys)

    def train_step(state, x):
        m, o = nnx.merge(graphdef, state)
        return nnx.state((m, o)), _nnx_step(m, o, x)

    step = jax.jit(reps.map(train_step), donate_argnums=0)
    for x in xs:
        state, _ = step(state, reps.put(x))
    mesh_model, mesh_opt = nnx.merge(graphdef, state)
    assert mesh_opt.opt_state.count[...].shape == () and step._cache_size() == 1
    got = nnx.state((mesh_model, mesh_opt))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), got, want)


def _nnx_built_with_out_axes_0():
    """N replicas and their nnx.Optimizer built under nnx.vmap(out_axes=0): a counter each."""
    tx = local_steps(optax.adam(1e-2), noloco_outer(), sync_every=3)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        m = _Linear(nnx.Rngs(key))
        return m, nnx.Optimizer(m, tx, wrt=nnx.Param)

    return make(jax.random.split(jax.random.key(0), N))


def test_flax_nnx_without_the_state_axes_is_refused():
    model, opt = _nnx_built_with_out_axes_0()
    step = nnx.vmap(_nnx_step, in_axes=(0, 0, 0), axis_name="replica")
    with pytest.raises(ValueError, match="nnx_state_axes"):
        step(model, opt, jnp.ones((N, 5, 3)))


def test_flax_nnx_optimizer_built_without_the_state_axes_names_out_axes():
    """An nnx.Optimizer built with out_axes=0 and stepped with in_axes=nnx_state_axes():
    the error told the user to pass in_axes=nnx_state_axes(), which they already did."""
    model, opt = _nnx_built_with_out_axes_0()
    step = nnx.vmap(_nnx_step, in_axes=(0, replicas.nnx_state_axes(), 0), axis_name="replica")
    with pytest.raises(ValueError, match=r"out_axes=replicas\.nnx_state_axes\(\)"):
        step(model, opt, jnp.ones((N, 5, 3)))


def test_restore_nonfinite_given_the_whole_nnx_state_names_the_params_filter():
    """nnx.state(model) (BatchStats, RNG state too) instead of nnx.state(model, nnx.Param)
    was a bare pytree structure error from inside restore_nonfinite."""

    class WithDropout(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 2, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

    tx = local_steps(optax.sgd(0.1), noloco_outer(), sync_every=2, nonfinite_guard=True)
    model = WithDropout(nnx.Rngs(0))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    with pytest.raises(ValueError, match=r"restore_nonfinite: .*nnx\.state\(model, nnx\.Param\)"):
        noloco_jax.restore_nonfinite(nnx.state(model), opt.opt_state)


def test_restore_nonfinite_takes_flax_nnx_params_and_optimizer_state():
    """nnx.state(model, nnx.Param) holds Params and an nnx.Optimizer's state OptVariables:
    restore_nonfinite raised a pytree structure error on the pair."""
    tx = local_steps(optax.sgd(0.1), noloco_outer(), sync_every=2, nonfinite_guard=True)
    model, opt = _nnx_replicas(tx)
    axes = replicas.nnx_state_axes()

    @nnx.jit
    @nnx.vmap(in_axes=(0, axes, 0), axis_name="replica")
    def step(model, opt, x):
        _nnx_step(model, opt, x)
        nnx.update(model, noloco_jax.restore_nonfinite(nnx.state(model, nnx.Param),
                                                       opt.opt_state))  # fmt: skip

    x = jnp.ones((N, 5, 3)).at[1].set(jnp.nan)  # replica 1 breaks
    for _ in range(2):
        step(model, opt, x)
    slow = opt.opt_state.slow_params["linear"]["kernel"][...]
    np.testing.assert_array_equal(model.linear.kernel[...][1], slow[1])  # put back on phi
    assert np.isfinite(model.linear.kernel[...]).all()
    assert opt.opt_state.nonfinite_resets[...].tolist() == [0.0, 1.0, 0.0, 0.0]


# ------------------------------------------------------------------ 2. pools connect


@pytest.mark.parametrize("num_replicas,n", [(8, 2), (16, 2), (64, 2), (16, 4), (12, 3)])
def test_every_pool_connects_all_replicas(num_replicas, n):
    for seed in range(20):
        for size in (2, 3):
            pool = comm.partition_pool(num_replicas, n, seed, size)
            assert comm.connects_all(pool, num_replicas), (seed, size)


def test_connects_all_detects_a_split():
    one_matching = comm.partition_pool(8, 2, 0)[:1]
    assert not comm.connects_all(one_matching, 8)
    assert comm.connects_all(comm.partition_pool(8, 2, 0), 8)


def test_a_pool_of_one_partition_is_refused():
    with pytest.raises(ValueError, match="pool_size=1 leaves replicas that never meet"):
        comm.partition_pool(8, 2, 0, pool_size=1)
    assert comm.partition_pool(4, 4, 0, pool_size=1).shape == (1, 1, 4)  # one group: fine


# ------------------------------------------------------------------ 3, 7. the guard


@functools.cache
def _guarded(sync_every=2, momentum=0.5):
    """The guarded NoLoCo optimizer (one object per settings, so the tests share its step)."""
    return local_steps(
        optax.adam(0.1),
        noloco_outer(learning_rate=0.5, momentum=momentum),
        sync_every,
        nonfinite_guard=True,
    )


@functools.cache
def _step2(tx):
    """``tx``'s jitted step over 2 vmapped replicas, compiled once for the tests that use it."""
    return jax.jit(replicas.make_replicas(2, backend="vmap").map(step_fn(tx)))


def _run(tx, grads_seq, params):
    reps = replicas.make_replicas(2, backend="vmap")
    state = reps.init(tx, params)
    step = _step2(tx)
    for g in grads_seq:
        params, state = step(params, state, g)
    return params, state


def test_guard_restarts_adam_with_a_fresh_count():
    tx = _guarded()
    params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
    ok = {"w": jnp.ones((2, 2))}
    bad = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0]])}
    _, state = _run(tx, [ok, ok, ok, bad], params)  # replica 1 broken at step 4 (a sync)
    counts = np.asarray(state.local_opt_state[0].count)
    np.testing.assert_array_equal(counts, [4, 0])
    np.testing.assert_array_equal(np.asarray(state.local_opt_state[0].mu["w"][1]), [0.0, 0.0])


def test_first_step_after_a_reset_is_one_learning_rate():
    tx = _guarded()
    params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
    ok = {"w": jnp.ones((2, 2))}
    bad = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0]])}
    p, state = _run(tx, [ok] * 7 + [bad], params)  # replica 1 caught at the 4th sync
    p = _restore(p, state)  # theta <- phi for the caught replica
    before = np.asarray(p["w"][1])
    p2, _ = _run_from(tx, p, state, [{"w": jnp.full((2, 2), 3.0)}])
    moved = np.asarray(p2["w"][1]) - before
    # Adam's first step is lr * sign(g); with the stale count of 8 it was ~0.49 lr.
    np.testing.assert_allclose(moved, -0.1, rtol=1e-5)


def _restore(params, state):
    from noloco_jax import restore_nonfinite

    reps = replicas.Replicas(2)
    return reps.map(restore_nonfinite)(params, state)


def _run_from(tx, params, state, grads_seq):
    step = _step2(tx)  # replicas.Replicas(2)'s step, as make_replicas(2, "vmap") is
    for g in grads_seq:
        params, state = step(params, state, g)
    return params, state


def test_guard_keeps_a_caught_replicas_momentum():
    tx = _guarded()
    params = {"w": jnp.array([[1.0, 2.0], [3.0, 4.0]])}
    ok = {"w": jnp.ones((2, 2))}
    bad = {"w": jnp.array([[1.0, 1.0], [jnp.nan, 1.0]])}
    _, s1 = _run(tx, [ok, ok], params)
    _, s2 = _run(tx, [ok, ok, ok, bad], params)
    m1 = np.asarray(s1.outer_state.sgd_state[0].trace["w"])
    m2 = np.asarray(s2.outer_state.sgd_state[0].trace["w"])
    np.testing.assert_array_equal(m2[1], m1[1])  # caught: kept, not decayed
    assert not np.allclose(m2[0], m1[0])  # healthy partner: moved on
    assert int(s2.outer_state.round) == 2


# ------------------------------------------------------------------ 4. phase flag checked


def test_a_wrong_sync_step_flag_is_reported_and_counted(capfd):
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 3)
    p = jnp.zeros(3)
    state = tx.init(p)
    step = jax.jit(lambda s, flag: tx.update(p, s, p, sync_step=flag)[1], static_argnums=1)
    state = step(state, False)  # step 1 of 3: right
    assert int(state.phase_errors) == 0 and "ERROR" not in capfd.readouterr().out
    state = step(state, True)  # step 2 is no sync: a round added
    assert int(state.phase_errors) == 1
    out = capfd.readouterr().out
    assert "sync_step=True but this is inner step 2" in out
    assert "for a 0-based loop index t: (t + 1) % sync_every == 0" in out
    state = step(state, False)  # step 3 is a sync: a round skipped
    assert int(state.phase_errors) == 2 and "was skipped" in capfd.readouterr().out


# ------------------------------------------------------------------ 5. apply_if_finite


def test_apply_if_finite_around_local_steps_is_refused():
    tx = optax.apply_if_finite(local_steps(optax.adam(0.1), noloco_outer(), 2), 3)
    reps = replicas.make_replicas(N, backend="vmap")
    with pytest.raises(ValueError, match="apply_if_finite wraps local_steps"):
        reps.init(tx, random_tree(jax.random.key(0), N))


def test_apply_if_finite_around_local_steps_is_refused_under_vmap_too():
    tx = optax.apply_if_finite(local_steps(optax.adam(0.1), noloco_outer(), 2), 3)
    params = random_tree(jax.random.key(0), N)
    state = jax.vmap(tx.init)(params)
    step = jax.vmap(step_fn(tx), axis_name="replica")
    with pytest.raises(ValueError, match="apply_if_finite around local_steps"):
        step(params, state, params)


def test_the_apply_if_finite_refusals_name_restore_nonfinite_which_repairs_the_weights():
    """The refusals (and the README) point at nonfinite_guard=True; the guard alone repairs the
    optimizer state, not the weights: without restore_nonfinite a caught replica stays NaN."""
    tx = optax.apply_if_finite(local_steps(optax.adam(0.1), noloco_outer(), 2), 3)
    params = random_tree(jax.random.key(0), N)
    with pytest.raises(ValueError, match="restore_nonfinite"):
        replicas.make_replicas(N, backend="vmap").init(tx, params)
    with pytest.raises(ValueError, match="restore_nonfinite"):
        jax.vmap(step_fn(tx), axis_name="replica")(params, jax.vmap(tx.init)(params), params)
    guarded = local_steps(optax.adam(0.1), noloco_outer(), 2, nonfinite_guard=True)
    reps = replicas.make_replicas(N, backend="vmap")

    def repaired(params, state, grads):
        params, state = step_fn(guarded)(params, state, grads)
        return noloco_jax.restore_nonfinite(params, state), state

    for fn, finite in ((step_fn(guarded), False), (repaired, True)):
        p, state = params, reps.init(guarded, params)
        p = jax.tree.map(lambda x: x.at[0].set(jnp.nan), p)  # replica 0 breaks mid-round
        step = jax.jit(reps.map(fn))
        for _ in range(4):  # two syncs
            p, state = step(p, state, jax.tree.map(jnp.ones_like, p))
        assert all(bool(jnp.isfinite(x[0]).all()) for x in jax.tree.leaves(p)) == finite


def _named(*stages):
    return optax.named_chain(*((f"s{i}", t) for i, t in enumerate(stages)))


@pytest.mark.parametrize("after", [optax.scale(0.5), optax.chain(optax.identity(),
                                                                 optax.scale(0.5))])
@pytest.mark.parametrize("chain", [optax.chain, _named])
def test_a_stage_after_local_steps_in_a_chain_is_refused(after, chain):
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    ok = chain(optax.clip_by_global_norm(1.0), local_steps(optax.adam(0.1), noloco_outer(), 2))
    reps.init(chain(optax.identity(), ok), params)  # before it (and nested): fine
    bad = chain(ok, after)  # named_chain's state is a dict of stages: was not checked
    with pytest.raises(ValueError, match="a transformation follows local_steps in an optax.chain"):
        reps.init(optax.chain(optax.identity(), bad), params)
    mask = jax.tree.map(lambda _: True, params)
    mask["b"] = False  # local_steps on some leaves, plain SGD on the others: fine
    split = optax.chain(optax.masked(local_steps(optax.adam(0.1), noloco_outer(), 2), mask),
                        optax.masked(optax.sgd(0.1), jax.tree.map(lambda m: not m, mask)))
    reps.init(split, params)
    labels = jax.tree.map(lambda m: "ls" if m else "sgd", mask)  # a dict state too: fine
    reps.init(optax.multi_transform({"ls": local_steps(optax.adam(0.1), noloco_outer(), 2),
                                     "sgd": optax.sgd(0.1)}, labels), params)


def test_an_update_outside_reps_map_names_the_fix():
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    tx = local_steps(optax.adam(1e-3), noloco_outer(), 2)
    state = reps.init(tx, params)
    with pytest.raises(ValueError, match=r"got the state of all replicas at once .* leading "
                       r"axis of 4\): call it per replica, e\.g\. jax\.jit\(reps\.map"):
        jax.jit(tx.update)(params, state, params)  # was a broadcasting error in Adam


def test_swapped_inner_and_outer_are_named():
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    with pytest.raises(ValueError, match=r"the order is local_steps\(inner, outer, sync_every\)"):
        reps.init(local_steps(noloco_outer(), optax.adam(1e-3), 2), params)
    hierarchical = local_steps(local_steps(optax.adam(1e-3), noloco_outer(), 2),
                               diloco_outer(axis_name=None), 4)  # an outer step nested: fine
    reps.init(hierarchical, params)


def test_apply_if_finite_inside_local_steps_works():
    tx = local_steps(optax.apply_if_finite(optax.adam(0.1), 3), noloco_outer(), 2)
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    state = reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)))
    grads = jax.tree.map(lambda x: x.at[0].set(jnp.nan), params)
    params, state = step(params, state, grads)
    params, state = step(params, state, jax.tree.map(jnp.ones_like, params))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    assert int(state.outer_state.round) == 1


# ------------------------------------------------------------------ 6. integer leaves


def test_integer_params_pass_through_untouched():
    # An integer buffer per replica (an integer *scalar* would be taken for a shared counter).
    params = {"w": jnp.arange(N * 2.0).reshape(N, 2), "n": jnp.arange(N * 3).reshape(N, 3)}
    inner = optax.masked(optax.sgd(0.1), {"w": True, "n": False})
    for outer in (noloco_outer(), diloco_outer()):
        tx = local_steps(inner, outer, 2)
        reps = replicas.make_replicas(N, backend="vmap")
        state = reps.init(tx, params)
        grads = {"w": jnp.ones((N, 2)), "n": jnp.zeros((N, 3), jnp.int32)}
        p, s = params, state
        step = jax.jit(reps.map(step_fn(tx)))  # traced and compiled once per outer
        for _ in range(4):
            p, s = step(p, s, grads)
        np.testing.assert_array_equal(p["n"], params["n"])  # never averaged
        assert s.slow_params["n"] is None and p["n"].dtype == jnp.int32


def test_data_parallel_passes_integer_leaves_through_unaveraged():
    # The README's integer-buffer rule holds for data_parallel too; its mean refused them.
    params = {"w": jnp.zeros((N, 2)), "n": jnp.arange(N * 3).reshape(N, 3)}
    tx = data_parallel(optax.masked(optax.sgd(1.0), {"w": True, "n": False}))
    reps = replicas.make_replicas(N, backend="vmap")
    grads = {"w": jnp.arange(N * 2.0).reshape(N, 2), "n": params["n"] + 1}
    updates, _ = reps.map(tx.update)(grads, reps.init(tx, params), params)
    np.testing.assert_array_equal(updates["n"], grads["n"])  # each replica's own
    np.testing.assert_allclose(updates["w"], -np.broadcast_to(grads["w"].mean(0), (N, 2)))


def test_noloco_outer_alone_does_not_average_integer_leaves():
    tx = noloco_outer(learning_rate=1.0, momentum=0.0)
    phi = {"w": jnp.zeros((N, 2)), "n": jnp.arange(N * 3).reshape(N, 3)}
    theta = {"w": jnp.arange(N * 2.0).reshape(N, 2), "n": phi["n"]}
    reps = replicas.make_replicas(N, backend="vmap")
    state = reps.init(tx, phi)
    grad = jax.tree.map(lambda a, b: a - b, phi, theta)
    delta, _ = reps.map(tx.update)(grad, state, phi)
    np.testing.assert_array_equal(delta["n"], np.zeros((N, 3), np.int32))


# ------------------------------------------------------------------ 8. low precision


def test_bf16_params_land_exactly_on_phi():
    params = {"w": (jnp.arange(N * 6.0).reshape(N, 6) / 7).astype(jnp.bfloat16)}
    tx = local_steps(optax.adam(1e-2), noloco_outer(), 2)
    reps = replicas.make_replicas(N, backend="vmap")
    p, s = params, reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)))
    grads = {"w": jnp.linspace(-1, 1, N * 6).reshape(N, 6).astype(jnp.bfloat16)}
    for _ in range(4):
        p, s = step(p, s, grads)
    np.testing.assert_array_equal(np.asarray(p["w"]), np.asarray(s.slow_params["w"]))


def test_float32_master_weights_for_bf16_params():
    params = {"w": (jnp.arange(N * 6.0).reshape(N, 6) / 7).astype(jnp.bfloat16)}
    tx = local_steps(optax.adam(1e-2), noloco_outer(), 2, slow_dtype=jnp.float32)
    reps = replicas.make_replicas(N, backend="vmap")
    p, s = params, reps.init(tx, params)
    assert s.slow_params["w"].dtype == jnp.float32
    assert s.outer_state.sgd_state[0].trace["w"].dtype == jnp.float32
    step = jax.jit(reps.map(step_fn(tx)))
    grads = {"w": jnp.linspace(-1, 1, N * 6).reshape(N, 6).astype(jnp.bfloat16)}
    for _ in range(4):
        p, s = step(p, s, grads)
    assert p["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(p["w"]), np.asarray(s.slow_params["w"].astype(jnp.bfloat16))
    )
    assert not np.array_equal(  # phi keeps digits bf16 cannot hold
        np.asarray(s.slow_params["w"]), np.asarray(p["w"].astype(jnp.float32))
    )


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_float32_params_land_on_bf16_slow_weights(backend):
    """slow_dtype=bfloat16 with float32 params: after a sync the params are phi (one float32
    rounding of the jump). XLA (excess precision) computed phi's last bf16 add in float32 and
    dropped its rounding on the way to the landing: vmap and one-device replicas landed up to
    half a bf16 ulp off the slow weights (470k of 558k weights of the nano model)."""
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(N, 256)), jnp.float32)}
    tx = local_steps(optax.sgd(0.1, momentum=0.9), noloco_outer(), 2, slow_dtype=jnp.bfloat16)
    reps = replicas.make_replicas(N, backend=backend)
    p, s = reps.put(params), reps.init(tx, reps.put(params))
    step = jax.jit(reps.map(step_fn(tx)))
    for t in range(4):
        grads = {"w": reps.put(jnp.asarray(rng.normal(size=(N, 256)), jnp.float32))}
        p, s = step(p, s, grads)
        if t % 2:  # a sync: theta = phi
            phi = np.asarray(s.slow_params["w"].astype(jnp.float32))
            # theta + (phi - theta) rounds twice in float32: off by float32 ulps of theta
            np.testing.assert_allclose(np.asarray(p["w"]), phi, rtol=0, atol=2.0**-21)


def test_float32_master_weights_of_complex_params_keep_the_imaginary_part():
    """slow_dtype=jnp.float32 cast a complex param's phi to float32 (imaginary part gone), so
    the first sync landed the weights on their real part."""
    params = {"c": jnp.full((N, 2), 1 + 2j, jnp.complex64), "w": jnp.ones((N, 2), jnp.bfloat16)}
    tx = local_steps(optax.sgd(0.0), diloco_outer(), 2, slow_dtype=jnp.float32)
    reps = replicas.make_replicas(N, backend="vmap")
    state = reps.init(tx, params)
    assert state.slow_params["c"].dtype == jnp.complex64
    assert state.slow_params["w"].dtype == jnp.float32
    step = jax.jit(reps.map(lambda p, s: step_fn(tx)(p, s, jax.tree.map(jnp.zeros_like, p))))
    for _ in range(2):  # the second step syncs; zero steps leave every weight where it was
        params, state = step(params, state)
    np.testing.assert_array_equal(params["c"], np.full((N, 2), 1 + 2j, np.complex64))


def test_slow_dtype_must_be_a_float():
    with pytest.raises(ValueError, match="slow_dtype"):
        local_steps(optax.sgd(0.1), noloco_outer(), 2, slow_dtype=jnp.int32)
    with pytest.raises(ValueError, match="slow_dtype"):  # was NumPy's TypeError, no field named
        local_steps(optax.sgd(0.1), noloco_outer(), 2, slow_dtype="float33")


@pytest.mark.parametrize("slow_dtype,match", [(jnp.float8_e4m3fn, "2 bytes or more"),
                                              (jnp.float8_e5m2, "2 bytes or more"),
                                              (jnp.float64, "jax_enable_x64")])
def test_slow_dtype_must_hold_the_slow_weights(slow_dtype, match):
    """A float8 phi turned a bf16 weight of 500 into NaN (1.3 into 1.25) at the first sync of
    a step that moved nothing; float64 without x64 was float32 with only JAX's warning."""
    with pytest.raises(ValueError, match=f"slow_dtype.*{match}"):
        local_steps(optax.sgd(0.1), noloco_outer(), 2, slow_dtype=slow_dtype)


# ------------------------------------------------------------------ composing


def _numpy_outer(phis, thetas_seq, groups_seq, lr_seq, alpha, nesterov):
    """Reference outer rounds with gamma = beta: g_i = phi_i - mean_G theta."""
    phis = [np.array(p, np.float64) for p in phis]
    trace = [np.zeros_like(p) for p in phis]
    out = []
    for thetas, groups, lr in zip(thetas_seq, groups_seq, lr_seq):
        new = []
        for i, p in enumerate(phis):
            g_members = next(g for g in groups if i in g)
            g = p - np.mean([thetas[j] for j in g_members], axis=0)
            trace[i] = alpha * trace[i] + g
            step = g + alpha * trace[i] if nesterov else trace[i]
            new.append(p - lr * step)
        phis = new
        out.append(phis)
    return out


@pytest.mark.parametrize("nesterov", [False, True])
def test_outer_lr_schedule_and_nesterov_match_numpy(nesterov):
    schedule = optax.linear_schedule(0.9, 0.3, transition_steps=3)
    tx = noloco_outer(learning_rate=schedule, momentum=0.5, nesterov=nesterov, seed=3)
    reps = replicas.make_replicas(N, backend="vmap")
    rng = np.random.default_rng(0)
    phi = jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)
    phi0 = np.asarray(phi)
    state = reps.init(tx, phi)
    update = jax.jit(reps.map(tx.update))
    thetas_seq, got = [], []
    for _ in range(4):
        theta = phi + jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)
        thetas_seq.append(np.asarray(theta))
        delta, state = update(phi - theta, state, phi)
        phi = phi + delta
        got.append(np.asarray(phi))
    groups = [comm.groups_for_round(r, N, 2, 3).tolist() for r in range(4)]
    lrs = [float(schedule(r)) for r in range(4)]
    want = _numpy_outer(list(phi0), thetas_seq, groups, lrs, 0.5, nesterov)
    np.testing.assert_allclose(np.stack(got), np.stack(want), rtol=1e-5, atol=1e-5)


def test_inject_hyperparams_of_the_outer_step_equals_fixed_rates():
    rng = np.random.default_rng(1)
    phi = jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)
    theta = phi + jnp.asarray(rng.normal(size=(N, 3)), jnp.float32)
    reps = replicas.make_replicas(N, backend="vmap")
    fixed = noloco_outer(learning_rate=0.6, momentum=0.4, gamma=0.9)
    inject = optax.inject_hyperparams(noloco_outer, static_args=INJECT_STATIC_ARGS)
    injected = inject(learning_rate=0.6, momentum=0.4, gamma=0.9)
    d1, _ = reps.map(fixed.update)(phi - theta, reps.init(fixed, phi), phi)
    s2 = reps.init(injected, phi)
    d2, s2 = reps.map(injected.update)(phi - theta, s2, phi)
    np.testing.assert_allclose(d1, d2, rtol=1e-5)  # gamma / beta: f32 on device vs Python
    s2.hyperparams["learning_rate"] = jnp.full_like(s2.hyperparams["learning_rate"], 0.0)
    d3, _ = reps.map(injected.update)(phi - theta, s2, phi)
    np.testing.assert_array_equal(np.asarray(d3), 0.0)  # the injected value is used
    # A scalar there: the message said "close over it", which cannot apply to a state entry.
    s2.hyperparams["learning_rate"] = jnp.float32(0.3)
    with pytest.raises(ValueError, match=r"hyperparams\['learning_rate'\] needs a leading replica "
                       rf"axis .* set it as reps.put\(jnp.full\(\({N},\), value\)\)"):  # fmt: skip
        reps.map(injected.update)(phi - theta, s2, phi)


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
@pytest.mark.parametrize("how", ["inject", "float32 momentum"])
def test_float32_hyperparameters_on_bfloat16_params_keep_the_state_dtypes(factory, how):
    """Injected (float32) rates turned a bf16 leaf's momentum float32 in the sync branch only:
    lax.cond refused the branches (a TypeError from inside local_steps)."""
    import importlib  # noqa: PLC0415

    module = importlib.import_module(factory.__module__)
    if how == "inject":
        outer = optax.inject_hyperparams(factory, static_args=module.INJECT_STATIC_ARGS)(
            learning_rate=0.7, momentum=0.5)  # fmt: skip
    else:
        outer = factory(0.7, jnp.asarray(0.5, jnp.float32))
    plain = factory(0.7, 0.5)
    params = {"a": jnp.ones((N, 3), jnp.bfloat16), "b": jnp.ones((N, 3), jnp.float32)}
    reps = replicas.make_replicas(N, backend="vmap")
    got = []
    for o in (outer, plain):
        tx = local_steps(optax.sgd(0.1), o, sync_every=2)
        step = jax.jit(reps.map(step_fn(tx)))
        p, st = params, reps.init(tx, params)
        for _ in range(4):  # two rounds
            p, st = step(p, st, jax.tree.map(jnp.ones_like, p))
        got.append(p)
    assert jax.tree.map(lambda x: x.dtype, got[0]) == jax.tree.map(lambda x: x.dtype, params)
    for x, y in zip(jax.tree.leaves(got[0]), jax.tree.leaves(got[1])):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_fragments_given_as_a_number_names_the_spec_to_pass():
    """fragments=2 was read as a one-leaf spec: errors about 3 fragments, or about leaves."""
    with pytest.raises(ValueError, match=r"fragments must be a fragment spec, e\.g\. "
                                         r"fragments\.by_layer_blocks\(params, 2\)"):  # fmt: skip
        local_steps(optax.sgd(0.1), noloco_outer(), 4, fragments=2)


def test_integer_leaves_are_neither_clipped_nor_counted():
    """Clipping and the replica spread counted int leaves: {'a': [3, 4]} clipped to norm 1
    gave [0.35, 0.47] beside an int leaf 7 (and the int leaf 0); the spread halved."""
    from noloco_jax.metrics import replica_spread  # noqa: PLC0415
    from noloco_jax.optim.clipping import clip_by_global_norm_fused  # noqa: PLC0415

    clip = clip_by_global_norm_fused(1.0)
    updates = {"a": jnp.array([3.0, 4.0]), "i": jnp.array([7], jnp.int32)}
    got, _ = clip.update(updates, clip.init(updates))
    np.testing.assert_allclose(got["a"], [0.6, 0.8], rtol=1e-6)
    assert got["i"].tolist() == [7] and got["i"].dtype == jnp.int32
    spread = lambda t: jax.vmap(lambda x: replica_spread(x, "r"), axis_name="r")(t)  # noqa: E731
    w = jnp.array([[0.0], [2.0]])
    with_int = {"w": w, "count": jnp.zeros((2, 3), jnp.int32)}
    assert spread(w).tolist() == spread(with_int).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
def test_nesterov_must_be_a_bool(factory):
    """nesterov='False' (a config string) turned Nesterov momentum on without a word."""
    for bad in ("False", 1e-4, 1):
        with pytest.raises(ValueError, match="nesterov: must be True or False"):
            factory(0.7, 0.5, nesterov=bad)


@pytest.mark.parametrize("factory, module", [(noloco_outer, "noloco"), (diloco_outer, "diloco")])
def test_injecting_a_structural_argument_names_the_static_args(factory, module):
    with pytest.raises(ValueError, match=f"noloco_jax.optim.{module}.INJECT_STATIC_ARGS"):
        optax.inject_hyperparams(factory)(learning_rate=0.6).init(jnp.zeros(3))
    static = importlib.import_module(f"noloco_jax.optim.{module}").INJECT_STATIC_ARGS
    tx = optax.inject_hyperparams(factory, static_args=static)(learning_rate=0.6)  # the fix works
    assert float(tx.init(jnp.zeros(3)).hyperparams["learning_rate"]) == pytest.approx(0.6)


@pytest.mark.parametrize("factory, module", [(noloco_outer, "noloco"), (diloco_outer, "diloco")])
@pytest.mark.parametrize("exchange", [{"exchange_dtype": jnp.bfloat16},  # callable: "a schedule"
                                      {"exchange_dtype": "int8", "error_feedback": True}])
def test_the_static_args_cover_the_exchange_options(factory, module, exchange):
    """With the documented static_args the README's exchange options compose with injection
    (jnp.bfloat16 was called as a schedule; a tracer reached a Python branch)."""
    static = importlib.import_module(f"noloco_jax.optim.{module}").INJECT_STATIC_ARGS
    outer = optax.inject_hyperparams(factory, static_args=static)(learning_rate=0.6, **exchange)
    fixed = factory(learning_rate=0.6, **exchange)
    reps = replicas.make_replicas(N, backend="vmap")
    phi = jnp.asarray(np.random.default_rng(2).normal(size=(N, 256)), jnp.float32)
    grad = 0.1 * phi[::-1]
    for tx in (outer, fixed):
        delta, _ = jax.jit(reps.map(tx.update))(grad, reps.init(tx, phi), phi)
        if tx is outer:
            injected = delta
    np.testing.assert_allclose(injected, delta, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
@pytest.mark.parametrize("seed", [-1, 1.5, 2**32, True])
def test_a_bad_seed_is_refused_at_construction(factory, seed):
    with pytest.raises(ValueError, match=r"seed: must be an integer in \[0, 2\*\*32 - 1\]"):
        factory(seed=seed)


def test_python_numbers_are_still_validated():
    with pytest.raises(ValueError, match="learning_rate"):
        noloco_outer(learning_rate=-1.0)
    with pytest.raises(ValueError, match="momentum"):
        diloco_outer(momentum=float("inf"))
    with pytest.raises(ValueError, match="gamma"):
        noloco_outer(learning_rate=optax.constant_schedule(0.7), gamma=optax.constant_schedule(1))
    with pytest.raises(ValueError, match="gamma: a gamma of its own needs a constant"):
        noloco_outer(learning_rate=optax.linear_schedule(0.1, 0.7, 5), gamma=0.5)
    noloco_outer(learning_rate=optax.linear_schedule(0.1, 0.7, 5))  # gamma follows it


def _train(tx, steps=6, num=N, params=None):
    reps = replicas.make_replicas(num, backend="vmap")
    params = random_tree(jax.random.key(0), num) if params is None else params
    state = reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)))
    for t in range(steps):
        grads = random_tree(jax.random.key(100 + t), num)
        params, state = step(params, state, grads)
    return params, state


def test_clipping_chained_before_local_steps():
    clip = optax.clip_by_global_norm(0.5)
    a, _ = _train(optax.chain(clip, local_steps(optax.sgd(0.1), noloco_outer(), 3)))
    b, _ = _train(local_steps(optax.chain(clip, optax.sgd(0.1)), noloco_outer(), 3))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6)


def test_multisteps_inside_local_steps_and_refused_outside():
    acc = optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2)
    params, state = _train(local_steps(acc.gradient_transformation(), noloco_outer(), 4), steps=8)
    assert int(state.outer_state.round) == 2
    with pytest.raises(ValueError, match="multiple of the MultiSteps accumulation count k=2"):
        local_steps(acc.gradient_transformation(), noloco_outer(), 3)
    outside = optax.MultiSteps(local_steps(optax.sgd(0.1), noloco_outer(), 4), 2)
    with pytest.raises(ValueError, match=r"MultiSteps wraps local_steps.*inner optimizer, so "
                                         r"that every call of local_steps is one inner step\.$"):
        check_composition(outside.init(random_tree(jax.random.key(0))))


def test_multisteps_that_can_end_off_a_sync_step_is_refused():
    """A count schedule was read at step 0 only (a jnp count not at all: k=3 under sync_every=4
    passed), and should_skip_update_fn does not count a skipped call: a NaN gradient moved every
    later accumulation end off the sync steps, silently."""
    with pytest.raises(ValueError, match=r"needs an int every_k_schedule: a count that changes"):
        local_steps(optax.MultiSteps(optax.sgd(0.1), lambda step: jnp.int32(3)), noloco_outer(), 4)
    with pytest.raises(ValueError, match=r"needs an int every_k_schedule"):
        local_steps(optax.MultiSteps(optax.sgd(0.1), lambda step: 2 + step // 8), noloco_outer(), 4)
    skipping = optax.MultiSteps(optax.sgd(0.1), 2, should_skip_update_fn=optax.skip_not_finite)
    with pytest.raises(ValueError, match=r"cannot take should_skip_update_fn.*nonfinite_guard"):
        local_steps(optax.chain(optax.clip(1.0), skipping.gradient_transformation()),
                    noloco_outer(), 4)  # fmt: skip


def test_multisteps_inside_a_chain_is_checked_or_refused():
    """An accumulation inside the inner chain escaped the check: with k=3 and sync_every=4 a
    sync fell in the middle of an accumulation, silently."""
    acc = lambda k: optax.MultiSteps(optax.sgd(0.1), k).gradient_transformation()  # noqa: E731
    clip = optax.clip_by_global_norm(1.0)
    with pytest.raises(ValueError, match="multiple of the MultiSteps accumulation count k=3"):
        local_steps(optax.chain(clip, acc(3)), noloco_outer(), 4)
    with pytest.raises(ValueError, match="multiple of the MultiSteps accumulation count k=3"):
        local_steps(optax.chain(clip, optax.chain(acc(3))), noloco_outer(), 4)
    params, state = _train(local_steps(optax.chain(clip, acc(2)), noloco_outer(), 4), steps=8)
    assert int(state.outer_state.round) == 2
    hidden = optax.MultiSteps(optax.sgd(0.1), 3)  # reached through a default, not a closure
    opaque = optax.GradientTransformationExtraArgs(
        hidden.init, lambda u, s, p=None, _m=hidden, **kw: _m.update(u, s, p, **kw))
    with pytest.raises(ValueError, match=r"cannot read its count k .*local_steps\(optax\."
                                         r"MultiSteps\(optax.chain\(\.\.\.\), k\)"):
        local_steps(opaque, noloco_outer(), 4).init(random_tree(jax.random.key(0)))


def test_masked_and_multi_transform():
    mask = {"w": True, "b": False}
    tx = optax.masked(local_steps(optax.sgd(0.1), noloco_outer(), 2), mask)
    params, _ = _train(tx, steps=4)
    start = random_tree(jax.random.key(0), N)
    grads = sum(random_tree(jax.random.key(100 + t), N)["b"] for t in range(4))
    np.testing.assert_allclose(params["b"], start["b"] + grads, rtol=1e-6, atol=1e-6)  # identity
    tx = optax.multi_transform(
        {"a": local_steps(optax.sgd(0.1), noloco_outer(), 2), "b": optax.adam(0.1)},
        {"w": "a", "b": "b"},
    )
    params, state = _train(tx, steps=4)
    ls = state.inner_states["a"].inner_state
    assert int(ls.outer_state.round) == 2 and ls.count.shape == ()


def test_restore_nonfinite_repairs_every_local_steps_of_a_partition():
    """Two local_steps (one per param group): restore_nonfinite read the first state only,
    so a replica broken in the second group stayed NaN after its guard caught it."""
    def guarded(outer, h):
        return local_steps(optax.sgd(0.1), outer, h, nonfinite_guard=True)

    tx = optax.partition({"a": guarded(noloco_outer(), 2), "b": guarded(diloco_outer(), 4)},
                         {"w": "a", "b": "b"})  # fmt: skip
    reps = replicas.make_replicas(N, backend="vmap")
    params = {"w": jnp.ones((N, 2)), "b": jnp.ones((N, 3))}
    state = reps.init(tx, params)

    def step(p, s, g):
        p, s = step_fn(tx)(p, s, g)
        return noloco_jax.restore_nonfinite(p, s), s

    grads = {"w": jnp.ones((N, 2)), "b": jnp.ones((N, 3)).at[1].set(jnp.nan)}
    step = jax.jit(reps.map(step))
    for _ in range(4):  # the "b" group syncs at step 4
        params, state = step(params, state, grads)
    np.testing.assert_array_equal(params["b"][1], np.ones(3))  # back on its slow weights
    assert np.isfinite(params["w"]).all() and np.isfinite(params["b"]).all()


def test_jit_with_donation_does_not_recompile():
    tx = local_steps(optax.adam(0.1), noloco_outer(), 2, nonfinite_guard=True)
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    state = reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)), donate_argnums=(0, 1))
    for t in range(5):
        params, state = step(params, state, random_tree(jax.random.key(t), N))
    assert step._cache_size() == 1


def test_user_written_shard_map_loop_equals_vmap():
    tx = local_steps(optax.adam(0.05), noloco_outer(seed=1), 2)
    mesh = jax.make_mesh((N,), ("replica",))
    params0 = random_tree(jax.random.key(0), N)
    state0 = replicas.make_replicas(N, backend="vmap").init(tx, params0)
    spec = jax.tree_util.tree_map_with_path(
        lambda path, x: P() if replicas.is_shared_leaf(x, path) else P("replica"), state0)

    def local(p, s, g):  # one replica's view: the leading axis of size 1 is the block
        sq = lambda t, ax: jax.tree.map(lambda x, a: x if a is None else x[0], t, ax,  # noqa: E731
                                        is_leaf=lambda x: x is None)  # fmt: skip
        s1 = sq(s, replicas.replica_axes(state0))
        p1, s1 = step_fn(tx)(jax.tree.map(lambda x: x[0], p), s1, jax.tree.map(lambda x: x[0], g))
        un = lambda t, ax: jax.tree.map(lambda x, a: x if a is None else x[None], t, ax,  # noqa: E731
                                        is_leaf=lambda x: x is None)  # fmt: skip
        return jax.tree.map(lambda x: x[None], p1), un(s1, replicas.replica_axes(state0))

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("replica"), spec, P("replica")),
                                    out_specs=(P("replica"), spec)))  # fmt: skip
    def put(tree, specs):
        return jax.tree.map(lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), tree, specs)

    full = lambda x: P("replica", *[None] * (x.ndim - 1))  # noqa: E731
    p = put(params0, jax.tree.map(full, params0))
    s = put(state0, jax.tree.map(lambda x, sp: sp if sp == P() else full(x), state0, spec))
    for t in range(4):
        g = random_tree(jax.random.key(50 + t), N)
        p, s = sharded(p, s, put(g, jax.tree.map(full, g)))
    reps = replicas.make_replicas(N, backend="vmap")
    q, r = params0, state0
    step = jax.jit(reps.map(step_fn(tx)))  # traced and compiled once
    for t in range(4):
        q, r = step(q, r, random_tree(jax.random.key(50 + t), N))
    for x, y in zip(jax.tree.leaves(p), jax.tree.leaves(q)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_fused_clip_equals_optax_clip_inside_local_steps():
    from noloco_jax.optim import clip_by_global_norm_fused

    a, _ = _train(local_steps(optax.chain(optax.clip_by_global_norm(0.3), optax.sgd(0.1)),
                              noloco_outer(), 2))  # fmt: skip
    b, _ = _train(local_steps(optax.chain(clip_by_global_norm_fused(0.3), optax.sgd(0.1)),
                              noloco_outer(), 2))  # fmt: skip
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)



def test_the_readme_api_example_runs_as_written_over_8_devices():
    """README "API in one example", with its undefined names filled in; the tests see 8 CPU
    devices, so backend="auto" is shard_map: every input must be placed (it once was not)."""
    import pathlib  # noqa: PLC0415

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    block = text.split("## API in one example", 1)[1].split("```python\n", 1)[1].split("```")[0]
    key = jax.random.key(0)
    x = jax.random.normal(key, (3, 8, 4, 5))
    scope = {
        "loss_fn": lambda p, b: jnp.mean((b[0] @ p["w"] - b[1]) ** 2),
        "params0": {"w": jnp.zeros((5, 1))},
        "batches": [(x[t], x[t].sum(-1, keepdims=True)) for t in range(3)],
    }
    exec(compile(block, "README.md", "exec"), scope)  # noqa: S102
    assert scope["reps"].backend == "shard_map"
    assert scope["params"]["w"].shape == (8, 5, 1) and np.isfinite(scope["params"]["w"]).all()


def test_the_readme_injected_hyperparameter_recipe_runs_on_a_mesh():
    """README: an injected hyperparameter is set per replica "as `...`"; that expression, run as
    written over 8 devices (backend="auto" is shard_map), must be a placed input the step takes
    (a bare jnp.full((8,), value) was refused as unplaced)."""
    import pathlib  # noqa: PLC0415
    import re  # noqa: PLC0415

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    sentence = text.split("An injected hyperparameter (", 1)[1].split("\n\n", 1)[0]
    expression = re.search(r"set it as\s+`([^`]+)`", sentence).group(1)
    outer = optax.inject_hyperparams(noloco_outer, static_args=INJECT_STATIC_ARGS)(0.7)
    tx = local_steps(optax.sgd(0.1), outer, sync_every=1)
    reps = replicas.make_replicas(8, backend="auto")
    assert reps.backend == "shard_map"
    params = reps.put(jnp.ones((8, 3)))
    state = reps.init(tx, params)
    state.outer_state.hyperparams["learning_rate"] = eval(  # noqa: S307
        expression, {"reps": reps, "jnp": jnp, "value": 0.0})
    updates, _ = jax.jit(reps.map(lambda p, s, g: tx.update(g, s, p)))(
        params, state, reps.put(jnp.ones((8, 3))))
    np.testing.assert_array_equal(np.asarray(updates), 0.0)  # outer lr 0: phi stays put

def test_the_readme_nnx_recipes_start_identical_replicas():
    """README's two Flax NNX recipes, run as written with data_parallel: the replicas start
    from one set of weights and stay one model (split keys once started them apart, and data
    parallel and DiLoCo never brought them together)."""
    import pathlib  # noqa: PLC0415

    text = (pathlib.Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    vmap_block = text.split("**Flax NNX.**", 1)[1].split("```python\n", 1)[1].split("```")[0]
    mesh_block = text.split("**Flax NNX, one replica per device", 1)[1]
    mesh_block = mesh_block.split("```python\n", 1)[1].split("```")[0]
    x = jax.random.normal(jax.random.key(1), (3, N, 5, 3))
    base = {"jax": jax, "jnp": jnp, "nnx": nnx, "replicas": replicas, "N": N,
            "Model": _Linear, "tx": data_parallel(optax.adam(1e-2)),
            "loss_fn": lambda m, b: (m(b) ** 2).mean()}  # fmt: skip
    scope = dict(base)
    exec(compile(vmap_block, "README.md", "exec"), scope)  # noqa: S102
    for b in x:
        scope["train_step"](scope["model"], scope["optimizer"], b)
    k = np.asarray(scope["model"].linear.kernel[...])
    assert np.ptp(k, axis=0).max() == 0.0 and np.ptp(k) > 0
    scope = dict(base, batches=list(x))
    exec(compile(mesh_block, "README.md", "exec"), scope)  # noqa: S102
    k = np.asarray(scope["model"].linear.kernel[...])
    assert np.ptp(k, axis=0).max() == 0.0 and np.ptp(k) > 0
