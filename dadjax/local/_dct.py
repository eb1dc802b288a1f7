"""Chunked orthonormal DCT-II: a tensor cut into ``a x b`` blocks (1-D chunks for vectors).

DeMo extracts the fast-moving components of its momentum in the frequency
domain of small blocks, and SparseLoCo selects its top-k per block. Both
see a tensor as rows of chunks:

* a matrix ``(R, C)`` is cut into ``(R / a) x (C / b)`` blocks of ``a x b``
  entries, where ``a`` is the largest divisor of ``R`` that is at most the
  target side ``s`` (and ``b`` the same for ``C``), DeMo's rule; each block
  is one row of ``a * b`` entries;
* a vector of ``n`` entries is cut into chunks of ``c`` entries (the largest
  divisor of ``n`` at most ``s``); a scalar is one chunk of one entry;
* a tensor of more dimensions is seen as the matrix
  ``(prod(shape[:-1]), shape[-1])`` (a convolution kernel: its input
  positions by its output channels).

With ``dct=True`` each block is replaced by its orthonormal 2-D DCT-II
coefficients (``D_a @ block @ D_b.T``, 1-D chunks: ``D_c @ chunk``) through
precomputed basis matrices; the inverse is the transpose, so a round trip
is the identity to float rounding.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def largest_divisor(n: int, target: int) -> int:
  """The largest divisor of ``n`` that is at most ``target`` (at least 1)."""
  best = 1
  for d in range(1, min(n, target) + 1):
    if n % d == 0:
      best = d
  return best


@functools.lru_cache(maxsize=None)
def dct_matrix(n: int) -> np.ndarray:
  """The orthonormal DCT-II basis ``D`` of size ``n`` (float64): ``X = D @ x``, ``x = D.T @ X``.

  ``D[k, j] = sqrt(2 / n) * cos(pi * (2 j + 1) * k / (2 n))``, with row 0
  scaled by ``1 / sqrt(2)`` (scipy's ``dct(type=2, norm="ortho")``).
  """
  k = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  d = np.sqrt(2.0 / n) * np.cos(np.pi * (2 * j + 1) * k / (2 * n))
  d[0] /= np.sqrt(2.0)
  return d


class ChunkLayout(NamedTuple):
  """How a tensor of ``shape`` is cut into chunks.

  Attributes:
    shape: the tensor's shape.
    rows: rows of the matrix the tensor is seen as (1 for vectors).
    cols: its columns (the vector's length for vectors).
    a: block height (1 for vectors).
    b: block width (the chunk length for vectors).
  """

  shape: tuple[int, ...]
  rows: int
  cols: int
  a: int
  b: int

  @property
  def chunks(self) -> int:
    """Number of chunks."""
    return (self.rows // self.a) * (self.cols // self.b)

  @property
  def grid(self) -> tuple[int, ...]:
    """The chunks' grid: ``(rows // a, cols // b)`` block rows and columns of a matrix,
    ``(cols // b,)`` for a vector (its product is :attr:`chunks`)."""
    if self.matrix:
      return (self.rows // self.a, self.cols // self.b)
    return (self.cols // self.b,)

  @property
  def size(self) -> int:
    """Entries per chunk."""
    return self.a * self.b

  @property
  def matrix(self) -> bool:
    return len(self.shape) >= 2


def chunk_layout(shape: tuple[int, ...], side: int) -> ChunkLayout:
  """The :class:`ChunkLayout` of a tensor of ``shape`` with target block side ``side``.

  Raises:
    ValueError: if ``side`` is not an int >= 1.
  """
  if isinstance(side, bool) or not isinstance(side, int) or side < 1:
    raise ValueError(f"chunk side must be an int >= 1, got {side!r}")
  shape = tuple(int(s) for s in shape)
  if len(shape) >= 2:
    rows, cols = math.prod(shape[:-1]), shape[-1]
    return ChunkLayout(shape, rows, cols, largest_divisor(rows, side),
                       largest_divisor(cols, side))
  n = math.prod(shape)
  return ChunkLayout(shape, 1, n, 1, largest_divisor(n, side))


def to_chunks(x: jax.Array, layout: ChunkLayout, dct: bool = False,
              grid: bool = False) -> jax.Array:
  """``x`` as ``(chunks, size)`` rows (DCT coefficients when ``dct``), in fp32 or wider.

  ``grid=True``: as ``layout.grid + (size,)`` instead, the block rows and columns kept
  apart: a tensor split over devices along either axis stays split the same way (merging
  the two axes would make the SPMD partitioner gather a column-split tensor whole).
  """
  x = jnp.asarray(x)
  x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
  a, b = layout.a, layout.b
  if layout.matrix:
    blocks = x.reshape(layout.rows // a, a, layout.cols // b, b).transpose(0, 2, 1, 3)
    if dct:
      da, db = (jnp.asarray(dct_matrix(n), x.dtype) for n in (a, b))
      blocks = jnp.einsum("ij,yxjl,kl->yxik", da, blocks, db)
    return blocks.reshape(layout.grid + (a * b,) if grid else (-1, a * b))
  chunks = x.reshape(-1, b)
  if dct:
    chunks = chunks @ jnp.asarray(dct_matrix(b), x.dtype).T
  return chunks


def from_chunks(chunks: jax.Array, layout: ChunkLayout, dct: bool = False) -> jax.Array:
  """The tensor of ``layout.shape`` whose :func:`to_chunks` is ``chunks`` (the inverse; either
  form, ``(chunks, size)`` or ``layout.grid + (size,)``)."""
  a, b = layout.a, layout.b
  if layout.matrix:
    blocks = chunks.reshape(layout.rows // a, layout.cols // b, a, b)
    if dct:
      da, db = (jnp.asarray(dct_matrix(n), chunks.dtype) for n in (a, b))
      blocks = jnp.einsum("ji,yxjl,lk->yxik", da, blocks, db)
    return blocks.transpose(0, 2, 1, 3).reshape(layout.shape)
  if dct:
    chunks = chunks @ jnp.asarray(dct_matrix(b), chunks.dtype)
  return chunks.reshape(layout.shape)
