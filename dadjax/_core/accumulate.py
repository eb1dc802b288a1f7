"""Local gradient accumulation that calls a communicating update once per ``k`` micro-steps.

The one implementation behind :func:`dadjax.accumulate` (a fixed or traced
``k``) and Accordion's batch-size mode (``k`` chosen by the detector): each
micro-step adds this site's gradient to a running sum; when ``k``
micro-steps are pending, the update runs on their mean under a ``lax.cond``
whose predicate every site computes alike, so every site issues the
update's collectives in the same micro-step, and only then (under
``shard_map`` and ``pmap`` the collective sits in the taken branch). Both
branches' outputs are typed alike under ``shard_map(check_vma=True)``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dadjax._core.vma import branch_matched_cond

__all__ = ["Accumulated", "accumulate_step"]


class Accumulated(NamedTuple):
  """One micro-step's result.

  Attributes:
    updates: the update's output on a firing micro-step, zeros otherwise.
    acc: the running sum (zeros after firing).
    inner: the update's state (advanced only when firing).
    pending: micro-steps in the running sum (0 after firing).
    fired: bool scalar, whether the update ran.
  """

  updates: Any
  acc: Any
  inner: Any
  pending: jax.Array
  fired: jax.Array


def accumulate_step(update: Callable[[Any, Any], tuple[Any, Any]], grads: Any, acc: Any,
                    pending: jax.Array, inner: Any, every_k: int | jax.Array,
                    refs: Any = ()) -> Accumulated:
  """Add ``grads`` to ``acc``; when ``every_k`` micro-steps are pending, ``update`` their mean.

  Args:
    update: ``(mean, inner) -> (updates, inner)``, the communicating
      transformation's update (it runs only on the firing micro-step).
    grads: this micro-step's local gradients.
    acc: the running sum (a tree like ``grads``, any float dtype).
    pending: int32, micro-steps already in ``acc``.
    inner: ``update``'s state.
    every_k: micro-steps per update, an int >= 1 or a traced int32 (equal
      on every site).
    refs: values ``update`` closes over (parameters): their variance types
      count when typing the branches.

  Returns:
    :class:`Accumulated`. The mean is ``acc / k`` in ``acc``'s dtype, cast to
    the gradients' dtypes.
  """
  acc = jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)
  pending = pending + 1
  fire = pending >= jnp.asarray(every_k, jnp.int32)

  def run(ops):
    acc, inner, pending = ops
    mean = jax.tree.map(lambda a, g: (a / pending.astype(a.dtype)).astype(g.dtype), acc, grads)
    out, inner = update(mean, inner)
    return out, jax.tree.map(jnp.zeros_like, acc), inner, jnp.zeros_like(pending)

  def wait(ops):
    acc, inner, pending = ops
    return jax.tree.map(jnp.zeros_like, grads), acc, inner, pending

  out, acc, inner, pending = branch_matched_cond(fire, run, wait, (acc, inner, pending), grads,
                                            refs)
  return Accumulated(out, acc, inner, pending, fire)
