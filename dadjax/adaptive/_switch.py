"""Accordion's per-tensor switch, run as a few batched exchanges per shape group.

The tensors Accordion compresses are split (statically, at trace time) into
*groups* of equal shape and dtype. A group of ``B`` members is cut into the
static chunks of :func:`chunk_sizes` (``1, 2, 4, ...`` and a remainder:
``floor(log2 B) + 1`` chunks). Each step the members are placed, by their
decisions, so that every chunk holds members of one setting (the members that
chose ``low`` fill whole chunks totalling their count, :func:`chunk_low`); each
chunk runs its setting's one-tensor exchanges as one ``jax.vmap`` (their
collectives become one collective over the stacked payloads) under one
``lax.cond`` on the chunk's setting, and the results return to their members.
So a step compiles ``2 (floor(log2 B) + 1)`` exchanges per group instead of
``2 B``, and every member's result is the one of its own exchange (same keys,
same state); the setting it did not choose keeps its state.

What a step sends: exactly the per-tensor decisions' payloads, each member's
chosen setting once, whether the members of a group agree or not (earlier
releases ran one exchange per setting over the whole group, and a group whose
members disagreed sent both settings' payloads for all of them).

Shared error-feedback memory: when both settings of a tensor keep a residual
memory of the same shape (``error_feedback(...)`` or PowerSGD's own), one
memory is kept per tensor (:func:`split_memory`) and handed to whichever
setting runs; see :func:`~dadjax.adaptive.accordion` for the semantics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from dadjax._core.bits import Bits, as_bits, bits_add, bits_sum, bits_zero
from dadjax._core.vma import cond
from dadjax.compress import ErrorFeedbackState, PowerSGDState, exchange, grouping, leaf_keys


def compressed(leaf) -> bool:
  """Whether Accordion compresses ``leaf`` (ndim >= 2)."""
  return len(jnp.shape(leaf)) >= 2


def shape_groups(leaves) -> tuple[tuple[int, ...], ...]:
  """Positions of the compressed leaves, grouped by (shape, dtype), groups in first-member order."""
  groups: dict = {}
  for i, x in enumerate(leaves):
    if compressed(x):
      groups.setdefault((tuple(jnp.shape(x)), jnp.result_type(x)), []).append(i)
  return tuple(tuple(g) for g in groups.values())


def _memory(state) -> Any:
  if isinstance(state, (ErrorFeedbackState, PowerSGDState)):
    return state.memory
  return None


def split_memory(low_state, high_state) -> tuple[Any, Any, Any]:
  """``(low_state, high_state, memory)`` with one memory for both settings, if they can share.

  They share when both states keep a non-empty residual memory
  (:class:`~dadjax.compress.ErrorFeedbackState` or
  :class:`~dadjax.compress.PowerSGDState`) of equal structure, shapes and
  dtypes: the memory is returned once and both states hold ``memory=()``.
  Otherwise the states are returned as they are with ``memory = ()``.
  """
  a, b = _memory(low_state), _memory(high_state)
  if a is None or b is None or not jax.tree.leaves(a):
    return low_state, high_state, ()
  same = (jax.tree.structure(a) == jax.tree.structure(b)
          and all(x.shape == y.shape and x.dtype == y.dtype
                  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))
  if not same:
    return low_state, high_state, ()
  return low_state._replace(memory=()), high_state._replace(memory=()), a


def _with_memory(state, memory):
  return state._replace(memory=memory) if jax.tree.leaves(memory) else state


def _stack(trees):
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def _unstack(tree, b):
  return jax.tree.map(lambda x: x[b], tree)


def chunk_sizes(members: int) -> tuple[int, ...]:
  """Static chunk sizes of a group of ``members``: ``1, 2, 4, ..., 2**(m-1)`` and a remainder.

  ``m`` is the largest with ``2**m - 1 <= members``; the remainder ``members - (2**m - 1)``
  (absent when 0) is below ``2**m``. Every count ``k`` in ``[0, members]`` is the total size of
  a subset of these chunks (:func:`chunk_low`), so the members that chose ``low`` fill whole
  chunks and the others fill the rest: ``floor(log2(members)) + 1`` chunks at most.
  """
  sizes, s = [], 1
  while 2 * s - 1 <= members:
    sizes.append(s)
    s *= 2
  rest = members - (s - 1)
  return tuple(sizes) + ((rest,) if rest else ())


def chunk_low(members: int, k: jax.Array) -> jax.Array:
  """(chunks,) bool: which of :func:`chunk_sizes` ``(members)`` run ``low``, totalling ``k``.

  The power-of-two chunks take the binary digits of ``k``; when ``k`` exceeds their total
  ``2**m - 1`` the remainder chunk (size ``r < 2**m <= k``) runs ``low`` as well and the digits
  are those of ``k - r`` (at most ``members - r = 2**m - 1``).
  """
  sizes = chunk_sizes(members)
  has_rest = sum(sizes) != 2 ** len(sizes) - 1
  m = len(sizes) - 1 if has_rest else len(sizes)
  k = jnp.asarray(k, jnp.int32)
  rest_low = k > 2 ** m - 1
  if has_rest:
    k = jnp.where(rest_low, k - sizes[-1], k)
  flags = [((k >> j) & 1) == 1 for j in range(m)]
  if has_rest:
    flags.append(rest_low)
  return jnp.stack(flags)


def _slot_members(members: int, chose_low: jax.Array) -> jax.Array:
  """(members,) int32: the member each slot of the chunks holds (a permutation).

  Slots of ``low`` chunks take the members that chose ``low``, in member order, and the other
  slots the others; when all members agree this is the identity.
  """
  sizes = chunk_sizes(members)
  slot_low = jnp.repeat(chunk_low(members, jnp.sum(chose_low)), jnp.asarray(sizes),
                        total_repeat_length=members)
  by_member = jnp.argsort(~chose_low, stable=True)  # low members first
  by_slot = jnp.argsort(~slot_low, stable=True)  # low slots first
  return jnp.zeros([members], jnp.int32).at[by_slot].set(by_member.astype(jnp.int32))


def _exchange_batch(compressor, xs, states, keys, axis_name):
  """The members' one-tensor exchanges as one vmap: (means, states, reduce, gather, calls)."""

  def one(x, state, key):
    out = exchange(compressor, (x,), state, key, axis_name)
    t = out.traffic
    return (out.mean[0].astype(x.dtype), out.state, as_bits(t.reduce), as_bits(t.gather),
            jnp.int32(t.reduce_calls), jnp.int32(t.gather_calls))

  means, new, reduce, gather, rc, gc = jax.vmap(one)(xs, states, keys)
  members = range(xs.shape[0])
  return (means, new, bits_sum(Bits(reduce.hi[b], reduce.lo[b]) for b in members),
          bits_sum(Bits(gather.hi[b], gather.lo[b]) for b in members), rc[0], gc[0])


def _chunk(low, high, is_low, xs, lows, highs, memory, keys, axis_name):
  """One chunk whose members all chose one setting: that setting's batched exchange, by a cond.

  Returns ``(means, lows, highs, memory, reduce, gather, reduce_calls, gather_calls)``; the
  setting that did not run keeps its states.
  """

  def run(comp, xs, mine, memory, keys):
    full = _with_memory(mine, memory)
    means, new, r, g, rc, gc = _exchange_batch(comp, xs, full, keys, axis_name)
    if jax.tree.leaves(memory):
      return means, new._replace(memory=()), new.memory, r, g, rc, gc
    return means, new, memory, r, g, rc, gc

  def on_low(ops):
    xs, lows, highs, memory, keys = ops
    means, new, mem, *traffic = run(low, xs, lows, memory, keys)
    return (means, new, highs, mem, *traffic)

  def on_high(ops):
    xs, lows, highs, memory, keys = ops
    means, new, mem, *traffic = run(high, xs, highs, memory, keys)
    return (means, lows, new, mem, *traffic)

  return cond(is_low, on_low, on_high, (xs, lows, highs, memory, keys))


def switch(low, high, leaves, critical, lows, highs, memory, keys, axis_name):
  """Per compressed tensor, the mean of the chosen setting; both settings' new states.

  Per group of equal-shape tensors: the members are placed, by their decisions, into the
  static chunks of :func:`chunk_sizes` so that each chunk holds members of one setting
  (:func:`_slot_members`); each chunk runs its setting's batched exchange under one ``cond``.
  Every member is exchanged exactly once, with its own setting, keys and state.

  Args:
    low, high: the two :class:`~dadjax.compress.Compressor` settings.
    leaves: this site's gradient leaves (all of them; only ndim >= 2 are read).
    critical: (T,) bool, per leaf: ``low`` (True) or ``high``.
    lows, highs, memory: the per-leaf states of :class:`AccordionState`
      (``memory[i]`` the shared residual, or ``()``).
    keys: the step's :class:`~dadjax.compress.Keys`; leaf ``i`` uses
      ``leaf_keys(keys, i)``.
    axis_name: the sites' axis.

  Returns:
    ``(means, lows, highs, memory, reduce, gather, reduce_calls, gather_calls)``:
    ``means[i]`` for compressed leaves (others ``None``), the new per-leaf
    states, and what the step sent (:class:`Bits`, int32 calls).
  """
  means: list = [None] * len(leaves)
  lows, highs, memory = list(lows), list(highs), list(memory)
  reduce, gather = bits_zero(), bits_zero()
  rcalls, gcalls = jnp.int32(0), jnp.int32(0)
  for group in shape_groups(leaves):
    b = len(group)
    # GROUP_SAME_SHAPES off (benchmarks' per-leaf reference): every tensor its own chunk
    sizes = chunk_sizes(b) if grouping() else (1,) * b
    chose_low = jnp.stack([critical[i] for i in group])
    group_state = (jnp.stack([leaves[i] for i in group]),
                   _stack([lows[i] for i in group]), _stack([highs[i] for i in group]),
                   _stack([memory[i] for i in group]),
                   _stack([leaf_keys(keys, i) for i in group]))
    if max(sizes) == 1:  # chunks of one: each member is its own chunk, in place
      slots, flags = None, chose_low
    else:
      slots = _slot_members(b, chose_low)
      flags = chunk_low(b, jnp.sum(chose_low))
      group_state = jax.tree.map(lambda x: x[slots], group_state)
    outs, start = [], 0
    for j, size in enumerate(sizes):
      part = jax.tree.map(lambda x: x[start:start + size], group_state)
      out = _chunk(low, high, flags[j], *part, axis_name)
      reduce, gather = bits_add(reduce, out[4]), bits_add(gather, out[5])
      rcalls, gcalls = rcalls + out[6], gcalls + out[7]
      outs.append(out[:4])
      start += size
    m, s_low, s_high, mem = jax.tree.map(lambda *xs: jnp.concatenate(xs), *outs)
    if slots is not None:  # back from slot order to member order
      back = jnp.argsort(slots)
      m, s_low, s_high, mem = jax.tree.map(lambda x: x[back], (m, s_low, s_high, mem))
    for j, i in enumerate(group):
      means[i] = m[j]
      lows[i], highs[i] = _unstack(s_low, j), _unstack(s_high, j)
      memory[i] = _unstack(mem, j)
  return means, tuple(lows), tuple(highs), tuple(memory), reduce, gather, rcalls, gcalls
