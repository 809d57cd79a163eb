"""replicas.Replicas: layout rules and the single-replica path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

from noloco_jax import replicas


def _fn(step, w, x):
    """One replica: a matmul, collectives on the replica axis and a shared counter."""
    y = x @ w
    return step + 1, y, lax.psum(y.sum(), "replica"), lax.ppermute(y, "replica", [(0, 0)])


def test_single_replica_map_batches_nothing_and_matches_the_plain_function():
    w = jax.random.normal(jax.random.key(0), (4, 3))
    x = jax.random.normal(jax.random.key(1), (2, 4))
    step = jnp.zeros([], jnp.int32)
    mapped = replicas.Replicas(1).map(_fn)
    args = (step, w[None], x[None])
    jaxpr = jax.make_jaxpr(mapped)(*args)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert dots, jaxpr
    for eqn in dots:  # no size-1 batch axis on the weights: plain matmuls
        (_, _), (lhs_batch, rhs_batch) = eqn.params["dimension_numbers"]
        assert lhs_batch == () and rhs_batch == (), eqn
    count, y, total, sent = jax.jit(mapped)(*args)
    assert count.shape == () and int(count) == 1  # shared leaves stay shared
    np.testing.assert_allclose(y, (x @ w)[None], rtol=1e-6)
    np.testing.assert_allclose(total, (x @ w).sum()[None], rtol=1e-5)
    np.testing.assert_allclose(sent, y, rtol=0)


def test_single_replica_map_equals_the_vmap_of_two_replicas_restricted_to_one():
    w = jax.random.normal(jax.random.key(2), (2, 4, 3))
    x = jax.random.normal(jax.random.key(3), (2, 5, 4))
    step = jnp.zeros([], jnp.int32)
    one = jax.jit(replicas.Replicas(1).map(lambda s, a, b: (s + 1, jnp.tanh(b @ a))))
    two = jax.jit(replicas.Replicas(2).map(lambda s, a, b: (s + 1, jnp.tanh(b @ a))))
    _, y1 = one(step, w[:1], x[:1])
    _, y2 = two(step, w, x)
    np.testing.assert_allclose(y1, y2[:1], rtol=1e-6, atol=1e-6)


def test_vmap_map_traces_the_function_once_and_keeps_the_output_tree():
    traces = []

    def fn(step, w, x):
        traces.append(None)  # a Python side effect: runs once per trace
        return {"count": step + 1, "out": (x @ w, None), "norm": jnp.linalg.norm(w)}

    w = jax.random.normal(jax.random.key(4), (3, 4, 2))
    x = jax.random.normal(jax.random.key(5), (3, 5, 4))
    got = jax.jit(replicas.Replicas(3).map(fn))(jnp.zeros([], jnp.int32), w, x)
    assert len(traces) == 1
    assert got["count"].shape == () and int(got["count"]) == 1  # shared: no replica axis
    assert got["out"][1] is None and got["out"][0].shape == (3, 5, 2)
    np.testing.assert_allclose(got["out"][0], jnp.einsum("nbi,nio->nbo", x, w), rtol=1e-5)
    np.testing.assert_allclose(got["norm"], jnp.linalg.norm(w.reshape(3, -1), axis=1), rtol=1e-5)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_map_refuses_an_integer_scalar_that_differs_between_replicas(backend):
    # Integer scalars are shared by the layout rule; one that varies cannot be, and must not
    # silently become replica 0's value. The message names the rule and the fix.
    reps = replicas.make_replicas(8, backend=backend)
    mapped = reps.map(lambda x: (x.sum(), lax.axis_index("replica")))
    with pytest.raises(ValueError, match=r"scalar output is computed per replica, but the "
                       r"replicated layout keeps such scalars shared.*shape \[1\]"):  # fmt: skip
        jax.jit(mapped)(reps.put(jnp.ones((8, 3))))


def test_map_names_the_fix_for_a_vmapped_optax_state():
    reps = replicas.make_replicas(4, backend="vmap")
    tx = optax.adam(1e-2)
    params = replicas.replicate({"w": jnp.ones(3)}, 4)
    step = jax.jit(reps.map(lambda p, s: tx.update(p, s, p)))
    with pytest.raises(ValueError, match=r"built with jax\.vmap\(tx\.init\) .* build it with "
                                         r"reps\.init\(tx, params\)"):  # fmt: skip
        step(params, jax.vmap(tx.init)(params))  # its counter gets a replica axis
    step(params, reps.init(tx, params))  # the fix works


@pytest.mark.parametrize("shared", [1.0, jnp.float32(1.0), jax.random.key(0)])
def test_map_names_the_argument_and_the_fix_for_a_float_or_key_scalar(shared):
    # Was "expected a leading replica axis of size 4, got shape ()", naming neither.
    reps = replicas.make_replicas(4, backend="vmap")
    mapped = reps.map(lambda x, s: x)
    with pytest.raises(ValueError, match=r"Replicas\.map: argument 1 needs a leading replica "
                                         r"axis of size 4, got shape \(\)\. .*close over it"):
        mapped(jnp.ones((4, 3)), shared)
    with pytest.raises(ValueError, match=r"argument 0\['b'\] needs a leading replica axis of "
                                         r"size 4, got shape \(3,\)\.$"):  # fmt: skip
        mapped({"a": jnp.ones((4, 3)), "b": jnp.ones(3)}, jnp.ones(4))


def test_a_float_output_varying_over_a_stage_axis_keeps_jaxs_error():
    # Only a shared (P()) leaf gets the integer-scalar message; here the float leaf's spec is
    # P('replica') and it varies over the manual stage axis.
    mesh = jax.make_mesh((4, 2), ("replica", "stage"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)  # fmt: skip
    reps = replicas.Replicas(4, "replica", mesh, leaf_axes=lambda path, leaf: ())
    mapped = jax.jit(reps.map(lambda x: x * (1.0 + lax.axis_index("stage"))))
    with pytest.raises(ValueError, match=r"is P\('replica',\) which implies") as caught:
        mapped(reps.put(jnp.ones((4, 3))))
    assert "integer or boolean scalar" not in str(caught.value)


def test_shard_map_names_reps_put_for_an_input_left_unplaced():
    reps = replicas.make_replicas(8, backend="shard_map")
    mapped = jax.jit(reps.map(lambda x, b: x + b.sum()))
    x = reps.put(jnp.ones((8, 3)))
    with pytest.raises(ValueError, match=r"an input is not placed over the 'replica' mesh axis "
                       r"\(float32\[8,16\]\)\. Pass every per-replica input .* reps\.put"):
        mapped(x, jnp.ones((8, 16)))  # the batch was not put
    assert mapped(x, reps.put(jnp.ones((8, 16)))).shape == (8, 3)


@pytest.mark.parametrize("axis_name", [3, 0, None, b"replica"])
def test_an_axis_name_that_is_not_a_string_is_refused(axis_name):
    """Replicas(2, 3) was accepted; with an int name lax.psum(x, 0) inside map summed a leaf's
    first dimension of each replica instead of across the replicas."""
    with pytest.raises(ValueError, match=r"^axis_name: must be a string"):
        replicas.Replicas(2, axis_name)


@pytest.mark.parametrize("num_replicas,axis_name", [(4, "replica"), (2, "r")])
def test_a_mesh_whose_replica_axis_is_not_num_replicas_long_is_refused(num_replicas, axis_name):
    # Replicas(4) on a 2-device replica axis ran replicas 0 and 2 only and returned 2 of 4.
    mesh = jax.make_mesh((2,), ("replica",), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=rf"the mesh's '{axis_name}' axis \(axis_name\) must "
                                         rf"have num_replicas={num_replicas} devices"):  # fmt: skip
        replicas.Replicas(num_replicas, axis_name, mesh)
    assert replicas.Replicas(2, mesh=mesh).backend == "shard_map"


@pytest.mark.parametrize("index", [4, 9, -5])
def test_select_replica_refuses_an_index_past_the_replicas(index):
    """Index 4 of 4 replicas returned replica 3's weights (the gather clamps)."""
    like = {"w": jnp.zeros(2), "step": jnp.int32(0)}
    tree = {"w": jnp.arange(8.0).reshape(4, 2), "step": jnp.int32(7)}
    assert replicas.select_replica(tree, -1, like)["w"].tolist() == [6.0, 7.0]
    with pytest.raises(ValueError, match=r"index: must be an integer in \[-4, 3\]"):
        replicas.select_replica(tree, index, like)


def test_select_replica_checks_an_array_index_too():
    """A concrete jax.Array index 4 of 4 replicas was never checked (replica 3's weights came
    back), and a 0-d numpy integer index was refused."""
    like = {"w": jnp.zeros(2), "step": jnp.int32(0)}
    tree = {"w": jnp.arange(8.0).reshape(4, 2), "step": jnp.int32(7)}
    assert replicas.select_replica(tree, np.array(1), like)["w"].tolist() == [2.0, 3.0]
    assert replicas.select_replica(tree, jnp.array(-1), like)["w"].tolist() == [6.0, 7.0]
    for index in (jnp.array(4), jnp.array(-5), np.array(4)):
        with pytest.raises(ValueError, match=r"index: must be an integer in \[-4, 3\]"):
            replicas.select_replica(tree, index, like)
    for index in (jnp.array([5]), np.array([1, 2])):  # [5] was clamped to replica 3
        with pytest.raises(ValueError, match=r"one replica's index .* shape \("):
            replicas.select_replica(tree, index, like)


@pytest.mark.parametrize("num_replicas", [0, -1, 2.0, True])
def test_replicate_refuses_a_bad_num_replicas(num_replicas):
    """num_replicas=0 gave a tree of zero replicas; -1 a TypeError from broadcast_in_dim."""
    with pytest.raises(ValueError, match=r"num_replicas: must be an integer >= 1"):
        replicas.replicate({"w": jnp.ones(2), "step": jnp.int32(0)}, num_replicas)


def test_the_device_count_in_messages_is_singular_for_one():
    assert replicas._visible(1) == "1 device is visible"  # was "1 devices are visible"
    assert replicas._visible(8) == "8 devices are visible"
