"""Accordion as a method spec: ``accordion(LOW, HIGH, window=.., interval=.., eta=..)``."""

from __future__ import annotations

from typing import Any, Callable

from dadjax.adaptive._accordion import accordion
from dadjax.registry import COMPRESSOR, Arg, Method, register_method


@register_method(
    "accordion",
    Arg("low", COMPRESSOR, doc="the low-compression setting, sent in critical regimes"),
    Arg("high", COMPRESSOR, doc="the high-compression setting, sent otherwise"),
    Arg("window", int, within="[1, inf)", positional=False,
        doc="steps per detector window (none: the run's steps per epoch)"),
    Arg("interval", int, within="[1, inf)", positional=False, doc="windows between checks"),
    Arg("eta", float, within="(0, inf)", positional=False,
        doc="critical when the window norm changes by this fraction"),
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
  if window is None:
    window = steps_per_epoch if steps_per_epoch is not None else 1
  return Method("", tx=accordion(low, high, window=window, interval=interval, eta=eta,
                                 lr_schedule=lr_schedule, axis_name=axis_name, seed=seed))
