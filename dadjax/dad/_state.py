"""The ``"dad_state"`` entry of a dAD layer: its fields, how it advances and how it is read back.

The backward pass returns the layer's *new* float fields as the cotangent of
its state input. A layer applied K times in one forward pass receives the
*sum* of K cotangents, so the float fields store sums together with a
``uses`` count and are read back as ``sum / uses`` (:func:`current_state`).

The step counter ``step`` is an int32 that the backward pass only reads (the
shared random key, quantization noise, Accordion's schedule): an integer
input has no cotangent (its cotangent is ``float0``), so whoever owns the
state advances it. :func:`next_state` takes the old collection and the
cotangent of one step and returns the new collection: float fields from the
cotangent, ``step + 1``, for every layer that ran (``uses > 0``); the old
state, untouched, for every layer that got no cotangent. The train step
(:mod:`dadjax.parallel`) does exactly this; code that differentiates the
``"dad_state"`` collection itself does the same::

    grads, cts = jax.grad(loss, argnums=(0, 1), allow_int=True)(params, dad_state)
    dad_state = dadjax.dad.next_state(dad_state, cts)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from dadjax.dad._config import DadConfig

STATE_NAME = "dad"
# Extra fields of a layer under Accordion (``rank_low``).
ACCORDION_FIELDS = ("critical", "win_norm", "win_steps", "windows", "ref_norm", "norm", "rank_used")


def init_state(config: DadConfig, d_in: int, d_out: int) -> dict[str, jax.Array] | None:
  """The layer's initial ``"dad_state"`` entry (``None`` for ``"local"``).

  ``step`` is an int32 scalar (the number of steps the layer has run,
  advanced by :func:`next_state`); every other leaf is float32 (the
  backward pass returns it as a cotangent). Fields: ``uses`` and ``step``
  always; for ``"rank"``: ``rank`` (local effective rank), ``basis``
  (d_out, r) with ``warm_start``, ``memory`` (d_in, d_out) with
  ``error_feedback``, and for two-way ``rank_global`` (+ ``basis_global``
  with ``warm_start``). Float values are sums over the uses of the last
  step; read them with :func:`current_state`.
  """
  if config.mode == "local":
    return None
  zero = jnp.zeros((), jnp.float32)
  state = {"uses": zero, "step": jnp.zeros((), jnp.int32)}
  if config.mode == "rank":
    state["rank"] = zero
    if config.warm_start:
      state["basis"] = jnp.zeros((d_out, config.rank), jnp.float32)
    if config.error_feedback:
      state["memory"] = jnp.zeros((d_in, d_out), jnp.float32)
    if config.rank_low is not None:  # Accordion's detector (dadjax.dad._rank_accordion)
      state.update({k: zero for k in ACCORDION_FIELDS})
      state["critical"] = jnp.ones((), jnp.float32)
    if config.aggregation == "two_way":
      state["rank_global"] = zero
      if config.warm_start:
        state["basis_global"] = jnp.zeros((d_out, config.rank), jnp.float32)
  return state


def _is_float(v) -> bool:
  return jnp.issubdtype(jnp.result_type(v), jnp.inexact)


def current_state(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A stored state's float fields divided by its ``uses`` (zeros before the first step).

  Integer fields (``step``) are returned as they are; ``uses`` becomes 1.
  """
  uses = state["uses"]
  live = uses > 0
  safe = jnp.where(live, uses, 1.0)
  out = {k: jnp.where(live, v / safe, jnp.zeros_like(v)) if _is_float(v) else v
         for k, v in state.items()}
  out["uses"] = jnp.ones_like(uses)
  return out


def _bcast(mask, like):
  return jnp.reshape(mask, jnp.shape(mask) + (1,) * (jnp.ndim(like) - jnp.ndim(mask)))


def _no_cotangent(ct) -> bool:
  return ct is None or getattr(ct, "dtype", None) == jax.dtypes.float0


def next_state(old: Any, cotangent: Any) -> Any:
  """The ``"dad_state"`` collection after a step, from the old one and its cotangent.

  A layer state is a mapping with a ``"uses"`` entry. Where its cotangent
  has ``uses > 0`` (the layer was on the path of the loss) the new state
  takes the cotangent's float fields and ``step = old step + 1``; where
  ``uses == 0`` (an unused head, a branch not taken) the whole layer state
  keeps its old value. ``uses`` may carry leading axes (layers stacked by
  ``nn.scan``, sites stacked by ``vmap``); the choice is made per entry of
  those axes. Integer leaves never take a cotangent (theirs is ``float0``,
  or ``None`` where they were not differentiated): outside a layer state
  they keep their old value.

  Args:
    old: the collection the step started from (e.g. ``variables["dad_state"]``).
    cotangent: its cotangent, e.g. from ``jax.grad(..., allow_int=True)``
      (integer leaves ``float0`` or ``None``), same structure.

  Returns:
    The new collection, with the structure and dtypes of ``old``.
  """
  if isinstance(old, Mapping):
    if "uses" in old and not isinstance(old["uses"], Mapping):
      ct = cotangent if cotangent is not None else {}
      ct_uses = ct.get("uses")
      if _no_cotangent(ct_uses):  # nothing reached this layer
        return dict(old)
      ran = ct_uses > 0
      out = {}
      for k, v in old.items():
        if k == "step":
          new = v + jnp.ones((), jnp.result_type(v))
        elif _no_cotangent(ct.get(k)) or not _is_float(v):
          new = v
        else:
          new = ct[k].astype(jnp.result_type(v))
        out[k] = jnp.where(_bcast(ran, v), new, v)
      return out
    return {k: next_state(v, None if cotangent is None else cotangent.get(k))
            for k, v in old.items()}
  if _no_cotangent(cotangent) or not _is_float(old):
    return old
  return cotangent
