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

from dadjax.comm._bits import Bits, bits_add, bits_const, bits_to_int, bits_zero, host_array
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


def _as_bits(x: BitsLike) -> Bits:
  return x if isinstance(x, Bits) else bits_const(x)


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
  reduce, gather, dense = _as_bits(reduce), _as_bits(gather), _as_bits(dense)
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


def tree_dense_bits(tree: Any) -> int:
  """Bits of an fp32 all-reduce of every array leaf of ``tree`` (trace-time int)."""
  return sum(int(np.prod(jnp.shape(x))) * FP32_BITS for x in jax.tree.leaves(tree))


def _is_stats(x) -> bool:
  return isinstance(x, CommStats)


def find_comm_stats(state: Any) -> list[CommStats]:
  """Every :class:`CommStats` inside an arbitrary (optax) state pytree."""
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
  (:mod:`dadjax.comm._wire`).

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

  @property
  def compression_ratio(self) -> float:
    """fp32 payload bits over sent payload bits, cumulative (the last step if nothing is sent yet).

    A payload ratio: it counts all-gather and all-reduce payloads alike.
    For what the network moves use :meth:`wire_ratio`.
    """
    sent, dense = self.total, self.total_dense
    if sent == 0:
      sent, dense = self.bits_per_step, self.dense_bits_per_step
    return float("inf") if sent == 0 else dense / sent

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

  def wire_ratio(self, num_sites: int, topology: str = "ring", baseline: str = "fp32") -> float:
    """Baseline all-reduce wire bits over this method's wire bits (> 1: the method sends less).

    Args:
      num_sites: ``N`` the ratio is stated for (it depends on it: an
        all-gather's wire bits grow with ``N``, an all-reduce's do not).
      topology: ``"ring"`` or ``"ps"``.
      baseline: ``"fp32"`` or ``"bf16"`` all-reduce.
    """
    if baseline not in ("fp32", "bf16"):
      raise ValueError(f"baseline must be 'fp32' or 'bf16', got {baseline!r}")
    base = (self.fp32_wire_bits if baseline == "fp32" else self.bf16_wire_bits)(num_sites, topology)
    sent = self.wire_bits(num_sites, topology)
    if sent == 0:
      return float("inf") if base else 1.0
    return base / sent

  def headline(self, num_sites: int, topology: str = "ring") -> str:
    """The wire-based ratio with the topology and N it holds for, e.g. ``"12.3x (ring, N=8)"``."""
    ratio = self.wire_ratio(num_sites, topology)
    return f"{ratio:.3g}x vs fp32 all-reduce ({topology}, N={num_sites})"


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
  fields, calls, slow, fast = _summarize(inter)
  intra_fields, intra_calls, _, _ = _summarize(intra)
  return CommSummary(**fields, **calls, updates=slow, micro_steps=fast,
                     intra_reduce_bits=intra_fields["reduce_bits"],
                     intra_gather_bits=intra_fields["gather_bits"],
                     intra_reduce_calls=intra_calls["reduce_calls"],
                     intra_gather_calls=intra_calls["gather_calls"])


def _summarize(found: list[CommStats]):
  """Per-step fields, call counts and the slowest / fastest update count of some ledgers."""
  rates = [int(np.max(host_array(s.updates))) for s in found]
  live = [u for u in rates if u > 0]
  slow, fast = (min(live), max(live)) if live else (0, 0)
  fields = dict(reduce_bits=(0,), gather_bits=(0,), dense_bits=(0,),
                total_bits=(0,), total_dense_bits=(0,), total_gather_bits=(0,))
  calls = {"reduce_calls": 0, "gather_calls": 0}
  for s, u in zip(found, rates):
    num, den = (u, slow) if slow else (1, 1)
    for name, bits in (("reduce_bits", s.step_reduce), ("gather_bits", s.step_gather),
                       ("dense_bits", s.step_dense)):
      fields[name] = _add_tuples(fields[name], _scale(_per_site(bits), num, den))
    fields["total_bits"] = _add_tuples(fields["total_bits"], _per_site(s.total_sent))
    fields["total_dense_bits"] = _add_tuples(fields["total_dense_bits"], _per_site(s.total_dense))
    fields["total_gather_bits"] = _add_tuples(fields["total_gather_bits"],
                                              _per_site(s.total_gather))
    calls["reduce_calls"] += int(np.max(host_array(s.step_reduce_calls))) * num // den
    calls["gather_calls"] += int(np.max(host_array(s.step_gather_calls))) * num // den
  return fields, calls, slow, fast
