"""Nodes of a heterogeneous network: latency, bandwidth and compute per node.

Every pair of nodes is joined by a ``netsim.Link`` (SI units: bytes per
second, seconds). The cost of sending ``b`` bytes from node i to node j is the
link's message time plus a constant overhead,
``latency_s[i, j] + b / bytes_per_second[i, j] + overhead_s`` seconds (0 when
i == j), the link cost of SkipPipe's scheduler [SkipPipe code,
``communication_costs.py``].

The 12 regions are the GCP locations named by SkipPipe's geo-distributed
setting. Their latency and bandwidth are *not* measured values: they are
generated deterministically from approximate city coordinates,

* one-way latency = 1 ms + great-circle distance x ROUTE_FACTOR / (200 km/ms)
  (light in fibre, routes ~1.5x longer than the geodesic);
* bandwidth = min(DATACENTER_BYTES_PER_S, TCP_WINDOW_BYTES / RTT) (one TCP
  stream limited by its window), DATACENTER_BYTES_PER_S within a region.

That gives 1-130 ms and 30 MB/s - 1.25 GB/s, the range of public inter-region
measurements; only orderings and relative gaps built on it are meaningful.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from noloco_jax import errors
from noloco_jax.netsim import checks
from noloco_jax.netsim.links import Link, message_time

__all__ = [
    "REGIONS",
    "Network",
    "region_link",
    "from_locations",
    "geo_distributed",
    "single_cluster",
    "five_clusters",
]

# name -> (latitude, longitude) of the GCP region's city (approximate).
REGIONS: dict[str, tuple[float, float]] = {
    "australia": (-33.87, 151.21),  # Sydney
    "belgium": (50.45, 3.82),  # St. Ghislain
    "canada": (45.50, -73.57),  # Montreal
    "germany": (50.11, 8.68),  # Frankfurt
    "iowa": (41.26, -95.86),  # Council Bluffs
    "japan": (35.68, 139.69),  # Tokyo
    "la": (34.05, -118.24),  # Los Angeles
    "nl": (53.44, 6.83),  # Eemshaven
    "oregon": (45.59, -121.18),  # The Dalles
    "singapore": (1.35, 103.82),
    "taiwan": (24.08, 120.54),  # Changhua
    "london": (51.51, -0.13),
}
FIVE_CLUSTER_REGIONS = ("iowa", "germany", "japan", "oregon", "singapore")
EARTH_RADIUS_KM = 6371.0
FIBRE_KM_PER_S = 200_000.0
ROUTE_FACTOR = 1.5
BASE_LATENCY_S = 1e-3
INTRA_REGION_LATENCY_S = 1e-4
DATACENTER_BYTES_PER_S = 1.25e9  # 10 Gbit/s
TCP_WINDOW_BYTES = 8 * 2**20


@dataclasses.dataclass(frozen=True, eq=False)
class Network:
    """Nodes, their links and their compute speed.

    Attributes:
      locations: region name of each node.
      latency_s: (N, N) one-way latency in seconds (diagonal ignored).
      bytes_per_second: (N, N) bandwidth in bytes per second (diagonal ignored).
      compute_s: (N,) forward time ``w`` of one microbatch through one stage on
        each node, in seconds (backward takes 1.5 w, the loss w / 4).
      overhead_s: constant added to every message between two nodes (SkipPipe
        adds 0.35 s of host/device copies per edge; 0 by default).
    """

    locations: tuple[str, ...]
    latency_s: np.ndarray
    bytes_per_second: np.ndarray
    compute_s: np.ndarray
    overhead_s: float = 0.0

    def __post_init__(self) -> None:
        n = len(self.locations)
        if n < 2:
            raise ValueError(f"locations must name at least 2 nodes, got {n}")
        for name in ("latency_s", "bytes_per_second"):
            value = np.asarray(getattr(self, name), dtype=float)
            if value.shape != (n, n):
                raise ValueError(f"{name} must have shape ({n}, {n}), got {value.shape}")
            object.__setattr__(self, name, value)
        off = ~np.eye(n, dtype=bool)
        if not np.all((self.latency_s[off] >= 0) & np.isfinite(self.latency_s[off])):
            raise ValueError("latency_s must be finite and >= 0")
        if not np.all((self.bytes_per_second[off] > 0) & np.isfinite(self.bytes_per_second[off])):
            raise ValueError("bytes_per_second must be finite and > 0")
        compute = np.asarray(self.compute_s, dtype=float)
        if compute.shape != (n,) or not np.all((compute > 0) & np.isfinite(compute)):
            raise ValueError(f"compute_s must be {n} finite values > 0 s, got {compute}")
        object.__setattr__(self, "compute_s", compute)
        object.__setattr__(self, "overhead_s", checks.non_negative("overhead_s", self.overhead_s))

    @property
    def num_nodes(self) -> int:
        """Number of nodes N."""
        return len(self.locations)

    def _check_node_ids(self, src: int, dst: int) -> None:
        for name, node in (("src", src), ("dst", dst)):  # -1 would index the last node
            errors.check_int(name, node, 0, self.num_nodes - 1)

    def link(self, src: int, dst: int) -> Link:
        """The link from node ``src`` to node ``dst`` (two different nodes)."""
        self._check_node_ids(src, dst)
        if src == dst:
            raise ValueError(f"src and dst must be different nodes, got {src} twice")
        return Link(self.bytes_per_second[src, dst], self.latency_s[src, dst])

    def link_time(self, src: int, dst: int, num_bytes: float) -> float:
        """Seconds to send ``num_bytes`` from ``src`` to ``dst`` (0 on the same node)."""
        num_bytes = checks.non_negative("num_bytes", num_bytes)
        self._check_node_ids(src, dst)
        if src == dst:
            return 0.0
        lat, bw = self.latency_s[src, dst], self.bytes_per_second[src, dst]
        return float(message_time(num_bytes, lat, bw) + self.overhead_s)

    def cost_matrix(self, num_bytes: float) -> np.ndarray:
        """(N, N) link times for a message of ``num_bytes`` (zero diagonal)."""
        num_bytes = checks.non_negative("num_bytes", num_bytes)
        eye = np.eye(self.num_nodes, dtype=bool)  # the diagonal (any value) is unused
        cost = message_time(num_bytes, np.where(eye, 0.0, self.latency_s),
                            np.where(eye, 1.0, self.bytes_per_second))  # fmt: skip
        cost = cost + self.overhead_s
        np.fill_diagonal(cost, 0.0)
        return cost


def _distance_km(a: tuple[float, float], b: tuple[float, float]) -> float:
    lat1, lon1, lat2, lon2 = map(math.radians, (*a, *b))
    h = (math.sin((lat2 - lat1) / 2) ** 2
         + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2)  # fmt: skip
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(min(1.0, h)))


def region_link(a: str, b: str) -> Link:
    """The generated link between two regions.

    Args:
      a: region name (a key of ``REGIONS``).
      b: region name.

    Returns:
      The ``Link``; see the module docstring for the model.
    """
    for name, region in (("a", a), ("b", b)):
        if region not in REGIONS:
            raise ValueError(f"{name} must be one of {sorted(REGIONS)}, got {region!r}")
    if a == b:
        return Link(DATACENTER_BYTES_PER_S, INTRA_REGION_LATENCY_S)
    km = _distance_km(REGIONS[a], REGIONS[b])
    latency = BASE_LATENCY_S + km * ROUTE_FACTOR / FIBRE_KM_PER_S
    return Link(min(DATACENTER_BYTES_PER_S, TCP_WINDOW_BYTES / (2 * latency)), latency)


def _compute(num_nodes: int, forward_s: float, compute_spread: float, seed: int) -> np.ndarray:
    forward_s = checks.positive("forward_s", forward_s)
    if not 0 <= compute_spread < 1:
        raise ValueError(f"compute_spread must be in [0, 1), got {compute_spread}")
    rng = np.random.default_rng(errors.check_int("seed", seed, 0))
    return forward_s * (1 + rng.uniform(-compute_spread, compute_spread, num_nodes))


def from_locations(locations: Sequence[str], *, forward_s: float = 1.0,
                   compute_spread: float = 0.0, overhead_s: float = 0.0,
                   seed: int = 0) -> Network:  # fmt: skip
    """A network whose nodes sit in the given regions.

    Args:
      locations: region of each node (keys of ``REGIONS``).
      forward_s: mean forward time ``w`` of one microbatch through one stage.
      compute_spread: per-node compute times are ``forward_s x U(1 - spread,
        1 + spread)`` (0: homogeneous nodes, as in SkipPipe).
      overhead_s: constant per-message overhead in seconds.
      seed: seed of the compute-time draw.

    Returns:
      The ``Network``.
    """
    for k, region in enumerate(locations):  # region_link would name its own argument "a"
        if region not in REGIONS:
            raise ValueError(f"locations[{k}] must be one of {sorted(REGIONS)}, got {region!r}")
    n = len(locations)
    lat = np.zeros((n, n))
    bw = np.full((n, n), DATACENTER_BYTES_PER_S)
    for i in range(n):
        for j in range(n):
            if i != j:
                link = region_link(locations[i], locations[j])
                lat[i, j], bw[i, j] = link.latency_s, link.bytes_per_second
    return Network(tuple(locations), lat, bw, _compute(n, forward_s, compute_spread, seed),
                   overhead_s)  # fmt: skip


def _check_nodes(num_nodes: int) -> None:
    errors.check_int("num_nodes", num_nodes, 2)


def geo_distributed(num_nodes: int, **kwargs) -> Network:
    """Nodes spread round-robin over the 12 regions (SkipPipe's geo-distributed setting).

    Args:
      num_nodes: number of nodes N >= 2.
      **kwargs: ``forward_s``, ``compute_spread``, ``overhead_s``, ``seed`` (see
        ``from_locations``).

    Returns:
      The ``Network``.
    """
    _check_nodes(num_nodes)
    names = sorted(REGIONS)
    return from_locations([names[i % len(names)] for i in range(num_nodes)], **kwargs)


def five_clusters(num_nodes: int, **kwargs) -> Network:
    """Nodes spread round-robin over 5 regions (Iowa, Germany, Japan, Oregon, Singapore).

    Args:
      num_nodes: number of nodes N >= 2.
      **kwargs: as for ``geo_distributed``.

    Returns:
      The ``Network``.
    """
    _check_nodes(num_nodes)
    return from_locations([FIVE_CLUSTER_REGIONS[i % 5] for i in range(num_nodes)], **kwargs)


def single_cluster(num_nodes: int, **kwargs) -> Network:
    """All nodes in one data centre (0.1 ms, 10 Gbit/s links).

    Args:
      num_nodes: number of nodes N >= 2.
      **kwargs: as for ``geo_distributed``.

    Returns:
      The ``Network``.
    """
    _check_nodes(num_nodes)
    return from_locations(["iowa"] * num_nodes, **kwargs)
