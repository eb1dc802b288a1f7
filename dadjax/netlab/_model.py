"""What the cost model predicts for a lab run: textbook ring and calibrated (gloo) forms."""

from __future__ import annotations

from dadjax.comm import CollectiveOps, CommSummary, NetworkModel, TransportFit, hlo_collectives


def collective_operands(hlo_text: str) -> dict:
  """Operands per collective kind of a compiled program: the gloo calls XLA:CPU makes.

  A combined all-reduce of ``k`` tensors is one op in the HLO
  (:func:`~dadjax.comm.hlo_collectives` counts 1) but ``k`` calls of gloo,
  one after another, each paying the ring's latency. Every branch of every
  ``conditional`` is counted (:attr:`CollectiveOps.operands
  <dadjax.comm.CollectiveOps>`; for the branch a step takes see
  :func:`~dadjax.comm.taken_collectives`).

  Args:
    hlo_text: ``compiled.as_text()`` (optimized HLO).

  Returns:
    ``{"reduce": ..., "gather": ..., ...}`` over every collective kind.
  """
  return dict(hlo_collectives(hlo_text).operands)


def _ops_of(ledger: dict) -> CollectiveOps:
  """The compiled ops a lab ledger describes (``ops``, or the flat counts of every op)."""
  if "ops" in ledger:
    return CollectiveOps(**{k: dict(v) for k, v in ledger["ops"].items()})
  kinds = ("reduce", "gather")
  return CollectiveOps({k: ledger.get(f"{k}_ops", int(k == "reduce")) for k in kinds}, {}, {}, {},
                       {k: ledger.get(f"{k}_operands", int(k == "reduce")) for k in kinds}, {})


def _summary(ledger: dict) -> CommSummary:
  periodic = ledger.get("exchange_rate") is not None
  zero = (0,)
  return CommSummary(
      reduce_bits=(ledger.get("reduce_bits", 0),), gather_bits=(ledger.get("gather_bits", 0),),
      dense_bits=zero, total_bits=zero, total_dense_bits=zero, reduce_calls=0, gather_calls=0,
      updates=1,
      peak_reduce_bits=(ledger["peak_reduce_bits"],) if periodic else (),
      peak_gather_bits=(ledger["peak_gather_bits"],) if periodic else (),
      exchange_rate=ledger.get("exchange_rate"), peak_share=ledger.get("peak_share"))


def predicted_comm(ledger: dict, rate: float, delay: float, num_sites: int,
                   fit: TransportFit | None = None) -> dict:
  """Modeled communication seconds of one step from a lab run's ``ledger``.

  Goes through :meth:`NetworkModel.step_time <dadjax.comm.NetworkModel.step_time>`
  (what :func:`dadjax.comm.report` charges) for both models.

  Args:
    ledger: :attr:`~dadjax.netlab.LabRun.ledger`: ``reduce_bits`` /
      ``gather_bits`` per optimizer step (a local-update method's
      :class:`~dadjax.comm.PeriodicStats` mean), and the compiled ops:
      ``ops`` (:class:`~dadjax.comm.CollectiveOps` fields; the branches the
      step took when :func:`~dadjax.comm.match_branches` could tell them,
      with the ``taken`` branches named) and, for local updates,
      ``exchange_rate`` (``1 / H``: the conditional ops, the sync branch,
      are charged once per ``H`` steps), ``peak_share`` and the sync step's
      ``peak_reduce_bits`` / ``peak_gather_bits``; or, from older runs, the
      flat ``reduce_ops`` / ``reduce_operands`` / ... (every op, every step).
    rate: line rate, bits/s; ``delay``: one-way delay, seconds.
    num_sites: sites.
    fit: the calibrated model's constants (default: the package's gloo fit).

  Returns:
    ``{"textbook": s, "calibrated": s}``: the textbook ring charged per
    compiled op with latency = ``delay``, and :meth:`NetworkModel.calibrated`
    charged per operand (gloo call); mean seconds per optimizer step. With
    a local-update ledger also ``"textbook_peak"`` / ``"calibrated_peak"``:
    the sync step (:meth:`~dadjax.comm.NetworkModel.peak_step_time`).
  """
  models = {"textbook": NetworkModel(rate, delay, num_sites),
            "calibrated": NetworkModel.calibrated(rate, delay, num_sites, fit)}
  summary, ops = _summary(ledger), _ops_of(ledger)
  out = {name: model.step_time(summary, ops) for name, model in models.items()}
  if summary.exchange_rate is not None:
    out.update({f"{name}_peak": model.peak_step_time(summary, ops)
                for name, model in models.items()})
  return out
