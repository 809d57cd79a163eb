"""Sync time and communication share of data parallel, DiLoCo and NoLoCo over one ``Link``.

``sync_report`` answers "P parameters, N replicas, this link and this compute
time per inner step: how long does each method's sync take, and what fraction
of wall time is communication?" ``python -m experiments.network_model
--params=...`` prints it.
"""

from __future__ import annotations

from typing import Any, Sequence

from noloco_jax import comm
from noloco_jax.netsim import checks, _wire
from noloco_jax.netsim.collectives import (
    ALLREDUCE_ALGORITHMS,
    allreduce_time,
    group_exchange_time,
)
from noloco_jax.netsim.links import Link

__all__ = ["METHODS", "sync_report", "report_markdown"]

METHODS = ("dp", "diloco", "noloco")


def _row(method: str, sync_every: int, num_bytes: float, sync_s: float, step_s: float) -> dict:
    comm_s = sync_s / sync_every
    return {
        "method": method,
        "sync_every": sync_every,
        "bytes_per_sync": float(num_bytes),
        "sync_time_s": sync_s,
        "syncs_per_step": 1.0 / sync_every,
        "comm_per_step_s": comm_s,
        "compute_per_step_s": step_s,
        "comm_fraction": comm_s / (step_s + comm_s),
    }


def sync_report(
    num_params: float,
    num_replicas: int,
    link: Link,
    *,
    step_time_s: float,
    noloco_sync_every: int = 50,
    diloco_sync_every: int = 100,
    bytes_per_param: int = 4,
    group_size: int = 2,
    gamma_equals_beta: bool = True,
    exchange_bytes_per_param: int | None = None,
    allreduce: str = "ring",
) -> list[dict[str, Any]]:
    """Sync time and communication share of data parallel, DiLoCo and NoLoCo.

    Bytes come from ``noloco_jax.comm`` applied to a ``jax.ShapeDtypeStruct``
    of ``num_params`` parameters. NoLoCo's are the ones its optimizer reports;
    the all-reduces are counted at ``bytes_per_param`` width, as a network that
    reduces 16-bit values natively sends them, while the trainer's DiLoCo and
    data parallel sum 16-bit values in float32 and report twice as many
    (``comm.diloco_bytes_per_sync``, ``comm.mean_bytes_per_replica``).
    Data parallel all-reduces the gradients every inner step, DiLoCo the outer
    gradient every ``diloco_sync_every`` steps (both with ``allreduce``), and
    NoLoCo runs one group exchange every ``noloco_sync_every`` steps.
    Communication is assumed not to overlap compute.

    Args:
      num_params: P, a whole number >= 1.
      num_replicas: N >= 2, a multiple of ``group_size``.
      link: the link between any two replicas.
      step_time_s: compute time of one inner step per replica, > 0.
      noloco_sync_every: H of NoLoCo, >= 1.
      diloco_sync_every: H of DiLoCo, >= 1.
      bytes_per_param: bytes of one parameter and gradient, one of 1, 2, 4, 8.
      group_size: NoLoCo group size n >= 2.
      gamma_equals_beta: NoLoCo with γ = β sends only the fast weights.
      exchange_bytes_per_param: NoLoCo's bytes per parameter on the wire
        (``exchange_dtype``); ``None`` means ``bytes_per_param``. 1 is the optimizer's
        ``"int8"`` exchange, whose float32 scale per ``quantize.BLOCK`` values is counted.
      allreduce: "ring" or "tree", the all-reduce of data parallel and DiLoCo.

    Returns:
      One dict per method ("dp", "diloco", "noloco") with keys method,
      sync_every, bytes_per_sync (bytes one replica sends per sync; for the
      all-reduces the ring count ``comm.allreduce_bytes_per_replica``, also
      with ``allreduce="tree"``, where only the time changes), sync_time_s,
      syncs_per_step, comm_per_step_s, compute_per_step_s and comm_fraction
      = comm / (compute + comm) per inner step.
    """
    p = checks.num_params(num_params)
    n = checks.int_at_least("num_replicas", num_replicas, 2)
    checks.groups_divide("num_replicas", n, group_size)
    step_s = checks.positive("step_time_s", step_time_s)
    h_noloco = checks.int_at_least("noloco_sync_every", noloco_sync_every, 1)
    h_diloco = checks.int_at_least("diloco_sync_every", diloco_sync_every, 1)
    bpp = _wire.bytes_per_param("bytes_per_param", bytes_per_param)
    xbpp = bpp if exchange_bytes_per_param is None else exchange_bytes_per_param
    xbpp = _wire.bytes_per_param("exchange_bytes_per_param", xbpp)
    if allreduce not in ALLREDUCE_ALGORITHMS:
        raise ValueError(f"allreduce must be one of {ALLREDUCE_ALGORITHMS}, got {allreduce!r}.")

    tree = _wire.params_tree(p, bpp)
    ar_bytes = comm.allreduce_bytes_per_replica(tree, n)
    ar_time = allreduce_time(allreduce, p * bpp, n, link)
    # The optimizer's params are float (comm counts only float leaves, so a 1-byte int8 tree
    # would send nothing); the wire dtype alone sets the bytes. 1 byte: "int8" codes + scales.
    nl_bytes = comm.noloco_bytes_per_sync(
        _wire.params_tree(p, 4), group_size=group_size, gamma_equals_beta=gamma_equals_beta,
        exchange_dtype="int8" if xbpp == 1 else _wire.wire_dtype(xbpp),
    )
    nl_time = group_exchange_time(nl_bytes, link, group_size=group_size)
    return [
        _row("dp", 1, ar_bytes, ar_time, step_s),
        _row("diloco", h_diloco, ar_bytes, ar_time, step_s),
        _row("noloco", h_noloco, nl_bytes, nl_time, step_s),
    ]


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.3e}"


def report_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """Markdown table of ``sync_report`` rows.

    Args:
      rows: the list ``sync_report`` returns.

    Returns:
      A markdown table, one line per method.
    """
    head = (
        "| method | sync every (steps) | MB sent / replica / sync | sync time (s) "
        "| comm / inner step (s) | compute / inner step (s) | comm fraction |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {r['sync_every']} | {_fmt(r['bytes_per_sync'] / 1e6)} "
            f"| {_fmt(r['sync_time_s'])} | {_fmt(r['comm_per_step_s'])} "
            f"| {_fmt(r['compute_per_step_s'])} | {r['comm_fraction']:.1%} |"
        )
    return "\n".join(lines)
