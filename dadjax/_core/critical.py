"""Accordion's critical-regime rule, shared by Accordion (adaptive) and rank-dAD's detector.

A tensor is in a *critical* regime when its gradient norm changed by at
least a fraction ``eta`` since the last check (:func:`is_critical`), or
when the learning rate just decreased (:func:`lr_decreased`).

References:
  Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive
  Gradient Communication via Critical Learning Regime Identification",
  MLSys 2021 (https://arxiv.org/abs/2010.16248).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["is_critical", "lr_decreased"]


def is_critical(old_norm: jax.Array, new_norm: jax.Array, eta: float) -> jax.Array:
  """Accordion's rule: ``|old - new| / old >= eta``; a zero ``old`` is critical.

  Args:
    old_norm: norms of the window ``interval`` windows earlier, any shape.
    new_norm: norms of the window just completed, same shape.
    eta: threshold, > 0 (the paper uses 0.5).

  Returns:
    bool array of the same shape (no NaN: a zero ``old`` never divides).
  """
  old_norm = jnp.asarray(old_norm, jnp.float32)
  new_norm = jnp.asarray(new_norm, jnp.float32)
  zero = old_norm <= 0
  ratio = jnp.abs(old_norm - new_norm) / jnp.where(zero, 1.0, old_norm)
  return zero | (ratio >= eta)


def lr_decreased(lr_schedule, count: jax.Array) -> jax.Array:
  """Whether ``lr_schedule(count) < lr_schedule(count - 1)`` (false at ``count = 0``)."""
  now = jnp.asarray(lr_schedule(count), jnp.float32)
  before = jnp.asarray(lr_schedule(jnp.maximum(count - 1, 0)), jnp.float32)
  return (count > 0) & (now < before)
