"""Where a site's parameters live inside the site: the in-site ``PartitionSpec`` of every leaf.

A site of several devices keeps the sharding its model's author gave it;
GSPMD (XLA's SPMD partitioner) then splits activations, compute and
gradients accordingly and inserts the in-site collectives itself. The specs
come, per leaf, from the first of:

1. ``param_specs``: a pytree of ``PartitionSpec`` (a prefix of the
   parameters' tree is enough) or a function ``params -> specs`` of one
   site's parameters (arrays or ``ShapeDtypeStruct``);
2. the model's own metadata: ``nn.with_partitioning`` (mesh axis names),
   ``nn.with_logical_partitioning`` (logical names, mapped by ``rules`` or
   the active ``nn.logical_axis_rules``), NNX ``sharding`` metadata through
   :class:`dadjax.nnx.Model`;
3. whole (replicated) on every device of the site;

and then, with ``shard_params=True`` (FSDP), each leaf is further split over
the in-site axes its spec does not use (:func:`with_fsdp`).

The site axis never appears in an in-site spec (sites hold replicas of one
another), nor does an axis the mesh lacks; a dimension that the named axes
do not divide stays whole (``NamedSharding`` needs even splits).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from dadjax._core.trees import leaf_path

Rules = Sequence[tuple[str, Any]]


def shard_dims(params: Any, per_site: int) -> Any:
  """Which dimension of each parameter FSDP splits over the devices of a site.

  A parameter is split along its largest dimension that ``per_site``
  divides (the first of equal ones), so each device holds ``1 / per_site``
  of it; a parameter with no such dimension (a scalar, a bias of odd size)
  stays whole on every device of the site.

  Args:
    params: one site's parameters (arrays or ``ShapeDtypeStruct``).
    per_site: devices per site.

  Returns:
    A tree like ``params`` of ``int`` (the dimension) or ``None`` (whole).
  """

  def dim(x):
    shape = tuple(x.shape)
    fits = [i for i, n in enumerate(shape) if n >= per_site and n % per_site == 0]
    return max(fits, key=lambda i: (shape[i], -i)) if fits and per_site > 1 else None

  return jax.tree.map(dim, params)


def _is_box(x) -> bool:
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return isinstance(x, nn.Partitioned)  # LogicallyPartitioned is a Partitioned


def metadata_specs(params: Any, rules: Rules | None) -> Any:
  """The in-site specs a Flax model's boxed parameters declare (``None`` for a bare leaf).

  ``nn.LogicallyPartitioned`` names are mapped with ``rules`` (default: the
  box's own rules, else the active ``nn.logical_axis_rules``).
  """
  import flax.linen as nn  # pylint: disable=g-import-not-at-top

  def spec(x):
    if not _is_box(x):
      return None
    names = x.get_partition_spec()
    if isinstance(x, nn.LogicallyPartitioned):
      leaf_rules = rules if rules is not None else (x.rules or nn.get_logical_axis_rules())
      return P(*nn.logical_to_mesh_axes(tuple(names), leaf_rules))
    return names

  return jax.tree.map(spec, params, is_leaf=_is_box)


def unbox(tree: Any) -> Any:
  """The arrays of a tree whose leaves may be Flax partitioning boxes."""
  return jax.tree.map(lambda x: x.unbox() if _is_box(x) else x, tree, is_leaf=_is_box)


def _axis_size(mesh_shape: dict, axes) -> int:
  axes = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh_shape[a] for a in axes)


def clean_spec(spec: Any, shape: tuple[int, ...], mesh_shape: dict, site_axis: str) -> P:
  """``spec`` without the site axis or axes the mesh lacks, and whole where it does not divide."""
  if spec is None:
    return P()
  entries = tuple(spec) + (None,) * (len(shape) - len(tuple(spec)))
  out = []
  for n, axes in zip(shape, entries[:len(shape)]):
    axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
    axes = tuple(a for a in axes if a in mesh_shape and a != site_axis)
    if not axes or n % _axis_size(mesh_shape, axes):
      out.append(None)
    else:
      out.append(axes[0] if len(axes) == 1 else axes)
  while out and out[-1] is None:
    out.pop()
  return P(*out)


def param_layout(params: Any, *, mesh_shape: dict, site_axis: str, inner: tuple[str, ...],
                 param_specs: Any = None, rules: Rules | None = None,
                 shard_params: bool = False) -> Any:
  """The in-site ``PartitionSpec`` of every parameter leaf (module docstring: the order).

  Args:
    params: one site's parameters, possibly boxed (``nn.Partitioned``).
    mesh_shape: ``{axis name: size}`` of the mesh.
    site_axis: the site axis (never in the result).
    inner: the in-site axes.
    param_specs: a tree (prefix) of ``PartitionSpec`` or ``params -> specs``.
    rules: logical axis rules for ``nn.LogicallyPartitioned`` leaves.
    shard_params: FSDP over ``inner`` for leaves without another spec.

  Returns:
    A tree like the unboxed ``params`` of ``PartitionSpec``.
  """
  arrays = unbox(params)
  shapes = jax.tree.map(lambda x: tuple(np.shape(x)), arrays)
  declared = metadata_specs(params, rules)
  if param_specs is not None:
    given = param_specs(arrays) if callable(param_specs) else param_specs
    declared = jax.tree_util.tree_map_with_path(
        lambda path, d: _spec_at(given, path, d), declared,
        is_leaf=lambda x: isinstance(x, P) or x is None)
  def spec(d, shape):
    d = clean_spec(d, shape, mesh_shape, site_axis)
    return with_fsdp(d, shape, mesh_shape, inner) if shard_params else d

  return jax.tree.map(spec, declared, shapes, is_leaf=lambda x: isinstance(x, P) or x is None)


def _spec_at(given: Any, path: tuple, default: Any) -> Any:
  """The spec ``given`` holds for a leaf path: a ``PartitionSpec`` met on the way down applies
  to the whole subtree; a missing key or ``None`` leaves ``default``."""
  node = given
  for entry in path:
    if isinstance(node, P) or node is None:
      break
    key = getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", None)))
    try:
      node = node[key] if not hasattr(entry, "name") else getattr(node, key)
    except (KeyError, IndexError, TypeError, AttributeError):
      return default
  if node is not None and not isinstance(node, P):
    raise ValueError(f"param_specs: expected a PartitionSpec or None at {leaf_path(path)}, got "
                     f"{node!r}")
  return default if node is None else node


def with_fsdp(spec: P, shape: tuple[int, ...], mesh_shape: dict, inner: tuple[str, ...]) -> P:
  """``spec`` further split over the in-site axes it does not use yet (FSDP).

  The free axes split the largest dimension ``spec`` leaves whole that their
  combined size divides (the first of equal ones), as :func:`shard_dims`
  does for a whole leaf: a tensor-parallel kernel ``P(None, "model")`` on a
  ``("fsdp", "model")`` site becomes ``P("fsdp", "model")``.
  """
  entries = list(tuple(spec) + (None,) * (len(shape) - len(tuple(spec))))
  used = {a for e in entries if e is not None for a in (e if isinstance(e, tuple) else (e,))}
  free = tuple(a for a in inner if a not in used)
  if not free:
    return spec
  size = _axis_size(mesh_shape, free)
  dims = [i for i, n in enumerate(shape) if entries[i] is None and n >= size and n % size == 0]
  if size == 1 or not dims:
    return spec
  dim = max(dims, key=lambda i: (shape[i], -i))
  entries[dim] = free[0] if len(free) == 1 else free
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def mirror_specs(tree: Any, params: Any, param_specs: Any, default: Callable[[Any], P]) -> Any:
  """Specs of a tree that mirrors the parameters (optimizer state, memories).

  A leaf whose key path ends with a parameter's path and whose shape is the
  parameter's takes that parameter's spec (Adam's moments, error-feedback
  memories, a local-update family's inner parameters); a leaf at a stacked
  parameter's path plus a layer index (:func:`dadjax.per_layer`'s state) with
  the parameter's shape less one axis takes its spec less that axis; every
  other leaf gets ``default(leaf)``.
  """
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  spec_leaves = jax.tree.structure(params).flatten_up_to(param_specs)
  by_path = {tuple(path): (tuple(np.shape(x)), s) for (path, x), s in zip(leaves, spec_leaves)}

  def leaf_spec(path, x):
    shape = tuple(np.shape(x))
    for k in range(len(path), 0, -1):  # the longest matching suffix
      hit = by_path.get(tuple(path[-k:]))
      if hit is not None:
        return hit[1] if hit[0] == shape else default(x)
    if path and isinstance(path[-1], jax.tree_util.SequenceKey):  # one layer of a stacked leaf
      for k in range(len(path) - 1, 0, -1):
        hit = by_path.get(tuple(path[-k - 1:-1]))
        if hit is not None:
          return _without_axis(hit, shape) or default(x)
    return default(x)

  return jax.tree_util.tree_map_with_path(leaf_spec, tree)


def _without_axis(hit: tuple, shape: tuple) -> P | None:
  """The spec of one layer of a stacked parameter: the parameter's without its layer axis."""
  full, spec = hit
  entries = tuple(spec) + (None,) * (len(full) - len(tuple(spec)))
  for axis in range(len(full)):
    if full[:axis] + full[axis + 1:] == shape:
      kept = list(entries[:axis] + entries[axis + 1:])
      while kept and kept[-1] is None:
        kept.pop()
      return P(*kept)
  return None


def strip_site_axis(rules: Rules | None, site_axis: str) -> tuple | None:
  """Logical axis rules with the site axis removed (inside a site program the site axis is manual,
  and ``with_sharding_constraint`` may only name automatic axes)."""
  if rules is None:
    return None
  out = []
  for name, axes in rules:
    if isinstance(axes, (tuple, list)):
      kept = tuple(a for a in axes if a != site_axis)
      axes = kept if len(kept) > 1 else (kept[0] if kept else None)
    elif axes == site_axis:
      axes = None
    out.append((name, axes))
  return tuple(out)
