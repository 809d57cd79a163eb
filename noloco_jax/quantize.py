"""8-bit wire formats for what replicas send: block-wise int8 and float8 (e4m3) with scales.

A flat float buffer is cut into blocks of ``BLOCK`` values; each block travels as 8-bit codes
plus one float32 scale (its absolute maximum over the format's largest code), so the message is
``n + 4 * ceil(n / BLOCK)`` bytes instead of ``4 n``: 1/4 + 1/256 = 0.254 of float32 with
256-value blocks.
``encode`` packs codes and scales into one uint8 buffer (one collective per message);
``decode`` inverts it. ``roundtrip(x) = decode(encode(x))`` is what a receiver sees; values
already on the grid (a ``roundtrip`` output) come back unchanged up to float rounding of the
scale.

Error feedback (Seide et al., 2014; Karimireddy et al., 2019): a sender that adds the
residual of its last quantisation to its next message, ``q_t = Q(x_t + e_t)``,
``e_{t+1} = x_t + e_t - q_t``, sends values whose running sum differs from the true running
sum by ``e_{t+1}`` alone, which stays within half a quantisation step per value, however many
rounds pass.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from noloco_jax import errors

__all__ = ["FORMATS", "BLOCK", "encode", "decode", "roundtrip", "wire_bytes", "is_codec"]

BLOCK = 256
# code dtype, largest code magnitude
FORMATS: dict[str, tuple[Any, float]] = {
    "int8": (jnp.int8, 127.0),
    "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0),
}
_TINY = float(jnp.finfo(jnp.float32).tiny)


def is_codec(wire: Any) -> bool:
    """Whether ``wire`` names an 8-bit format of this module (not a plain dtype)."""
    return isinstance(wire, str) and wire in FORMATS


def _format(fmt: Any) -> tuple[Any, float]:
    """The code dtype and largest code of ``fmt``; a ``ValueError`` naming it otherwise."""
    errors.require(is_codec(fmt), "fmt", f"must be one of {sorted(FORMATS)}, got {fmt!r}.")
    return FORMATS[fmt]


def _blocks(x: jax.Array) -> tuple[jax.Array, int]:
    errors.require(jnp.ndim(x) == 1, "x", f"must be a flat (1-D) buffer, got shape "
                   f"{jnp.shape(x)}; pass x.reshape(-1).")  # fmt: skip
    n = x.shape[0]
    pad = (-n) % BLOCK
    return jnp.pad(x.astype(jnp.float32), (0, pad)).reshape(-1, BLOCK), n


def _codes(x: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array, int]:
    dtype, top = _format(fmt)
    blocks, n = _blocks(x)
    absmax = jnp.max(jnp.abs(blocks), axis=1)
    # An all-zero block gets scale 1; a block with a NaN keeps a NaN scale, so it arrives
    # non-finite (as a block with an inf does) instead of as finite, clipped values. A scale
    # is at least float32's smallest normal number: a subnormal one is flushed to 0, and the
    # codes x / 0 were NaN (float8) or clipped to zero (int8) for a block of tiny values.
    scale = jnp.where(absmax == 0, 1.0, jnp.maximum(absmax / top, _TINY)).astype(jnp.float32)
    scaled = blocks / scale[:, None]
    codes = (jnp.clip(jnp.round(scaled), -top, top) if fmt == "int8" else scaled).astype(dtype)
    return codes, scale, n


def encode(x: jax.Array, fmt: str) -> jax.Array:
    """A flat float buffer as one uint8 buffer: 8-bit codes, then float32 scales."""
    codes, scale, n = _codes(x, fmt)
    code_bytes = lax.bitcast_convert_type(codes, jnp.uint8).reshape(-1)[:n]  # no padding sent
    scale_bytes = lax.bitcast_convert_type(scale, jnp.uint8).reshape(-1)
    return jnp.concatenate([code_bytes, scale_bytes])


def decode(buf: jax.Array, n: int, fmt: str) -> jax.Array:
    """The float32 values of an ``encode``d buffer of ``n`` values."""
    dtype, _ = _format(fmt)
    n = errors.check_int("n", n, 0)  # a float n was a TypeError from jnp.pad, a bool taken as 1
    errors.require(jnp.shape(buf) == (wire_bytes(n),), "buf", f"must be the flat "
                   f"{wire_bytes(n)} bytes of an encoded message of n={n} values, got shape "
                   f"{jnp.shape(buf)}.")  # fmt: skip
    num_blocks = -(-n // BLOCK)
    padded = jnp.pad(buf[:n], (0, num_blocks * BLOCK - n))
    codes = lax.bitcast_convert_type(padded, dtype).reshape(num_blocks, BLOCK)
    scale = lax.bitcast_convert_type(buf[n:].reshape(num_blocks, 4), jnp.float32)
    return (codes.astype(jnp.float32) * scale[:, None]).reshape(-1)[:n]


def roundtrip(x: jax.Array, fmt: str) -> jax.Array:
    """``decode(encode(x))`` without the byte packing: what the receiver sees."""
    codes, scale, n = _codes(x, fmt)
    return (codes.astype(jnp.float32) * scale[:, None]).reshape(-1)[:n]


def wire_bytes(n: int) -> int:
    """Bytes of one encoded message of ``n`` values (an integer >= 0)."""
    n = errors.check_int("n", n, 0)  # a negative n gave a negative count
    return n + 4 * (-(-n // BLOCK))
