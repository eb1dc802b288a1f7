"""Meshes and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(num_sites: int | None = None, axis_name: str = "data", devices=None) -> Mesh:
  """A 1-D mesh of ``num_sites`` devices (default: all global devices).

  Args:
    num_sites: how many devices (sites) to use; must not exceed the devices.
    axis_name: the name collectives refer to; default ``"data"``.
    devices: devices to use, default ``jax.devices()`` (all processes).

  Returns:
    A ``jax.sharding.Mesh`` with one axis.
  """
  devices = list(jax.devices() if devices is None else devices)
  n = len(devices) if num_sites is None else num_sites
  if not (isinstance(n, int) and 1 <= n <= len(devices)):
    raise ValueError(f"num_sites must be an int in [1, {len(devices)}] "
                     f"(the available devices), got {num_sites}")
  return Mesh(np.array(devices[:n]), (axis_name,))


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
