"""A network cost model: modeled wall time of a step's collectives.

Standard alpha-beta model (latency ``alpha`` per message, ``1 / bandwidth``
per bit). For ``N`` sites each handing a payload of ``B`` bits:

* ring all-reduce: ``2 (N-1)/N * B / bw + 2 (N-1) * alpha``
* ring all-gather: ``(N-1) * B / bw + (N-1) * alpha``
* parameter server (one server link of bandwidth ``bw``): all-reduce
  ``2 N B / bw + 2 alpha`` (N payloads in, N results out); all-gather
  ``N B / bw + N (N-1) B / bw + 2 alpha``.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005.
"""

from __future__ import annotations

import dataclasses

from dadjax.comm._ledger import CommSummary

TOPOLOGIES = ("ring", "ps")


@dataclasses.dataclass(frozen=True)
class NetworkModel:
  """Bandwidth in bits/s, latency in seconds per message, number of sites."""

  bandwidth: float = 1e9
  latency: float = 50e-6
  num_sites: int = 8
  topology: str = "ring"

  def __post_init__(self):
    if not self.bandwidth > 0:
      raise ValueError(f"bandwidth must be > 0 bits/s, got {self.bandwidth}")
    if not self.latency >= 0:
      raise ValueError(f"latency must be >= 0 s, got {self.latency}")
    if not (isinstance(self.num_sites, int) and self.num_sites >= 1):
      raise ValueError(f"num_sites must be an int >= 1, got {self.num_sites}")
    if self.topology not in TOPOLOGIES:
      raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")

  def allreduce_time(self, bits: int, messages: int = 1) -> float:
    n, bw, a = self.num_sites, self.bandwidth, self.latency
    if n == 1 or (bits == 0 and messages == 0):
      return 0.0
    if self.topology == "ring":
      return 2 * (n - 1) / n * bits / bw + 2 * (n - 1) * a * messages
    return 2 * n * bits / bw + 2 * a * messages

  def allgather_time(self, bits: int, messages: int = 1) -> float:
    n, bw, a = self.num_sites, self.bandwidth, self.latency
    if n == 1 or (bits == 0 and messages == 0):
      return 0.0
    if self.topology == "ring":
      return (n - 1) * bits / bw + (n - 1) * a * messages
    return (n * bits + n * (n - 1) * bits) / bw + 2 * a * messages

  def step_time(self, summary: CommSummary) -> float:
    """Modeled seconds of one step's communication, from a ledger read-out.

    Every collective call recorded in the ledger pays the latency term of
    its kind; the payloads pay the bandwidth term.
    """
    return (self.allreduce_time(max(summary.reduce_bits), summary.reduce_calls)
            + self.allgather_time(max(summary.gather_bits), summary.gather_calls))
