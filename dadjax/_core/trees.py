"""Shared pytree helpers (the one place for them).

Small, jit-friendly maps over pytrees of arrays used by several modules.
Everything here either returns a pytree of the same structure or a Python
int computed from static shapes at trace time. Leaves may be arrays or
``jax.ShapeDtypeStruct``; ``optax.MaskedNode`` subtrees have no leaves and
pass through untouched.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.shards import shard_axes

__all__ = [
    "tree_add", "tree_sub", "tree_scale", "tree_zeros_like", "tree_cast_like", "tree_num_leaves",
    "tree_nbits", "path_names", "leaf_path", "TreeSpec", "tree_spec", "spec_mismatch",
    "check_tree_matches", "SpecMemo", "check_float_leaves", "check_axis_name"
]


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


def _dtype(x) -> np.dtype:
  return np.dtype(x.dtype if hasattr(x, "dtype") else jnp.result_type(x))


def leaf_path(path) -> str:
  """A key path as one readable string (``"block/kernel"``; ``"<root>"`` for a bare leaf)."""
  return "/".join(path_names(path)) or "<root>"


class TreeSpec(NamedTuple):
  """What a pytree must keep between ``init`` and ``update``: structure, paths, shapes, dtypes."""

  treedef: Any
  paths: tuple[str, ...]
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]


def tree_spec(tree: Any) -> TreeSpec:
  """The :class:`TreeSpec` of ``tree`` (arrays, tracers or ``ShapeDtypeStruct`` leaves)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
  return TreeSpec(treedef, tuple(leaf_path(p) for p, _ in leaves),
                  tuple(tuple(jnp.shape(x)) for _, x in leaves),
                  tuple(_dtype(x) for _, x in leaves))


def spec_mismatch(spec: TreeSpec, expected: TreeSpec) -> str | None:
  """``None`` if the specs agree, else a sentence naming the first differing leaf path."""
  for i in range(max(len(spec.paths), len(expected.paths))):
    got = spec.paths[i] if i < len(spec.paths) else None
    want = expected.paths[i] if i < len(expected.paths) else None
    if got != want:
      if want is None or (got is not None and got not in expected.paths):
        return f"leaf {got!r} is not in the tree given at init"
      return f"leaf {want!r} of the tree given at init is missing"
    if spec.shapes[i] != expected.shapes[i]:
      return f"leaf {got!r} has shape {spec.shapes[i]}, expected {expected.shapes[i]}"
    if spec.dtypes[i] != expected.dtypes[i]:
      return (f"leaf {got!r} has dtype {spec.dtypes[i].name}, expected "
              f"{expected.dtypes[i].name}")
  if spec.treedef != expected.treedef:
    return f"the tree structure differs: {spec.treedef} vs {expected.treedef} at init"
  return None


def check_tree_matches(tree: Any, expected: TreeSpec | Any, what: str) -> None:
  """Raise a ``ValueError`` naming the first leaf path where ``tree`` differs from ``expected``.

  Args:
    tree: the pytree given to an update.
    expected: a :class:`TreeSpec`, or a pytree (e.g. the params at init, or a
      state that mirrors them) whose spec is taken.
    what: the transform's name, for the message.
  """
  expected = expected if isinstance(expected, TreeSpec) else tree_spec(expected)
  why = spec_mismatch(tree_spec(tree), expected)
  if why is not None:
    raise ValueError(f"{what}: the updates differ from the parameters given to init: {why}")


class SpecMemo:
  """The specs a transform's ``init`` saw, for checking its ``update`` (trace-time Python).

  ``record`` is called by ``init``; ``check`` by ``update`` raises a
  ``ValueError`` if the updates match none of them (no check before any
  ``init`` in this process, e.g. for a state restored from elsewhere).
  """

  def __init__(self, what: str):
    self.what = what
    self.specs: list[TreeSpec] = []

  def record(self, tree: Any) -> None:
    spec = tree_spec(tree)
    if spec not in self.specs:
      self.specs.append(spec)

  def check(self, tree: Any) -> None:
    if not self.specs or shard_axes() is not None:
      return  # sharded parameters: the updates are the device's slices, not init's shapes
    spec = tree_spec(tree)
    if spec not in self.specs:
      check_tree_matches(tree, self.specs[-1], self.what)


def check_float_leaves(tree: Any, what: str) -> None:
  """Raise a ``ValueError`` naming the first leaf whose dtype is not floating point."""
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    dtype = _dtype(x)
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(f"{what} compresses floating-point gradients only; leaf "
                       f"{leaf_path(path)!r} has dtype {dtype.name} (keep such leaves "
                       "out, e.g. with optax.masked)")


def check_axis_name(axis_name: Any, name: str = "axis_name") -> Any:
  """``axis_name`` if it is a str, a non-empty tuple of str or ``None``, else a ``ValueError``."""
  if axis_name is None or isinstance(axis_name, str):
    return axis_name
  if (isinstance(axis_name, tuple) and axis_name
      and all(isinstance(a, str) for a in axis_name)):
    return axis_name
  raise ValueError(f"{name} must be a mesh axis name (a str, a non-empty tuple of str) or None, "
                   f"got {axis_name!r}")
