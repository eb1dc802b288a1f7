"""Communication methods by name: one spec string -> what the step needs.

A method is the communicating optax transformation (placed first in the
optimizer chain) plus, for methods that communicate inside the backward
pass (dAD), the dense-layer factory the model must be built with. Switching
method in an experiment is a config change: ``method="topk:0.01"``.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import optax

from dadjax import compress, dad
from dadjax.comm import allreduce


class Method(NamedTuple):
  """``tx``: communicating transformation; ``dense``: model dense factory or None."""

  name: str
  tx: optax.GradientTransformation
  dense: Callable[..., Any] | None = None


def build_method(spec: str, axis_name: str | None = "data", seed: int = 0) -> Method:
  """Build a method from its spec.

  Args:
    spec: ``"allreduce"`` (fp32 psum); a compressor spec understood by
      ``dadjax.compress.get_compressor`` (``"topk:0.01"``, ``"powersgd:4"``,
      ``"qsgd:16"``, ``"sign"``, ...); or a dAD spec understood by
      ``dadjax.dad.get_method`` (``"dad"``, ``"rank_dad:2"``, ``"auto_dad"``).
    axis_name: mesh axis of the sites (``None``: one site).
    seed: seeds the method's shared randomness.

  Returns:
    A :class:`Method`.
  """
  if spec in ("allreduce", "fp32"):
    return Method(spec, allreduce(axis_name))
  if dad.is_method(spec):
    tx, dense = dad.get_method(spec, axis_name=axis_name, seed=seed)
    return Method(spec, tx, dense)
  try:
    compressor = compress.get_compressor(spec)
  except ValueError as e:
    raise ValueError(f"unknown method {spec!r}: not 'allreduce', not a dAD spec "
                     f"({', '.join(dad.VALID_SPECS)}), and {e}") from e
  return Method(spec, compress.compressed(compressor, axis_name=axis_name, seed=seed))
