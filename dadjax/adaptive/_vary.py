"""``lax.cond`` whose branches communicate, under every backend.

Under ``jax.shard_map`` (with variance checking) both branches of a
``lax.cond`` must return values of the same variance type, but a ``psum``
returns a value typed invariant across sites while per-site state is typed
varying. :func:`cond` types every output varying along the axes the operands
vary along, so a branch may return collective results next to per-site state.
Under ``pmap`` and ``vmap`` nothing is typed and it is a plain ``lax.cond``
(under ``vmap`` with a per-site predicate, a select of both branches).
"""

from __future__ import annotations

from typing import Any, Callable

import jax


def vma(x) -> frozenset:
  """Mesh axes ``x`` is typed as varying along (empty outside shard_map)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def tree_vma(tree: Any) -> frozenset:
  """Union of :func:`vma` over every array leaf of ``tree``."""
  return frozenset().union(*(vma(x) for x in jax.tree.leaves(tree)))


def vary(tree: Any, axes: frozenset) -> Any:
  """Every leaf of ``tree`` typed varying along ``axes`` (a no-op where it already is)."""

  def one(x):
    missing = axes - vma(x)
    return jax.lax.pcast(x, tuple(sorted(missing)), to="varying") if missing else x

  return jax.tree.map(one, tree) if axes else tree


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, operands: Any) -> Any:
  """``lax.cond(pred, true_fn, false_fn, operands)`` with matching variance types.

  Args:
    pred: scalar bool; must be equal on every site when a branch
      communicates (all sites must issue the same collectives).
    true_fn: ``operands -> outputs``.
    false_fn: ``operands -> outputs`` (same structure, shapes and dtypes).
    operands: the pytree both branches receive.

  Returns:
    The chosen branch's outputs, typed varying along every axis ``pred`` or
    ``operands`` vary along.
  """
  axes = tree_vma((pred, operands))
  return jax.lax.cond(pred, lambda ops: vary(true_fn(ops), axes),
                      lambda ops: vary(false_fn(ops), axes), operands)
