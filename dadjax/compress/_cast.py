"""Dense compressors: fp32 identity, half-precision and fp8 casting."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.packing import pack_leaf, unpack_leaf
from dadjax._core.shards import whole_max
import dadjax.compress._two_phase as tp
from dadjax.compress._base import Compressor, leafwise
from dadjax.compress._two_phase import Codec, route_arg, two_phase
from dadjax.registry import Arg, register_compressor

_DTYPES = {
    "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "fp16": jnp.float16, "float16": jnp.float16,
    "fp8_e4m3": jnp.float8_e4m3fn, "e4m3": jnp.float8_e4m3fn,
    "fp8_e5m2": jnp.float8_e5m2, "e5m2": jnp.float8_e5m2,
}
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def _wire_dtype(dtype):
  if isinstance(dtype, str):
    if dtype.lower() in _DTYPES:
      return np.dtype(_DTYPES[dtype.lower()])
  else:
    try:
      d = np.dtype(dtype)
    except TypeError:
      d = None
    if d is not None and d in {np.dtype(t) for t in _DTYPES.values()}:
      return d
  raise ValueError(f"dtype must be one of {sorted(_DTYPES)} (or the matching jnp "
                   f"dtype), got {dtype!r}")


@register_compressor("cast", Arg("dtype", str, choices=("bf16", "fp16", "fp32", "fp8_e4m3",
                                                        "fp8_e5m2"), doc="wire type"),
                     route_arg("bf16 / fp16 / fp32 keep one_round; fp8 two_phase from N = 3"))
def cast(dtype="bf16", route: str = "one_round") -> Compressor:
  """Send every gradient in a narrower float type, all-reduced in that type.

  fp8 (``"fp8_e4m3"``, ``"fp8_e5m2"``) is different: a sum of fp8 numbers on
  the wire would lose the gradient, and their range is narrow, so each
  tensor is scaled by ``max|g| / max_fp8`` (an fp32 scale sent with it),
  rounded to the nearest fp8 number and all-gathered; sites average the
  decoded tensors in fp32 (a ``"gather"`` compressor of ``32 + 8 * 4 *
  ceil(d / 4)`` bits per tensor: four fp8 numbers per uint32 word).

  Args:
    dtype: wire type: ``"bf16"`` / ``"bfloat16"``, ``"fp16"`` / ``"float16"``,
      ``"fp32"`` / ``"float32"``, ``"fp8_e4m3"`` / ``"e4m3"`` or
      ``"fp8_e5m2"`` / ``"e5m2"`` (or the jnp dtype).
    route: ``"one_round"`` (one all-reduce; fp8: one all-gather),
      ``"two_phase"`` (:func:`~dadjax.compress.two_phase`: chunks cast,
      all-to-all, fp32 mean, cast again, all-gather; fp8 with one scale per
      chunk) or ``"auto"`` (spec ``cast:fp8_e4m3:route=auto``).

  Returns:
    A ``"reduce"`` :class:`Compressor` of ``bits(dtype) * d`` bits per tensor
    of ``d`` entries; the sum is formed in ``dtype`` (as on the wire), the
    mean in fp32 (or wider), then cast back to the gradient's dtype. Values
    beyond ``dtype``'s range saturate at its largest finite value (fp16:
    65504) instead of becoming inf.

  Raises:
    ValueError: for an unsupported ``dtype`` or ``route``.

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018
    (https://arxiv.org/abs/1710.03740); Li et al., "PyTorch Distributed:
    Experiences on Accelerating Data Parallel Training" (fp16 compression
    hook), VLDB 2020 (https://arxiv.org/abs/2006.15704).
  """
  wire = _wire_dtype(dtype)
  tp.check_route(route)
  if wire in _FP8:
    return two_phase(_fp8(wire), _fp8_codec(wire), route)

  top = float(jnp.finfo(wire).max)

  def compress_leaf(x, key):
    del key
    if float(jnp.finfo(x.dtype).max) > top:  # saturate: a finite gradient stays finite on the wire
      x = jnp.clip(x, -top, top)
    return x.astype(wire)

  def decompress_leaf(payload, like, key):
    del key
    return payload.astype(like.dtype)

  base = leafwise(compress_leaf, decompress_leaf, "reduce", name=f"cast_{wire.name}",
                   shardable=True)
  return two_phase(base, _half_codec(wire, top), route)


def _half_codec(wire, top: float) -> Codec:
  """16-bit (or 32-bit) chunks, no scale: two 16-bit numbers per uint32 word."""
  per_word = 32 // (8 * wire.itemsize)
  unsigned = {1: jnp.uint32, 2: jnp.uint16}.get(per_word, jnp.uint32)

  def encode(v, key, rows, lay):
    del key, rows, lay
    x = jnp.clip(v, -top, top).astype(wire)  # saturate: a finite gradient stays finite
    if per_word == 1:
      return jax.lax.bitcast_convert_type(x, jnp.uint32)
    u = jax.lax.bitcast_convert_type(x, unsigned)
    return jax.lax.bitcast_convert_type(u.reshape(v.shape[0], -1, per_word), jnp.uint32)

  def decode(buf, rows, lay):
    del rows, lay
    if per_word == 1:
      return jax.lax.bitcast_convert_type(buf, wire).astype(jnp.float32)
    u = jax.lax.bitcast_convert_type(buf, unsigned).reshape(buf.shape[0], -1)
    return jax.lax.bitcast_convert_type(u, wire).astype(jnp.float32)

  return Codec(encode, decode)


def _fp8_encode(x, scale, wire):
  """fp8 codes (as uint32 in [0, 256)) of ``x / scale``, rounded to nearest."""
  safe = jnp.where(scale > 0, scale, 1.0)
  top = float(jnp.finfo(wire).max)
  q = jnp.clip(x / safe, -top, top).astype(wire)
  return jax.lax.bitcast_convert_type(q, jnp.uint8).astype(jnp.uint32)


def _fp8_decode(codes, scale, wire):
  q = jax.lax.bitcast_convert_type(codes.astype(jnp.uint8), wire)
  return q.astype(jnp.float32) * scale


def _fp8(wire) -> Compressor:
  """fp8 on the one-round route: per-tensor fp32 scale and fp8 codes, all-gathered."""
  from dadjax.compress._quantize import QuantizedPayload  # pylint: disable=g-import-not-at-top
  top = float(jnp.finfo(wire).max)

  def compress_leaf(x, key):
    del key
    v = x.astype(jnp.float32)  # in the leaf's shape (pack_leaf)
    scale = whole_max(jnp.max(jnp.abs(v))) / top
    return QuantizedPayload(scale, pack_leaf(_fp8_encode(v, scale, wire), 8))

  def decompress_leaf(p, like, key):
    del key
    return _fp8_decode(unpack_leaf(p.words, 8, like.shape), p.scale, wire).astype(like.dtype)

  return leafwise(compress_leaf, decompress_leaf, "gather", name=f"cast_{wire.name}",
                  shardable=True)


def _fp8_codec(wire) -> Codec:
  """fp8 chunks: one fp32 scale per block of a chunk, four fp8 numbers per uint32 word."""
  top = float(jnp.finfo(wire).max)

  def encode(v, key, rows, lay):
    del key, rows, lay
    scale = tp.per_block(jnp.abs(v), tp.BLOCK, jnp.max) / top
    entries = tp.to_entries(scale, v.shape[1], tp.BLOCK)
    return tp.with_scales(scale, tp.pack_rows(_fp8_encode(v, entries, wire), 8))

  def decode(buf, rows, lay):
    del rows
    scale, codes = tp.split_scales(buf, 8, lay.chunk, tp.BLOCK)
    return _fp8_decode(codes, scale, wire)

  return Codec(encode, decode)


@register_compressor("identity", aliases=("fp32",))
def identity() -> Compressor:
  """No compression: the fp32 gradient, all-reduced (the dense baseline).

  Returns:
    ``cast("fp32")``: ``32 * d`` bits per tensor of ``d`` entries.

  References:
    Li et al., "PyTorch Distributed: Experiences on Accelerating Data
    Parallel Training", VLDB 2020 (https://arxiv.org/abs/2006.15704).
  """
  return cast("fp32")


_HALF_ROUTE = route_arg("keeps one_round: the same bits, fewer ops")
register_compressor("bf16", _HALF_ROUTE,
                    doc="cast(\"bf16\"): bfloat16 on the wire, 16 bits per entry")(
    lambda route="one_round": cast("bf16", route))
register_compressor("fp16", _HALF_ROUTE,
                    doc="cast(\"fp16\"): float16 on the wire, 16 bits per entry")(
    lambda route="one_round": cast("fp16", route))
register_compressor("fp8", route_arg("two_phase from N = 3 sites"),
                    doc="cast(\"fp8_e4m3\"): scaled fp8 e4m3 on the wire, 8 bits per entry")(
    lambda route="one_round": cast("fp8_e4m3", route))
