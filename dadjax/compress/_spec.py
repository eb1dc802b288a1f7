"""Compressors from short spec strings ("topk:0.01", "ef_scaled_sign", ...)."""

from __future__ import annotations

from dadjax.compress._base import Compressor
from dadjax.compress._cast import cast, identity
from dadjax.compress._error_feedback import error_feedback
from dadjax.compress._powersgd import powersgd
from dadjax.compress._quantize import qsgd, scaled_sign, sign, terngrad
from dadjax.compress._sparse import randomk, topk

# name -> (factory, type of the optional argument or None)
_FACTORIES = {
    "identity": (identity, None),
    "fp32": (identity, None),
    "bf16": (lambda: cast("bf16"), None),
    "fp16": (lambda: cast("fp16"), None),
    "topk": (topk, float),
    "randomk": (randomk, float),
    "qsgd": (qsgd, int),
    "terngrad": (terngrad, None),
    "sign": (sign, None),
    "scaled_sign": (scaled_sign, None),
    "powersgd": (powersgd, int),
}

VALID_SPECS = (
    "identity", "fp32", "bf16", "fp16", "topk:RATIO", "randomk:RATIO", "qsgd:LEVELS",
    "terngrad", "sign", "scaled_sign", "powersgd:RANK",
    "ef_<any of these> (error feedback, e.g. ef_topk:0.01, ef_scaled_sign)",
)


def _unknown(spec: str, why: str) -> ValueError:
  return ValueError(f"unknown compressor spec {spec!r} ({why}); valid forms: "
                    + ", ".join(VALID_SPECS)
                    + " (RATIO in (0, 1], LEVELS and RANK ints >= 1; the ':ARG' "
                    "part is optional and defaults to the factory's default)")


def get_compressor(spec: str) -> Compressor:
  """Build a compressor from a spec string.

  Args:
    spec: ``"identity"`` / ``"fp32"``, ``"bf16"``, ``"fp16"``,
      ``"topk:0.01"``, ``"randomk:0.1"``, ``"qsgd:16"``, ``"terngrad"``,
      ``"sign"``, ``"scaled_sign"``, ``"powersgd:4"``; a ``"ef_"`` prefix wraps
      any of them in :func:`error_feedback` (``"ef_topk:0.01"``,
      ``"ef_scaled_sign"``).

  Returns:
    A :class:`Compressor`.

  Raises:
    ValueError: for an unknown name or a malformed / out-of-range argument,
      listing the valid forms.

  References:
    See the individual factories.
  """
  if not isinstance(spec, str):
    raise _unknown(repr(spec), "not a string")
  text = spec.strip().lower()
  if text.startswith("ef_"):
    return error_feedback(get_compressor(text[3:]))
  name, sep, arg = text.partition(":")
  if name not in _FACTORIES:
    raise _unknown(spec, f"no compressor named {name!r}")
  factory, arg_type = _FACTORIES[name]
  if not sep:
    return factory()
  if arg_type is None:
    raise _unknown(spec, f"{name!r} takes no argument")
  try:
    value = arg_type(arg)
  except ValueError:
    raise _unknown(spec, f"{arg!r} is not a valid {arg_type.__name__}") from None
  return factory(value)
