"""Bit packing: small unsigned codes in uint32 words, so the wire is exact.

Codes of ``bits`` bits each (1 <= bits <= 32) are packed densely: every
group of 32 consecutive codes occupies exactly ``bits`` uint32 words (code
``j`` of a group starts at bit ``j * bits`` of the group, little-endian,
and may straddle two words). A vector of ``n`` codes therefore takes
``ceil(n / 32) * bits`` words, at most ``bits - 1`` words more than the
information-theoretic ``ceil(n * bits / 32)``. The word layout is a static
function of ``bits``, so packing is a few shifts, a static gather and a sum
(the shifted pieces never overlap, so the sum is a bitwise or).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["WORD_BITS", "code_bits", "packed_words", "pack_bits", "unpack_bits", "pack_rows",
           "unpack_rows", "leaf_rows", "pack_leaf", "unpack_leaf"]

WORD_BITS = 32


def code_bits(num_values: int) -> int:
  """Bits needed for codes ``0`` to ``num_values - 1``: ``ceil(log2(num_values))``, at least 1."""
  return max(1, (num_values - 1).bit_length())


def packed_words(n: int, bits: int) -> int:
  """uint32 words that :func:`pack_bits` uses for ``n`` codes of ``bits`` bits."""
  _check_bits(bits)
  return -(-n // WORD_BITS) * bits


def _check_bits(bits: int) -> None:
  if not (isinstance(bits, int) and 1 <= bits <= WORD_BITS):
    raise ValueError(f"bits must be an int in [1, {WORD_BITS}], got {bits!r}")


@functools.lru_cache(maxsize=None)
def _layout(bits: int):
  """Static layout of one group of 32 codes over ``bits`` words."""
  j = np.arange(WORD_BITS)
  offset = j * bits
  word = offset // WORD_BITS
  shift = (offset % WORD_BITS).astype(np.uint32)
  spill = (shift + bits) > WORD_BITS  # the code's high part lands in word + 1
  # Shift amounts are kept in [0, 32) so no shift is undefined; pieces that
  # do not exist are masked out instead.
  high_shift = np.where(spill, WORD_BITS - shift, 0).astype(np.uint32)
  # contributors[w] = column indices into concat([low, high, zero]) (65 cols)
  contributors = [[int(i) for i in np.flatnonzero(word == w)]
                  + [WORD_BITS + int(i) for i in np.flatnonzero(spill & (word + 1 == w))]
                  for w in range(bits)]
  width = max(len(c) for c in contributors)
  table = np.full((bits, width), 2 * WORD_BITS, np.int32)
  for w, c in enumerate(contributors):
    table[w, :len(c)] = c
  next_word = np.minimum(word + 1, bits - 1)
  return word, shift, spill, high_shift, table, next_word


def _mask(bits: int) -> np.uint32:
  return np.uint32((1 << bits) - 1)


def pack_bits(codes: jax.Array, bits: int) -> jax.Array:
  """Pack a vector of codes ``< 2**bits`` into uint32 words.

  Args:
    codes: 1-D integer array, every value in ``[0, 2**bits)``.
    bits: bits per code, in ``[1, 32]``.

  Returns:
    uint32 array of shape ``(packed_words(codes.size, bits),)``.
  """
  _check_bits(bits)
  codes = jnp.ravel(codes).astype(jnp.uint32)
  n = codes.shape[0]
  groups = -(-n // WORD_BITS)
  codes = jnp.pad(codes, (0, groups * WORD_BITS - n)).reshape(groups, WORD_BITS)
  if WORD_BITS % bits == 0:  # no code straddles a word: a reshape suffices
    per_word = WORD_BITS // bits
    shifts = (np.arange(per_word) * bits).astype(np.uint32)
    words = jnp.sum(codes.reshape(groups * bits, per_word) << shifts, axis=-1, dtype=jnp.uint32)
    return words
  _, shift, spill, high_shift, table, _ = _layout(bits)
  low = codes << shift
  high = jnp.where(spill, codes >> high_shift, jnp.uint32(0))
  pieces = jnp.concatenate([low, high, jnp.zeros((groups, 1), jnp.uint32)], axis=1)
  words = jnp.sum(pieces[:, table], axis=-1, dtype=jnp.uint32)  # (groups, bits)
  return words.reshape(groups * bits)


def unpack_bits(words: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_bits`: the first ``n`` codes, as uint32.

  Args:
    words: the packed uint32 words.
    bits: bits per code, as used for packing.
    n: number of codes to return.

  Returns:
    uint32 array of shape ``(n,)``.
  """
  _check_bits(bits)
  groups = -(-n // WORD_BITS)
  if words.shape != (groups * bits,):
    raise ValueError(f"unpack_bits: expected {groups * bits} words for {n} codes "
                     f"of {bits} bits, got shape {words.shape}")
  mask = _mask(bits)
  if WORD_BITS % bits == 0:
    per_word = WORD_BITS // bits
    shifts = (np.arange(per_word) * bits).astype(np.uint32)
    codes = (words[:, None] >> shifts) & mask
    return codes.reshape(-1)[:n]
  word, shift, spill, high_shift, _, next_word = _layout(bits)
  w = words.reshape(groups, bits)
  low = w[:, word] >> shift
  high = jnp.where(spill, w[:, next_word] << high_shift, jnp.uint32(0))
  return ((low | high) & mask).reshape(-1)[:n]


def _planes(bits: int) -> list[tuple[int, int]]:
  """``(offset, width)`` of the power-of-two bit planes of a ``bits``-bit code (low bits first)."""
  planes, offset = [], 0
  for i in range(bits.bit_length()):
    if bits >> i & 1:
      planes.append((offset, 1 << i))
      offset += 1 << i
  return planes


def _pack_divisor(codes: jax.Array, bits: int) -> jax.Array:
  """Codes ``(..., groups, 32)`` of ``bits`` dividing 32: ``(..., groups, bits)`` words."""
  per_word = WORD_BITS // bits
  shifts = (np.arange(per_word) * bits).astype(np.uint32)
  lead = codes.shape[:-1]
  return jnp.sum(codes.reshape(*lead, bits, per_word) << shifts, axis=-1, dtype=jnp.uint32)


def _unpack_divisor(words: jax.Array, bits: int) -> jax.Array:
  """Inverse of :func:`_pack_divisor`: ``(..., groups, bits)`` words -> ``(..., groups, 32)``."""
  per_word = WORD_BITS // bits
  shifts = (np.arange(per_word) * bits).astype(np.uint32)
  codes = (words[..., None] >> shifts) & _mask(bits)
  return codes.reshape(*words.shape[:-1], WORD_BITS)


def pack_rows(codes: jax.Array, bits: int) -> jax.Array:
  """Pack codes along the last axis only: ``(..., m)`` -> ``uint32 (..., packed_words(m, bits))``.

  Every row (a position of the leading axes) is packed on its own, so a leaf
  keeps its leading dimensions, and a sharding over any axis survives the
  packing: each group of 32 codes becomes ``bits`` words in place, by
  shifts and sums only (no flatten, gather or concatenation across
  groups), which GSPMD partitions without moving data. Where ``bits``
  divides 32 the words are :func:`pack_bits`'s of each row. Otherwise a
  code is split into power-of-two bit planes (6 bits: its low 2 bits, then
  its high 4), each packed as above into the group's words: the same
  ``ceil(m / 32) * bits`` words per row as :func:`pack_bits`, in another
  order. A 0-D ``codes`` is one row of one code.
  """
  _check_bits(bits)
  codes = jnp.asarray(codes).astype(jnp.uint32)
  *lead, m = codes.shape if codes.ndim else (1,)
  codes = codes.reshape(*lead, m)
  groups = -(-m // WORD_BITS)
  pad = [(0, 0)] * len(lead) + [(0, groups * WORD_BITS - m)]
  codes = jnp.pad(codes, pad).reshape(*lead, groups, WORD_BITS)
  planes = [_pack_divisor((codes >> offset) & _mask(width), width)
            for offset, width in _planes(bits)]
  words = planes[0] if len(planes) == 1 else jnp.concatenate(planes, axis=-1)
  return words.reshape(*lead, groups * bits)


def unpack_rows(words: jax.Array, bits: int, m: int) -> jax.Array:
  """Inverse of :func:`pack_rows`: ``uint32 (..., packed_words(m, bits))`` -> codes ``(..., m)``."""
  _check_bits(bits)
  groups = -(-m // WORD_BITS)
  *lead, w = words.shape
  if w != groups * bits:
    raise ValueError(f"unpack_rows: expected {groups * bits} words per row for {m} codes of "
                     f"{bits} bits, got {w}")
  words = words.reshape(*lead, groups, bits)
  codes, start = None, 0
  for offset, width in _planes(bits):
    part = _unpack_divisor(words[..., start:start + width], width) << offset
    codes = part if codes is None else codes | part
    start += width
  return codes.reshape(*lead, groups * WORD_BITS)[..., :m]


def leaf_rows(shape: tuple[int, ...]) -> tuple[tuple[int, ...], int]:
  """``(row shape, codes per row)`` a leaf of ``shape`` is packed in by :func:`pack_leaf`.

  Along the last axis when it holds whole groups of 32 codes (rows: the
  other axes), else as one flat row: either way exactly
  ``packed_words(leaf size, bits)`` words, in a shape that keeps the leaf's
  leading axes (and a sharding over any of its axes) when it can.
  """
  if len(shape) >= 2 and shape[-1] % WORD_BITS == 0:
    return tuple(shape[:-1]), int(shape[-1])
  return (), int(np.prod(shape, dtype=np.int64))


def pack_leaf(codes: jax.Array, bits: int) -> jax.Array:
  """Codes of a leaf's shape (after any leading batch axes ``batch``) packed per
  :func:`leaf_rows`: ``uint32 batch + rows + (words,)``. Give ``codes`` without batch axes
  unless :func:`unpack_leaf` gets the same ``shape``."""
  rows, m = leaf_rows(np.shape(codes))
  return pack_rows(jnp.reshape(codes, rows + (m,)), bits)


def unpack_leaf(words: jax.Array, bits: int, shape: tuple[int, ...]) -> jax.Array:
  """Inverse of :func:`pack_leaf` for a leaf of ``shape``; leading axes of ``words`` beyond
  the leaf's rows (gathered sites) are kept: codes ``batch + shape``."""
  rows, m = leaf_rows(tuple(shape))
  batch = words.shape[:words.ndim - len(rows) - 1]
  return unpack_rows(words, bits, m).reshape(batch + tuple(shape))
