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

FP32_BITS = 32


class CommStats(NamedTuple):
  """Per-site communication of the last step and since the start.

  All counts are :class:`Bits` (exact 64-bit); ``step_reduce_calls`` and
  ``step_gather_calls`` count the collective calls of each kind in the last
  step (each call pays the network's latency).
  """

  step_reduce: Bits
  step_gather: Bits
  step_dense: Bits
  total_sent: Bits
  total_dense: Bits
  step_reduce_calls: jax.Array
  step_gather_calls: jax.Array
  updates: jax.Array


BitsLike = Bits | int


def _as_bits(x: BitsLike) -> Bits:
  return x if isinstance(x, Bits) else bits_const(x)


def ledger_init() -> CommStats:
  """An empty ledger."""
  z = bits_zero()
  return CommStats(z, z, z, z, z, jnp.int32(0), jnp.int32(0), jnp.int32(0))


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
    The updated ledger.
  """
  reduce, gather, dense = _as_bits(reduce), _as_bits(gather), _as_bits(dense)
  sent = bits_add(reduce, gather)
  return CommStats(
      step_reduce=reduce,
      step_gather=gather,
      step_dense=dense,
      total_sent=bits_add(stats.total_sent, sent),
      total_dense=bits_add(stats.total_dense, dense),
      step_reduce_calls=jnp.asarray(reduce_calls, jnp.int32),
      step_gather_calls=jnp.asarray(gather_calls, jnp.int32),
      updates=stats.updates + 1,
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
  """

  reduce_bits: tuple[int, ...]
  gather_bits: tuple[int, ...]
  dense_bits: tuple[int, ...]
  total_bits: tuple[int, ...]
  total_dense_bits: tuple[int, ...]
  reduce_calls: int
  gather_calls: int
  updates: int

  @property
  def collectives(self) -> int:
    """Collective calls per step, both kinds."""
    return self.reduce_calls + self.gather_calls

  @property
  def bits_per_step(self) -> int:
    return max(r + g for r, g in zip(self.reduce_bits, self.gather_bits))

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
    """fp32 bits over sent bits, cumulative (the last step if nothing is sent yet)."""
    sent, dense = self.total, self.total_dense
    if sent == 0:
      sent, dense = self.bits_per_step, self.dense_bits_per_step
    return float("inf") if sent == 0 else dense / sent


def _per_site(b: Bits) -> tuple[int, ...]:
  v = bits_to_int(b)
  return tuple(v) if isinstance(v, list) else (v,)


def _add_tuples(a, b):
  if len(a) == 1 and len(b) > 1:
    a = a * len(b)
  if len(b) == 1 and len(a) > 1:
    b = b * len(a)
  return tuple(x + y for x, y in zip(a, b))


def comm_stats(state: Any) -> CommSummary:
  """Sum every ledger in ``state`` (any optax state, or a train state).

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
  fields = dict(reduce_bits=(0,), gather_bits=(0,), dense_bits=(0,),
                total_bits=(0,), total_dense_bits=(0,))
  calls = {"reduce_calls": 0, "gather_calls": 0}
  updates = 0
  for s in found:
    fields["reduce_bits"] = _add_tuples(fields["reduce_bits"], _per_site(s.step_reduce))
    fields["gather_bits"] = _add_tuples(fields["gather_bits"], _per_site(s.step_gather))
    fields["dense_bits"] = _add_tuples(fields["dense_bits"], _per_site(s.step_dense))
    fields["total_bits"] = _add_tuples(fields["total_bits"], _per_site(s.total_sent))
    fields["total_dense_bits"] = _add_tuples(fields["total_dense_bits"], _per_site(s.total_dense))
    calls["reduce_calls"] += int(np.max(host_array(s.step_reduce_calls)))
    calls["gather_calls"] += int(np.max(host_array(s.step_gather_calls)))
    updates = max(updates, int(np.max(host_array(s.updates))))
  return CommSummary(**fields, **calls, updates=updates)
