"""The steps of a synchronization, as parameters of :func:`~dadjax.local.local_updates`.

On a synchronization step of a fragment, every local-update method does
the same three things: it takes the fragment's pseudo-gradient
(:func:`pseudo_gradient`, ``Delta = anchor - local``), averages it over
the sites (*communicate*), and lets the average move the anchor and the
site (*merge*). Methods differ only in the last two. Each is a
module-level function of a small configuration tuple, bound into a
:class:`Communicate` or :class:`Merge` pair of ``init`` / ``run`` functions
(the optax way: a factory returns functions over explicit state):

* :func:`averaging` (:class:`Exchange`, :func:`exchange_init`,
  :func:`exchange_mean`): an fp32 all-reduce or any dadjax compressor; with
  ``decay`` an error-feedback memory that decays by ``decay`` before every
  exchange (``e <- decay * e + Delta``, send ``C(e)``, keep ``e - C(e)``):
  SparseLoCo's accumulator and DeMo's decoupled momentum are both this memory.
* :func:`outer_step` (:class:`Outer`, :func:`outer_init`,
  :func:`outer_merge`): an outer optax optimizer on the anchor, then every
  site moves to ``alpha * local + (1 - alpha) * anchor``.

A new variant is a new pair, e.g.
``local_updates(inner, H, communicate=averaging(dadjax.sign(), decay=1.0),
merge=outer_step(optax.sgd(0.7, momentum=0.9, nesterov=True)))``, or a
:class:`Communicate` / :class:`Merge` of its own functions that call these.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from typing import Any, Callable, NamedTuple

import jax
import optax

from dadjax._core.trees import check_axis_name
from dadjax.comm import Traffic, metered_pmean
from dadjax.compress import (Compressor, EmptyState, ErrorFeedbackState, error_feedback, exchange,
                             step_keys)


class Communicate(NamedTuple):
  """How a fragment's pseudo-gradient becomes the sites' average.

  Attributes:
    init: ``fragment params -> state``; the fragment is the parameter tree
      with the leaves of other fragments ``None``. The state is kept per
      fragment and per site in :attr:`~dadjax.local.LocalState.codec` and
      checkpointed with it.
    run: ``(delta, state, step) -> (mean, state, Traffic)``. ``delta`` is
      the fragment's pseudo-gradient (shapes and dtypes of the parameters),
      ``mean`` the sites' average in the same shapes, ``step`` the 0-based
      optimizer step (int32, traced). It runs inside ``lax.cond`` on the
      synchronization steps only, may run collectives over the sites' axis
      and must book them in the returned :class:`~dadjax.comm.Traffic`.
  """

  init: Callable[[Any], Any]
  run: Callable[[Any, Any, Any], tuple[Any, Any, Traffic]]


class Merge(NamedTuple):
  """How the average moves the anchor and the site.

  Attributes:
    init: ``fragment params -> state`` (kept per fragment in
      :attr:`~dadjax.local.LocalState.outer`).
    run: ``(local, anchor, mean, state) -> (local, anchor, state)``: the
      site's fragment, the synchronized fragment and the averaged
      pseudo-gradient in, the site's and the anchor's new fragment out (all
      shaped like the parameters).
  """

  init: Callable[[Any], Any]
  run: Callable[[Any, Any, Any, Any], tuple[Any, Any, Any]]


def pseudo_gradient(anchor: Any, local: Any) -> Any:
  """``Delta = anchor - local``: the change a site made since the last synchronization.

  Args:
    anchor: the synchronized parameters (``theta_global``).
    local: the site's parameters after its inner steps (same tree).

  Returns:
    A tree like ``local``: a step along ``-Delta`` from the anchor lands on
    the site's parameters (an outer SGD step of rate 1 on the average
    lands on the average of the sites).

  References:
    A. Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", 2023 (https://arxiv.org/abs/2311.08105).
  """
  return jax.tree.map(lambda a, l: a - l, anchor, local)


@contextlib.contextmanager
def named(name: str):
  """Prefix the ``ValueError`` of a step factory with the method's ``name``."""
  try:
    yield
  except ValueError as e:
    raise ValueError(f"{name}: {e}") from None


class Exchange(NamedTuple):
  """Configuration of :func:`exchange_mean`.

  Attributes:
    compressor: ``None`` (fp32 all-reduce) or a compressor; with ``decay``
      it is wrapped in :func:`~dadjax.compress.error_feedback`.
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys (default 0).
    decay: ``None`` (default): the compressor's state as it is; a float in
      [0, 1]: the error-feedback memory is multiplied by it before each
      exchange.
  """

  compressor: Compressor | None
  axis_name: str | None
  seed: int = 0
  decay: float | None = None


def exchange_init(config: Exchange, part: Any) -> Any:
  """The exchange's state for one fragment ``part`` of the parameters.

  Returns:
    ``EmptyState()`` for the fp32 all-reduce, else the compressor's state
    (an :class:`~dadjax.compress.ErrorFeedbackState` with a memory like
    ``part`` when ``config.decay`` is set).

  Raises:
    ValueError: ``decay`` with a compressor that keeps its own memory (PowerSGD).
  """
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
  """The sites' average of ``delta`` (a :class:`Communicate` ``run``).

  Args:
    config: the :class:`Exchange`.
    delta: the fragment's pseudo-gradient (parameter shapes).
    state: :func:`exchange_init`'s state.
    step: the 0-based optimizer step (int32), folded into the compressor's keys.

  Returns:
    ``(mean, state, traffic)``: ``mean`` like ``delta``; with ``decay`` the
    memory is ``decay * e`` before the compressor's error feedback adds
    ``delta`` and keeps what it did not send.
  """
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
    compressor: ``None`` (default: fp32 all-reduce) or a
      :class:`~dadjax.compress.Compressor` (its state persists across
      synchronizations).
    axis_name: the sites' axis (default ``"data"``; ``None``: one site).
    seed: seed of the compressor's keys (an int, default 0).
    decay: ``None`` (default), or a float in [0, 1]: wrap ``compressor`` in
      error feedback whose memory decays by ``decay`` before each exchange
      (``e <- decay * e + Delta``; 1.0: plain error feedback).

  Returns:
    A :class:`Communicate`.

  Raises:
    ValueError: a bad ``axis_name`` or ``seed``, ``decay`` outside [0, 1]
      or given without a compressor.

  References:
    S. P. Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019 (https://arxiv.org/abs/1901.09847).
  """
  axis_name = check_axis_name(axis_name)
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed must be an int, got {seed!r}")
  if decay is not None:
    if isinstance(decay, bool) or not isinstance(decay, numbers.Real) or not 0 <= decay <= 1:
      raise ValueError(f"decay must be None or a float in [0, 1] (the error-feedback memory's "
                       f"decay), got {decay!r}")
    if compressor is None:
      raise ValueError("decay needs a compressor: the fp32 all-reduce leaves no residual")
    compressor, decay = error_feedback(compressor), float(decay)
  config = Exchange(compressor, axis_name, int(seed), decay)
  return Communicate(functools.partial(exchange_init, config),
                     functools.partial(exchange_mean, config))


class Outer(NamedTuple):
  """Configuration of :func:`outer_merge`.

  Attributes:
    outer: the outer optimizer, applied to the anchor with the averaged
      pseudo-gradient as its gradient.
    alpha: weight of the site's local parameters in the merge (default 0:
      every site restarts from the anchor).
  """

  outer: optax.GradientTransformation
  alpha: float = 0.0


def outer_init(config: Outer, part: Any) -> Any:
  """The outer optimizer's state for one fragment ``part`` of the parameters."""
  return config.outer.init(part)


def outer_merge(config: Outer, local: Any, anchor: Any, mean: Any, state: Any
                ) -> tuple[Any, Any, Any]:
  """Outer step on the anchor with the averaged pseudo-gradient; the site's merged params.

  ``anchor <- anchor + outer(mean)``; ``local <- alpha * local + (1 - alpha) * anchor``
  (in ``local``'s dtype; with ``alpha = 0`` the new anchor itself).

  Returns:
    ``(local, anchor, state)``, shaped like the inputs.
  """
  updates, state = config.outer.update(mean, state, anchor)
  anchor = optax.apply_updates(anchor, updates)
  alpha = config.alpha
  if alpha == 0.0:
    local = anchor
  else:
    local = jax.tree.map(lambda l, g: (alpha * l + (1 - alpha) * g).astype(l.dtype), local,
                         anchor)
  return local, anchor, state


def default_outer() -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def outer_step(outer: optax.GradientTransformation | None = None, alpha: float = 0.0) -> Merge:
  """The :class:`Merge` of :func:`outer_merge`: DiLoCo's, and Streaming DiLoCo's with ``alpha``.

  Args:
    outer: the outer optimizer (default :func:`default_outer`; local SGD:
      ``optax.sgd(1.0)``, the plain average; SparseLoCo: ``optax.sgd(lr)``).
    alpha: weight of the local parameters in the merge, a float in [0, 1]
      (default 0; Streaming DiLoCo: 0.5).

  Returns:
    A :class:`Merge` whose state is the outer optimizer's.

  Raises:
    ValueError: ``outer`` not an optax transformation, ``alpha`` outside [0, 1].

  References:
    A. Douillard et al., "Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512).
  """
  outer = default_outer() if outer is None else outer
  if not isinstance(outer, optax.GradientTransformation):
    raise ValueError(f"outer must be an optax GradientTransformation (e.g. optax.sgd(0.7, "
                     f"momentum=0.9, nesterov=True)), got {type(outer).__name__}")
  if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha <= 1:
    raise ValueError(f"alpha must be a float in [0, 1] (the weight of the local parameters in "
                     f"the merge), got {alpha!r}")
  config = Outer(outer, float(alpha))
  return Merge(functools.partial(outer_init, config), functools.partial(outer_merge, config))
