"""Which axis of each parameter holds the layers a Flax ``nn.scan`` stacked."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np

from dadjax._core.trees import leaf_path
from dadjax.parallel._layout import _is_box


def layer_axes_of(params: Any, layer_names: Sequence[str] = ("layers",)) -> dict[str, int]:
  """``{leaf path: axis}`` of the leaves a Flax ``nn.scan`` / ``nn.vmap`` stacked.

  Read from the partitioning names the model declares (``nn.scan(...,
  metadata_params={nn.PARTITION_NAME: "layers"})`` inserts ``"layers"`` into
  every boxed parameter's names): the axis whose name is in ``layer_names``.
  A parameter without partitioning names (a bias with the default
  initializer) inside the same scanned module is stacked too: each boxed
  stacked leaf's module, and the largest enclosing scope in which every
  boxed leaf names the same layer axis and every bare leaf has the same
  number of layers on that axis, is taken as the scan's scope.

  Raises:
    ValueError: a leaf names two layer axes, or a bare leaf beside a stacked
      one (in its own module) does not have the stack's layer count on the
      layer axis: its layout is ambiguous (give ``layer_axes`` instead).
  """
  names = tuple(layer_names)
  entries = []  # (path parts, path, box axis or None if bare, shape)
  for path, x in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)[0]:
    key = leaf_path(path)
    axis = None
    if _is_box(x):
      hits = [i for i, n in enumerate(x.names) if n in names]
      if len(hits) > 1:
        raise ValueError(f"{key}: more than one stacking axis among its partitioning names "
                         f"{x.names} (layer_names={names})")
      axis = hits[0] if hits else -1  # -1: boxed, not stacked
      x = x.unbox()
    entries.append((tuple(key.split("/")), key, axis, tuple(np.shape(x))))
  out = {key: axis for _, key, axis, _ in entries if axis is not None and axis >= 0}
  for parts, key, axis, shape in entries:
    if key not in out or out[key] != axis:
      continue
    layers = shape[axis]

    def fits(prefix, axis=axis, layers=layers):
      inside = [e for e in entries if e[0][:len(prefix)] == prefix]
      return all((a == axis) if a is not None else (len(s) > axis and s[axis] == layers)
                 for _, _, a, s in inside)

    scope = None
    for n in range(len(parts) - 1, 0, -1):  # from the leaf's module outwards
      if not fits(parts[:n]):
        break
      scope = parts[:n]
    if scope is None and len(parts) > 1:
      bad = [k for p, k, a, s in entries if p[:-1] == parts[:-1] and a is None
             and not (len(s) > axis and s[axis] == layers)]
      raise ValueError(f"layer_axes: {bad} sit beside the stacked leaf {key} ({layers} layers "
                       f"on axis {axis}) without that layer count: pass layer_axes explicitly")
    for p, k, a, _ in entries:
      if scope is not None and p[:len(scope)] == scope and a is None:
        out[k] = axis
  return out
