"""Variance typing under ``shard_map(check_vma=True)`` and the type-matched ``cond``.

Inside ``jax.shard_map`` with type checking on, every value is typed as
*varying* along the mesh axes where sites may hold different values, or
*invariant* where every site holds the same. Custom backward passes, loop
carries and ``lax.cond`` branches must return values of the types JAX
expects (a ``psum`` returns an invariant value, per-site state is varying).
These helpers read and adjust those types; outside ``shard_map`` (``pmap``,
``vmap``, no mapping) every value is untyped and they are no-ops.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax

__all__ = [
    "struct_vma", "vma", "is_varying", "tree_vma", "to_varying", "tree_to_varying", "vary_like",
    "tree_to_vmas", "cond", "branch_matched_cond"
]


def struct_vma(aval: Any) -> frozenset:
  """Mesh axes an abstract value (``jax.typeof(x)``, a ``ShapeDtypeStruct``) varies along."""
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
  return frozenset(mat.varying if mat is not None else (getattr(aval, "vma", ()) or ()))


def vma(x: Any) -> frozenset:
  """Mesh axes ``x`` is typed as varying along (empty outside shard_map, or for ``None``)."""
  if x is None:
    return frozenset()
  return struct_vma(jax.typeof(x))


def is_varying(x: Any, axis_name: str | None) -> bool:
  """Whether ``x`` is typed as varying along ``axis_name`` (shard_map only)."""
  return axis_name is not None and x is not None and axis_name in vma(x)


def tree_vma(tree: Any) -> frozenset:
  """Union of :func:`vma` over every leaf of ``tree``."""
  return frozenset().union(*(vma(x) for x in jax.tree.leaves(tree)))


def to_varying(x: Any, axes: Iterable[str]) -> Any:
  """``x`` typed varying along every axis in ``axes`` (no data movement; it only gains axes)."""
  missing = tuple(sorted(frozenset(axes) - vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def tree_to_varying(tree: Any, axes: Iterable[str]) -> Any:
  """:func:`to_varying` on every leaf of ``tree``."""
  axes = frozenset(axes)
  return jax.tree.map(lambda x: to_varying(x, axes), tree) if axes else tree


def vary_like(x: Any, *refs: Any) -> Any:
  """``x`` (a pytree) typed varying along every axis some leaf of ``refs`` varies along.

  Loop carries must keep their type: a start value drawn from a shared key is
  invariant while the iterate computed from per-site data is varying.
  """
  return tree_to_varying(x, tree_vma(refs))


def tree_to_vmas(tree: Any, axes: list) -> Any:
  """Type leaf ``i`` of ``tree`` varying along ``axes[i]`` (a leaf may only gain axes)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [to_varying(x, a) for x, a in zip(leaves, axes)])


def cond(pred: jax.Array, true_fn: Callable, false_fn: Callable, operands: Any) -> Any:
  """``lax.cond(pred, true_fn, false_fn, operands)`` whose branches may communicate.

  Under ``shard_map`` both branches of a ``lax.cond`` must return values of the
  same variance type; this types every output varying along the axes ``pred``
  or ``operands`` vary along, so a branch may return collective results next
  to per-site state. Under ``pmap`` and ``vmap`` it is a plain ``lax.cond``
  (under ``vmap`` with a per-site predicate, a select of both branches).

  Args:
    pred: scalar bool; must be equal on every site when a branch
      communicates (all sites must issue the same collectives).
    true_fn: ``operands -> outputs``.
    false_fn: ``operands -> outputs`` (same structure, shapes and dtypes).
    operands: the pytree both branches receive.

  Returns:
    The chosen branch's outputs.
  """
  axes = tree_vma((pred, operands))
  return jax.lax.cond(pred, lambda ops: tree_to_varying(true_fn(ops), axes),
                      lambda ops: tree_to_varying(false_fn(ops), axes), operands)


def branch_matched_cond(pred: jax.Array, true_fn: Callable, false_fn: Callable,
                        operands: Any, *refs: Any) -> Any:
  """``lax.cond`` whose outputs take, leaf by leaf, the union of both branches' variance types.

  Unlike :func:`cond`, an output leaf that neither branch makes vary (a
  collective's invariant result) stays invariant. When ``operands`` or
  ``refs`` carry variance types (``shard_map`` with type checks) both
  branches are traced once more (``eval_shape``) to read their types;
  elsewhere it is a plain ``lax.cond``.
  """
  if not tree_vma((pred, operands, refs)):
    return jax.lax.cond(pred, true_fn, false_fn, operands)
  a, b = (jax.tree.leaves(jax.eval_shape(f, operands)) for f in (true_fn, false_fn))
  axes = [struct_vma(x) | struct_vma(y) for x, y in zip(a, b)]
  return jax.lax.cond(pred, lambda o: tree_to_vmas(true_fn(o), axes),
                      lambda o: tree_to_vmas(false_fn(o), axes), operands)
