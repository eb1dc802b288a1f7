"""Typed arguments of catalog entries: :class:`Arg`, its declaration checks and conversion.

An argument is ``int``, ``float``, ``bool`` (a flag), ``str`` (optionally
with ``choices``), or a nested spec: :data:`COMPRESSOR` / :data:`METHOD`.
Numbers may carry an allowed interval (``within="(0, 1]"``). Conversion
turns one atom of spec text into the typed value, or says what was expected.
"""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, NamedTuple

COMPRESSOR = "compressor"  # an argument that is a nested compressor spec
METHOD = "method"  # an argument that is a nested method spec (built with the same context)

TYPES = (int, float, bool, str, COMPRESSOR, METHOD)
FROM_SIGNATURE = object()
REQUIRED = inspect.Parameter.empty
_INTERVAL = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\Z")
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class Arg(NamedTuple):
  """One typed argument of a registered method.

  Attributes:
    name: the builder's keyword (also the key in ``name=value``).
    type: ``int``, ``float``, ``bool`` (a flag), ``str``, :data:`COMPRESSOR`
      or :data:`METHOD`.
    default: the default; by default read from the builder's signature
      (a parameter without a default makes the argument required).
    within: allowed interval of an ``int`` / ``float``, e.g. ``"(0, 1]"``,
      ``"[1, inf)"``.
    choices: allowed values of a ``str`` (matched without regard to case).
    doc: one line.
    positional: whether it may be given without its key (flags never take
      a position: they are set by their bare name).
  """

  name: str
  type: Any
  default: Any = FROM_SIGNATURE
  within: str | None = None
  choices: tuple | None = None
  doc: str = ""
  positional: bool = True

  @property
  def required(self) -> bool:
    return self.default is REQUIRED

  @property
  def is_flag(self) -> bool:
    return self.type is bool

  @property
  def is_spec(self) -> bool:
    """Whether the argument is a nested spec (:data:`COMPRESSOR` or :data:`METHOD`)."""
    return self.type in (COMPRESSOR, METHOD)

  @property
  def type_name(self) -> str:
    return self.type if isinstance(self.type, str) else self.type.__name__

  def describe(self) -> str:
    """``name: float in (0, 1], default 0.01 -- doc``."""
    text = f"{self.name}: {self.type_name}"
    if self.within:
      text += f" in {self.within}"
    if self.choices:
      text += f" in {{{', '.join(self.choices)}}}"
    if self.default is None:
      text += " or none"
    text += ", required" if self.required else f", default {_show(self.default)}"
    return text + (f" -- {self.doc}" if self.doc else "")


def _show(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "none"
  return str(value)


def parse_interval(within: str) -> tuple[float, float, bool, bool]:
  """``"(0, 1]"`` -> ``(0.0, 1.0, False, True)``: low, high, low closed, high closed."""
  m = _INTERVAL.match(within.strip())
  if m is None:
    raise ValueError(f"within must look like '(0, 1]' or '[1, inf)', got {within!r}")
  lo, hi = float(m.group(2)), float(m.group(3))
  return lo, hi, m.group(1) == "[", m.group(4) == "]"


def in_interval(value: float, within: str) -> bool:
  lo, hi, lo_closed, hi_closed = parse_interval(within)
  if math.isnan(value):
    return False
  above = value >= lo if lo_closed else value > lo
  below = value <= hi if hi_closed else value < hi
  return above and below


def declare(entry_name: str, arg: Arg, params: dict, takes_kwargs: bool) -> Arg:
  """Check one declared argument against the builder's parameters; fill its default.

  Raises:
    ValueError: for an argument the builder does not take, an unknown
      type, or ``within`` / ``choices`` on the wrong type.
  """
  if arg.name not in params and not takes_kwargs:
    raise ValueError(f"{entry_name}: the builder has no parameter {arg.name!r}")
  if arg.type not in TYPES:
    raise ValueError(f"{entry_name}: {arg.name}: type must be one of int, float, bool, str, "
                     f"COMPRESSOR, METHOD, got {arg.type!r}")
  if arg.within is not None:
    if arg.type not in (int, float):
      raise ValueError(f"{entry_name}: {arg.name}: within applies to int and float arguments")
    parse_interval(arg.within)
  if arg.choices is not None and arg.type is not str:
    raise ValueError(f"{entry_name}: {arg.name}: choices apply to str arguments")
  if arg.default is FROM_SIGNATURE:
    p = params.get(arg.name)
    arg = arg._replace(default=p.default if p is not None else REQUIRED)
  return arg


class Expected(Exception):
  """An atom that is not a value of the argument; ``str(e)`` says what was expected."""


def is_none(arg: Arg, text: str) -> bool:
  """Whether ``text`` is ``none`` for an argument whose default is ``None``."""
  return arg.default is None and text.lower() == "none"


def convert(arg: Arg, text: str) -> Any:
  """One atom as a value of a non-spec argument.

  Raises:
    Expected: naming what the argument takes.
  """
  if is_none(arg, text):
    return None
  if arg.type is bool:
    if text.lower() in _TRUE:
      return True
    if text.lower() in _FALSE:
      return False
    raise Expected("true or false")
  range_ = f" in {arg.within}" if arg.within else ""
  if arg.type is int:
    try:
      out = int(text)
    except ValueError:
      raise Expected(f"an int{range_}") from None
  elif arg.type is float:
    try:
      out = float(text)
    except ValueError:
      raise Expected(f"a float{range_}") from None
  elif arg.type is str:
    out = text
    if arg.choices:
      match = [c for c in arg.choices if c.lower() == text.lower()]
      if not match:
        raise Expected(f"one of {', '.join(arg.choices)}")
      out = match[0]
  else:
    raise TypeError(f"unsupported argument type {arg.type!r}")
  if arg.within and not in_interval(out, arg.within):
    raise Expected(f"{'an' if arg.type is int else 'a'} {arg.type_name}{range_}")
  return out
