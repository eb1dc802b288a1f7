"""The devices of a named TPU topology, compiled for on any host (no TPU needed).

``jax.experimental.topologies.get_topology_desc`` gives the abstract devices
of a real topology (``"v5e:4x4"`` with ``num_slices=2``: 32 chips in two
slices joined by the data-center network); a mesh of them compiles a step
with the TPU compiler (libtpu) as a job on that pod would, so its memory and
collectives are the compiler's, not an estimate. ``"cpu:8"`` names the
host's (forced) CPU devices instead, so the same report works without libtpu.
"""

from __future__ import annotations

import importlib.util
import os
import re

import jax

# HBM per chip (GiB) by the device kind jax reports (the vendor's published figures).
HBM_GIB = {"TPU v5 lite": 16.0, "TPU v5": 95.0, "TPU v5p": 95.0,
           "TPU v6 lite": 32.0, "TPU7x": 192.0}
_NAME = re.compile(r"^(v4|v5e|v5p|v6e|v5litepod|v5lite|tpu7x):\d+(x\d+){1,2}$")
INSTALL_HINT = ('pip install -e ".[tpu]" (or pip install "jax[tpu]==' + jax.__version__ + '")')


def has_libtpu() -> bool:
  """Whether libtpu (the TPU compiler) is installed."""
  return importlib.util.find_spec("libtpu") is not None


def topology_devices(topology: str, slices: int = 1) -> list:
  """The devices of ``topology`` (``"v5e:4x4"``, ``"v5p:4x4x4"``, ``"v4:2x2x2"``) times ``slices``,
  slice by slice; ``"cpu:N"``: the first ``N`` CPU devices of this process.

  Raises:
    ValueError: a malformed name, ``slices < 1``, too few CPU devices, or
      libtpu missing (the message says how to install it).
  """
  if isinstance(slices, bool) or not isinstance(slices, int) or slices < 1:
    raise ValueError(f"slices must be an int >= 1, got {slices!r}")
  if isinstance(topology, str) and topology.startswith("cpu:") and topology[4:].isdigit():
    n = int(topology[4:]) * slices
    cpus = jax.devices("cpu")
    if not 1 <= n <= len(cpus):
      raise ValueError(f"topology {topology!r} x {slices} slice(s) needs {n} CPU devices, this "
                       f"process has {len(cpus)}; start it with XLA_FLAGS="
                       f"--xla_force_host_platform_device_count={n}")
    return cpus[:n]
  if not isinstance(topology, str) or not _NAME.match(topology):
    raise ValueError(f"topology must name a TPU topology such as 'v5e:4x4', 'v5e:16x16', "
                     f"'v5p:4x4x4' or 'v4:2x2x2', or 'cpu:N' for N host devices; got {topology!r}")
  if not has_libtpu():
    raise ValueError(f"compiling for TPU topology {topology!r} needs libtpu, the TPU compiler: "
                     f"{INSTALL_HINT}; or use --topology cpu:N")
  # Several processes on one host (pytest-xdist workers) may each load libtpu to compile.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
  try:
    desc = topologies.get_topology_desc(platform="tpu", topology_name=topology,
                                        num_slices=slices)
  except Exception as e:  # pylint: disable=broad-except  (libtpu's own error types)
    raise ValueError(f"libtpu does not know topology {topology!r} x {slices} slice(s): "
                     f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
  return sorted(desc.devices, key=lambda d: (getattr(d, "slice_index", 0), d.id))


def hbm_bytes(device) -> float | None:
  """HBM of one chip of ``device``'s kind (``None`` when unknown, e.g. a CPU)."""
  gib = HBM_GIB.get(getattr(device, "device_kind", ""))
  return None if gib is None else gib * 2 ** 30


def slice_count(devices) -> int:
  """Distinct slices among ``devices`` (1 where the devices name none)."""
  return len({getattr(d, "slice_index", 0) for d in devices}) or 1
