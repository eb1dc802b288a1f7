"""Communication methods by name: one spec string -> what the step needs.

A method (:class:`~dadjax.registry.Method`) is any of: the communicating
optax transformation (placed first in the optimizer chain), the dense-layer
factory the model must be built with (dAD), and a batch stage (data-side
methods). Switching method in an experiment is a config change:
``method="topk:0.01"``. The specs themselves live in
:mod:`dadjax.registry`; this module registers the baselines and makes every
compressor a method (its :func:`~dadjax.compress.compressed` all-reduce).
"""

from __future__ import annotations

from typing import Any, Callable

from dadjax import registry
from dadjax.comm import allreduce
from dadjax.compress import Compressor, compressed
from dadjax.registry import BuildContext, Method, register_method

__all__ = ["Method", "build_method"]


@register_method("allreduce", aliases=("fp32",), family="baseline")
def _allreduce(ctx: BuildContext) -> Method:
  """fp32 mean of the gradients (psum): the baseline every method is measured against."""
  return Method(tx=allreduce(ctx.axis_name))


@registry.lift_compressors
def _compressed(compressor: Compressor, ctx: BuildContext) -> Method:
  return Method(tx=compressed(compressor, axis_name=ctx.axis_name, seed=ctx.seed))


def build_method(spec: str, axis_name: str | None = "data", seed: int = 0, *,
                 steps_per_epoch: int | None = None,
                 lr_schedule: Callable[[Any], Any] | None = None) -> Method:
  """Build a method from its spec.

  Args:
    spec: ``"allreduce"`` / ``"fp32"`` (fp32 psum); any compressor spec
      (``"topk:0.01"``, ``"ef(topk:0.01)"``, ``"powersgd:4"``, ...: the
      compressor inside :func:`~dadjax.compress.compressed`); a dAD spec
      (``"dad"``, ``"rank_dad:2:two_way"``, ``"auto_dad"``); or any other
      registered method (``dadjax methods`` lists them all).
    axis_name: mesh axis of the sites (``None``: one site).
    seed: seeds the method's shared randomness.
    steps_per_epoch: the run's steps per epoch, for methods that work in
      epochs (Accordion's detector window); ``None``: unknown.
    lr_schedule: the optimizer's learning-rate schedule (step -> lr), for
      methods that react to its decreases (Accordion); ``None``: unknown.

  Returns:
    A :class:`~dadjax.registry.Method` named ``spec``.

  Raises:
    SpecError: (a ``ValueError``) for a malformed spec, an unknown name or a
      bad argument, listing every valid form. An error inside a builder
      (a defect, not the spec) propagates as itself.
  """
  context = BuildContext(axis_name=axis_name, seed=seed, steps_per_epoch=steps_per_epoch,
                         lr_schedule=lr_schedule)
  return registry.build("method", spec, context)
