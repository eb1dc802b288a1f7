"""Shared pytree helpers (the one place for them).

Small, jit-friendly maps over pytrees of arrays used by several modules.
Everything here either returns a pytree of the same structure or a Python
int computed from static shapes at trace time. Leaves may be arrays or
``jax.ShapeDtypeStruct``; ``optax.MaskedNode`` subtrees have no leaves and
pass through untouched.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def tree_add(a: Any, b: Any) -> Any:
  """Leafwise ``a + b``."""
  return jax.tree.map(jnp.add, a, b)


def tree_sub(a: Any, b: Any) -> Any:
  """Leafwise ``a - b``."""
  return jax.tree.map(jnp.subtract, a, b)


def tree_scale(tree: Any, factor) -> Any:
  """Leafwise ``x * factor``, keeping each leaf's dtype."""
  return jax.tree.map(lambda x: (x * factor).astype(x.dtype), tree)


def tree_zeros_like(tree: Any, dtype=None) -> Any:
  """Zeros with each leaf's shape (and dtype unless ``dtype`` is given)."""
  return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), dtype or x.dtype), tree)


def tree_cast_like(tree: Any, like: Any) -> Any:
  """Cast every leaf of ``tree`` to the dtype of the matching leaf of ``like``."""
  return jax.tree.map(lambda x, l: jnp.asarray(x).astype(l.dtype), tree, like)


def tree_num_leaves(tree: Any) -> int:
  return len(jax.tree.leaves(tree))


def tree_nbits(tree: Any) -> int:
  """Exact storage bits of every array leaf: ``sum(size * itemsize * 8)``.

  Shapes and dtypes are static, so this is a Python int at trace time; it is
  the size of ``tree`` as handed to a collective.
  """
  return sum(math.prod(jnp.shape(x)) * np.dtype(x.dtype).itemsize * 8
             for x in jax.tree.leaves(tree))


def path_names(path) -> tuple[str, ...]:
  """A key path from ``tree_flatten_with_path`` as plain names (``("block", "kernel")``)."""
  out = []
  for entry in path:
    for attr in ("key", "name", "idx"):
      if hasattr(entry, attr):
        out.append(str(getattr(entry, attr)))
        break
    else:
      out.append(str(entry))
  return tuple(out)
