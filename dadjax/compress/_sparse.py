"""Sparsifiers: TopK (values + indices, gathered) and RandomK (shared indices, reduced)."""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dadjax._core.running import running_count
from dadjax._core.validate import check_ratio
from dadjax._core.vma import vary_like
from dadjax.comm import in_site_axes, in_site_devices
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
  axes = in_site_axes()
  if axes:
    flat = _scatter_in_site(values.astype(jnp.float32), indices, math.prod(like.shape), axes)
  else:
    flat = jnp.zeros((math.prod(like.shape),), jnp.float32).at[indices].add(values.astype(jnp.float32))
  return flat.reshape(like.shape).astype(like.dtype if dtype is None else dtype)


def _split_flat(x: jax.Array, fill, axes: tuple[str, ...]) -> tuple[jax.Array, int]:
  """``x`` flattened, padded with ``fill`` to a multiple of the devices of ``axes``, and
  its entries per device (each device holds a contiguous run of flat positions)."""
  devices = in_site_devices(axes)
  flat = x.reshape(-1)
  pad = -flat.shape[0] % devices
  if pad:
    flat = jnp.concatenate([flat, jnp.full((pad,), fill, flat.dtype)])
  return flat, flat.shape[0] // devices


def _before_me(count: jax.Array, axes: tuple[str, ...]) -> jax.Array:
  """The sum of ``count`` over the devices of ``axes`` that hold earlier flat positions."""
  counts = jax.lax.all_gather(count, axes)
  return jnp.sum(jnp.where(jnp.arange(counts.shape[0]) < jax.lax.axis_index(axes), counts, 0))


def _largest_in_site(x: jax.Array, k: int, axes: tuple[str, ...]) -> SparsePayload:
  """:func:`largest_magnitude_indices`'s entries of ``x``, found on each device's own run of
  the flat tensor, in ascending flat index.

  Why: GSPMD computes ``top_k`` of a tensor split over a site's chips on the whole tensor,
  gathered on every chip, and inside the sites' partially manual ``shard_map`` it does not
  split a scatter into the ``k`` slots either. Here each chip holds ``d / chips`` contiguous
  flat positions (a row-split kernel is that already; a column-split one is moved there by
  one all-to-all of its shard), the ``k``-th largest magnitude is found bit by bit (31
  counts, each a scalar all-reduce), ties at it go to the lower flat index, and every chip
  writes its kept entries into their slots: one reduce-scatter of the ``k`` slots (padded to
  a multiple of the chips), which leaves each chip its share of the payload.
  """
  bits, per_device = _split_flat(_magnitude_bits(x), -1, axes)  # padding: below every |x|
  flat, _ = _split_flat(x, 0, axes)

  def local(bits, flat):
    def count(mask):
      return jax.lax.psum(jnp.sum(mask, dtype=jnp.int32), axes)

    def bisect(b, kth):
      candidate = kth | jnp.left_shift(jnp.int32(1), 30 - b)
      return jnp.where(count(bits >= candidate) >= k, candidate, kth)

    kth = jax.lax.fori_loop(0, 31, bisect, vary_like(jnp.int32(0), bits))  # k-th largest |x|
    above, ties = bits > kth, bits == kth
    ties_so_far = running_count(ties)
    tie_rank = _before_me(ties_so_far[-1], axes) + ties_so_far - ties
    kept = above | (ties & (tie_rank < k - count(above)))
    kept_so_far = running_count(kept)
    slot = _before_me(kept_so_far[-1], axes) + kept_so_far - kept
    slot = jnp.where(kept, slot, slots)  # past the slots: dropped
    position = jax.lax.axis_index(axes) * per_device + jnp.arange(per_device, dtype=jnp.int32)
    # fp32 slots: each holds one entry, so the cast back is exact, and a 16-bit reduction
    # would meet XLA:CPU's all-reduce promotion
    values = jnp.zeros((slots,), jnp.float32).at[slot].add(
        jnp.where(kept, flat, 0).astype(jnp.float32), mode="drop")
    indices = jnp.zeros((slots,), jnp.int32).at[slot].add(position, mode="drop")
    # each chip keeps its share of the slots: the gather over sites then sends each share
    # from one chip, not the whole payload from every chip of the site
    return (jax.lax.psum_scatter(values, axes, tiled=True),
            jax.lax.psum_scatter(indices, axes, tiled=True))

  slots = k + -k % (flat.shape[0] // per_device)  # a multiple of the devices
  values, indices = jax.shard_map(local, in_specs=(P(axes), P(axes)),
                                  out_specs=(P(axes), P(axes)), axis_names=set(axes))(bits, flat)
  return SparsePayload(values[:k].astype(x.dtype), indices[:k])


def _scatter_in_site(values: jax.Array, indices: jax.Array, size: int,
                     axes: tuple[str, ...]) -> jax.Array:
  """``zeros(size).at[indices].add(values)``, each device of ``axes`` writing its own flat
  run (the SPMD partitioner would build the whole buffer on every chip)."""
  zeros, per_device = _split_flat(jnp.zeros((size,), values.dtype), 0, axes)

  def local(zeros, values, indices):
    local_index = indices - jax.lax.axis_index(axes) * per_device
    mine = (local_index >= 0) & (local_index < per_device)
    return zeros.at[jnp.where(mine, local_index, per_device)].add(values, mode="drop")

  flat = jax.shard_map(local, in_specs=(P(axes), P(), P()), out_specs=P(axes),
                       axis_names=set(axes))(zeros, values, indices)
  return flat[:size]


def _magnitude_bits(x: jax.Array) -> jax.Array:
  """``|x|`` as ``int32`` bit patterns, ordered as the magnitudes are (NaN above inf)."""
  return jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.int32)


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

  When sites are groups of devices (a tensor split over a site's chips), the
  exact selection runs on each chip's own part (the same entries, sent in
  ascending flat index), so no chip gathers the tensor whole.

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
    k = num_kept(x.size, ratio)
    axes = () if approx else in_site_axes()
    if axes:  # a site's chips may split x
      return _largest_in_site(x, k, axes)
    flat = x.reshape(-1)
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
