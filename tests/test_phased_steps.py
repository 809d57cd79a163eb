"""Phase known on the host: local_steps(sync_step=...) and the trainer's two programs.

The static phase must give the on-device ``lax.cond`` trajectory, an inner step
compiled with it must be the inner optimizer's step alone, and the loop must
compile two programs (inner steps, sync step), the inner one once per block length.
"""

import functools
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import hlo, local_steps, models, noloco_outer, replicas
from noloco_jax.trainer import build, health, loop
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState, make_program, run_steps, train_step
from tests.helpers import assert_trees_close, random_tree

CFG = models.get_preset("nano", vocab_size=64, max_seq_len=16, hidden_size=16, num_heads=2,
                         num_layers=1, mlp_hidden_size=32)


def test_static_phase_equals_on_device_phase():
    h, n = 3, 4
    tx = local_steps(optax.adam(0.05), noloco_outer(), h)
    reps = replicas.make_replicas(n, backend="vmap")

    def step(params, state, grads, sync_step):
        kw = {} if sync_step is None else {"sync_step": sync_step}
        updates, state = tx.update(grads, state, params, **kw)
        return optax.apply_updates(params, updates), state

    steps = {mode: jax.jit(reps.map(functools.partial(step, sync_step=mode)))
             for mode in (None, True, False)}  # fmt: skip
    params0 = random_tree(jax.random.key(0), n)
    p_dyn = p_sta = params0
    s_dyn = s_sta = reps.map(tx.init)(params0)
    for t in range(8):
        g = random_tree(jax.random.key(100 + t), n)
        p_dyn, s_dyn = steps[None](p_dyn, s_dyn, g)
        p_sta, s_sta = steps[(t + 1) % h == 0](p_sta, s_sta, g)
        # Float rounding only (XLA fuses the update into the params without the
        # cond in between); a sync on the wrong step would differ by O(1).
        assert_trees_close((p_sta, s_sta), (p_dyn, s_dyn), rtol=1e-6, atol=1e-6)
    assert int(s_sta.count) == 8  # a shared scalar


def test_static_inner_step_has_no_weight_cond_and_no_collective():
    reps = replicas.make_replicas(2, backend="shard_map")  # real collectives in the HLO
    params = reps.put(random_tree(jax.random.key(0), 2))

    def text(sync_step, check_phase=True):
        tx = local_steps(optax.adam(0.05), noloco_outer(), 3, check_phase=check_phase)
        state = reps.init(tx, params)
        f = reps.map(lambda g, s, p: tx.update(g, s, p, sync_step=sync_step))
        return hlo.compiled_text(jax.jit(f), params, state, params)

    inner = text(False)  # compiled once, read twice
    conds = re.findall(r"= (\S+) conditional\(", inner)
    assert conds == ["()"]  # only the scalar phase check, which returns nothing
    assert "conditional(" not in text(False, check_phase=False)
    assert "f32[5]{0}" in re.search(r"= (.*) conditional\(", text(None)).group(1)  # on device
    assert not hlo.collective_ops(inner)
    assert hlo.collective_ops(text(True))  # the sync step exchanges with partners


@pytest.mark.parametrize("check_phase,printed", [(True, True), ("count", False)])
def test_a_wrong_phase_is_counted_and_printed_unless_count_only(capfd, check_phase, printed):
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2, check_phase=check_phase)
    p = jnp.zeros(3)
    step = jax.jit(lambda s: tx.update(p, s, p, sync_step=True)[1])  # step 1 of 2: no round end
    lowered = step.lower(tx.init(p))
    assert ("callback" in lowered.as_text()) == printed  # only a printing check calls the host
    state = step(tx.init(p))
    jax.effects_barrier()
    assert int(state.phase_errors) == 1
    assert ("ERROR local_steps: sync_step=True" in capfd.readouterr().out) == printed


def test_trainer_stops_on_a_phase_error():
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2, check_phase="count")
    p = jnp.zeros(3)
    good = TrainState(jnp.zeros([], jnp.int32), p, tx.init(p))
    health.check_phase_errors(good, 2)  # no error counted: nothing happens
    bad = good._replace(opt_state=good.opt_state._replace(phase_errors=jnp.ones([], jnp.int32)))
    with pytest.raises(RuntimeError, match="by step 2 the trainer ran a sync step"):
        health.check_phase_errors(bad, 2)


@pytest.mark.parametrize("bad", ["yes", 1, 0, 1.0, 0.0])  # ints and floats equal a bool
def test_check_phase_must_be_true_false_or_count(bad):
    with pytest.raises(ValueError, match="check_phase must be True, False or 'count'"):
        local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2, check_phase=bad)


def test_sync_step_must_be_a_bool():
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2)
    p = jnp.zeros(3)
    with pytest.raises(ValueError, match="sync_step must be None, True or False"):
        tx.update(p, tx.init(p), p, sync_step=1)


def test_numpy_phase_flags_equal_python_ones():
    """``(t + 1) % H == 0`` for a step t of np.arange is an np.bool_, which was refused."""
    tx = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), 2)
    p = jnp.arange(3.0)

    def run(flag):
        params, state = p, tx.init(p)
        for t in np.arange(4):
            updates, state = tx.update(jnp.sin(params), state, params, sync_step=flag(t))
            params = optax.apply_updates(params, updates)
        return params, state

    got, state = run(lambda t: (t + 1) % 2 == 0)
    want, _ = run(lambda t: bool((t + 1) % 2 == 0))
    np.testing.assert_array_equal(got, want)
    assert int(state.phase_errors) == 0 and int(state.outer_state.round) == 2


def _model_setup(h):
    graphdef, params = models.init_params(CFG, 0)
    tx = optax.chain(optax.clip_by_global_norm(1.0),
                     local_steps(optax.adam(1e-2), noloco_outer(), h))  # fmt: skip
    return graphdef, tx, TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))


def _fake_run(reps, graphdef, tx, n, log_every, period, **kwargs):
    """A ``build.Run`` with only what ``loop._run_blocks`` reads; batches from a seeded RNG."""
    def batch(t):
        return np.random.default_rng(t).integers(0, CFG.vocab_size, (n, 2, 9)).astype(np.int32)

    inner, sync = build.make_programs(reps, dict(grads_fn=grads.plain(graphdef), tx=tx, **kwargs),
                                 rounds=True, fragments=False)  # fmt: skip
    data = types.SimpleNamespace(batcher=types.SimpleNamespace(batch=batch))
    return types.SimpleNamespace(inner=inner, sync=sync, block=np.gcd(log_every, period),
                                 period=period, reps=reps, data=data, calls=set(),
                                 delay=0), batch  # fmt: skip


@pytest.mark.parametrize("log_every,h,start", [(2, 4, 0), (4, 2, 0), (3, 3, 1)])
def test_two_programs_equal_on_device_phase(log_every, h, start):
    """Blocks of inner steps and lone sync steps (any start: a resume) = the on-device cond."""
    n, steps = 2, 8
    graphdef, tx, single = _model_setup(h)
    reps = replicas.make_replicas(n, backend="vmap")
    run, batch = _fake_run(reps, graphdef, tx, n, log_every, h)
    dynamic = jax.jit(reps.map(functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx)))
    b = replicas.replicate(single, n)
    for t in range(start):  # a resume mid-block
        b, _ = dynamic(b, jnp.asarray(batch(t)))
    a = jax.tree.map(jnp.copy, b)
    step, synced = start, []
    while step < start + steps:
        k = min(log_every - step % log_every, start + steps - step)
        a, loss_a = loop._run_blocks(run, a, step, k, synced)
        loss_b = []
        for t in range(step, step + k):
            b, loss = dynamic(b, jnp.asarray(batch(t)))
            loss_b.append(loss)
        np.testing.assert_allclose(loss_a, np.stack(loss_b, 1), rtol=1e-6)
        assert_trees_close(a, b, rtol=1e-5, atol=1e-6)  # rounding, compounded over steps
        step += k
    assert int(a.opt_state[1].count) == start + steps
    # The guard's counters, read after each sync program (the escalation counts per sync).
    assert len(synced) == sum((t + 1) % h == 0 for t in range(start, start + steps))
    # Two programs: the sync step compiled once, the inner steps once per block length.
    lengths = {size for name, size in run.calls if name == "inner"}
    assert run.inner._cache_size() == len(lengths) and run.sync._cache_size() == 1


def test_counter_out_of_step_with_the_run_is_refused():
    _, _, state = _model_setup(2)
    health.check_counter(state, 0)
    with pytest.raises(ValueError, match="step counter"):
        health.check_counter(state, 5)


def test_sync_program_needs_no_more_memory_than_on_device_phase():
    # Weights dominate this model's footprint, as in real training. A sync step compiled as
    # straight-line code kept ~2 more weight-sized temporaries than one inside a loop.
    cfg = models.get_preset("nano", vocab_size=64, max_seq_len=16, hidden_size=128, num_heads=2,
                            num_layers=1, mlp_hidden_size=512)  # fmt: skip
    graphdef, params = models.init_params(cfg, 0)
    tx = local_steps(optax.adam(1e-2), noloco_outer(axis_name=None), 2)
    state = jax.eval_shape(lambda: TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)))
    tokens = jax.ShapeDtypeStruct((1, 1, 9), jnp.int32)
    weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))

    def temp_bytes(sync_step):
        step_fn = functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx,
                                    sync_step=sync_step)  # fmt: skip
        f = jax.jit(functools.partial(run_steps, step_fn=step_fn), donate_argnums=0)
        m = f.lower(state, tokens).compile().memory_analysis()
        return m.temp_size_in_bytes

    assert temp_bytes(True) <= temp_bytes(None) + 0.25 * weight_bytes


def test_guard_repairs_on_sync_steps_and_ends_the_round_in_the_same_state():
    # Replica 1's weights turn NaN at step 0 of a round of H = 2. With the phase
    # from the host the repair runs at the sync (step 1) only, so both losses are
    # NaN; with the on-device phase it runs after every step, so step 1 is computed
    # on phi (finite loss, but its Adam moments are NaN). Either way the sync
    # catches it, resets its moments and leaves the same state.
    n, h = 2, 2
    graphdef, params = models.init_params(CFG, 0)
    tx = local_steps(optax.adam(1e-2), noloco_outer(), h, nonfinite_guard=True)
    state0 = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), n)
    reps = replicas.make_replicas(n, backend="vmap")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (n, 2, 2, 9)), jnp.int32)
    corrupt = build.nan_drill(types.SimpleNamespace(inject_nan_step=0, inject_nan_replica=1))
    kwargs = dict(grads_fn=grads.plain(graphdef), tx=tx, nonfinite_guard=True, corrupt=corrupt)
    inner, sync = (make_program(reps, sync_step=p, **kwargs) for p in (False, True))
    host, loss_i = inner(jax.tree.map(jnp.copy, state0), tokens[:, :1])
    host, loss_s = sync(host, tokens[:, 1:])
    loss_host = jnp.concatenate([loss_i, loss_s], 1)
    device, loss_device = make_program(reps, sync_step=None, **kwargs)(
        jax.tree.map(jnp.copy, state0), tokens)
    assert np.isfinite(loss_host[0]).all() and np.isnan(loss_host[1]).all()
    assert np.isnan(loss_device[1, 0]) and np.isfinite(loss_device[1, 1])
    np.testing.assert_array_equal(host.opt_state.nonfinite_resets, [0.0, 1.0])
    assert_trees_close(host, device, rtol=1e-5, atol=1e-6)  # rounding, as in the chunk test
    for leaf, start in zip(jax.tree.leaves(host.params), jax.tree.leaves(params)):
        np.testing.assert_array_equal(leaf[1], start)  # back on its slow weights (the start)


def test_static_inner_step_moves_no_more_bytes_than_plain_adam():
    # XLA's cost analysis of the compiled trainer step (deterministic, unlike timings):
    # an inner step of local_steps must cost what the inner optimizer's step costs.
    graphdef, params = models.init_params(CFG, 0)
    tokens = jnp.zeros((2, 2, 9), jnp.int32)

    def step_bytes(tx, sync_step):
        state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), 2)
        f = jax.jit(replicas.Replicas(2).map(functools.partial(
            train_step, grads_fn=grads.plain(graphdef), tx=tx, nonfinite_guard=True,
            sync_step=sync_step)),
            donate_argnums=0)  # as the trainer: phi passes through without a copy
        cost = f.lower(state, tokens).compile().cost_analysis()
        return float((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])

    plain = step_bytes(optax.adam(1e-2), None)
    guarded = local_steps(optax.adam(1e-2), noloco_outer(), 3, nonfinite_guard=True)
    inner, sync = step_bytes(guarded, False), step_bytes(guarded, True)
    # A few hundred bytes of scalar work (the step counter); an extra pass over the
    # weights, as with the on-device phase's cond output, would add ~8 B per parameter.
    assert inner <= plain * 1.001, (inner, plain)
    assert sync > 1.2 * plain  # the count sees the outer step's passes over the weights
