"""Static configuration of a dAD layer: :class:`DadConfig` and the mode names.

:class:`DadConfig` is the only place dAD's options are written: every layer
(:class:`~dadjax.dad.Dense`, :class:`~dadjax.dad.DotGeneral`,
:class:`~dadjax.dad.NnxDotGeneral`) takes a ``config`` and, for convenience,
its fields as keyword options, read from :data:`CONFIG_FIELDS`
(:func:`config_from`).

See :mod:`dadjax.dad._vjp` for what each mode does in the backward pass and
:mod:`dadjax.dad._cost` for the routes' cost model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from dadjax._core.validate import check_int
from dadjax.dad._power import POWER_METHODS

MODES = ("exact", "rank", "auto", "local")
AGGREGATIONS = ("one_way", "two_way")
ROUTES = ("gather", "factors", "allreduce", "local")


@dataclasses.dataclass(frozen=True)
class DadConfig:
  """Static configuration of a dAD layer (hashable: a ``nondiff`` argument).

  Attributes:
    axis_name: mesh / pmap / vmap axis of the sites; ``None``: one site.
    mode: ``"exact"``, ``"rank"``, ``"auto"`` or ``"local"`` (module doc).
    rank: components per site for ``"rank"``, >= 1. Default 4.
    iters: maximum power iterations per component, >= 1. Default 10.
    tol: power-iteration convergence threshold on ``||b_new - b||``, >= 0.
      Default 1e-3 (the authors' default).
    aggregation: ``"one_way"`` (sum of all sites' factors, rank <= N r) or
      ``"two_way"`` (global rank-r result). Default ``"one_way"``.
    warm_start: start each step's power iteration from the last step's
      right factors (``"rank"`` only). Default False.
    error_feedback: keep each site's compression residual and add it to the
      next step's local gradient (``"rank"`` only). Default False.
    seed: seed of the random starts; the key is ``fold_in(key(seed),
      step)``, identical on every site. Default 0.
    precision: ``jax.lax.Precision`` of the matmuls. Default ``None``.
    rank_low: with ``mode="rank"`` (one-way): run under Accordion, switching
      the layer's rank between ``rank`` (critical regimes) and ``rank_low``
      (1 <= rank_low < rank), see :mod:`dadjax.dad._rank_accordion`.
      Default ``None`` (fixed rank).
    accordion_window: steps per detector window (>= 1). Default 1.
    accordion_interval: windows between checks (>= 1). Default 1.
    accordion_eta: critical threshold on the relative change (> 0). Default 0.5.
    lr_schedule: the optimizer's schedule (step -> lr); a decrease makes the
      layer critical until the next check. Default ``None``.
    power: ``mode="rank"``: the power iteration, ``"deflated"`` (one component
      at a time) or ``"block"`` (all ``rank`` at once, subspace iteration);
      see :func:`~dadjax.extend.factorize`. Default ``"deflated"``.
    quantize_bits: ``mode="exact"`` only: send ``A`` and ``D`` stochastically
      rounded to this many bits per number, in ``[1, 8]`` (quantized dAD,
      unbiased; :mod:`dadjax.dad._quantized`). Default ``None`` (fp rows).
    bucket: ``mode="exact"`` only: the train step gathers every bucketing
      layer's ``A`` and ``D`` in one all-gather per backward pass instead of
      one per layer (:mod:`dadjax.dad._bucket`). Default False.
  """

  axis_name: str | None = "data"
  mode: str = "exact"
  rank: int = 4
  iters: int = 10
  tol: float = 1e-3
  aggregation: str = "one_way"
  warm_start: bool = False
  error_feedback: bool = False
  seed: int = 0
  precision: Any = None
  rank_low: int | None = None
  accordion_window: int = 1
  accordion_interval: int = 1
  accordion_eta: float = 0.5
  lr_schedule: Any = None
  quantize_bits: int | None = None
  power: str = "deflated"
  bucket: bool = False

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
    check_int("rank", self.rank, 1)
    check_int("iters", self.iters, 1)
    if isinstance(self.tol, bool) or not isinstance(self.tol, (int, float)) or not (
        math.isfinite(self.tol) and self.tol >= 0):
      raise ValueError(f"tol must be a finite number >= 0, got {self.tol!r}")
    if self.aggregation not in AGGREGATIONS:
      raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
    if self.axis_name is not None and not isinstance(self.axis_name, str):
      raise ValueError(f"axis_name must be a str or None, got {self.axis_name!r}")
    for flag in ("warm_start", "error_feedback"):
      if getattr(self, flag) and self.mode != "rank":
        raise ValueError(f"{flag} applies to mode='rank' only, got mode={self.mode!r}")
    check_int("seed", self.seed, 0)
    if self.power not in POWER_METHODS:
      raise ValueError(f"power must be one of {POWER_METHODS}, got {self.power!r}")
    if self.rank_low is not None:
      if self.mode != "rank" or self.aggregation != "one_way":
        raise ValueError("rank_low applies to mode='rank' with aggregation='one_way', got "
                         f"mode={self.mode!r}, aggregation={self.aggregation!r}")
      if (isinstance(self.rank_low, bool) or not isinstance(self.rank_low, int)
          or not 1 <= self.rank_low < self.rank):
        raise ValueError(f"rank_low must be an int in [1, rank={self.rank}), got {self.rank_low!r}")
    check_int("accordion_window", self.accordion_window, 1)
    check_int("accordion_interval", self.accordion_interval, 1)
    eta = self.accordion_eta
    if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not (
        math.isfinite(eta) and eta > 0):
      raise ValueError(f"accordion_eta must be a finite number > 0, got {eta!r}")
    if self.lr_schedule is not None and not callable(self.lr_schedule):
      raise ValueError(f"lr_schedule must be callable (step -> lr) or None, got "
                       f"{self.lr_schedule!r}")
    if self.quantize_bits is not None:
      if self.mode != "exact":
        raise ValueError(f"quantize_bits applies to mode='exact' only, got mode={self.mode!r}")
      if (isinstance(self.quantize_bits, bool) or not isinstance(self.quantize_bits, int)
          or not 1 <= self.quantize_bits <= 8):
        raise ValueError(f"quantize_bits must be None or an int in [1, 8], "
                         f"got {self.quantize_bits!r}")
    if not isinstance(self.bucket, bool):
      raise ValueError(f"bucket must be a bool, got {self.bucket!r}")
    if self.bucket and (self.mode != "exact" or self.quantize_bits is not None):
      raise ValueError("bucket applies to mode='exact' without quantize_bits (the exact rows "
                       f"A and D), got mode={self.mode!r}, quantize_bits={self.quantize_bits!r}")


CONFIG_FIELDS = tuple(f.name for f in dataclasses.fields(DadConfig))


def config_from(config: DadConfig | None = None, **options: Any) -> DadConfig:
  """``config`` with ``options`` (:class:`DadConfig` fields) replacing its fields.

  Args:
    config: a :class:`DadConfig`, or ``None`` (the defaults).
    **options: any of :data:`CONFIG_FIELDS`.

  Returns:
    The :class:`DadConfig` (validated: a bad value raises naming its field).

  Raises:
    TypeError: for a keyword that is not a :class:`DadConfig` field.
    ValueError: for a ``config`` that is not a :class:`DadConfig`, or a bad value.
  """
  unknown = sorted(set(options) - set(CONFIG_FIELDS))
  if unknown:
    raise TypeError(f"unexpected dAD options {unknown}; the options are DadConfig's fields "
                    f"{list(CONFIG_FIELDS)}")
  if config is None:
    return DadConfig(**options)
  if not isinstance(config, DadConfig):
    raise ValueError(f"config must be a dadjax.dad.DadConfig, got {config!r}")
  return dataclasses.replace(config, **options) if options else config
