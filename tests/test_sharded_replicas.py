"""Replicas that span devices: NoLoCo across replicas, fsdp and tensor splits inside each.

Every topology must train like the ``vmap`` simulation (SGD with momentum as the inner
optimizer, so that the only differences are float reassociation in the split matmuls:
rtol 1e-5, atol 1e-6), and the compiled HLO must show the topology: NoLoCo's
collective-permute joins equal shards of different replicas, and every gather or
reduction of an inner step stays inside one replica.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import comm, data_parallel, diloco_outer, hlo, local_steps, models, noloco_outer
from noloco_jax import replicas, sharding
from noloco_jax.trainer import grads
from noloco_jax.trainer.step import TrainState, train_step
from tests.helpers import assert_trees_close

CFG = models.get_preset("nano", vocab_size=64, max_seq_len=32)  # D 64, 4 heads, MLP 256
H, STEPS, B, T = 2, 6, 2, 16  # three outer rounds

METHODS = {
    "noloco": lambda n: local_steps(optax.sgd(0.1, momentum=0.9), noloco_outer(seed=1), H),
    "noloco_n4": lambda n: local_steps(optax.sgd(0.1, momentum=0.9),
                                       noloco_outer(seed=1, group_size=4), H),
    "noloco_gamma": lambda n: local_steps(optax.sgd(0.1, momentum=0.9),
                                          noloco_outer(seed=1, gamma=0.3), H),
    "noloco_bf16": lambda n: local_steps(optax.sgd(0.1, momentum=0.9),
                                         noloco_outer(seed=1, exchange_dtype=jnp.bfloat16), H),
    "diloco": lambda n: local_steps(optax.sgd(0.1, momentum=0.9), diloco_outer(), H),
    "dp": lambda n: data_parallel(optax.sgd(0.1, momentum=0.9)),
}


def _train(method, num_replicas, mesh_shape):
    graphdef, params = models.init_params(CFG, 0)
    tx = METHODS[method](num_replicas)
    backend = "vmap" if mesh_shape is None else "shard_map"
    reps = replicas.make_replicas(num_replicas, backend=backend, mesh_shape=mesh_shape)
    state = reps.put(replicas.replicate(
        TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), num_replicas))
    step = jax.jit(reps.map(functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx)))
    losses = []
    for t in range(STEPS):
        tokens = np.random.default_rng(t).integers(0, 64, (num_replicas, B, T + 1), np.int32)
        state, loss = step(state, reps.put(tokens))
        losses.append(np.asarray(loss))
    return np.stack(losses), jax.tree.map(np.asarray, state.params), state


@functools.lru_cache(maxsize=None)
def _reference(method, num_replicas):
    losses, params, _ = _train(method, num_replicas, None)
    return losses, params


def _assert_close_up_to_bf16_flips(params, ref_params):
    """Float agreement everywhere except rare bf16 rounding flips, each inside its bound.

    A bf16 exchange rounds the theta it sends to 8 significant bits. The split matmuls
    add in another order, so theta can differ by a float32 ulp, and where that straddles
    a bf16 rounding boundary the partner receives a value one bf16 ulp (<= 2^-7 |theta|)
    away: the group mean moves by ulp / n, the outer step by beta ulp / n, and through
    the heavy ball (sum of alpha^k <= 1 / (1 - alpha)) phi by beta ulp / (n (1 - alpha))
    per flipped round. Measured (2 replicas, fsdp 4): 89 of 279168 weights off, by
    0.35, 0.175, 0.7 and 1.4 bf16 ulps, i.e. beta / 2 times powers of two, the flip's
    fingerprint; every other weight within float tolerance. So: at most 0.1 % of the
    weights may leave float tolerance, and each by at most
    ROUNDS * beta / (n (1 - alpha)) * 2^-7 * max |leaf|.
    """
    beta, alpha, n, rounds = 0.7, 0.5, 2, STEPS // H  # noloco_outer's defaults, this run
    bound = rounds * beta / (n * (1 - alpha)) * 2.0**-7
    off = total = 0
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        diff = np.abs(np.asarray(x, np.float64) - y)
        off += int(np.sum(diff > 1e-5 * np.abs(y) + 1e-6))
        total += diff.size
        assert diff.max() <= bound * np.abs(y).max(), (diff.max(), np.abs(y).max())
    assert off <= 1e-3 * total, f"{off} of {total} weights beyond float tolerance"


def _check(method, num_replicas, mesh_shape):
    losses, params, state = _train(method, num_replicas, mesh_shape)
    ref_losses, ref_params = _reference(method, num_replicas)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-6)
    if method.endswith("bf16"):
        _assert_close_up_to_bf16_flips(params, ref_params)
    else:
        assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6)
    return state


@pytest.mark.parametrize("num_replicas,mesh_shape", [
    (4, {}), (4, {"fsdp": 2}), (2, {"fsdp": 2, "tensor": 2}), (2, {"fsdp": 4})])  # fmt: skip
def test_noloco_on_every_topology_equals_the_simulation(num_replicas, mesh_shape):
    state = _check("noloco", num_replicas, mesh_shape)
    if mesh_shape:  # the state stays split as placed: params and slow weights alike
        spec = tuple(state.params["blocks"]["attn"]["wq"][...].sharding.spec)
        assert spec + (None,) * (5 - len(spec)) == (
            "replica", None, "fsdp", "tensor" if "tensor" in mesh_shape else None, None)


@pytest.mark.parametrize("method", ["noloco_gamma", "noloco_bf16", "diloco", "dp"])
def test_every_method_on_a_split_replica_equals_the_simulation(method):
    _check(method, 2, {"fsdp": 2, "tensor": 2})


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("num_replicas,mesh_shape", [(4, {"fsdp": 2}), (2, {"fsdp": 4})])
def test_every_method_on_more_splits(method, num_replicas, mesh_shape):
    if method == "noloco_n4" and num_replicas < 4:
        pytest.skip("a group of 4 needs 4 replicas")
    _check(method, num_replicas, mesh_shape)


def _coords(reps):
    """Device id -> (replica, intra-replica coordinates)."""
    out = {}
    for index in np.ndindex(reps.mesh.devices.shape):
        out[reps.mesh.devices[index].id] = (index[0], index[1:])
    return out


def _wire_means(num_replicas, mesh_shape, tree, weight, absent_takes_mean):
    reps = replicas.make_replicas(num_replicas, backend="vmap" if mesh_shape is None else
                                  "shard_map", mesh_shape=mesh_shape)  # fmt: skip

    def mean(t, w):
        return comm.all_replica_mean(t, reps.axis_name, w, jnp.bfloat16,
                                     absent_takes_mean=absent_takes_mean)  # fmt: skip

    if weight is None:
        out = jax.jit(reps.map(lambda t: mean(t, None)))(reps.put(tree))
    else:
        out = jax.jit(reps.map(mean))(reps.put(tree), reps.put(jnp.asarray(weight)))
    return jax.tree.map(np.asarray, out)


@pytest.mark.parametrize("num_replicas,mesh_shape", [(2, {"fsdp": 2, "tensor": 2}),
                                                     (4, {"fsdp": 2})])  # fmt: skip
def test_bfloat16_wire_mean_on_a_split_replica_is_the_simulations_bit_for_bit(num_replicas,
                                                                               mesh_shape):
    """On a split replica each leaf travels alone, cut along its own last axis (padded
    where N does not divide it); the flat message of the simulation is cut elsewhere,
    but every element's mean is the same sum of the same rounded values.

    A training run (as ``_check``) cannot show this: DiLoCo rounds the small pseudo-
    gradient phi - theta, so the split matmuls' float32 ulps of theta flip its bfloat16
    rounding more often than NoLoCo's theta (0.1024 % of the weights, flat message or not).
    """
    _, params = models.init_params(CFG, 0)
    rng = np.random.default_rng(num_replicas)
    tree = {"params": jax.tree.map(lambda x: jnp.asarray(
        rng.normal(size=(num_replicas, *x.shape)) * 0.01, x.dtype), params),
        "odd": jnp.asarray(rng.normal(size=(num_replicas, 3, 5)), jnp.float32),
        "scalar": jnp.asarray(rng.normal(size=num_replicas), jnp.float32)}  # fmt: skip
    absent = np.ones(num_replicas, np.float32)
    absent[1] = 0.0  # and its NaN reaches no one
    nan = {**tree, "odd": tree["odd"].at[1].set(np.nan)}
    for t, weight, takes in ((tree, None, False), (nan, absent, False), (nan, absent, True)):
        ref = _wire_means(num_replicas, None, t, weight, takes)
        got = _wire_means(num_replicas, mesh_shape, t, weight, takes)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_float32_wire_mean_with_an_absent_replica_is_the_simulations_bit_for_bit():
    """bfloat16 leaves over a float32 wire go by the wire paths too. With a present count of
    3 (N 4, one absent) the flat path's division by it compiled to a product with its
    reciprocal and the split replica's by-leaf path to a division: 1-ulp differences in
    about a third of the float32 leaf's means."""
    rng = np.random.default_rng(4)
    tree = {"a": jnp.asarray(rng.normal(size=(4, 8, 6)) * 3, jnp.float32),
            "h": jnp.asarray(rng.normal(size=(4, 6, 10)), jnp.bfloat16)}  # fmt: skip
    absent = np.asarray([1.0, 0.0, 1.0, 1.0], np.float32)

    def means(mesh_shape, takes):
        reps = replicas.make_replicas(4, backend="vmap" if mesh_shape is None else "shard_map",
                                      mesh_shape=mesh_shape)  # fmt: skip
        out = jax.jit(reps.map(lambda t, w: comm.all_replica_mean(
            t, reps.axis_name, w, jnp.float32, absent_takes_mean=takes)))(
            reps.put(tree), reps.put(jnp.asarray(absent)))  # fmt: skip
        return jax.tree.map(np.asarray, out)

    for takes in (False, True):
        for x, y in zip(jax.tree.leaves(means({"fsdp": 2}, takes)),
                        jax.tree.leaves(means(None, takes))):  # fmt: skip
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8))


def test_hlo_noloco_sync_joins_equal_shards_of_different_replicas():
    graphdef, params = models.init_params(CFG, 0)
    reps = replicas.make_replicas(2, mesh_shape={"fsdp": 2, "tensor": 2})
    tx = METHODS["noloco"](2)
    state = reps.put(replicas.replicate(
        TrainState(jnp.zeros([], jnp.int32), params, tx.init(params)), 2))
    tokens = reps.put(np.zeros((2, B, T + 1), np.int32))
    where = _coords(reps)
    texts = {}
    for phase in (False, True):
        f = jax.jit(reps.map(functools.partial(train_step, grads_fn=grads.plain(graphdef), tx=tx,
                                               sync_step=phase)))  # fmt: skip
        texts[phase] = hlo.compiled_text(f, state, tokens)
    sync_ops = hlo.collective_ops(texts[True])
    permutes = [op for op in sync_ops if op.kind == "collective-permute"]
    assert permutes and all(op.pairs for op in permutes)
    for a, b in [p for op in permutes for p in op.pairs]:  # another replica, the same shard
        assert where[a][0] != where[b][0] and where[a][1] == where[b][1], (a, b)
    for op in sync_ops:  # everything else stays inside one replica
        assert op.kind == "collective-permute" or all(
            len({where[d][0] for d in g}) == 1 for g in op.groups), (op.kind, op.groups)
    for op in hlo.collective_ops(texts[False]):  # an inner step never leaves its replica
        assert op.kind != "collective-permute"
        for group in op.groups:
            assert len({where[d][0] for d in group}) == 1, (op.kind, group)
    # Per device, a NoLoCo sync sends 1/(F*T) of the replica's float bytes (plus scalars).
    sent = sum(op.bytes for op in permutes)
    replica_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    assert sent < 2 * replica_bytes / 4 * 1.05, (sent, replica_bytes)


@pytest.mark.parametrize("mesh_shape", [{"fsdp": 2}, {"tensor": 2}])
def test_one_replica_split_over_devices_evaluates_and_checks_its_weights(mesh_shape):
    """N = 1 split over devices: the spread needs no collective (XLA refused an all-reduce over
    a size-1 replica axis of split leaves) and the finiteness check does not stack leaves
    whose results come differently sharded (the trainer crashed at the first eval / save)."""
    from noloco_jax.metrics import replica_spread  # noqa: PLC0415
    from noloco_jax.trainer import health  # noqa: PLC0415

    cfg = models.get_preset("nano", vocab_size=256, max_seq_len=64)
    reps = replicas.make_replicas(1, backend="shard_map", mesh_shape=mesh_shape)
    params = reps.put(replicas.replicate(models.init_params(cfg, 0)[1], 1))
    spread = jax.jit(reps.map(lambda p: replica_spread(p, "replica")))(params)
    assert np.asarray(spread).tolist() == [0.0]
    per_leaf = health.per_replica_finite(params)
    assert all(np.asarray(v).tolist() == [True] for v in per_leaf)


def test_init_places_the_optimizer_state_as_put_does_on_a_split_replica():
    """reps.init split the params' slow weights but left the Adam moments and the outer
    momentum whole on every device of a replica (F x T times their share)."""
    reps = replicas.make_replicas(2, mesh_shape={"fsdp": 2, "tensor": 2})
    params = reps.put(replicas.replicate(models.init_params(CFG, 0)[1], 2))
    state = reps.init(local_steps(optax.adam(1e-2), noloco_outer(seed=1), H), params)
    want = reps.put(jax.tree.map(np.asarray, state))
    for (path, got), placed in zip(jax.tree_util.tree_flatten_with_path(state)[0],
                                   jax.tree.leaves(want)):  # fmt: skip
        assert got.sharding.is_equivalent_to(placed.sharding, got.ndim), (
            jax.tree_util.keystr(path), got.sharding.spec, placed.sharding.spec)
    mu = state.local_opt_state[0].mu["blocks"]["attn"]["wq"][...]
    assert mu.addressable_shards[0].data.shape == (1, 2, 32, 2, 16)  # [1, L, D/F, H/T, Dh]

def test_a_split_that_does_not_divide_is_refused():
    _, params = models.init_params(CFG, 0)  # D 64, 4 heads (4 key/value heads)
    sharding.check_divides(params, {"fsdp": 4, "tensor": 4})  # these divide
    wk = r"\['blocks'\]\['attn'\]\['wk'\]"
    with pytest.raises(ValueError, match=rf"mesh.tensor=8 is more than the 4 key/value heads "
                                         rf"\(dim 2 of {wk}\) it splits; choose a divisor of 4\."):
        sharding.check_divides(params, {"tensor": 8})
    with pytest.raises(ValueError, match=rf"mesh.fsdp=3 does not divide dim 1 of {wk} \(the "
                                         rf"model dimension, size 64\); choose a divisor of 64\."):
        sharding.check_divides(params, {"fsdp": 3})
    with pytest.raises(ValueError, match=r"mesh.tensor=3 does not divide dim 2 .*key/value heads"):
        sharding.check_divides(params, {"tensor": 3})
    for backend in ("shard_map", "auto"):  # auto cannot simulate a split replica either
        with pytest.raises(ValueError, match="num_replicas=4 x fsdp=4 x tensor=1 = 16 devices are "
                                             "needed, 8 devices are visible"):  # fmt: skip
            replicas.make_replicas(4, backend=backend, mesh_shape={"fsdp": 4})
    with pytest.raises(ValueError, match="mesh_shape takes"):
        replicas.make_replicas(2, mesh_shape={"pipe": 2})
    for bad in (2.7, 1.9, True, "2"):  # 2.7 and 1.9 were truncated to 2 and 1
        with pytest.raises(ValueError, match=r"with integer sizes >= 1, got \{'fsdp': "):
            replicas.make_replicas(2, mesh_shape={"fsdp": bad})
    with pytest.raises(ValueError, match="mesh_shape must be a dict"):  # an AttributeError
        replicas.make_replicas(2, mesh_shape=[("fsdp", 2)])
    d = jax.devices()
    with pytest.raises(ValueError, match="devices lists a device more than once"):  # was taken,
        replicas.make_replicas(2, backend="shard_map", devices=[d[0], d[0]])  # then an assert


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 2, "tensor": 2}])
def test_select_replica_of_a_placed_tree_keeps_the_split(mesh_shape):
    """select_replica / unreplicate of a tree placed with reps.put raised JAX's
    ShardingTypeError (eager: "out sharding could not be resolved"; under jit: "slicing on
    sharded dims"), one device per replica or split."""
    like = {"embedding": jnp.zeros((8, 4)), "step": jnp.int32(0)}
    tree = {"embedding": jnp.arange(64.0).reshape(2, 8, 4), "step": jnp.int32(7)}
    placed = replicas.make_replicas(2, backend="shard_map", mesh_shape=mesh_shape).put(tree)
    picks = (replicas.select_replica(placed, -1, like), replicas.unreplicate(placed, like),
             jax.jit(lambda t: replicas.select_replica(t, 1, like))(placed))  # fmt: skip
    for got, want in zip(picks, (1, 0, 1)):
        np.testing.assert_array_equal(got["embedding"], tree["embedding"][want])
        assert int(got["step"]) == 7
    if mesh_shape:  # replica 1's table stays split inside its replica: [V/T, D/F] per device
        assert picks[0]["embedding"].addressable_shards[0].data.shape == (4, 2)


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 2}])
def test_select_replica_of_a_placed_tree_moves_one_replica(mesh_shape):
    """select_replica gathered every replica onto every device to pick one (an all-gather
    of [N, ...]): it now moves one replica's bytes, with the same bits (-0.0, NaN, bool, bf16)
    for an index given as an int or traced, negative or past the end (clamped, as x[i])."""
    emb = np.arange(128.0, dtype=np.float32).reshape(4, 8, 4)
    emb[2, 0, :2] = -0.0, np.nan
    tree = {"embedding": jnp.asarray(emb), "step": jnp.int32(7),
            "flag": jnp.array([[1, 0], [0, 1], [1, 1], [0, 0]], bool),
            "half": jnp.array([[1, -0.0], [2, 3], [-0.0, 4], [5, 6]], jnp.bfloat16)}  # fmt: skip
    like = jax.tree.map(lambda x: x[0] if x.ndim else x, tree)
    placed = replicas.make_replicas(4, backend="shard_map", mesh_shape=mesh_shape).put(tree)
    static = jax.jit(lambda t: replicas.select_replica(t, 2, like))
    traced = jax.jit(lambda t, i: replicas.select_replica(t, i, like))
    for got, want in ((replicas.select_replica(placed, -2, like), 2), (static(placed), 2),
                      (traced(placed, 1), 1), (traced(placed, -1), 3), (traced(placed, 9), 3)):
        for key, x in tree.items():
            x, y = np.asarray(x if key == "step" else x[want]), np.asarray(got[key])
            assert (y.dtype, y.tobytes()) == (x.dtype, x.tobytes()), (key, want)
    local = placed["embedding"].addressable_shards[0].data[0]  # one replica's part on a device
    moved = [op for op in hlo.collective_ops(hlo.compiled_text(static, placed))
             if op.kind != "all-reduce" or op.bytes > 4]  # the bool/bf16 leaves move less
    assert [(op.kind, op.bytes) for op in moved] == [("all-reduce", local.nbytes)]


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 2}])
def test_select_replica_of_a_placed_tree_compiles_once(mesh_shape):
    """An eager select_replica of a placed tree ran a new shard_map closure per leaf and call,
    so every call compiled its small programs again: another index or another tree of the
    same leaves now compiles nothing."""
    tree = {"w": jnp.arange(32.0).reshape(4, 8), "b": jnp.arange(12, dtype=jnp.int32).reshape(4, 3)}
    like = jax.tree.map(lambda x: x[0], tree)
    placed = replicas.make_replicas(4, backend="shard_map", mesh_shape=mesh_shape).put(tree)
    other = jax.block_until_ready(jax.tree.map(lambda x: x + 1, placed))  # the same leaves' types
    replicas.select_replica(placed, 0, like)
    compiles = []
    listener = lambda event, *_, **__: compiles.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for index in (1, -1, 3):
            got = jax.block_until_ready(replicas.select_replica(other, index, like))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert [e for e in compiles if e.endswith("backend_compile_duration")] == []
    np.testing.assert_array_equal(np.asarray(got["w"]), np.arange(25.0, 33.0))


def test_put_names_the_leaf_a_split_does_not_divide():
    """reps.put of a vocabulary of 65 over tensor=2 failed with JAX's IndivisibleError, which
    names a shape (2, 65, 64) but not the leaf, the setting or the fix. The fix named was
    only a divisor of 65 (5 or 13; of GPT-2's 50257: 29): padding the vocabulary is named too."""
    cfg = models.get_preset("nano", vocab_size=65, max_seq_len=32)
    reps = replicas.make_replicas(2, mesh_shape={"tensor": 2})
    state = replicas.replicate(TrainState(jnp.zeros([], jnp.int32), models.init_params(cfg, 0)[1],
                                          None), 2)  # fmt: skip
    with pytest.raises(ValueError, match=r"mesh.tensor=2 does not divide dim 0 of "
                                         r"\.params\['embedding'\] \(the vocabulary, size 65\); "
                                         r"choose a divisor of 65 or pad the vocabulary to a "
                                         r"multiple of 2 \(config\.model\.vocab_size=66\)\."):
        reps.put(state)


class _FakeDevice:
    def __init__(self, i, process):
        self.id, self.process_index, self.platform, self.device_kind = i, process, "cpu", "cpu"


def test_each_process_holds_whole_replicas():
    """With several processes each replica's devices lie in one process, however the devices
    are listed (tests/test_multihost.py trains on such a mesh)."""
    devs = np.asarray([_FakeDevice(i, i % 2) for i in range(8)], dtype=object)  # interleaved
    processes = lambda grid: [sorted({d.process_index for d in r.flat}) for r in grid]  # noqa: E731
    assert processes(replicas._whole_replicas_per_process(devs, (2, 4, 1))) == [[0], [1]]
    assert processes(replicas._whole_replicas_per_process(devs, (4, 1, 2))) == [[0], [0], [1], [1]]
    assert replicas._whole_replicas_per_process(devs, (1, 4, 2)) is None  # larger than a process
    uneven = np.asarray([_FakeDevice(i, i // 4) for i in range(6)], dtype=object)  # 4 + 2
    assert replicas._whole_replicas_per_process(uneven, (3, 2, 1)) is None
    assert replicas._whole_replicas_per_process(np.asarray(jax.devices()), (2, 4, 1)) is None


def test_a_process_left_without_replicas_is_refused():
    """Two hosts of 8 devices: 8 replicas took the first host's devices and left the second
    process idle (README's srun recipe with configs/paper_small.py)."""
    devs = [_FakeDevice(i, i // 8) for i in range(16)]
    with pytest.raises(ValueError, match=r"num_replicas=8 x fsdp=1 x tensor=1 = 8 of the 16 "
                                         r"devices leave process\(es\) \[1\] without any.*"
                                         r"num_replicas=16 \(config\.num_replicas\)"):  # fmt: skip
        replicas.make_replicas(8, devices=devs)
    with pytest.raises(ValueError, match=r"num_replicas=4 x fsdp=2 .* num_replicas=8 "):
        replicas.make_replicas(4, devices=devs, mesh_shape={"fsdp": 2})
    with pytest.raises(ValueError, match=r"backend='vmap' runs every replica on one device, but "
                                         r"the devices belong to 2 processes"):  # fmt: skip
        replicas.make_replicas(8, devices=devs, backend="vmap")
    with pytest.raises(ValueError, match=r"backend='auto' with num_replicas=32 \(not one per "
                                         r"device of the 16\) runs every replica on one device.*"
                                         r"Use num_replicas=16"):  # fmt: skip
        replicas.make_replicas(32, devices=devs)  # auto falls back to vmap


class _FakeTpu(_FakeDevice):
    """A chip of a v5e-16 slice (4 x 4 chips), 4 chips per process."""

    def __init__(self, i):
        super().__init__(i, i // 4)
        self.platform, self.device_kind, self.core_on_chip = "tpu", "TPU v5 lite", 0
        self.slice_index, local = i // 16, i % 16
        self.coords = (local % 4, local // 4, 0)


def test_replicas_are_dealt_over_tpu_slices_each_inside_one():
    """README's multi-slice recipe: jax.make_mesh refused devices of several slices."""
    devs = [_FakeTpu(i) for i in range(32)]  # two slices
    for n, split in ((4, {"fsdp": 8}), (8, {"fsdp": 2, "tensor": 2}), (32, None)):
        grid = replicas.make_replicas(n, devices=devs, mesh_shape=split).mesh.devices
        per_replica = [{d.slice_index for d in np.ravel(r)} for r in grid]
        assert all(len(s) == 1 for s in per_replica), per_replica  # a replica in one slice
        assert sorted(s.pop() for s in per_replica) == [0] * (n // 2) + [1] * (n // 2)
        assert sorted(d.id for d in grid.flat) == list(range(32))
    with pytest.raises(ValueError, match=r"num_replicas=1 must be a multiple of the 2 TPU "
                                         r"slices"):  # fmt: skip
        replicas.make_replicas(1, devices=devs, mesh_shape={"fsdp": 32})



def test_replicas_on_part_of_a_tpu_slice_that_is_no_block_of_it():
    """3 replicas on a v5e-4 (2 x 2 chips): the first 3 chips leave a hole in the block and
    jax.make_mesh's TPU code failed an assertion; the devices are used in their order."""
    chips = []
    for i in range(4):
        chip = _FakeTpu(i)
        chip.coords = (i % 2, i // 2, 0)
        chips.append(chip)
    for n, split in ((3, None), (1, {"fsdp": 3})):
        grid = replicas.make_replicas(n, devices=chips, mesh_shape=split).mesh.devices
        assert [d.id for d in grid.flat] == [0, 1, 2]


def test_a_split_that_needs_a_physical_axis_split_falls_back_to_the_device_order():
    """A TPU v4-32 (2 x 2 x 4 chips, a host per 2 x 2 layer): fsdp 2 x tensor 4 made
    jax.make_mesh raise NotImplementedError ("Failed to find assignment for logical_axis_index
    1"); the chips are used in their order, each replica on two whole hosts."""
    chips = []
    for i in range(16):
        chip = _FakeTpu(i)
        chip.device_kind, chip.process_index = "TPU v4", i // 4
        chip.coords = (i % 2, i % 4 // 2, i // 4)
        chips.append(chip)
    split = {"fsdp": 2, "tensor": 4}
    grid = replicas.make_replicas(2, devices=chips, mesh_shape=split).mesh.devices
    assert [d.id for d in grid.flat] == list(range(16))
    assert [sorted({d.process_index for d in r.flat}) for r in grid] == [[0, 1], [2, 3]]


def test_whole_replicas_per_process_may_split_a_hosts_row_of_chips():
    """One v5e-16 slice, each host a row of 4 chips: 2 x 2 (fsdp x tensor) replicas per host
    raised NotImplementedError ("Failed to find assignment for logical_axis_index 2")."""
    chips = [_FakeTpu(i) for i in range(16)]
    for n, split in ((4, {"fsdp": 2, "tensor": 2}), (8, {"tensor": 2})):
        grid = replicas.make_replicas(n, devices=chips, mesh_shape=split).mesh.devices
        assert [len({d.process_index for d in r.flat}) for r in grid] == [1] * n
        assert sorted(d.id for d in grid.flat) == list(range(16))


def test_over_tpu_slices_each_process_holds_whole_replicas():
    """Two v5e-16 slices whose hosts hold 2 x 2 chips: a replica of 4 chips lay over two hosts
    (the slice's topology order) although each host holds one; one slice was fine."""
    chips = []
    for i in range(32):
        chip = _FakeTpu(i)
        x, y, _ = chip.coords
        chip.process_index = 4 * chip.slice_index + x // 2 + 2 * (y // 2)
        chips.append(chip)
    for split in ({"fsdp": 4}, {"fsdp": 2, "tensor": 2}):
        grid = replicas.make_replicas(8, devices=chips, mesh_shape=split).mesh.devices
        assert [len({d.process_index for d in r.flat}) for r in grid] == [1] * 8
        assert [r.flat[0].slice_index for r in grid] == [0] * 4 + [1] * 4
        assert sorted(d.id for d in grid.flat) == list(range(32))
    unequal = chips[:16] + chips[16:24]  # 16 + 8 chips: the given order, as before
    grid = replicas.make_replicas(6, devices=unequal, mesh_shape={"fsdp": 4}).mesh.devices
    assert [d.id for d in grid.flat] == list(range(24))


def test_fewer_replicas_than_devices_are_dealt_over_tpu_slices():
    """Two v5e-4 slices (2 x 2 chips, one host each): 6 replicas took the first 6 chips (4 + 2)
    and mesh_utils failed ("Number of devices 4 must equal the product of mesh_shape (3, 1,
    1)"); 2 replicas left the second slice's host idle. Each slice now holds N / 2."""
    chips = []
    for i in range(8):
        chip = _FakeTpu(i)
        chip.process_index, chip.slice_index, chip.coords = i // 4, i // 4, (i % 2, i % 4 // 2, 0)
        chips.append(chip)
    for n, split in ((6, None), (2, None), (2, {"fsdp": 2})):
        grid = replicas.make_replicas(n, devices=chips, mesh_shape=split).mesh.devices
        slices = [{d.slice_index for d in np.ravel(r)} for r in grid]
        assert slices == [{0}] * (n // 2) + [{1}] * (n // 2), (n, slices)

# ---------------------------------------------------------------- the trainer on split replicas


def _settings(corpus_dir, data_dir, fsdp, tensor=1, **overrides):
    from tests.test_train import tiny_settings  # noqa: PLC0415

    base = dict(num_replicas=2, backend="shard_map", num_steps=8, checkpoint_every=4,
                mesh={"fsdp": fsdp, "tensor": tensor})
    return tiny_settings(corpus_dir, data_dir, **{**base, **overrides})


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory, corpus_dir, data_dir):
    """Finished 8-step trainer runs with 2 replicas of fsdp 1 and of fsdp 2: {fsdp: workdir}.

    Checkpoints at steps 4 and 8; NoLoCo syncs every 4 steps. Tests only read them and
    resume copies (``_killed_while_saving``).
    """
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    base = tmp_path_factory.mktemp("split_runs")
    for fsdp in (1, 2):
        train_and_evaluate(_settings(corpus_dir, data_dir, fsdp), base / str(fsdp), progress=False)
    return {fsdp: base / str(fsdp) for fsdp in (1, 2)}


def _killed_while_saving(finished, dst):
    """A copy of a finished 8-step run as a process killed while saving step 8 leaves it:
    metrics logged up to step 8, the checkpoint of step 4, orbax's unfinished directory of 8."""
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415
    from tests.helpers import copy_run  # noqa: PLC0415

    run = copy_run(finished, dst)
    (run / "checkpoints" / "8").rename(run / "checkpoints" / "8.orbax-checkpoint-tmp-1700000000")
    assert Checkpointer(run / "checkpoints").latest_step() == 4
    return run


def _records(workdir, kind, key):
    """[(step, value)] of every ``kind`` record in the order logged (a replay logs twice)."""
    from tests.helpers import logged_records  # noqa: PLC0415

    return [(r["step"], r[key]) for r in logged_records(workdir, kind)]


def test_trainer_on_split_replicas_and_resharded_checkpoints(tmp_path, corpus_dir, data_dir,
                                                             split_runs):  # fmt: skip
    """The trainer with (replica 2, fsdp 2) trains like one device per replica (Adam: losses
    to rtol 1e-4), and its checkpoint restores bit for bit into fsdp 4 and fsdp 1."""
    from noloco_jax.trainer.loop import load_run, train_and_evaluate  # noqa: PLC0415

    losses = {f: [v for _, v in _records(split_runs[f], "train", "train_loss")] for f in (1, 2)}
    assert len(losses[2]) == 4
    np.testing.assert_allclose(losses[2], losses[1], rtol=1e-4)
    restored = {f: load_run(_settings(corpus_dir, data_dir, f), split_runs[2])[1]
                for f in (1, 2, 4)}  # fmt: skip
    for f in (1, 4):
        for a, b in zip(jax.tree.leaves(restored[f]), jax.tree.leaves(restored[2])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    spec = tuple(restored[4]["blocks"]["attn"]["wq"][...].sharding.spec)
    assert spec[:3] == ("replica", None, "fsdp")
    # An interrupted run resumes on another split and finishes the same way (Adam: rtol
    # 1e-4); a different N is still refused. It resumes on fsdp 1, whose programs the fsdp-1
    # run compiled (the restore into fsdp 4 is checked above; test_multihost trains on it).
    run = _killed_while_saving(split_runs[2], tmp_path / "run")
    train_and_evaluate(_settings(corpus_dir, data_dir, 1), run, progress=False)
    resumed = dict(_records(run, "train", "train_loss"))  # the replay's records come last
    np.testing.assert_allclose([resumed[s] for s in (2, 4, 6, 8)], losses[2], rtol=1e-4)
    with pytest.raises(ValueError, match="num_replicas"):
        train_and_evaluate(_settings(corpus_dir, data_dir, 1, num_replicas=4, num_steps=12),
                           run, progress=False)  # fmt: skip


def test_killed_and_resumed_split_run_equals_an_uninterrupted_one(tmp_path, corpus_dir, data_dir,
                                                                  split_runs):  # fmt: skip
    """(replica 2, fsdp 2) killed while saving step 8, resumed from step 4 on the same split:
    the replayed losses, the last evaluation and every array of the state at step 8 (params,
    slow weights, Adam moments, outer momentum: the checkpoint's checksums) are bit for bit
    those of the uninterrupted run."""
    from noloco_jax.trainer.checkpoint import Checkpointer  # noqa: PLC0415
    from noloco_jax.trainer.loop import train_and_evaluate  # noqa: PLC0415

    full = split_runs[2]
    run = _killed_while_saving(full, tmp_path / "run")
    last = train_and_evaluate(_settings(corpus_dir, data_dir, 2), run, progress=False)
    assert last["step"] == 8
    train, evals = _records(run, "train", "train_loss"), _records(run, "eval", "val_ppl")
    full_train, full_evals = _records(full, "train", "train_loss"), _records(full, "eval", "val_ppl")
    assert train == full_train + full_train[2:]  # steps 6 and 8 trained again, the same way
    assert evals == full_evals + full_evals[-1:]
    sums = [Checkpointer(w / "checkpoints").read_meta(8)["checksums"] for w in (full, run)]
    assert sums[0] == sums[1] and len(sums[0]) > 10


def test_bad_mesh_settings(corpus_dir, data_dir):
    with pytest.raises(ValueError, match="config.mesh: fsdp=2 x tensor=1 .* backend='vmap'"):
        _settings(corpus_dir, data_dir, 2, backend="vmap")
    with pytest.raises(ValueError, match="config.mesh.tensor"):
        _settings(corpus_dir, data_dir, 1, tensor=0)


@pytest.mark.parametrize("axis_name", ["fsdp", "tensor"])
def test_a_replica_axis_named_like_an_intra_replica_axis_is_refused(axis_name):
    # Was accepted as a mesh with two axes of one name; the first reps.put died inside XLA.
    with pytest.raises(ValueError, match=rf"axis_name='{axis_name}' is a mesh axis inside each "
                                         rf"replica \(mesh_shape="):  # fmt: skip
        replicas.make_replicas(2, axis_name=axis_name, mesh_shape={"fsdp": 2, "tensor": 2})
    assert replicas.make_replicas(2, axis_name=axis_name).mesh.axis_names == (axis_name,)


@pytest.mark.parametrize("mesh_shape", [None, {"fsdp": 2}])
def test_select_replica_of_a_placed_tree_of_keys_complex_and_int4(mesh_shape):
    """Picking by moving a replica's bits as unsigned integers failed for leaves with no such
    integer (a TypeError for PRNG keys and complex, a shard_map ValueError for int4); these
    are gathered first again, the same values as x[i]."""
    tree = {"key": jax.random.split(jax.random.key(0), 4),
            "c64": jnp.arange(8, dtype=jnp.complex64).reshape(4, 2) * (1 + 2j),
            "i4": jnp.arange(-4, 4, dtype=jnp.int4).reshape(4, 2)}  # fmt: skip
    like = jax.tree.map(lambda x: x[0], tree)
    placed = replicas.make_replicas(4, backend="shard_map", mesh_shape=mesh_shape).put(tree)
    got = replicas.select_replica(placed, 2, like)
    np.testing.assert_array_equal(jax.random.key_data(got["key"]),
                                  jax.random.key_data(tree["key"][2]))  # fmt: skip
    for key in ("c64", "i4"):
        assert (got[key].dtype, got[key].tolist()) == (tree[key].dtype, tree[key][2].tolist())
