"""Accordion as method specs: ``accordion(LOW, HIGH, ...)`` and ``accordion_batch(METHOD, ...)``."""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp

from dadjax.adaptive._accordion import accordion
from dadjax.adaptive._batch import accordion_batch
from dadjax.comm import comm_stats
from dadjax.compress import compressed
from dadjax.registry import (COMPRESSOR, METHOD, Arg, ArgumentError, BuildContext, Method,
                             register_method)


def _detector_args(steps: str, statistic: str) -> tuple[Arg, ...]:
  """The detector's keyword arguments, shared by both Accordion specs."""
  return (
      Arg("window", int, within="[1, inf)", positional=False,
          doc=f"{steps} per detector window (none: the run's steps per epoch)"),
      Arg("interval", int, within="[1, inf)", positional=False, doc="windows between checks"),
      Arg("eta", float, within="(0, inf)", positional=False,
          doc=f"critical when the {statistic} changes by this fraction"),
  )


# The probe the two settings of accordion(low, high) are compared on: a matrix (low-rank
# compressors need two dimensions) and a vector, about the size of a small layer.
_PROBE_SHAPES = {"kernel": (256, 128), "bias": (128,)}


def payload_bits(compressor: Any, shapes: dict | None = None) -> int:
  """The ledger's payload bits of one step of ``compressor`` on a probe tree (one site).

  Args:
    compressor: a :class:`~dadjax.compress.Compressor`.
    shapes: ``{name: shape}`` of the probe's float32 leaves (default: a
      256 x 128 matrix and a 128 vector).
  """
  shapes = _PROBE_SHAPES if shapes is None else shapes
  probe = {k: jnp.cos(jnp.arange(math.prod(s), dtype=jnp.float32)).reshape(s)
           for k, s in shapes.items()}
  tx = compressed(compressor, axis_name=None)
  # jitted: op-by-op dispatch of a quantizer's many small ops costs seconds per build
  _, state = jax.jit(tx.update)(probe, tx.init(probe), probe)
  return comm_stats(state).bits_per_step


@register_method(
    "accordion",
    Arg("low", COMPRESSOR, doc="the low-compression setting, sent in critical regimes"),
    Arg("high", COMPRESSOR, doc="the high-compression setting, sent otherwise"),
    *_detector_args("steps", "window norm"),
    doc="Accordion: per tensor, LOW while the gradient norm changes fast (critical), else HIGH",
)
def _accordion(
    ctx: BuildContext,
    low,
    high,
    window: int | None = None,
    interval: int = 1,
    eta: float = 0.5,
) -> Method:
  """:func:`~dadjax.adaptive.accordion` with the run's epoch as window and its LR schedule.

  ``window`` defaults to the context's ``steps_per_epoch`` (one of the two
  must be known), and a learning-rate decrease of ``ctx.lr_schedule`` makes
  every tensor critical until the next check. ``low`` must send at least
  as many bits as ``high`` (compared on a probe tree by the ledger).
  """
  window = ctx.epoch_window(window)
  low_bits, high_bits = payload_bits(low), payload_bits(high)
  if low_bits < high_bits:
    raise ArgumentError(
        f"low ({low.name or 'low'}, {low_bits} bits on a {_probe_text()} probe) compresses more "
        f"than high ({high.name or 'high'}, {high_bits} bits): low is the setting sent in "
        "critical regimes and must send at least as many bits; swap the two")
  return Method(tx=accordion(low, high, window=window, interval=interval, eta=eta,
                             lr_schedule=ctx.lr_schedule, axis_name=ctx.axis_name,
                             seed=ctx.seed))


def _probe_text() -> str:
  return " + ".join("x".join(map(str, s)) for s in _PROBE_SHAPES.values())


@register_method(
    "accordion_batch",
    Arg("method", METHOD, doc="the optimizer-side method run once per update (allreduce, a "
        "compressor spec)"),
    Arg("small", int, within="[1, inf)", doc="micro-batches per update in critical regimes"),
    Arg("large", int, within="[1, inf)", doc="micro-batches per update otherwise (>= small)"),
    *_detector_args("micro-steps", "whole-model norm"),
    doc="Accordion's batch-size mode: SMALL micro-batches per update while critical, else LARGE",
)
def _accordion_batch(
    ctx: BuildContext,
    method: Method,
    small: int = 1,
    large: int = 8,
    window: int | None = None,
    interval: int = 1,
    eta: float = 0.5,
) -> Method:
  """:func:`~dadjax.adaptive.accordion_batch` around the whole optimizer.

  The method's transformation *and the local optimizer* run once per
  cycle of ``k`` micro-steps (``Method.wrap``), so neither momentum nor the
  collective act on steps that only accumulate. ``window`` defaults to the
  context's steps per epoch (one of the two must be known); a decrease of
  ``ctx.lr_schedule`` makes the regime critical until the next check.
  """
  if method.dense is not None or method.batch_stage is not None:
    raise ArgumentError(f"it wraps optimizer-side methods (allreduce, compressors); "
                        f"{method.name or 'this method'} communicates in the backward pass or "
                        "the batch stage, which would still run every micro-step")
  if large < small:
    raise ArgumentError(f"large must be an int >= small={small}, got {large}")
  wrap = functools.partial(accordion_batch, small=small, large=large,
                           window=ctx.epoch_window(window), interval=interval, eta=eta,
                           lr_schedule=ctx.lr_schedule, axis_name=ctx.axis_name)
  if method.wrap is not None:  # a method that wraps the chain itself (local updates) runs inside
    inner_wrap, outer_wrap = method.wrap, wrap
    wrap = lambda chain: outer_wrap(inner_wrap(chain))
  return Method(tx=method.tx, wrap=wrap)
