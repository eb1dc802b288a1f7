"""The ``"dad_state"`` entry of a dAD layer: its fields and how it is read back.

The backward pass returns the layer's *new* state as the cotangent of its
state input and the train step overwrites the state with that "gradient".
A layer applied K times in one forward pass receives the *sum* of K
cotangents, so the state stores sums together with a ``uses`` count and is
read back as ``sum / uses`` (:func:`current_state`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dadjax.dad._config import DadConfig

STATE_NAME = "dad"


def init_state(config: DadConfig, d_in: int, d_out: int) -> dict[str, jax.Array] | None:
  """The layer's initial ``"dad_state"`` entry (``None`` for ``"local"``).

  Every leaf is float32 (it is differentiated by the train step). Fields:
  ``uses`` and ``step`` always; for ``"rank"``: ``rank`` (local effective
  rank), ``basis`` (d_out, r) with ``warm_start``, ``memory`` (d_in, d_out)
  with ``error_feedback``, and for two-way ``rank_global`` (+
  ``basis_global`` with ``warm_start``). Values are sums over the uses of
  the last step; read them with :func:`current_state`.
  """
  if config.mode == "local":
    return None
  zero = jnp.zeros((), jnp.float32)
  state = {"uses": zero, "step": zero}
  if config.mode == "rank":
    state["rank"] = zero
    if config.warm_start:
      state["basis"] = jnp.zeros((d_out, config.rank), jnp.float32)
    if config.error_feedback:
      state["memory"] = jnp.zeros((d_in, d_out), jnp.float32)
    if config.aggregation == "two_way":
      state["rank_global"] = zero
      if config.warm_start:
        state["basis_global"] = jnp.zeros((d_out, config.rank), jnp.float32)
  return state


def current_state(state: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """A stored state divided by its ``uses`` (zeros before the first step)."""
  uses = state["uses"]
  live = uses > 0
  safe = jnp.where(live, uses, 1.0)
  out = {k: jnp.where(live, v / safe, jnp.zeros_like(v)) for k, v in state.items()}
  out["step"] = jnp.round(out["step"])
  out["uses"] = jnp.ones_like(uses)
  return out
