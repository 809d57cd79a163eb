"""Pipeline stages with random routing: paths, locality, fixed eval routing, sim == mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import models, noloco_outer, replicas
from noloco_jax import pipeline as pl
from noloco_jax.trainer.step import loss_fn
from tests.helpers import assert_trees_close

N, S, B, T = 4, 2, 3, 12
CFG = models.get_preset("nano", vocab_size=64, max_seq_len=64)


@pytest.fixture(scope="module")
def setup():
    graphdef, _ = models.init_params(CFG, 0)
    keys = jax.random.split(jax.random.key(1), N)
    params = jax.jit(jax.vmap(lambda k: models.init_params(CFG, k)[1]))(keys)  # distinct replicas
    tokens = jax.random.randint(jax.random.key(2), (N, B, T + 1), 1, 64)
    pool = pl.permutation_pool(N)
    idx = pl.route_indices(3, num_boundaries=S - 1, num_microbatches=B, pool_size=len(pool),
                           seed=0)  # fmt: skip
    return graphdef, params, tokens, pool, idx, pl.route_perms(pool, idx)


def test_pool_and_draws_are_bijections_and_deterministic():
    pool = pl.permutation_pool(4)
    assert pool.shape == (24, 4) and len({tuple(r) for r in pool.tolist()}) == 24
    big = pl.permutation_pool(8, pool_size=16, seed=3)
    assert big.shape == (16, 8) and all(sorted(r) == list(range(8)) for r in big.tolist())
    a = pl.route_indices(7, num_boundaries=3, num_microbatches=5, pool_size=24, seed=1)
    b = pl.route_indices(7, num_boundaries=3, num_microbatches=5, pool_size=24, seed=1)
    c = pl.route_indices(8, num_boundaries=3, num_microbatches=5, pool_size=24, seed=1)
    assert a.shape == (3, 5) and np.array_equal(a, b) and not np.array_equal(a, c)
    perms = np.asarray(pl.route_perms(pool, a))
    assert all(sorted(p) == [0, 1, 2, 3] for p in perms.reshape(-1, 4).tolist())


def test_permutation_pool_refuses_bools_floats_and_negative_seeds():
    """True made a 1-replica pool (and hit 1's cache entry), pool_size=2.5 or True was used as
    a bound, 2.0 replicas died in math.factorial with a TypeError, seed=-1 in NumPy unnamed."""
    pl.permutation_pool(1), pl.permutation_pool(3, 1)  # cached entries True could have hit
    for args, field in [((True,), "num_replicas"), ((2.0,), "num_replicas"),
                        ((0,), "num_replicas"), ((3, 2.5), "pool_size"), ((3, True), "pool_size"),
                        ((3, 0), "pool_size"), ((4, 8, -1), "seed")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{field}: must be an integer"):
            pl.permutation_pool(*args)


def test_route_indices_refuses_a_pool_size_below_one():
    """pool_size <= 0 (or True) drew index 0 everywhere: the identity, fixed routing."""
    for pool_size in (0, -3, True, 2.5):
        with pytest.raises(ValueError, match=r"^pool_size: must be an integer >= 1"):
            pl.route_indices(0, num_boundaries=2, num_microbatches=6, pool_size=pool_size, seed=0)


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5])
def test_route_indices_refuses_a_seed_its_key_cannot_hold(seed):
    """The key keeps 32 bits: seed=-1 drew seed 2**32 - 1's routes, 2**32 seed 0's, True
    seed 1's (permutation_pool refuses -1 and True, and draws 2**32's own pool), and 1.5 died
    in JAX naming a tracer."""
    with pytest.raises(ValueError, match=r"^seed: must be an integer in \[0, 2\*\*32 - 1\]"):
        pl.route_indices(0, num_boundaries=1, num_microbatches=2, pool_size=24, seed=seed)


def test_route_boundary_moves_each_microbatch_to_its_destination():
    x = jnp.arange(N * B).reshape(N, B)
    perm = jnp.array([[1, 2, 3, 0], [0, 1, 2, 3], [3, 2, 1, 0]])  # [B, N]
    y = pl.route_boundary(x, perm)
    y_np, x_np, perm_np = map(np.asarray, (y, x, perm))  # read on the host, not op by op
    for b in range(B):
        for k in range(N):
            assert int(y_np[perm_np[b, k], b]) == int(x_np[k, b])
    with pytest.raises(ValueError, match=r"^perm_BxN must have shape \[B, N\] = \[3, 4\]"):
        pl.route_boundary(x, perm[:, :3])  # was a [3, B] result: replica 3's batches dropped


def _sequence_loss(params, graphdef, tokens, path, r, b):
    """One sequence through the replicas on its path, stage by stage."""
    stages = pl.stage_layer_ids(CFG.num_layers, S)
    pick = lambda k: jax.tree.map(lambda a: a[k], params)  # noqa: E731
    from flax import nnx

    x = nnx.merge(graphdef, pick(path[0])).embed(tokens[r, b][None, :-1])
    for s, ids in enumerate(stages):
        x = nnx.merge(graphdef, pick(path[s])).run_layers(x, ids)
    logits = nnx.merge(graphdef, pick(path[-1])).head(x)
    return models.cross_entropy(logits, tokens[r, b][None, 1:]).mean()


@pytest.fixture(scope="module")
def simulated(setup):
    """(losses [N], their sum's gradient) of ``routed_losses`` with ``setup``'s routing: one
    program that the tests comparing other paths against the simulation share."""
    graphdef, params, tokens, _, _, perms = setup

    def total(p):
        losses = pl.routed_losses(p, tokens, perms, graphdef=graphdef, num_stages=S)
        return losses.sum(), losses

    (_, losses), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(params)
    return losses, grads


def test_routed_forward_backward_equals_explicit_loop_over_paths(setup, simulated):
    graphdef, params, tokens, _, _, perms = setup
    paths = pl.sequence_paths(np.asarray(perms)).reshape(N * B, S)
    rows, cols = np.divmod(np.arange(N * B), B)  # sequence (r, b) of each path

    def looped(p):  # each of the N * B sequences on its own path, by _sequence_loss
        one = lambda path, r, b: _sequence_loss(p, graphdef, tokens, path, r, b)  # noqa: E731
        return jax.vmap(one)(paths, rows, cols).sum() / B

    # Compiled (one program) rather than op by op, and vmapped over the sequences rather than
    # unrolled (12 copies of the model took ~20 s to compile): same arithmetic per sequence.
    l_looped, g_looped = jax.jit(jax.value_and_grad(looped))(params)
    l_routed, g_routed = simulated[0].sum(), simulated[1]
    np.testing.assert_allclose(l_routed, l_looped, rtol=1e-5)
    assert_trees_close(g_routed, g_looped, rtol=1e-4, atol=1e-7)


def test_fixed_routing_is_independent_replicas(setup):
    graphdef, params, tokens, *_ = setup
    fixed = pl.identity_perms(S - 1, B, N)
    got = jax.jit(lambda p: pl.routed_losses(p, tokens, fixed, graphdef=graphdef,
                                             num_stages=S))(params)  # fmt: skip
    want = jax.jit(jax.vmap(lambda p, t: loss_fn(p, t, graphdef=graphdef)))(params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_stage_gradients_only_come_from_microbatches_routed_through_it(setup):
    graphdef, params, tokens, _, _, perms = setup
    paths = pl.sequence_paths(np.asarray(perms))
    per = pl.stage_layer_ids(CFG.num_layers, S)
    grad_of = jax.jit(jax.grad(lambda p, j: pl.routed_losses(
        p, tokens, perms, graphdef=graphdef, num_stages=S)[j]))  # one program for every j
    for j in range(N):  # the loss finished by last-stage replica j
        grads = grad_of(params, j)
        wq = np.asarray(grads["blocks"]["attn"]["wq"][...])  # [N, L, ...]
        for k in range(N):
            for s in range(S):
                visited = any(paths[r, b, s] == k and paths[r, b, -1] == j
                              for r in range(N) for b in range(B))  # fmt: skip
                nonzero = np.abs(wq[k, per[s]]).max() > 0
                assert nonzero == visited, (j, k, s)
        emb = np.abs(np.asarray(grads["embedding"][...])).reshape(N, -1).max(1) > 0
        starts = {int(paths[r, b, 0]) for r in range(N) for b in range(B) if paths[r, b, -1] == j}
        assert {k for k in range(N) if emb[k]} == starts


def test_routing_arrays_of_the_wrong_shape_are_refused(setup):
    """A routing array whose micro-batch axis is not B was broadcast or clamped: every
    micro-batch silently took micro-batch 0's route (or extra rows were ignored)."""
    graphdef, params, tokens, pool, idx, perms = setup
    with pytest.raises(ValueError, match=r"perms must have shape \[S - 1, B, N\]"):
        pl.routed_losses(params, tokens, perms[:, :1], graphdef=graphdef, num_stages=S)
    with pytest.raises(ValueError, match=r"perms must have shape"):
        pl.routed_losses(params, tokens, perms[:, :, :2], graphdef=graphdef, num_stages=S)
    one = jax.tree.map(lambda x: x[0], params)
    for bad in (idx[:, :1], jnp.concatenate([idx, idx], axis=1), idx[None]):
        for fn in (pl.routed_loss, pl.routed_loss_on_mesh):
            with pytest.raises(ValueError, match=r"idx_Sm1xB must have shape \[S - 1, B\]"):
                fn(one, tokens[0], bad, graphdef=graphdef, pool=pool, num_stages=S)


def _mesh_reps():
    return replicas.Replicas(N, mesh=pl.make_pipeline_mesh(N, S), leaf_axes=pl.stage_leaf_axes)


def _routed_grads(reps, graphdef, pool, idx, on_mesh, gather=False):
    """Loss and grads of every replica with the routing ``idx``, via ``reps.map``."""
    def one(p, tok):
        if not on_mesh:
            f = lambda q: pl.routed_loss(q, tok, idx, graphdef=graphdef, pool=pool,  # noqa: E731
                                         num_stages=S, gather=gather)
            return jax.value_and_grad(f)(p)

        def total(q):
            local = pl.routed_loss_on_mesh(q, tok, idx, graphdef=graphdef, pool=pool, num_stages=S)
            return jax.lax.psum(local, ("replica", "stage")), jax.lax.psum(local, "stage")

        (_, loss), g = jax.value_and_grad(total, has_aux=True)(p)
        return loss, g

    return jax.jit(reps.map(one))


def test_routed_loss_on_mesh_refuses_num_stages_other_than_the_stage_axis(setup):
    """Device (r, s) is addressed as r * num_stages + s: with num_stages=1 on a 4 x 2 mesh the
    loss came back silently (the routing and the last stage were those of a 1-stage pipeline)."""
    graphdef, params, tokens, pool, idx, _ = setup
    reps = _mesh_reps()

    def one(p, tok):
        return jax.lax.psum(pl.routed_loss_on_mesh(p, tok, idx[:0], graphdef=graphdef, pool=pool,
                                                   num_stages=1), "stage")  # fmt: skip

    with pytest.raises(ValueError, match=r"^num_stages: must equal the mesh's 'stage' axis "
                                         r"size 2, got 1\."):
        jax.eval_shape(reps.map(one), reps.put(params), reps.put(tokens))


@pytest.mark.parametrize("on_mesh, gather", [(False, False), (False, True), (True, False)])
def test_a_pool_for_another_number_of_replicas_is_refused(setup, on_mesh, gather):
    """Bijections of 2 or 8 replicas on 4: the gather clamped the sources and returned a wrong
    loss silently; ppermute died with a bare AssertionError."""
    graphdef, params, tokens, *_ = setup
    reps = _mesh_reps() if on_mesh else replicas.Replicas(N)
    idx = jnp.ones((S - 1, B), jnp.int32)
    for m in (2, 8):
        pool = pl.permutation_pool(m, 24)

        def one(p, tok, pool=pool):
            if on_mesh:
                return jax.lax.psum(pl.routed_loss_on_mesh(p, tok, idx, graphdef=graphdef,
                                                           pool=pool, num_stages=S), "stage")
            return pl.routed_loss(p, tok, idx, graphdef=graphdef, pool=pool, num_stages=S,
                                  gather=gather)  # fmt: skip

        with pytest.raises(ValueError, match=rf"^pool: must hold bijections of the {N} "):
            jax.eval_shape(reps.map(one), reps.put(params), reps.put(tokens))


@pytest.mark.parametrize("on_mesh, gather", [(False, False), (False, True), (True, False)])
def test_per_replica_routing_equals_the_gather_simulation(setup, simulated, on_mesh, gather):
    """routed_loss (ppermute or gather over replicas, vmap) and routed_loss_on_mesh equal
    routed_losses."""
    graphdef, params, tokens, pool, idx, perms = setup
    reps = _mesh_reps() if on_mesh else replicas.Replicas(N)
    losses, grads = _routed_grads(reps, graphdef, pool, idx, on_mesh, gather)(
        reps.put(params), reps.put(tokens))
    np.testing.assert_allclose(losses, simulated[0], rtol=1e-6)
    assert_trees_close(grads, simulated[1], rtol=1e-5, atol=1e-7)


def test_training_with_noloco_per_stage_matches_on_mesh_and_in_simulation(setup):
    from noloco_jax import local_steps
    from noloco_jax.trainer import grads as grads_lib
    from noloco_jax.trainer.step import TrainState, train_step

    graphdef, params, tokens, pool, _, _ = setup
    single = jax.tree.map(lambda x: x[0], params)  # identical init
    # SGD: equal gradients must give equal trajectories. (Adam divides near-zero
    # gradients by their own magnitude, so 1e-8 differences in summation order
    # would show up as 1e-5 differences in the parameters.)
    make_tx = lambda stage=None: optax.chain(  # noqa: E731
        pl.clip_by_stage_norm(0.5, S, stage=stage),
        local_steps(optax.sgd(0.5, momentum=0.9), noloco_outer(seed=2), 2))
    state0 = TrainState(jnp.zeros([], jnp.int32), single, jax.jit(make_tx().init)(single))
    runs = {
        "sim": (replicas.Replicas(N), grads_lib.routed(graphdef, pool, S, seed=0), make_tx()),
        "mesh": (_mesh_reps(), grads_lib.routed_on_mesh(graphdef, pool, S, seed=0),
                 grads_lib.per_stage(make_tx)),
    }
    out = {}
    for name, (reps, grads_fn, tx) in runs.items():
        step = jax.jit(reps.map(functools.partial(train_step, grads_fn=grads_fn, tx=tx)))
        state = reps.put(replicas.replicate(state0, N))
        for k in range(5):  # two NoLoCo syncs
            tok = jax.random.randint(jax.random.key(10 + k), (N, B, T + 1), 1, 64)
            state, _ = step(state, reps.put(tok))
        out[name] = jax.tree.map(np.asarray, state.params)
    assert_trees_close(out["mesh"], out["sim"], rtol=1e-4, atol=1e-6)
    assert not np.allclose(out["sim"]["lm_head"][...][0], out["sim"]["lm_head"][...][1])


def test_clip_by_stage_norm_leaves_integer_leaves_out():
    """As clip_by_global_norm_fused does: an integer leaf was counted in its stage's norm and
    then scaled and truncated (7, 9 -> 0, 0), and it clipped the floats of its stage."""
    tree = {"blocks": {"w": jnp.full((2, 3), 0.1)}, "lm_head": jnp.full((2,), 0.1),
            "final_norm": {"count": jnp.array([7, 9], jnp.int32)}}  # last stage's
    out, _ = jax.jit(pl.clip_by_stage_norm(1.0, 2).update)(tree, optax.EmptyState())
    np.testing.assert_array_equal(out["final_norm"]["count"], [7, 9])
    np.testing.assert_array_equal(out["lm_head"], tree["lm_head"])  # its stage's norm is < 1


def test_clip_by_stage_norm_clips_each_stage_on_its_own(setup):
    _, params, *_ = setup
    single = jax.tree.map(lambda x: x[0] * 10.0, params)
    tx = pl.clip_by_stage_norm(1.0, S)
    clipped, _ = jax.jit(tx.update)(single, tx.init(single))  # one program, not op by op
    per = pl.stage_layer_ids(CFG.num_layers, S)
    sq = [0.0] * S
    for path, g in jax.tree_util.tree_flatten_with_path(clipped)[0]:
        owner = pl.leaf_owner(path)
        g = np.asarray(g, np.float64)  # the norms summed on the host
        if owner == "blocks":
            for s in range(S):
                sq[s] += float(np.sum(np.square(g[per[s]])))
        else:
            sq[0 if owner == "first" else S - 1] += float(np.sum(np.square(g)))
    np.testing.assert_allclose(np.sqrt(sq), [1.0] * S, rtol=1e-5)
    with pytest.raises(ValueError, match="max_norm"):
        pl.clip_by_stage_norm(0.0, S)
    with pytest.raises(ValueError, match="max_norm must be a number > 0, got nan"):  # NaN out
        pl.clip_by_stage_norm(float("nan"), S)
    with pytest.raises(ValueError, match="max_norm must be a number > 0, got True"):  # was 1
        pl.clip_by_stage_norm(True, S)
    with pytest.raises(ValueError, match=r"num_stages: must be an integer"):  # ZeroDivisionError
        pl.clip_by_stage_norm(1.0, 0)
    bad = pl.clip_by_stage_norm(1.0, CFG.num_layers + 1)  # was a reshape TypeError
    with pytest.raises(ValueError, match=rf"num_stages={CFG.num_layers + 1} must divide"):
        bad.update(single, bad.init(single))


def test_bad_stage_counts_and_meshes():
    with pytest.raises(ValueError, match=r"num_stages=3 must divide the model's 2 layers; "
                                         r"allowed: \[1, 2\]"):
        pl.stage_layer_ids(2, 3)
    for layers in (0, -2, 2.0):  # 0 and -2 gave every stage an empty list of layers
        with pytest.raises(ValueError, match=rf"^num_layers: must be an integer >= 1, got "
                                             rf"{layers!r}"):  # fmt: skip
            pl.stage_layer_ids(layers, 2)
    with pytest.raises(ValueError, match="needs 32 devices"):
        pl.make_pipeline_mesh(8, 4)
    # 0 died with an IndexError, 2.0 with a TypeError, (-1, -2) in JAX unnamed, True made 1 x 2
    for args, field in [((0, 2), "num_replicas"), ((2.0, 2), "num_replicas"),
                        ((-1, -2), "num_replicas"), ((True, 2), "num_replicas"),
                        ((2, 0), "num_stages")]:  # fmt: skip
        with pytest.raises(ValueError, match=rf"^{field}: must be an integer >= 1"):
            pl.make_pipeline_mesh(*args)


class _Chip:
    """A fake device: a chip of a single-host v5e-8 slice (2 x 4), or a GPU (``coords=None``)."""

    def __init__(self, i, process, coords=None):
        self.id, self.process_index, self.core_on_chip = i, process, 0
        gpu = coords is None
        self.platform, self.device_kind = ("gpu", "gpu") if gpu else ("tpu", "TPU v5 lite")
        if coords is not None:
            self.slice_index, self.coords = process, coords


def test_pipeline_mesh_keeps_replicas_in_a_slice_and_every_process_busy():
    """Two v5e-8 slices: jax.make_mesh failed a bare assertion (it refuses multi-slice
    devices). Two GPU hosts x 8: 2 x 4 took host 0's GPUs and left host 1 idle, silently."""
    chips = [_Chip(i, i // 8, (i % 2, i % 8 // 2, 0)) for i in range(16)]
    for n, s in ((4, 4), (2, 8)):
        grid = pl.make_pipeline_mesh(n, s, devices=chips).devices
        assert [{d.slice_index for d in r} for r in grid] == [{0}] * (n // 2) + [{1}] * (n // 2)
        assert sorted(d.id for d in grid.flat) == list(range(16))
    gpus = [_Chip(i, i // 8) for i in range(16)]
    with pytest.raises(ValueError, match=r"2 x 4 \(replica x stage\) mesh on 8 of the 16 "
                                         r"devices leaves process\(es\) \[1\] without any.*"
                                         r"num_replicas=4 \(config\.num_replicas\)"):  # fmt: skip
        pl.make_pipeline_mesh(2, 4, devices=gpus)
    grid = pl.make_pipeline_mesh(4, 4, devices=gpus).devices
    assert [{d.process_index for d in r} for r in grid] == [{0}, {0}, {1}, {1}]


def test_nonfinite_guard_on_the_mesh_resets_every_stage_of_the_replica(setup):
    """A NaN in one stage's blocks resets that replica on all its devices, no one else."""
    graphdef, params, tokens, pool, idx, _ = setup
    from noloco_jax import local_steps
    from noloco_jax.trainer import grads as grads_lib
    from noloco_jax.trainer.optimizer import STAGE_AXIS
    from noloco_jax.trainer.step import TrainState, train_step

    reps = _mesh_reps()
    single = jax.tree.map(lambda x: x[0], params)
    make_tx = lambda stage=None: local_steps(  # noqa: E731
        optax.sgd(0.1), noloco_outer(seed=1), 2, nonfinite_guard=True, guard_axis_name=STAGE_AXIS)
    opt_state = replicas.replicate(jax.jit(make_tx().init)(single), N)  # one program
    step = jax.jit(reps.map(functools.partial(
        train_step, grads_fn=grads_lib.routed_on_mesh(graphdef, pool, S, seed=0),
        tx=grads_lib.per_stage(make_tx), nonfinite_guard=True, guard_axis=STAGE_AXIS)))
    bad = 1
    # NaN only in the blocks of the last layer (stage S - 1's slice), replica `bad`.
    def poison(path, x):  # on the host: one update per leaf shape compiled nothing worth it
        if "blocks" not in jax.tree_util.keystr(path):
            return x
        x = np.array(x)
        x[bad, -1] = np.nan
        return jnp.asarray(x)

    poisoned = jax.tree_util.tree_map_with_path(poison, params)
    state = TrainState(jnp.int32(3), poisoned, opt_state)  # step 3: the routing of ``idx``
    new, losses = step(reps.put(state), reps.put(tokens))
    p = jax.tree.map(np.asarray, new.params)
    slow = jax.tree.map(np.asarray, opt_state.slow_params)
    for leaf, ref in zip(jax.tree.leaves(p), jax.tree.leaves(slow)):
        np.testing.assert_array_equal(leaf[bad], ref[bad])  # whole replica back on phi
        assert np.isfinite(leaf).all()
    moved = [not np.array_equal(a[0], b[0]) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(slow))]
    assert any(moved)  # healthy replicas took their SGD step
    assert not np.isfinite(np.asarray(losses)[bad]) and np.isfinite(np.delete(np.asarray(losses), bad)).all()


def test_bytes_sent_on_the_stage_mesh_are_the_compiled_sync_steps():
    """Each stage device sends its blocks and its own copy of embedding, head and norm: the
    count was the model's size (656,644 B here), the compiled sync sends 787,984 B."""
    from noloco_jax import comm, hlo
    from noloco_jax.trainer import grads as grads_lib
    from noloco_jax.trainer import optimizer as optim_lib
    from noloco_jax.trainer import settings as settings_lib

    s = settings_lib.from_config({"num_replicas": N, "global_batch_size": 8, "num_stages": S,
                                  "model": {"preset": "nano"}})  # fmt: skip
    single = models.init_params(models.get_preset("nano", vocab_size=256), 0)[1]
    tx = grads_lib.per_stage(lambda stage=None: optim_lib.build_optimizer(
        "noloco", s.optim, s.outer, num_steps=10, num_replicas=N, num_stages=S, stage=stage))
    reps = _mesh_reps()
    params = reps.put(replicas.replicate(single, N))
    sync = jax.jit(reps.map(lambda g, st, p: tx.update(g, st, p, sync_step=True)))
    state = reps.init(tx, params)
    per_branch = hlo.bytes_by_computation(hlo.compiled_text(sync, params, state, params),
                                          "collective-permute")  # fmt: skip
    pool = comm.partition_pool(N, s.outer.group_size, s.outer.seed)
    per_device = sum(per_branch.values()) / len(pool)  # one branch of each message per sync
    reported = optim_lib.bytes_sent("noloco", s.outer, single, num_replicas=N,
                                    steps=s.outer.sync_every, fault=s.fault, stage_copies=S)
    assert reported == S * per_device
    assert reported > optim_lib.bytes_sent("noloco", s.outer, single, num_replicas=N,
                                           steps=s.outer.sync_every, fault=s.fault)  # the model


def test_diloco_bytes_on_the_stage_mesh_pad_one_message_per_device():
    """DiLoCo's sync is one all-to-all and one all-gather of each device's whole local tree, so
    a narrower wire pads it once (it was counted as two messages, each padded)."""
    from noloco_jax import comm
    from noloco_jax.trainer import optimizer as optim_lib
    from noloco_jax.trainer import settings as settings_lib

    s = settings_lib.from_config({"num_replicas": N, "global_batch_size": 8, "num_stages": S,
                                  "method": "diloco", "outer": {"exchange_dtype": "bfloat16"},
                                  "model": {"preset": "nano"}})  # fmt: skip
    single = jax.eval_shape(lambda: models.init_params(models.get_preset("nano",
                                                                         vocab_size=256), 0)[1])
    local = jax.tree_util.tree_map_with_path(  # one stage device: 1/S of the blocks, the rest
        lambda path, x: jax.ShapeDtypeStruct((x.shape[0] // S, *x.shape[1:]), x.dtype)
        if pl.stage_leaf_axes(path, x) else x, single)
    want = S * comm.diloco_bytes_per_sync(local, N, exchange_dtype=jnp.bfloat16,
                                          with_presence=s.fault.nonfinite_guard)  # fmt: skip
    got = optim_lib.bytes_sent("diloco", s.outer, single, num_replicas=N,
                               steps=s.outer.sync_every, fault=s.fault, stage_copies=S)
    assert got == want


def test_bf16_params_train_on_the_stage_mesh_as_in_simulation():
    """bf16 params on a (replica, stage) mesh: ``comm.as_stored``'s one barrier over all leaves
    typed the stage-replicated embedding and head as stage-varying, so every run died in the
    step loop's scan with a TypeError."""
    from noloco_jax.trainer import grads as grads_lib
    from noloco_jax.trainer import optimizer as optim_lib
    from noloco_jax.trainer import settings as settings_lib
    from noloco_jax.trainer.step import TrainState, make_program

    cfg = models.get_preset("nano", vocab_size=64, max_seq_len=64, param_dtype="bfloat16")
    graphdef, single = models.init_params(cfg, 0)
    s = settings_lib.from_config({"num_replicas": N, "global_batch_size": 8, "num_stages": S,
                                  "method": "dp"})  # fmt: skip
    build = lambda stage=None: optim_lib.build_optimizer(
        "dp", s.optim, s.outer, num_steps=10, num_replicas=N, num_stages=S, stage=stage)
    state0 = TrainState(jnp.zeros([], jnp.int32), single, jax.jit(build().init)(single))
    state0 = replicas.replicate(state0, N)
    tokens = jax.random.randint(jax.random.key(3), (N, 1, B, T + 1), 1, 64)
    pool, out = pl.permutation_pool(N), {}
    for name, reps, grads_fn, tx in (
            ("sim", replicas.Replicas(N), grads_lib.routed(graphdef, pool, S, seed=0), build()),
            ("mesh", _mesh_reps(), grads_lib.routed_on_mesh(graphdef, pool, S, seed=0),
             grads_lib.per_stage(build))):  # fmt: skip
        program = make_program(reps, sync_step=None, donate=False, grads_fn=grads_fn, tx=tx)
        state, _ = program(reps.put(state0), reps.put(tokens))
        out[name] = jax.tree.map(lambda x: np.asarray(x, np.float32), state.params)
    assert_trees_close(out["mesh"], out["sim"], rtol=1e-2, atol=1e-3)  # ~2 bf16 ulps
    moved = out["mesh"]["lm_head"][...][0] - np.asarray(single["lm_head"][...], np.float32)
    assert np.abs(moved).max() > 0


def test_a_routing_pool_too_big_to_compile_on_the_mesh_is_refused():
    """routing_pool_size was unbounded: on the (replica, stage) mesh each of min(N!, size)
    bijections compiles a ppermute branch per micro-batch and boundary (8 replicas and a pool
    >= 8! built 40320 branches each); the simulated path, which gathers, takes any size."""
    from noloco_jax.trainer import build  # noqa: PLC0415
    from tests.test_train import tiny_settings  # noqa: PLC0415

    graphdef, _ = models.init_params(CFG, 0)
    big = dict(num_replicas=8, num_stages=2, routing_pool_size=10**6)
    with pytest.raises(ValueError, match=r"^config\.routing_pool_size: must be in \[1, 1024\] on "
                                         r"the \(replica, stage\) device mesh .* got 1000000 "):
        build.topology(tiny_settings("/tmp", "/tmp", backend="shard_map", **big), CFG, graphdef,
                       lambda **_: optax.sgd(0.1))  # fmt: skip
    small = tiny_settings("/tmp", "/tmp", backend="shard_map", num_replicas=4, num_stages=2,
                          routing_pool_size=10**6)  # 4! = 24 bijections: a small switch
    build.topology(small, CFG, graphdef, lambda **_: optax.sgd(0.1))
    build.topology(tiny_settings("/tmp", "/tmp", backend="vmap", **big), CFG, graphdef,
                   lambda **_: optax.sgd(0.1))  # simulated: gathers


def test_fixed_routing_on_the_mesh_keeps_only_the_identity(monkeypatch):
    """routing_pool_size is ignored with routing='fixed' (its warning says so), but the mesh's
    pool cap refused it, and the whole pool compiled a switch branch per bijection unused."""
    from noloco_jax.trainer import build  # noqa: PLC0415
    from tests.test_train import tiny_settings  # noqa: PLC0415

    graphdef, _ = models.init_params(CFG, 0)
    pools = []
    routed = build.grads.routed_on_mesh
    monkeypatch.setattr(build.grads, "routed_on_mesh",
                        lambda g, pool, *a, **k: pools.append(pool) or routed(g, pool, *a, **k))
    monkeypatch.setattr(build, "MAX_MESH_ROUTING_POOL", 4)  # 4! = 24 bijections: over it
    four = dict(backend="shard_map", num_replicas=4, num_stages=2, routing_pool_size=24)
    with pytest.raises(ValueError, match=r"^config\.routing_pool_size: must be in \[1, 4\]"):
        build.topology(tiny_settings("/tmp", "/tmp", **four), CFG, graphdef,
                       lambda **_: optax.sgd(0.1))  # fmt: skip
    build.topology(tiny_settings("/tmp", "/tmp", routing="fixed", **four), CFG, graphdef,
                   lambda **_: optax.sgd(0.1))  # fmt: skip
    np.testing.assert_array_equal(pools[-1], [[0, 1, 2, 3]])
