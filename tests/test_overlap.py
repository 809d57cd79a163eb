"""The overlapped exchange of local_steps (``delay=tau``): an exchange starts tau steps before
its round ends and is merged when the round ends, theta <- phi_new + m (theta_t - theta_s)."""

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import (comm, diloco_outer, hlo, local_steps, models, noloco_outer, replicas,
                        restore_nonfinite)
from noloco_jax.optim import fragments as frag
from noloco_jax.optim.local_steps import check_delay
from noloco_jax.trainer import build, grads, loop
from noloco_jax.trainer.loop import train_and_evaluate
from noloco_jax.trainer.step import TrainState, make_window_program, train_step
from noloco_jax.trainer.writers import read_jsonl
from tests.helpers import assert_trees_close, random_tree
from tests.test_train import tiny_settings

N, H, LR = 4, 4, 0.1
CURVATURE = {"w": np.linspace(1.0, 0.2, 6).reshape(3, 2), "b": np.linspace(0.5, 1.5, 5)}


def _targets(t):
    """Each replica's target at step t (0-based): the toy loss is 1/2 sum A (theta - c_t)^2."""
    return jax.tree.map(np.asarray, random_tree(jax.random.key(1000 + t), N))


def _step(tx):
    def step(params, state, c, **phase):
        grads = jax.tree.map(lambda a, p, ci: a * (p - ci), CURVATURE, params, c)
        updates, state = tx.update(grads, state, params, **phase)
        return optax.apply_updates(params, updates), state

    return step


def _train(tx, steps, backend="vmap"):
    reps = replicas.make_replicas(N, backend=backend)
    params = reps.put(random_tree(jax.random.key(0), N))
    state = reps.init(tx, params)
    step = jax.jit(reps.map(_step(tx)))
    history = []
    for t in range(steps):
        params, state = step(params, state, reps.put(_targets(t)))
        history.append(jax.tree.map(np.asarray, params))
    return state, history


def _outer_numpy(kind, phi, theta, trace, rnd, gamma_over_beta, beta, alpha, seed):
    """One outer step of every replica (leaves [N, ...], float64); returns phi_new, trace."""
    if kind == "diloco":
        g = (phi - theta).mean(0, keepdims=True)
    else:
        partner = {}
        for a, b in comm.groups_for_round(rnd, N, 2, seed):
            partner[int(a)], partner[int(b)] = int(b), int(a)
        other = [partner[i] for i in range(N)]
        theta_bar = (theta + theta[other]) / 2
        phi_bar = (phi + phi[other]) / 2
        g = phi - theta_bar + (gamma_over_beta - 1.0) * (phi - phi_bar)
    trace = alpha * trace + g
    return phi - beta * trace, trace


def _reference(kind, steps, delay, mixing, *, beta=0.7, alpha=0.5, gamma=None, seed=3):
    """NumPy: SGD inner steps on the toy loss; exchanges at t = kH - delay, merges at t = kH."""
    ratio = 1.0 if gamma is None else gamma / beta
    theta = jax.tree.map(lambda x: np.asarray(x, np.float64), random_tree(jax.random.key(0), N))
    phi = jax.tree.map(np.copy, theta)
    trace = jax.tree.map(np.zeros_like, theta)
    pending, anchor, rnd, out = None, None, 0, []
    for t in range(1, steps + 1):
        c = _targets(t - 1)
        theta = jax.tree.map(lambda x, a, ci: x - LR * a * (x - ci), theta, CURVATURE, c)
        if (t + delay) % H == 0:  # the exchange starts from theta_s and phi
            new = {k: _outer_numpy(kind, phi[k], theta[k], trace[k], rnd, ratio, beta, alpha,
                                   seed) for k in theta}  # fmt: skip
            pending = {k: v[0] for k, v in new.items()}
            trace = {k: v[1] for k, v in new.items()}
            anchor, rnd = jax.tree.map(np.copy, theta), rnd + 1
        if t % H == 0:  # the merge
            phi = pending
            theta = jax.tree.map(lambda p, x, a: p + mixing * (x - a), phi, theta, anchor)
        out.append(theta)
    return out


OUTERS = {
    "noloco": (lambda: noloco_outer(learning_rate=0.7, momentum=0.5, seed=3), {}),
    "noloco_gamma": (lambda: noloco_outer(learning_rate=0.7, momentum=0.5, gamma=0.3, seed=3),
                     {"gamma": 0.3}),
    "diloco": (lambda: diloco_outer(learning_rate=0.7, momentum=0.5), {}),
}


REFERENCE_CASES = [(name, delay, mixing) for name in sorted(OUTERS)
                   for delay, mixing in [(2, 1.0), (1, 0.5), (3, 0.0)]]  # fmt: skip
FAST = {("diloco", 3, 0.0), ("noloco", 2, 1.0), ("noloco_gamma", 1, 0.5)}


@pytest.mark.parametrize("name,delay,mixing", [
    c if c in FAST else pytest.param(*c, marks=pytest.mark.slow) for c in REFERENCE_CASES])
def test_delay_matches_a_numpy_reference(name, delay, mixing):
    make, kwargs = OUTERS[name]
    kind = "diloco" if name == "diloco" else "noloco"
    steps = 3 * H + H - delay  # three merged rounds and an exchange still pending at the end
    tx = local_steps(optax.sgd(LR), make(), H, delay=delay, mixing=mixing)
    state, got = _train(tx, steps)
    want = _reference(kind, steps, delay, mixing, **kwargs)
    for t, (g, w) in enumerate(zip(got, want)):
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(w)):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-5, err_msg=f"step {t + 1}")
    assert int(state.outer_state.round) == 4  # the fourth exchange is pending in the state
    np.testing.assert_allclose(state.anchor["w"], got[-1]["w"], rtol=0, atol=0)


def test_without_the_merge_the_reference_would_differ():
    # The reference is sensitive: a merge with another m, or none, is far from it.
    want = _reference("noloco", 3 * H, 2, 1.0)[-1]["w"]
    other = _reference("noloco", 3 * H, 2, 0.0)[-1]["w"]
    assert np.abs(want - other).max() > 1e-2


@pytest.fixture(scope="module")
def today():
    """(state, params after each step) of 2H + 1 steps of local_steps without a delay argument
    (today's update), trained once and only read."""
    return _train(local_steps(optax.adam(0.05), noloco_outer(seed=2), H), 2 * H + 1)


@pytest.mark.parametrize("mixing", [0.0, 0.3, 1.0])
def test_no_delay_is_todays_update_bit_for_bit(mixing, today):
    zero = local_steps(optax.adam(0.05), noloco_outer(seed=2), H, delay=0, mixing=mixing)
    sa, a = today
    sb, b = _train(zero, 2 * H + 1)
    assert sb.anchor is None
    for x, y in zip(jax.tree.leaves((a, sa)), jax.tree.leaves((b, sb))):
        np.testing.assert_array_equal(x, y)


def test_static_phases_equal_the_on_device_phase_and_bad_flags_are_counted():
    tx = local_steps(optax.adam(0.05), noloco_outer(seed=1), H, delay=2, mixing=0.5)
    reps = replicas.make_replicas(N, backend="vmap")
    p1 = p2 = reps.put(random_tree(jax.random.key(0), N))
    s1 = s2 = reps.init(tx, p1)
    dyn = jax.jit(reps.map(_step(tx)))
    stat = {(a, b): jax.jit(reps.map(lambda p, s, c, a=a, b=b: _step(tx)(
        p, s, c, sync_step=a, merge_step=b))) for a, b in [(False, False), (True, False), (False, True)]}
    for t in range(2 * H + 1):
        count = t + 1
        phase = ((count + 2) % H == 0, count % H == 0)
        p1, s1 = dyn(p1, s1, _targets(t))
        p2, s2 = stat[phase](p2, s2, _targets(t))
    for x, y in zip(jax.tree.leaves((p1, s1)), jax.tree.leaves((p2, s2))):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)
    assert int(s2.phase_errors) == 0
    _, s3 = stat[(False, False)](p2, s2, _targets(9))  # step 10 starts an exchange: skipped
    assert int(s3.phase_errors) == 1


def test_fragments_with_delay_match_a_per_fragment_reference():
    # Two fragments ("w" and "b"), each exchanging `delay` steps before its own round ends.
    spec = {"w": 0, "b": 1}
    delay, mixing = 1, 0.5
    tx = local_steps(optax.sgd(LR), noloco_outer(seed=3), H, fragments=spec, delay=delay,
                     mixing=mixing)  # fmt: skip
    _, got = _train(tx, 3 * H)
    theta = jax.tree.map(lambda x: np.asarray(x, np.float64), random_tree(jax.random.key(0), N))
    phi = jax.tree.map(np.copy, theta)
    trace, pending, anchor, rnd = jax.tree.map(np.zeros_like, theta), {}, {}, {"w": 0, "b": 0}
    stride = H // 2
    for t in range(1, 3 * H + 1):
        theta = jax.tree.map(lambda x, a, ci: x - LR * a * (x - ci), theta, CURVATURE,
                             _targets(t - 1))  # fmt: skip
        for k, p in spec.items():
            if (t + delay) % stride == 0 and ((t + delay) // stride - 1) % 2 == p:
                partner = {}
                groups = comm.groups_for_round(rnd[k], N, 2, 3, stream=p)
                for a, b in groups:
                    partner[int(a)], partner[int(b)] = int(b), int(a)
                other = [partner[i] for i in range(N)]
                g = phi[k] - (theta[k] + theta[k][other]) / 2
                trace[k] = 0.5 * trace[k] + g
                pending[k], anchor[k] = phi[k] - 0.7 * trace[k], theta[k].copy()
                rnd[k] += 1
            if t % stride == 0 and (t // stride - 1) % 2 == p:
                phi[k] = pending[k]
                theta[k] = phi[k] + mixing * (theta[k] - anchor[k])
        for key in spec:
            np.testing.assert_allclose(got[t - 1][key], theta[key], rtol=1e-5, atol=1e-5,
                                       err_msg=f"step {t}, {key}")  # fmt: skip


def test_guard_caught_replica_lands_on_its_slow_weights_and_anchors_there():
    tx = local_steps(optax.sgd(LR), noloco_outer(seed=1), H, delay=1, nonfinite_guard=True)
    reps = replicas.make_replicas(N, backend="vmap")
    params = random_tree(jax.random.key(0), N)
    state = reps.init(tx, params)
    step = jax.jit(reps.map(_step(tx)))
    for t in range(H - 2):
        params, state = step(params, state, _targets(t))
    bad = jax.tree.map(lambda x: jnp.asarray(x).at[2].set(jnp.nan), _targets(H - 2))
    params, state = step(params, state, bad)  # step H - 1 starts the exchange: replica 2 is NaN
    assert np.asarray(state.nonfinite_resets).tolist() == [0.0, 0.0, 1.0, 0.0]
    slow = state.slow_params
    np.testing.assert_array_equal(state.anchor["w"][2], slow["w"][2])  # anchored on phi
    assert np.isfinite(state.anchor["w"]).all()
    repaired = jax.tree.map(lambda p, s: p.at[2].set(s[2]), params, slow)  # restore_nonfinite
    params, state = step(repaired, state, _targets(H - 1))  # the merge: all finite again
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(params))


def test_a_replica_broken_inside_the_window_is_caught_at_the_merge():
    """The guard looked only at the exchange: a replica that broke inside the window landed
    non-finite at the merge and stayed so (its evals too) until the next round's exchange."""
    tx = local_steps(optax.sgd(LR), noloco_outer(seed=1), H, delay=2, nonfinite_guard=True)
    reps = replicas.make_replicas(N, backend="vmap")
    step, restore = jax.jit(reps.map(_step(tx))), jax.jit(reps.map(restore_nonfinite))

    def run(broken):
        params = random_tree(jax.random.key(0), N)
        state = reps.init(tx, params)
        for t in range(H):  # t = 1 starts the exchange, t = 3 (H - 1) merges it
            c = _targets(t)
            if broken and t == 2:  # inside the window
                c = jax.tree.map(lambda x: jnp.asarray(x).at[2].set(jnp.nan), c)
            params, state = step(params, state, c)
        return restore(params, state), state

    clean, _ = run(False)
    params, state = run(True)
    assert np.asarray(state.nonfinite_resets).tolist() == [0.0, 0.0, 1.0, 0.0]
    for key in ("w", "b"):
        np.testing.assert_array_equal(params[key][2], state.slow_params[key][2])  # phi_new
        for i in (0, 1, 3):  # the exchange came before the break: the others are untouched
            np.testing.assert_array_equal(params[key][i], clean[key][i])


@pytest.mark.parametrize("kwargs,match", [
    (dict(delay=4), r"delay: must be an integer in \[0, 3\] .*sync_every=4 steps later\), got 4"),
    (dict(delay=-1), r"delay: must be an integer >= 0, got -1"),
    (dict(delay=1.5), r"delay: must be an integer >= 0, got 1.5"),
    (dict(delay=2, fragments={"w": 0, "b": 1}),
     r"delay: must be an integer in \[0, 1\] .*sync_every / fragments = 4 / 2 = 2"),
    (dict(mixing=1.5), r"mixing: must be in \[0, 1\], got 1.5"),
    (dict(mixing=-0.1), r"mixing: must be in \[0, 1\], got -0.1"),
])  # fmt: skip
def test_bad_delay_and_mixing_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        local_steps(optax.sgd(0.1), noloco_outer(), H, **kwargs)


@pytest.mark.parametrize("args,match", [((1, 4, 0), "fragments: must be an integer >= 1"),
                                        ((0, 2.0, 1), "sync_every: must be an integer >= 1"),
                                        ((0, 4, 2.0), "fragments: must be an integer >= 1")])
def test_check_delay_refuses_a_bad_period(args, match):
    """check_delay (public: the settings use it) divided by num_fragments before checking it:
    a ZeroDivisionError for 0 fragments, and a float H or P was taken."""
    with pytest.raises(ValueError, match=match):
        check_delay(*args)


def test_bad_phase_flags_are_refused():
    p = jnp.zeros(3)
    delayed = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), H, delay=1)
    plain = local_steps(optax.sgd(0.1), noloco_outer(axis_name=None), H)
    with pytest.raises(ValueError, match="give both sync_step .* and merge_step"):
        delayed.update(p, delayed.init(p), p, sync_step=False)
    with pytest.raises(ValueError, match="no step both starts an exchange and merges one"):
        delayed.update(p, delayed.init(p), p, sync_step=True, merge_step=True)
    with pytest.raises(ValueError, match="merge_step must be None, True or False, got 2"):
        delayed.update(p, delayed.init(p), p, sync_step=False, merge_step=2)
    with pytest.raises(ValueError, match="merge_step needs delay > 0"):
        plain.update(p, plain.init(p), p, sync_step=False, merge_step=False)


# ------------------------------------------------------------------ the trainer's programs

CFG = models.get_preset("nano", vocab_size=64, max_seq_len=16, hidden_size=16, num_heads=2,
                         num_layers=1, mlp_hidden_size=32)  # fmt: skip


def _toy_params():
    """Shaped like the model's (a stacked "blocks" leaf), so fragments split it by layer."""
    k = jax.random.split(jax.random.key(0), 3)
    return {"embedding": jax.random.normal(k[0], (6, 2)),
            "blocks": {"w": jax.random.normal(k[1], (2, 2, 2))},
            "lm_head": jax.random.normal(k[2], (2, 6))}  # fmt: skip


def _toy_grads(params, tokens, step):
    """A cheap stand-in for the model: a loss whose gradients depend on params and batch."""
    del step
    target = jnp.mean(tokens.astype(jnp.float32)) / 32.0

    def loss(p):
        return sum(jnp.sum(jnp.sin(x) * (x - target) ** 2) for x in jax.tree.leaves(p))

    return jax.value_and_grad(loss)(params)


def _setup(tx, n, model):
    """(grads_fn, replicated state) for the toy or the nano model."""
    if model == "toy":
        params, grads_fn = _toy_params(), _toy_grads
    else:
        graphdef, params = models.init_params(CFG, 0)
        grads_fn = grads.plain(graphdef)
    single = TrainState(jnp.zeros([], jnp.int32), params, tx.init(params))
    return grads_fn, replicas.replicate(single, n)


def _batch(n, t):
    return np.random.default_rng(t).integers(0, CFG.vocab_size, (n, 1, 2, 9)).astype(np.int32)


@pytest.mark.parametrize("outer,kind,model", [
    (noloco_outer, "collective-permute", "toy"),
    (diloco_outer, "all-reduce", "toy"),
    pytest.param(noloco_outer, "collective-permute", "nano", marks=pytest.mark.slow)])  # fmt: skip
def test_window_program_exchanges_while_the_delay_steps_compute(outer, kind, model):
    """From the compiled HLO of the sync program (exchange, tau steps, merge as one program):
    the collective's operands need only the exchange step's batch, and nothing that the tau
    inner steps compute (losses, gradients, Adam moments) uses its result; the merged
    weights do. On CPU the collective is synchronous; on GPU/TPU XLA splits it into an
    async start/done pair that can then run around the tau steps (not measured here)."""
    n, tau = 4, 2
    tx = local_steps(optax.adam(1e-2), outer(), 4, delay=tau)
    reps = replicas.make_replicas(n, backend="shard_map")  # real collectives in the HLO
    grads_fn, state = _setup(tx, n, model)
    state = reps.put(state)
    program = make_window_program(reps, delay=tau, grads_fn=grads_fn, tx=tx, donate=False)
    tokens = tuple(reps.put(_batch(n, t)) for t in range(tau + 1))
    graph = hlo.entry_graph(hlo.compiled_text(program, state, tokens))
    (holder,) = graph.holders[kind]  # one exchange per window
    before = graph.ancestors(holder)
    assert graph.params["args[1][0]"] in before  # the exchange step's batch (theta_s)
    for k in range(1, tau + 1):
        assert graph.params[f"args[1][{k}]"] not in before, k  # not the delay steps' batches
    after = graph.descendants(holder)
    paths = [jax.tree_util.keystr(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(jax.eval_shape(program, state, tokens))[0]]
    uses = {path: out in after for path, out in zip(paths, graph.outputs, strict=True)}
    assert not uses["[1]"]  # the tau steps' losses never see the exchange's result
    moments = [p for p in uses if "local_opt_state" in p and (".mu" in p or ".nu" in p)]
    assert moments and not any(uses[p] for p in moments)  # nor do their gradients
    weights = [p for p in uses if p.startswith("[0].params")]
    assert weights and all(uses[p] for p in weights)  # the merge consumes it
    late = graph.params[f"args[1][{tau}]"]
    assert all(late in graph.ancestors(graph.outputs[paths.index(p)]) for p in weights)


@pytest.mark.parametrize("num_frags,h,delay,log_every,start,model", [
    (1, 4, 2, 4, 0, "toy"), (1, 8, 3, 8, 4, "toy"), (1, 8, 3, 8, 2, "toy"), (2, 8, 1, 4, 4, "toy"),
    pytest.param(1, 4, 2, 4, 0, "nano", marks=pytest.mark.slow)])  # fmt: skip
def test_loop_windows_equal_the_on_device_phase(num_frags, h, delay, log_every, start, model):
    """The trainer's blocks (inner program, window programs) = one step at a time with the
    phase decided on the device, from any chunk boundary (a resume) on."""
    n, steps = 2, 2 * h
    spec = frag.by_layer_blocks(_toy_params(), num_frags) if num_frags > 1 else None
    tx = local_steps(optax.adam(1e-2), noloco_outer(), h, fragments=spec, delay=delay)
    grads_fn, b = _setup(tx, n, model)
    reps = replicas.make_replicas(n, backend="vmap")
    kwargs = dict(grads_fn=grads_fn, tx=tx)
    inner, sync = build.make_programs(reps, kwargs, rounds=True, fragments=spec is not None,
                                 delay=delay, num_fragments=num_frags)  # fmt: skip
    data = types.SimpleNamespace(batcher=types.SimpleNamespace(batch=lambda t: _batch(n, t)[:, 0]))
    period = h // num_frags
    run = types.SimpleNamespace(inner=inner, sync=sync, block=np.gcd(log_every, period),
                                period=period, reps=reps, data=data, calls=set(), delay=delay)
    dynamic = jax.jit(reps.map(functools.partial(train_step, **kwargs)))
    for t in range(start):
        b, _ = dynamic(b, jnp.asarray(_batch(n, t)[:, 0]))
    a, step = jax.tree.map(jnp.copy, b), start
    while step < start + steps:
        k = min(log_every - step % log_every, start + steps - step)
        a, loss_a = loop._run_blocks(run, a, step, k)
        loss_b = []
        for t in range(step, step + k):
            b, loss = dynamic(b, jnp.asarray(_batch(n, t)[:, 0]))
            loss_b.append(loss)
        np.testing.assert_allclose(loss_a, np.stack(loss_b, 1), rtol=1e-5)
        assert_trees_close(a, b, rtol=1e-5, atol=1e-6)
        step += k
    assert int(a.opt_state.phase_errors) == 0
    # Two kinds of program: a window per fragment, each compiled once, and the inner steps once
    # per block length (none at all when the window fills the round).
    lengths = {size for name, size in run.calls if name == "inner"}
    assert inner._cache_size() == len(lengths) and (lengths != set()) == (delay + 1 < period)
    assert all(w._cache_size() == 1 for w in sync)
    assert {key for name, key in run.calls if name == "sync"} == set(range(num_frags))  # the bar
    inside = (step // period + 1) * period - 1  # one step before the next window's merge
    with pytest.raises(ValueError, match="cut the overlap window"):
        loop._run_blocks(run, a, step, inside - step)  # a chunk that would end there


# ------------------------------------------------------------------ a tiny trainer run

@pytest.mark.slow  # about a minute on 2 busy cores; the loop itself is tested above
def test_tiny_trainer_run_with_delay_is_finite(tmp_path, corpus_dir, data_dir):
    s = tiny_settings(corpus_dir, data_dir, num_replicas=2, global_batch_size=4, num_steps=8,
                      log_every=4, eval_every=8, checkpoint_every=8,
                      outer={"sync_every": 4, "delay": 2, "mixing": 1.0})  # fmt: skip
    last = train_and_evaluate(s, tmp_path, progress=False)
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    losses = [x for r in train for x in r["train_loss_per_replica"]]
    assert last["step"] == 8 and len(train) == 2 and np.isfinite(losses).all()
    assert np.isfinite(last["val_ppl"])
    with pytest.raises(ValueError, match="stop_at=6 ends inside an overlap window"):
        train_and_evaluate(s, tmp_path / "other", stop_at=6, progress=False)


@pytest.mark.slow  # a minute on 2 busy cores; test_a_replica_broken_inside_the_window_... above
def test_trainer_repairs_a_replica_broken_inside_the_window_at_the_merge(tmp_path, corpus_dir,
                                                                          data_dir):  # fmt: skip
    """Replica 1 breaks at step index 2, inside the window of the round ending at step 4 (its
    exchange started at index 1). It stayed NaN through the merge: the eval at step 4 was NaN,
    and the next exchange (index 5) caught it."""
    s = tiny_settings(corpus_dir, data_dir, num_replicas=2, global_batch_size=4, num_steps=8,
                      log_every=4, eval_every=4, checkpoint_every=8,
                      outer={"sync_every": 4, "delay": 2},
                      fault={"inject_nan_step": 2, "inject_nan_replica": 1})  # fmt: skip
    train_and_evaluate(s, tmp_path, progress=False)
    evals = read_jsonl(tmp_path / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [0, 4, 8]
    assert all(np.isfinite(r["val_ppl_worst_replica"]) for r in evals)
    events = read_jsonl(tmp_path / "metrics.jsonl", "event")
    assert [(e["event"], e["step"], e["total"]) for e in events] == [("nonfinite_reset", 4, 1)]


@pytest.mark.parametrize("overrides,match", [
    (dict(outer={"sync_every": 4, "delay": 4}),
     r"config.outer.delay: must be an integer in \[0, 3\]"),
    (dict(outer={"sync_every": 4, "delay": -1}), r"config.outer.delay: must be an integer >= 0"),
    (dict(outer={"sync_every": 4, "mixing": 1.5}), r"config.outer.mixing: must be in \[0, 1\]"),
    (dict(log_every=2, outer={"sync_every": 4, "delay": 2}),
     r"config.log_every: 2 would end chunks .* gcd\(log_every, 4\) = 2 must be > 2"),
    (dict(num_steps=11, log_every=4, eval_every=4, checkpoint_every=4,
          outer={"sync_every": 4, "delay": 2}),
     r"config.num_steps=11 ends inside an overlap window: .* e.g. 9 or 12"),
    (dict(method="dp", outer={"delay": 1}), r"config.outer.delay: the overlapped exchange needs"),
])  # fmt: skip
def test_bad_trainer_delay_settings_are_refused(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        tiny_settings(tmp_path, tmp_path, **overrides)
