"""What the compiler says about one compiled program: memory, collectives per mesh axis, FLOPs.

:func:`compile_report` compiles a lowered program (``jax.jit(f).lower(...)``
on ``ShapeDtypeStruct`` with shardings over a mesh, e.g. a TPU topology's)
and reads, per device: the compiler's ``memory_analysis()`` (arguments,
outputs, temporaries, code) against the chip's HBM; every collective of the
optimized HLO with the mesh axes it spans and its link, ICI inside a slice
or DCN between slices (the TPU compiler's cross-slice transfers are
``send`` s to its multi-slice runtime, read by their transfer type); the
``cost_analysis()`` FLOPs; and the compile time.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from typing import Any

import numpy as np

from dadjax.comm import collective_ops, type_bytes
from dadjax.pod._topology import hbm_bytes, slice_count

_OP_NAMES = {"reduce": "all-reduce", "gather": "all-gather", "reduce_scatter": "reduce-scatter",
             "all_to_all": "all-to-all", "permute": "collective-permute"}
_DCN_KINDS = {"ALL_REDUCE": "reduce", "ALL_GATHER": "gather", "REDUCE_SCATTER": "reduce_scatter",
              "ALL_TO_ALL": "all_to_all", "ONE_TO_ONE": "permute"}
_ARRAY = re.compile(r"\b[a-z]+\d*[a-z\d]*\[[\d,]*\]")
_DCN_TYPE = re.compile(r"_xla_megascale_transfer_type=\"(\w+)\"")


@dataclasses.dataclass(frozen=True)
class Collective:
  """The collectives of one kind over one set of mesh axes, per device and step.

  Attributes:
    link: ``"ICI"`` (inside a slice) or ``"DCN"`` (between slices); on a
      mesh of host devices the platform (``"CPU"``).
    axes: the mesh axes the ops span, joined by ``"+"``.
    kind: ``"all-reduce"``, ``"all-gather"``, ``"reduce-scatter"``,
      ``"all-to-all"`` or ``"collective-permute"``.
    count: ops in the program text (a loop body's once, both branches of a ``cond``).
    nbytes: operand bytes per device.
  """

  link: str
  axes: str
  kind: str
  count: int
  nbytes: int


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """One program compiled for a mesh: the compiler's figures per device (see the module)."""

  label: str
  platform: str
  device_kind: str
  devices: int
  slices: int
  mesh: dict
  compile_s: float
  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int
  code_bytes: int
  hbm_bytes: float | None
  flops: float | None
  collectives: tuple[Collective, ...]

  @property
  def total_bytes(self) -> int:
    """Peak device memory the compiler plans: arguments + outputs - aliased + temporaries + code."""
    return (self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes
            + self.code_bytes)

  @property
  def fits(self) -> bool | None:
    return None if self.hbm_bytes is None else self.total_bytes <= self.hbm_bytes

  def link_bytes(self, link: str) -> int:
    """Collective operand bytes per device and step over ``link`` (``"ICI"`` / ``"DCN"``)."""
    return sum(c.nbytes for c in self.collectives if c.link == link)

  def as_dict(self) -> dict:
    out = dataclasses.asdict(self)
    out.update(total_bytes=self.total_bytes, fits=self.fits, dcn_bytes=self.link_bytes("DCN"),
               ici_bytes=self.link_bytes("ICI"))
    return out

  def to_json(self) -> str:
    return json.dumps(self.as_dict(), indent=1)

  def table(self) -> str:
    """The printable report."""
    mib = lambda b: f"{b / 2 ** 20:10.1f} MiB"
    by = "the TPU compiler" if self.platform == "tpu" else f"XLA:{self.platform.upper()}"
    mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
    lines = [f"{self.label}: compiled by {by} for {self.devices} {self.device_kind} devices "
             f"in {self.slices} slice(s), mesh {mesh}, in {self.compile_s:.1f} s",
             "memory per device (the compiler's memory_analysis):",
             f"  arguments   {mib(self.argument_bytes)}",
             f"  outputs     {mib(self.output_bytes)}  (aliased with arguments: "
             f"{self.alias_bytes / 2 ** 20:.1f} MiB)",
             f"  temporaries {mib(self.temp_bytes)}",
             f"  code        {mib(self.code_bytes)}",
             f"  total       {mib(self.total_bytes)}"]
    if self.hbm_bytes is not None:
      share = 100 * self.total_bytes / self.hbm_bytes
      lines[-1] += (f"  = {share:.1f}% of {self.hbm_bytes / 2 ** 30:g} GiB HBM: "
                    f"{'fits' if self.fits else 'does NOT fit'}")
    lines.append("collectives per device and step (the optimized program's):")
    lines.append(f"  {'link':4s} {'axes':14s} {'op':19s} {'count':>5s} {'operand MiB':>12s}")
    for c in self.collectives:
      lines.append(f"  {c.link:4s} {c.axes:14s} {c.kind:19s} {c.count:5d} "
                   f"{c.nbytes / 2 ** 20:12.3f}")
    if not self.collectives:
      lines.append("  none")
    links = sorted({c.link for c in self.collectives})
    lines.append("  in all: " + (", ".join(f"{k} {self.link_bytes(k) / 2 ** 20:.3f} MiB"
                                          for k in links) or "none"))
    if self.flops is not None:
      lines.append(f"FLOPs per device and step (cost_analysis): {self.flops:.3g}")
    return "\n".join(lines)


def _axes(groups: tuple, slice_shape: tuple, names: tuple) -> str:
  """The mesh axes along which the devices of replica groups (ids within a slice) differ."""
  size = math.prod(slice_shape)
  groups = groups or (tuple(range(size)),)
  if any(max(g) >= size for g in groups if g):
    return "?"
  coords = [np.array(np.unravel_index(np.asarray(g), slice_shape)) for g in groups if g]
  spanned = [n for d, n in enumerate(names) if any(len(set(c[d])) > 1 for c in coords)]
  return "+".join(spanned) or "none"


def _dcn_ops(text: str) -> list[tuple[str, int]]:
  """``(kind, bytes)`` of each cross-slice transfer (a multi-slice runtime ``send``)."""
  out = []
  for line in text.splitlines():
    kind = _DCN_TYPE.search(line)
    head, sep, _ = line.partition(" send(")
    if kind and sep:
      operand = _ARRAY.search(head.partition("=")[2])  # the first element of the send's tuple
      out.append((_DCN_KINDS.get(kind.group(1), kind.group(1).lower()),
                  type_bytes(operand.group(0)) if operand else 0))
  return out


def _flops(compiled) -> float | None:
  try:
    cost = compiled.cost_analysis()
  except Exception:  # pylint: disable=broad-except  (not every backend implements it)
    return None
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  value = (cost or {}).get("flops")
  return None if value is None else float(value)


def collectives_of(text: str, mesh, site_axis: str) -> tuple[Collective, ...]:
  """The collectives of an optimized HLO module compiled for ``mesh``, per link, axes and kind.

  On several slices the program's replica groups number the devices of one
  slice; the site axis must run over whole slices (outermost), as
  :func:`dadjax.pod.pod_mesh` lays it out.
  """
  names = tuple(mesh.axis_names)
  shape = tuple(mesh.devices.shape)
  slices = slice_count(mesh.devices.flat)
  if slices > 1:
    site = names.index(site_axis)
    shape = tuple(s // slices if d == site else s for d, s in enumerate(shape))
  rows: dict = {}
  platform = mesh.devices.flat[0].platform
  inside = "ICI" if platform == "tpu" else platform.upper()  # no ICI between host devices
  for op in collective_ops(text):
    key = (inside, _axes(op.groups, shape, names), _OP_NAMES[op.kind])
    count, nbytes = rows.get(key, (0, 0))
    rows[key] = (count + 1, nbytes + op.nbytes)
  for kind, nbytes in _dcn_ops(text):
    key = ("DCN", site_axis, _OP_NAMES.get(kind, kind))
    count, total = rows.get(key, (0, 0))
    rows[key] = (count + 1, total + nbytes)
  return tuple(Collective(*k, *v) for k, v in sorted(rows.items()))


def compile_report(lowered, mesh, *, site_axis: str = "data", label: str = "step") -> CompileReport:
  """Compile ``lowered`` (a ``jax.stages.Lowered`` for ``mesh``'s devices) and report on it.

  Args:
    lowered: ``jax.jit(f).lower(*args)``, the arguments ``ShapeDtypeStruct``
      with ``NamedSharding`` over ``mesh`` (:func:`dadjax.parallel.abstract_state`).
    mesh: the ``jax.sharding.Mesh`` it was lowered for.
    site_axis: the mesh axis of the sites (the DCN collectives' axis).
    label: the name printed at the head of the report.

  Returns:
    A :class:`CompileReport`.
  """
  start = time.perf_counter()
  compiled = lowered.compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  device = mesh.devices.flat[0]
  get = lambda name: int(getattr(mem, name, 0) or 0) if mem is not None else 0
  return CompileReport(
      label=label, platform=device.platform, device_kind=str(device.device_kind),
      devices=int(mesh.devices.size), slices=slice_count(mesh.devices.flat),
      mesh=dict(mesh.shape), compile_s=seconds,
      argument_bytes=get("argument_size_in_bytes"), output_bytes=get("output_size_in_bytes"),
      alias_bytes=get("alias_size_in_bytes"), temp_bytes=get("temp_size_in_bytes"),
      code_bytes=get("generated_code_size_in_bytes"), hbm_bytes=hbm_bytes(device),
      flops=_flops(compiled), collectives=collectives_of(compiled.as_text(), mesh, site_axis))


def compile_step(step, state: Any, batch: Any, *, label: str = "step") -> CompileReport:
  """:func:`compile_report` of a :class:`~dadjax.parallel.TrainStep` (``shard_map`` backend) on
  its abstract state and batch (:func:`~dadjax.parallel.abstract_state`,
  :func:`~dadjax.parallel.abstract_batch`)."""
  if step.backend != "shard_map":
    raise ValueError(f"compile_step needs backend='shard_map' (a mesh), got {step.backend!r}")
  return compile_report(step.lower(state, batch), step.mesh, site_axis=step.axis_name,
                        label=label)
