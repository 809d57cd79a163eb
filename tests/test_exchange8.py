"""8-bit exchange for NoLoCo and DiLoCo: bytes from HLO, one mean per group, error feedback."""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from jax import lax

from noloco_jax import comm, diloco_outer, hlo, local_steps, noloco_outer, quantize, replicas
from noloco_jax.optim.diloco import DiLoCoOuterState
from noloco_jax.trainer import optimizer as trainer_optimizer
from noloco_jax.trainer.settings import FaultSettings, OptimSettings, OuterSettings
from tests.helpers import step_fn

N = 4


def _tree(num=None, seed=0):
    lead = () if num is None else (num,)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"a": jax.random.normal(k1, lead + (40, 16)), "b": jax.random.normal(k2, lead + (300,))}


def _sync_hlo(outer, guard):
    """Compiled HLO of a sync step of ``local_steps(sgd, outer)`` over N shard_map replicas."""
    tx = local_steps(optax.sgd(0.1), outer, 5, nonfinite_guard=guard)
    reps = replicas.make_replicas(N, backend="shard_map")
    params = reps.put(_tree(N))
    state = reps.init(tx, params)
    f = jax.jit(reps.map(lambda g, s, p: tx.update(g, s, p, sync_step=True)))
    return hlo.compiled_text(f, params, state, params)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("guard", [False, True])
def test_sync_step_sends_a_quarter_of_float32_plus_scales(fmt, guard):
    per_branch = hlo.bytes_by_computation(_sync_hlo(noloco_outer(exchange_dtype=fmt), guard),
                                          "collective-permute")  # fmt: skip
    single = _tree()
    want = comm.noloco_bytes_per_sync(single, exchange_dtype=fmt, with_presence=guard)
    n = comm.tree_num_elements(single)
    assert want == n + 4 * -(-n // quantize.BLOCK) + 4 * guard
    assert set(per_branch.values()) == {want}, per_branch
    assert want / comm.noloco_bytes_per_sync(single) < 0.27


@pytest.mark.parametrize("fmt", [None, jnp.bfloat16, "int8"])
def test_byte_counts_leave_out_integer_leaves_which_never_travel(fmt):
    # They were counted (int8: 1536 bytes per NoLoCo sync for the 1016 that the HLO sends).
    with_int = {**_tree(), "step": jnp.zeros((512,), jnp.int32)}
    assert comm.noloco_bytes_per_sync(with_int, exchange_dtype=fmt) == \
        comm.noloco_bytes_per_sync(_tree(), exchange_dtype=fmt)
    assert comm.diloco_bytes_per_sync(with_int, N, exchange_dtype=fmt) == \
        comm.diloco_bytes_per_sync(_tree(), N, exchange_dtype=fmt)
    if fmt == "int8":  # and the compiled step sends what is counted
        tx = local_steps(optax.sgd(0.1), noloco_outer(exchange_dtype=fmt), 5)
        reps = replicas.make_replicas(N, backend="shard_map")
        params = reps.put({**_tree(N), "step": jnp.zeros((N, 512), jnp.int32)})
        f = jax.jit(reps.map(lambda g, s, p: tx.update(g, s, p, sync_step=True)))
        text = hlo.compiled_text(f, params, reps.init(tx, params), params)
        sent = set(hlo.bytes_by_computation(text, "collective-permute").values())
        assert sent == {comm.noloco_bytes_per_sync(with_int, exchange_dtype=fmt)}


@pytest.mark.parametrize("fmt", [jnp.bfloat16, "int8"])
def test_byte_counts_take_a_complex_leaf_as_the_real_pairs_that_travel(fmt):
    # A complex leaf travels as (real, imag) pairs: with a narrow wire it was counted at half.
    single = {"c": jnp.ones((64,), jnp.complex64)}
    pairs = {"c": jnp.ones((64, 2))}
    assert comm.diloco_bytes_per_sync(single, N, exchange_dtype=fmt) == \
        comm.diloco_bytes_per_sync(pairs, N, exchange_dtype=fmt)
    tx = local_steps(optax.sgd(0.1), noloco_outer(exchange_dtype=fmt), 5)
    reps = replicas.make_replicas(N, backend="shard_map")
    params = reps.put({"c": jnp.ones((N, 64), jnp.complex64)})
    f = jax.jit(reps.map(lambda g, s, p: tx.update(g, s, p, sync_step=True)))
    text = hlo.compiled_text(f, params, reps.init(tx, params), params)
    sent = set(hlo.bytes_by_computation(text, "collective-permute").values())
    assert sent == {comm.noloco_bytes_per_sync(single, exchange_dtype=fmt)}


# What users compile with: the suite's fast-compile flags hid a disagreement (a member's own
# message was folded back into its unrounded values; the others decoded its bytes).
OPTIMIZED = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}


@pytest.mark.parametrize("n, num", [(2, N), (3, 6), (4, N)])  # pairs, cyclic shifts, butterfly
def test_the_group_agrees_on_one_mean_close_to_the_exact_one(n, num):
    values = _tree(num, seed=1)
    pool = comm.partition_pool(num, n, 0)
    run = jax.vmap(lambda t: comm.group_mean(t, "replica", pool, 0, "int8"), axis_name="replica")
    got = jax.jit(run).lower(values).compile(compiler_options=OPTIMIZED)(values)
    exact = jax.jit(jax.vmap(lambda t: comm.group_mean(t, "replica", pool, 0),
                             axis_name="replica"))(values)  # fmt: skip
    for g in pool[0]:
        for leaf in jax.tree.leaves(got):
            for member in g[1:]:
                np.testing.assert_array_equal(leaf[member], leaf[g[0]])  # one mean per group
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(exact)):
        np.testing.assert_allclose(x, y, atol=2 * 4.0 / 127)  # a few quantisation steps


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_params_without_float_leaves_send_nothing_with_8_bit_exchange(fmt):
    # The codec joined no leaves into one vector: "Need at least one array to concatenate",
    # where every other exchange_dtype returns the empty tree.
    pool = comm.partition_pool(N, 2, 0)
    out = jax.vmap(lambda w: comm.group_mean({}, "replica", pool, 0, fmt, w),
                   axis_name="replica")(jnp.ones(N))  # fmt: skip
    assert out == {}
    tx = noloco_outer(exchange_dtype=fmt, error_feedback=True)
    reps = replicas.make_replicas(N, backend="vmap")
    phi = {"count": jnp.arange(3 * N, dtype=jnp.int32).reshape(N, 3)}
    delta, _ = reps.map(tx.update)(phi, reps.init(tx, phi), phi)
    np.testing.assert_array_equal(delta["count"], 0)  # integer leaves are not moved


def test_absent_replicas_with_8_bit_exchange():
    values = _tree(N, seed=2)
    values = jax.tree.map(lambda x: x.at[1].set(jnp.nan), values)
    pool = comm.partition_pool(N, 2, 0)
    weight = jnp.array([1.0, 0.0, 1.0, 1.0])
    got = jax.jit(jax.vmap(lambda t, w: comm.group_mean(t, "replica", pool, 0, "int8", w),
                           axis_name="replica"))(values, weight)  # fmt: skip
    partner = [int(b) for a, b in pool[0] if a == 1] + [int(a) for a, b in pool[0] if b == 1]
    for x, v in zip(jax.tree.leaves(got), jax.tree.leaves(values)):
        assert np.isfinite(np.asarray(x[partner[0]])).all()  # NaN reached no one
        np.testing.assert_allclose(x[partner[0]], v[partner[0]], atol=4.0 / 127)


def _rounds(error_feedback, rounds=40):
    """Fixed fast weights, beta = 1, alpha = 0: phi <- mean_G theta-hat every round."""
    tx = noloco_outer(learning_rate=1.0, momentum=0.0, exchange_dtype="int8",
                      error_feedback=error_feedback)  # fmt: skip
    reps = replicas.make_replicas(N, backend="vmap")
    theta = jax.tree.map(lambda x: 0.02 + 0.001 * x, _tree(N, seed=3))  # small spread
    theta = jax.tree.map(lambda x: x.at[:, 0].set(1.0), theta)  # sets each block's scale
    phi = theta
    state = reps.init(tx, phi)
    update = jax.jit(reps.map(tx.update))
    errs, residuals = [], []
    for r in range(rounds):
        delta, state = update(jax.tree.map(jnp.subtract, phi, theta), state, phi)
        new_phi = jax.tree.map(jnp.add, phi, delta)
        pool = comm.partition_pool(N, 2, 0)
        groups = comm.groups_for_round(r, N, 2, 0)
        exact = jax.tree.map(lambda t: np.stack([np.asarray(t)[[p for g in groups if i in g
                                                                for p in g]].mean(0)
                                                 for i in range(N)]), theta)  # fmt: skip
        errs.append(jax.tree.map(lambda a, b: np.asarray(a) - b, new_phi, exact))
        if error_feedback:
            residuals.append(max(float(np.abs(x).max()) for x in jax.tree.leaves(state.residual)))
        del pool
    return errs, residuals


def test_error_feedback_keeps_the_residual_bounded_and_the_average_unbiased():
    errs_fb, residuals = _rounds(True)
    errs_plain, _ = _rounds(False)
    assert max(residuals) <= 1.0 / 127 / 2 * 1.01  # half a step of the 1.0-scaled blocks
    mean_fb = max(float(np.abs(np.mean([e[k] for e in errs_fb], 0)).max()) for k in ("a", "b"))
    mean_plain = max(float(np.abs(np.mean([e[k] for e in errs_plain], 0)).max())
                     for k in ("a", "b"))  # fmt: skip
    # Averaged over rounds, error feedback removes the bias plain quantisation keeps.
    assert mean_fb < 0.25 * mean_plain, (mean_fb, mean_plain)


@functools.cache
def _int8_exchange(num, n):
    """(pool, jitted vmap of group_mean_codec's (mean, sent) over int8, weights an argument):
    one program for the cases of one group size."""
    pool = comm.partition_pool(num, n, 0)
    exchange = lambda t, w: comm.group_mean_codec(t, "r", pool, 0, "int8", w)[:2]  # noqa: E731
    return pool, jax.jit(jax.vmap(exchange, axis_name="r"))


@pytest.mark.parametrize("absent", [(), (1, 4)])
@pytest.mark.parametrize("n", [2, 3, 4, 8])  # pairs, cyclic shifts, butterflies of 2 and 3 steps
def test_what_error_feedback_keeps_is_what_the_group_sum_lost(n, absent):
    """Summed over a group's present members, value - sent equals sum(value) - group sum.

    A butterfly re-quantises its partial sums; their roundings must land in the residuals
    too (they were left out, so with n = 4 and 8 error feedback let phi drift).
    """
    num = 8 if n != 3 else 6
    pool, exchange = _int8_exchange(num, n)
    rng = np.random.default_rng(n)
    x = rng.standard_normal((num, 1024)).astype(np.float32)
    weight = np.ones(num, np.float32)
    weight[list(absent)] = 0.0
    mean, sent = exchange(jnp.asarray(x), jnp.asarray(weight))
    mean, sent = np.asarray(mean, np.float64), np.asarray(sent, np.float64)
    for group in pool[0]:
        here = [int(i) for i in group if weight[i] > 0]
        if len(here) < 2:  # nobody used its message: the optimizer keeps its residual
            continue
        group_sum = mean[here[0]] * len(here)
        kept = (x[here] - sent[here]).sum(0)
        np.testing.assert_allclose(kept, x[here].sum(0) - group_sum, atol=4e-6)


@pytest.mark.parametrize("n", [4, 8])
def test_error_feedback_keeps_a_butterfly_group_within_a_step(n):
    """One group of n, beta = 1, alpha = 0: phi moves to the exchanged mean of fresh values."""
    tx = noloco_outer(1.0, 0.0, group_size=n, exchange_dtype="int8", error_feedback=True)
    reps = replicas.make_replicas(n, backend="vmap")
    phi = np.zeros((n, 1024), np.float32)
    phi[:, ::256] = 1.0  # every block's largest value: steps of 1/127
    phi = jnp.asarray(phi)
    state, update = reps.init(tx, phi), jax.jit(reps.map(tx.update))
    rng, exact, drift = np.random.default_rng(0), np.asarray(phi[0], np.float64), []
    for _ in range(150):
        grad = 0.01 * rng.standard_normal((n, 1024)).astype(np.float32)
        grad[:, ::256] = 0.0
        delta, state = update(jnp.asarray(grad), state, phi)
        phi = phi + delta
        exact = exact - grad.astype(np.float64).mean(axis=0)
        drift.append(np.asarray(phi[0], np.float64) - exact)
    # The errors of the applied means telescope to minus the replicas' mean last residual.
    np.testing.assert_allclose(drift[-1], -np.asarray(state.residual).mean(0), atol=1e-5)
    # Was 10.5 (n = 4) and 13.5 (n = 8) steps after 150 rounds, still growing; now 1.0, 1.1.
    assert max(np.abs(d).max() for d in drift) <= 1.5 / 127


def test_error_feedback_with_bfloat16_slow_weights_keeps_its_residual():
    """Two identical replicas (exact mean = phi), beta = 1, alpha = 0: the deltas telescope to
    minus the residual. theta + residual was formed in bf16, which rounded the residual (under
    half an int8 step, about a bf16 ulp here) away: the same message went out every round.
    Run op by op: under jit XLA:CPU's excess precision happened to hide the rounding."""
    tx = noloco_outer(1.0, 0.0, exchange_dtype="int8", error_feedback=True)
    reps = replicas.make_replicas(2, backend="vmap")
    x = jnp.linspace(0.5, 1.0, 256).astype(jnp.bfloat16)
    phi = jnp.stack([x, x])
    state, total = reps.init(tx, phi), np.zeros(256)
    for _ in range(6):
        delta, state = reps.map(tx.update)(jnp.zeros_like(phi), state, phi)
        total += np.asarray(delta[0], np.float64)
    residual = np.asarray(state.residual, np.float64).mean(0)
    assert np.abs(residual).max() > 1e-3  # in play
    # bf16 deltas of under 1/127 round by at most 2^-16 each (it was off by 1e-2)
    np.testing.assert_allclose(total, -residual, rtol=0, atol=1e-4)


def test_absent_replica_with_error_feedback_steps_on_its_own_pseudo_gradient():
    """An absent replica's local step uses theta - phi, not theta + residual - phi."""
    beta = 0.7
    tx = noloco_outer(beta, 0.0, exchange_dtype="int8", error_feedback=True)
    reps = replicas.make_replicas(N, backend="vmap")
    update = jax.jit(reps.map(lambda g, s, p, a: tx.update(g, s, p, active=a)))
    phi = jax.tree.map(jnp.zeros_like, _tree(N))
    state = reps.init(tx, phi)
    theta = _tree(N, seed=4)
    delta, state = update(jax.tree.map(jnp.subtract, phi, theta), state, phi, jnp.ones(N, bool))
    residual = state.residual
    assert min(float(np.abs(x[1]).max()) for x in jax.tree.leaves(residual)) > 0  # in play
    phi = jax.tree.map(jnp.add, phi, delta)
    theta = jax.tree.map(jnp.add, phi, _tree(N, seed=5))
    absent = jnp.array([True, False, True, True])
    delta, state = update(jax.tree.map(jnp.subtract, phi, theta), state, phi, absent)
    for d, t, f, e, kept in zip(*map(jax.tree.leaves, (delta, theta, phi, residual,
                                                        state.residual))):  # fmt: skip
        np.testing.assert_allclose(d[1], beta * (t[1] - f[1]), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(kept[1], e[1])  # it sent nothing: its residual waits


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("group_size, num", [(2, N), (4, N), (3, 6)])  # pairs, butterfly, shifts
def test_a_replica_whose_partners_are_all_absent_steps_on_its_exact_theta(feedback, group_size,
                                                                         num):  # fmt: skip
    """Alone in its group, a present replica exchanged nothing: no 8-bit rounding, residual kept."""
    beta = 0.7
    tx = noloco_outer(beta, 0.0, group_size=group_size, exchange_dtype="int8",
                      error_feedback=feedback)  # fmt: skip
    reps = replicas.make_replicas(num, backend="vmap")
    update = jax.jit(reps.map(lambda g, s, p, a: tx.update(g, s, p, active=a)))
    phi = jax.tree.map(jnp.zeros_like, _tree(num))
    state = reps.init(tx, phi)
    delta, state = update(jax.tree.map(jnp.subtract, phi, _tree(num, seed=4)), state, phi,
                          jnp.ones(num, bool))  # fmt: skip
    phi = jax.tree.map(jnp.add, phi, delta)
    theta = jax.tree.map(jnp.add, phi, _tree(num, seed=5))
    alone = jnp.arange(num) == 0  # replica 0 is the only one present
    new_delta, new_state = update(jax.tree.map(jnp.subtract, phi, theta), state, phi, alone)
    for d, t, f in zip(*map(jax.tree.leaves, (new_delta, theta, phi))):
        np.testing.assert_allclose(d[0], beta * (t[0] - f[0]), rtol=1e-6, atol=1e-6)
    if feedback:
        assert min(float(np.abs(x[0]).max()) for x in jax.tree.leaves(state.residual)) > 0
        for e, kept in zip(jax.tree.leaves(state.residual), jax.tree.leaves(new_state.residual)):
            np.testing.assert_array_equal(kept[0], e[0])  # nobody used its message


def test_error_feedback_with_drop_out_on_a_replica_by_stage_mesh():
    """Leaves split over stages and leaves replicated over them, each with its own presence
    flag: one flag typed like the first kind made the stage-replicated leaves stage-varying,
    and shard_map refused the output."""
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    mesh = jax.make_mesh((N, 2), ("replica", "stage"))
    tx = noloco_outer(0.7, 0.0, exchange_dtype="int8", error_feedback=True, dropout_prob=0.4,
                      seed=3)  # fmt: skip
    a = jax.random.normal(jax.random.key(0), (N, 2, 6))
    b = jax.random.normal(jax.random.key(1), (N, 5))

    def body(a, b):
        theta = {"a": a[0], "b": b[0]}
        phi = jax.tree.map(jnp.zeros_like, theta)
        delta, _ = tx.update(jax.tree.map(jnp.subtract, phi, theta), tx.init(phi), phi)
        return delta["a"][None], delta["b"][None]

    specs = (P("replica", "stage"), P("replica"))
    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=specs))
    da, db = map(np.asarray, run(*(jax.device_put(x, NamedSharding(mesh, s))
                                   for x, s in zip((a, b), specs))))  # fmt: skip
    a, b = np.asarray(a), np.asarray(b)
    present = np.asarray(comm.presence_mask(0, N, 0.4, 3))
    for r in np.flatnonzero(~present):  # an absent replica steps on its own theta alone
        np.testing.assert_allclose(db[r], 0.7 * b[r], rtol=1e-6)
        np.testing.assert_allclose(da[r], 0.7 * a[r], rtol=1e-6)
    assert (~present).any() and np.isfinite(np.asarray(da)).all()


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
def test_bad_exchange_settings(factory):
    with pytest.raises(ValueError, match="exchange_dtype: must be None, a float dtype"):
        factory(exchange_dtype="int4")
    with pytest.raises(ValueError, match="exchange_dtype: must be None, a float dtype"):
        factory(exchange_dtype=jnp.int8)
    with pytest.raises(ValueError, match="error_feedback needs an 8-bit exchange_dtype"):
        factory(exchange_dtype=jnp.bfloat16, error_feedback=True)
    with pytest.raises(ValueError, match="error_feedback: must be True or False, got 'False'"):
        factory(exchange_dtype="int8", error_feedback="False")  # was truthy: feedback on
    if not jax.config.jax_enable_x64:  # float64 was taken; NoLoCo's step then crashed
        with pytest.raises(ValueError, match="exchange_dtype: float64 needs jax_enable_x64"):
            factory(exchange_dtype=jnp.float64)


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_1_byte_float_dtype_is_refused_for_the_named_8_bit_codes(factory, dtype):
    """The dtype jnp.float8_e4m3fn (not the name) was taken as a plain cast without scales:
    a weight of 500 arrived as NaN. The name gives block-scaled codes."""
    with pytest.raises(ValueError, match="exchange_dtype: a plain cast to the 1-byte"):
        factory(exchange_dtype=dtype)
    factory(exchange_dtype="float8_e4m3fn")


def test_training_with_8_bit_exchange_stays_close_to_float32():
    def run(fmt, ef=False):
        tx = local_steps(optax.adam(0.01), noloco_outer(exchange_dtype=fmt, error_feedback=ef), 2)
        reps = replicas.make_replicas(N, backend="vmap")
        p = _tree(N)
        s = reps.init(tx, p)
        step = jax.jit(reps.map(step_fn(tx)))
        for t in range(8):
            p, s = step(p, s, jax.tree.map(lambda x: jnp.sin(x * (t + 1)), p))
        return p

    ref = run(None)
    step = max(float(np.abs(x).max()) for x in jax.tree.leaves(ref)) / 127  # one int8 step
    diffs = {}
    for fmt, ef in (("int8", False), ("int8", True), ("float8_e4m3fn", False)):
        out = run(fmt, ef)
        diffs[fmt, ef] = np.concatenate([np.abs(np.asarray(x) - np.asarray(y)).ravel()
                                         for x, y in zip(jax.tree.leaves(out),
                                                         jax.tree.leaves(ref))])  # fmt: skip
    assert diffs["int8", False].max() < 2 * step  # 4 rounds of Adam stay within two steps
    assert diffs["int8", True].mean() < diffs["int8", False].mean()  # feedback helps
    assert diffs["float8_e4m3fn", False].mean() < 2.0 ** -5  # half of e4m3's relative step


# ---------------------------------------------------------------- DiLoCo


def _np_roundtrip(x, fmt):
    """NumPy block-wise absmax quantise + dequantise (len(x) a multiple of 256)."""
    blocks = x.reshape(-1, 256).astype(np.float32)
    top = np.float32(127.0 if fmt == "int8" else 448.0)
    absmax = np.abs(blocks).max(axis=1)
    scale = np.where(absmax > 0, absmax / top, np.float32(1.0)).astype(np.float32)
    scaled = blocks / scale[:, None]
    if fmt == "int8":
        codes = np.clip(np.round(scaled), -top, top)
    else:
        codes = scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return (codes * scale[:, None]).reshape(-1)


def _np_diloco_mean(values, fmt):
    """Each replica's padded flat vector quantised, the float32 mean quantised again."""
    num, n = values.shape
    unit = num * 256
    padded = np.pad(values.astype(np.float32), ((0, 0), (0, -n % unit)))
    sent = np.stack([_np_roundtrip(v, fmt) for v in padded])
    return _np_roundtrip(sent.sum(axis=0) / np.float32(num), fmt)[:n]


def _flat(tree):
    return np.concatenate([np.asarray(x).reshape(x.shape[0], -1) for x in jax.tree.leaves(tree)],
                          axis=1)  # fmt: skip


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_diloco_8_bit_mean_equals_numpy_and_every_replica_gets_it(backend, fmt):
    reps = replicas.make_replicas(N, backend=backend)
    phi = jax.tree.map(lambda x: jnp.broadcast_to(x[:1], x.shape), _tree(N, seed=4))
    theta = jax.tree.map(lambda p, t: p + 0.01 * t, phi, _tree(N, seed=5))
    tx = diloco_outer(learning_rate=1.0, momentum=0.0, exchange_dtype=fmt)
    grad = jax.tree.map(jnp.subtract, phi, theta)
    delta, _ = jax.jit(reps.map(tx.update))(reps.put(grad), reps.init(tx, reps.put(phi)),
                                            reps.put(phi))  # fmt: skip
    new_phi = _flat(jax.tree.map(jnp.add, phi, delta))
    for r in range(1, N):
        np.testing.assert_array_equal(new_phi[r], new_phi[0])  # one phi for all, bit for bit
    want = _np_diloco_mean(_flat(grad), fmt)
    got = -_flat(delta)[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())
    exact = _flat(grad).mean(axis=0)
    assert np.abs(got - exact).max() > 1e-6 * np.abs(want).max()  # quantisation did happen


def _todays_diloco(grads, phi, rounds):
    """DiLoCo as before exchange_dtype: optax.sgd on lax.pmean of the pseudo-gradients."""
    reps = replicas.make_replicas(N, backend="vmap")
    sgd = optax.sgd(0.7, momentum=0.3)
    state = reps.init(sgd, phi)
    update = jax.jit(reps.map(lambda g, s, p: sgd.update(lax.pmean(g, "replica"), s, p)))
    out = []
    for r in range(rounds):
        delta, state = update(grads[r], state, phi)
        out.append(delta)
    return out


@pytest.mark.parametrize("fmt", [None, jnp.float32])
def test_diloco_without_quantisation_is_todays_update_bit_for_bit(fmt):
    reps = replicas.make_replicas(N, backend="vmap")
    phi = _tree(N, seed=6)
    grads = [_tree(N, seed=7 + r) for r in range(3)]
    tx = diloco_outer(exchange_dtype=fmt)
    state = reps.init(tx, phi)
    assert state.residual is None
    update = jax.jit(reps.map(tx.update))
    for want in _todays_diloco(grads, phi, 3):
        delta, state = update(grads.pop(0), state, phi)
        for x, y in zip(jax.tree.leaves(delta), jax.tree.leaves(want)):
            np.testing.assert_array_equal(x, y)


def _diloco_sync_ops(fmt, guard):
    return hlo.collective_ops(_sync_hlo(diloco_outer(exchange_dtype=fmt), guard))


@pytest.mark.parametrize("fmt,guard", [("int8", False), ("int8", True),
                                       ("float8_e4m3fn", False), (jnp.bfloat16, False)])
def test_diloco_sync_moves_only_encoded_shards(fmt, guard):
    """All-to-all + all-gather of N shards; per replica (N - 1) / N of each operand's bytes."""
    single = _tree()
    n = comm.tree_num_elements(single)  # 940 values
    codec = quantize.is_codec(fmt)
    unit = N * (quantize.BLOCK if codec else 1)
    shard = -(-n // unit) * unit // N  # 256 values for 8-bit formats
    encoded = quantize.wire_bytes(shard) if codec else shard * 2  # one shard on the wire
    ops = _diloco_sync_ops(fmt, guard)
    assert sorted(op.kind for op in ops) == ["all-gather", "all-to-all"], ops
    by_kind = {op.kind: op.bytes for op in ops}
    assert by_kind == {"all-to-all": N * (encoded + 4 * guard), "all-gather": N * encoded}
    sent = (N - 1) / N * (by_kind["all-to-all"] + by_kind["all-gather"])
    assert sent == comm.diloco_bytes_per_sync(single, N, exchange_dtype=fmt, with_presence=guard)


def test_diloco_float32_sync_is_one_all_reduce_and_8_bit_a_quarter_of_it():
    ops = _diloco_sync_ops(None, False)
    single = _tree()
    assert [(op.kind, op.bytes) for op in ops] == [("all-reduce", 4 * 940)]
    ring = 2 * (N - 1) / N * ops[0].bytes
    assert ring == comm.diloco_bytes_per_sync(single, N)
    # With the guard's presence count the one all-reduce carries 4 more bytes (it was left out).
    guarded = _diloco_sync_ops(None, True)
    assert [op.kind for op in guarded] == ["all-reduce"]
    assert 2 * (N - 1) / N * guarded[0].bytes == 2 * (N - 1) / N * (ops[0].bytes + 4)
    assert comm.diloco_bytes_per_sync(single, N, with_presence=True) == \
        2 * (N - 1) / N * guarded[0].bytes
    # 940 values pad to 4 shards of 256: 2 * 3 * (256 + 4) bytes against 5640.
    assert comm.diloco_bytes_per_sync(single, N, exchange_dtype="int8") == 1560
    big = {"w": jax.ShapeDtypeStruct((4096, 4096), jnp.float32)}
    for num in (8, 64):
        ratio = (comm.diloco_bytes_per_sync(big, num, exchange_dtype="int8")
                 / comm.diloco_bytes_per_sync(big, num))  # fmt: skip
        assert ratio == (1 + 4 / 256) / 4  # 0.2539: the codes and 4 bytes per 256 values


def _diloco_drift(error_feedback, rounds=200):
    """beta = 1, alpha = 0: phi moves by minus the exchanged mean, each round a fresh one.

    Returns phi's largest drift from the exact path after each round, the last
    drift (signed), the mean residual over the replicas (or None) and the final phi.
    """
    tx = diloco_outer(learning_rate=1.0, momentum=0.0, exchange_dtype="int8",
                      error_feedback=error_feedback)  # fmt: skip
    reps = replicas.make_replicas(N, backend="vmap")
    phi = jnp.zeros((N, 1024))  # 4 shards of one 256-value block each
    state = reps.init(tx, phi)
    update = jax.jit(reps.map(tx.update))
    rng = np.random.default_rng(0)
    drift, exact = [], np.zeros(1024)
    for _ in range(rounds):
        grad = 0.1 * rng.standard_normal((N, 1024)).astype(np.float32)
        grad[:, ::256] = 1.0  # every block's largest value: steps of 1/127
        delta, state = update(jnp.asarray(grad), state, phi)
        phi = phi + delta
        exact = exact - grad.astype(np.float64).mean(axis=0)
        drift.append(np.asarray(phi[0], np.float64) - exact)
    residual = None if state.residual is None else np.asarray(state.residual).mean(axis=0)
    return np.array([np.abs(d).max() for d in drift]), drift[-1], residual, np.asarray(phi)


def test_diloco_error_feedback_keeps_the_drift_within_one_step():
    drift, last, residual, phi = _diloco_drift(True)
    for r in range(1, N):
        np.testing.assert_array_equal(phi[r], phi[0])
    # The means applied minus the exact ones, summed over rounds, telescope to minus the
    # replicas' mean last residual; phi moves by minus the means.
    np.testing.assert_allclose(last, residual, atol=1e-5)
    # Half a step of each replica's message plus half a step of the relayed mean.
    assert drift.max() <= 1.05 / 127, drift.max()
    plain, _, _, _ = _diloco_drift(False)
    print(f"drift after 20/200 rounds in int8 steps: error feedback {drift[19] * 127:.2f}/"
          f"{drift[-1] * 127:.2f}, without {plain[19] * 127:.2f}/{plain[-1] * 127:.2f}")
    # Without it the rounding errors random-walk: after 200 rounds the drift is several steps.
    assert plain[-1] > 3 / 127 and plain[-1] > 4 * drift.max(), (plain[-1], drift.max())
    assert plain[-1] > 2 * plain[19]  # and it grows (about sqrt(rounds))


def test_trainer_passes_the_exchange_to_diloco_and_counts_its_bytes():
    outer = OuterSettings(sync_every=2, exchange_dtype="int8", error_feedback=True)
    tx = trainer_optimizer.build_optimizer("diloco", OptimSettings(), outer, num_steps=10,
                                           num_replicas=N)  # fmt: skip
    reps = replicas.make_replicas(N, backend="vmap")
    params = _tree(N)
    state = reps.init(tx, params)
    outers = [s for s in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, DiLoCoOuterState)) if isinstance(s, DiLoCoOuterState)]  # fmt: skip
    assert len(outers) == 1 and outers[0].residual is not None
    step = jax.jit(reps.map(step_fn(tx)))
    for _ in range(2):  # the second step syncs
        params, state = step(params, state, jax.tree.map(jnp.sin, params))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(params))
    single = _tree()
    for guard in (False, True):
        got = trainer_optimizer.bytes_sent("diloco", outer, single, num_replicas=N, steps=10,
                                           fault=FaultSettings(nonfinite_guard=guard))
        assert got == 5 * comm.diloco_bytes_per_sync(single, N, exchange_dtype="int8",
                                                     with_presence=guard)  # fmt: skip


def test_diloco_state_without_error_feedback_has_the_old_leaves():
    """The new ``residual`` field defaults to None: no new leaf, so old checkpoints load."""

    class OldState(NamedTuple):  # DiLoCoOuterState before exchange_dtype
        round: jax.Array
        sgd_state: optax.OptState

    new = diloco_outer().init(_tree())
    old = OldState(new.round, new.sgd_state)

    def paths(tree):
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]

    assert new.residual is None and paths(new) == paths(old)
    with_feedback = diloco_outer(exchange_dtype="int8", error_feedback=True).init(_tree())
    assert paths(with_feedback.residual) == paths(_tree())
