"""Variance typing under ``shard_map(check_vma=True)``, and the collection names.

Inside ``jax.shard_map`` with type checking on, every value is typed as
*varying* along the mesh axes where sites may hold different values, or
*invariant* where every site holds the same. Custom backward passes and
``lax.cond`` branches must return values of the types JAX expects. These
helpers read and adjust those types; outside ``shard_map`` (pmap, vmap, no
mapping) every value is untyped and they are no-ops.

The Flax collections the layers and the train step share are named here too,
so the layers do not depend on the train step:

* :data:`COMM_COLLECTION` (``"comm"``): bits a layer hands to collectives in
  its backward pass, sown as :class:`~dadjax.comm.Bits`.
* :data:`STATE_COLLECTION` (``"dad_state"``): layer state that the train
  step differentiates and overwrites with its cotangent.
"""

from __future__ import annotations

from typing import Any

import jax

COMM_COLLECTION = "comm"
STATE_COLLECTION = "dad_state"


def vma(x: Any) -> frozenset:
  """Mesh axes ``x`` is typed as varying along (empty outside shard_map)."""
  if x is None:
    return frozenset()
  aval = jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)  # jax 0.10
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def is_varying(x: Any, axis_name: str | None) -> bool:
  """Whether ``x`` is typed as varying along ``axis_name`` (shard_map only)."""
  return axis_name is not None and x is not None and axis_name in vma(x)


def tree_vma(tree: Any) -> frozenset:
  """Union of :func:`vma` over every leaf."""
  return frozenset().union(*(vma(x) for x in jax.tree.leaves(tree)))


def to_varying(x: Any, axes) -> Any:
  """``x`` typed varying along every axis in ``axes`` (no data movement)."""
  missing = tuple(sorted(frozenset(axes) - vma(x)))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def tree_to_varying(tree: Any, axes) -> Any:
  """:func:`to_varying` on every leaf."""
  return jax.tree.map(lambda x: to_varying(x, axes), tree)
