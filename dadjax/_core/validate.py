"""Argument checks shared by the builders, the method registry's ``Arg`` and ``Config``.

Each check returns the value in its canonical Python type or raises a
``ValueError`` (or the ``error`` class passed in, e.g. ``ConfigError``) whose
message names the argument and the allowed range, before anything is traced.
Intervals are written as text, ``"(0, 1]"``, ``"[1, inf)"``: the same text a
registry ``Arg(within=...)`` declares and the help shows.
"""

from __future__ import annotations

import math
import numbers
import re
from typing import NamedTuple

__all__ = [
    "Interval", "parse_interval", "in_interval", "is_int", "is_real", "check_int", "check_ratio",
    "check_real", "check_choice"
]

_INTERVAL = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\Z")


class Interval(NamedTuple):
  """A real interval: ``low``, ``high`` and whether each end is closed."""

  low: float
  high: float
  low_closed: bool
  high_closed: bool

  def __contains__(self, value) -> bool:
    value = float(value)
    if math.isnan(value):
      return False
    above = value >= self.low if self.low_closed else value > self.low
    below = value <= self.high if self.high_closed else value < self.high
    return above and below

  def __str__(self) -> str:
    def end(v):
      return "inf" if v == math.inf else "-inf" if v == -math.inf else f"{v:g}"

    return (("[" if self.low_closed else "(") + f"{end(self.low)}, {end(self.high)}"
            + ("]" if self.high_closed else ")"))


def parse_interval(within: str | Interval) -> Interval:
  """``"(0, 1]"`` as an :class:`Interval` (a ``ValueError`` for malformed text)."""
  if isinstance(within, Interval):
    return within
  m = _INTERVAL.match(within.strip())
  if m is None:
    raise ValueError(f"within must look like '(0, 1]' or '[1, inf)', got {within!r}")
  return Interval(float(m.group(2)), float(m.group(3)), m.group(1) == "[", m.group(4) == "]")


def in_interval(value, within: str | Interval) -> bool:
  """Whether the real ``value`` lies in ``within`` (NaN lies nowhere)."""
  return value in parse_interval(within)


def is_int(value) -> bool:
  """An integer that is not a ``bool`` (Python and NumPy integers)."""
  return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
  """A real number that is not a ``bool``."""
  return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int = 1, *, error: type = ValueError) -> int:
  """``value`` as an int >= ``minimum``, else ``error("NAME must be an int >= MIN, got V")``."""
  if not is_int(value) or value < minimum:
    raise error(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def check_ratio(name: str, value, *, error: type = ValueError) -> float:
  """``value`` as a float in (0, 1], else ``error`` naming ``name``."""
  if not is_real(value) or not 0 < value <= 1:
    raise error(f"{name} must be a number in (0, 1], got {value!r}")
  return float(value)


def check_real(name: str, value, within: str | Interval = "(-inf, inf)", *,
               error: type = ValueError) -> float:
  """``value`` as a finite float in ``within``, else ``error`` naming ``name`` and the range."""
  interval = parse_interval(within)
  if not is_real(value) or not math.isfinite(value) or value not in interval:
    raise error(f"{name} must be finite and in {interval}, got {value!r}")
  return float(value)


def check_choice(name: str, value, choices, *, error: type = ValueError):
  """``value`` if it is one of ``choices``, else ``error`` listing them."""
  if value not in choices:
    raise error(f"{name} must be one of {list(choices)}, got {value!r}")
  return value
