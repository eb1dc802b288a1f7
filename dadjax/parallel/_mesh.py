"""Meshes and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(num_sites: int | None = None, axis_name: str = "data", devices=None, *,
              sites: int | None = None, per_site: int | None = None,
              inner_axis: str = "replica") -> Mesh:
  """A 1-D mesh of sites, or a 2-D mesh of sites made of several devices.

  ``make_mesh(4)`` is a 1-D mesh: 4 sites of one device each.
  ``make_mesh(sites=2, per_site=4)`` is a 2-D mesh with axes
  ``(axis_name, inner_axis)`` = ``("data", "replica")`` of shape ``(2, 4)``:
  site ``s`` is the devices ``devices[s * per_site:(s + 1) * per_site]``
  (on several hosts, ``jax.devices()`` lists each process's devices
  together, so a process with ``per_site`` devices is one site). Every
  dadjax method communicates over ``axis_name`` only; the train step
  averages exactly over ``inner_axis`` (:func:`~dadjax.make_train_step`).

  For a TPU multi-slice job (slices joined by the data-center network),
  build the mesh so that the site axis runs across slices::

    from jax.experimental import mesh_utils
    devices = mesh_utils.create_hybrid_device_mesh(
        mesh_shape=(1, per_site), dcn_mesh_shape=(num_slices, 1))
    mesh = jax.sharding.Mesh(devices, ("data", "replica"))

  Args:
    num_sites: 1-D mesh: how many devices (sites) to use (default: all).
      With ``per_site``, the same as ``sites``.
    axis_name: the site axis's name (what the methods' collectives name);
      default ``"data"``.
    devices: devices to use, default ``jax.devices()`` (all processes).
    sites: 2-D mesh: number of sites (default: all devices over ``per_site``).
    per_site: 2-D mesh: devices per site (``>= 1``).
    inner_axis: 2-D mesh: the in-site axis's name; default ``"replica"``.

  Returns:
    A ``jax.sharding.Mesh`` with one axis, or two (site axis first).
  """
  devices = list(jax.devices() if devices is None else devices)
  if sites is not None and num_sites is not None and sites != num_sites:
    raise ValueError(f"sites={sites} and num_sites={num_sites} disagree; pass one of them")
  if sites is None and per_site is None:
    n = len(devices) if num_sites is None else num_sites
    if isinstance(n, bool) or not (isinstance(n, int) and 1 <= n <= len(devices)):
      raise ValueError(f"num_sites must be an int in [1, {len(devices)}] "
                       f"(the available devices), got {num_sites}")
    return Mesh(np.array(devices[:n]), (axis_name,))
  per = 1 if per_site is None else per_site
  if isinstance(per, bool) or not (isinstance(per, int) and 1 <= per <= len(devices)):
    raise ValueError(f"per_site must be an int in [1, {len(devices)}] (the available devices), "
                     f"got {per_site}")
  n = sites if sites is not None else num_sites
  n = len(devices) // per if n is None else n
  if isinstance(n, bool) or not (isinstance(n, int) and 1 <= n * per <= len(devices)):
    raise ValueError(f"sites must be an int in [1, {len(devices) // per}] ({len(devices)} "
                     f"devices / per_site={per}), got {n}")
  if inner_axis == axis_name:
    raise ValueError(f"inner_axis must differ from axis_name, both are {axis_name!r}")
  return Mesh(np.array(devices[:n * per]).reshape(n, per), (axis_name, inner_axis))


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    *,
    cpu_collectives: str | None = "gloo",
) -> None:
  """Start JAX's multi-host runtime (wraps ``jax.distributed.initialize``).

  On TPU pods and SLURM / Open MPI GPU clusters every argument can be left
  as ``None``: JAX discovers the cluster. On CPU hosts, cross-process
  collectives need an implementation (``"gloo"`` by default); it is set
  before the runtime starts, as JAX requires.

  Args:
    coordinator_address: ``"host:port"`` of process 0.
    num_processes: total number of processes.
    process_id: this process's rank in ``[0, num_processes)``.
    local_device_ids: devices of this process to use.
    cpu_collectives: ``"gloo"``, ``"mpi"`` or ``None`` to leave JAX's default.
  """
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local_device_ids,
  )
