"""Slice-aware statistics for compressors: kept for compatibility, plain local math today.

Before 0.5, ``make_train_step(..., shard_params=True)`` traced the methods on
each device's slice of a parameter inside :func:`sharded_parameters`, and a
compressor that needed a statistic of the whole tensor (a norm, a maximum)
or noise tied to it took them from :func:`whole_sum` / :func:`whole_max` /
:func:`whole_size` / :func:`slice_uniform`; a method that needed the whole
tensor called :func:`require_whole_leaves`. Since 0.5 the step places a
site's state with ``NamedSharding`` and XLA (GSPMD) partitions the program:
every method sees whole logical tensors, sharded or not
(:class:`~dadjax.parallel.SiteMesh`), so the step never enters
:func:`sharded_parameters`, every helper here is the plain local computation
and a compressor's ``shardable`` flag changes nothing.

The names stay because :mod:`dadjax.extend` promises them until the next
minor version; entering :func:`sharded_parameters` warns
(``DeprecationWarning``). New compressors need none of them.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Callable, Iterator, Mapping, NamedTuple

import jax

# Stack of (in-site axes, {leaf path: sharded dimension or None}) of the sharded steps being traced.
_ACTIVE: list[tuple[tuple[str, ...], Mapping[str, int | None]]] = []
# Stack of the leaf paths being compressed.
_LEAVES: list[str] = []

class LeafShard(NamedTuple):
  """How the leaf being compressed is split: over ``axes``, along dimension ``dim``."""

  axes: tuple[str, ...]
  dim: int


@contextlib.contextmanager
def sharded_parameters(axes: tuple[str, ...],
                       dims: Mapping[str, int | None] | None = None) -> Iterator[None]:
  """Within this context, parameters and gradients are slices over ``axes``.

  Args:
    axes: the in-site mesh axes.
    dims: leaf path (``"['hidden_0']['kernel']"``) -> the sharded dimension,
      or ``None`` for a leaf kept whole on every device.
  """
  warnings.warn("dadjax._core.shards.sharded_parameters is deprecated: the step places sharded "
                "parameters with GSPMD and methods see whole logical tensors; it goes in the next "
                "minor version", DeprecationWarning, stacklevel=3)
  _ACTIVE.append((tuple(axes), dict(dims or {})))
  try:
    yield
  finally:
    _ACTIVE.pop()


@contextlib.contextmanager
def current_leaf(path: str) -> Iterator[None]:
  """Within this context, :func:`leaf_shard` describes the leaf at ``path``."""
  _LEAVES.append(path)
  try:
    yield
  finally:
    _LEAVES.pop()


def shard_axes() -> tuple[str, ...] | None:
  """The in-site axes parameters are sharded over, or ``None`` (whole tensors)."""
  return _ACTIVE[-1][0] if _ACTIVE else None


def leaf_shard() -> LeafShard | None:
  """The current leaf's slicing, or ``None`` when it is whole on this device."""
  if not _ACTIVE or not _LEAVES:
    return None
  axes, dims = _ACTIVE[-1]
  path = _LEAVES[-1]
  if path not in dims:
    raise ValueError(f"leaf {path} is not a parameter of the sharded step (parameters: "
                     f"{sorted(dims)}); a compressor on sharded parameters must see the "
                     "gradients with the parameters' paths")
  return None if dims[path] is None else LeafShard(axes, dims[path])


def whole_sum(value: jax.Array) -> jax.Array:
  """A slice's sum made the whole leaf's (``psum`` over the site's devices when sliced)."""
  shard = leaf_shard()
  return value if shard is None else jax.lax.psum(value, shard.axes)


def whole_max(value: jax.Array) -> jax.Array:
  """A slice's maximum made the whole leaf's (``pmax`` when sliced)."""
  shard = leaf_shard()
  return value if shard is None else jax.lax.pmax(value, shard.axes)


def whole_size(size: int) -> int:
  """The whole leaf's number of entries, from the slice's ``size``."""
  shard = leaf_shard()
  return size if shard is None else size * jax.lax.axis_size(shard.axes)


def threefry_unit(key: jax.Array, n: int) -> jax.Array:
  """``n`` uniform [0, 1) floats of ``jax.random.uniform`` (the default rounding noise)."""
  return jax.random.uniform(key, (n,))


def slice_uniform(key: jax.Array, shape: tuple[int, ...], draw=None) -> jax.Array:
  """``uniform(key)`` noise of shape ``shape`` that is this slice of the whole leaf's noise.

  Whole: ``draw(key, size).reshape(shape)``. Sliced: the same draw for
  the whole leaf, cut to this device's slice, so every entry gets the
  number it gets in the replicated layout. ``draw(key, n) -> (n,)`` [0, 1)
  floats; default ``jax.random.uniform``.
  """
  draw = threefry_unit if draw is None else draw
  shard = leaf_shard()
  if shard is None:
    if draw is threefry_unit:  # drawn in the leaf's shape: a sharded leaf's noise stays sharded
      return jax.random.uniform(key, tuple(shape))  # (partitionable threefry: the flat draw's)
    return draw(key, math.prod(shape)).reshape(shape)
  n = jax.lax.axis_size(shard.axes)
  whole = tuple(s * n if i == shard.dim else s for i, s in enumerate(shape))
  noise = draw(key, math.prod(whole)).reshape(whole)
  start = jax.lax.axis_index(shard.axes) * shape[shard.dim]
  return jax.lax.dynamic_slice_in_dim(noise, start, shape[shard.dim], axis=shard.dim)


def require_whole_leaves(method: str, supported: Callable[[], list[str]] | None = None) -> None:
  """Raise a ``ValueError`` naming ``method`` if parameters are sharded now.

  Args:
    method: the method's name as the user spelled it (e.g. ``"topk"``).
    supported: returns the methods that do support sharded parameters, for
      the message (each declares it once, e.g. a compressor's ``shardable``
      flag); called only when raising.
  """
  if _ACTIVE:
    names = ["allreduce", "dAD layers (they see whole kernels)", "elementwise optimizers"]
    names += supported() if supported is not None else []
    raise ValueError(
        f"{method} needs each parameter's whole tensor, but make_train_step(shard_params=True) "
        f"gives every device of a site a slice of it over {_ACTIVE[-1][0]}; use shard_params="
        f"False for {method}. Methods that support sharded parameters: {', '.join(names)}")


__all__ = ["LeafShard", "current_leaf", "leaf_shard", "require_whole_leaves",
           "shard_axes", "sharded_parameters", "slice_uniform", "threefry_unit", "whole_max", "whole_size",
           "whole_sum"]
