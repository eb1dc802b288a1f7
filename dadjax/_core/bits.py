"""Exact 64-bit bit counts without enabling JAX's 64-bit mode.

JAX disables 64-bit types by default, and int32 overflows after one fp32
step of a 100M-parameter model (3.2e9 bits). A bit count is therefore held
as two uint32 words, ``hi * 2**32 + lo``, added with an explicit carry. That
covers 1.8e19 bits: 10^10 parameters x 32 bits x 10^6 steps = 3.2e17 fits
with room to spare.

Sizes known at trace time are Python ints and enter through
:func:`bits_const`; data-dependent sizes (a traced count of items times a
static number of bits per item) enter through :func:`bits_from_count`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "MAX_BITS", "Bits", "bits_const", "bits_zero", "bits_add", "bits_sum", "bits_from_count",
    "host_array", "bits_to_int", "bits_reduce", "tree_bits", "as_bits"
]

_WORD = 1 << 32
_HALF = 1 << 16
MAX_BITS = (1 << 64) - 1


class Bits(NamedTuple):
  """An exact non-negative bit count: ``hi * 2**32 + lo`` (uint32 scalars)."""

  hi: jax.Array
  lo: jax.Array


def bits_const(n: int) -> Bits:
  """A count known at trace time (a Python int in ``[0, 2**64)``)."""
  n = int(n)
  if not 0 <= n <= MAX_BITS:
    raise ValueError(f"bit count must be in [0, 2**64), got {n}")
  return Bits(jnp.uint32(n >> 32), jnp.uint32(n & (_WORD - 1)))


def bits_zero() -> Bits:
  return bits_const(0)


def bits_add(a: Bits, b: Bits) -> Bits:
  """Exact sum; the carry out of ``lo`` moves into ``hi``."""
  lo = a.lo + b.lo  # uint32 arithmetic wraps modulo 2**32
  carry = (lo < a.lo).astype(jnp.uint32)
  return Bits(a.hi + b.hi + carry, lo)


def bits_sum(terms) -> Bits:
  """Exact sum of an iterable of :class:`Bits`."""
  total = bits_zero()
  for t in terms:
    total = bits_add(total, t)
  return total


def bits_from_count(count: jax.Array, bits_per_item: int) -> Bits:
  """Exact ``count * bits_per_item`` for a traced ``count`` in ``[0, 2**32)``.

  The product can exceed 2**32, so both factors are split into 16-bit limbs
  and the four partial products (each < 2**32) are added with carries.
  """
  if not 0 <= bits_per_item < _WORD:
    raise ValueError(f"bits_per_item must be in [0, 2**32), got {bits_per_item}")
  count = jnp.asarray(count).astype(jnp.uint32)
  c_lo, c_hi = count & (_HALF - 1), count >> 16
  b_lo, b_hi = jnp.uint32(bits_per_item & (_HALF - 1)), jnp.uint32(bits_per_item >> 16)
  low = Bits(jnp.uint32(0), c_lo * b_lo)
  # cross terms contribute x * 2**16: split each into the part that stays in
  # lo and the part that overflows into hi.
  cross = [c_lo * b_hi, c_hi * b_lo]
  total = low
  for x in cross:
    total = bits_add(total, Bits(x >> 16, (x & (_HALF - 1)) << 16))
  return bits_add(total, Bits(c_hi * b_hi, jnp.uint32(0)))


def host_array(x) -> np.ndarray:
  """A numpy copy of ``x``; for a multi-host array, of this process's part.

  This process's part is the smallest box holding its addressable shards
  (e.g. its sites' rows of a site-stacked array, with every in-site slice
  put back in place when parameters are sharded within a site).
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    shards = x.addressable_shards
    if not x.ndim:
      return np.asarray(shards[0].data)
    bounds = [[(s.index[d].start or 0, x.shape[d] if s.index[d].stop is None else s.index[d].stop)
               for s in shards] for d in range(x.ndim)]
    low = [min(a for a, _ in dim) for dim in bounds]
    out = np.empty([max(b for _, b in dim) - lo for dim, lo in zip(bounds, low)], x.dtype)
    for i, s in enumerate(shards):
      out[tuple(slice(bounds[d][i][0] - low[d], bounds[d][i][1] - low[d])
                for d in range(x.ndim))] = np.asarray(s.data)
    return out
  return np.asarray(jax.device_get(x))


def bits_to_int(b: Bits) -> int | list[int]:
  """Host-side exact value: a Python int, or a list of ints when stacked per site."""
  hi = host_array(b.hi).astype(np.uint64)
  lo = host_array(b.lo).astype(np.uint64)
  if hi.ndim:  # stacked per site: every site reports its own count
    return [int(h) * _WORD + int(l) for h, l in zip(hi.ravel(), lo.ravel())]
  return int(hi) * _WORD + int(lo)


def bits_reduce(b: Bits) -> Bits:
  """Exact sum over every element of an array-valued :class:`Bits`.

  Used for counts stacked along an axis (e.g. one per scanned time step).
  ``lo`` is split into 16-bit halves whose sums cannot overflow uint32 for
  fewer than 65537 elements.
  """
  hi, lo = jnp.asarray(b.hi, jnp.uint32), jnp.asarray(b.lo, jnp.uint32)
  if lo.size >= _HALF:
    raise ValueError(f"bits_reduce sums at most {_HALF - 1} counts, got {lo.size}")
  low = jnp.sum(lo & (_HALF - 1), dtype=jnp.uint32)
  high = jnp.sum(lo >> 16, dtype=jnp.uint32)
  total = Bits(jnp.sum(hi, dtype=jnp.uint32), low)
  return bits_add(total, Bits(high >> 16, (high & (_HALF - 1)) << 16))


def tree_bits(tree) -> Bits:
  """Exact sum of every :class:`Bits` found in ``tree`` (e.g. a sown collection)."""
  found = [x for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Bits))
           if isinstance(x, Bits)]
  return bits_sum(bits_reduce(x) for x in found)


def as_bits(x: "Bits | int") -> Bits:
  """``x`` as :class:`Bits` (a Python int enters through :func:`bits_const`)."""
  return x if isinstance(x, Bits) else bits_const(int(x))
