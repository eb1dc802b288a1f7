"""SparseLoCo and DeMo: local updates whose exchange is a decaying error-feedback memory.

Both keep, on every site, a memory ``e`` that decays by ``beta`` and takes
the new pseudo-gradient (``e <- beta * e + Delta``), send only the top-k of
each chunk of it (:func:`~dadjax.local.chunked_topk`) and keep the rest
(``e <- e - C(e)``): :func:`~dadjax.local.averaging` with ``decay=beta``.
SparseLoCo quantizes the kept values to 2 bits and takes a plain outer SGD
step (the memory stands in for DiLoCo's outer momentum); DeMo selects DCT
coefficients and applies the sign of the average.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable

import optax

from dadjax.compress import Compressor
from dadjax.local._chunked import chunked_topk
from dadjax.local._periodic import check_compressor, local_updates
from dadjax.local._steps import averaging, named, outer_step


def _check_unit(name: str, what: str, value, low_open: bool = False) -> float:
  ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
  ok = ok and (0 < value if low_open else 0 <= value) and value <= 1
  if not ok:
    raise ValueError(f"{name}: {what} must be a float in {'(' if low_open else '['}0, 1], "
                     f"got {value!r}")
  return float(value)


def _check_positive(name: str, what: str, value) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
    raise ValueError(f"{name}: {what} must be a float > 0, got {value!r}")
  return float(value)


def sparseloco(
    inner: optax.GradientTransformation,
    every: int,
    *,
    k: int = 64,
    chunk: int = 64,
    values: Compressor | str | None = "terngrad",
    decay: float = 0.95,
    outer_lr: float = 1.0,
    axis_name: str | None = "data",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """SparseLoCo: DiLoCo with top-k, 2-bit pseudo-gradients and error feedback for momentum.

  Every ``every`` steps each site folds its pseudo-gradient into its memory
  (``e <- decay * e + Delta``), sends the ``k`` largest entries of every
  ``chunk x chunk`` block of ``e`` with their values quantized to 2 bits,
  and keeps what it did not send (``e <- e - C(e)``). The sites average
  the sparse payloads (all-gather) and take a plain outer SGD step
  ``anchor <- anchor - outer_lr * mean``: the decaying memory replaces
  DiLoCo's outer Nesterov momentum.

  Defaults as we read the paper: 64 of every 4096-entry (64 x 64) block
  (1.56% density; 1-3% in its experiments), 2-bit values, ``decay`` 0.95,
  outer learning rate 1, positions inside the block sent as 12-bit codes.
  The paper quantizes the values with a 4-bin statistical quantizer; here
  they go through the catalog's ``terngrad`` (2 bits per value, one fp32
  scale per tensor, unbiased up to its clipping), or any stateless
  compressor given as ``values``.

  Args:
    inner: the local optimizer (the paper: AdamW).
    every: ``H``, inner steps per synchronization (the paper: 15 to 250).
    k: entries kept per chunk, an int >= 1.
    chunk: block side, an int >= 1 (vectors: 1-D chunks of at most ``chunk``).
    values: compressor of the kept values (spec or
      :class:`~dadjax.compress.Compressor`, stateless; ``None``: sent in fp32).
    decay: ``beta``, the memory's decay, in [0, 1].
    outer_lr: ``alpha``, the outer SGD learning rate, > 0.
    axis_name: the sites' axis.
    seed: seed of the quantizer's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`~dadjax.local.LocalState` (the memory is its ``codec``, an
    :class:`~dadjax.compress.ErrorFeedbackState` per site).

  Raises:
    ValueError: naming the argument and its range.

  References:
    A. Sarfi, B. Therien, J. Lidin, E. Belilovsky, "Communication Efficient
    LLM Pre-training with SparseLoCo", 2025 (https://arxiv.org/abs/2508.15706).
  """
  name = "sparseloco"
  values = check_compressor(values, name)
  try:
    compressor = chunked_topk(k, chunk, values=values)
  except ValueError as e:
    raise ValueError(f"{name}: {str(e).removeprefix('chunked_topk: ')}") from None
  decay = _check_unit(name, "decay", decay)
  outer_lr = _check_positive(name, "outer_lr", outer_lr)
  with named(name):
    communicate = averaging(compressor, axis_name=axis_name, seed=seed, decay=decay)
  return local_updates(inner, every, communicate, outer_step(optax.sgd(outer_lr)), name=name)


def demo_outer(lr: float | Callable[[Any], Any], weight_decay: float = 0.0,
               sign: bool = True) -> optax.GradientTransformation:
  """DeMo's step on the averaged components: ``-lr * (sign(Q) + weight_decay * params)``."""
  parts = [optax.scale_by_sign()] if sign else []
  if weight_decay:
    parts.append(optax.add_decayed_weights(weight_decay))
  parts.append(optax.scale_by_learning_rate(lr))
  return optax.chain(*parts)


def demo(
    inner: optax.GradientTransformation,
    every: int = 1,
    *,
    lr: float | Callable[[Any], Any] = 4e-4,
    k: int = 32,
    chunk: int = 64,
    decay: float = 0.999,
    weight_decay: float = 0.0,
    sign: bool = True,
    axis_name: str | None = "data",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """DeMo: per-site decoupled momentum, its fast DCT components shared, sign-SGD on their mean.

  Each site keeps its own momentum ``m`` and never averages it. Every
  ``every`` steps (the paper: every step) it adds the change its inner
  optimizer made (``m <- decay * m + Delta``; with ``inner = optax.sgd(lr)``
  and ``every = 1``, ``Delta = lr * g``, the paper's ``delta += lr * grad``),
  takes the orthonormal DCT-II of every ``chunk x chunk`` block of ``m``,
  keeps the ``k`` largest coefficients per block (its fast components),
  removes their inverse transform from ``m`` and all-gathers them. The
  parameters take ``-lr * sign(mean)`` (with ``weight_decay``: decoupled, as
  the paper's ``p *= 1 - lr * wd``). The sign makes the step independent of
  the inner learning rate's scale.

  The mean is the sum of the sites' components over the number of sites;
  the reference code averages each coefficient over the sites that selected
  it, which weighs rare coefficients more before the sign. Positions travel
  as 12-bit codes (the reference: int64), values in the parameters' dtype.

  Args:
    inner: the per-site optimizer whose step feeds the momentum; the paper's
      DeMo is ``optax.sgd(lr)`` without momentum (``optimizer=sgd
      momentum=0`` in a config).
    every: steps between exchanges (1: DeMo; more: local steps between them).
    lr: the sign step's learning rate (or schedule); the paper: 4e-4 at
      300M parameters, with warmup and cosine decay.
    k: coefficients kept per block (the paper: 32).
    chunk: block side (the paper: 64; vectors: 1-D chunks).
    decay: the momentum's decay ``beta`` (the paper: 0.999), in [0, 1].
    weight_decay: decoupled weight decay, >= 0 (the paper: 0).
    sign: apply the sign of the mean (the paper); ``False`` applies the mean.
    axis_name: the sites' axis.
    seed: seed of the exchange's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`~dadjax.local.LocalState`; the momenta are its ``codec`` (an
    :class:`~dadjax.compress.ErrorFeedbackState` per site, ``memory = m``).

  Raises:
    ValueError: naming the argument and its range.

  References:
    B. Peng, J. Quesnelle, D. P. Kingma, "DeMo: Decoupled Momentum
    Optimization", 2024 (https://arxiv.org/abs/2411.19870).
  """
  name = "demo"
  try:
    compressor = chunked_topk(k, chunk, dct=True)
  except ValueError as e:
    raise ValueError(f"{name}: {str(e).removeprefix('chunked_topk: ')}") from None
  decay = _check_unit(name, "decay", decay)
  if not callable(lr):
    lr = _check_positive(name, "lr", lr)
  if isinstance(weight_decay, bool) or not isinstance(weight_decay, numbers.Real) or \
      not weight_decay >= 0:
    raise ValueError(f"{name}: weight_decay must be a float >= 0, got {weight_decay!r}")
  if not isinstance(sign, bool):
    raise ValueError(f"{name}: sign must be a bool, got {sign!r}")
  with named(name):
    communicate = averaging(compressor, axis_name=axis_name, seed=seed, decay=decay)
  return local_updates(inner, every, communicate,
                       outer_step(demo_outer(lr, float(weight_decay), sign)), name=name)
