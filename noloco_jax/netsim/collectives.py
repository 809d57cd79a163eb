"""How long one sync's collective takes over a ``Link``: all-reduce or a NoLoCo group exchange.

Every replica pair is joined by the same link. A message pays the link's
latency once and its bytes at the link's bandwidth; links are full duplex, so
sending and receiving overlap. So a pair exchange is one latency, where the
paper's latency model (§5.3, ``latency_model``) charges a pairwise average
2·t_c: with no bandwidth cost, tree all-reduce / pair is 2·log2 N here and
log2 N there.
"""

from __future__ import annotations

import math

from noloco_jax import comm
from noloco_jax.netsim import checks
from noloco_jax.netsim.links import Link

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "allreduce_time",
    "group_exchange_time",
    "ring_allreduce_time",
    "tree_allreduce_time",
]

ALLREDUCE_ALGORITHMS = ("ring", "tree")


def ring_allreduce_time(num_bytes: float, num_replicas: int, link: Link) -> float:
    """Time of a ring all-reduce of a ``num_bytes`` buffer.

    Reduce-scatter then all-gather: 2(N − 1) sequential hops of latency, and
    2(N − 1)/N · num_bytes sent by every replica.

    Args:
      num_bytes: size of the buffer being reduced, >= 0.
      num_replicas: N >= 2.
      link: the link between neighbours.

    Returns:
      Seconds.
    """
    b = checks.non_negative("num_bytes", num_bytes)
    n = checks.int_at_least("num_replicas", num_replicas, 2)
    hops = 2 * (n - 1)
    return hops * link.latency_s + hops / n * b / link.bytes_per_second


def tree_allreduce_time(num_bytes: float, num_replicas: int, link: Link) -> float:
    """Time of a binary-tree all-reduce (reduce to the root, then broadcast).

    2·ceil(log2 N) sequential hops, each carrying the whole buffer.

    Args:
      num_bytes: size of the buffer being reduced, >= 0.
      num_replicas: N >= 2.
      link: the link between tree neighbours.

    Returns:
      Seconds.
    """
    b = checks.non_negative("num_bytes", num_bytes)
    n = checks.int_at_least("num_replicas", num_replicas, 2)
    hops = 2 * math.ceil(math.log2(n))
    return hops * link.message_time(b)


def allreduce_time(algorithm: str, num_bytes: float, num_replicas: int, link: Link) -> float:
    """``ring_allreduce_time`` or ``tree_allreduce_time``, by name.

    Args:
      algorithm: one of ``ALLREDUCE_ALGORITHMS``.
      num_bytes: size of the buffer being reduced, >= 0.
      num_replicas: N >= 2.
      link: the link between neighbours.

    Returns:
      Seconds.
    """
    if algorithm == "ring":
        return ring_allreduce_time(num_bytes, num_replicas, link)
    if algorithm == "tree":
        return tree_allreduce_time(num_bytes, num_replicas, link)
    raise ValueError(f"algorithm must be one of {ALLREDUCE_ALGORITHMS}, got {algorithm!r}.")


def group_exchange_time(num_bytes_sent: float, link: Link, *, group_size: int = 2) -> float:
    """Time of one NoLoCo group exchange.

    ``comm.exchange_steps(n)`` sequential messages (butterfly for powers of
    two, n − 1 shifts otherwise), each paying the latency once; the transfer
    time is the replica's sent bytes over the bandwidth.

    Args:
      num_bytes_sent: bytes one replica sends in the exchange (all messages
        together, as ``comm.noloco_bytes_per_sync`` reports), >= 0.
      link: the link between group members.
      group_size: n >= 2.

    Returns:
      Seconds.
    """
    b = checks.non_negative("num_bytes_sent", num_bytes_sent)
    n = checks.int_at_least("group_size", group_size, 2)
    return comm.exchange_steps(n) * link.latency_s + b / link.bytes_per_second
