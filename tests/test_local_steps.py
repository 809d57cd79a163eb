"""local_steps and data_parallel: trajectories, reductions, compilation, HLO."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from noloco_jax import (
    comm,
    data_parallel,
    diloco_outer,
    hlo,
    local_steps,
    noloco_outer,
    replicas,
)
from tests.helpers import assert_trees_close, random_tree, run_steps, step_fn


def _grads(num_replicas, num_steps, seed=0):
    key = jax.random.key(seed)
    return [random_tree(jax.random.fold_in(key, t), num_replicas) for t in range(num_steps)]


def test_hand_computed_trajectory():
    # Two replicas, scalar params [1, 3], constant grads [1, -1], SGD(0.1),
    # outer lr 0.5, momentum 0.5, H = 2. By hand:
    #   step 1: theta = [0.9, 3.1]
    #   step 2: theta = [0.8, 3.2]; sync: mean theta = 2, g = phi - 2 = [-1, 1],
    #           trace = g, delta = -0.5 trace = [0.5, -0.5], phi = [1.5, 2.5]
    #   step 3: theta = [1.4, 2.6]
    #   step 4: theta = [1.3, 2.7]; sync: g = [-0.5, 0.5], trace = g + 0.5 trace
    #           = [-1, 1], delta = [0.5, -0.5], phi = [2.0, 2.0]
    tx = local_steps(optax.sgd(0.1), noloco_outer(learning_rate=0.5, momentum=0.5), 2)
    reps = replicas.make_replicas(2, backend="vmap")
    params = jnp.array([1.0, 3.0])
    state = reps.map(tx.init)(params)  # phi starts at each replica's params
    step = jax.jit(reps.map(step_fn(tx)))
    got = []
    for _ in range(4):
        params, state = step(params, state, jnp.array([1.0, -1.0]))
        got.append(params.tolist())
    np.testing.assert_allclose(
        got, [[0.9, 3.1], [1.5, 2.5], [1.4, 2.6], [2.0, 2.0]], rtol=1e-6, atol=1e-6
    )
    np.testing.assert_allclose(state.slow_params, [2.0, 2.0], rtol=1e-6)


def test_single_replica_unit_outer_step_is_plain_inner_optimizer():
    params0 = random_tree(jax.random.key(1))
    grads = [jax.tree.map(lambda x: x[0], g) for g in _grads(1, 7, seed=1)]
    inner = optax.adam(0.05)
    tx = local_steps(inner, noloco_outer(learning_rate=1.0, momentum=0.0, axis_name=None), 3)
    p_ref, s_ref = params0, inner.init(params0)
    p, s = params0, tx.init(params0)
    step_ref, step = jax.jit(step_fn(inner)), jax.jit(step_fn(tx))  # one compile each
    for g in grads:
        p_ref, s_ref = step_ref(p_ref, s_ref, g)
        p, s = step(p, s, g)
    assert_trees_close(p, p_ref, rtol=1e-6, atol=1e-7)
    assert int(s.count) == 7


def test_sync_every_step_with_unit_diloco_is_parameter_averaging():
    num_replicas = 4
    params0 = random_tree(jax.random.key(2))
    grads = _grads(num_replicas, 3, seed=2)
    tx = local_steps(optax.sgd(0.1), diloco_outer(learning_rate=1.0, momentum=0.0), 1)
    _, _, history, _ = run_steps(tx, params0, grads, num_replicas)
    expected = jax.tree.map(np.asarray, replicas.replicate(params0, num_replicas))
    for g, got in zip(grads, history):  # the reference on the host (numpy): no compiles
        stepped = jax.tree.map(lambda p, gg: p - 0.1 * np.asarray(gg), expected, g)
        mean = jax.tree.map(lambda x: np.broadcast_to(x.mean(0), x.shape), stepped)
        assert_trees_close(got, mean, rtol=1e-6, atol=1e-6)
        expected = mean


def test_inner_state_is_local_and_not_reset():
    num_replicas = 4
    params0 = random_tree(jax.random.key(3))
    grads = _grads(num_replicas, 4, seed=3)
    tx = local_steps(optax.adam(0.01), noloco_outer(), 2)
    _, state, _, _ = run_steps(tx, params0, grads, num_replicas)
    # Adam's first moment after 4 steps from zero: sum_t 0.1 * 0.9^(4-t) g_t, per replica.
    mu = jax.tree.map(lambda *g: sum(0.1 * 0.9 ** (3 - t) * np.asarray(gt)  # on the host
                                     for t, gt in enumerate(g)), *grads)  # fmt: skip
    assert_trees_close(state.local_opt_state[0].mu, mu, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("outer", ["noloco", "noloco_g", "diloco"])
def test_shard_map_training_equals_vmap(outer):
    num_replicas = 8
    make = {
        "noloco": lambda: noloco_outer(seed=3),
        "noloco_g": lambda: noloco_outer(gamma=0.9, group_size=4),
        "diloco": lambda: diloco_outer(),
    }[outer]
    tx = local_steps(optax.chain(optax.clip_by_global_norm(1.0), optax.adam(0.05)), make(), 3)
    params0 = random_tree(jax.random.key(4))
    grads = _grads(num_replicas, 7, seed=4)
    p_v, s_v, _, _ = run_steps(tx, params0, grads, num_replicas, backend="vmap")
    p_s, s_s, _, _ = run_steps(tx, params0, grads, num_replicas, backend="shard_map")
    assert_trees_close(p_v, p_s, rtol=1e-6, atol=1e-6)
    assert_trees_close(s_v, s_s, rtol=1e-6, atol=1e-6)
    assert not np.allclose(p_v["w"][0], p_v["w"][1])  # replicas really differ


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_no_recompilation_and_stable_state_types(backend):
    num_replicas = 8
    tx = local_steps(optax.adam(0.01), noloco_outer(), 2)
    params0 = random_tree(jax.random.key(5))
    reps = replicas.make_replicas(num_replicas, backend=backend)
    params = reps.put(replicas.replicate(params0, num_replicas))
    state = reps.put(replicas.replicate(tx.init(params0), num_replicas))
    types_before = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), (params, state))
    step = jax.jit(reps.map(step_fn(tx)))
    for g in _grads(num_replicas, 6, seed=5):  # crosses three sync steps
        params, state = step(params, state, reps.put(g))
    types_after = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), (params, state))
    assert step._cache_size() == 1
    assert types_before == types_after
    assert int(state.count) == 6 and int(state.outer_state.round) == 3


def test_composes_in_optax_chain_and_keeps_dtypes():
    params = {"w": jnp.ones((3,), jnp.bfloat16), "v": jnp.ones((2,), jnp.float32)}
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        local_steps(optax.adam(0.1), noloco_outer(axis_name=None), 2),
    )
    state = tx.init(params)
    step = jax.jit(step_fn(tx))
    for _ in range(4):
        params, state = step(params, state, jax.tree.map(jnp.ones_like, params))
    assert params["w"].dtype == jnp.bfloat16 and params["v"].dtype == jnp.float32
    assert state[1].slow_params["w"].dtype == jnp.bfloat16
    assert step._cache_size() == 1


def test_a_python_float_leaf_is_taken_like_optax_takes_it():
    """``init`` and an eager ``update`` read ``.dtype`` off every leaf, so a Python-float
    leaf (which optax.sgd takes) failed with AttributeError."""
    tx = local_steps(optax.sgd(0.5), noloco_outer(1.0, 0.0, axis_name=None), 1)
    params = {"t": 1.0, "w": jnp.ones(2)}
    state = tx.init(params)
    updates, new_state = tx.update({"t": 1.0, "w": jnp.ones(2)}, state, params)
    new = optax.apply_updates(params, updates)
    assert float(new["t"]) == 0.5 and new["w"].tolist() == [0.5, 0.5]
    assert float(new_state.slow_params["t"]) == 0.5
    assert jax.tree.map(lambda x: x.dtype, new_state) == jax.tree.map(lambda x: x.dtype, state)


@pytest.mark.parametrize("outer", [diloco_outer, noloco_outer])
def test_bfloat16_params_keep_the_outer_states_dtype_across_rounds(outer):
    """DiLoCo's all-replica mean came back in float32, so its bfloat16 momentum turned float32
    after one round: with the guard (the trainer's default) the sync step failed to compile
    ('cond branches must have equal output types')."""
    reps = replicas.make_replicas(2, backend="vmap")
    tx = local_steps(optax.adam(1e-3), outer(), 2, nonfinite_guard=True)
    params = {"w": jnp.ones((2, 3), jnp.bfloat16)}
    state = reps.init(tx, params)
    before = jax.tree.map(lambda x: x.dtype, state)
    step = jax.jit(reps.map(step_fn(tx)))
    for _ in range(4):  # two rounds
        params, state = step(params, state, jax.tree.map(jnp.ones_like, params))
    assert jax.tree.map(lambda x: x.dtype, state) == before and step._cache_size() == 1


@pytest.mark.parametrize("outer", [diloco_outer, noloco_outer])
def test_the_guard_runs_under_strict_dtype_promotion(outer):
    """The guard counted resets as ``resets + (1.0 - ok)``, a float minus a bool: every sync
    step raised under jax_numpy_dtype_promotion='strict'. (optax.sgd: optax.adam's bias
    correction is not strict-safe itself.)"""
    reps = replicas.make_replicas(2, backend="vmap")
    tx = local_steps(optax.sgd(0.1), outer(), 1, nonfinite_guard=True)
    params = {"w": jnp.ones((2, 3))}
    grads = {"w": jnp.array([[0.1] * 3, [jnp.nan] * 3])}  # replica 1 is caught

    step = jax.jit(reps.map(step_fn(tx)))  # traced again under "strict" (a jit cache key)

    def run():
        return step(params, reps.init(tx, params), grads)

    want = run()
    with jax.numpy_dtype_promotion("strict"):
        got = run()
    assert_trees_close(got, want, rtol=0, atol=0)
    assert got[1].nonfinite_resets.tolist() == [0.0, 1.0]


def _computations(text):
    """{name: body lines} of an HLO module's computations."""
    comps, name = {}, None
    for line in text.splitlines():
        head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if head and line.rstrip().endswith("{"):
            name = head.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def _sync_only(comps):
    """Computations reached only through branch 1 (``lax.cond``'s true branch) of a conditional."""
    first = set()
    for lines in comps.values():
        for line in lines:
            m = re.search(r"branch_computations=\{%[\w.\-]+, (%[\w.\-]+)\}", line)
            if m:
                first.add(m.group(1))
    seen, todo = set(), list(first)
    while todo:
        c = todo.pop()
        if c in seen or c not in comps:
            continue
        seen.add(c)
        for line in comps[c]:
            todo += re.findall(r"(%[\w.\-]+)", line.split("metadata=")[0].split("=", 1)[-1])
    return seen


def _param_copies(tx, params, steps=4):
    """Weight-shaped ``copy`` ops that run on inner steps of a donated, compiled scan.

    Copies inside the sync branch (``lax.cond``'s true branch and what it calls)
    run once per round and are not counted.
    """

    def body(carry, _):
        p, s = carry
        u, s = tx.update(jax.tree.map(lambda x: 1e-3 * jnp.sin(x), p), s, p)
        return (optax.apply_updates(p, u), s), None

    run = jax.jit(lambda c: jax.lax.scan(body, c, length=steps)[0], donate_argnums=0)
    comps = _computations(run.lower((params, tx.init(params))).compile().as_text())
    sync_only = _sync_only(comps)
    shapes = {"f32[%s]" % ",".join(map(str, p.shape)) for p in jax.tree.leaves(params)}
    lines = [ln for c, body_ in comps.items() if c not in sync_only for ln in body_]
    return sum(f"= {shape}{{1,0}} copy(" in ln for ln in lines for shape in shapes)


@pytest.mark.parametrize("guard", [False, True])
def test_inner_steps_copy_no_more_weights_than_plain_adam(guard):
    # Regression: selecting between the old and new outer state under the guard
    # made XLA copy phi and the outer momentum on every step, sync or not.
    params = {"a": jnp.ones((64, 96)), "b": jnp.ones((32, 96))}
    tx = local_steps(optax.adam(1e-3), noloco_outer(axis_name=None), 10**6, nonfinite_guard=guard)
    assert _param_copies(tx, params) <= _param_copies(optax.adam(1e-3), params)


def test_guarded_single_replica_keeps_the_outer_counter_shared():
    # The guard's kept outer state must still advance the (shared) round counter.
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2, nonfinite_guard=True)
    params = {"w": jnp.ones((3,))}
    state = tx.init(params)
    step = jax.jit(step_fn(tx))
    for _ in range(4):
        params, state = step(params, state, {"w": jnp.ones((3,))})
    assert int(state.outer_state.round) == 2 and float(state.nonfinite_resets) == 0.0


def test_flax_nnx_optimizer():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.linear = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x):
            return self.linear(x)

    x = jnp.arange(12.0).reshape(4, 3) / 10
    y = jnp.ones((4, 1))

    def loss_fn(model):
        return jnp.mean((model(x) - y) ** 2)

    def train(tx):
        model = Model(nnx.Rngs(0))
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def step(model, opt):
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            opt.update(model, grads)
            return loss

        return [float(step(model, opt)) for _ in range(6)], model

    wrapped = local_steps(optax.sgd(0.1), noloco_outer(1.0, 0.0, axis_name=None), 2)
    losses, model = train(wrapped)
    plain_losses, plain = train(optax.sgd(0.1))
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    assert losses[-1] < losses[0]
    np.testing.assert_allclose(model.linear.kernel[...], plain.linear.kernel[...], rtol=1e-6)


def test_data_parallel_averages_gradients_every_step():
    num_replicas = 4
    params0 = random_tree(jax.random.key(6))
    grads = _grads(num_replicas, 3, seed=6)
    p, _, _, _ = run_steps(data_parallel(optax.sgd(0.1)), params0, grads, num_replicas)
    expected = jax.tree.map(np.asarray, params0)
    for g in grads:  # the reference on the host (numpy)
        expected = jax.tree.map(lambda e, gg: e - 0.1 * np.asarray(gg).mean(0), expected, g)
    assert_trees_close(p, replicas.replicate(expected, num_replicas), rtol=1e-6, atol=1e-6)
    alone = data_parallel(optax.sgd(0.1), axis_name=None)
    single = jax.tree.map(lambda x: x[0], grads[0])
    u, _ = alone.update(single, alone.init(params0), params0)
    assert_trees_close(u, jax.tree.map(lambda x: -0.1 * x, single))


def test_data_parallel_averages_integer_gradients_of_float_params():
    """An int32 gradient of a float param was left out of the mean (taken for a buffer's), so
    each replica stepped by its own gradient and the replicas drifted apart; an int buffer's
    own update still stays per replica."""
    reps = replicas.make_replicas(4, backend="vmap")
    tx = data_parallel(optax.sgd(1.0))
    params = {"w": jnp.zeros((4, 2), jnp.bfloat16), "buf": jnp.zeros((4, 2), jnp.int32)}
    grads = {"w": jnp.arange(8, dtype=jnp.int32).reshape(4, 2),
             "buf": jnp.arange(8, dtype=jnp.int32).reshape(4, 2)}
    updates, _ = jax.jit(reps.map(tx.update))(grads, reps.init(tx, params), params)
    np.testing.assert_array_equal(updates["w"], np.tile([[-3.0, -4.0]], (4, 1)))
    assert updates["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(updates["buf"], -np.arange(8).reshape(4, 2))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_sync_every_must_be_positive_integer(bad):
    with pytest.raises(ValueError, match="sync_every"):
        local_steps(optax.sgd(0.1), noloco_outer(), bad)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_nonfinite_guard_must_be_a_bool(bad):
    """"yes", 1 or None were taken as truthy or falsy flags."""
    with pytest.raises(ValueError, match="nonfinite_guard: must be True or False"):
        local_steps(optax.sgd(0.1), noloco_outer(), 2, nonfinite_guard=bad)


def test_unbound_axis_in_wrappers():
    params = jnp.zeros(2)
    for tx in [
        data_parallel(optax.sgd(0.1), axis_name="dp"),
        local_steps(optax.sgd(0.1), diloco_outer(axis_name="dp"), 1),
    ]:
        with pytest.raises(ValueError, match="'dp'.*jax.vmap"):
            tx.update(params, tx.init(params), params)


# ---------------------------------------------------------------- compiled HLO


def _compiled_step_text(tx, num_replicas=8, params0=None):
    params0 = params0 if params0 is not None else random_tree(jax.random.key(7))
    reps = replicas.make_replicas(num_replicas, backend="shard_map")
    params = reps.put(replicas.replicate(params0, num_replicas))
    state = reps.put(replicas.replicate(tx.init(params0), num_replicas))
    grads = reps.put(replicas.replicate(jax.tree.map(jnp.ones_like, params0), num_replicas))
    step = jax.jit(reps.map(step_fn(tx)))
    return hlo.compiled_text(step, params, state, grads), params0


@pytest.mark.parametrize(
    "gamma,exchange_dtype,factor",
    [(None, None, 1.0), (0.9, None, 2.0), (None, jnp.bfloat16, 0.5), (0.9, jnp.bfloat16, 1.0)],
)
def test_noloco_hlo_has_only_collective_permutes_inside_branches(gamma, exchange_dtype, factor):
    tx = local_steps(optax.adam(0.01), noloco_outer(gamma=gamma, exchange_dtype=exchange_dtype), 5)
    text, params0 = _compiled_step_text(tx)
    ops = hlo.collective_ops(text)
    kinds = {op.kind for op in ops}
    assert kinds == {"collective-permute"}, kinds  # no all-reduce, no all-gather
    assert not any(op.in_entry for op in ops)  # only inside the sync branch
    per_branch = hlo.bytes_by_computation(text, "collective-permute")
    assert len(per_branch) == 7  # one switch branch per round-robin matching of 8
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params0))
    expected = comm.noloco_bytes_per_sync(
        params0, gamma_equals_beta=gamma is None, exchange_dtype=exchange_dtype
    )
    assert expected == factor * param_bytes
    assert set(per_branch.values()) == {expected}


def test_noloco_group_of_four_sends_two_buffers_per_sync():
    tx = local_steps(optax.sgd(0.1), noloco_outer(group_size=4), 5)
    text, params0 = _compiled_step_text(tx)
    per_branch = hlo.bytes_by_computation(text, "collective-permute")
    assert set(per_branch.values()) == {comm.noloco_bytes_per_sync(params0, group_size=4)}


def test_diloco_hlo_has_all_reduce_in_sync_branch_only():
    text, params0 = _compiled_step_text(local_steps(optax.adam(0.01), diloco_outer(), 5))
    ops = hlo.collective_ops(text)
    assert {op.kind for op in ops} == {"all-reduce"}
    assert not any(op.in_entry for op in ops)
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params0))
    assert sum(op.bytes for op in ops) == param_bytes


def test_data_parallel_hlo_all_reduces_every_step():
    text, params0 = _compiled_step_text(data_parallel(optax.adam(0.01)))
    ops = hlo.collective_ops(text)
    assert {op.kind for op in ops} == {"all-reduce"}
    assert all(op.in_entry for op in ops)
