"""Accordion as method specs: ``accordion(LOW, HIGH, ...)`` and ``accordion_batch(METHOD, ...)``."""

from __future__ import annotations

import functools
from typing import Any, Callable

import optax

from dadjax.adaptive._accordion import accordion
from dadjax.adaptive._batch import accordion_batch
from dadjax.registry import COMPRESSOR, METHOD, Arg, Method, register_method


def _detector_args(steps: str, statistic: str) -> tuple[Arg, ...]:
  """The detector's keyword arguments, shared by both Accordion specs."""
  return (
      Arg("window", int, within="[1, inf)", positional=False,
          doc=f"{steps} per detector window (none: the run's steps per epoch)"),
      Arg("interval", int, within="[1, inf)", positional=False, doc="windows between checks"),
      Arg("eta", float, within="(0, inf)", positional=False,
          doc=f"critical when the {statistic} changes by this fraction"),
  )


def _window(window: int | None, steps_per_epoch: int | None) -> int:
  """The detector window: as given, else the run's epoch, else 1."""
  if window is not None:
    return window
  return steps_per_epoch if steps_per_epoch is not None else 1


@register_method(
    "accordion",
    Arg("low", COMPRESSOR, doc="the low-compression setting, sent in critical regimes"),
    Arg("high", COMPRESSOR, doc="the high-compression setting, sent otherwise"),
    *_detector_args("steps", "window norm"),
    doc="Accordion: per tensor, LOW while the gradient norm changes fast (critical), else HIGH",
)
def _accordion(
    low,
    high,
    window: int | None = None,
    interval: int = 1,
    eta: float = 0.5,
    *,
    axis_name: str | None = "data",
    seed: int = 0,
    steps_per_epoch: int | None = None,
    lr_schedule: Callable[[Any], Any] | None = None,
) -> Method:
  """:func:`~dadjax.adaptive.accordion` with the run's epoch as window and its LR schedule.

  ``window`` defaults to ``steps_per_epoch`` (1 when the run does not say),
  and a learning-rate decrease of ``lr_schedule`` makes every tensor
  critical until the next check.
  """
  return Method("", tx=accordion(low, high, window=_window(window, steps_per_epoch),
                                 interval=interval, eta=eta,
                                 lr_schedule=lr_schedule, axis_name=axis_name, seed=seed))


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
    method: Method,
    small: int = 1,
    large: int = 8,
    window: int | None = None,
    interval: int = 1,
    eta: float = 0.5,
    *,
    axis_name: str | None = "data",
    seed: int = 0,
    steps_per_epoch: int | None = None,
    lr_schedule: Callable[[Any], Any] | None = None,
) -> Method:
  """:func:`~dadjax.adaptive.accordion_batch` around the whole optimizer.

  The method's transformation *and the local optimizer* run once per
  cycle of ``k`` micro-steps (``Method.wrap``), so neither momentum nor the
  collective act on steps that only accumulate. ``window`` defaults to the
  run's steps per epoch; a decrease of ``lr_schedule`` makes the regime
  critical until the next check.
  """
  del seed
  if method.dense is not None or method.batch_stage is not None:
    raise ValueError(f"it wraps optimizer-side methods (allreduce, compressors); "
                     f"{method.name or 'this method'} communicates in the backward pass or the "
                     "batch stage, which would still run every micro-step")
  wrap = functools.partial(accordion_batch, small=small, large=large,
                           window=_window(window, steps_per_epoch),
                           interval=interval, eta=eta, lr_schedule=lr_schedule,
                           axis_name=axis_name)
  wrap(optax.identity())  # check the hyperparameters now, not when the run builds its optimizer
  if method.wrap is not None:  # a method that wraps the chain itself (local updates) runs inside
    inner_wrap, outer_wrap = method.wrap, wrap
    wrap = lambda chain: outer_wrap(inner_wrap(chain))
  return Method("", tx=method.tx, wrap=wrap)
