"""The two steps of a synchronization, as parameters of :func:`~dadjax.local.local_updates`.

A local-update method differs from DiLoCo in how a fragment's
pseudo-gradient is averaged (*communicate*) and in how the average moves
the anchor and the sites (*merge*). Each step is a module-level function
of a small configuration tuple, bound into a :class:`Communicate` or
:class:`Merge` pair of ``init`` / ``run`` functions (the optax way: a
factory returns functions over explicit state):

* :func:`averaging` / :func:`exchange_mean`: an fp32 all-reduce or any
  dadjax compressor; with ``decay`` an error-feedback memory that decays
  by ``decay`` before every exchange (``e <- decay * e + Delta``, send
  ``C(e)``, keep ``e - C(e)``): SparseLoCo's accumulator and DeMo's
  decoupled momentum are both this memory.
* :func:`outer_step` / :func:`outer_merge`: an outer optax optimizer on the
  anchor, then every site moves to ``alpha * local + (1 - alpha) * anchor``.

A new variant is a new pair, e.g.
``local_updates(inner, H, communicate=my_communicate, merge=outer_step(optax.sgd(1.0)))``.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, NamedTuple

import jax
import optax

from dadjax.comm import Traffic, metered_pmean
from dadjax.compress import (Compressor, EmptyState, ErrorFeedbackState, error_feedback, exchange,
                             step_keys)


class Communicate(NamedTuple):
  """How a fragment's pseudo-gradient becomes the sites' average.

  Attributes:
    init: ``fragment params -> state`` (kept per fragment and per site in
      :attr:`~dadjax.local.LocalState.codec`; checkpointed with it).
    run: ``(delta, state, step) -> (mean, state, Traffic)``; ``step`` is the
      0-based optimizer step (int32, traced); it may run collectives over
      the sites' axis and must book them in the returned
      :class:`~dadjax.comm.Traffic`.
  """

  init: Callable[[Any], Any]
  run: Callable[[Any, Any, Any], tuple[Any, Any, Traffic]]


class Merge(NamedTuple):
  """How the average moves the anchor and the site.

  Attributes:
    init: ``fragment params -> state`` (kept per fragment in
      :attr:`~dadjax.local.LocalState.outer`).
    run: ``(local, anchor, mean, state) -> (local, anchor, state)``.
  """

  init: Callable[[Any], Any]
  run: Callable[[Any, Any, Any, Any], tuple[Any, Any, Any]]


class Exchange(NamedTuple):
  """Configuration of :func:`exchange_mean`.

  Attributes:
    compressor: ``None`` (fp32 all-reduce) or a compressor; with ``decay``
      it is wrapped in :func:`~dadjax.compress.error_feedback`.
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys.
    decay: ``None``: the compressor's state as it is; a float in [0, 1]:
      the error-feedback memory is multiplied by it before each exchange.
  """

  compressor: Compressor | None
  axis_name: str | None
  seed: int = 0
  decay: float | None = None


def exchange_init(config: Exchange, part: Any) -> Any:
  """The exchange's state for one fragment (the compressor's; ``EmptyState`` for fp32)."""
  if config.compressor is None:
    return EmptyState()
  state = config.compressor.init(part)
  if config.decay is not None and not isinstance(state, ErrorFeedbackState):
    raise ValueError(
        f"decay needs an error-feedback memory, but {config.compressor.name or 'the compressor'} "
        "keeps its own (PowerSGD's): pass decay=None, or a compressor without one")
  return state


def exchange_mean(config: Exchange, delta: Any, state: Any, step: jax.Array
                  ) -> tuple[Any, Any, Traffic]:
  """The sites' average of ``delta``: ``(mean, state, traffic)`` (see :class:`Exchange`)."""
  if config.compressor is None:
    mean, traffic = metered_pmean(delta, config.axis_name)
    return mean, state, traffic
  if config.decay is not None:
    state = state._replace(memory=jax.tree.map(lambda e: e * config.decay, state.memory))
  out = exchange(config.compressor, delta, state, step_keys(int(config.seed), step,
                                                            config.axis_name),
                 config.axis_name)
  return out.mean, out.state, out.traffic


def averaging(compressor: Compressor | None = None, *, axis_name: str | None = "data",
              seed: int = 0, decay: float | None = None) -> Communicate:
  """The :class:`Communicate` of :func:`exchange_mean`: fp32 all-reduce or a compressor.

  Args:
    compressor: ``None`` (fp32 all-reduce) or a
      :class:`~dadjax.compress.Compressor` (its state persists across
      synchronizations).
    axis_name: the sites' axis.
    seed: seed of the compressor's keys.
    decay: ``None``, or a float in [0, 1]: wrap ``compressor`` in error
      feedback whose memory decays by ``decay`` before each exchange
      (``e <- decay * e + Delta``; 1.0: plain error feedback).

  Raises:
    ValueError: ``decay`` outside [0, 1] or given without a compressor.
  """
  if decay is not None:
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 <= decay <= 1:
      raise ValueError(f"decay must be None or a float in [0, 1] (the error-feedback memory's "
                       f"decay), got {decay!r}")
    if compressor is None:
      raise ValueError("decay needs a compressor: the fp32 all-reduce leaves no residual")
    compressor, decay = error_feedback(compressor), float(decay)
  config = Exchange(compressor, axis_name, seed, decay)
  return Communicate(functools.partial(exchange_init, config),
                     functools.partial(exchange_mean, config))


class Outer(NamedTuple):
  """Configuration of :func:`outer_merge`: the outer optimizer and the local weight ``alpha``."""

  outer: optax.GradientTransformation
  alpha: float = 0.0


def outer_init(config: Outer, part: Any) -> Any:
  return config.outer.init(part)


def outer_merge(config: Outer, local: Any, anchor: Any, mean: Any, state: Any
                ) -> tuple[Any, Any, Any]:
  """Outer step on the anchor with the averaged pseudo-gradient; the site's merged params."""
  updates, state = config.outer.update(mean, state, anchor)
  anchor = optax.apply_updates(anchor, updates)
  alpha = config.alpha
  if alpha == 0.0:
    local = anchor
  else:
    local = jax.tree.map(lambda l, g: (alpha * l + (1 - alpha) * g).astype(l.dtype), local,
                         anchor)
  return local, anchor, state


def outer_step(outer: optax.GradientTransformation, alpha: float = 0.0) -> Merge:
  """The :class:`Merge` of :func:`outer_merge` (DiLoCo's; Streaming DiLoCo's with ``alpha``)."""
  config = Outer(outer, float(alpha))
  return Merge(functools.partial(outer_init, config), functools.partial(outer_merge, config))
