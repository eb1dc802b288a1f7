"""The orthogonalization kernel shared by PowerSGD and rank-dAD.

Both methods run a power iteration that keeps a set of orthonormal vectors:
PowerSGD orthogonalizes the columns of ``P`` (and keeps its warm-start ``Q``
orthonormal), rank-dAD deflates each new right factor against the ones it
already found. One kernel serves both, :func:`project_out`: project a
vector off an orthonormal basis twice ("twice is enough", Kahan / Parlett),
then normalize it, or return exactly 0 when what is left is below a
relative threshold (the vector was zero or numerically dependent on the
basis: its remainder is round-off, and normalizing it would add a
direction that is not in the data and break orthogonality). Norms are
computed scale-safely, so vectors of any magnitude the dtype can hold
(``1e-30`` in float32) neither underflow nor overflow.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = [
    "safe_norm", "pow2_unit", "pow2_scale", "tree_safe_norm", "project_out", "orthogonalize"
]


def safe_norm(x: jax.Array, axis: int = -1, keepdims: bool = False) -> jax.Array:
  """Euclidean norm along ``axis`` without underflow or overflow of the squares.

  Computes ``s * ||x / s||`` with ``s = max |x|``; 0 for a zero vector.
  """
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
  safe = jnp.where(scale > 0, scale, jnp.ones_like(scale))
  norm = jnp.linalg.norm(x / safe, axis=axis, keepdims=True) * scale
  return norm if keepdims else jnp.squeeze(norm, axis=axis)


def pow2_unit(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(x / 2^e, e)`` with ``2^e`` the power of two just above ``max |x|`` (int32 ``e``).

  Only the exponents change, so the scaling is exact (no rounding) and
  products of scaled operands are the unscaled ones times a power of two:
  a computation on them rounds exactly as it would on ``x``, but cannot
  overflow (entries are below 1) or underflow where ``x`` is tiny. ``e`` is
  kept within ``[-125, 126]`` (the scale factor stays a normal float32) and
  is 0 for a zero or non-finite ``x``. Undo with :func:`pow2_scale`.
  """
  top = jnp.max(jnp.abs(x))
  e = _frexp_exponent(top)  # top = m 2^e, 0.5 <= m < 1
  e = jnp.where((top > 0) & jnp.isfinite(top), jnp.clip(e, -125, 126), 0).astype(jnp.int32)
  return x * _pow2(-e, x.dtype), e


def pow2_scale(x: jax.Array, e: jax.Array) -> jax.Array:
  """``x 2^e`` for an int32 ``e`` in ``[-252, 252]``, exactly, in two factors (each a normal
  float32; the intermediate lies between ``x`` and the result, so only a result out of
  range overflows or underflows)."""
  half = e // 2
  return x * _pow2(half, x.dtype) * _pow2(e - half, x.dtype)


def _frexp_exponent(top: jax.Array) -> jax.Array:
  """``frexp(top)``'s exponent; for float32 read from the bits (a subnormal or 0 gives -126,
  which :func:`pow2_unit` clips or discards as it does frexp's). ``jnp.frexp`` and
  ``jnp.ldexp`` expand to many ops per call, and rank-dAD calls these in every layer."""
  if top.dtype == jnp.float32:
    return (jax.lax.bitcast_convert_type(top, jnp.int32) >> 23) - 126
  return jnp.frexp(top)[1]


def _pow2(e: jax.Array, dtype) -> jax.Array:
  """``2^e`` exactly, for an int32 ``e`` in ``[-126, 127]`` (a normal float32)."""
  if jnp.dtype(dtype) == jnp.float32:
    return jax.lax.bitcast_convert_type((e.astype(jnp.int32) + 127) << 23, jnp.float32)
  return jnp.ldexp(jnp.ones((), dtype), e)


def tree_safe_norm(tree) -> jax.Array:
  """The global Euclidean norm of a pytree's leaves, scale-safe (:func:`safe_norm` of the
  leaves' :func:`safe_norm`); 0 for a tree without leaves."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return jnp.zeros((), jnp.float32)
  return safe_norm(jnp.stack([safe_norm(jnp.ravel(x)).astype(jnp.float32) for x in leaves]))


def project_out(v: jax.Array, basis: jax.Array | None, rtol: float) -> tuple[jax.Array, jax.Array]:
  """``v`` made orthogonal to ``basis`` and normalized, or 0 if nothing is left.

  Args:
    v: (..., m) vectors.
    basis: (..., m, k) with orthonormal or zero columns (zero columns are
      ignored), or ``None`` (nothing to project out).
    rtol: relative threshold: when the norm after projection is at most
      ``rtol`` times the norm before, the result is 0.

  Returns:
    ``(unit, norm)``: ``unit`` (..., m) is a unit vector orthogonal to the
    basis or exactly 0; ``norm`` (...) is the norm after projection, 0 when
    ``unit`` is 0. No NaN for any finite input.
  """
  before = safe_norm(v, keepdims=True)
  if basis is not None and basis.shape[-1] > 0:
    for _ in range(2):
      v = v - jnp.einsum("...mk,...k->...m", basis, jnp.einsum("...mk,...m->...k", basis, v))
  after = safe_norm(v, keepdims=True)
  keep = after > rtol * before
  unit = jnp.where(keep, v / jnp.where(keep, after, jnp.ones_like(after)), jnp.zeros_like(v))
  return unit, jnp.squeeze(jnp.where(keep, after, jnp.zeros_like(after)), axis=-1)


def orthogonalize(p: jax.Array, rtol: float = 1e-4) -> jax.Array:
  """Gram-Schmidt on the columns of ``p`` (..., m, r), NaN-free.

  Column ``i`` is projected off the already orthonormal columns ``0..i-1``
  twice (classical Gram-Schmidt with re-orthogonalization, as accurate as
  modified Gram-Schmidt and two matrix products per column), then
  normalized (:func:`project_out`); a column that is zero or dependent on
  the previous ones (its norm falls below ``rtol`` times its norm before the
  projection) becomes 0 instead of noise or NaN.

  Args:
    p: a (batch of) tall matrices.
    rtol: relative threshold of dependence, default ``1e-4``.

  Returns:
    Same shape; non-zero columns orthonormal.
  """
  cols = []
  for i in range(p.shape[-1]):
    done = jnp.stack(cols, axis=-1) if cols else None
    cols.append(project_out(p[..., i], done, rtol)[0])
  return jnp.stack(cols, axis=-1) if cols else p
