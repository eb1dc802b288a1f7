"""The ``shard_map`` placement: manual over the site axis, GSPMD inside each site.

See :mod:`dadjax.parallel._placement` for the state and batch layout every
placement shares, and :mod:`dadjax.parallel._layout` for where each
parameter lives inside a site.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dadjax.comm import compiling_for
from dadjax.parallel._layout import mirror_specs, param_layout, strip_site_axis, with_fsdp
from dadjax.parallel._mesh import make_mesh
from dadjax.parallel._rows import put_site_rows
from dadjax.parallel._state import unstack_shapes

# A method's own state leaf (one that mirrors no parameter) with fewer entries stays whole on
# every device of a site: splitting 16 KiB saves nothing an in-site all-gather would not cost.
SPREAD_MIN_ENTRIES = 4096

# site program factory: () -> (state, batch) -> (state, metrics)
Build = Callable[[], Callable]


@dataclasses.dataclass(frozen=True)
class Mesh:
  """``jax.shard_map`` over a mesh whose ``axis_name`` axis runs over the sites.

  The site program is manual over the site axis only (a partially manual
  ``shard_map(..., axis_names={axis_name})``); every other mesh axis is
  GSPMD's. A site of several devices therefore keeps the sharding its model
  declares (:mod:`dadjax.parallel._layout`: FSDP, tensor parallelism, both),
  its batch rows are split over ``batch_axes``, and XLA inserts the in-site
  collectives; the methods see each site's whole (logical) tensors and
  communicate over the site axis.

  Attributes:
    mesh: a ``jax.sharding.Mesh``; ``None``: :func:`~dadjax.parallel.make_mesh`
      over ``num_sites`` devices (all devices when ``None``).
    shard_params: FSDP for parameters that declare no sharding: each is
      split along :func:`~dadjax.parallel.shard_dims`'s dimension over every
      in-site axis (needs a mesh with in-site axes).
    num_sites: with ``mesh=None``, the number of sites; with a mesh it must
      be ``None`` or the site axis's size.
    axis_name: the site axis (set by ``make_train_step``).
    param_specs: in-site ``PartitionSpec`` per parameter: a tree (prefix) or
      ``params -> specs``; ``None``: the model's metadata (module
      :mod:`~dadjax.parallel._layout`).
    rules: logical axis rules (``(logical name, mesh axes)`` pairs) for
      ``nn.with_logical_partitioning`` parameters and
      ``nn.with_logical_constraint`` activations; ``None``: the
      ``nn.logical_axis_rules`` context active when the step is built. The
      site axis is removed from them inside the site program.
    batch_axes: the in-site axes a site's rows are split over; ``None``:
      every in-site axis.
  """

  mesh: Any = None
  shard_params: bool = False
  num_sites: int | None = None
  axis_name: str = "data"
  param_specs: Any = None
  rules: Any = None
  batch_axes: tuple[str, ...] | None = None
  # the in-site specs of the parameters recorded by TrainStep.init (from the model's metadata)
  recorded: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

  backend = "shard_map"

  def resolved(self, axis_name: str) -> "Mesh":
    mesh = make_mesh(self.num_sites, axis_name) if self.mesh is None else self.mesh
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    size = mesh.shape[axis_name]
    if self.num_sites is not None and self.mesh is not None and self.num_sites != size:
      raise ValueError(f"num_sites={self.num_sites} differs from the mesh's {axis_name!r} axis of "
                       f"size {size}; leave num_sites=None with a mesh")
    if not isinstance(self.shard_params, bool):
      raise ValueError(f"shard_params must be a bool, got {self.shard_params!r}")
    rules = self.rules
    if rules is None:
      import flax.linen as nn  # pylint: disable=g-import-not-at-top
      rules = tuple(nn.get_logical_axis_rules()) or None
    placed = dataclasses.replace(self, mesh=mesh, num_sites=size, axis_name=axis_name,
                                 rules=rules, recorded={})
    if self.shard_params and not placed.inner:
      raise ValueError("shard_params=True splits parameters over the devices of a site: it needs "
                       "backend='shard_map' and a mesh with in-site axes, e.g. mesh=make_mesh("
                       f"sites=2, per_site=4); got backend='shard_map', mesh axes {mesh.axis_names}")
    if self.batch_axes is not None:
      bad = [a for a in self.batch_axes if a not in placed.inner]
      if isinstance(self.batch_axes, str) or bad:
        raise ValueError(f"batch_axes must be a tuple of in-site axes {placed.inner}, got "
                         f"{self.batch_axes!r}")
    return placed

  @property
  def inner(self) -> tuple[str, ...]:
    """The in-site axes (``()`` on a 1-D mesh)."""
    return tuple(a for a in self.mesh.axis_names if a != self.axis_name)

  @property
  def per_site(self) -> int:
    return int(np.prod([self.mesh.shape[a] for a in self.inner])) if self.inner else 1

  @property
  def row_axes(self) -> tuple[str, ...]:
    """The in-site axes a site's rows are split over."""
    return self.inner if self.batch_axes is None else tuple(self.batch_axes)

  @property
  def rows_per_site_unit(self) -> int:
    """A site's rows must be a multiple of this (the devices its rows are split over)."""
    return int(np.prod([self.mesh.shape[a] for a in self.row_axes])) if self.row_axes else 1

  def compile(self, build: Build, donate: bool):
    """The jitted step: manual over the site axis, GSPMD inside (one program per state layout)."""
    program = build()
    inner_rules = strip_site_axis(self.rules, self.axis_name)

    platform = self.mesh.devices.flat[0].platform  # a TPU topology's on a CPU host

    def blocked(state, batch):
      with _logical_rules(inner_rules), compiling_for(platform):
        new_state, metrics = program(jax.tree.map(lambda x: x[0], state), batch)
      return jax.tree.map(lambda x: x[None], (new_state, metrics))

    site = P(self.axis_name)
    mapped = jax.shard_map(blocked, mesh=self.mesh, in_specs=(site, site),
                           out_specs=(site, site), axis_names={self.axis_name})

    def compile_for(state):
      shardings = self.shardings(self.state_specs(state))
      return jax.jit(mapped, in_shardings=(shardings, self.batch_sharding),
                     out_shardings=(shardings, NamedSharding(self.mesh, site)),
                     donate_argnums=(0,) if donate else ())

    return PerLayoutRun(compile_for)

  @property
  def batch_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P((self.axis_name, *self.row_axes)))

  def shardings(self, specs: Any) -> Any:
    return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                        is_leaf=lambda x: isinstance(x, P))

  def record(self, params: Any) -> Any:
    """Record the in-site specs of one site's (possibly boxed) parameters; returns them."""
    specs = param_layout(params, mesh_shape=dict(self.mesh.shape), site_axis=self.axis_name,
                         inner=self.inner, param_specs=self.param_specs, rules=self.rules,
                         shard_params=self.shard_params)
    self.recorded["params"] = (jax.tree.structure(specs, is_leaf=lambda x: isinstance(x, P)),
                               specs)
    return specs

  def param_specs_of(self, params: Any) -> Any:
    """The in-site specs of one site's parameters (recorded at init, else computed)."""
    hit = self.recorded.get("params")
    if hit is not None and hit[0] == jax.tree.structure(params):
      return hit[1]
    return self.record(params)

  def state_specs(self, state: Any) -> Any:
    """The ``PartitionSpec`` of every leaf of a site-stacked state.

    Every leaf is split over the sites on its leading axis. A parameter
    keeps its in-site spec after it (:meth:`param_specs_of`), and so does
    each optimizer-state leaf that mirrors it
    (:func:`~dadjax.parallel._layout.mirror_specs`); every other leaf of at
    least :data:`SPREAD_MIN_ENTRIES` entries (PowerSGD's stacked memories and
    Q factors, a method's own buffers) is split over the in-site axes along
    its largest dimension they divide (:meth:`spread_spec`, ZeRO-1 style),
    and the rest (counters, ledgers, keys) are whole on every device of a site.
    """
    site = P(self.axis_name)
    if not hasattr(state, "params"):
      return jax.tree.map(lambda _: site, state)
    one_site = unstack_shapes(state.params)
    inner = self.param_specs_of(one_site)
    stacked = lambda s: P(self.axis_name, *s)
    params = jax.tree.map(stacked, inner, is_leaf=lambda x: isinstance(x, P))
    mirrored = lambda tree: jax.tree.map(
        stacked, mirror_specs(unstack_shapes(tree), one_site, inner, self.spread_spec),
        is_leaf=lambda x: isinstance(x, P))
    fields = {f: jax.tree.map(lambda _: site, getattr(state, f)) for f in type(state)._fields}
    fields.update(params=params, opt_state=mirrored(state.opt_state),
                  stage_state=mirrored(state.stage_state))
    return type(state)(**fields)

  def spread_spec(self, leaf: Any) -> P:
    """The in-site spec of one site's state leaf that mirrors no parameter.

    Split over every in-site axis along the largest dimension their combined
    size divides (:func:`~dadjax.parallel._layout.with_fsdp`); whole when it
    has fewer than :data:`SPREAD_MIN_ENTRIES` entries or no such dimension.
    """
    shape = tuple(np.shape(leaf))
    if math.prod(shape) < SPREAD_MIN_ENTRIES:
      return P()
    return with_fsdp(P(), shape, dict(self.mesh.shape), self.inner)

  def place(self, tree: Any, specs: Any = None) -> Any:
    """A site-stacked tree placed by ``specs`` (default: split over the sites)."""
    specs = P(self.axis_name) if specs is None else specs
    specs = jax.tree.broadcast(specs, tree, is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(lambda x, spec: self._put(x, spec), tree, specs)

  def _put(self, x, spec):
    return jax.make_array_from_callback(np.shape(x), NamedSharding(self.mesh, spec),
                                        lambda idx, x=x: np.asarray(x)[idx])

  def place_batch(self, batch: Any, sites: tuple[int, ...] | None = None) -> Any:
    """The global batch array from the rows of ``sites`` (default: every site's,
    ascending); each device reads only its own site's rows (:func:`put_site_rows`)."""
    sites = tuple(range(self.num_sites)) if sites is None else sites
    return jax.tree.map(lambda x: put_site_rows(x, sites, self.num_sites, self.batch_sharding),
                        batch)


def _logical_rules(rules):
  if rules is None:
    return contextlib.nullcontext()
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  return nn.logical_axis_rules(rules)


class PerLayoutRun:
  """The jitted step, built once per state layout (its shardings depend on the leaves' shapes)."""

  def __init__(self, compile_for):
    self.compile_for = compile_for
    self.programs: dict = {}

  def program(self, state: Any):
    key = (jax.tree.structure(state), tuple(np.shape(x) for x in jax.tree.leaves(state)))
    if key not in self.programs:
      self.programs[key] = self.compile_for(state)
    return self.programs[key]

  def __call__(self, state: Any, batch: Any):
    return self.program(state)(state, batch)

  def lower(self, state: Any, batch: Any):
    return self.program(state).lower(state, batch)
