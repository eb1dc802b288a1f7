"""Compiled for the pod: a step compiled by the TPU compiler for a named topology, on any host.

``jax.experimental.topologies`` gives the abstract devices of a TPU
topology; a step lowered on ``ShapeDtypeStruct`` with shardings over them
compiles with libtpu (``pip install -e ".[tpu]"``) as it would on that pod,
so its per-device memory, its collectives (in-slice ICI, cross-slice DCN)
and its FLOPs are the compiler's (MaxText's ``train_compile`` does the same
for its jobs). ``dadjax compile CONFIG --topology v5e:16x16 --slices 4`` is
the command; ``topology="cpu:8"`` compiles for host devices instead.

* :func:`topology_devices`: the devices of ``"v5e:4x4"`` x slices;
* :func:`compile_config`: a run config's own step, compiled, reported;
* :func:`compile_step` / :func:`compile_report`: a
  :class:`~dadjax.parallel.TrainStep`, or any lowered program (your own
  ``jax.jit`` step with :func:`dadjax.site_map` inside), compiled, reported;
* :class:`CompileReport`: the figures, ``.table()`` and ``.to_json()``.
"""

from dadjax.pod._config import compile_config, pod_layout, pod_mesh
from dadjax.pod._report import Collective, CompileReport, collectives_of, compile_report, compile_step
from dadjax.pod._topology import HBM_GIB, has_libtpu, hbm_bytes, topology_devices

__all__ = ["topology_devices", "has_libtpu", "hbm_bytes", "HBM_GIB", "compile_config",
           "compile_step", "compile_report", "collectives_of", "CompileReport", "Collective",
           "pod_mesh", "pod_layout"]
