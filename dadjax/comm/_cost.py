"""A network cost model: modeled wall time of a step's collectives.

Standard alpha-beta model: latency ``alpha`` per message, ``1 / bandwidth``
per bit on the busiest link. For ``N`` sites each handing a payload of
``B`` bits to one collective op:

* ring all-reduce: ``2 (N-1)/N * B / bw + 2 (N-1) * alpha``
* ring all-gather: ``(N-1) * B / bw + (N-1) * alpha``
* parameter server (the server's link, bandwidth ``bw``, carries ``N``
  workers' traffic): all-reduce ``2 N B / bw + 2 alpha`` (N payloads in,
  N results out); all-gather ``N B / bw + N (N-1) B / bw + 2 alpha``.

A calibrated mode, :meth:`NetworkModel.calibrated`, keeps the ring's wire
bits but charges what a real ring transport (gloo over TCP, measured in
:mod:`dadjax.netlab`) does: each *call* pays its ring steps (``2(N-1)`` for
an all-reduce, ``N-1`` for an all-gather) at ``rtt_per_step`` round trips
(``2 * latency``, the one-way latency) plus a software floor per step, and
the bytes move at a goodput below the line rate (TCP over Ethernet frames;
the all-gather's own). XLA:CPU issues one gloo call per *operand* of a
combined collective, so pass operand counts as ``ops`` in this mode.

The bandwidth term comes from the ledger's payload bits
(:mod:`dadjax.comm._wire` defines the wire bits). The latency term is
charged per collective *op*: pass the ops the compiled program really runs
(:func:`~dadjax.comm.hlo_collectives`, ``TrainStep.collectives``) as
``ops``; without them every collective call the ledger recorded is charged,
which can be far off either way (XLA combines independent calls, and one
recorded call over a pytree compiles to one op per leaf: TopK's single
recorded all-gather is 12 compiled ops on a 3-layer MLP). Every figure a
user reads goes through :func:`dadjax.comm.report`, which takes the
compiled ops. Ops under ``lax.cond``
appear in the compiled text whether or not their branch runs; for gradient
accumulation over ``k`` micro-steps charge them once per optimizer step.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005.
  Li et al., "Scaling Distributed Machine Learning with the Parameter
  Server", OSDI 2014.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dadjax.comm._ledger import FP32_BITS, CommSummary
from dadjax.comm._wire import TOPOLOGIES, latency_messages, link_load, wire_bits


def _sites(reduce_bits, gather_bits):
  """``(reduce, gather)`` payload of each site (a one-entry tuple stands for every site)."""
  n = max(len(reduce_bits), len(gather_bits))
  pick = lambda bits, i: bits[i] if len(bits) > 1 else bits[0]
  return [(pick(reduce_bits, i), pick(gather_bits, i)) for i in range(n)]


@dataclasses.dataclass(frozen=True)
class TransportFit:
  """Fitted constants of a real ring transport, for :meth:`NetworkModel.calibrated`.

  Attributes:
    rtt_per_step: latency of one ring step, in round trips (``2 * latency``).
    step_overhead: seconds per ring step on top of that (software floor).
    reduce_goodput: all-reduce payload rate over the line rate (in (0, 1]).
    gather_goodput: all-gather payload rate over the line rate (in (0, 1]).
    host_rate: bits/s the hosts themselves move through the transport
      (CPU bound: copies, the reduction, scheduling); the payload moves at
      ``min(goodput * bandwidth, host_rate)``. Default: no such limit.
    source: where the numbers come from.
  """

  rtt_per_step: float = 1.0
  step_overhead: float = 0.0
  reduce_goodput: float = 1.0
  gather_goodput: float = 1.0
  host_rate: float = float("inf")
  source: str = ""

  def __post_init__(self):
    for name in ("rtt_per_step", "step_overhead"):
      if not getattr(self, name) >= 0:
        raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
    for name in ("reduce_goodput", "gather_goodput"):
      if not 0 < getattr(self, name) <= 1:
        raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
    if not self.host_rate > 0:
      raise ValueError(f"host_rate must be > 0 bits/s, got {self.host_rate}")

  def rate(self, kind: str, bandwidth: float) -> float:
    """Payload bits/s of ``kind`` ("reduce" or "gather") over a link of ``bandwidth``."""
    goodput = self.reduce_goodput if kind == "reduce" else self.gather_goodput
    return min(goodput * bandwidth, self.host_rate)


# gloo's ring over TCP between processes in network namespaces, HTB-shaped veth links, the
# delay from a user-space relay, 2 CPU cores shared with other jobs (dadjax.netlab; N = 2, 4;
# 10-1000 Mbit/s; 0-20 ms; 1 KB-64 MB): experiments/results/netlab_calibration.md has every
# point, this fit (median error 15%) and the textbook model's (58%). The software floor and
# host_rate belong to that machine; the round trips per ring step and the goodputs to gloo/TCP.
GLOO_TCP = TransportFit(rtt_per_step=1.10, step_overhead=1.7e-3, reduce_goodput=0.88,
                        gather_goodput=0.76, host_rate=5.0e8,
                        source="experiments/results/netlab_calibration.md")


@dataclasses.dataclass(frozen=True)
class NetworkModel:
  """Bandwidth in bits/s, latency in seconds per message, number of sites, topology.

  ``fit``: a :class:`TransportFit` (see :meth:`calibrated`); ``None`` is the
  textbook alpha-beta model.
  """

  bandwidth: float = 1e9
  latency: float = 50e-6
  num_sites: int = 8
  topology: str = "ring"
  fit: TransportFit | None = None

  @classmethod
  def calibrated(cls, bandwidth: float, latency: float, num_sites: int,
                 fit: TransportFit | None = None) -> "NetworkModel":
    """A ring model with a measured transport's constants (default :data:`GLOO_TCP`).

    Args:
      bandwidth: the link's line rate, bits/s.
      latency: the link's one-way delay, seconds (a ring step costs
        ``fit.rtt_per_step * 2 * latency + fit.step_overhead``).
      num_sites: sites in the ring.
      fit: the transport's constants (default: gloo over TCP as measured by
        ``experiments/netlab_calibration.py``).

    Its ``allreduce_time(bits, messages)`` / ``allgather_time`` take
    ``messages`` = gloo calls, i.e. the *operands* of the compiled
    collectives (:attr:`CollectiveOps.operands <dadjax.comm.CollectiveOps>`),
    not the ops; its :meth:`step_time` and :meth:`peak_step_time`, given
    a :class:`~dadjax.comm.CollectiveOps`, charge those operands (the
    conditional ones of a local-update method once per period, as for ops).
    """
    return cls(bandwidth, latency, num_sites, "ring", GLOO_TCP if fit is None else fit)

  def __post_init__(self):
    if not self.bandwidth > 0:
      raise ValueError(f"bandwidth must be > 0 bits/s, got {self.bandwidth}")
    if not self.latency >= 0:
      raise ValueError(f"latency must be >= 0 s, got {self.latency}")
    if isinstance(self.num_sites, bool) or not (isinstance(self.num_sites, int)
                                                and self.num_sites >= 1):
      raise ValueError(f"num_sites must be an int >= 1, got {self.num_sites}")
    if self.topology not in TOPOLOGIES:
      raise ValueError(f"topology must be one of {TOPOLOGIES}, got {self.topology!r}")
    if self.fit is not None and not isinstance(self.fit, TransportFit):
      raise ValueError(f"fit must be a TransportFit or None, got {self.fit!r}")
    if self.fit is not None and self.topology != "ring":
      raise ValueError(f"a TransportFit describes a ring; topology must be 'ring', got "
                       f"{self.topology!r}")

  def wire_bits(self, kind: str, bits: int) -> float:
    """Wire bits per site for a payload of ``bits`` per site handed to ``kind``."""
    return wire_bits(kind, bits, self.num_sites, self.topology)

  def _time(self, kind: str, bits: int, messages: int) -> float:
    n = self.num_sites
    if n == 1:
      return 0.0
    busiest = self.wire_bits(kind, bits) * link_load(n, self.topology)
    messages_total = latency_messages(kind, n, self.topology) * messages
    if self.fit is not None:
      step = self.fit.rtt_per_step * 2 * self.latency + self.fit.step_overhead
      return busiest / self.fit.rate(kind, self.bandwidth) + messages_total * step
    return busiest / self.bandwidth + messages_total * self.latency

  def allreduce_time(self, bits: int, messages: int = 1) -> float:
    """Seconds of ``messages`` all-reduce ops moving ``bits`` payload bits per site in all."""
    return self._time("reduce", bits, messages)

  def allgather_time(self, bits: int, messages: int = 1) -> float:
    """Seconds of ``messages`` all-gather ops moving ``bits`` payload bits per site in all."""
    return self._time("gather", bits, messages)

  def step_time(self, summary: CommSummary, ops: Any = None) -> float:
    """Modeled seconds of one optimizer step's communication.

    Args:
      summary: a ledger read-out (:func:`~dadjax.comm_stats`): payload bits.
      ops: the compiled program's collective ops (a
        :class:`~dadjax.comm.CollectiveOps`, or a dict ``{"reduce": n,
        "gather": m}``); each pays the latency term of its kind. ``None``:
        charge every call the ledger recorded.

    Returns:
      Seconds of the slowest site (the one a synchronous step waits for):
      the largest, over the sites, of that site's all-reduce time plus its
      all-gather time. "Largest site" means the same as in
      :attr:`~dadjax.comm.CommSummary.bits_per_step`: the site whose whole
      step is largest, not the busiest site of each kind taken apart.
    """
    reduce_ops, gather_ops = self._ops(summary, ops, per_operand=self.fit is not None)
    return max(self.allreduce_time(r, reduce_ops) + self.allgather_time(g, gather_ops)
               for r, g in _sites(summary.reduce_bits, summary.gather_bits))

  def peak_step_time(self, summary: CommSummary, ops: Any = None) -> float:
    """Modeled seconds of the busiest step's communication.

    :meth:`step_time` is the mean over the optimizer steps; a method that
    communicates on some steps only (local updates, a
    :class:`~dadjax.comm.PeriodicStats` ledger) sends its whole exchange on
    those steps, which is where a slow link stalls. Without such a ledger
    the two are equal.

    Args:
      summary: a ledger read-out (:func:`~dadjax.comm_stats`).
      ops: as for :meth:`step_time` (the conditional ops of a local-update
        method charged at the busy step's share); ``None`` charges the
        busiest step's recorded calls.
    """
    if not summary.peak_reduce_bits:
      return self.step_time(summary, ops)
    reduce_ops, gather_ops = self._ops(summary, ops, peak=True, per_operand=self.fit is not None)
    return (self.allreduce_time(max(summary.peak_reduce_bits), reduce_ops)
            + self.allgather_time(max(summary.peak_gather_bits), gather_ops))

  def baseline_time(self, summary: CommSummary, number_bits: int = FP32_BITS,
                    ops: int = 1) -> float:
    """Seconds of an all-reduce of the same tensors in ``number_bits`` floats (fp32 or bf16)."""
    return self.allreduce_time(summary.dense_bits_per_step // FP32_BITS * number_bits, ops)

  @staticmethod
  def _ops(summary: CommSummary, ops, peak: bool = False,
           per_operand: bool = False) -> tuple[float, float]:
    if ops is None:
      if peak and summary.peak_reduce_calls is not None:
        return summary.peak_reduce_calls, summary.peak_gather_calls
      return summary.reduce_calls, summary.gather_calls
    count = getattr(ops, "count", ops)
    cond = getattr(ops, "conditional_count", None)
    if per_operand and getattr(ops, "operands", None):
      # A calibrated (gloo) model: every operand of a combined op is its own call.
      count, cond = ops.operands, ops.conditional_operands
    # An all-to-all op is booked and charged as an all-gather (N - 1 messages;
    # dadjax.comm._metered.metered_all_to_all).
    count, cond = _all_to_all_as_gather(count), _all_to_all_as_gather(cond)
    if summary.exchange_rate is None or cond is None:
      return int(count.get("reduce", 0)), int(count.get("gather", 0))
    # A method that communicates on some steps only (local updates): its
    # collectives sit in conditional branches that run once per period
    # (the mean step), a share of them on a busy step (the peak).
    share = summary.peak_share if peak else summary.exchange_rate
    return tuple(int(count.get(k, 0)) - int(cond.get(k, 0)) + share * int(cond.get(k, 0))
                 for k in ("reduce", "gather"))


def _all_to_all_as_gather(count):
  """``count`` (ops per kind) with its all-to-all ops added to the all-gather ones."""
  if not count or not count.get("all_to_all"):
    return count
  return {**count, "gather": count.get("gather", 0) + count["all_to_all"]}


@dataclasses.dataclass(frozen=True)
class HierarchicalNetwork:
  """Two link classes: fast links inside a site, slow links between sites.

  For a 2-D mesh (``num_sites`` sites of ``per_site`` devices each). The
  in-site averaging (the ledger's ``intra_*`` fields) runs on the in-site
  links, a ring over ``per_site`` devices; the methods' collectives (the
  ledger's main fields) run on the inter-site links, a ring (or parameter
  server) over ``num_sites`` sites. Every device of a site runs the
  site-axis collectives over its own inter-site link, in parallel with the
  site's other devices (multi-slice TPU: one DCN path per host), so the
  ledger's per-device payload sets the time. The step's communication time
  is the sum of both phases (the in-site average finishes before the
  method runs).

  Attributes:
    inter: the :class:`NetworkModel` between sites (``num_sites`` sites;
      e.g. 1-25 Gbit/s, ~1 ms).
    intra_bandwidth: in-site link bandwidth in bits/s (default 800e9 =
      100 GB/s, NVLink / ICI class).
    intra_latency: seconds per in-site message (default 5 us).
    per_site: devices per site (``>= 1``; 1: no in-site traffic).
  """

  inter: NetworkModel = NetworkModel()
  intra_bandwidth: float = 800e9
  intra_latency: float = 5e-6
  per_site: int = 1

  def __post_init__(self):
    if not isinstance(self.inter, NetworkModel):
      raise ValueError(f"inter must be a NetworkModel, got {self.inter!r}")
    if isinstance(self.per_site, bool) or not (isinstance(self.per_site, int)
                                               and self.per_site >= 1):
      raise ValueError(f"per_site must be an int >= 1, got {self.per_site}")

  @property
  def intra(self) -> NetworkModel:
    """The in-site links as a ring :class:`NetworkModel` over ``per_site`` devices."""
    return NetworkModel(self.intra_bandwidth, self.intra_latency, self.per_site, "ring")

  def intra_time(self, summary: CommSummary, ops: Any = None) -> float:
    """Seconds of the in-site phase.

    ``ops``: the in-site compiled ops (default: the ledger's in-site calls).
    """
    if ops is None:
      reduce_ops, gather_ops = summary.intra_reduce_calls, summary.intra_gather_calls
    else:
      reduce_ops, gather_ops = NetworkModel._ops(summary, ops)
    return max(self.intra.allreduce_time(r, reduce_ops) + self.intra.allgather_time(g, gather_ops)
               for r, g in _sites(summary.intra_reduce_bits, summary.intra_gather_bits))

  def inter_time(self, summary: CommSummary, ops: Any = None) -> float:
    """Seconds of the inter-site phase (the methods' collectives)."""
    return self.inter.step_time(summary, ops)

  def step_time(self, summary: CommSummary, ops: Any = None, intra_ops: Any = None) -> float:
    """Modeled seconds of one step: in-site phase plus inter-site phase.

    Args:
      summary: a ledger read-out (:func:`~dadjax.comm_stats`).
      ops: the compiled inter-site ops (``TrainStep.collectives(...,
        link="inter")``) or ``None`` for the ledger's calls.
      intra_ops: the compiled in-site ops (``link="intra"``) or ``None``.
    """
    return self.intra_time(summary, intra_ops) + self.inter_time(summary, ops)
