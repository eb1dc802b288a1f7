"""Per-coordinate stochastic uniform quantization of data rows.

A row ``x`` of ``D`` features is mapped onto ``L = 2**bits`` evenly spaced
levels ``offset + c * step`` (``c`` in ``0 .. L - 1``) that span the range of
its scale group:

* ``scale="sample"``: one ``(offset, step)`` pair per row, ``offset =
  min(x)``, ``step = (max(x) - min(x)) / (L - 1)``; the pair travels with the
  row (2 x fp32 = 64 bits per row).
* ``scale="feature"``: one pair per feature, from the minimum and maximum of
  that feature over the rows given (the site's batch); the ``2 * D`` fp32
  numbers travel once per batch.

The range is the group's exact ``[min, max]`` (an affine, offset quantizer:
no clipping, so every coordinate lies between two levels). Each coordinate
is rounded to the level below or above with the probabilities that make it
unbiased: ``c = floor(t + u)`` with ``t = (x - offset) / step`` and ``u ~
U[0, 1)``, so ``E[offset + c * step] = x`` and the variance of a coordinate
is at most ``step**2 / 4``. A constant group (``max == min``) is sent
exactly. The codes of each row are packed into uint32 words
(:func:`dadjax._core.packing.pack_bits`), so a row costs exactly
``32 * packed_words(D, bits)`` bits (plus its 64-bit scale pair for
``scale="sample"``).
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dadjax._core.packing import pack_bits, packed_words, unpack_bits

__all__ = [
    "SCALES", "MAX_BITS", "SCALE_BITS", "UniformPayload", "check_bits", "check_scale",
    "uniform_row_bits", "uniform_header_bits", "quantize_uniform", "dequantize_uniform"
]

SCALES = ("sample", "feature")
MAX_BITS = 8
SCALE_BITS = 2 * 32  # fp32 offset and step of one scale group


class UniformPayload(NamedTuple):
  """Quantized rows: packed codes and the fp32 scale pairs.

  Attributes:
    words: uint32 ``(rows, packed_words(D, bits))``, each row packed separately.
    offset: fp32 ``(rows,)`` for ``scale="sample"``, ``(D,)`` for ``"feature"``.
    step: fp32, same shape as ``offset``.
  """

  words: jax.Array
  offset: jax.Array
  step: jax.Array


def check_bits(bits) -> int:
  """``bits`` as an int in ``[1, 8]``, else a ValueError naming it."""
  if isinstance(bits, bool) or not isinstance(bits, numbers.Integral) or not 1 <= bits <= MAX_BITS:
    raise ValueError(f"bits must be an int in [1, {MAX_BITS}] (or None for no quantization), "
                     f"got {bits!r}")
  return int(bits)


def check_scale(scale) -> str:
  if scale not in SCALES:
    raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
  return scale


def uniform_row_bits(dim: int, bits: int, scale: str = "sample") -> int:
  """Exact wire bits of one quantized row of ``dim`` features (its scale pair included).

  ``32 * packed_words(dim, bits)`` for the codes, plus 64 for
  ``scale="sample"``. The per-feature scales are a batch header, see
  :func:`uniform_header_bits`.
  """
  check_scale(scale)
  return 32 * packed_words(dim, check_bits(bits)) + (SCALE_BITS if scale == "sample" else 0)


def uniform_header_bits(dim: int, scale: str = "sample") -> int:
  """Bits sent once per batch: ``64 * dim`` for ``scale="feature"``, else 0."""
  return SCALE_BITS * dim if check_scale(scale) == "feature" else 0


def quantize_uniform(x: jax.Array, bits: int, key: jax.Array,
                     scale: str = "sample") -> UniformPayload:
  """Stochastically round every coordinate of ``x`` onto ``2**bits`` levels.

  Args:
    x: float ``(rows, D)``.
    bits: bits per coordinate, in ``[1, 8]``.
    key: PRNG key of the rounding noise.
    scale: ``"sample"`` (one range per row) or ``"feature"`` (one range per
      feature over the rows); see the module docstring.

  Returns:
    A :class:`UniformPayload`; :func:`dequantize_uniform` gives an unbiased
    estimate of ``x``.

  References:
    Hanna et al., "Quantizing data for distributed learning"
    (https://arxiv.org/abs/2012.07913); Alistarh et al., "QSGD"
    (https://arxiv.org/abs/1610.02132) for unbiased stochastic rounding.
  """
  bits, scale = check_bits(bits), check_scale(scale)
  x = jnp.asarray(x, jnp.float32)
  if x.ndim != 2:
    raise ValueError(f"quantize_uniform: x must be (rows, D), got shape {x.shape}")
  top = (1 << bits) - 1
  axis = 1 if scale == "sample" else 0
  lo, hi = jnp.min(x, axis=axis), jnp.max(x, axis=axis)
  step = (hi - lo) / top
  safe = jnp.where(step > 0, step, 1.0)
  expand = (lambda v: v[:, None]) if scale == "sample" else (lambda v: v[None, :])
  t = jnp.clip((x - expand(lo)) / expand(safe), 0.0, float(top))
  u = jax.random.uniform(key, x.shape)
  codes = jnp.clip(jnp.floor(t + u), 0, top).astype(jnp.uint32)
  codes = jnp.where(expand(step) > 0, codes, jnp.uint32(0))
  words = jax.vmap(lambda c: pack_bits(c, bits))(codes)
  return UniformPayload(words, lo, step)


def dequantize_uniform(payload: UniformPayload, bits: int, dim: int,
                       scale: str = "sample") -> jax.Array:
  """The rows a :class:`UniformPayload` encodes.

  Args:
    payload: from :func:`quantize_uniform`.
    bits: bits per coordinate it was quantized with.
    dim: ``D``, features per row.
    scale: the scale kind it was quantized with.

  Returns:
    fp32 ``(rows, dim)``: ``offset + code * step`` per coordinate.
  """
  bits, scale = check_bits(bits), check_scale(scale)
  codes = jax.vmap(lambda w: unpack_bits(w, bits, dim))(payload.words).astype(jnp.float32)
  if scale == "sample":
    return payload.offset[:, None] + codes * payload.step[:, None]
  return payload.offset[None, :] + codes * payload.step[None, :]
