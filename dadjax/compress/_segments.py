"""Many leaves as one buffer: the quantizers' elementwise work once for the whole tree.

A quantizer keeps per-leaf semantics (each leaf's own norm or scale, its own
key derived from its path), but its elementwise work (noise, rounding,
bit packing, unpacking) runs once over one flat buffer holding every leaf, each
leaf a *segment* padded to whole groups of 32 codes. The program then has a
few large ops instead of a dozen small ones per leaf, which is what made
QSGD and TernGrad compile and run slowly on models with 60-200 leaves.

The results are the per-leaf computation's, bit for bit:

* packing a segment padded to whole 32-code groups gives exactly the words
  :func:`~dadjax._core.packing.pack_bits` gives for the leaf alone (groups are
  independent and padding codes are 0), so each leaf's payload is unchanged;
* :func:`segment_uniform` gives, on each segment, the leaf's
  ``jax.random.uniform(leaf_key, (d,))``: JAX's partitionable threefry
  (``jax_threefry_partitionable``, the default) draws entry ``j`` as a function
  of ``(key, j)`` only, so one threefry call with a key per entry draws every
  leaf at once.

:func:`fused` says when the buffer form applies (``FUSED`` set, whole leaves,
a threefry key with the partitionable layout); otherwise the compressors run
their per-leaf form, which is also the reference the tests compare against.
``FUSED`` is off by default (see its comment): the buffer form compiles in half
the time but computes slower on XLA:CPU. PowerSGD's warm-start draws (small)
always come from one call (:func:`batched_draws`).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry2x32_p

from dadjax._core.keys import derive_keys
from dadjax._core.packing import WORD_BITS, pack_bits, unpack_bits
from dadjax._core.shards import shard_axes
from dadjax._core.trees import leaf_path
from dadjax.compress._base import as_keys

# Whether quantizers use the one-buffer form when it applies (read at trace time).
# Off by default: measured on ResNet-18 width 64 (experiments/results/bench_scale.md) it
# halves QSGD's and TernGrad's compile time but runs 3.6x / 8x slower than the per-leaf
# form (XLA:CPU evaluates the concatenation of 62 segments per element, and the threefry
# call with a key per entry is 6x slower than one call per leaf), so compute wins.
FUSED = False


def fused(key: jax.Array | None = None) -> bool:
  """Whether the one-buffer form applies now (see the module docstring)."""
  if not FUSED or shard_axes() is not None:
    return False
  return key is None or batched_draws(key)


def batched_draws(key: jax.Array) -> bool:
  """Whether :func:`segment_uniform` / :func:`segment_normal` reproduce per-key draws for ``key``."""
  return bool(jax.config.jax_threefry_partitionable) and (
      str(jax.random.key_impl(key)) == "threefry2x32")


class Layout(NamedTuple):
  """Where each leaf's codes sit in the buffer.

  Attributes:
    counts: codes of each leaf (``d``, or ``d + 1`` with a flag code).
    padded: each segment's length, ``counts`` rounded up to a multiple of 32.
    offsets: each segment's first position.
  """

  counts: tuple
  padded: tuple
  offsets: tuple

  @property
  def size(self) -> int:
    return sum(self.padded)


def layout(counts: Sequence[int]) -> Layout:
  """The :class:`Layout` of leaves with these code counts."""
  padded = tuple(-(-int(c) // WORD_BITS) * WORD_BITS for c in counts)
  offsets = tuple(int(o) for o in np.cumsum((0,) + padded)[:-1])
  return Layout(tuple(int(c) for c in counts), padded, offsets)


def segments(pieces: Sequence[jax.Array], lay: Layout, fill=0) -> jax.Array:
  """1-D ``pieces`` (one per leaf, at most its segment long) as one buffer, padded with ``fill``."""
  parts = []
  for x, n in zip(pieces, lay.padded):
    parts.append(x)
    if n > x.shape[-1]:
      parts.append(jnp.full(x.shape[:-1] + (n - x.shape[-1],), fill, x.dtype))
  return jnp.concatenate(parts, axis=-1)


def per_entry(values: Sequence[jax.Array], lay: Layout) -> jax.Array:
  """One value per leaf (each of shape ``batch``) broadcast over its segment: ``batch + (N,)``."""
  return jnp.concatenate([jnp.broadcast_to(jnp.asarray(v)[..., None], jnp.shape(v) + (n,))
                          for v, n in zip(values, lay.padded)], axis=-1)


def split(buffer: jax.Array, lay: Layout) -> list[jax.Array]:
  """The leaves' codes back out of the buffer: ``buffer[..., offset:offset + count]`` each."""
  return [buffer[..., o:o + c] for o, c in zip(lay.offsets, lay.counts)]


def leaf_site_keys(site_key: jax.Array, method: str, paths: Sequence[str]) -> jax.Array:
  """The leaves' site keys, batched (L,): ``leaf_keys(keys, path, method).site`` of each path."""
  return derive_keys(site_key, [(method, "leaf", p) for p in paths])


def segment_uniform(keys: jax.Array, lay: Layout) -> jax.Array:
  """Uniform [0, 1) noise (N,): on segment ``i`` the leaf's ``jax.random.uniform(keys[i], (d,))``.

  One threefry call for every leaf (entries past ``d`` are draws the leaf does
  not use). Requires :func:`fused` ``(key)``.
  """
  return _unit_floats(keys, lay)


def _unit_floats(keys: jax.Array, lay: Layout) -> jax.Array:
  """``jax.random.uniform``'s [0, 1) floats of every segment's key, from one threefry call."""
  data = jax.random.key_data(keys)  # (L, 2) uint32
  k1 = per_entry(list(data[:, 0]), lay)
  k2 = per_entry(list(data[:, 1]), lay)
  count = jnp.concatenate([jnp.arange(n, dtype=jnp.uint32) for n in lay.padded])
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(count), count)
  bits = bits1 ^ bits2
  # jax.random.uniform's float32 conversion: 23 random mantissa bits of a number in [1, 2), minus 1.
  one = np.array(1.0, np.float32).view(np.uint32)
  return jax.lax.bitcast_convert_type((bits >> np.uint32(32 - 23)) | one, jnp.float32) - 1.0


def segment_normal(keys: jax.Array, lay: Layout) -> jax.Array:
  """Standard normal noise (N,): on segment ``i`` the leaf's ``jax.random.normal(keys[i], (d,))``.

  ``jax.random.normal``'s float32 transform (``sqrt(2) * erf_inv(u)`` of a
  uniform ``u`` in ``(-1, 1)``) applied to one threefry call for every segment.
  """
  lo = np.nextafter(np.float32(-1.0), np.float32(0.0), dtype=np.float32)
  lo_, hi_ = jnp.asarray(lo), jnp.asarray(np.float32(1.0))
  u = jax.lax.max(lo_, _unit_floats(keys, lay) * (hi_ - lo_) + lo_)
  return jax.lax.mul(np.float32(np.sqrt(2)), jax.lax.erf_inv(u))


def pack_segments(codes: jax.Array, bits: int, lay: Layout) -> list[jax.Array]:
  """Pack the buffer's codes once; each leaf's words (what ``pack_bits`` gives the leaf alone)."""
  words = pack_bits(codes, bits)
  per = [n // WORD_BITS * bits for n in lay.padded]
  starts = np.cumsum([0] + per)
  return [words[s:s + n] for s, n in zip(starts[:-1], per)]


def unpack_segments(words: Sequence[jax.Array], bits: int, lay: Layout) -> jax.Array:
  """Inverse of :func:`pack_segments`: the leaves' words (each ``batch + (W_i,)``) -> codes ``batch + (N,)``."""
  flat = jnp.concatenate(list(words), axis=-1)
  batch = flat.shape[:-1]
  fn = lambda w: unpack_bits(w, bits, lay.size)
  for _ in batch:
    fn = jax.vmap(fn)
  return fn(flat)


def sizes_of(like_leaves) -> list[int]:
  """Entries of each leaf."""
  return [math.prod(jnp.shape(x)) for x in like_leaves]


def _live(tree):
  """``(paths, leaves, treedef, positions)`` of the non-empty leaves of ``tree``."""
  items, treedef = jax.tree_util.tree_flatten_with_path(tree)
  pos = [i for i, (_, x) in enumerate(items) if math.prod(jnp.shape(x)) > 0]
  return [leaf_path(items[i][0]) for i in pos], [items[i][1] for i in pos], treedef, pos, len(items)


def segmented(base, compress_all, decode_all, aggregate_all=None):
  """``base`` (a :func:`~dadjax.compress._base.leafwise` compressor) with its one-buffer form.

  Where :func:`fused` holds, ``compress`` / ``decompress`` / ``aggregate`` run
  over all non-empty leaves at once (empty leaves send ``()`` and decompress to
  empty arrays, as in ``base``); elsewhere ``base``'s per-leaf functions run.
  The payload, bits and results are ``base``'s.

  Args:
    base: the per-leaf compressor.
    compress_all: ``(leaves, paths, keys) -> [leaf payload]`` for the non-empty leaves.
    decode_all: ``(payloads, likes) -> [values]``: each leaf's decompression in
      fp32, flat, with the payload's leading (site) axes: ``batch + (d,)``.
    aggregate_all: ``(gathered payloads, likes) -> [leaf]`` (final shape and
      dtype); ``None``: the mean over sites of the per-site decompressions,
      each cast to the leaf's dtype first (what ``base`` computes).
  """

  def compress(grads, state, key):
    key = as_keys(key)
    if not fused(key.site):
      return base.compress(grads, state, key)
    base.init(grads)  # the same checks (float leaves, naming the leaf)
    paths, xs, _, pos, n = _live(grads)
    out = [()] * n
    for i, p in zip(pos, compress_all(xs, paths, key) if xs else ()):
      out[i] = p
    return tuple(out), state

  def rebuild(like, values):
    _, likes, treedef, pos, n = _live(like)
    leaves = [jnp.zeros(jnp.shape(l), l.dtype) for l in jax.tree.leaves(like)]
    for i, v in zip(pos, values):
      leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)

  def decompress(payload, like, key):
    if not fused():
      return base.decompress(payload, like, key)
    _, likes, _, pos, _ = _live(like)
    values = decode_all([payload[i] for i in pos], likes) if likes else []
    return rebuild(like, [v.reshape(l.shape).astype(l.dtype) for v, l in zip(values, likes)])

  def aggregate(gathered, like, key):
    if not fused():
      return base.aggregate(gathered, like, key)
    _, likes, _, pos, _ = _live(like)
    parts = [gathered[i] for i in pos]
    if not likes:
      return rebuild(like, [])
    if aggregate_all is not None:
      return rebuild(like, aggregate_all(parts, likes))
    values = decode_all(parts, likes)  # (sites, d) each
    if all(l.dtype == jnp.float32 for l in likes):  # one mean over the sites for every leaf
      means = jnp.mean(jnp.concatenate(values, axis=-1), axis=0)
      sizes = np.cumsum([0] + [v.shape[-1] for v in values])
      return rebuild(like, [means[a:b].reshape(l.shape) for a, b, l in
                            zip(sizes[:-1], sizes[1:], likes)])
    return rebuild(like, [jnp.mean(v.astype(l.dtype).astype(jnp.float32), axis=0)
                          .astype(l.dtype).reshape(l.shape) for v, l in zip(values, likes)])

  return base._replace(compress=compress, decompress=decompress, aggregate=aggregate)
