"""The importance gate: which of a site's samples are worth sending.

A per-sample score ``s_i >= 0`` decides. Two rules:

* ``"threshold"``: send sample ``i`` iff ``s_i >= threshold``; a sent sample
  keeps its weight. The estimate counts an unsent sample as a zero gradient,
  so with the gradient-norm score its bias has norm at most ``threshold``
  (each dropped sample's gradient has norm below it).
* ``"sample"``: send sample ``i`` with probability
  ``p_i = min(1, fraction * R * ((1 - floor) * s_i / sum(s) + floor / R))``
  (``R`` rows; a uniform share ``floor`` keeps every ``p_i > 0``) and weight
  it by ``1 / p_i``, so the weighted sum over the sent samples is an unbiased
  estimate of the sum over all of them. About ``fraction * R`` samples are
  sent (fewer where ``p_i`` is capped at 1).

Scores: ``"loss"``, the sample's loss (``ctx.loss_fn`` on one row, vmapped
over the rows: one forward pass of ``R`` rows); ``"grad_norm"``, the global
norm of the sample's own parameter gradient (one vmapped backward pass of
single rows), the bound the threshold rule's bias statement needs.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dadjax._core.linalg import tree_safe_norm

GATE_MODES = ("threshold", "sample")
SCORES = ("loss", "grad_norm")


class GateDecision(NamedTuple):
  """The gate's choice for each row of a batch.

  Attributes:
    mask: bool ``(rows,)``, the rows that are sent.
    prob: fp32 ``(rows,)``, each row's probability of being sent (0 or 1 for
      the threshold rule).
    weight: fp32 ``(rows,)``, the row's weight divided by its probability
      where sent, 0 elsewhere.
  """

  mask: jax.Array
  prob: jax.Array
  weight: jax.Array


def check_gate(gate, gate_mode: str, floor) -> tuple[float | None, str, float]:
  """Validate the gate's hyperparameters (ValueError naming the argument)."""
  if gate_mode not in GATE_MODES:
    raise ValueError(f"gate_mode must be one of {GATE_MODES}, got {gate_mode!r}")
  if isinstance(floor, bool) or not isinstance(floor, numbers.Real) or not 0 <= floor <= 1:
    raise ValueError(f"gate_floor must be a number in [0, 1], got {floor!r}")
  if gate is None:
    return None, gate_mode, float(floor)
  if isinstance(gate, bool) or not isinstance(gate, numbers.Real):
    raise ValueError(f"gate must be None or a number, got {gate!r}")
  if gate_mode == "threshold" and not gate >= 0:
    raise ValueError(f"gate (a score threshold) must be >= 0, got {gate!r}")
  if gate_mode == "sample" and not 0 < gate <= 1:
    raise ValueError(f"gate (the expected fraction of rows sent) must be in (0, 1], got {gate!r}")
  return float(gate), gate_mode, float(floor)


def check_score(score) -> str | Callable:
  if callable(score) or score in SCORES:
    return score
  raise ValueError(f"score must be one of {SCORES} or a callable "
                   f"(ctx, params, batch) -> (rows,), got {score!r}")


def _rows(batch: dict) -> dict:
  """The batch without its weight, for per-row evaluation."""
  return {k: v for k, v in batch.items() if k != "weight"}


def loss_scores(loss_fn: Callable, params: Any, batch: dict) -> jax.Array:
  """Each row's loss: ``loss_fn(params, one-row batch)[0]`` vmapped over rows, ``(rows,)``."""
  one = lambda row: loss_fn(params, jax.tree.map(lambda v: v[None], row))[0]
  return jax.vmap(one)(_rows(batch))


def grad_norm_scores(loss_fn: Callable, params: Any, batch: dict) -> jax.Array:
  """Global norm of each row's own loss gradient, ``(rows,)`` (vmapped backward passes).

  The norm is scale-safe (:func:`~dadjax._core.linalg.tree_safe_norm`): rows whose
  gradients are ``1e30`` or ``1e-30`` get finite, non-zero scores.
  """

  def one(row):
    g = jax.grad(lambda p: loss_fn(p, jax.tree.map(lambda v: v[None], row))[0])(params)
    return tree_safe_norm(g)

  return jax.vmap(one)(_rows(batch))


def threshold_gate(scores: jax.Array, threshold: float, weight: jax.Array) -> GateDecision:
  """Send the rows whose score is at least ``threshold``; they keep ``weight``."""
  mask = scores >= threshold
  prob = mask.astype(jnp.float32)
  return GateDecision(mask, prob, jnp.where(mask, weight, 0.0))


def send_probabilities(scores: jax.Array, fraction: float, floor: float) -> jax.Array:
  """``p_i = min(1, fraction * R * ((1 - floor) * s_i / sum(s) + floor / R))``.

  Negative scores count as 0; when every score is 0 the rows are equally
  likely (``p_i = fraction``).
  """
  s = jnp.maximum(jnp.asarray(scores, jnp.float32), 0.0)
  rows = s.shape[0]
  total = jnp.sum(s)
  share = jnp.where(total > 0, s / jnp.where(total > 0, total, 1.0), 1.0 / rows)
  return jnp.minimum(1.0, fraction * rows * ((1.0 - floor) * share + floor / rows))


def sample_gate(scores: jax.Array, fraction: float, key: jax.Array, weight: jax.Array,
                floor: float = 0.1) -> GateDecision:
  """Send row ``i`` with probability ``p_i`` (:func:`send_probabilities`), weight ``w_i / p_i``.

  Args:
    scores: ``(rows,)`` importance scores.
    fraction: expected fraction of rows sent, in (0, 1].
    key: this site's key for the Bernoulli draws.
    weight: ``(rows,)`` the rows' weights before gating.
    floor: uniform share of the probabilities, in [0, 1].

  Returns:
    A :class:`GateDecision`; ``sum(decision.weight * g_i)`` is unbiased for
    ``sum(weight * g_i)`` whenever every row with ``g_i != 0`` has ``p_i > 0``.
  """
  prob = send_probabilities(scores, fraction, floor)
  mask = jax.random.uniform(key, prob.shape) < prob
  safe = jnp.where(prob > 0, prob, 1.0)
  return GateDecision(mask, prob, jnp.where(mask, weight / safe, 0.0))
