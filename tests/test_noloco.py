"""noloco_outer against an independent NumPy implementation, and its reductions."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from noloco_jax import diloco_outer, groups_for_round, noloco_outer, replicas
from tests.helpers import assert_trees_close, random_tree


def numpy_noloco(phi0, thetas, *, alpha, beta, gamma, n, seed):
    """The paper's Eq. 1-3 (sign as in App. A.2 / reference code), leaf by leaf.

    phi0: dict of [N, ...] arrays; thetas: list (one per round) of such dicts.
    """
    phi = {k: np.array(v, np.float64) for k, v in phi0.items()}
    delta = {k: np.zeros_like(v) for k, v in phi.items()}
    for r, theta in enumerate(thetas):
        groups = groups_for_round(r, len(next(iter(phi.values()))), n, seed)
        for k in phi:
            th = np.asarray(theta[k], np.float64)
            new_delta = np.empty_like(delta[k])
            for g in groups:
                mean_dtheta = (th[g] - phi[k][g]).mean(axis=0)
                mean_phi = phi[k][g].mean(axis=0)
                for i in g:
                    new_delta[i] = (
                        alpha * delta[k][i] + beta * mean_dtheta - gamma * (phi[k][i] - mean_phi)
                    )
            delta[k] = new_delta
            phi[k] = phi[k] + delta[k]
    return phi


def run_outer(tx, phi0, thetas, num_replicas, backend="vmap"):
    """Applies ``tx`` once per round with the given fast weights; returns phi."""
    reps = replicas.make_replicas(num_replicas, backend=backend)
    single = jax.tree.map(lambda x: x[0], phi0)
    state = reps.put(replicas.replicate(tx.init(single), num_replicas))

    def outer_step(phi, state, theta):
        outer_grad = jax.tree.map(lambda p, t: p - t, phi, theta)
        delta, state = tx.update(outer_grad, state, phi)
        return optax.apply_updates(phi, delta), state

    step = jax.jit(reps.map(outer_step))
    phi = reps.put(phi0)
    for theta in thetas:
        phi, state = step(phi, state, reps.put(theta))
    return phi, state


def _rounds(num_replicas, num_rounds, seed=0):
    key = jax.random.key(seed)
    phi0 = random_tree(jax.random.fold_in(key, 999), num_replicas)
    thetas = [  # phi0 + 0.1 * d on the host (numpy): no compile per replica count
        jax.tree.map(
            lambda p, d: np.asarray(p) + np.float32(0.1) * np.asarray(d),
            phi0, random_tree(jax.random.fold_in(key, r), num_replicas),
        )
        for r in range(num_rounds)
    ]  # fmt: skip
    return phi0, thetas


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("gamma", [None, 0.35, 1.2])
def test_matches_independent_numpy_implementation(n, gamma):
    num_replicas, alpha, beta, seed = 8, 0.5, 0.7, 11
    phi0, thetas = _rounds(num_replicas, num_rounds=5)
    tx = noloco_outer(learning_rate=beta, momentum=alpha, gamma=gamma, group_size=n, seed=seed)
    phi, state = run_outer(tx, phi0, thetas, num_replicas)
    expected = numpy_noloco(
        phi0, thetas, alpha=alpha, beta=beta, gamma=beta if gamma is None else gamma, n=n, seed=seed
    )
    assert_trees_close(phi, expected, rtol=1e-5, atol=1e-5)
    assert int(state.round) == 5


def test_group_of_all_replicas_is_diloco():
    # DiLoCo keeps one phi shared by all replicas; start NoLoCo from that too.
    num_replicas = 8
    _, thetas = _rounds(num_replicas, num_rounds=4, seed=1)
    phi0 = replicas.replicate(random_tree(jax.random.key(7)), num_replicas)
    nl = noloco_outer(learning_rate=0.7, momentum=0.3, group_size=num_replicas)
    dl = diloco_outer(learning_rate=0.7, momentum=0.3)
    phi_nl, _ = run_outer(nl, phi0, thetas, num_replicas)
    phi_dl, _ = run_outer(dl, phi0, thetas, num_replicas)
    assert_trees_close(phi_nl, phi_dl, rtol=1e-6, atol=1e-6)


def test_no_momentum_unit_lr_moves_phi_to_group_mean_of_theta():
    num_replicas = 8
    phi0, thetas = _rounds(num_replicas, num_rounds=1, seed=2)
    tx = noloco_outer(learning_rate=1.0, momentum=0.0, seed=4)
    phi, _ = run_outer(tx, phi0, thetas, num_replicas)
    groups = groups_for_round(0, num_replicas, 2, seed=4)
    for k in phi:
        theta = np.asarray(thetas[0][k])
        expected = np.empty_like(theta)
        for g in groups:
            expected[g] = theta[g].mean(axis=0)
        np.testing.assert_allclose(phi[k], expected, rtol=1e-6, atol=1e-6)


def test_single_replica_is_momentum_on_own_pseudo_gradient():
    phi0, thetas = _rounds(1, num_rounds=4, seed=3)
    single = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
    alone = noloco_outer(learning_rate=0.7, momentum=0.5, axis_name=None)
    reference = optax.sgd(0.7, momentum=0.5)
    phi_ref, st_ref = single(phi0), reference.init(single(phi0))
    phi, st = single(phi0), alone.init(single(phi0))
    for theta in thetas:
        theta = single(theta)
        g = jax.tree.map(lambda p, t: p - t, phi_ref, theta)
        u, st_ref = reference.update(g, st_ref, phi_ref)
        phi_ref = optax.apply_updates(phi_ref, u)
        d, st = alone.update(jax.tree.map(lambda p, t: p - t, phi, theta), st, phi)
        phi = optax.apply_updates(phi, d)
    assert_trees_close(phi, phi_ref, rtol=0, atol=0)
    # N = 1 on a bound axis is the same single-replica algorithm.
    phi_axis, _ = run_outer(noloco_outer(momentum=0.5), phi0, thetas, num_replicas=1)
    assert_trees_close(single(phi_axis), phi_ref, rtol=1e-6, atol=1e-6)


def test_shard_map_equals_vmap():
    num_replicas = 8
    phi0, thetas = _rounds(num_replicas, num_rounds=4, seed=5)
    for n, gamma in [(2, None), (4, 1.0)]:
        tx = noloco_outer(group_size=n, gamma=gamma, seed=9)
        phi_v, _ = run_outer(tx, phi0, thetas, num_replicas, backend="vmap")
        phi_s, _ = run_outer(tx, phi0, thetas, num_replicas, backend="shard_map")
        assert_trees_close(phi_v, phi_s, rtol=1e-6, atol=1e-6)


def test_bf16_exchange_keeps_local_state_dtype_and_stays_close():
    num_replicas = 4
    phi0, thetas = _rounds(num_replicas, num_rounds=3, seed=6)
    exact, _ = run_outer(noloco_outer(), phi0, thetas, num_replicas)
    cast, state = run_outer(noloco_outer(exchange_dtype=jnp.bfloat16), phi0, thetas, num_replicas)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(cast))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.sgd_state))
    # bf16 keeps 8 bits of mantissa: relative error of a sent value <= 2^-9.
    assert_trees_close(cast, exact, rtol=0, atol=3 * 2.0**-9 * 3)
    assert not all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(cast), jax.tree.leaves(exact))
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"group_size": 1}, "group_size"),
        ({"group_size": 2.0}, "group_size"),
        ({"learning_rate": -0.1}, "learning_rate"),
        ({"momentum": -0.5}, "momentum"),
        ({"momentum": 1.0}, r"momentum: must be in \[0, 1\)"),  # heavy ball diverges (was taken)
        ({"momentum": 1.5}, r"momentum: must be in \[0, 1\)"),
        ({"gamma": -1.0}, "gamma"),
        ({"learning_rate": float("nan")}, "learning_rate"),
        ({"learning_rate": "0.7"}, "learning_rate"),
        ({"learning_rate": 0.0, "gamma": 0.5}, "gamma"),
        ({"pool_size": 0}, "pool_size"),
        # NumPy scalars are host numbers: they were let through unchecked, as arrays are.
        ({"momentum": np.float64(1.5)}, r"momentum: must be in \[0, 1\)"),
        ({"gamma": np.float32(-1.0)}, "gamma"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        noloco_outer(**kwargs)


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
@pytest.mark.parametrize("wrap", [np.float64, np.float32, np.asarray])
@pytest.mark.parametrize("field,bad", [("learning_rate", float("nan")), ("learning_rate", -0.7),
                                       ("momentum", 1.5), ("momentum", float("nan"))])
def test_numpy_scalar_rates_are_checked_as_numbers(factory, wrap, field, bad):
    """A NumPy scalar or 0-d array was taken for an on-device value and passed unchecked
    (momentum 1.5 diverges, a NaN rate makes every weight NaN)."""
    with pytest.raises(ValueError, match=field):
        factory(**{field: wrap(bad)})
    factory(**{field: wrap(0.5)})  # a good one is still taken


@pytest.mark.parametrize("factory", [noloco_outer, diloco_outer])
def test_a_momentum_schedule_is_refused_when_built(factory):
    """optax.sgd takes a constant momentum: a schedule was taken and the first update died
    with "TypeError: unsupported operand type(s) for *: 'function' ..."."""
    with pytest.raises(ValueError, match="momentum: .*not a schedule"):
        factory(momentum=optax.constant_schedule(0.5))


def test_group_size_must_divide_replicas_at_trace_time():
    phi0 = {"w": np.zeros((6, 3, 2), np.float32), "b": np.zeros((6, 5), np.float32)}
    thetas = [phi0]  # only the shapes matter: the trace refuses them
    with pytest.raises(ValueError, match="group_size=4 must divide.*num_replicas=6"):
        run_outer(noloco_outer(group_size=4), phi0, thetas, num_replicas=6)


def test_unbound_axis_names_axis_and_how_to_bind():
    tx = noloco_outer(axis_name="workers")
    phi = jnp.zeros(3)
    with pytest.raises(ValueError, match=r"'workers'.*jax\.vmap.*jax\.shard_map"):
        tx.update(phi, tx.init(phi), phi)
    with pytest.raises(ValueError, match="params"):
        noloco_outer(axis_name=None).update(phi, tx.init(phi))



@pytest.mark.parametrize("outer, kwargs", [
    ("noloco", {"gamma": 0.3}), ("noloco", {"exchange_dtype": "int8", "error_feedback": True}),
    ("diloco", {"exchange_dtype": jnp.bfloat16}), ("diloco", {"exchange_dtype": "int8"}),
])  # fmt: skip
def test_complex_leaves_average_both_parts(outer, kwargs):
    """noloco_outer died packing a complex leaf's bits into its message, and a diloco wire
    cast it to float32, dropping the imaginary part (a silent wrong delta)."""
    num, beta = 4, 0.7
    tx = noloco_outer(beta, seed=0, **kwargs) if outer == "noloco" else diloco_outer(beta, **kwargs)
    rng = np.random.default_rng(0)
    phi = {"c": jnp.asarray(rng.normal(size=(num, 3)) + 1j * rng.normal(size=(num, 3)),
                            jnp.complex64), "w": jnp.asarray(rng.normal(size=(num, 2)))}
    grad = {"c": jnp.asarray(np.asarray(phi["c"]) * np.float32(0.5) + np.complex64(0.25j)),
            "w": phi["w"]}  # on the host (numpy)
    reps = replicas.make_replicas(num, backend="vmap")
    delta, _ = jax.jit(reps.map(tx.update))(grad, reps.init(tx, phi), phi)
    p, g = np.asarray(phi["c"], np.complex128), np.asarray(grad["c"], np.complex128)
    want = np.empty_like(p)
    if outer == "diloco":
        want[:] = -beta * g.mean(0)
    for grp in groups_for_round(0, num, 2, 0) if outer == "noloco" else ():
        gamma = kwargs.get("gamma", beta)  # delta = -beta mean_G grad - gamma (phi - mean_G phi)
        want[grp] = -beta * g[grp].mean(0) - gamma * (p[grp] - p[grp].mean(0))
    np.testing.assert_allclose(np.asarray(delta["c"]), want, atol=0.03)
