"""Placements: where the sites run, how state and batches are laid out, how the site program compiles.

A placement is one of

* :class:`Vmap` ``(n)``: all ``n`` sites simulated on one device with
  ``jax.vmap(..., axis_name=...)`` (collectives work under vmap), for
  studying 16 or 64 sites on a laptop or a single GPU;
* :class:`Pmap` ``(n)``: ``jax.pmap`` over ``n`` local devices;
* :class:`Mesh` ``(mesh, ...)``: ``jax.shard_map`` over a mesh (one or
  many hosts), manual over the site axis only; a mesh with axes besides the
  site axis makes each site a group of devices whose sharding (FSDP, tensor
  parallelism) is GSPMD's (:mod:`dadjax.parallel._layout` says where each
  parameter lives).

Layout: every array of the train state carries a leading site axis of size
``num_sites`` (the layout ``pmap`` uses). Under ``shard_map`` the site axis
is sharded over the mesh, so each device holds exactly its own site's copy
(of its share of the site's parameters: a replicated leaf costs a device no
more than in a layout without the site axis).
The batch is global, site-major: every leaf has a leading row axis and rows
``[i * b, (i + 1) * b)`` belong to site ``i``. A process may hand over only
the rows of some sites (those of its devices, :mod:`dadjax.parallel._rows`):
``place_batch(batch, sites)`` builds the global batch from them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dadjax.parallel._rows import global_order
from dadjax.parallel._site_mesh import Build, Mesh

BACKENDS = ("shard_map", "pmap", "vmap")


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
  inner = ()
  per_site = 1
  rows_per_site_unit = 1

  def resolved(self, axis_name: str) -> "Vmap":
    """This placement for the step's axis, its arguments checked."""
    _check_sites(self.backend, self.num_sites)
    return dataclasses.replace(self, axis_name=axis_name)

  def compile(self, build: Build, donate: bool):
    """The jitted step running ``build()`` on every site."""
    return jax.jit(jax.vmap(build(), axis_name=self.axis_name),
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
    return jax.pmap(build(), axis_name=self.axis_name,
                    donate_argnums=(0,) if donate else ())

  def place(self, tree: Any) -> Any:
    return jax.tree.map(jnp.asarray, tree)  # pmap shards its inputs itself

  def place_batch(self, batch: Any, sites: tuple[int, ...] | None = None) -> Any:
    sites = tuple(range(self.num_sites)) if sites is None else sites
    return jax.tree.map(lambda x: np.reshape(global_order(x, sites),
                                             (self.num_sites, -1) + np.shape(x)[1:]), batch)


def placement_of(backend: Any, num_sites: int | None, mesh: Any, shard_params: bool,
                 axis_name: str, **layout):
  """The placement of ``make_train_step``'s arguments, resolved for ``axis_name``.

  ``backend`` is a placement object or one of :data:`BACKENDS`; ``layout``:
  :class:`Mesh`'s ``param_specs``, ``rules`` and ``batch_axes`` (``None``
  when not given).
  """
  layout = {k: v for k, v in layout.items() if v is not None}
  if layout and backend not in ("shard_map", None) and not isinstance(backend, Mesh):
    raise ValueError(f"{sorted(layout)} describe a mesh's in-site layout: they need "
                     f"backend='shard_map', got backend={backend!r}")
  if isinstance(backend, (Vmap, Mesh)):
    if mesh is not None or num_sites is not None or shard_params or layout:
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
    return Mesh(mesh, shard_params, num_sites, **layout).resolved(axis_name)
  if backend == "pmap":
    return Pmap(num_sites).resolved(axis_name)
  return Vmap(num_sites).resolved(axis_name)
