"""A drop-in for your own ``jax.jit`` step: the part from the gradient to ``tx.update``, per site.

A GSPMD train step (``jax.jit`` over ``NamedSharding`` state, as MaxText,
big_vision and the flax examples write it) computes one gradient of the
global batch. To compress across sites, only the part from the gradient to
``tx.update`` has to run once per site; :func:`site_map` wraps that part in a
partially manual ``jax.shard_map`` (manual over the site axis, every other
mesh axis left to GSPMD), and the rest of the step (the model, its
shardings, ``optax.apply_updates``, the checkpointing) stays as it is::

  def site_update(params, opt_state, batch):      # one site's program
    grads = jax.grad(loss_fn)(params, batch)     # this site's rows only
    return tx.update(grads, opt_state, params)   # tx compresses over "data"

  site_update = dadjax.site_map(site_update, mesh)
  opt_state = site_update.init(tx.init(params), params, batch)

  @jax.jit
  def train_step(params, opt_state, batch):
    updates, opt_state = site_update(params, opt_state, batch)
    return optax.apply_updates(params, updates), opt_state

Layout: ``params`` are the same on every site (no site axis); ``batch`` is
the global batch, its leading axis split over the sites (site-major); the
state (argument 1) keeps a leading site axis only on the leaves that differ
between sites (error-feedback memories, a local-update family's inner
parameters), found by JAX's variance types when :meth:`SiteMapped.init`
traces the function once: every other leaf (counters, ledgers, PowerSGD's
shared ``Q``) keeps the layout the user gave it. The types over-approximate:
a leaf computed from a gathered payload (the momentum of TopK's mean) is
typed as differing and kept per site, the same bytes per device as one
copy, since each site's copy lives on its own devices. Outputs that
are the same on every site (the updates) come back without a site axis; an
output that differs per site (a metric of the site's rows) comes back with
one. Inside, the function sees each site's whole (logical) arrays, sharded
by GSPMD over the in-site axes as the caller placed them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dadjax._core.layers import stacked_layers
from dadjax._core.vma import tree_to_varying, vma
from dadjax.comm import compiling_for
from dadjax.parallel._checks import check_opt_state
from dadjax.parallel._layout import mirror_specs, with_fsdp
from dadjax.parallel._site_mesh import SPREAD_MIN_ENTRIES


def _varying(tree: Any, axis: str) -> list[bool]:
  return [axis in vma(x) for x in jax.tree.leaves(tree)]


def _spec(x) -> P:
  sharding = getattr(x, "sharding", None)
  return sharding.spec if isinstance(sharding, NamedSharding) else P()


def _state_layout(state: Any, params: Any, mesh, site_axis: str) -> Any:
  """The in-site spec of every state leaf: a leaf that mirrors a parameter (its path and shape:
  Adam's moments, error-feedback memories) takes the parameter's sharding; any other leaf of at
  least ``SPREAD_MIN_ENTRIES`` entries (PowerSGD's stacked memories and ``Q``) is split over
  the in-site axes (ZeRO-1), as :class:`~dadjax.parallel.Mesh` places ``make_train_step``'s."""
  inner = tuple(a for a in mesh.axis_names if a != site_axis)

  def spread(leaf):
    shape = tuple(np.shape(leaf))
    if not inner or math.prod(shape) < SPREAD_MIN_ENTRIES:
      return P()
    return with_fsdp(P(), shape, dict(mesh.shape), inner)

  return mirror_specs(state, params, jax.tree.map(_spec, params), spread)


def _place(x, spec: P, per_site: bool, n: int, axis: str, mesh):
  """``x`` placed by ``spec`` (and copied along a new leading site axis when ``per_site``);
  a ``ShapeDtypeStruct`` becomes one with that sharding (nothing allocated)."""
  shape = ((n,) if per_site else ()) + tuple(np.shape(x))
  sharding = NamedSharding(mesh, P(axis, *spec) if per_site else spec)
  if isinstance(x, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)
  return jax.device_put(jax.numpy.broadcast_to(x, shape), sharding)


@dataclasses.dataclass(eq=False)  # hashable by identity: jax.jit(site_fn) works
class SiteMapped:
  """The per-site function of :func:`site_map` (call it inside your ``jax.jit``)."""

  fn: Callable
  mesh: Any
  site_axis: str = "data"
  layer_axes: dict = dataclasses.field(default_factory=dict)
  per_site: dict = dataclasses.field(default_factory=dict)  # state treedef -> [bool per leaf]

  @property
  def num_sites(self) -> int:
    return self.mesh.shape[self.site_axis]

  def _run_fn(self, params, state_leaves, treedef, state_flags, batch, rest):
    """``fn`` on one site's view: the state's per-site leaves without their site axis."""
    if state_flags is not None:
      state_leaves = [x[0] if f else x for x, f in zip(state_leaves, state_flags)]
    with stacked_layers(self.layer_axes), compiling_for(self.mesh.devices.flat[0].platform):
      return self.fn(params, jax.tree.unflatten(treedef, state_leaves), batch, *rest)

  def _probe(self, params, state, batch, rest, state_flags):
    """Which outputs of ``fn`` differ by site, read from JAX's variance types (no compilation)."""
    axis, site = self.site_axis, P(self.site_axis)
    found: list = []
    in_state = (jax.tree.map(lambda _: P(), state) if state_flags is None
                else self._state_specs(state))

    def body(params, state, batch, *rest):
      leaves, treedef = jax.tree.flatten(state)
      # typed varying: the gradient of a site-invariant value would be summed over the sites
      out = self._run_fn(tree_to_varying(params, (axis,)), leaves, treedef, state_flags, batch,
                         rest)
      found.append(jax.tree.map(lambda x: axis in vma(x), out))
      return jax.tree.map(lambda x: x[None], tree_to_varying(out, (axis,)))

    jax.eval_shape(jax.shard_map(body, mesh=self.mesh,
                                 in_specs=(P(), in_state, site) + (P(),) * len(rest),
                                 out_specs=site, axis_names={axis}), params, state, batch, *rest)
    out = found[0]
    if not isinstance(out, tuple) or len(out) < 2:
      raise ValueError("site_map: the function must return (updates, state, ...), got "
                       f"{jax.tree.structure(out)}")
    # the updates are the same on every site by contract (the communicating transformation's
    # mean), even where a gather types them varying: they leave without a site axis
    return (jax.tree.map(lambda _: False, out[0]),) + out[1:]

  def _state_specs(self, state: Any) -> Any:
    flags = self.per_site.get(jax.tree.structure(state))
    if flags is None:
      raise ValueError("site_map: the state was not made by init() (its structure is new); call "
                       "state = site_fn.init(state, params, batch) first")
    return jax.tree.unflatten(jax.tree.structure(state),
                              [P(self.site_axis) if f else P() for f in flags])

  def init(self, state: Any, params: Any, batch: Any, *rest) -> Any:
    """``state`` with a leading site axis on the leaves that differ between sites, placed.

    Traces the function once (no compilation) with ``state`` the same on
    every site, reads which leaves of the state it returns differ by site,
    and stacks exactly those (each site's copy on its devices). Every leaf is
    placed inside a site as :func:`_state_layout` says: like the parameter
    it mirrors, else split over the site's devices when large, so no device
    holds a whole model's worth of a method's state. ``ShapeDtypeStruct``
    arguments give a ``ShapeDtypeStruct`` state with those shardings (to
    compile for a TPU topology: :func:`dadjax.pod.compile_report`).
    """
    check_opt_state(state, num_sites=self.num_sites, axis_name=self.site_axis, stage=False,
                    allow_local=False)
    out = self._probe(params, state, batch, rest, None)
    flags = jax.tree.leaves(out[1])
    if len(flags) != len(jax.tree.leaves(state)):
      raise ValueError("site_map: the state the function returns has another structure than the "
                       "state it was given")
    self.per_site[jax.tree.structure(state)] = flags
    specs = jax.tree.structure(state).flatten_up_to(
        _state_layout(state, params, self.mesh, self.site_axis))
    leaves = [_place(x, spec, f, self.num_sites, self.site_axis, self.mesh)
              for x, spec, f in zip(jax.tree.leaves(state), specs, flags)]
    return jax.tree.unflatten(jax.tree.structure(state), leaves)

  def __call__(self, params: Any, state: Any, batch: Any, *rest):
    """``fn(params, state, batch, *rest)`` on every site; outputs as the module docstring says."""
    specs = self._state_specs(state)
    state_flags = self.per_site[jax.tree.structure(state)]
    out_flags = self._probe(params, state, batch, rest, state_flags)
    site = P(self.site_axis)

    def body(params, state, batch, *rest):
      leaves, treedef = jax.tree.flatten(state)
      out = self._run_fn(params, leaves, treedef, state_flags, batch, rest)
      return jax.tree.map(lambda x, f: x[None] if f else x, out, out_flags)

    # Untyped: the updates leave as one copy though a gather typed them varying; without
    # variance types the gradient of the site-invariant params is each site's own.
    mapped = jax.shard_map(body, mesh=self.mesh,
                           in_specs=(P(), specs, site) + (P(),) * len(rest),
                           out_specs=jax.tree.map(lambda f: site if f else P(), out_flags),
                           axis_names={self.site_axis}, check_vma=False)
    return mapped(params, state, batch, *rest)


def site_map(fn: Callable, mesh, site_axis: str = "data", *,
             layer_axes: dict | None = None) -> SiteMapped:
  """Run ``fn(params, state, batch, *rest)`` once per site inside a GSPMD step.

  Args:
    fn: one site's program from the gradient to ``tx.update``: returns
      ``(updates, state, *aux)``; ``updates`` must be the same on every site
      (a dadjax communicating transformation in ``tx`` makes them so).
    mesh: the ``jax.sharding.Mesh``; ``site_axis`` runs over the sites, every
      other axis is GSPMD's inside a site.
    site_axis: the mesh axis of the sites (what the transformations' collectives name).
    layer_axes: ``{leaf path: axis}`` of stacked layers (``nn.scan``):
      communicating transformations treat each layer as a tensor
      (:func:`~dadjax.stacked_layers`; :func:`~dadjax.parallel.layer_axes_of`
      reads them from a Flax model's boxed parameters).

  Returns:
    A :class:`SiteMapped`: ``init(state, params, batch)`` gives the state its
    per-site axes, calling it runs the sites.

  Raises:
    ValueError: ``site_axis`` is not an axis of ``mesh``.
  """
  if site_axis not in mesh.axis_names:
    raise ValueError(f"site_axis {site_axis!r} is not an axis of the mesh {mesh.axis_names}")
  with stacked_layers(dict(layer_axes or {})):  # checks the map
    pass
  return SiteMapped(fn, mesh, site_axis, dict(layer_axes or {}))
