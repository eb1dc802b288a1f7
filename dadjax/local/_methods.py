"""The local-update methods as specs: ``local_sgd:H``, ``diloco:H``, ``streaming_diloco:H``,
``sparseloco:H``, ``demo[:H]``.

Each wraps the run's local optimizer (``Method.wrap``): the config's
optimizer becomes the inner optimizer, and the method communicates alone.
"""

from __future__ import annotations

from typing import Any

import optax

from dadjax.local._frontier import demo, sparseloco
from dadjax.local._diloco import diloco, local_sgd, streaming_diloco
from dadjax.registry import COMPRESSOR, Arg, ArgumentError, BuildContext, Method, register_method

_EVERY = Arg("every", int, within="[1, inf)", doc="H: inner steps between synchronizations")


def _outer_args() -> tuple[Arg, ...]:
  return (
      Arg("outer_lr", float, within="(0, inf)", positional=False, doc="outer SGD learning rate"),
      Arg("outer_momentum", float, within="[0, 1)", positional=False,
          doc="outer Nesterov momentum (0: plain SGD)"),
      Arg("compress", COMPRESSOR, positional=False,
          doc="compressor of the pseudo-gradient (none: fp32 all-reduce)"),
  )


def _outer(lr: float, momentum: float) -> optax.GradientTransformation:
  return optax.sgd(lr, momentum=momentum or None, nesterov=bool(momentum))


def _method(name: str, make) -> Method:
  try:
    make(optax.identity())  # check the hyperparameters now, not when the run builds its optimizer
  except ValueError as e:  # the constructor's checks of the user's values; the registry names it
    raise ArgumentError(str(e).removeprefix(f"{name}: ")) from None
  return Method(tx=None, wrap=make)


@register_method("local_sgd", _EVERY, family="local",
                 doc="local SGD: H local steps, then the sites average their parameters (fp32)")
def _local_sgd(ctx: BuildContext, every: int) -> Method:
  """:func:`~dadjax.local.local_sgd` around the run's optimizer."""
  return _method("local_sgd", lambda inner: local_sgd(inner, every, axis_name=ctx.axis_name))


@register_method("diloco", _EVERY, *_outer_args(), family="local",
                 doc="DiLoCo: H inner steps, then outer Nesterov SGD on the averaged "
                     "pseudo-gradient (optionally compressed)")
def _diloco(ctx: BuildContext, every: int, outer_lr: float = 0.7, outer_momentum: float = 0.9,
            compress: Any = None) -> Method:
  """:func:`~dadjax.local.diloco` around the run's optimizer."""
  outer = _outer(outer_lr, outer_momentum)
  return _method("diloco", lambda inner: diloco(inner, every, outer, compress,
                                                axis_name=ctx.axis_name, seed=ctx.seed))


@register_method(
    "streaming_diloco", _EVERY,
    Arg("fragments", int, within="[1, inf)", positional=False,
        doc="P: fragments, each synchronized at its own offset (<= H and the leaves)"),
    Arg("delay", int, within="[0, inf)", positional=False,
        doc="tau: inner steps between a fragment's send and its merge (< H)"),
    Arg("alpha", float, within="[0, 1]", positional=False,
        doc="weight of the local parameters in the merge"),
    *_outer_args(), family="local",
    doc="Streaming DiLoCo: DiLoCo in P staggered fragments, merged tau steps after sending")
def _streaming_diloco(ctx: BuildContext, every: int, fragments: int = 2, delay: int = 1,
                      alpha: float = 0.5, outer_lr: float = 0.7, outer_momentum: float = 0.9,
                      compress: Any = None) -> Method:
  """:func:`~dadjax.local.streaming_diloco` around the run's optimizer."""
  outer = _outer(outer_lr, outer_momentum)
  return _method("streaming_diloco", lambda inner: streaming_diloco(
      inner, every, fragments, delay, alpha, outer, compress, axis_name=ctx.axis_name,
      seed=ctx.seed))


_CHUNK_ARGS = (
    Arg("chunk", int, within="[1, inf)", positional=False,
        doc="block side s: s x s blocks (vectors: 1-D chunks of at most s)"),
)


@register_method(
    "sparseloco", _EVERY,
    Arg("k", int, within="[1, inf)", positional=False, doc="entries kept per block"),
    *_CHUNK_ARGS,
    Arg("values", COMPRESSOR, positional=False,
        doc="stateless quantizer of the kept values (identity: fp32)"),
    Arg("decay", float, within="[0, 1]", positional=False,
        doc="beta: decay of the error-feedback memory"),
    Arg("outer_lr", float, within="(0, inf)", positional=False, doc="outer SGD learning rate"),
    family="local",
    doc="SparseLoCo: H inner steps, then top-k per 64x64 block of a decaying error-feedback "
        "memory, 2-bit values, outer SGD (arXiv 2508.15706)")
def _sparseloco(ctx: BuildContext, every: int, k: int = 64, chunk: int = 64,
                values: Any = "terngrad", decay: float = 0.95, outer_lr: float = 1.0) -> Method:
  """:func:`~dadjax.local.sparseloco` around the run's optimizer."""
  return _method("sparseloco", lambda inner: sparseloco(
      inner, every, k=k, chunk=chunk, values=values, decay=decay, outer_lr=outer_lr,
      axis_name=ctx.axis_name, seed=ctx.seed))


@register_method(
    "demo",
    Arg("every", int, within="[1, inf)", doc="inner steps between exchanges (DeMo: 1)"),
    Arg("k", int, within="[1, inf)", positional=False, doc="DCT coefficients kept per block"),
    *_CHUNK_ARGS,
    Arg("decay", float, within="[0, 1]", positional=False, doc="beta: decay of the momentum"),
    Arg("lr", float, within="(0, inf)", positional=False,
        doc="sign step's learning rate (default: the run's schedule, else 4e-4)"),
    Arg("weight_decay", float, within="[0, inf)", positional=False,
        doc="decoupled weight decay"),
    Arg("sign", bool, doc="apply the sign of the averaged components (the paper)"),
    family="local",
    doc="DeMo: per-site momentum, top-k of its DCT blocks shared and removed, sign-SGD on "
        "their mean (arXiv 2411.19870; the run's optimizer feeds the momentum: sgd, "
        "momentum=0 for the paper's)")
def _demo(ctx: BuildContext, every: int = 1, k: int = 32, chunk: int = 64,
          decay: float = 0.999, lr: float | None = None, weight_decay: float = 0.0,
          sign: bool = True) -> Method:
  """:func:`~dadjax.local.demo` around the run's optimizer; ``lr`` defaults to the run's
  schedule (``dadjax train`` passes it), else 4e-4."""
  if lr is None:  # the run's learning rate, as DeMo has one; else the paper's (300M LM)
    lr = ctx.lr_schedule if ctx.lr_schedule is not None else 4e-4
  return _method("demo", lambda inner: demo(
      inner, every, lr=lr, k=k, chunk=chunk, decay=decay, weight_decay=weight_decay,
      sign=sign, axis_name=ctx.axis_name, seed=ctx.seed))
