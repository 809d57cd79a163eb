"""8-bit wire formats: exact packing, error bounds, and bounded error with error feedback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from noloco_jax import quantize as qz

N = 1000  # values of a message: three full blocks and a padded one (one shape, compiled once)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_encode_decode_equals_roundtrip_and_has_the_stated_size(fmt):
    x = jax.random.normal(jax.random.key(0), (N,)) * jnp.linspace(1e-3, 10, N)
    buf = qz.encode(x, fmt)
    assert buf.dtype == jnp.uint8 and buf.size == qz.wire_bytes(N) == 1000 + 4 * 4
    np.testing.assert_array_equal(qz.decode(buf, N, fmt), qz.roundtrip(x, fmt))


def test_int8_error_is_at_most_half_a_step_per_block():
    x = jax.random.normal(jax.random.key(1), (3 * qz.BLOCK + 7,))
    err = np.abs(np.asarray(qz.roundtrip(x, "int8") - x))
    blocks = np.pad(np.abs(np.asarray(x)), (0, (-x.size) % qz.BLOCK)).reshape(-1, qz.BLOCK)
    step = np.repeat(blocks.max(1) / 127, qz.BLOCK)[: x.size]
    assert (err <= step / 2 * (1 + 1e-5)).all()
    assert err.max() > 0  # it does quantise


def test_values_on_the_grid_come_back():
    x = qz.roundtrip(jax.random.normal(jax.random.key(2), (N,)), "int8")
    np.testing.assert_allclose(qz.roundtrip(x, "int8"), x, rtol=1e-6, atol=0)


def test_zeros_and_fp8_range():
    np.testing.assert_array_equal(qz.roundtrip(jnp.zeros(N), "int8"), 0.0)
    x = jnp.array([1e4, -3.0, 0.5])
    np.testing.assert_allclose(qz.roundtrip(x, "float8_e4m3fn"), x, rtol=0.07)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("value", [1e-37, 1e-36, -3e-37])
def test_a_block_of_tiny_values_arrives_finite_and_close(fmt, value):
    # The scale absmax / top underflowed to a subnormal, which XLA flushes to 0: the codes
    # x / 0 were NaN for float8 (finite weights arrived as NaN) and 0 for int8.
    x = jnp.asarray(np.full((N,), value, np.float32))  # N: a padded last block, as before
    got = np.asarray(qz.decode(qz.encode(x, fmt), x.size, fmt))
    np.testing.assert_allclose(got, np.asarray(x), rtol=0.07)
    np.testing.assert_array_equal(got, qz.roundtrip(x, fmt))


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_arrives_non_finite_and_spares_other_blocks(fmt, bad):
    # A replica that diverged must show as non-finite on the wire, as with a float32 wire,
    # not as finite values that its partner averages in (a NaN used to get scale 1: code 0,
    # and the block's other values clipped to +-127).
    x = np.arange(N, dtype=np.float32) - 300.0  # built on the host; N as the other tests
    x[3] = bad
    got = np.asarray(qz.decode(qz.encode(jnp.asarray(x), fmt), x.size, fmt))
    assert not np.isfinite(got[: qz.BLOCK]).any()
    x[3] = 0.0
    clean = np.asarray(qz.decode(qz.encode(jnp.asarray(x), fmt), x.size, fmt))
    np.testing.assert_array_equal(got[qz.BLOCK :], clean[qz.BLOCK :])


def test_error_feedback_keeps_the_accumulated_error_bounded():
    # A toy stream: the running sum of what was sent tracks the true running sum to within
    # one block's half step (the residual), over 500 rounds; without feedback it drifts.
    key = jax.random.key(3)
    xs = 0.01 + 0.001 * jax.random.normal(key, (500, 64))  # a small bias quantises badly
    xs = np.asarray(xs.at[:, 0].set(1.0))  # one large value sets each block's scale

    @jax.jit  # one compiled round (500 eager rounds dispatched ~30 ops each)
    def send(x, e):
        q = qz.roundtrip(x + e, "int8")
        return q, x + e - q, qz.roundtrip(x, "int8")

    e = jnp.zeros(64)
    sent_fb, sent_plain = [], []
    for x in xs:
        q, e, plain = send(x, e)
        sent_fb.append(q)
        sent_plain.append(plain)
    true = np.cumsum(np.asarray(xs), 0)
    drift_fb = np.abs(np.cumsum(np.asarray(sent_fb), 0) - true).max(1)
    drift_plain = np.abs(np.cumsum(np.asarray(sent_plain), 0) - true).max(1)
    half_step = 1.0 / 127 / 2
    assert drift_fb.max() <= half_step * 1.01  # bounded by the residual: the test's bound
    assert drift_plain[-1] > 50 * half_step  # without feedback the error accumulates


@pytest.mark.parametrize("shape", [(3, 4), ()])
def test_a_buffer_that_is_not_flat_is_refused(shape):
    # A 2-D x was padded on both axes and came back as shape[0] wrong values; a scalar raised
    # an IndexError.
    x = jnp.ones(shape)
    for call in (qz.encode, qz.roundtrip):
        with pytest.raises(ValueError, match="x: must be a flat"):
            call(x, "int8")


def test_an_unknown_format_or_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match=r"fmt: must be one of \['float8_e4m3fn', 'int8'\]"):
        qz.encode(jnp.ones(4), "int4")
    with pytest.raises(ValueError, match="fmt: must be one of"):
        qz.decode(qz.encode(jnp.ones(4), "int8"), 4, "int4")
    with pytest.raises(ValueError, match="buf: must be the flat 9 bytes"):
        qz.decode(qz.encode(jnp.ones(4), "int8"), 5, "int8")  # n does not match the message


@pytest.mark.parametrize("n", [-300, -1, 3.0, True, None])
def test_wire_bytes_and_decode_refuse_an_n_that_is_not_a_count(n):
    """wire_bytes(-300) was -304 bytes; decode with n=3.0 failed with jnp.pad's TypeError."""
    with pytest.raises(ValueError, match=r"n: must be an integer >= 0, got"):
        qz.wire_bytes(n)
    with pytest.raises(ValueError, match=r"n: must be an integer >= 0, got"):
        qz.decode(jnp.zeros(7, jnp.uint8), n, "int8")
