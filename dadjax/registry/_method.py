"""What a method gives the train step (:class:`Method`) and what its builder is told.

:class:`BuildContext` holds the run facts; :class:`ArgumentError` is a builder's word for
values the user gave that it cannot use.
"""

from __future__ import annotations

import types
from typing import Any, Callable, Mapping, NamedTuple

import optax

from dadjax.errors import DadjaxError

_NO_COLLECTIONS: Mapping[str, Any] = types.MappingProxyType({})


class ArgumentError(DadjaxError):
  """Raised by a builder for values the user gave that it cannot use.

  For the checks an ``Arg`` range cannot state (two arguments that must
  agree, a nested method of the wrong sort, a run fact the method needs).
  :func:`~dadjax.registry.build` reports it as a ``SpecError`` naming the
  spec; called directly, the builder's caller sees this ``ValueError``.
  """


class BuildContext(NamedTuple):
  """The run facts every method builder receives (its first argument).

  Attributes:
    axis_name: mesh axis of the sites (``None``: one site).
    seed: seeds the method's shared randomness.
    steps_per_epoch: the run's steps per epoch, for methods that work in
      epochs (Accordion's detector window); ``None``: unknown.
    lr_schedule: the optimizer's learning-rate schedule (step -> lr), for
      methods that react to its decreases (Accordion); ``None``: unknown.
  """

  axis_name: str | None = "data"
  seed: int = 0
  steps_per_epoch: int | None = None
  lr_schedule: Callable[[Any], Any] | None = None

  def epoch_window(self, window: int | None, name: str = "window") -> int:
    """A detector window in steps: ``window`` if given, else the run's steps per epoch.

    Raises:
      ArgumentError: neither is known, naming both ways to give it.
    """
    if window is not None:
      return window
    if self.steps_per_epoch is None:
      raise ArgumentError(
          f"{name} is needed: give {name}=STEPS in the spec, or build the method with the "
          "run's steps_per_epoch (build_method(spec, steps_per_epoch=...); `dadjax train` "
          "passes it)")
    return self.steps_per_epoch


class Method(NamedTuple):
  """What a communication method gives the train step (any field may be empty).

  Attributes:
    name: the spec it was built from.
    tx: the communicating optax transformation; put it first in the
      optimizer chain.
    dense: a dense-layer factory the model must be built with (dAD).
    batch_stage: a :class:`~dadjax.stage.BatchStage` that runs on the site's
      batch instead of the plain backward pass (data-side methods).
    wrap: ``optimizer -> optimizer`` applied to the whole chain (``tx``, then
      the local optimizer) for methods that decide *when* an update happens
      (Accordion's batch-size mode accumulates micro-steps and runs the
      chain once per cycle); ``None`` leaves the chain as it is.
    collections: model-state collections with their own update rule, by
      collection name: ``{name: CollectionRule}`` (the rule type of
      ``dadjax._core.protocols``); the train loop hands them to
      ``make_train_step(..., collections=...)``. Empty by default.
  """

  name: str = ""
  tx: optax.GradientTransformation | None = None
  dense: Callable[..., Any] | None = None
  batch_stage: Any = None
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None
  collections: Mapping[str, Any] = _NO_COLLECTIONS

  def optimizer(self, local: optax.GradientTransformation) -> optax.GradientTransformation:
    """The optimizer a run uses: ``tx`` first, then ``local``, under ``wrap``.

    Args:
      local: the local optimizer, e.g. ``optax.sgd(0.1, momentum=0.9)``.
    """
    chain = optax.chain(self.tx if self.tx is not None else optax.identity(), local)
    return self.wrap(chain) if self.wrap is not None else chain
