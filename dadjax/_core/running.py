"""A running count of a boolean mask, computed as small triangular matmuls.

``jnp.cumsum`` lowers to a reduce-window over the whole axis, and the TPU
compiler spends seconds on each one of a sharded kernel's size (TopK's slot
assignment had two per leaf: about 2.8 s of EF-TopK's 5.2 s step compile
against the all-reduce step's 1.0 s; docs/placement.md). A running count is a product
with an upper-triangular matrix of ones, so it is computed blockwise: each
block of ``block`` entries is one ``(rows, block) @ (block, block)`` product
on the MXU, and the blocks' totals are counted the same way, recursively.
Every product is exact: 0/1 entries and totals of at most 256 are exact in
bfloat16, larger totals go through a float32 product at ``HIGHEST``
precision, and every partial count stays below ``2**24``, where float32
holds integers exactly. Longer masks fall back to ``jnp.cumsum``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["running_count"]

_EXACT_BELOW = 2**24  # float32 holds every integer below this
_BFLOAT16_EXACT = 256  # ... and bfloat16 every integer up to this


def running_count(mask: jax.Array, block: int = 128) -> jax.Array:
  """``jnp.cumsum(mask, dtype=int32)`` of a 1-D boolean ``mask``, as triangular matmuls.

  Args:
    mask: ``bool[n]``.
    block: entries per triangular product (default 128, one MXU tile), at least 2.

  Returns:
    ``int32[n]``: entry ``i`` counts the true entries of ``mask[: i + 1]``.
  """
  if mask.ndim != 1:
    raise ValueError(f"running_count: mask must be 1-D, got shape {mask.shape}")
  if block < 2:
    raise ValueError(f"running_count: block must be at least 2, got {block}")
  if mask.shape[0] >= _EXACT_BELOW:
    return jnp.cumsum(mask, dtype=jnp.int32)
  return _running_sum(mask.astype(jnp.bfloat16), 1, block).astype(jnp.int32)


def _running_sum(x: jax.Array, largest: int, block: int) -> jax.Array:
  """The inclusive running sum of ``x`` (integers of at most ``largest``), in float32."""
  n = x.shape[0]
  width = min(n, block)
  rows = jnp.pad(x, (0, -n % width)).reshape(-1, width)
  upper = jnp.triu(jnp.ones((width, width), x.dtype))
  precision = jax.lax.Precision.HIGHEST if x.dtype == jnp.float32 else None
  within = jnp.dot(rows, upper, precision=precision, preferred_element_type=jnp.float32)
  if rows.shape[0] == 1:
    return within[0, :n]
  totals = within[:, -1]
  largest *= width
  narrow = totals.astype(jnp.bfloat16) if largest <= _BFLOAT16_EXACT else totals
  before = _running_sum(narrow, largest, block) - totals
  return (within + before[:, None]).reshape(-1)[:n]
