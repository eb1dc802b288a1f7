"""Accordion's per-tensor switch, run as one batched exchange per setting and shape group.

The tensors Accordion compresses are split (statically, at trace time) into
*groups* of equal shape and dtype. For each group and each setting the
one-tensor exchanges of its members run as one ``jax.vmap`` (their
collectives become one collective over the stacked payloads), under one
``lax.cond`` that skips the setting when no member chose it; each member then
takes, by a select on its own decision, the mean and the new state of the
setting it chose, and keeps the other setting's state as it was. So a step
compiles O(groups) exchanges and collectives instead of two per tensor, and
every member's result is the one of its own exchange (same keys, same state).

What a step sends: a group whose members all chose one setting sends exactly
that setting's payloads; a group whose members disagree sends both settings'
payloads for all its members (shapes are static: a member cannot leave a
stacked collective), and the ledger books both.

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
from dadjax.compress import ErrorFeedbackState, PowerSGDState, exchange, leaf_keys


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


def _group_exchange(compressor, xs, states, keys, axis_name):
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


def _setting(compressor, chosen, xs, states, keys, axis_name):
  """:func:`_group_exchange` under a cond on ``any(chosen)``; skipped: zeros and the old states."""

  def run(ops):
    return _group_exchange(compressor, *ops, axis_name)

  def skip(ops):
    xs, states, _ = ops
    z = bits_zero()
    return jnp.zeros_like(xs), states, z, z, jnp.int32(0), jnp.int32(0)

  return cond(jnp.any(chosen), run, skip, (xs, states, keys))


def switch(low, high, leaves, critical, lows, highs, memory, keys, axis_name):
  """Per compressed tensor, the mean of the chosen setting; both settings' new states.

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
    xs = jnp.stack([leaves[i] for i in group])
    ks = _stack([leaf_keys(keys, i) for i in group])
    chose_low = jnp.stack([critical[i] for i in group])
    outs = {}
    for name, comp, states, chosen in (("low", low, lows, chose_low),
                                       ("high", high, highs, ~chose_low)):
      full = _stack([_with_memory(states[i], memory[i]) for i in group])
      outs[name] = _setting(comp, chosen, xs, full, ks, axis_name)
      _, _, r, g, rc, gc = outs[name]
      reduce, gather = bits_add(reduce, r), bits_add(gather, g)
      rcalls, gcalls = rcalls + rc, gcalls + gc
    (m_low, s_low, *_), (m_high, s_high, *_) = outs["low"], outs["high"]
    for b, i in enumerate(group):
      c = critical[i]
      means[i] = jnp.where(c, m_low[b], m_high[b])
      new_low, new_high = _unstack(s_low, b), _unstack(s_high, b)
      if jax.tree.leaves(memory[i]):
        memory[i] = jax.tree.map(lambda a, z: jnp.where(c, a, z), new_low.memory, new_high.memory)
        new_low, new_high = new_low._replace(memory=()), new_high._replace(memory=())
      lows[i] = jax.tree.map(lambda n, o: jnp.where(c, n, o), new_low, lows[i])
      highs[i] = jax.tree.map(lambda n, o: jnp.where(c, o, n), new_high, highs[i])
  return means, tuple(lows), tuple(highs), tuple(memory), reduce, gather, rcalls, gcalls

