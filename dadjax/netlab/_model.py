"""What the cost model predicts for a lab run: textbook ring and calibrated (gloo) forms."""

from __future__ import annotations

from dadjax.comm._cost import NetworkModel, TransportFit
from dadjax.comm._hlo import OPCODES, _COMMENT, _split_instruction, _split_operands


def collective_operands(hlo_text: str) -> dict:
  """Operands per collective kind of a compiled program: the gloo calls XLA:CPU makes.

  A combined all-reduce of ``k`` tensors is one op in the HLO
  (:func:`~dadjax.comm.hlo_collectives` counts 1) but ``k`` calls of gloo,
  one after another, each paying the ring's latency.

  Args:
    hlo_text: ``compiled.as_text()`` (optimized HLO).

  Returns:
    ``{"reduce": ..., "gather": ..., ...}`` over every collective kind.
  """
  out: dict = {}
  for line in hlo_text.splitlines():
    parts = _split_instruction(_COMMENT.sub("", line))
    if parts is None or parts[2] not in OPCODES:
      continue
    kind = OPCODES[parts[2]]
    out[kind] = out.get(kind, 0) + len(_split_operands(parts[3]))
  return out


def predicted_comm(ledger: dict, rate: float, delay: float, num_sites: int,
                   fit: TransportFit | None = None) -> dict:
  """Modeled communication seconds of one step from a lab run's ``ledger``.

  Args:
    ledger: :attr:`~dadjax.netlab.LabRun.ledger` (payload bits, ops, operands).
    rate: line rate, bits/s; ``delay``: one-way delay, seconds.
    num_sites: sites.
    fit: the calibrated model's constants (default: the package's gloo fit).

  Returns:
    ``{"textbook": s, "calibrated": s}``: the textbook ring charged per
    compiled op with latency = ``delay``, and :meth:`NetworkModel.calibrated`
    charged per operand.
  """
  textbook = NetworkModel(rate, delay, num_sites)
  calibrated = NetworkModel.calibrated(rate, delay, num_sites, fit)
  rb, gb = ledger.get("reduce_bits", 0), ledger.get("gather_bits", 0)
  return {
      "textbook": textbook.allreduce_time(rb, ledger.get("reduce_ops", 1))
      + textbook.allgather_time(gb, ledger.get("gather_ops", 0)),
      "calibrated": calibrated.allreduce_time(rb, ledger.get("reduce_operands", 1))
      + calibrated.allgather_time(gb, ledger.get("gather_operands", 0)),
  }
