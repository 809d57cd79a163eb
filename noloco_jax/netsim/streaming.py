"""One replica's communication with streaming fragments, overlap and 8-bit exchange.

Every H / P inner steps one fragment is exchanged: by NoLoCo with the replica's
group, by DiLoCo in an all-reduce over all N replicas. The model takes P equal
fragments of 1/P of the parameters each; the trainer's layer fragments
(``optim.fragments.by_layer_blocks``) are larger at the ends when the vocabulary
tables are a large part of the model (``fragment_sizes`` gives them), and then
the largest fragment's exchange is what stalls. With an overlap of tau inner steps the exchange runs behind that much
compute, so only what does not fit there stalls the replica.

DiLoCo's 8-bit all-reduce is modelled as a ring in two phases (each replica
sends its 8-bit chunks to their owners, which sum them in float32, then every
owner sends its summed chunk back re-encoded), so it moves the ring's
2 (N - 1) / N buffers at 8 bits plus the block scales.
"""

from __future__ import annotations

import math
from typing import Any

from noloco_jax import comm, quantize
from noloco_jax.netsim import checks, _wire
from noloco_jax.netsim.collectives import group_exchange_time, ring_allreduce_time
from noloco_jax.netsim.links import Link

__all__ = ["streaming_sync"]

_UNQUANTIZED_BYTES = {"float32": 4, "bfloat16": 2}


def _hidden_above(num_bytes: float, latency_s: float, overlap_s: float) -> float:
    """Bytes/s above which ``overlap_s`` of compute hides an exchange (inf: no overlap;
    nan: the latency alone does not fit)."""
    if overlap_s == 0:
        return math.inf
    if latency_s >= overlap_s:
        return math.nan
    return num_bytes / (overlap_s - latency_s)


def _wire_bytes(num_values: int, exchange: str) -> int:
    """Bytes of one buffer of ``num_values`` on the wire."""
    if quantize.is_codec(exchange):
        return quantize.wire_bytes(num_values)
    return num_values * _UNQUANTIZED_BYTES[exchange]


def _group_cost(num_values: int, link: Link, exchange: str, group_size: int
                ) -> tuple[float, float, float]:  # fmt: skip
    """(bytes sent, seconds, latency part) of one NoLoCo group exchange of a fragment."""
    codec = quantize.is_codec(exchange)
    wire = exchange if codec else _wire.wire_dtype(_UNQUANTIZED_BYTES[exchange])
    tree = _wire.params_tree(num_values, 4)
    nbytes = comm.noloco_bytes_per_sync(tree, group_size=group_size, exchange_dtype=wire)
    sync_s = group_exchange_time(nbytes, link, group_size=group_size)
    return float(nbytes), sync_s, comm.exchange_steps(group_size) * link.latency_s


def _ring_cost(num_values: int, link: Link, exchange: str, num_replicas: int
               ) -> tuple[float, float, float]:  # fmt: skip
    """(bytes sent, seconds, latency part) of one DiLoCo ring all-reduce of a fragment."""
    buffer = _wire_bytes(num_values, exchange)
    nbytes = 2.0 * (num_replicas - 1) / num_replicas * buffer
    sync_s = ring_allreduce_time(buffer, num_replicas, link)
    return nbytes, sync_s, 2 * (num_replicas - 1) * link.latency_s


def streaming_sync(
    num_params: float,
    link: Link,
    *,
    step_time_s: float,
    sync_every: int = 50,
    fragments: int = 1,
    delay_steps: int = 0,
    exchange: str = "float32",
    group_size: int = 2,
    method: str = "noloco",
    num_replicas: int = 2,
) -> dict[str, Any]:
    """One replica's sync cost with P fragments, an overlap of tau steps and a wire format.

    Args:
      num_params: parameters of the model, a whole number >= 1.
      link: the link between any two replicas.
      step_time_s: compute time of one inner step, > 0.
      sync_every: H, >= 1, a multiple of ``fragments``.
      fragments: P >= 1.
      delay_steps: tau, 0 <= tau < H / P (the next fragment's exchange must not
        start before this one is applied).
      exchange: "float32", "bfloat16", "int8" or "float8_e4m3fn" on the wire
        (the 8-bit formats with a float32 scale per ``quantize.BLOCK`` values).
      group_size: n >= 2 (NoLoCo).
      method: "noloco" (group exchange; does not depend on N) or "diloco"
        (ring all-reduce over ``num_replicas``).
      num_replicas: N >= 2 (DiLoCo).

    Returns:
      A dict with method, num_replicas, fragments, delay_steps, exchange, bytes_per_sync (one
      fragment), sync_time_s, exposed_per_step_s (stall per inner step,
      amortized), comm_fraction (stall / (compute + stall)) and
      hidden_above_bytes_per_s (the bandwidth above which the overlap hides the
      exchange completely; inf without overlap, nan when even an infinite
      bandwidth cannot because of latency).
    """
    p = checks.num_params(num_params)
    step_s = checks.positive("step_time_s", step_time_s)
    h = checks.int_at_least("sync_every", sync_every, 1)
    frags = checks.int_at_least("fragments", fragments, 1)
    if h % frags:
        raise ValueError(f"fragments={frags} must divide sync_every={h}.")
    stride = h // frags
    tau = checks.int_at_least("delay_steps", delay_steps, 0)
    if tau >= stride:
        raise ValueError(f"delay_steps={tau} must be < sync_every / fragments = {stride}.")
    if exchange not in (*_UNQUANTIZED_BYTES, *quantize.FORMATS):
        raise ValueError(f"exchange must be float32, bfloat16, int8 or float8_e4m3fn, "
                         f"got {exchange!r}.")  # fmt: skip
    if method not in ("noloco", "diloco"):
        raise ValueError(f"method must be 'noloco' or 'diloco', got {method!r}.")
    n_rep = checks.int_at_least("num_replicas", num_replicas, 2)
    checks.int_at_least("group_size", group_size, 2)
    fragment = -(-p // frags)
    if method == "noloco":
        nbytes, sync_s, latency = _group_cost(fragment, link, exchange, group_size)
    else:
        nbytes, sync_s, latency = _ring_cost(fragment, link, exchange, n_rep)
    per_step = max(0.0, sync_s - tau * step_s) / stride
    return {
        "method": method, "num_replicas": n_rep, "fragments": frags, "delay_steps": tau,
        "exchange": exchange,
        "bytes_per_sync": float(nbytes), "sync_time_s": sync_s,
        "exposed_per_step_s": per_step, "comm_fraction": per_step / (step_s + per_step),
        "hidden_above_bytes_per_s": _hidden_above(nbytes, latency, tau * step_s),
    }  # fmt: skip
