"""Streaming fragments of local_steps: one fragment per sync, each with its own outer state."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import comm, diloco_outer, hlo, local_steps, noloco_outer, replicas
from noloco_jax.optim import fragments as frag
from tests.helpers import step_fn

N, H, L = 4, 4, 4


@functools.partial(jax.jit, static_argnums=0)  # one compile per leading axis, not per op
def _params(num=None):
    lead = () if num is None else (num,)
    k = jax.random.split(jax.random.key(0), 3)
    return {
        "embedding": jax.random.normal(k[0], lead + (6, 2)),
        "blocks": {"w": jax.random.normal(k[1], lead + (L, 2, 2))},
        "lm_head": jax.random.normal(k[2], lead + (2, 6)),
    }


@jax.jit  # t is traced: one compile for every step
def _grads(t):
    return jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)), _params(N))


def _train(tx, steps, backend="vmap"):
    reps = replicas.make_replicas(N, backend=backend)
    params = reps.put(_params(N))
    state = reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)))
    history = []
    for t in range(steps):
        params, state = step(params, state, reps.put(_grads(t)))
        history.append(jax.tree.map(np.asarray, params))
    return params, state, history


def test_by_layer_blocks_spec_and_validation():
    spec = frag.by_layer_blocks(_params(), 2)
    assert spec == {"embedding": 0, "blocks": {"w": (0, 0, 1, 1)}, "lm_head": 1}
    assert frag.num_fragments(spec) == 2
    assert frag.check_spec(spec, _params(), 4) == 2
    with pytest.raises(ValueError, match="fragments=5 exceeds the model's 4 layers"):
        frag.by_layer_blocks(_params(), 5)
    with pytest.raises(ValueError, match="fragments: must be an integer >= 1"):
        frag.by_layer_blocks(_params(), 0)
    with pytest.raises(ValueError, match="sync_every=3 must be a multiple of the number of "):
        local_steps(optax.sgd(0.1), noloco_outer(), 3, fragments=spec)
    with pytest.raises(ValueError, match="contiguous"):
        frag.check_spec({**spec, "blocks": {"w": (0, 1, 0, 1)}}, _params(), 4)
    with pytest.raises(ValueError, match="hold no parameters"):
        frag.check_spec({**spec, "lm_head": 3}, _params(), 4)
    # Embedding (6 x 2) with rows 0-1 of the blocks (2 x 2 x 2), head (2 x 6) with rows 2-3.
    assert frag.fragment_sizes(spec, _params()) == [12 + 8, 8 + 12]
    assert frag.fragment_sizes(frag.by_layer_blocks(_params(), 4), _params()) == [16, 4, 4, 16]


def test_a_row_spec_on_a_scalar_leaf_is_a_value_error():
    """It read the scalar's shape[0] and died with an IndexError."""
    params = {"blocks": np.zeros((2, 3)), "scale": np.zeros(())}
    with pytest.raises(ValueError, match="scale: a scalar has no rows"):
        frag.check_spec({"blocks": (0, 1), "scale": (1,)}, params, 4)


def test_params_in_tuples_take_a_spec_shaped_like_them():
    """A tuple container of the params was read as one row spec: a spec (0, 1) for the params
    (w, b) was refused, and by_layer_blocks of tuple-held blocks crashed num_fragments."""
    params = (np.zeros((4, 3)), np.zeros(2))
    assert frag.check_spec((0, 1), params, 2) == 2
    blocks = {"blocks": (np.zeros((4, 3)), np.zeros((4, 2))), "head": np.zeros(2)}
    spec = frag.by_layer_blocks(blocks, 2)
    assert frag.num_fragments(spec) == 2 and frag.check_spec(spec, blocks, 2) == 2
    assert frag.fragment_sizes(spec, blocks) == [10, 12]
    with pytest.raises(ValueError, match="shaped like the params"):
        frag.check_spec((0, 1, 0), params, 2)


def test_take_and_put_round_trip():
    spec = frag.by_layer_blocks(_params(), 2)
    p = _params()
    part = frag.take(p, spec, 1)
    assert part["embedding"] is None and part["blocks"]["w"].shape == (2, 2, 2)
    back = frag.put(p, jax.tree.map(lambda x: x + 1, part), spec, 1)
    np.testing.assert_array_equal(back["blocks"]["w"][:2], p["blocks"]["w"][:2])
    np.testing.assert_array_equal(back["blocks"]["w"][2:], p["blocks"]["w"][2:] + 1)
    for bad in (2, -1, 1.5):  # take gave a tree of Nones, put the tree unchanged
        with pytest.raises(ValueError, match=r"^p: must be an integer in \[0, 1\]"):
            frag.take(p, spec, bad)
        with pytest.raises(ValueError, match=r"^p: must be an integer in \[0, 1\]"):
            frag.put(p, part, spec, bad)


def test_sync_fragment_schedule():
    due = [int(frag.sync_fragment(t, 8, 4)) for t in range(1, 17)]
    assert due == [-1, 0, -1, 1, -1, 2, -1, 3] * 2


@pytest.mark.parametrize("sync_every, p_count, message", [
    (8, 0, r"^p_count: must be an integer >= 1, got 0"),
    (8, -2, r"^p_count: must be an integer >= 1, got -2"),
    (8, 3, r"^sync_every=8 must be a multiple of the number of fragments p_count=3"),
    (0, 1, r"^sync_every: must be an integer >= 1, got 0"),
])
def test_sync_fragment_refuses_a_count_outside_its_range(sync_every, p_count, message):
    """p_count=0 or sync_every=0 stopped in a ZeroDivisionError; p_count=-2 or 3 (with H=8)
    gave a wrong schedule without a word."""
    with pytest.raises(ValueError, match=message):
        frag.sync_fragment(4, sync_every, p_count)


@pytest.mark.parametrize("outer", [noloco_outer(seed=2), diloco_outer()])
def test_one_fragment_is_todays_update(outer):
    tx0 = local_steps(optax.adam(0.05), outer, H)
    tx1 = local_steps(optax.adam(0.05), outer, H, fragments=frag.by_layer_blocks(_params(), 1))
    *_, a = _train(tx0, 2 * H)
    *_, b = _train(tx1, 2 * H)
    for x, y in zip(jax.tree.leaves(a[-1]), jax.tree.leaves(b[-1])):
        np.testing.assert_array_equal(x, y)


def _numpy_streaming(num_frags, steps, lr_in, beta, alpha, seed):
    """SGD inner steps; fragment p syncs when t % H == (p + 1) H / P with its own momentum,
    round counter and group stream; g = phi - mean_G theta (gamma = beta)."""
    spec = frag.by_layer_blocks(_params(), num_frags)
    theta = jax.tree.map(lambda x: np.asarray(x, np.float64), _params(N))
    phi = jax.tree.map(np.copy, theta)
    trace = [jax.tree.map(np.zeros_like, theta) for _ in range(num_frags)]
    rounds = [0] * num_frags
    stride = H // num_frags
    out = []
    for t in range(1, steps + 1):
        g = jax.tree.map(lambda x: np.asarray(x, np.float64), _grads(t - 1))
        theta = jax.tree.map(lambda x, d: x - lr_in * d, theta, g)
        if t % stride == 0:
            p = (t // stride - 1) % num_frags
            groups = comm.groups_for_round(rounds[p], N, 2, seed,
                                           stream=None if num_frags == 1 else p)  # fmt: skip
            partner = {int(a): int(b) for a, b in groups}
            partner.update({b: a for a, b in partner.items()})

            def move(ph, th, tr, s):
                rows = frag._rows(s, p)  # noqa: SLF001
                if rows is None:
                    return ph, th, tr
                sl = slice(None) if rows == "all" else slice(rows[0], rows[1])
                ph, th, tr = ph.copy(), th.copy(), tr.copy()
                mean = (th[:, sl] + th[[partner[i] for i in range(N)], sl]) / 2
                grad = ph[:, sl] - mean
                tr[:, sl] = alpha * tr[:, sl] + grad
                ph[:, sl] = ph[:, sl] - beta * tr[:, sl]
                th[:, sl] = ph[:, sl]
                return ph, th, tr

            leaves = [move(a, b, c, s) for a, b, c, s in zip(
                jax.tree.leaves(phi), jax.tree.leaves(theta), jax.tree.leaves(trace[p]),
                jax.tree.leaves(spec, is_leaf=lambda v: isinstance(v, tuple)))]  # fmt: skip
            treedef = jax.tree.structure(phi)
            phi = jax.tree.unflatten(treedef, [x[0] for x in leaves])
            theta = jax.tree.unflatten(treedef, [x[1] for x in leaves])
            trace[p] = jax.tree.unflatten(treedef, [x[2] for x in leaves])
            rounds[p] += 1
        out.append(theta)
    return out


@pytest.mark.parametrize("num_frags", [2, 4])
def test_fragments_match_a_numpy_reference(num_frags):
    spec = frag.by_layer_blocks(_params(), num_frags)
    tx = local_steps(optax.sgd(0.1), noloco_outer(learning_rate=0.7, momentum=0.5, seed=3), H,
                     fragments=spec)  # fmt: skip
    _, state, got = _train(tx, 3 * H)
    want = _numpy_streaming(num_frags, 3 * H, 0.1, 0.7, 0.5, 3)
    for t, (g, w) in enumerate(zip(got, want)):
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"step {t + 1}")
    assert [int(o.round) for o in state.outer_state] == [3] * num_frags


def test_fragment_syncs_must_end_accumulations():
    """With P fragments a sync comes every H / P steps: H = 4, P = 2 and MultiSteps k = 4 were
    accepted, and fragment 0 synced at step 2, inside the accumulation of steps 1..4."""
    spec = frag.by_layer_blocks(_params(), 2)
    acc = lambda k: optax.MultiSteps(optax.sgd(0.1), k).gradient_transformation()  # noqa: E731
    with pytest.raises(ValueError, match=r"sync_every / fragments = 4 / 2 = 2 must be a "
                                         r"multiple of the MultiSteps accumulation count k=4"):
        local_steps(acc(4), noloco_outer(), H, fragments=spec)
    _, state, _ = _train(local_steps(acc(2), noloco_outer(), H, fragments=spec), 2 * H)
    assert [int(o.round) for o in state.outer_state] == [2, 2]


def test_each_sync_step_sends_only_its_fragment():
    spec = frag.by_layer_blocks(_params(), 2)
    tx = local_steps(optax.sgd(0.1), noloco_outer(), H, fragments=spec)
    reps = replicas.make_replicas(N, backend="shard_map")
    params = reps.put(_params(N))
    state = reps.init(tx, params)
    single = _params()
    for p in range(2):
        f = jax.jit(reps.map(lambda g, s, q, p=p: tx.update(g, s, q, sync_step=p)))
        per_branch = hlo.bytes_by_computation(hlo.compiled_text(f, params, state, params),
                                              "collective-permute")  # fmt: skip
        part = frag.take(single, spec, p)
        want = comm.noloco_bytes_per_sync(part)
        assert set(per_branch.values()) == {want}, (p, per_branch, want)
    full = comm.noloco_bytes_per_sync(single)
    halves = [comm.noloco_bytes_per_sync(frag.take(single, spec, p)) for p in range(2)]
    assert sum(halves) == full and max(halves) < full


def test_static_phase_with_fragments_equals_the_on_device_phase():
    spec = frag.by_layer_blocks(_params(), 2)
    tx = local_steps(optax.adam(0.05), noloco_outer(seed=1), H, fragments=spec)
    reps = replicas.make_replicas(N, backend="vmap")
    p1 = p2 = _params(N)
    s1 = s2 = reps.init(tx, p1)
    dyn = jax.jit(reps.map(step_fn(tx)))
    def static(k):
        def f(q, s, g):
            u, s = tx.update(g, s, q, sync_step=k)
            return optax.apply_updates(q, u), s

        return jax.jit(reps.map(f))

    stat = [static(False), static(0), static(1)]  # not a dict: False == 0 as a key
    for t in range(2 * H):
        due = int(frag.sync_fragment(t + 1, H, 2))
        p1, s1 = dyn(p1, s1, _grads(t))
        p2, s2 = stat[due + 1](p2, s2, _grads(t))
    for x, y in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    assert int(s2.phase_errors) == 0
    with pytest.raises(ValueError, match="the index \\(0..1\\) of the fragment"):
        tx.update(_params(), tx.init(_params()), _params(), sync_step=True)


def test_guard_with_fragments_keeps_the_caught_fragment_state():
    spec = frag.by_layer_blocks(_params(), 2)
    tx = local_steps(optax.adam(0.05), noloco_outer(seed=1), H, fragments=spec,
                     nonfinite_guard=True)  # fmt: skip
    reps = replicas.make_replicas(N, backend="vmap")
    params = _params(N)
    state = reps.init(tx, params)
    step = jax.jit(reps.map(step_fn(tx)))
    for t in range(H):  # both fragments sync once
        params, state = step(params, state, _grads(t))
    before = jax.tree.map(np.asarray, state.outer_state[0].sgd_state[0].trace)
    bad = jax.tree.map(np.array, _grads(H))  # replica 1's gradient NaN, set on the host
    for x in jax.tree.leaves(bad):
        x[1] = np.nan
    params, state = step(params, state, bad)  # step H+1: inner
    params, state = step(params, state, _grads(H + 1))  # step H+2: fragment 0 syncs
    after = jax.tree.map(np.asarray, state.outer_state[0].sgd_state[0].trace)
    np.testing.assert_array_equal(after["blocks"]["w"][1], before["blocks"]["w"][1])  # kept
    assert not np.array_equal(after["blocks"]["w"][0], before["blocks"]["w"][0])
    assert np.asarray(state.nonfinite_resets).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert np.asarray(state.local_opt_state[0].count).tolist() == [H + 2, 0, H + 2, H + 2]


@pytest.mark.parametrize("fragments, delay, want", [
    # 40 float32 params = 160 bytes; fragments of 20 each (80 bytes); H = 4, pairs, gamma = beta.
    (1, 0, {1: 0, 3: 0, 4: 160, 7: 160, 8: 320}),
    (2, 0, {1: 0, 2: 80, 3: 80, 4: 160, 6: 240, 8: 320}),  # was 0 at step 2, 160 at 6
    (1, 1, {2: 0, 3: 160, 7: 320}),  # an overlapped exchange is sent tau steps before it lands
    (2, 1, {1: 80, 2: 80, 3: 160, 5: 240}),
])  # fmt: skip
def test_the_bytes_a_replica_has_sent_count_every_fragment_exchange(fragments, delay, want):
    from noloco_jax.trainer import optimizer as optim_lib  # noqa: PLC0415
    from noloco_jax.trainer.settings import FaultSettings, OuterSettings  # noqa: PLC0415

    params = jax.eval_shape(_params)
    assert frag.fragment_sizes(frag.by_layer_blocks(params, 2), params) == [20, 20]
    outer = OuterSettings(sync_every=4, fragments=fragments, delay=delay)
    got = {t: optim_lib.bytes_sent("noloco", outer, params, num_replicas=4, steps=t,
                                   fault=FaultSettings(nonfinite_guard=False))
           for t in want}  # fmt: skip
    assert got == want
