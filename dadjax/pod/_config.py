"""A run config's own train step compiled for a TPU topology (``dadjax compile``).

:func:`compile_config` builds the step ``dadjax train`` would build from the
config (its model, method, optimizer, rules, compute dtype) on a mesh of the
topology's devices and compiles it on abstract inputs: nothing is allocated
and no data is read for a ``text:`` data set (its shapes are the config's).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from dadjax.parallel import abstract_batch, abstract_state
from dadjax.pod._report import CompileReport, compile_step
from dadjax.pod._topology import slice_count, topology_devices

SITE_AXIS = "data"


def pod_mesh(devices, sites: int, inner: dict, site_axis: str = SITE_AXIS) -> jax.sharding.Mesh:
  """``site_axis`` x ``inner`` over ``devices`` (slice-major): each site whole slices, or a
  share of one slice, so the in-site axes stay on ICI.

  Raises:
    ValueError: the sizes do not use exactly the devices, or sites split a slice unevenly.
  """
  devices = list(devices)
  per_site = math.prod(inner.values()) if inner else 1
  if sites * per_site != len(devices):
    raise ValueError(f"mesh {site_axis}={sites} x {inner} needs {sites * per_site} devices, the "
                     f"topology has {len(devices)}")
  slices = slice_count(devices)
  if sites % slices and slices % sites:
    raise ValueError(f"{sites} sites do not split {slices} slices evenly")
  grid = np.array(devices, dtype=object).reshape(sites, *inner.values())
  return jax.sharding.Mesh(grid, (site_axis, *inner))


def pod_layout(config, devices: int, slices: int, mesh: dict | None = None) -> tuple[int, dict]:
  """``(sites, in-site axes)`` of ``config`` fitted to ``devices`` chips in ``slices`` slices.

  Given ``mesh`` (``{"data": 2, "fsdp": 16}``) it is used as it is. Else the
  sites are the slices (one site per slice) when there are several, or the
  config's ``num_sites``; the config's in-site axes (``mesh_inner``, else
  ``fsdp=per_site``) keep their sizes except the first, ``fsdp`` if there is
  one, which takes up the remaining chips.
  """
  if mesh is not None:
    mesh = dict(mesh)
    if SITE_AXIS not in mesh:
      raise ValueError(f"mesh must name the site axis {SITE_AXIS!r}, got {mesh}")
    return mesh.pop(SITE_AXIS), mesh
  sites = slices if slices > 1 else config.num_sites
  inner = dict(config.mesh_inner) or {"fsdp": config.per_site}
  if devices % sites:
    raise ValueError(f"{devices} devices do not split over {sites} sites; pass --mesh")
  grow = "fsdp" if "fsdp" in inner else next(iter(inner))
  rest = math.prod(v for k, v in inner.items() if k != grow)
  per_site = devices // sites
  if per_site % rest:
    raise ValueError(f"{per_site} devices per site do not hold the config's in-site axes "
                     f"{inner}; pass --mesh")
  inner[grow] = per_site // rest
  return sites, inner


def _shape_dataset(config):
  """The config's data set, or for ``text:`` only its shapes (byte tokens, nothing read)."""
  from dadjax import data as data_lib  # pylint: disable=g-import-not-at-top
  if not config.dataset.startswith("text:"):
    kwargs = dict(config.dataset_kwargs)
    if config.data_dir:
      kwargs["data_dir"] = config.data_dir
    return data_lib.load(config.dataset, **kwargs)
  seq_len = int(config.dataset_kwargs.get("seq_len", 128))
  tokens = np.zeros((1, seq_len), np.int32)
  return data_lib.Dataset(tokens, tokens, tokens, tokens, num_classes=data_lib.BYTE_VOCAB,
                          name=config.dataset, vocab_size=data_lib.BYTE_VOCAB)


def compile_config(config, topology: str, slices: int = 1, *, mesh: dict | None = None,
                   label: str | None = None) -> CompileReport:
  """Compile ``config``'s train step for ``topology`` x ``slices`` (no TPU needed).

  The mesh is :func:`pod_layout`'s; the rows per device are the config's
  (``batch_per_site / per_site``, at least 1), so a larger pod runs a larger
  global batch. The step is ``dadjax train``'s (``shard_map`` backend).

  Args:
    config: a :class:`dadjax.config.Config`.
    topology: ``"v5e:4x4"``, ``"v5e:16x16"``, ``"v5p:4x4x4"``, or ``"cpu:N"``
      (:func:`~dadjax.pod.topology_devices`).
    slices: slices of the topology (joined by DCN).
    mesh: the mesh axes (``{"data": 4, "fsdp": 256}``) instead of :func:`pod_layout`'s.
    label: the report's heading (default: model, method, topology).

  Returns:
    The :class:`~dadjax.pod.CompileReport`.
  """
  from dadjax.run import build_step  # pylint: disable=g-import-not-at-top
  devices = topology_devices(topology, slices)
  sites, inner = pod_layout(config, len(devices), slices, mesh)
  per_site = math.prod(inner.values())
  rows = max(1, config.batch_per_site // max(1, config.per_site)) * per_site
  fitted = config.replace(num_sites=sites, mesh_inner=inner, per_site=per_site,
                          batch_per_site=rows, backend="shard_map")
  dataset = _shape_dataset(fitted)
  step = build_step(fitted, dataset, None, mesh=pod_mesh(devices, sites, inner))
  x, y = dataset.x_train, dataset.y_train
  sds = lambda a, n: jax.ShapeDtypeStruct((n, *np.shape(a)[1:]), jnp.asarray(a[:1]).dtype)
  state = abstract_state(step, jax.random.key(config.seed), sds(x, rows))
  batch = abstract_batch(step, {"x": sds(x, sites * rows), "y": sds(y, sites * rows)})
  name = label or f"{config.model} {config.method} on {topology} x {slices}"
  return compile_step(step, state, batch, label=name)
