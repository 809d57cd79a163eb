"""How long a sync takes: the paper's latency model and a bandwidth + latency model.

All in SI units (bytes, bytes per second, seconds); NumPy, with JAX only for
byte counts, and deterministic given a seed. One idea per module:

- ``links``: ``Link`` (bandwidth and latency of one link, shared with
  ``skippipe.Network``) and the time of one message.
- ``latency_model``: the paper's model of message times only, tree all-reduce
  against pairwise averaging [NoLoCo §5.3, Eq. 5–7, Fig. 5A].
- ``blocking``: how long slow workers hold the others up, DiLoCo's barrier
  against NoLoCo's groups [Fig. 5B].
- ``collectives``: ring / tree all-reduce and NoLoCo group exchange over a link.
- ``report``: ``sync_report``, the sync time and communication share of data
  parallel, DiLoCo and NoLoCo for P parameters on N replicas.
- ``streaming``: ``streaming_sync``, one NoLoCo replica's cost with streaming
  fragments, overlap and 8-bit exchange.

``python -m experiments.network_model --params=125e6 --replicas=1024 --bandwidth_gbps=1
--latency_ms=50 --step_time=0.5`` prints a ``sync_report`` for one model and link (the five
flags are all needed: the link and the step time have no default).
"""

from noloco_jax.netsim import blocking, collectives, latency_model, links, report, streaming
from noloco_jax.netsim.blocking import simulate_global_blocking
from noloco_jax.netsim.collectives import (
    ALLREDUCE_ALGORITHMS,
    allreduce_time,
    group_exchange_time,
    ring_allreduce_time,
    tree_allreduce_time,
)
from noloco_jax.netsim.latency_model import (
    allreduce_pairwise_ratio,
    expected_max_of_two,
    expected_max_of_two_mc,
    lognormal_params,
    paper_allreduce_time,
    paper_pairwise_time,
    simulate_tree_allreduce,
)
from noloco_jax.netsim.links import DATACENTER, INTERNET, Link, message_time
from noloco_jax.netsim.report import METHODS, report_markdown, sync_report
from noloco_jax.netsim.streaming import streaming_sync

__all__ = [
    "Link",
    "message_time",
    "DATACENTER",
    "INTERNET",
    "paper_allreduce_time",
    "paper_pairwise_time",
    "lognormal_params",
    "expected_max_of_two",
    "expected_max_of_two_mc",
    "simulate_tree_allreduce",
    "allreduce_pairwise_ratio",
    "simulate_global_blocking",
    "ALLREDUCE_ALGORITHMS",
    "allreduce_time",
    "ring_allreduce_time",
    "tree_allreduce_time",
    "group_exchange_time",
    "METHODS",
    "sync_report",
    "report_markdown",
    "streaming_sync",
]
