"""``lax.cond`` whose two branches return values of the same variance type.

Under ``shard_map(check_vma=True)`` both branches of a ``cond`` must return
values typed alike; a synchronization branch returns invariant values (a
mean over the sites) where the other branch returns varying ones. Each
output leaf is cast to varying along the union of the axes either branch
makes it vary along (the same rule :func:`dadjax.accumulate` applies).
Outside ``shard_map`` it is a plain ``lax.cond``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from dadjax.comm import tree_vma


def _struct_vma(s) -> frozenset:
  mat = getattr(s, "manual_axis_type", None)
  return frozenset(mat.varying) if mat is not None else frozenset(getattr(s, "vma", ()) or ())


def _cast_to(tree: Any, axes: list) -> Any:
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for x, want in zip(leaves, axes):
    missing = tuple(sorted(want - tree_vma(x)))
    out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
  return jax.tree.unflatten(treedef, out)


def typed_cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, operands: Any) -> Any:
  """``lax.cond(pred, true_fn, false_fn, operands)`` with type-matched branch outputs."""
  if not tree_vma(operands):  # no shard_map type checks
    return jax.lax.cond(pred, true_fn, false_fn, operands)
  a, b = (jax.tree.leaves(jax.eval_shape(f, operands)) for f in (true_fn, false_fn))
  axes = [_struct_vma(x) | _struct_vma(y) for x, y in zip(a, b)]
  return jax.lax.cond(pred, lambda o: _cast_to(true_fn(o), axes),
                      lambda o: _cast_to(false_fn(o), axes), operands)
