"""Placements: where the sites run, how state and batches are laid out, how the site program compiles.

A placement is one of

* :class:`Vmap` ``(n)``: all ``n`` sites simulated on one device with
  ``jax.vmap(..., axis_name=...)`` (collectives work under vmap), for
  studying 16 or 64 sites on a laptop or a single GPU;
* :class:`Pmap` ``(n)``: ``jax.pmap`` over ``n`` local devices;
* :class:`Mesh` ``(mesh, shard_params=...)``: ``jax.shard_map`` over a mesh
  (one or many hosts); a mesh with axes besides the site axis makes each
  site a group of devices (the in-site reduction of
  :class:`~dadjax.parallel._insite.InSite`), and ``shard_params`` splits each
  site's parameters over them.

Layout: every array of the train state carries a leading site axis of size
``num_sites`` (the layout ``pmap`` uses). Under ``shard_map`` the site axis
is sharded over the mesh, so each device holds exactly its own site's copy.
The batch is global, site-major: every leaf has a leading row axis and rows
``[i * b, (i + 1) * b)`` belong to site ``i``. A process may hand over only
the rows of some sites (those of its devices, :mod:`dadjax.parallel._rows`):
``place_batch(batch, sites)`` builds the global batch from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from dadjax.parallel._insite import InSite, sharded_layout
from dadjax.parallel._mesh import make_mesh
from dadjax.parallel._rows import global_order, put_site_rows

BACKENDS = ("shard_map", "pmap", "vmap")
# site program factory: InSite -> (state, batch) -> (state, metrics)
Build = Callable[[InSite], Callable]


def _check_sites(name: str, num_sites: Any) -> int:
  if isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1:
    raise ValueError(f"num_sites must be an int >= 1 for backend={name!r}, got {num_sites!r}")
  return num_sites


@dataclasses.dataclass(frozen=True)
class Vmap:
  """All sites simulated on one device (``jax.vmap`` with the site axis name).

  Attributes:
    num_sites: the number of sites, an int >= 1.
    axis_name: the site axis (set by ``make_train_step``).
  """

  num_sites: int
  axis_name: str = "data"

  backend = "vmap"
  mesh = None
  shard_params = False
  in_site = InSite()
  per_site = 1

  def resolved(self, axis_name: str) -> "Vmap":
    """This placement for the step's axis, its arguments checked."""
    _check_sites(self.backend, self.num_sites)
    return dataclasses.replace(self, axis_name=axis_name)

  def compile(self, build: Build, donate: bool):
    """The jitted step running ``build(InSite())`` on every site."""
    return jax.jit(jax.vmap(build(self.in_site), axis_name=self.axis_name),
                   donate_argnums=(0,) if donate else ())

  def place(self, tree: Any) -> Any:
    """Device arrays of a site-stacked tree."""
    return jax.tree.map(jnp.asarray, tree)

  def state_specs(self, state: Any) -> Any:
    raise ValueError(f"state_specs is for backend='shard_map' (a mesh), not {self.backend!r}")

  def place_batch(self, batch: Any, sites: tuple[int, ...] | None = None) -> Any:
    """The global batch split into ``(num_sites, rows per site, ...)``.

    ``sites``: the order of the batch's site blocks (every site; default ascending).
    """
    sites = tuple(range(self.num_sites)) if sites is None else sites
    return jax.tree.map(lambda x: jnp.asarray(np.reshape(
        global_order(x, sites), (self.num_sites, -1) + np.shape(x)[1:])), batch)


@dataclasses.dataclass(frozen=True)
class Pmap(Vmap):
  """One local device per site (``jax.pmap``).

  Attributes:
    num_sites: the number of sites, an int in ``[1, jax.local_device_count()]``;
      ``None``: every local device.
  """

  num_sites: int | None = None
  backend = "pmap"

  def resolved(self, axis_name: str) -> "Pmap":
    n = jax.local_device_count() if self.num_sites is None else self.num_sites
    _check_sites(self.backend, n)
    if n > jax.local_device_count():
      raise ValueError(f"num_sites must be <= {jax.local_device_count()} local devices "
                       f"for backend='pmap', got {n}")
    return dataclasses.replace(self, num_sites=n, axis_name=axis_name)

  def compile(self, build: Build, donate: bool):
    return jax.pmap(build(self.in_site), axis_name=self.axis_name,
                    donate_argnums=(0,) if donate else ())

  def place(self, tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)  # pmap shards its inputs itself

  def place_batch(self, batch: Any, sites: tuple[int, ...] | None = None) -> Any:
    sites = tuple(range(self.num_sites)) if sites is None else sites
    return jax.tree.map(lambda x: np.reshape(global_order(x, sites),
                                             (self.num_sites, -1) + np.shape(x)[1:]), batch)


@dataclasses.dataclass(frozen=True)
class Mesh:
  """``jax.shard_map`` over a mesh whose ``axis_name`` axis runs over the sites.

  Attributes:
    mesh: a ``jax.sharding.Mesh``; ``None``: :func:`~dadjax.parallel.make_mesh`
      over ``num_sites`` devices (all devices when ``None``).
    shard_params: split each site's parameters and their optimizer state
      over the site's devices (needs a 2-D mesh).
    num_sites: with ``mesh=None``, the number of sites; with a mesh it must
      be ``None`` or the site axis's size.
    axis_name: the site axis (set by ``make_train_step``).
  """

  mesh: Any = None
  shard_params: bool = False
  num_sites: int | None = None
  axis_name: str = "data"

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
    placed = dataclasses.replace(self, mesh=mesh, num_sites=size, axis_name=axis_name)
    if self.shard_params and not placed.inner:
      raise ValueError("shard_params=True splits parameters over the devices of a site: it needs "
                       "backend='shard_map' and a 2-D mesh, e.g. mesh=make_mesh(sites=2, "
                       f"per_site=4); got backend='shard_map', mesh axes {mesh.axis_names}")
    return placed

  @property
  def inner(self) -> tuple[str, ...]:
    """The in-site axes (``()`` on a 1-D mesh)."""
    return tuple(a for a in self.mesh.axis_names if a != self.axis_name)

  @property
  def per_site(self) -> int:
    return int(np.prod([self.mesh.shape[a] for a in self.inner])) if self.inner else 1

  @property
  def in_site(self) -> InSite:
    return InSite(self.inner)

  def compile(self, build: Build, donate: bool):
    """The jitted ``shard_map`` step (per state layout with sharded parameters)."""

    def compile_for(state_specs, dims):
      program = build(InSite(self.inner, dims))

      def blocked(state, batch):
        new_state, metrics = program(jax.tree.map(lambda x: x[0], state), batch)
        return jax.tree.map(lambda x: x[None], (new_state, metrics))

      return jax.jit(
          jax.shard_map(blocked, mesh=self.mesh, in_specs=(state_specs, self._batch_spec),
                        out_specs=(state_specs, P(self.axis_name))),
          donate_argnums=(0,) if donate else ())

    if self.shard_params:
      return PerLayoutRun(compile_for, self)
    return compile_for(P(self.axis_name), None)

  @property
  def _batch_spec(self) -> P:
    return P((self.axis_name, *self.inner))

  def state_specs(self, state: Any) -> Any:
    """The ``PartitionSpec`` of every leaf of a site-stacked state.

    Every leaf is split over the sites on its leading axis. With
    ``shard_params`` a parameter is also split over the in-site axes along
    :func:`~dadjax.parallel.shard_dims`'s dimension, and so is each
    optimizer-state leaf whose key path ends with that parameter's path and
    whose shape is the parameter's (momenta, Adam moments, error-feedback
    memories, accumulators); every other leaf (counters, ledgers) is whole
    on every device of a site.
    """
    if not self.shard_params:
      return jax.tree.map(lambda _: P(self.axis_name), state)
    return sharded_layout(state, self.axis_name, self.inner, self.per_site)[0]

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
    sharding = NamedSharding(self.mesh, self._batch_spec)
    return jax.tree.map(lambda x: put_site_rows(x, sites, self.num_sites, sharding), batch)


class PerLayoutRun:
  """The jitted step for sharded parameters, built once per state layout.

  ``shard_map`` needs each leaf's spec, which depends on the parameters'
  shapes: the first call (or ``lower``) with a state of new shapes builds
  the program for the placement's ``state_specs`` of that state.
  """

  def __init__(self, compile_for, placement: Mesh):
    self.compile_for, self.placement = compile_for, placement
    self.programs: dict = {}

  def program(self, state: Any):
    key = (jax.tree.structure(state), tuple(np.shape(x) for x in jax.tree.leaves(state)))
    if key not in self.programs:
      p = self.placement
      self.programs[key] = self.compile_for(
          *sharded_layout(state, p.axis_name, p.inner, p.per_site))
    return self.programs[key]

  def __call__(self, state: Any, batch: Any):
    return self.program(state)(state, batch)

  def lower(self, state: Any, batch: Any):
    return self.program(state).lower(state, batch)


def placement_of(backend: Any, num_sites: int | None, mesh: Any, shard_params: bool,
                 axis_name: str):
  """The placement of ``make_train_step``'s arguments, resolved for ``axis_name``.

  ``backend`` is a placement object or one of :data:`BACKENDS`.
  """
  if isinstance(backend, (Vmap, Mesh)):
    if mesh is not None or num_sites is not None or shard_params:
      raise ValueError("with a placement object as backend, give num_sites, mesh and "
                       "shard_params to the placement (e.g. Mesh(mesh, shard_params=True))")
    return backend.resolved(axis_name)
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS} or a placement (Vmap(n), Pmap(n), "
                     f"Mesh(mesh)), got {backend!r}")
  if backend != "shard_map" and mesh is not None:
    raise ValueError(f"mesh is for backend='shard_map'; backend={backend!r} runs one device "
                     "per site (1-D) and takes num_sites")
  if shard_params and backend != "shard_map":
    raise ValueError("shard_params=True splits parameters over the devices of a site: it needs "
                     "backend='shard_map' and a 2-D mesh, e.g. mesh=make_mesh(sites=2, "
                     f"per_site=4); got backend={backend!r}, mesh axes None")
  if backend == "shard_map":
    return Mesh(mesh, shard_params, num_sites).resolved(axis_name)
  if backend == "pmap":
    return Pmap(num_sites).resolved(axis_name)
  return Vmap(num_sites).resolved(axis_name)
