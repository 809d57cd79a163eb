"""A network link in SI units (bytes, bytes per second, seconds), shared with SkipPipe.

Sending ``b`` bytes over a link takes ``latency_s + b / bytes_per_second``
seconds: one latency, then the bytes at the link's bandwidth. The network
model (``netsim``) assumes one such link between every pair of replicas;
SkipPipe's ``skippipe.Network`` holds one per pair of nodes.

Gbit/s and milliseconds appear only in ``Link.from_gbit_ms`` and
``Link.describe``, for people.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np

from noloco_jax.netsim import checks

__all__ = ["Link", "message_time", "DATACENTER", "INTERNET"]

Seconds = TypeVar("Seconds", float, np.ndarray)


def message_time(num_bytes: float, latency_s: Seconds, bytes_per_second: Seconds) -> Seconds:
    """Seconds to send one message of ``num_bytes``: latency, then bytes over bandwidth.

    Args:
      num_bytes: the message's size in bytes.
      latency_s: one-way latency in seconds (a number, or an array of links).
      bytes_per_second: bandwidth in bytes per second (same shape as ``latency_s``).

    Returns:
      ``latency_s + num_bytes / bytes_per_second``, with the shape of the links.

    Raises:
      ValueError: ``num_bytes`` or a latency is not a finite number >= 0, or a bandwidth is
        not a finite number > 0.
    """
    checks.non_negative("num_bytes", num_bytes)
    if np.ndim(latency_s) == 0 and np.ndim(bytes_per_second) == 0:
        checks.non_negative("latency_s", latency_s)
        checks.positive("bytes_per_second", bytes_per_second)
    else:
        _check_all(latency_s, bytes_per_second)
    return latency_s + num_bytes / bytes_per_second


def _check_all(latency_s: np.ndarray, bytes_per_second: np.ndarray) -> None:
    """A ValueError unless every latency is finite and >= 0 and every bandwidth finite and > 0."""
    lat, bw = np.asarray(latency_s, dtype=float), np.asarray(bytes_per_second, dtype=float)
    if not np.all((lat >= 0) & np.isfinite(lat)):
        raise ValueError(f"latency_s must be finite and >= 0 everywhere, got {latency_s!r}.")
    if not np.all((bw > 0) & np.isfinite(bw)):
        raise ValueError(f"bytes_per_second must be finite and > 0 everywhere, got "
                         f"{bytes_per_second!r}.")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link, full duplex, the same in both directions.

    Attributes:
      bytes_per_second: bandwidth per direction, > 0.
      latency_s: one-way latency of one message in seconds, >= 0.
    """

    bytes_per_second: float
    latency_s: float

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "bytes_per_second", checks.positive("bytes_per_second", self.bytes_per_second)
        )
        object.__setattr__(self, "latency_s", checks.non_negative("latency_s", self.latency_s))

    @classmethod
    def from_gbit_ms(cls, gbit_per_s: float, latency_ms: float) -> Link:
        """A link given in the units people quote: Gbit/s (1e9 bits/s) and milliseconds.

        Args:
          gbit_per_s: bandwidth in Gbit/s, > 0.
          latency_ms: one-way latency in milliseconds, >= 0.

        Returns:
          The ``Link`` in bytes per second and seconds.
        """
        gbit_per_s = checks.positive("gbit_per_s", gbit_per_s)
        latency_ms = checks.non_negative("latency_ms", latency_ms)
        return cls(bytes_per_second=gbit_per_s * 1e9 / 8.0, latency_s=latency_ms / 1e3)

    def message_time(self, num_bytes: float) -> float:
        """Seconds to send one message of ``num_bytes`` (a finite number >= 0) over this link."""
        num_bytes = checks.non_negative("num_bytes", num_bytes)
        return message_time(num_bytes, self.latency_s, self.bytes_per_second)

    def describe(self) -> str:
        """The link for people, e.g. ``"1 Gbit/s, 50 ms"``."""
        return f"{self.bytes_per_second * 8 / 1e9:g} Gbit/s, {self.latency_s * 1e3:g} ms"


DATACENTER = Link.from_gbit_ms(100.0, 0.01)
INTERNET = Link.from_gbit_ms(1.0, 50.0)
