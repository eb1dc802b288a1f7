"""Stacked layers: a leaf that ``nn.scan`` / ``nn.vmap`` stacked is ``L`` tensors, not one.

A model whose blocks run under ``nn.scan`` holds each block parameter as one
array with a leading layer axis, e.g. a ``(L, m, n)`` kernel. Viewed whole,
PowerSGD would factorize an ``(L m, n)`` matrix (one subspace for all
layers), TopK would select over all layers together, QSGD would take one norm
and Accordion one decision for the stack. Inside :func:`stacked_layers` the
communicating transformations wrapped by :func:`per_layer` see such a leaf as
``L`` leaves (a tuple of its slices along the layer axis, at the leaf's path
followed by the layer index), so every compressor, detector and ledger entry
treats each layer as the unscanned twin's layer; the results are stacked back.

The train step enters the context itself with the layer axes the model
declares (``nn.scan(..., metadata_params={nn.PARTITION_NAME: "layers"})``
puts ``"layers"`` in every boxed parameter's partitioning names:
:func:`~dadjax.parallel.layer_axes_of`) or that ``make_train_step(...,
layer_axes=...)`` gives. It is trace-time Python state: ``tx.init`` and the
traced ``tx.update`` must both run inside it (the state's structure holds
one entry per layer).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

import jax
import jax.numpy as jnp
import optax

from dadjax._core.trees import leaf_path

__all__ = ["stacked_layers", "active_axes", "unstack", "restack", "per_layer"]

_ACTIVE: list[dict[str, int]] = []


@contextlib.contextmanager
def stacked_layers(axes: Mapping[str, int]) -> Iterator[None]:
  """Within this context, the leaves at these paths are stacks of layers.

  Args:
    axes: ``{leaf path: layer axis}``, paths as :func:`dadjax._core.trees.leaf_path`
      writes them (``"blocks/dense/kernel"``), e.g. from
      :func:`~dadjax.parallel.layer_axes_of`.
  """
  bad = {k: v for k, v in dict(axes).items()
         if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0}
  if bad:
    raise ValueError(f"layer_axes must map leaf paths (str) to an axis (int >= 0), got {bad}")
  _ACTIVE.append(dict(axes))
  try:
    yield
  finally:
    _ACTIVE.pop()


def active_axes() -> dict[str, int]:
  """The innermost :func:`stacked_layers` map (``{}`` outside one)."""
  return _ACTIVE[-1] if _ACTIVE else {}


def _split(x, axis: int, path: str):
  if not hasattr(x, "shape") or axis >= jnp.ndim(x):
    raise ValueError(f"layer_axes: the leaf {path} has shape {jnp.shape(x)}, no layer axis {axis}")
  return tuple(jnp.take(x, i, axis=axis) for i in range(jnp.shape(x)[axis]))


def unstack(tree: Any, axes: Mapping[str, int] | None = None) -> Any:
  """``tree`` with each stacked leaf replaced by the tuple of its layers."""
  axes = active_axes() if axes is None else axes
  if not axes or tree is None:
    return tree
  return jax.tree_util.tree_map_with_path(
      lambda p, x: _split(x, axes[leaf_path(p)], leaf_path(p)) if leaf_path(p) in axes else x,
      tree)


def restack(tree: Any, like: Any, axes: Mapping[str, int] | None = None) -> Any:
  """The inverse of :func:`unstack`: ``like`` gives the structure to restore."""
  axes = active_axes() if axes is None else axes
  if not axes:
    return tree
  paths = [leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(like)[0]]
  parts = jax.tree.structure(like).flatten_up_to(tree)
  leaves = [jnp.stack(part, axis=axes[path]) if path in axes else part
            for path, part in zip(paths, parts)]
  return jax.tree.unflatten(jax.tree.structure(like), leaves)


def per_layer(tx: optax.GradientTransformation) -> optax.GradientTransformation:
  """``tx`` applied to each layer of the stacked leaves (module docstring).

  Outside :func:`stacked_layers` (or for a tree without stacked leaves) it is
  ``tx`` itself. ``tx``'s state holds one entry per layer.

  Args:
    tx: an optax transformation (a communicating one: its collectives,
      statistics and ledger entries then run per layer).

  Returns:
    An ``optax.GradientTransformationExtraArgs``.
  """
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return tx.init(unstack(params))

  def update_fn(updates, state, params=None, **extra_args):
    axes = active_axes()
    if not axes:
      return tx.update(updates, state, params, **extra_args)
    new, state = tx.update(unstack(updates, axes), state, unstack(params, axes), **extra_args)
    return restack(new, updates, axes), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
