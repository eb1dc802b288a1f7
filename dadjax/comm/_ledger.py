"""The bit ledger: what each site put on the wire, kept in optimizer state.

Every communicating transformation keeps a :class:`CommStats` in its state
and records, per step, the bits this site contributed to all-reduce (psum)
and all-gather collectives, plus the bits an uncompressed fp32 all-reduce of
the same tensors would have cost. :func:`comm_stats` finds every
``CommStats`` in any optax state (through ``optax.chain``, ``masked``,
``partition``, ``MultiSteps`` ...) and sums them on the host.

"Bits a site put on the wire" is the size of its payload as handed to the
collective, not the ring's internal traffic; :mod:`dadjax.comm._cost` turns
payload sizes into modeled time for a given topology.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.bits import (Bits, as_bits, bits_add, bits_const, bits_to_int, bits_zero,
                               host_array)
from dadjax.comm._wire import wire_bits

FP32_BITS = 32


class CommStats(NamedTuple):
  """Per-site communication of the last step and since the start.

  All counts are :class:`Bits` (exact 64-bit); ``step_reduce_calls`` and
  ``step_gather_calls`` count the collective calls of each kind in the last
  step (each call pays the network's latency). ``total_sent`` counts both
  kinds since the start, ``total_gather`` the all-gather part of it (the
  kinds cost different wire bits, so cumulative wire bits need the split).
  """

  step_reduce: Bits
  step_gather: Bits
  step_dense: Bits
  total_sent: Bits
  total_dense: Bits
  step_reduce_calls: jax.Array
  step_gather_calls: jax.Array
  updates: jax.Array
  total_gather: Bits


class IntraSiteStats(CommStats):
  """A ledger of traffic *inside* a site (the fast in-site links).

  Same fields as :class:`CommStats`. With a 2-D mesh (sites made of several
  devices) the train step books the exact in-site averaging here, apart
  from the inter-site traffic the methods send; :func:`comm_stats` reports
  it in the ``intra_*`` fields of :class:`CommSummary` and never adds it to
  the inter-site numbers.
  """

  __slots__ = ()


BitsLike = Bits | int


def ledger_init() -> CommStats:
  """An empty ledger."""
  z = bits_zero()
  return CommStats(z, z, z, z, z, jnp.int32(0), jnp.int32(0), jnp.int32(0), z)


def intra_ledger_init() -> IntraSiteStats:
  """An empty in-site ledger (:class:`IntraSiteStats`)."""
  return IntraSiteStats(*ledger_init())


def ledger_record(
    stats: CommStats,
    *,
    reduce: BitsLike = 0,
    gather: BitsLike = 0,
    dense: BitsLike = 0,
    reduce_calls: int | jax.Array = 0,
    gather_calls: int | jax.Array = 0,
) -> CommStats:
  """Replace the last step's numbers and add them to the running totals.

  Args:
    stats: the ledger to update.
    reduce: bits this site handed to all-reduce collectives this step
      (Python int when known at trace time, :class:`Bits` when traced).
    gather: bits this site handed to all-gather collectives this step.
    dense: bits an fp32 all-reduce of the same tensors would have sent.
    reduce_calls: number of all-reduce calls this step.
    gather_calls: number of all-gather calls this step.

  Returns:
    The updated ledger (of the same class as ``stats``).
  """
  reduce, gather, dense = as_bits(reduce), as_bits(gather), as_bits(dense)
  sent = bits_add(reduce, gather)
  return type(stats)(
      step_reduce=reduce,
      step_gather=gather,
      step_dense=dense,
      total_sent=bits_add(stats.total_sent, sent),
      total_dense=bits_add(stats.total_dense, dense),
      step_reduce_calls=jnp.asarray(reduce_calls, jnp.int32),
      step_gather_calls=jnp.asarray(gather_calls, jnp.int32),
      updates=stats.updates + 1,
      total_gather=bits_add(stats.total_gather, gather),
  )


class PeriodicStats(NamedTuple):
  """The ledger of a transformation that communicates on some optimizer steps only.

  Local-update methods (:mod:`dadjax.local`) exchange every ``H`` steps, or
  one fragment of the parameters at a time. Such a ledger is recorded on
  *every* optimizer step (zero bits on the steps without an exchange) and
  keeps per-kind totals and the largest step, so :func:`comm_stats` reports
  the mean per optimizer step (a DiLoCo run at ``H = 100`` shows a payload
  of ``payload / 100`` bits per step) and, apart, the peak step
  (:attr:`CommSummary.peak_bits_per_step`, where a slow link stalls).

  Attributes:
    reduce, gather: total bits handed to all-reduce / all-gather collectives.
    dense: total bits of the dense reference: an fp32 all-reduce of the
      parameters on every optimizer step (synchronous training).
    reduce_calls, gather_calls: total collective calls of each kind (int32).
    peak_reduce, peak_gather, peak_reduce_calls, peak_gather_calls: the
      step that sent the most bits so far (its split by kind, its calls).
    updates: optimizer steps recorded (int32).
    period: steps between two exchanges of the same tensors (``H``, int32).
    parts: exchanges per period, on different steps (fragments, int32).
      With ``period`` it says how often the collectives in the compiled
      program's conditional branches run: each once per ``period`` steps,
      ``1 / parts`` of them on a busy step.
  """

  reduce: Bits
  gather: Bits
  dense: Bits
  reduce_calls: jax.Array
  gather_calls: jax.Array
  peak_reduce: Bits
  peak_gather: Bits
  peak_reduce_calls: jax.Array
  peak_gather_calls: jax.Array
  updates: jax.Array
  period: jax.Array
  parts: jax.Array


def periodic_init(period: int = 1, parts: int = 1) -> PeriodicStats:
  """An empty :class:`PeriodicStats` of exchanges every ``period`` steps in ``parts`` parts."""
  z, i = bits_zero(), jnp.int32(0)
  return PeriodicStats(z, z, z, i, i, z, z, i, i, i, jnp.int32(period), jnp.int32(parts))


def _bits_greater(a: Bits, b: Bits) -> jax.Array:
  return (a.hi > b.hi) | ((a.hi == b.hi) & (a.lo > b.lo))


def periodic_record(
    stats: PeriodicStats,
    *,
    reduce: BitsLike = 0,
    gather: BitsLike = 0,
    dense: BitsLike = 0,
    reduce_calls: int | jax.Array = 0,
    gather_calls: int | jax.Array = 0,
) -> PeriodicStats:
  """Record one optimizer step (its exchange, or zeros on a step without one).

  Args: as :func:`ledger_record`; ``dense`` is this step's dense reference.

  Returns:
    The updated :class:`PeriodicStats`.
  """
  reduce, gather, dense = as_bits(reduce), as_bits(gather), as_bits(dense)
  reduce_calls = jnp.asarray(reduce_calls, jnp.int32)
  gather_calls = jnp.asarray(gather_calls, jnp.int32)
  more = _bits_greater(bits_add(reduce, gather), bits_add(stats.peak_reduce, stats.peak_gather))
  pick = lambda new, old: jax.tree.map(lambda n, o: jnp.where(more, n, o), new, old)
  return PeriodicStats(
      reduce=bits_add(stats.reduce, reduce),
      gather=bits_add(stats.gather, gather),
      dense=bits_add(stats.dense, dense),
      reduce_calls=stats.reduce_calls + reduce_calls,
      gather_calls=stats.gather_calls + gather_calls,
      peak_reduce=pick(reduce, stats.peak_reduce),
      peak_gather=pick(gather, stats.peak_gather),
      peak_reduce_calls=pick(reduce_calls, stats.peak_reduce_calls),
      peak_gather_calls=pick(gather_calls, stats.peak_gather_calls),
      updates=stats.updates + 1,
      period=stats.period,
      parts=stats.parts,
  )


def tree_dense_bits(tree: Any) -> int:
  """Bits of an fp32 all-reduce of every array leaf of ``tree`` (trace-time int)."""
  return sum(int(np.prod(jnp.shape(x))) * FP32_BITS for x in jax.tree.leaves(tree))


def _is_stats(x) -> bool:
  return isinstance(x, (CommStats, PeriodicStats))


def find_comm_stats(state: Any) -> list[CommStats | PeriodicStats]:
  """Every :class:`CommStats` and :class:`PeriodicStats` inside an arbitrary (optax) state pytree."""
  return [x for x in jax.tree.leaves(state, is_leaf=_is_stats) if _is_stats(x)]


@dataclasses.dataclass(frozen=True)
class CommSummary:
  """Host-side read-out of the ledger (exact Python ints).

  When the state is stacked per site (the train step's layout), each count
  is a tuple with one entry per site and the scalar properties report the
  largest site, the one a synchronous collective waits for.

  Per-step numbers are per *optimizer step*: ledgers updated at different
  rates (a ledger outside a gradient accumulator records every micro-step,
  one inside it every k-th) are scaled to the slowest rate before they are
  added (see :func:`comm_stats`). ``micro_steps`` is the fastest rate's
  count, so ``bits_per_step * updates / micro_steps`` is per micro-step.

  Payload bits are what a site hands to collectives; wire bits
  (:meth:`wire_bits`) are what the topology moves for them
  (:mod:`dadjax.comm._wire`). These are the ledger's counts and their
  conversion to wire bits; ratios, baselines and modeled times, every
  number a user reads, come from :func:`~dadjax.comm.report`.

  A :class:`PeriodicStats` ledger (a method that communicates on some
  steps only) contributes its mean per optimizer step to the per-step
  fields (``reduce_calls`` / ``gather_calls`` may then be fractions) and
  its busiest step to the ``peak_*`` fields (:attr:`peak_bits_per_step`;
  empty / ``None`` when no such ledger is present: the peak is the step).
  ``exchange_rate`` is then the fraction of steps on which its compiled
  conditional collectives run (``1 / H``) and ``peak_share`` the fraction
  of them a busy step runs (``1 / fragments``); the network model charges
  compiled ops at these rates.

  With a 2-D mesh every count is per *device* (each device of a site runs
  the site-axis collectives over its own links, in parallel with the
  site's other devices). The main fields are inter-site traffic (what the
  methods send over the site axis); ``intra_*`` is the exact in-site
  averaging (:class:`IntraSiteStats` ledgers), zero on a 1-D mesh.
  """

  reduce_bits: tuple[int, ...]
  gather_bits: tuple[int, ...]
  dense_bits: tuple[int, ...]
  total_bits: tuple[int, ...]
  total_dense_bits: tuple[int, ...]
  reduce_calls: int
  gather_calls: int
  updates: int
  micro_steps: int = 0
  intra_reduce_bits: tuple[int, ...] = (0,)
  intra_gather_bits: tuple[int, ...] = (0,)
  intra_reduce_calls: int = 0
  intra_gather_calls: int = 0
  total_gather_bits: tuple[int, ...] = (0,)
  peak_reduce_bits: tuple[int, ...] = ()
  peak_gather_bits: tuple[int, ...] = ()
  peak_reduce_calls: int | None = None
  peak_gather_calls: int | None = None
  exchange_rate: float | None = None
  peak_share: float | None = None

  @property
  def peak_bits_per_step(self) -> int:
    """Payload bits of the busiest step (largest site).

    Equals :attr:`bits_per_step` unless a ledger communicates on some steps
    only (:class:`PeriodicStats`: local updates), whose largest step counts
    here; with several such ledgers, the sum of each one's largest step (an
    upper bound when their busiest steps differ).
    """
    if not self.peak_reduce_bits:
      return self.bits_per_step
    return max(r + g for r, g in zip(self.peak_reduce_bits, self.peak_gather_bits))

  @property
  def intra_bits_per_step(self) -> int:
    """In-site payload bits per step (largest site; 0 on a 1-D mesh)."""
    return max(r + g for r, g in zip(self.intra_reduce_bits, self.intra_gather_bits))

  @property
  def collectives(self) -> int:
    """Collective calls per step, both kinds."""
    return self.reduce_calls + self.gather_calls

  @property
  def bits_per_step(self) -> int:
    """Payload bits per optimizer step (largest site)."""
    return max(r + g for r, g in zip(self.reduce_bits, self.gather_bits))

  @property
  def bits_per_micro_step(self) -> float:
    """Payload bits per micro-step (equals :attr:`bits_per_step` without accumulation)."""
    if not self.micro_steps or self.micro_steps == self.updates:
      return float(self.bits_per_step)
    return self.bits_per_step * self.updates / self.micro_steps

  @property
  def dense_bits_per_step(self) -> int:
    return max(self.dense_bits)

  @property
  def total(self) -> int:
    return max(self.total_bits)

  @property
  def total_dense(self) -> int:
    return max(self.total_dense_bits)

  def wire_bits(self, num_sites: int, topology: str = "ring") -> float:
    """Wire bits per site and optimizer step for ``num_sites`` sites (:mod:`~dadjax.comm._wire`)."""
    return max(wire_bits("reduce", r, num_sites, topology)
               + wire_bits("gather", g, num_sites, topology)
               for r, g in zip(self.reduce_bits, self.gather_bits))

  def total_wire_bits(self, num_sites: int, topology: str = "ring") -> float:
    """Cumulative wire bits per site since the start (largest site), each kind at its factor."""
    return max(wire_bits("reduce", t - g, num_sites, topology)
               + wire_bits("gather", g, num_sites, topology)
               for t, g in zip(self.total_bits, _broadcast(self.total_gather_bits,
                                                            len(self.total_bits))))

  def fp32_wire_bits(self, num_sites: int, topology: str = "ring") -> float:
    """Wire bits per site of an fp32 all-reduce of the same tensors."""
    return wire_bits("reduce", self.dense_bits_per_step, num_sites, topology)

  def bf16_wire_bits(self, num_sites: int, topology: str = "ring") -> float:
    """Wire bits per site of a bf16 all-reduce of the same tensors (the second baseline)."""
    return wire_bits("reduce", self.dense_bits_per_step // FP32_BITS * 16, num_sites, topology)


def _per_site(b: Bits) -> tuple[int, ...]:
  v = bits_to_int(b)
  return tuple(v) if isinstance(v, list) else (v,)


def _broadcast(values: tuple[int, ...], n: int) -> tuple[int, ...]:
  return values * n if len(values) == 1 and n > 1 else values


def _add_tuples(a, b):
  if len(a) == 1 and len(b) > 1:
    a = a * len(b)
  if len(b) == 1 and len(a) > 1:
    b = b * len(a)
  return tuple(x + y for x, y in zip(a, b))


def _scale(values: tuple[int, ...], num: int, den: int) -> tuple[int, ...]:
  return tuple(v * num // den for v in values)


def comm_stats(state: Any) -> CommSummary:
  """Sum every ledger in ``state`` (any optax state, or a train state).

  Ledgers may record at different rates: with gradient accumulation over
  ``k`` micro-steps a ledger inside the accumulator records once per
  optimizer step and one outside it (e.g. :func:`dadjax.dad.model_ledger`
  for layers that communicate in every backward pass) every micro-step.
  The per-step numbers are per optimizer step: a ledger that recorded
  ``u_i`` times contributes its last step's numbers times ``u_i / u_min``,
  where ``u_min`` is the fewest updates of any ledger that has recorded
  (exact when, as for every dadjax method, a ledger records the same
  traffic at each of its updates within an optimizer step). Totals are sums.

  Args:
    state: a pytree holding one or more :class:`CommStats`, for example
      ``opt_state`` of ``optax.chain(dadjax.allreduce("data"), optax.sgd(.1))``.

  Returns:
    A :class:`CommSummary` of exact Python ints.

  Raises:
    ValueError: if ``state`` holds no ledger.
  """
  found = find_comm_stats(state)
  if not found:
    raise ValueError("comm_stats: the state holds no CommStats; is a dadjax "
                     "communicating transformation part of the optimizer?")
  inter = [x for x in found if not isinstance(x, IntraSiteStats)]
  intra = [x for x in found if isinstance(x, IntraSiteStats)]
  fields, calls, slow, fast, peak = _summarize(inter)
  intra_fields, intra_calls, _, _, _ = _summarize(intra)
  return CommSummary(**fields, **calls, **peak, updates=slow, micro_steps=fast,
                     intra_reduce_bits=intra_fields["reduce_bits"],
                     intra_gather_bits=intra_fields["gather_bits"],
                     intra_reduce_calls=intra_calls["reduce_calls"],
                     intra_gather_calls=intra_calls["gather_calls"])


def _summarize(found: list):
  """Per-step fields, call counts, the slowest / fastest update count and the peak of some ledgers."""
  rates = [int(np.max(host_array(s.updates))) for s in found]
  live = [u for u in rates if u > 0]
  slow, fast = (min(live), max(live)) if live else (0, 0)
  fields = dict(reduce_bits=(0,), gather_bits=(0,), dense_bits=(0,),
                total_bits=(0,), total_dense_bits=(0,), total_gather_bits=(0,))
  calls = {"reduce_calls": 0, "gather_calls": 0}
  peak = dict(peak_reduce_bits=(0,), peak_gather_bits=(0,), peak_reduce_calls=0,
              peak_gather_calls=0)
  periodic, rate, share = False, 0.0, 0.0
  for s, u in zip(found, rates):
    num, den = (u, slow) if slow else (1, 1)
    if isinstance(s, PeriodicStats):
      periodic = True
      rate = max(rate, 1 / max(int(np.max(host_array(s.period))), 1))
      share = max(share, 1 / max(int(np.max(host_array(s.parts))), 1))
      steps = max(slow, 1)  # the mean over the optimizer steps
      reduce, gather = _per_site(s.reduce), _per_site(s.gather)
      fields["reduce_bits"] = _add_tuples(fields["reduce_bits"], _scale(reduce, 1, steps))
      fields["gather_bits"] = _add_tuples(fields["gather_bits"], _scale(gather, 1, steps))
      fields["dense_bits"] = _add_tuples(fields["dense_bits"], _scale(_per_site(s.dense), 1, steps))
      fields["total_bits"] = _add_tuples(fields["total_bits"], _add_tuples(reduce, gather))
      fields["total_dense_bits"] = _add_tuples(fields["total_dense_bits"], _per_site(s.dense))
      fields["total_gather_bits"] = _add_tuples(fields["total_gather_bits"], gather)
      calls["reduce_calls"] += int(np.max(host_array(s.reduce_calls))) / steps
      calls["gather_calls"] += int(np.max(host_array(s.gather_calls))) / steps
      peak["peak_reduce_bits"] = _add_tuples(peak["peak_reduce_bits"], _per_site(s.peak_reduce))
      peak["peak_gather_bits"] = _add_tuples(peak["peak_gather_bits"], _per_site(s.peak_gather))
      peak["peak_reduce_calls"] += int(np.max(host_array(s.peak_reduce_calls)))
      peak["peak_gather_calls"] += int(np.max(host_array(s.peak_gather_calls)))
      continue
    for name, bits in (("reduce_bits", s.step_reduce), ("gather_bits", s.step_gather),
                       ("dense_bits", s.step_dense)):
      scaled = _scale(_per_site(bits), num, den)
      fields[name] = _add_tuples(fields[name], scaled)
      if name != "dense_bits":
        peak[f"peak_{name}"] = _add_tuples(peak[f"peak_{name}"], scaled)
    fields["total_bits"] = _add_tuples(fields["total_bits"], _per_site(s.total_sent))
    fields["total_dense_bits"] = _add_tuples(fields["total_dense_bits"], _per_site(s.total_dense))
    fields["total_gather_bits"] = _add_tuples(fields["total_gather_bits"],
                                              _per_site(s.total_gather))
    for kind, value in (("reduce", s.step_reduce_calls), ("gather", s.step_gather_calls)):
      n = int(np.max(host_array(value))) * num // den
      calls[f"{kind}_calls"] += n
      peak[f"peak_{kind}_calls"] += n
  for kind in ("reduce_calls", "gather_calls"):
    if float(calls[kind]).is_integer():
      calls[kind] = int(calls[kind])
  if not periodic:
    peak = dict(peak_reduce_bits=(), peak_gather_bits=(), peak_reduce_calls=None,
                peak_gather_calls=None)
  else:
    peak.update(exchange_rate=rate, peak_share=share)
  return fields, calls, slow, fast, peak
