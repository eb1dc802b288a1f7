"""One read-out of a run's communication: every number a user reads comes from here.

:func:`report` turns the ledger (:func:`~dadjax.comm.comm_stats`) and the
compiled program's collective ops (``TrainStep.collectives``) into a
:class:`Report`: payload bits, wire bits per site for the network's
topology and ``N``, wire-based ratios against an fp32 and a bf16 all-reduce
of the same tensors and against the all-reduce in the dtype the model
trains in, and the modeled communication time with latency charged per
*compiled* op. The CLI's ``metrics.jsonl`` rows (:meth:`Report.row`), the
demo's table and plot, the experiments and the notebooks all read it, so
they cannot disagree.

References:
  Agarwal et al., "On the Utility of Gradient Compression in Distributed
  Training Systems", MLSys 2022 (report wire-level, end-to-end figures
  against the strongest all-reduce baseline).
"""

from __future__ import annotations

import dataclasses

from typing import Any, NamedTuple

import jax
import numpy as np

from dadjax.comm._ledger import FP32_BITS, CommSummary, comm_stats, find_comm_stats


class Report(NamedTuple):
  """Per site and optimizer step (largest site), for one network setting.

  Attributes:
    setting: the topology and ``N`` the wire figures hold for, e.g. ``"ring, N=8"``.
    baseline: the all-reduce the model's own gradient dtype would run
      (``"fp32"``, ``"bf16"`` or ``"fp16"``).
    payload_bits_per_step: what a site hands to collectives (the ledger).
    wire_bits_per_step: what the topology moves for it per site.
    fp32_wire_bits_per_step / bf16_wire_bits_per_step: an fp32 / bf16
      all-reduce of the same tensors.
    baseline_wire_bits_per_step: the all-reduce in ``baseline``'s dtype.
    wire_ratio_fp32 / wire_ratio_bf16 / wire_ratio: baseline wire bits over
      the method's (> 1: the method sends less; < 1: it sends *more*).
    payload_ratio: fp32 payload bits over sent payload bits, cumulative (not
      a wire figure: it counts gathers and reductions alike).
    total_payload_bits / total_wire_bits: since the start.
    modeled_comm_s_per_step: modeled seconds of the step's communication;
      latency charged per compiled op when the ops were given
      (``latency_per == "compiled op"``), else per recorded call.
    fp32_comm_s_per_step / bf16_comm_s_per_step: the two baselines' time
      (one all-reduce op).
    modeled_comm_s: ``modeled_comm_s_per_step`` times the optimizer steps.
    intra_payload_bits_per_step / modeled_intra_comm_s_per_step: the
      in-site phase of a 2-D mesh (0 otherwise).
    latency_per: ``"compiled op"`` or ``"recorded call"``.
    peak_payload_bits_per_step / peak_comm_s_per_step: the busiest step
      (equal to the mean figures unless a method communicates on some steps
      only: local updates, whose synchronization step is where a slow link
      stalls; :meth:`~dadjax.comm.NetworkModel.peak_step_time`).
    dense_bits_per_step: payload bits of an fp32 all-reduce of the same
      tensors (what a site would hand to collectives without the method).
    step_bits_per_step: the payload bits of the train step's own ledger
      (``TrainState.comm``: a batch stage, averaged collections, the
      metrics' all-reduce), included in ``payload_bits_per_step``; 0 when
      ``state`` is not a train state.
  """

  setting: str
  baseline: str
  payload_bits_per_step: int
  wire_bits_per_step: float
  fp32_wire_bits_per_step: float
  bf16_wire_bits_per_step: float
  baseline_wire_bits_per_step: float
  wire_ratio_fp32: float
  wire_ratio_bf16: float
  wire_ratio: float
  payload_ratio: float
  total_payload_bits: int
  total_wire_bits: float
  modeled_comm_s_per_step: float
  fp32_comm_s_per_step: float
  bf16_comm_s_per_step: float
  modeled_comm_s: float
  intra_payload_bits_per_step: int
  modeled_intra_comm_s_per_step: float
  latency_per: str
  peak_payload_bits_per_step: int = 0
  peak_comm_s_per_step: float = 0.0
  dense_bits_per_step: int = 0
  step_bits_per_step: int = 0

  def row(self) -> dict:
    """The columns of a ``metrics.jsonl`` row (JSON-ready): every field, by its name."""
    return dict(self._asdict())


_DTYPE_NAMES = {np.dtype("float32"): "fp32", np.dtype("float16"): "fp16"}


def gradient_baseline(params: Any) -> str:
  """The all-reduce dtype of a model's own gradients: ``"bf16"``/``"fp16"`` when every
  floating parameter is stored so, else ``"fp32"``."""
  dtypes = {np.dtype(x.dtype) for x in jax.tree.leaves(params)
            if np.issubdtype(np.dtype(x.dtype), np.floating) or x.dtype == jax.numpy.bfloat16}
  if len(dtypes) != 1:
    return "fp32"
  (dtype,) = dtypes
  if dtype == jax.numpy.bfloat16:
    return "bf16"
  return _DTYPE_NAMES.get(dtype, "fp32")


def _ratio(base: float, sent: float) -> float:
  if sent == 0:
    return float("inf") if base else 1.0
  return base / sent


def _payload_ratio(summary: CommSummary) -> float:
  """fp32 all-reduce payload bits over sent payload bits, cumulative.

  The last step's figures when nothing is sent yet; a payload ratio, so it
  counts all-gather and all-reduce payloads alike (the wire ratios are
  :func:`report`'s other fields).
  """
  sent, dense = summary.total, summary.total_dense
  if sent == 0:
    sent, dense = summary.bits_per_step, summary.dense_bits_per_step
  return float("inf") if sent == 0 else dense / sent


def _ops_of(step, state, batch, link):
  if step is None or batch is None:
    return None
  return step.collectives(state, batch, link=link) if link else step.collectives(state, batch)


def compiled_intra(summary: CommSummary, intra_ops: Any) -> CommSummary:
  """``summary`` with its ``intra_*`` fields read from the compiled in-site ops.

  Inside a site the collectives are GSPMD's (XLA inserts them when it
  partitions the program), so no ledger books them: the compiled program
  is their record. All-reduces and reduce-scatters count as reduce traffic,
  every other kind (all-gathers, all-to-alls, permutes) as gather traffic;
  bits are operand bits per device.
  """
  if intra_ops is None:
    return summary
  nbytes, count = intra_ops.nbytes, intra_ops.count
  reduce_kinds = ("reduce", "reduce_scatter")
  return dataclasses.replace(
      summary,
      intra_reduce_bits=(8 * sum(nbytes.get(k, 0) for k in reduce_kinds),),
      intra_gather_bits=(8 * sum(v for k, v in nbytes.items() if k not in reduce_kinds),),
      intra_reduce_calls=sum(count.get(k, 0) for k in reduce_kinds),
      intra_gather_calls=sum(v for k, v in count.items() if k not in reduce_kinds))


def _step_bits(state: Any) -> int:
  """Payload bits per step of a train state's own ledger (``state.comm``); 0 for other states."""
  comm = getattr(state, "comm", None)
  if not hasattr(state, "opt_state") or not find_comm_stats(comm):
    return 0
  return comm_stats(comm).bits_per_step


def report(state: Any, network, *, ops: Any = None, intra_ops: Any = None, step: Any = None,
           batch: Any = None, baseline: str | None = None) -> Report:
  """The communication read-out of a train state (or of a :class:`CommSummary`).

  Args:
    state: a train state (every ledger in it is read), any state holding
      :class:`~dadjax.comm.CommStats`, or a :class:`CommSummary`.
    network: a :class:`~dadjax.comm.NetworkModel`, or a
      :class:`~dadjax.comm.HierarchicalNetwork` for a 2-D mesh.
    ops: the compiled program's collective ops (``TrainStep.collectives``;
      on a 2-D mesh its ``link="inter"`` ops); ``None`` with ``step`` and
      ``batch`` reads them from ``step``; ``None`` without them charges
      latency per recorded call (``latency_per`` says which).
    intra_ops: on a mesh whose sites are groups of devices, the in-site
      compiled ops (``link="intra"``): the ``intra_*`` figures
      (:func:`compiled_intra`).
    step: a ``TrainStep`` to read the compiled ops from (with ``batch``).
    batch: a global batch of the step's shapes.
    baseline: the dtype of the native all-reduce baseline; default: from
      ``state.params`` (:func:`gradient_baseline`), else ``"fp32"``.

  Returns:
    A :class:`Report`.
  """
  summary = state if isinstance(state, CommSummary) else comm_stats(state)
  hierarchical = hasattr(network, "inter")
  inter = network.inter if hierarchical else network
  if ops is None:
    ops = _ops_of(step, state, batch, "inter" if hierarchical else None)
  if hierarchical and intra_ops is None:
    intra_ops = _ops_of(step, state, batch, "intra")
  summary = compiled_intra(summary, intra_ops)
  if baseline is None:
    params = getattr(state, "params", None)
    baseline = gradient_baseline(params) if params is not None else "fp32"
  n, topo = inter.num_sites, inter.topology
  number_bits = FP32_BITS if baseline == "fp32" else 16
  wire = summary.wire_bits(n, topo)
  fp32, bf16 = summary.fp32_wire_bits(n, topo), summary.bf16_wire_bits(n, topo)
  native = fp32 if number_bits == FP32_BITS else bf16
  time_s = inter.step_time(summary, ops)
  intra_s = network.intra_time(summary, intra_ops) if hierarchical else 0.0
  per_site = network.per_site if hierarchical else 1
  setting = f"{topo}, N={n}" + (f" sites x {per_site} devices" if per_site > 1 else "")
  return Report(
      setting=setting,
      baseline=baseline,
      payload_bits_per_step=summary.bits_per_step,
      wire_bits_per_step=wire,
      fp32_wire_bits_per_step=fp32,
      bf16_wire_bits_per_step=bf16,
      baseline_wire_bits_per_step=native,
      wire_ratio_fp32=_ratio(fp32, wire),
      wire_ratio_bf16=_ratio(bf16, wire),
      wire_ratio=_ratio(native, wire),
      payload_ratio=_payload_ratio(summary),
      total_payload_bits=summary.total,
      total_wire_bits=summary.total_wire_bits(n, topo),
      modeled_comm_s_per_step=time_s + intra_s,
      fp32_comm_s_per_step=inter.baseline_time(summary, FP32_BITS),
      bf16_comm_s_per_step=inter.baseline_time(summary, 16),
      modeled_comm_s=(time_s + intra_s) * summary.updates,
      intra_payload_bits_per_step=summary.intra_bits_per_step,
      modeled_intra_comm_s_per_step=intra_s,
      latency_per="compiled op" if ops is not None else "recorded call",
      peak_payload_bits_per_step=summary.peak_bits_per_step,
      peak_comm_s_per_step=inter.peak_step_time(summary, ops) + intra_s,
      dense_bits_per_step=summary.dense_bits_per_step,
      step_bits_per_step=_step_bits(state),
  )


__all__ = ["Report", "compiled_intra", "gradient_baseline", "report"]
