"""8-bit exchange for NoLoCo: bytes from HLO, one mean per group, error feedback."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import comm, hlo, local_steps, noloco_outer, quantize, replicas
from tests.helpers import step_fn

N = 4


def _tree(num=None, seed=0):
    lead = () if num is None else (num,)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"a": jax.random.normal(k1, lead + (40, 16)), "b": jax.random.normal(k2, lead + (300,))}


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("guard", [False, True])
def test_sync_step_sends_a_quarter_of_float32_plus_scales(fmt, guard):
    tx = local_steps(optax.sgd(0.1), noloco_outer(exchange_dtype=fmt), 5, nonfinite_guard=guard)
    reps = replicas.make_replicas(N, backend="shard_map")
    params = reps.put(_tree(N))
    state = reps.init(tx, params)
    f = jax.jit(reps.map(lambda g, s, p: tx.update(g, s, p, sync_step=True)))
    per_branch = hlo.bytes_by_computation(hlo.compiled_text(f, params, state, params),
                                          "collective-permute")  # fmt: skip
    single = _tree()
    want = comm.noloco_bytes_per_sync(single, exchange_dtype=fmt, with_presence=guard)
    n = comm.tree_num_elements(single)
    assert want == n + 4 * -(-n // quantize.BLOCK) + 4 * guard
    assert set(per_branch.values()) == {want}, per_branch
    assert want / comm.noloco_bytes_per_sync(single) < 0.27


@pytest.mark.parametrize("n", [2, 4])
def test_the_group_agrees_on_one_mean_close_to_the_exact_one(n):
    values = _tree(N, seed=1)
    pool = comm.partition_pool(N, n, 0)
    run = jax.vmap(lambda t: comm.group_mean(t, "replica", pool, 0, "int8"), axis_name="replica")
    got = run(values)
    exact = jax.vmap(lambda t: comm.group_mean(t, "replica", pool, 0), axis_name="replica")(values)
    for g in pool[0]:
        for leaf in jax.tree.leaves(got):
            for member in g[1:]:
                np.testing.assert_array_equal(leaf[member], leaf[g[0]])  # one mean per group
    for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(exact)):
        np.testing.assert_allclose(x, y, atol=2 * 4.0 / 127)  # a few quantisation steps


def test_absent_replicas_with_8_bit_exchange():
    values = _tree(N, seed=2)
    values = jax.tree.map(lambda x: x.at[1].set(jnp.nan), values)
    pool = comm.partition_pool(N, 2, 0)
    weight = jnp.array([1.0, 0.0, 1.0, 1.0])
    got = jax.vmap(lambda t, w: comm.group_mean(t, "replica", pool, 0, "int8", w),
                   axis_name="replica")(values, weight)  # fmt: skip
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


def test_bad_exchange_settings():
    with pytest.raises(ValueError, match="exchange_dtype: must be None, a float dtype"):
        noloco_outer(exchange_dtype="int4")
    with pytest.raises(ValueError, match="exchange_dtype: must be None, a float dtype"):
        noloco_outer(exchange_dtype=jnp.int8)
    with pytest.raises(ValueError, match="error_feedback needs an 8-bit exchange_dtype"):
        noloco_outer(exchange_dtype=jnp.bfloat16, error_feedback=True)


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
