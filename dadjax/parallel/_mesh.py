"""Meshes and multi-host start-up."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh


def make_mesh(num_sites: int | None = None, axis_name: str = "data", devices=None, *,
              sites: int | None = None, per_site: int | None = None,
              inner_axis: str = "replica", inner: dict[str, int] | None = None) -> Mesh:
  """A 1-D mesh of sites, or a mesh of sites made of several devices.

  ``make_mesh(4)`` is a 1-D mesh: 4 sites of one device each.
  ``make_mesh(sites=2, per_site=4)`` is a 2-D mesh with axes
  ``(axis_name, inner_axis)`` = ``("data", "replica")`` of shape ``(2, 4)``:
  site ``s`` is the devices ``devices[s * per_site:(s + 1) * per_site]``
  (on several hosts, ``jax.devices()`` lists each process's devices
  together, so a process with ``per_site`` devices is one site).
  ``make_mesh(sites=2, inner={"fsdp": 2, "model": 2})`` gives a site
  several named axes (shape ``(2, 2, 2)``, axes ``("data", "fsdp",
  "model")``) for a model sharded by FSDP and tensor parallelism. Every
  dadjax method communicates over ``axis_name`` only; inside a site the
  sharding is GSPMD's (:func:`~dadjax.make_train_step`).

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
    inner: ``{axis name: size}`` of the in-site axes, in order (instead of
      ``per_site`` and ``inner_axis``).

  Returns:
    A ``jax.sharding.Mesh``, site axis first.
  """
  devices = list(jax.devices() if devices is None else devices)
  if inner is not None:
    return _named_inner_mesh(num_sites if sites is None else sites, axis_name, devices, inner,
                             per_site)
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


def _named_inner_mesh(sites, axis_name: str, devices: list, inner: dict, per_site) -> Mesh:
  if per_site is not None:
    raise ValueError("give the in-site axes either as per_site (one axis) or as inner, not both")
  if not isinstance(inner, dict) or not inner or any(
      not isinstance(k, str) or k == axis_name or isinstance(v, bool) or not isinstance(v, int)
      or v < 1 for k, v in inner.items()):
    raise ValueError(f"inner must be a non-empty dict of in-site axis name -> size >= 1, names "
                     f"other than {axis_name!r}, got {inner!r}")
  per = int(np.prod(list(inner.values())))
  n = len(devices) // per if sites is None else sites
  if isinstance(n, bool) or not (isinstance(n, int) and 1 <= n * per <= len(devices)):
    raise ValueError(f"sites must be an int in [1, {len(devices) // per}] ({len(devices)} "
                     f"devices / {per} per site), got {n}")
  return Mesh(np.array(devices[:n * per]).reshape(n, *inner.values()), (axis_name, *inner))


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids=None,
    *,
    cpu_collectives: str | None = "gloo",
    collectives_hostname: str | None = None,
    collectives_interface: str | None = None,
    coordinator_bind_address: str | None = None,
    initialization_timeout: int | None = None,
    heartbeat_timeout: int | None = 60,
    shutdown_timeout: int | None = None,
) -> None:
  """Start JAX's multi-host runtime (wraps ``jax.distributed.initialize``).

  On TPU pods and SLURM / Open MPI GPU clusters every argument can be left
  as ``None``: JAX discovers the cluster. On CPU hosts, cross-process
  collectives need an implementation (``"gloo"`` by default); it is set
  before the runtime starts, as JAX requires.

  The collectives' network identity: gloo publishes, for every process, an
  address its peers connect to. By default that is what the host name
  (``gethostname()``) resolves to, which is wrong on multi-NIC hosts and in
  network namespaces (it often resolves to ``127.0.0.1``). Pass
  ``collectives_hostname`` (a name or an address of this process's
  interface that peers can reach) or ``collectives_interface`` (an
  interface name, e.g. ``"eth1"``; gloo uses its address). dadjax then
  builds the CPU client with gloo's TCP collectives for that identity,
  through ``jax.extend.backend.register_backend_factory``, before any
  backend starts. For GPU collectives (NCCL) the identity is NCCL's own
  environment: ``NCCL_SOCKET_IFNAME=eth1`` (and ``NCCL_IB_HCA`` for
  InfiniBand), set before the process starts; the coordinator's listening
  address is ``coordinator_bind_address``.

  Args:
    coordinator_address: ``"host:port"`` of process 0.
    num_processes: total number of processes.
    process_id: this process's rank in ``[0, num_processes)``.
    local_device_ids: devices of this process to use.
    cpu_collectives: ``"gloo"``, ``"mpi"`` or ``None`` to leave JAX's default.
    collectives_hostname: gloo only: host name or address peers reach this
      process's collectives at (default: gloo's, from ``gethostname()``).
    collectives_interface: gloo only: network interface whose address the
      collectives use (default: gloo's choice).
    coordinator_bind_address: ``"address:port"`` process 0's coordinator
      listens on (default: every address, the port of ``coordinator_address``).
    initialization_timeout: seconds to wait for every process (JAX's
      default, 300, when ``None``).
    heartbeat_timeout: JAX's ``heartbeat_timeout_seconds``: a process
      silent this long is dead and JAX aborts every process (SIGABRT, "The
      tasks have crashed"). Default 60 (JAX's own: 100). The training loop
      notices a lost process sooner, with its own message
      (``Config.peer_timeout_s``, 20 s); keep this one above it.
    shutdown_timeout: JAX's ``shutdown_timeout_seconds``, how long a
      finished process waits at exit for the others (JAX's default, 300,
      when ``None``).

  Raises:
    ValueError: a bad rank or process count, a network identity without
      gloo, or a backend that has already started (call this first).
  """
  _check_processes(num_processes, process_id)
  identity = _check_identity(cpu_collectives, collectives_hostname, collectives_interface)
  if cpu_collectives is not None:
    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  if identity:
    _register_gloo_cpu_client(collectives_hostname, collectives_interface)
  jax.distributed.initialize(
      coordinator_address=coordinator_address,
      num_processes=num_processes,
      process_id=process_id,
      local_device_ids=local_device_ids,
      **_runtime_options(coordinator_bind_address, initialization_timeout, heartbeat_timeout,
                         shutdown_timeout),
  )


def _check_processes(num_processes: int | None, process_id: int | None) -> None:
  if num_processes is not None and num_processes < 1:
    raise ValueError(f"num_processes must be >= 1, got {num_processes}")
  if process_id is not None and num_processes is not None and not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")


def _check_identity(cpu_collectives: str | None, hostname: str | None,
                    interface: str | None) -> bool:
  """Whether gloo's network identity is set (and set right: only with gloo, non-empty strings)."""
  identity = hostname is not None or interface is not None
  if identity and cpu_collectives != "gloo":
    raise ValueError("collectives_hostname / collectives_interface set gloo's network identity; "
                     f"they need cpu_collectives='gloo', got {cpu_collectives!r} (for NCCL set "
                     "NCCL_SOCKET_IFNAME in the environment)")
  for name, value in (("collectives_hostname", hostname), ("collectives_interface", interface)):
    if value is not None and not (isinstance(value, str) and value):
      raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
  return identity


def _runtime_options(coordinator_bind_address, initialization_timeout, heartbeat_timeout,
                     shutdown_timeout) -> dict:
  """``jax.distributed.initialize``'s keyword arguments for the options given (JAX's defaults else)."""
  kwargs = {}
  if coordinator_bind_address is not None:
    kwargs["coordinator_bind_address"] = coordinator_bind_address
  if initialization_timeout is not None:
    kwargs["initialization_timeout"] = int(initialization_timeout)
  if heartbeat_timeout is not None:
    kwargs["heartbeat_timeout_seconds"] = int(heartbeat_timeout)
  if shutdown_timeout is not None:
    kwargs["shutdown_timeout_seconds"] = int(shutdown_timeout)
  return kwargs


def _register_gloo_cpu_client(hostname: str | None, interface: str | None) -> None:
  """Make the CPU backend use gloo's TCP collectives at ``hostname`` / ``interface``.

  JAX's own CPU factory calls ``make_gloo_tcp_collectives`` without them;
  this registers a factory that passes them (same priority, so it replaces
  JAX's). It must run before the backend starts.
  """
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
  from jax._src.lib import _jax  # pylint: disable=g-import-not-at-top
  from jax.extend.backend import register_backend_factory  # pylint: disable=g-import-not-at-top

  if xla_bridge.backends_are_initialized():
    raise ValueError("collectives_hostname / collectives_interface must be set before any JAX "
                     "computation starts a backend; call dadjax.initialize first")

  def factory():
    client = distributed.global_state.client
    if client is None:  # no multi-process runtime: JAX's plain CPU client
      return xla_bridge.make_cpu_client()
    collectives = _jax.make_gloo_tcp_collectives(distributed_client=client, hostname=hostname,
                                                 interface=interface)
    return xla_bridge.make_cpu_client(collectives=collectives)

  register_backend_factory("cpu", factory, priority=0, fail_quietly=False)
