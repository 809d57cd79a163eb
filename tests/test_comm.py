"""Group draws, group means and byte counts (noloco_jax.comm)."""

import collections
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import comm, groups_for_round, optim, replicas


def _is_partition(groups, n_replicas, n):
    return groups.shape == (n_replicas // n, n) and sorted(groups.ravel().tolist()) == list(
        range(n_replicas)
    )


@pytest.mark.parametrize("n_replicas", [2, 4, 8, 16])
def test_round_robin_pool_covers_every_pair_once(n_replicas):
    pool = comm.partition_pool(n_replicas, 2, seed=0)
    assert pool.shape == (n_replicas - 1, n_replicas // 2, 2)
    pairs = [tuple(sorted(p)) for m in pool for p in m.tolist()]
    assert all(_is_partition(m, n_replicas, 2) for m in pool)
    assert sorted(pairs) == sorted(itertools.combinations(range(n_replicas), 2))


@pytest.mark.parametrize("n_replicas,n", [(8, 4), (12, 3), (16, 8), (6, 6)])
def test_pool_entries_are_partitions(n_replicas, n):
    pool = comm.partition_pool(n_replicas, n, seed=3)
    assert all(_is_partition(p, n_replicas, n) for p in pool)
    assert not pool.flags.writeable


@pytest.mark.parametrize("kwargs, field", [({"round_index": -1}, "round_index"),
                                           ({"round_index": 2**32}, "round_index"),
                                           ({"round_index": 1.5}, "round_index"),
                                           ({"stream": -1}, "stream"),
                                           ({"seed": -1}, "seed"),
                                           ({"seed": 2**32}, "seed"),
                                           ({"num_replicas": 0}, "num_replicas")])  # fmt: skip
def test_groups_for_round_refuses_a_bad_round_or_stream(kwargs, field):
    """-1 gave an OverflowError from numpy, 1.5 was taken and gave groups; a seed of -1 a
    numpy "expected non-negative integer", num_replicas=0 a message about pool_size=-1."""
    args = {"round_index": 0, "num_replicas": 8, "group_size": 2, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=f"{field}: must be an integer"):
        groups_for_round(**args)


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5])
def test_pool_index_refuses_a_seed_its_key_cannot_hold(seed):
    """The key keeps 32 bits: seed=-1 drew seed 2**32 - 1's groups, 2**32 seed 0's, True
    seed 1's, and 1.5 died in JAX naming a tracer."""
    with pytest.raises(ValueError, match=r"^seed: must be an integer in \[0, 2\*\*32 - 1\]"):
        comm.pool_index(0, 7, seed)


@pytest.mark.parametrize("pool_size", [0, -3, 1.5, True])
def test_pool_index_refuses_a_bad_pool_size(pool_size):
    """Each returned index 0 (of an empty or fractional pool) without a word."""
    with pytest.raises(ValueError, match=r"^pool_size: must be an integer >= 1"):
        comm.pool_index(0, pool_size, 0)


def test_groups_for_round_is_deterministic_and_redrawn():
    rounds = [groups_for_round(r, 8, 2, seed=5) for r in range(30)]
    again = [groups_for_round(r, 8, 2, seed=5) for r in range(30)]
    assert all(np.array_equal(a, b) for a, b in zip(rounds, again))
    distinct = {tuple(map(tuple, g.tolist())) for g in rounds}
    assert len(distinct) >= 5  # re-drawn, not fixed
    other_seed = [groups_for_round(r, 8, 2, seed=6) for r in range(30)]
    assert any(not np.array_equal(a, b) for a, b in zip(rounds, other_seed))


def _drawn_groups(n_rounds, n_replicas, n, seed, pool_size=None):
    """``groups_for_round(r, ...)`` of rounds 0 .. n_rounds - 1: its pool entries, drawn by
    ``pool_index`` in one vmapped call (not a dispatch per round), checked against
    ``groups_for_round`` itself on the first 20 rounds."""
    pool = comm.partition_pool(n_replicas, n, seed, pool_size)
    draw = jax.jit(jax.vmap(lambda r: comm.pool_index(r, len(pool), seed)))
    drawn = pool[np.asarray(draw(jnp.arange(n_rounds, dtype=jnp.uint32)))]
    for r in range(min(n_rounds, 20)):
        np.testing.assert_array_equal(
            drawn[r], groups_for_round(r, n_replicas, n, seed=seed, pool_size=pool_size))
    return drawn


def test_partner_is_uniform_over_the_other_replicas():
    n_replicas, n_rounds = 8, 2800
    counts = np.zeros(n_replicas)
    for groups in _drawn_groups(n_rounds, n_replicas, 2, seed=0):
        for g in groups:
            if 0 in g:
                counts[g[g != 0][0]] += 1
    freq = counts[1:] / n_rounds
    assert counts[0] == 0
    # Each of the 7 partners has probability 1/7; 5 sigma of a binomial is ~0.033.
    np.testing.assert_allclose(freq, 1 / 7, atol=0.035)


def _meeting_shares(n_replicas, n, pool_size=None, n_rounds=600):
    """Share of rounds each pair of replicas shares a group: min, mean, max over pairs."""
    together = np.zeros((n_replicas, n_replicas))
    for groups in _drawn_groups(n_rounds, n_replicas, n, seed=0, pool_size=pool_size):
        for g in groups:
            together[np.ix_(g, g)] += 1
    shares = together[~np.eye(n_replicas, dtype=bool)] / n_rounds
    return [round(float(f(shares)), 2) for f in (np.min, np.mean, np.max)]


def test_groups_of_four_meet_unevenly_unless_the_pool_is_large():
    """The README's figures: N - 1 random partitions (the default) leave some pairs apart."""
    assert _meeting_shares(8, 4) == [0.0, 0.43, 0.87]
    assert _meeting_shares(8, 4, pool_size=32) == [0.18, 0.43, 0.61]
    assert _meeting_shares(8, 4, pool_size=128) == [0.36, 0.43, 0.53]
    assert _meeting_shares(16, 4)[::2] == [0.0, 0.55]
    assert _meeting_shares(16, 4, pool_size=256)[::2] == [0.14, 0.29]


def _numpy_group_mean(x, groups):
    out = np.empty_like(x)
    for g in groups:
        out[g] = x[g].mean(axis=0)
    return out


@pytest.mark.parametrize("n_replicas,n", [(8, 2), (8, 4), (6, 3), (8, 8), (4, 2)])
def test_group_mean_matches_numpy(n_replicas, n):
    x = jax.random.normal(jax.random.key(0), (n_replicas, 5))
    pool = comm.partition_pool(n_replicas, n, seed=1)
    run = jax.jit(jax.vmap(lambda v, i: comm.group_mean(v, "r", pool, i), in_axes=(0, None),
                           axis_name="r"))  # one program for every pool index  # fmt: skip
    for idx in range(min(len(pool), 4)):
        mean = run(x, jnp.int32(idx))
        np.testing.assert_allclose(mean, _numpy_group_mean(np.asarray(x), pool[idx]), rtol=1e-6)


@pytest.mark.parametrize("n_replicas,n", [(6, 3), (8, 2), (8, 4), (10, 5)])
def test_group_members_agree_bit_for_bit(n_replicas, n):
    """With cyclic shifts (n = 3, 5) members added the same values in different orders."""
    x = jax.random.normal(jax.random.key(1), (n_replicas, 3000))
    pool = comm.partition_pool(n_replicas, n, seed=0)
    run = jax.vmap(lambda v: comm.group_mean(v, "r", pool, 0), axis_name="r")
    optimized = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
    mean = np.asarray(jax.jit(run).lower(x).compile(compiler_options=optimized)(x))
    for g in pool[0]:
        np.testing.assert_array_equal(mean[g], np.broadcast_to(mean[g[0]], mean[g].shape))
    np.testing.assert_allclose(mean, _numpy_group_mean(np.asarray(x), pool[0]), atol=1e-6)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("n", [2, 3])
def test_group_members_agree_on_bf16_leaves_computed_in_bf16(backend, n):
    """A bf16 leaf fresh from bf16 arithmetic (NoLoCo's theta = phi - (phi - theta) with
    slow_dtype=jnp.bfloat16): XLA (excess precision) kept the last op in float32 on its way
    into the member's own float32 term, rounded on its way into the message, so the two
    members of a pair disagreed in about 90 % of the means under vmap and on one-device replicas
    (and both differed from a replica split over devices)."""
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.normal(size=(6, 512)), jnp.bfloat16)
    b = jnp.asarray(rng.normal(size=(6, 512)) * 0.3, jnp.bfloat16)
    pool = comm.partition_pool(6, n, seed=0)
    reps = replicas.make_replicas(6, backend=backend)
    mean = jax.jit(reps.map(lambda a, b: comm.group_mean(a * b + a, "replica", pool, 0)))
    got = np.asarray(mean(reps.put(a), reps.put(b)))
    stored = np.asarray(jax.jit(lambda a, b: a * b + a)(a, b), np.float32)  # bf16 each op
    for g in pool[0]:
        np.testing.assert_array_equal(got[g], np.broadcast_to(got[g[0]], got[g].shape))
        np.testing.assert_allclose(got[g[0]], stored[g].mean(0), rtol=1e-6)


def test_group_mean_bf16_exchange_rounds_only_what_travels():
    x = jnp.linspace(1.0, 2.0, 4 * 3, dtype=jnp.float32).reshape(4, 3) + 1e-3
    pool = comm.partition_pool(4, 2, seed=0)
    mean = jax.vmap(
        lambda v: comm.group_mean(v, "r", pool, jnp.int32(0), jnp.bfloat16), axis_name="r"
    )(x)
    exact = _numpy_group_mean(np.asarray(x), pool[0])
    partner_bf16 = np.asarray(x.astype(jnp.bfloat16).astype(jnp.float32))
    expected = np.empty_like(exact)
    for g in pool[0]:
        i, j = g
        expected[i] = (np.asarray(x)[i] + partner_bf16[j]) / 2
        expected[j] = (np.asarray(x)[j] + partner_bf16[i]) / 2
    np.testing.assert_allclose(mean, expected, rtol=1e-6)
    assert not np.allclose(mean, exact, rtol=1e-6, atol=0)  # the cast did happen
    assert mean.dtype == jnp.float32


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("leaf_dtype,wire", [(jnp.float16, None), (jnp.float32, jnp.float16)])
@pytest.mark.parametrize("weighted", [False, True])
def test_group_mean_of_float16_near_its_range_is_finite(n, leaf_dtype, wire, weighted):
    """A butterfly (n = 4, 8) sent its partial sums in float16, which ends at 65504: a group
    of weights of 30,000 to 40,000 (each one in range) came back inf."""
    x = jnp.asarray(np.linspace(30000, 40000, 8 * 3).reshape(8, 3), leaf_dtype)
    pool = comm.partition_pool(8, n, seed=0)
    weight = jnp.ones(8) if weighted else None
    mean = jax.vmap(lambda v, w: comm.group_mean(v, "r", pool, 0, wire, w), axis_name="r")(
        x, weight)  # fmt: skip
    np.testing.assert_allclose(mean, _numpy_group_mean(np.asarray(x, np.float64), pool[0]),
                               rtol=2e-3)  # fmt: skip


@pytest.mark.parametrize("wire", [None, jnp.bfloat16])
def test_butterfly_members_agree_where_a_partial_sum_is_near_float32s_smallest_normal(wire):
    """A float32 or bfloat16 wire sends the partial sums unscaled: halved (4ee75da), a sum of
    3 * 2**-127 travelled as a subnormal that XLA:CPU flushes to 0, and members 2 and 3 of
    the group got another mean than members 0 and 1."""
    u = 2.0**-127
    x = jnp.asarray([7 * u, -4 * u, 2.0**-120, 2.0**-120], jnp.float32)[:, None]
    pool = np.array([[[0, 1, 2, 3]]])
    mean = jax.jit(jax.vmap(lambda v: comm.group_mean(v, "r", pool, 0, wire), axis_name="r"))(x)
    np.testing.assert_array_equal(mean, np.full((4, 1), (3 * u + 2.0**-119) / 4, np.float32))


@pytest.mark.parametrize("n", [4, 8])
def test_float32_butterfly_does_one_add_per_step_and_element(n):
    """XLA's cost analysis: log2(n) adds and the mean's multiply per element; the partial
    means of 4ee75da (for float16's range) added a divide and a multiply per step."""
    pool = comm.partition_pool(8, n, seed=0)
    f = jax.jit(jax.vmap(lambda t, i: comm.group_mean(t, "r", pool, i), in_axes=(0, None),
                         axis_name="r"))  # fmt: skip
    x = jnp.ones((8, 4096))
    flops = f.lower(x, jnp.int32(0)).compile().cost_analysis()["flops"]
    assert flops <= (np.log2(n) + 1) * x.size + 8, (flops, x.size)


def test_exchange_steps():
    assert [comm.exchange_steps(n) for n in (2, 3, 4, 6, 8)] == [1, 2, 2, 5, 3]


def test_byte_helpers():
    params = {"a": jnp.zeros((10, 10)), "b": jnp.zeros(5, jnp.bfloat16)}
    base = 100 * 4 + 5 * 2
    assert comm.noloco_bytes_per_sync(params) == base
    assert comm.noloco_bytes_per_sync(params, gamma_equals_beta=False) == 2 * base
    assert comm.noloco_bytes_per_sync(params, exchange_dtype=jnp.bfloat16) == 105 * 2
    assert comm.noloco_bytes_per_sync(params, group_size=4) == 2 * base
    for flag in ("gamma_equals_beta", "with_presence"):  # "no" counted as True
        with pytest.raises(ValueError, match=f"^{flag}: must be True or False"):
            comm.noloco_bytes_per_sync(params, **{flag: "no"})
    with pytest.raises(ValueError, match="^with_presence: must be True or False"):
        comm.diloco_bytes_per_sync(params, 8, with_presence="no")  # a TypeError from str * float
    assert comm.allreduce_bytes_per_replica(params, 8) == pytest.approx(2 * 7 / 8 * base)
    assert comm.allreduce_bytes_per_replica(params, 1) == 0.0
    # all_replica_mean sums 16-bit leaves in float32, which is what travels
    assert comm.mean_bytes_per_replica(params, 8) == pytest.approx(2 * 7 / 8 * 105 * 4)
    assert comm.diloco_bytes_per_sync(params, 8) == comm.mean_bytes_per_replica(params, 8)
    half = {"b": jnp.zeros(64, jnp.bfloat16)}  # a 16-bit wire: all-to-all + all-gather
    assert comm.diloco_bytes_per_sync(half, 8, exchange_dtype=jnp.bfloat16) == 2 * 7 * 8 * 2


@pytest.mark.parametrize("call,match", [
    (lambda p: comm.noloco_bytes_per_sync(p, group_size=0), "group_size"),  # math domain error
    (lambda p: comm.noloco_bytes_per_sync(p, group_size=1), "group_size"),  # 0 bytes
    (lambda p: comm.diloco_bytes_per_sync(p, -1), "num_replicas"),  # 0.0
    (lambda p: comm.allreduce_bytes_per_replica(p, 0), "num_replicas"),  # 0.0
    (lambda p: comm.mean_bytes_per_replica(p, 2.5), "num_replicas"),  # 1.2 x the bytes
])  # fmt: skip
def test_byte_helpers_refuse_impossible_sizes(call, match):
    """They answered a number (or died in math.log2) for groups of < 2 and replica counts < 1."""
    with pytest.raises(ValueError, match=match):
        call({"a": jnp.zeros((10, 10))})


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_all_replica_mean_of_bfloat16_is_the_correctly_rounded_mean(backend):
    """A bfloat16 pmean rounded at every addition under vmap (2,118 of these 4,096 means were
    off by up to 4 ulps) while shard_map summed in float32: the backends disagreed."""
    n = 8
    x = jnp.asarray(np.random.default_rng(0).normal(size=(n, 4096)) * 0.01, jnp.bfloat16)
    want = np.asarray(x, np.float64).mean(0).astype(np.float32).astype(jnp.bfloat16)
    reps = replicas.make_replicas(n, backend=backend)
    for tx in (optim.diloco_outer(1.0, 0.0), optim.data_parallel(optax.sgd(1.0)),
               optim.diloco_outer(1.0, 0.0, exchange_dtype=jnp.bfloat16)):  # fmt: skip
        phi = reps.put(jnp.zeros_like(x))
        update, _ = jax.jit(reps.map(tx.update))(reps.put(x), reps.init(tx, phi), phi)
        assert update.dtype == jnp.bfloat16
        np.testing.assert_array_equal(-np.asarray(update), np.broadcast_to(want, x.shape))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("weight,takes", [(None, False), ([1, 0, 1, 1], False),
                                          ([1, 0, 1, 1], True)])  # fmt: skip
def test_all_replica_mean_of_bf16_leaves_computed_in_bf16_is_their_stored_mean(backend, weight,
                                                                               takes):
    """A bf16 leaf fresh from bf16 arithmetic (data parallel's bf16 gradients): XLA (excess
    precision) kept its last op in float32 on its way into the float32 sum on whole replicas
    (39 % of these means 1 ulp off), and under vmap XLA:CPU's YNN fusion of the producer
    with the reduction dropped every bf16 rounding, through a barrier too (47 %), while a
    split replica summed the stored values. (A leaf of 64 x 64: smaller ones were not fused.)"""
    rng = np.random.default_rng(0)
    a, b, c = (jnp.asarray(rng.normal(size=(4, 64, 64)) * k, jnp.bfloat16) for k in (1, 0.3, 0.01))
    stored = np.asarray(jax.jit(lambda a, b, c: a * b + c)(a, b, c), np.float32)  # bf16 each op
    w = np.ones(4, np.float32) if weight is None else np.asarray(weight, np.float32)
    want = ((stored * w[:, None, None]).sum(0) / w.sum()).astype(jnp.bfloat16)
    want = np.broadcast_to(want, stored.shape).copy()
    if weight is not None and not takes:
        want[1] = stored[1]  # the absent replica keeps its own (stored) value
    reps = replicas.make_replicas(4, backend=backend)

    def mean(a, b, c, *w):
        return comm.all_replica_mean(a * b + c, "replica", *w, absent_takes_mean=takes)

    args = [reps.put(t) for t in (a, b, c)] + ([] if weight is None else [reps.put(jnp.asarray(w))])
    got = np.asarray(jax.jit(reps.map(mean))(*args))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_diloco_bfloat16_wire_rounds_the_float32_mean_on_every_backend(backend):
    """float32 pseudo-gradients over a bfloat16 wire: under vmap XLA dropped the rounding of
    the gathered mean (a cast pair around a copy), so the simulation's mean was float32."""
    import ml_dtypes  # noqa: PLC0415

    n, r = 2, lambda a: a.astype(ml_dtypes.bfloat16).astype(np.float32)
    g = (np.random.default_rng(0).normal(size=(n, 4096)) * 0.01).astype(np.float32)
    want = r(r(g).sum(0) / np.float32(n))
    reps = replicas.make_replicas(n, backend=backend)
    tx = optim.diloco_outer(1.0, 0.0, exchange_dtype=jnp.bfloat16)
    phi = reps.put(jnp.zeros_like(g))
    update, _ = jax.jit(reps.map(tx.update))(reps.put(jnp.asarray(g)), reps.init(tx, phi), phi)
    np.testing.assert_array_equal(-np.asarray(update), np.broadcast_to(want, g.shape))


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
@pytest.mark.parametrize("wire", [jnp.bfloat16, "int8"])
def test_diloco_wire_mean_runs_under_jax_enable_x64(backend, wire):
    """With x64 on, the relay's update slice got indices (int32 axis_index, int64 literal 0)
    and every DiLoCo step over a narrow wire raised a TypeError."""
    g = np.random.default_rng(0).normal(size=(4, 300)).astype(np.float32)
    reps = replicas.make_replicas(4, backend=backend)
    tx = optim.diloco_outer(1.0, 0.0, exchange_dtype=wire)
    phi = reps.put(jnp.zeros_like(g))

    def step():
        return np.asarray(jax.jit(reps.map(tx.update))(reps.put(jnp.asarray(g)),
                                                       reps.init(tx, phi), phi)[0])  # fmt: skip

    want = step()
    with jax.enable_x64(True):
        got = step()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("mean", ["group", "all", "wire", "group_int8"])
def test_means_take_a_bool_presence_under_strict_dtype_promotion(mean):
    """``weight > 0`` with a bool mask (what the non-finite guard passes) was bool beside a
    Python int: refused under jax_numpy_dtype_promotion='strict'."""
    x, mask, pool = jnp.arange(8.0).reshape(4, 2), jnp.array([True, False, True, True]), \
        comm.partition_pool(4, 2, 0)  # fmt: skip
    fn = {"group": lambda v, w: comm.group_mean(v, "r", pool, 0, weight=w),
          "group_int8": lambda v, w: comm.group_mean(v, "r", pool, 0, "int8", w),
          "all": lambda v, w: comm.all_replica_mean(v, "r", w),
          "wire": lambda v, w: comm.all_replica_mean_wire(v, "r", "int8", w)[0]}[mean]
    run = jax.jit(jax.vmap(fn, axis_name="r"))  # traced under each promotion mode: one compile
    want = run(x, mask)
    with jax.numpy_dtype_promotion("strict"):
        np.testing.assert_array_equal(run(x, mask), want)


@pytest.mark.parametrize("wire", [jnp.float16, jnp.bfloat16, jnp.float8_e5m2, jnp.float8_e4m3fn,
                                  jnp.float8_e4m3fnuz])
def test_a_plain_float_wire_decodes_as_its_own_cast(wire):
    """reduce_precision models IEEE layouts only: on float8_e4m3fn it turned 288..448 into inf
    and the subnormals into 0 (a mean of 300s over the wire was NaN)."""
    x = jnp.array([[1.0, 300.0, 448.0, -400.0, 1e-3, 2.0**-9]], jnp.float32)
    got = comm._from_wire(comm._to_wire(x, wire), wire, x.shape[1])
    np.testing.assert_array_equal(got, x.astype(wire).astype(jnp.float32))


@pytest.mark.parametrize(
    "n_replicas,n,match",
    [(8, 1, "group_size: must be an integer >= 2"), (8, 3, "must divide"), (4, 8, "must divide")],
)
def test_bad_group_sizes(n_replicas, n, match):
    with pytest.raises(ValueError, match=match):
        comm.partition_pool(n_replicas, n, seed=0)


def test_pool_size_bounds():
    assert comm.partition_pool(8, 2, 0, pool_size=3).shape[0] == 3
    with pytest.raises(ValueError, match="pool_size"):
        comm.partition_pool(8, 2, 0, pool_size=9)
    with pytest.raises(ValueError, match="pool_size"):
        comm.partition_pool(8, 2, 0, pool_size=0)


@pytest.mark.parametrize("kwargs, field", [({"pool_size": 2.0}, "pool_size"),
                                           ({"group_size": 8, "pool_size": -3}, "pool_size"),
                                           ({"seed": -1}, "seed"), ({"seed": 1.5}, "seed")])
def test_partition_pool_checks_seed_and_pool_size(kwargs, field):
    """A float pool_size or seed crashed in numpy with a TypeError naming neither, a seed of
    -1 gave numpy's bare message, and pool_size=-3 was taken where n = N."""
    args = {"num_replicas": 8, "group_size": 4, "seed": 0, **kwargs}
    with pytest.raises(ValueError, match=f"{field}: must be an integer"):
        comm.partition_pool(**args)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("leaf", [jnp.full((4, 2), 100, jnp.int8),
                                  jnp.array([True, True, False, False])])
def test_group_mean_refuses_integer_and_bool_leaves(n, leaf):
    """A butterfly (n = 4) sent float partial sums cast to int8 (4 x 100 averaged to 81.75)
    and a bool leaf crashed in a bitcast: counters are not averaged, they are refused."""
    pool = comm.partition_pool(4, n, seed=0)
    mean = jax.vmap(lambda t: comm.group_mean({"c": t}, "r", pool, 0), axis_name="r")
    with pytest.raises(ValueError, match=r"\['c'\]: group_mean averages float leaves only"):
        mean(leaf)


@pytest.mark.parametrize("weight", [None, jnp.array([1.0, 1.0, 1.0, 0.0])])
@pytest.mark.parametrize("leaf", [jnp.arange(4, dtype=jnp.int32),
                                  jnp.array([True, False, False, False])])
def test_all_replica_mean_refuses_integer_and_bool_leaves(leaf, weight):
    """The mean of int32 [0, 1, 2, 3] came back as 1 and of bools [T, F, F, F] as True."""
    mean = jax.vmap(lambda t, w: comm.all_replica_mean({"c": t}, "r", w), axis_name="r",
                    in_axes=(0, None if weight is None else 0))
    with pytest.raises(ValueError, match=r"\['c'\]: all_replica_mean averages float leaves only"):
        mean(leaf, weight)


@pytest.mark.parametrize("name,mean", [
    ("group_mean", lambda t: comm.group_mean_codec(t, "r", comm.partition_pool(4, 2, 0), 0,
                                                   "int8")),
    ("all_replica_mean_wire", lambda t: comm.all_replica_mean_wire(t, "r", "int8"))])
def test_8_bit_wires_refuse_integer_leaves_by_name(name, mean):
    """The 8-bit paths share the float-leaf check, which names the leaf."""
    tree = {"a": jnp.ones((4, 3)), "c": jnp.arange(4, dtype=jnp.int32)}
    with pytest.raises(ValueError, match=rf"\['c'\]: {name} with exchange_dtype='int8' "
                                         r"averages float leaves only"):
        jax.vmap(mean, axis_name="r")(tree)


@pytest.mark.parametrize("wire", [jnp.int8, jnp.int32, jnp.float8_e4m3fn])
@pytest.mark.parametrize("mean", ["group", "all", "wire"])
def test_means_refuse_a_wire_dtype_without_scale(wire, mean):
    """An int8 wire truncated the weights (the two members of a pair disagreed on their
    mean), a float8 one sent 1000.0 as NaN: the comm functions now refuse what
    noloco_outer and diloco_outer refuse."""
    pool = comm.partition_pool(2, 2, seed=0)
    fn = {"group": lambda t: comm.group_mean(t, "r", pool, 0, wire),
          "all": lambda t: comm.all_replica_mean(t, "r", None, wire),
          "wire": lambda t: comm.all_replica_mean_wire(t, "r", wire)[0]}[mean]
    with pytest.raises(ValueError, match="exchange_dtype: "):
        jax.vmap(fn, axis_name="r")(jnp.array([[0.7, 1000.0], [0.2, 500.0]]))


def test_unbound_axis_error_names_axis_and_fix():
    with pytest.raises(comm.UnboundAxisError, match=r"'nope'.*jax.vmap.*shard_map"):
        comm.axis_size("nope")


# ------------------------------------------- packed exchange (issue 16: scale)


def _reference_group_mean(tree, axis_name, partition, exchange_dtype, weight):
    """Leaf-by-leaf group mean: one ppermute per leaf and step (the unpacked exchange)."""
    n = partition.shape[1]
    perms = comm._exchange_perms(partition)

    def send(acc, wire, perm):
        payload = acc.astype(wire)
        if jnp.dtype(wire) != acc.dtype:
            bits = jax.lax.bitcast_convert_type(payload, comm._uint_of(wire))
            moved = jax.lax.ppermute(bits, axis_name, perm)
            return jax.lax.bitcast_convert_type(moved, wire).astype(acc.dtype)
        return jax.lax.ppermute(payload, axis_name, perm).astype(acc.dtype)

    def group_sum(x, wire):
        acc = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        if n & (n - 1) == 0:  # butterfly: partial sums travel
            for perm in perms:
                acc = acc + send(acc, wire, perm)
            return acc
        # cyclic shifts: the own value travels; terms[k] came from position (p - k) mod n, and
        # the sum runs in position order (every member adds the same numbers in one order)
        terms = [acc] + [send(acc, wire, perm) for perm in perms]
        position = np.zeros(partition.size, np.int32)
        for group in partition:
            position[group] = np.arange(n)
        p = jnp.asarray(position)[jax.lax.axis_index(axis_name)]
        total = jax.lax.select_n(p, *terms)  # position 0's value, q = 0
        for q in range(1, n):
            total = total + jax.lax.select_n((p - q) % n, *terms)
        return total

    leaves, treedef = jax.tree.flatten(tree)
    if weight is None:
        sums = [group_sum(x, exchange_dtype or x.dtype) for x in leaves]
        return jax.tree.unflatten(treedef, [v / n for v in sums])
    present = weight > 0
    count = group_sum(present.astype(jnp.float32), jnp.float32)
    means = []
    for x in leaves:
        v = group_sum(jnp.where(present, x, jnp.zeros_like(x)), exchange_dtype or x.dtype)
        means.append(jnp.where(present, v / jnp.maximum(count, 1.0), x.astype(v.dtype)))
    return jax.tree.unflatten(treedef, means)


def _mixed_tree(n_replicas):
    k = jax.random.split(jax.random.key(3), 4)
    tree = {
        "a": jax.random.normal(k[0], (n_replicas, 3, 4)),
        "b": jax.random.normal(k[1], (n_replicas, 5)).astype(jnp.bfloat16),
        "c": jax.random.normal(k[2], (n_replicas,)),  # a scalar per replica
        "d": jax.random.normal(k[3], (n_replicas, 2, 1, 3)).astype(jnp.bfloat16),
    }
    # A NaN in the values of an absent replica (replica 1) must reach no one.
    tree["a"] = tree["a"].at[1, 0, 0].set(jnp.nan)
    return tree


@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("exchange_dtype", [None, jnp.bfloat16])
@pytest.mark.parametrize("n_replicas,n", [(4, 2), (6, 3), (8, 4)])
def test_packed_group_mean_equals_leaf_by_leaf_bit_for_bit(n_replicas, n, exchange_dtype,
                                                           with_weight):  # fmt: skip
    tree = _mixed_tree(n_replicas)
    weight = (jnp.arange(n_replicas) != 1).astype(jnp.float32) if with_weight else None
    if weight is None:
        tree["a"] = jnp.nan_to_num(tree["a"])
    pool = comm.partition_pool(n_replicas, n, seed=1)

    @jax.jit
    def both(tree, weight, index):
        def one(t, w):
            packed = comm.group_mean(t, "r", pool, index, exchange_dtype, w)
            refs = [_reference_group_mean(t, "r", p, exchange_dtype, w) for p in pool[:checked]]
            return packed, jax.lax.switch(index, [lambda r=r: r for r in refs])

        return jax.vmap(one, axis_name="r")(tree, weight)

    checked = min(len(pool), 3)  # the pool entries compared (the reference of no other compiles)
    for idx in range(checked):
        packed, ref = both(tree, weight, jnp.int32(idx))
        assert jax.tree.map(lambda x: x.dtype, packed) == jax.tree.map(lambda x: x.dtype, ref)
        for got, want in zip(jax.tree.leaves(packed), jax.tree.leaves(ref)):
            got, want = np.asarray(got), np.asarray(want)
            bits = np.dtype(f"u{got.dtype.itemsize}")
            np.testing.assert_array_equal(got.view(bits), want.view(bits))  # bit for bit
        if with_weight:  # the absent replica got its own values back, NaN included
            assert np.isnan(np.asarray(packed["a"])[1, 0, 0])
            assert np.isfinite(np.asarray(packed["a"])[np.arange(n_replicas) != 1]).all()


def _permutes_per_branch(num_leaves, n, exchange_dtype=None, with_weight=False):
    from noloco_jax import hlo, replicas

    size = 8 if 8 % n == 0 else 6
    reps = replicas.make_replicas(size, backend="shard_map", axis_name="r")
    tree = {f"w{i}": jnp.ones((size, 3 + i)) for i in range(num_leaves)}
    tree["h"] = jnp.ones((size, 2), jnp.bfloat16)  # a second dtype
    pool = comm.partition_pool(size, n, seed=0)

    def one(t, w, index):
        return comm.group_mean(t, "r", pool, index, exchange_dtype, w if with_weight else None)

    f = jax.jit(reps.map(one))
    text = hlo.compiled_text(f, reps.put(tree), reps.put(jnp.ones(size)), jnp.int32(0))
    ops = hlo.collective_ops(text)
    assert {op.kind for op in ops} == {"collective-permute"}
    counts = collections.Counter(op.computation for op in ops)
    assert len(counts) == len(pool)  # one switch branch per pool entry
    return set(counts.values())


@pytest.mark.parametrize("n,exchange_dtype,with_weight", [
    (2, None, False), (2, jnp.bfloat16, True), (4, None, True), (3, jnp.bfloat16, False),
])  # fmt: skip
def test_one_collective_per_exchange_step_whatever_the_number_of_leaves(n, exchange_dtype,
                                                                        with_weight):  # fmt: skip
    """The compiled branch holds one collective-permute per step, for 2 leaves as for 8."""
    steps = comm.exchange_steps(n)
    assert _permutes_per_branch(2, n, exchange_dtype, with_weight) == {steps}
    assert _permutes_per_branch(8, n, exchange_dtype, with_weight) == {steps}


@pytest.mark.parametrize("k", [5, 40, 49, 50])
def test_many_branches_switch_as_a_tree_picks_the_same_branch(k):
    """Above 32 branches the switch is two levels deep; every index (and a clamped
    out-of-range one) still runs the branch a flat lax.switch would run."""
    branches = [lambda x, i=i: x * 0 + i for i in range(k)]
    f = jax.jit(lambda index: comm._switch(index, branches, jnp.float32(0)))
    for index in [-3, 0, 1, k // 2, k - 2, k - 1, k, k + 7]:
        assert int(f(jnp.int32(index))) == min(max(index, 0), k - 1), index


def test_group_mean_with_a_deep_pool_matches_numpy():
    n_replicas = 80  # 79 matchings: the switch is a tree of switches
    x = jax.random.normal(jax.random.key(1), (n_replicas, 3))
    pool = comm.partition_pool(n_replicas, 2, seed=0)
    mean = jax.jit(jax.vmap(lambda v, i: comm.group_mean(v, "r", pool, i), in_axes=(0, None),
                            axis_name="r"))  # fmt: skip
    for idx in [0, 9, 10, 40, 78]:
        got = mean(x, jnp.int32(idx))
        np.testing.assert_allclose(got, _numpy_group_mean(np.asarray(x), pool[idx]), rtol=1e-6)
    # No conditional of more than 32 branches: XLA's copy insertion is quadratic in them.
    text = mean.lower(x, jnp.int32(0)).compile().as_text()
    fan_out = [m.count(",") + 1 for m in re.findall(r"branch_computations=\{([^}]*)\}", text)]
    assert max(fan_out) <= 32 and sum(fan_out) >= len(pool), fan_out


@pytest.mark.parametrize("exchange_dtype", [None, jnp.bfloat16])
def test_memory_traffic_of_group_mean_does_not_grow_with_the_number_of_leaves(exchange_dtype):
    """Each leaf is sliced out of the received message before it is converted and added, so
    a model split into 8 leaves moves as many bytes (XLA's cost analysis) as one in 2."""
    pool = comm.partition_pool(8, 2, seed=0)

    def bytes_accessed(num_leaves):
        tree = [jnp.ones((8, 4096 // num_leaves)) for _ in range(num_leaves)]
        f = jax.jit(jax.vmap(lambda t, i: comm.group_mean(t, "r", pool, i, exchange_dtype),
                             in_axes=(0, None), axis_name="r"))  # fmt: skip
        return f.lower(tree, jnp.int32(0)).compile().cost_analysis()["bytes accessed"]

    assert bytes_accessed(8) <= 1.1 * bytes_accessed(2)
