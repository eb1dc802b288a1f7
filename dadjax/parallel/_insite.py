"""The in-site reduction: what a site of several devices does before and after its method.

On a 2-D mesh (``make_mesh(sites=..., per_site=...)``) each site is a group
of devices: every device computes the gradient of its share of the site's
rows, the gradients, the updated collections and the metrics are averaged
exactly over the in-site axes (booked in the in-site ledger), and the method
then runs over the site axis identically on every device of the site. With
sharded parameters (FSDP) the site holds slices, all-gathered for the
forward pass and reduce-scattered back. On a 1-D layout (one device per
site: ``Vmap``, ``Pmap``, a 1-D ``Mesh``) :class:`InSite` has no axes and
every operation is the identity with no traffic, so the site program has no
special case.
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from dadjax._core.shards import sharded_parameters
from dadjax._tree_utils import leaf_path
from dadjax.comm import (
    NO_TRAFFIC,
    Traffic,
    is_varying,
    ledger_record,
    metered_gather_shards,
    metered_mean_scatter,
    metered_pmean,
    metered_psum,
    traffic_add,
    tree_to_varying,
)
from dadjax.parallel._state import unstack_shapes


def shard_dims(params: Any, per_site: int) -> Any:
  """Which dimension of each parameter is split over the devices of a site (FSDP).

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


def _with_dims(params: Any, dims: Any) -> list[tuple[tuple, Any, int | None]]:
  """``(key path, leaf, sharded dimension or None)`` for every parameter leaf."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [(path, x, d) for (path, x), d in zip(
      leaves, jax.tree.structure(params).flatten_up_to(dims))]


def sharded_layout(state: Any, axis_name: str, inner: tuple[str, ...],
                   per_site: int) -> tuple[Any, Any]:
  """``(specs, dims)``: the state's specs with sharded parameters, and
  :func:`shard_dims` of one site's parameters.

  A parameter is split over ``inner`` along its :func:`shard_dims`
  dimension, and so is each optimizer-state leaf whose key path ends with
  that parameter's path and whose shape is the parameter's; every other leaf
  is split over the sites only.
  """
  site = P(axis_name)
  inner_spec = inner[0] if len(inner) == 1 else inner
  dims = shard_dims(unstack_shapes(state.params), per_site)

  def spec(d):
    return site if d is None else P(axis_name, *([None] * d), inner_spec)

  params = _with_dims(state.params, dims)
  by_path = {tuple(path): (np.shape(x), spec(d)) for path, x, d in params}

  def opt_spec(path, x):
    for k in range(len(path), 0, -1):  # the longest matching suffix
      hit = by_path.get(tuple(path[-k:]))
      if hit is not None:
        return hit[1] if hit[0] == np.shape(x) else site
    return site

  specs = state._replace(
      params=jax.tree.unflatten(jax.tree.structure(state.params), [spec(d) for _, _, d in params]),
      opt_state=jax.tree_util.tree_map_with_path(opt_spec, state.opt_state),
      **{f: jax.tree.map(lambda _: site, getattr(state, f))
         for f in type(state)._fields if f not in ("params", "opt_state")})
  return specs, dims


def _is_float(v) -> bool:
  return jnp.issubdtype(jnp.result_type(v), jnp.inexact)


def mean_in_site(tree: Any, axes) -> tuple[Any, Traffic]:
  """A tree made equal on every device of a site: the exact mean of its float leaves
  (``pmean``) and the first device's integer leaves (one ``psum`` of that
  device's value, dtype kept). The default in-site rule of a collection."""
  floats, traffic = metered_pmean(jax.tree.map(lambda v: v if _is_float(v) else None, tree), axes)
  ints = jax.tree.map(lambda v: None if _is_float(v) else v, tree)
  if jax.tree.leaves(ints):
    first = jax.lax.axis_index(axes) == 0
    ints, t = metered_psum(jax.tree.map(lambda v: jnp.where(first, v, jnp.zeros_like(v)), ints),
                           axes)
    traffic = traffic_add(traffic, t)
  return jax.tree.map(lambda f, i: i if f is None else f, floats, ints,
                      is_leaf=lambda x: x is None), traffic


class InSite(NamedTuple):
  """The in-site axes of a layout (``()``: one device per site) and the sharded dims.

  Attributes:
    axes: the mesh axes inside a site.
    dims: with sharded parameters, :func:`shard_dims` of one site's
      parameters; ``None`` when every device holds whole parameters.
  """

  axes: tuple[str, ...] = ()
  dims: Any = None

  def device_key(self, key: jax.Array) -> jax.Array:
    """Each device of a site draws its own dropout masks."""
    if self.axes and jax.lax.axis_size(self.axes) > 1:
      return jax.random.fold_in(key, jax.lax.axis_index(self.axes))
    return key

  def local(self, params: Any, model_state: Any) -> tuple[Any, Any, Traffic]:
    """The device's view: whole parameters (gathered from slices), typed varying."""
    if not self.axes:
      return params, model_state, NO_TRAFFIC
    traffic = NO_TRAFFIC
    if self.dims is not None:
      params, traffic = metered_gather_shards(params, self.axes, self.dims)
    return (tree_to_varying(params, self.axes), tree_to_varying(model_state, self.axes),
            traffic)

  def mean_grads(self, grads: Any) -> tuple[Any, Traffic]:
    """The exact in-site mean of the gradients (slices of it for sharded leaves)."""
    if not self.axes:
      return grads, NO_TRAFFIC
    if self.dims is None:
      return metered_pmean(grads, self.axes)
    grads, scatter = metered_mean_scatter(grads, self.axes, self.dims)
    leaves, treedef = jax.tree.flatten(grads)
    whole = [i for i, d in enumerate(treedef.flatten_up_to(self.dims)) if d is None]
    means, reduce = metered_pmean([leaves[i] for i in whole], self.axes)
    for i, mean in zip(whole, means):
      leaves[i] = mean
    return jax.tree.unflatten(treedef, leaves), traffic_add(scatter, reduce)

  def sync(self, old: Mapping, new: Mapping, rules: Mapping) -> tuple[dict, Traffic]:
    """The model state after the step, equal on every device of a site.

    A collection with a rule keeps its new value, made equal over the site
    by the rule's ``in_site`` (default :func:`mean_in_site`) where it differs
    between devices; every other collection keeps ``old``.
    """
    if not self.axes:
      return dict(new), NO_TRAFFIC
    out, traffic = dict(old), NO_TRAFFIC
    for name, value in new.items():
      if name not in rules or name not in old:
        continue
      if any(is_varying(x, a) for x in jax.tree.leaves(value) for a in self.axes):
        reduce = rules[name].in_site or mean_in_site
        value, t = reduce(value, self.axes)
        traffic = traffic_add(traffic, t)
      out[name] = value
    return out, traffic

  def mean(self, tree: Any) -> tuple[Any, Traffic]:
    """The exact in-site mean of a tree of floats (the metrics)."""
    return metered_pmean(tree, self.axes) if self.axes else (tree, NO_TRAFFIC)

  def check_stage_state(self, stage_state: Any) -> Any:
    """A batch stage's state must be the same on every device of a site."""
    for leaf in jax.tree.leaves(stage_state):
      if any(is_varying(leaf, a) for a in self.axes):
        raise ValueError("batch_stage: its state differs between the devices of a site (it "
                         "depends on the device's rows); such a stage supports 1-D meshes only")
    return stage_state

  def optimizer_scope(self, params: Any):
    """The context the optimizer is traced in (sharded parameters: slice-aware methods)."""
    if self.dims is None:
      return contextlib.nullcontext()
    by_path = {leaf_path(path): d for path, _, d in _with_dims(params, self.dims)}
    return sharded_parameters(self.axes, by_path)

  def record(self, ledger: Any, traffic: Traffic) -> Any:
    """The in-site ledger after this step's traffic (``None`` without in-site axes)."""
    if not self.axes:
      return ledger
    return ledger_record(ledger, reduce=traffic.reduce, gather=traffic.gather,
                         reduce_calls=traffic.reduce_calls, gather_calls=traffic.gather_calls)
