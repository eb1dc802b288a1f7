"""Vector quantization of data rows with a learned codebook (k-means).

A row of ``D`` features is cut into ``ceil(D / block)`` blocks of ``block``
consecutive features (the last one zero-padded); each block is replaced by
the index of its nearest codeword in a codebook of ``K = 2**bits`` entries
of ``block`` features, and the indices of a row are packed into uint32
words: ``32 * packed_words(ceil(D / block), bits)`` bits per row, i.e.
about ``bits / block`` bits per feature. Nearest-codeword rounding is
deterministic and therefore biased; the stage's gradient correction is what
removes the bias.

The codebook is learned by k-means (Lloyd's iterations) on a sample of
local data (:func:`fit_codebook`); :func:`merge_codebooks` turns the
codebooks of several sites, gathered once, into one shared codebook that
every site computes identically. Its one-time cost on the wire is
:func:`codebook_bits`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dadjax._core.linalg import pow2_scale, pow2_unit
from dadjax._core.packing import pack_bits, packed_words, unpack_bits


def num_blocks(dim: int, block: int) -> int:
  """Blocks per row: ``ceil(dim / block)``."""
  return -(-dim // block)


def codebook_row_bits(dim: int, bits: int, block: int) -> int:
  """Exact wire bits of one row: ``32 * packed_words(ceil(dim / block), bits)``."""
  return 32 * packed_words(num_blocks(dim, block), bits)


def codebook_bits(bits: int, block: int) -> int:
  """One site's one-time broadcast: ``K = 2**bits`` fp32 codewords of ``block``
  features and their fp32 cluster sizes, ``32 * K * (block + 1)`` bits."""
  return 32 * (1 << bits) * (block + 1)


def to_blocks(x: jax.Array, block: int) -> jax.Array:
  """``(rows, D)`` -> ``(rows, ceil(D / block), block)``, zero-padded."""
  rows, dim = x.shape
  nb = num_blocks(dim, block)
  x = jnp.pad(x, ((0, 0), (0, nb * block - dim)))
  return x.reshape(rows, nb, block)


def _nearest(points: jax.Array, centroids: jax.Array) -> jax.Array:
  # Both scaled by one power of two (exact: the same argmin) so the squares cannot overflow.
  _, e = pow2_unit(jnp.stack([jnp.max(jnp.abs(points)), jnp.max(jnp.abs(centroids))]))
  points, centroids = pow2_scale(points, -e), pow2_scale(centroids, -e)
  d = (jnp.sum(points ** 2, -1, keepdims=True) - 2 * points @ centroids.T
       + jnp.sum(centroids ** 2, -1)[None, :])
  return jnp.argmin(d, axis=-1)


def _seed(points: jax.Array, weights: jax.Array, k: int, key: jax.Array) -> jax.Array:
  """k-means++ seeding (weighted); falls back to the weights alone once every
  point coincides with a seed."""
  n = points.shape[0]
  keys = jax.random.split(key, k)

  def draw(i, mass):
    total = jnp.sum(mass)
    fallback = jnp.where(jnp.sum(weights) > 0, weights, jnp.ones_like(weights))
    p = jnp.where(total > 0, mass, fallback)
    return jax.random.choice(keys[i], n, p=p / jnp.sum(p))

  first = points[draw(0, weights)]
  centroids = jnp.zeros((k,) + points.shape[1:], points.dtype).at[0].set(first)
  d2 = jnp.sum((points - first) ** 2, -1)

  def body(i, carry):
    c, d2 = carry
    nxt = points[draw(i, weights * d2)]
    return c.at[i].set(nxt), jnp.minimum(d2, jnp.sum((points - nxt) ** 2, -1))

  centroids, _ = jax.lax.fori_loop(1, k, body, (centroids, d2))
  return centroids


def kmeans(points: jax.Array, weights: jax.Array, k: int, key: jax.Array,
           iters: int = 10) -> tuple[jax.Array, jax.Array]:
  """Weighted k-means (Lloyd's iterations) with a fixed number of iterations.

  Args:
    points: ``(n, B)`` float.
    weights: ``(n,)`` non-negative weights (cluster sizes when merging).
    k: number of centroids.
    key: picks the initial centroids (k-means++ seeding: each next seed is a
      point drawn with probability proportional to its weight times its
      squared distance to the seeds so far).
    iters: Lloyd iterations.

  Returns:
    ``(centroids (k, B), sizes (k,))``; a centroid that loses all its points
    keeps its previous position.

  References:
    Lloyd, "Least squares quantization in PCM", IEEE Trans. Inf. Theory 1982;
    Arthur & Vassilvitskii, "k-means++: The Advantages of Careful Seeding",
    SODA 2007.
  """
  # On the points scaled exactly by a power of two (entries below 1), so that no squared
  # distance overflows (1e20 features) or underflows; the centroids are scaled back.
  points, scale = pow2_unit(jnp.asarray(points, jnp.float32))
  weights = jnp.asarray(weights, jnp.float32)
  centroids = _seed(points, weights, k, key)

  def lloyd(_, c):
    a = _nearest(points, c)
    sums = jax.ops.segment_sum(points * weights[:, None], a, num_segments=k)
    size = jax.ops.segment_sum(weights, a, num_segments=k)
    return jnp.where(size[:, None] > 0, sums / jnp.where(size > 0, size, 1.0)[:, None], c)

  centroids = jax.lax.fori_loop(0, iters, lloyd, centroids)
  sizes = jax.ops.segment_sum(weights, _nearest(points, centroids), num_segments=k)
  return pow2_scale(centroids, scale), sizes


def fit_codebook(x: jax.Array, bits: int, block: int, key: jax.Array,
                 iters: int = 10) -> tuple[jax.Array, jax.Array]:
  """k-means codebook of ``2**bits`` codewords on the blocks of the rows ``x``.

  Args:
    x: float ``(rows, D)``, the local data sample.
    bits: bits per code (``K = 2**bits``).
    block: features per block.
    key: initialization key.
    iters: Lloyd iterations.

  Returns:
    ``(codebook (K, block), sizes (K,))``.
  """
  pts = to_blocks(jnp.asarray(x, jnp.float32), block).reshape(-1, block)
  return kmeans(pts, jnp.ones(pts.shape[0]), 1 << bits, key, iters)


def merge_codebooks(codebooks: jax.Array, sizes: jax.Array, key: jax.Array,
                    iters: int = 10) -> jax.Array:
  """One shared codebook from the sites' gathered codebooks.

  Weighted k-means of all ``N * K`` codewords (weights: their cluster
  sizes) back to ``K``. Deterministic in its inputs, so every site that
  holds the same gathered codebooks and ``key`` gets the same result.

  Args:
    codebooks: ``(N, K, B)``.
    sizes: ``(N, K)``.
    key: a key shared by every site.
    iters: Lloyd iterations.

  Returns:
    ``(K, B)`` codebook.
  """
  n, k, b = codebooks.shape
  centroids, _ = kmeans(codebooks.reshape(n * k, b), sizes.reshape(n * k), k, key, iters)
  return centroids


def encode_codebook(x: jax.Array, codebook: jax.Array, bits: int) -> jax.Array:
  """Nearest-codeword indices of every block, packed per row.

  Args:
    x: float ``(rows, D)``.
    codebook: ``(2**bits, block)``.
    bits: bits per code.

  Returns:
    uint32 ``(rows, packed_words(ceil(D / block), bits))``.
  """
  block = codebook.shape[1]
  blocks = to_blocks(jnp.asarray(x, jnp.float32), block)
  rows, nb, _ = blocks.shape
  codes = _nearest(blocks.reshape(rows * nb, block), codebook).reshape(rows, nb)
  return jax.vmap(lambda c: pack_bits(c, bits))(codes)


def decode_codebook(words: jax.Array, codebook: jax.Array, bits: int, dim: int) -> jax.Array:
  """Rows from packed codes: fp32 ``(rows, dim)``."""
  block = codebook.shape[1]
  nb = num_blocks(dim, block)
  codes = jax.vmap(lambda w: unpack_bits(w, bits, nb))(words)
  rows = codes.shape[0]
  return codebook[codes.astype(jnp.int32)].reshape(rows, nb * block)[:, :dim]

