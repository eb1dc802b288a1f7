"""Sparsifiers: TopK (values + indices, gathered) and RandomK (shared indices, reduced)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dadjax._core.validate import check_ratio
from dadjax.compress._base import Compressor, leafwise, num_kept
from dadjax.registry import Arg, register_compressor


class SparsePayload(NamedTuple):
  """``values[j]`` belongs at flat position ``indices[j]`` of the tensor."""

  values: jax.Array
  indices: jax.Array  # int32


def _scatter(values, indices, like, dtype=None):
  """``values`` added at the flat ``indices`` of a zero tensor like ``like``, summed in fp32.

  The result has ``dtype`` (default ``like``'s); a mean is divided before it is cast.
  """
  flat = jnp.zeros((math.prod(like.shape),), jnp.float32).at[indices].add(values.astype(jnp.float32))
  return flat.reshape(like.shape).astype(like.dtype if dtype is None else dtype)


def largest_magnitude_indices(flat: jax.Array, k: int) -> jax.Array:
  """The flat indices of the ``k`` largest ``|flat|``: the set ``jax.lax.top_k`` keeps.

  Ties go to the lower index, as in ``top_k``. For ``k`` above half the
  size, the kept set is found as the complement of the ``size - k``
  smallest (reversed, so that ties fall as ``top_k``'s do) and returned in
  ascending order: XLA:CPU's ``top_k`` costs about as much as a sort for
  large ``k``, and dropping the smallest 1% is several times faster than
  keeping the largest 99% (``experiments/bench_topk_select.py``).
  Below half the size, ``top_k``'s own order (by magnitude) is returned.

  Args:
    flat: a 1-D array of ``size`` entries.
    k: entries to keep, in ``[1, size]``.

  Returns:
    ``int32[k]`` distinct indices into ``flat``.
  """
  size = flat.shape[0]
  if 2 * k <= size:
    return jax.lax.top_k(jnp.abs(flat), k)[1].astype(jnp.int32)
  drop = size - k
  if drop == 0:
    return jnp.arange(size, dtype=jnp.int32)
  # NaN is kept, as top_k keeps it (its key is the lowest): an error must travel, not hide
  # in an error-feedback memory.
  magnitude = jnp.abs(flat[::-1])
  _, reversed_dropped = jax.lax.top_k(jnp.where(jnp.isnan(magnitude), -jnp.inf, -magnitude), drop)
  kept = jnp.ones((size,), bool).at[size - 1 - reversed_dropped].set(False)
  return jnp.nonzero(kept, size=k)[0].astype(jnp.int32)


@register_compressor("topk", Arg("ratio", float, within="(0, 1]", doc="fraction of entries kept"),
                     Arg("approx", bool, positional=False,
                         doc="select with jax.lax.approx_max_k (recall target 0.95)"))
def topk(ratio: float = 0.01, approx: bool = False) -> Compressor:
  """Keep the ``k = round(ratio * d)`` largest-magnitude entries of each tensor.

  Each site sends the kept values (in the gradient's dtype) and their int32
  flat indices; sites all-gather the pairs and the average is the sum of
  every site's sparse tensor divided by the number of sites. Biased: use
  with :func:`error_feedback` (``"ef_topk:0.01"``) as the papers do.

  Args:
    ratio: fraction of entries kept per tensor, in (0, 1]; ``k`` is clipped
      to ``[1, d]``, so ``ratio=1`` sends every entry.
    approx: select with ``jax.lax.approx_max_k(|x|, k, recall_target=0.95)``
      instead of the exact ``jax.lax.top_k`` (spec ``topk:0.01:approx=1``).
      The approximate kernel exists on TPU (recall >= 0.95 of the true top-k
      by construction); XLA:CPU computes it exactly: measured recall 1.0 and
      the same time as the exact selection on 1M and 2.4M entries
      (``experiments/results/bench_scale.md``). Exact is the default.

  Returns:
    A ``"gather"`` :class:`Compressor` of ``k * (bits(dtype) + 32)`` bits
    per tensor.

  Raises:
    ValueError: if ``ratio`` is outside (0, 1].

  References:
    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017 (https://arxiv.org/abs/1704.05021); Stich, Cordonnier &
    Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
    (https://arxiv.org/abs/1809.07599).
  """
  ratio = check_ratio("ratio", ratio)
  if not isinstance(approx, bool):
    raise ValueError(f"approx must be a bool, got {approx!r}")

  def compress_leaf(x, key):
    del key
    flat = x.reshape(-1)
    k = num_kept(flat.size, ratio)
    if approx:
      _, idx = jax.lax.approx_max_k(jnp.abs(flat), k, recall_target=0.95)
    else:
      idx = largest_magnitude_indices(flat, k)
    return SparsePayload(flat[idx], idx.astype(jnp.int32))

  def decompress_leaf(p, like, key):
    del key
    return _scatter(p.values, p.indices, like)

  def aggregate_leaf(gathered, like, key):
    del key
    n = gathered.values.shape[0]
    total = _scatter(gathered.values.reshape(-1), gathered.indices.reshape(-1), like, jnp.float32)
    return (total / n).astype(like.dtype)  # the mean in fp32: fp16 sums of sites may overflow

  return leafwise(compress_leaf, decompress_leaf, "gather", aggregate_leaf, name="topk",
                  group_same_shapes=False)  # batched top-k / gather / scatter are slow on CPU


def _shared_indices(key, size: int, k: int) -> jax.Array:
  """``k`` distinct flat indices, a uniformly random subset, from the *shared* key.

  The subset is the positions of the ``k`` largest of ``size`` i.i.d.
  uniform 30-bit integers: a ``top_k`` (like TopK's) instead of the full
  sort a random permutation needs. The integers are offset into the normal
  float32 range and bitcast, which preserves their order, because ``top_k``
  is fast for floats only. A tie at the boundary (probability about
  ``size / 2**30`` per call) goes to the lower index.
  """
  bits = jax.random.bits(key, (size,), jnp.uint32)
  keys = jax.lax.bitcast_convert_type((bits >> 2) + jnp.uint32(1 << 23), jnp.float32)
  return jax.lax.top_k(keys, k)[1].astype(jnp.int32)


@register_compressor("randomk",
                     Arg("ratio", float, within="(0, 1]", doc="fraction of entries kept"))
def randomk(ratio: float = 0.01) -> Compressor:
  """Keep ``k = round(ratio * d)`` uniformly random entries, scaled by ``d / k``.

  The indices come from the key shared by all sites, so every site keeps
  the same coordinates: only the ``k`` values travel (no indices), and the
  payload is linear, so it is all-reduced (psum) rather than gathered. The
  estimate is unbiased: ``E[C(g)] = g``.

  Args:
    ratio: fraction of entries kept per tensor, in (0, 1].

  Returns:
    A ``"reduce"`` :class:`Compressor` of ``k * bits(dtype)`` bits per tensor.

  Raises:
    ValueError: if ``ratio`` is outside (0, 1].

  References:
    Stich, Cordonnier & Jaggi, "Sparsified SGD with Memory", NeurIPS 2018
    (https://arxiv.org/abs/1809.07599); Wangni et al., "Gradient
    Sparsification for Communication-Efficient Distributed Optimization",
    NeurIPS 2018 (https://arxiv.org/abs/1710.09854).
  """
  ratio = check_ratio("ratio", ratio)

  def compress_leaf(x, key):
    flat = x.reshape(-1)
    k = num_kept(flat.size, ratio)
    return flat[_shared_indices(key.shared, flat.size, k)]

  def decompress_leaf(values, like, key):
    size = math.prod(like.shape)
    k = values.shape[0]
    idx = _shared_indices(key.shared, size, k)
    return _scatter(values.astype(jnp.float32) * (size / k), idx, like)

  return leafwise(compress_leaf, decompress_leaf, "reduce", name="randomk",
                  group_same_shapes=False)  # batched gather / scatter are slow on CPU
