"""Cost to a target: the first logged row whose metric reaches a value, and what it cost.

Every "steps / bits / time to target" figure (the demo's table, the
experiments' tables) is read here from the run's own rows, so that they all
mean the same thing: the first evaluated row at the target (not an
interpolation between evaluations), with that row's *cumulative* wire bits
and modeled seconds (:func:`dadjax.comm.report`'s ``total_wire_bits`` and
``modeled_comm_s``), not steps times a per-step figure.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple

# Parts of metric names ("test_accuracy", "test_bits_per_byte") that say which way is better;
# a lower-is-better part wins ("accuracy_error" is an error).
_HIGHER = ("accuracy", "acc", "f1", "auc")
_LOWER = ("loss", "bits_per_byte", "perplexity", "error", "bpb")


class Reached(NamedTuple):
  """Where a metric first reached its target.

  Attributes:
    index: position of the row in the rows given.
    step: the row's ``step`` (``index + 1`` when the rows carry none).
    value: the metric's value in that row.
    bits: the row's cumulative bits column (``None`` when the row has none).
    seconds: the row's cumulative modeled seconds (``None`` when it has none).
  """

  index: int
  step: int
  value: float
  bits: float | None
  seconds: float | None


def higher_is_better(metric: str) -> bool:
  """Whether larger values of ``metric`` are better: accuracy up; loss, bits per byte down.

  Raises:
    ValueError: the name says neither (pass ``higher=`` to :func:`to_target`).
  """
  name = metric.lower()
  if any(part in name for part in _LOWER):
    return False
  if any(part in name for part in _HIGHER):
    return True
  raise ValueError(f"to_target: cannot tell whether {metric!r} is better high or low; pass "
                   "higher=True (accuracy-like) or higher=False (loss-like)")


def to_target(rows: Iterable[Mapping[str, Any]], metric: str, target: float, *,
              higher: bool | None = None, bits: str = "total_wire_bits",
              seconds: str = "modeled_comm_s", step: str = "step") -> Reached | None:
  """The first row whose ``metric`` reaches ``target``, with its cumulative bits and time.

  Args:
    rows: metrics rows in logging order (``Run.history``, the lines of a
      ``metrics.jsonl``, or any dicts); a row without ``metric`` (or with a
      NaN there) is skipped.
    metric: the row key to compare (``"test_accuracy"``, ``"test_loss"``,
      ``"test_bits_per_byte"``, ...).
    target: the value to reach: at or above it when higher is better, at
      or below it otherwise.
    higher: whether larger is better; default: from the metric's name
      (:func:`higher_is_better`: accuracy up, loss and bits per byte down).
    bits: the cumulative bits column (default the report's
      ``total_wire_bits``; ``"total_payload_bits"`` for payload bits).
    seconds: the cumulative modeled time column (default ``modeled_comm_s``).
    step: the step column.

  Returns:
    A :class:`Reached`, or ``None`` if no row reaches the target.
  """
  up = higher_is_better(metric) if higher is None else higher
  for index, row in enumerate(rows):
    value = row.get(metric)
    if value is None or (isinstance(value, float) and math.isnan(value)):
      continue
    if value >= target if up else value <= target:
      return Reached(index, int(row.get(step, index + 1)), float(value),
                     _number(row.get(bits)), _number(row.get(seconds)))
  return None


def _number(value) -> float | None:
  return None if value is None else float(value)
