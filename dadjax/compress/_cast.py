"""Dense compressors: fp32 identity and half-precision casting."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from dadjax.compress._base import Compressor, leafwise
from dadjax.registry import Arg, register_compressor

_DTYPES = {
    "fp32": jnp.float32, "float32": jnp.float32,
    "bf16": jnp.bfloat16, "bfloat16": jnp.bfloat16,
    "fp16": jnp.float16, "float16": jnp.float16,
}


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


@register_compressor("cast", Arg("dtype", str, choices=("bf16", "fp16", "fp32"), doc="wire type"))
def cast(dtype="bf16") -> Compressor:
  """Send every gradient in a narrower float type, all-reduced in that type.

  Args:
    dtype: wire type: ``"bf16"`` / ``"bfloat16"``, ``"fp16"`` / ``"float16"``
      or ``"fp32"`` / ``"float32"`` (or the jnp dtype).

  Returns:
    A ``"reduce"`` :class:`Compressor` of ``bits(dtype) * d`` bits per tensor
    of ``d`` entries; the sum is formed in ``dtype`` (as on the wire), the
    mean in fp32 (or wider), then cast back to the gradient's dtype. Values
    beyond ``dtype``'s range saturate at its largest finite value (fp16:
    65504) instead of becoming inf.

  Raises:
    ValueError: for an unsupported ``dtype``.

  References:
    Micikevicius et al., "Mixed Precision Training", ICLR 2018
    (https://arxiv.org/abs/1710.03740); Li et al., "PyTorch Distributed:
    Experiences on Accelerating Data Parallel Training" (fp16 compression
    hook), VLDB 2020 (https://arxiv.org/abs/2006.15704).
  """
  wire = _wire_dtype(dtype)

  top = float(jnp.finfo(wire).max)

  def compress_leaf(x, key):
    del key
    if float(jnp.finfo(x.dtype).max) > top:  # saturate: a finite gradient stays finite on the wire
      x = jnp.clip(x, -top, top)
    return x.astype(wire)

  def decompress_leaf(payload, like, key):
    del key
    return payload.astype(like.dtype)

  return leafwise(compress_leaf, decompress_leaf, "reduce", name=f"cast_{wire.name}",
                  shardable=True)


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


register_compressor("bf16", doc="cast(\"bf16\"): bfloat16 on the wire, 16 bits per entry")(
    lambda: cast("bf16"))
register_compressor("fp16", doc="cast(\"fp16\"): float16 on the wire, 16 bits per entry")(
    lambda: cast("fp16"))
