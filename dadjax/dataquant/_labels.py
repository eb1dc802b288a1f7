"""Labels on the wire: packed class indices, or the raw array.

With ``num_classes`` known, the ``rows`` labels of a batch travel as one
vector of ``code_bits(num_classes)``-bit codes packed into uint32 words
(``32 * packed_words(rows, code_bits(num_classes))`` bits); otherwise they
travel as they are (``rows * itemsize * 8`` bits, 32 per int32 label).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dadjax._core.packing import code_bits, pack_bits, packed_words, unpack_bits


def check_num_classes(num_classes) -> int | None:
  if num_classes is None:
    return None
  if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
    raise ValueError(f"num_classes must be None or an int >= 2, got {num_classes!r}")
  return num_classes


def encode_labels(labels: jax.Array, num_classes: int | None) -> jax.Array:
  """Labels ``(rows,)`` as sent: packed uint32 words, or unchanged for ``None``."""
  if num_classes is None:
    return labels
  return pack_bits(jnp.clip(labels, 0, num_classes - 1), code_bits(num_classes))


def decode_labels(payload: jax.Array, num_classes: int | None, rows: int, dtype) -> jax.Array:
  """Inverse of :func:`encode_labels`: ``(rows,)`` labels of ``dtype``."""
  if num_classes is None:
    return payload
  return unpack_bits(payload, code_bits(num_classes), rows).astype(dtype)


def label_bits(rows: int, num_classes: int | None, itemsize: int = 4) -> int:
  """Wire bits of ``rows`` labels (``itemsize`` bytes each when sent raw)."""
  if num_classes is None:
    return rows * itemsize * 8
  return 32 * packed_words(rows, code_bits(num_classes))
