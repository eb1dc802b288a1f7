"""Quantizers: QSGD, TernGrad, signSGD (majority vote), scaled sign (EF-signSGD) and b-bit.

Every quantizer sends a few fp32 scales plus bit-packed integer codes
(:mod:`dadjax._core.packing`), so the bytes handed to the all-gather
are exactly the bits the ledger records. Each also has a two-phase route
(``route="two_phase"`` / ``"auto"``, :mod:`dadjax.compress._two_phase`): a
quantized all-reduce whose cost does not grow with the number of sites.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.keys import hash_unit
from dadjax._core.validate import check_int
from dadjax._core.linalg import safe_norm
from dadjax._core.shards import leaf_shard, slice_uniform, threefry_unit, whole_max, whole_size, whole_sum
import dadjax.compress._segments as seg
from dadjax.compress._base import Compressor, leafwise
import dadjax.compress._two_phase as tp
from dadjax.compress._two_phase import Codec, route_arg, two_phase
from dadjax._core.packing import code_bits, pack_bits, pack_leaf, unpack_bits, unpack_leaf
from dadjax.registry import Arg, register_compressor


class QuantizedPayload(NamedTuple):
  """fp32 ``scale`` (scalar, or one per bucket) and packed uint32 ``words``."""

  scale: jax.Array
  words: jax.Array


def _size(like) -> int:
  return math.prod(like.shape)


def _signed(magnitude, negative):
  return jnp.where(negative, -magnitude, magnitude)


def _whole_norm(x: jax.Array) -> jax.Array:
  """The whole tensor's Euclidean norm, without underflow of the squares.

  ``s * ||x / s||`` with ``s = max |x|`` reduced over every axis of the leaf
  in its own shape (a flatten of a leaf sharded over a later axis would
  gather it); for a slice of a sharded leaf ``s`` and the sum of squares are
  taken over the whole tensor.
  """
  if leaf_shard() is None and x.ndim <= 1:
    return safe_norm(x.reshape(-1))
  top = whole_max(jnp.max(jnp.abs(x)))
  safe = jnp.where(top > 0, top, 1.0)
  return jnp.sqrt(whole_sum(jnp.sum(jnp.square(x / safe)))) * top


NOISES = ("threefry", "hash")


def _noise_draw(noise: str):
  """``draw(key, n) -> (n,)`` uniform [0, 1) rounding noise of the named source."""
  if noise not in NOISES:
    raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
  return threefry_unit if noise == "threefry" else hash_unit


def _segment_noise(noise: str, keys: jax.Array, lay) -> jax.Array:
  """The one-buffer form's noise: every leaf's ``draw(keys[i], d)``, in the buffer's layout."""
  if noise == "threefry":
    return seg.segment_uniform(keys, lay)
  return seg.segments([hash_unit(keys[i], d) for i, d in enumerate(lay.counts)], lay, 0.0)


_NOISE_ARG = Arg("noise", str, choices=NOISES, positional=False,
                 doc="rounding noise: threefry (jax.random) or hash (a counter hash, ~9x faster)")


@register_compressor("qsgd", Arg("levels", int, within="[1, inf)", doc="non-zero levels s"),
                     Arg("bucket_size", int, within="[1, inf)", doc="entries per norm"),
                     _NOISE_ARG, route_arg("two_phase from N = 3 sites"))
def qsgd(levels: int = 16, bucket_size: int | None = None, noise: str = "threefry",
         route: str = "one_round") -> Compressor:
  """QSGD: stochastic rounding of ``|g_i| / ||g||_2`` onto ``levels`` levels.

  For a bucket ``v`` (the whole tensor by default) each entry becomes
  ``||v||_2 * sign(v_i) * l_i / s`` with ``s = levels`` and ``l_i`` in
  ``{0, ..., s}`` rounded up with probability ``s |v_i| / ||v||_2 - floor(.)``,
  so the estimate is unbiased. The rounding noise comes from the per-site
  key. Each entry travels as ``1 + ceil(log2(s + 1))`` bits (sign and
  level, packed); each bucket adds its fp32 norm. A zero bucket sends zeros.

  Args:
    levels: ``s``, the number of non-zero quantization levels, ``>= 1``
      (``s = 1`` is ternary). The paper's experiments use 2-8 bits per entry.
    bucket_size: entries sharing one norm (the paper uses 512 in its
      experiments); ``None`` means one norm per tensor.
    noise: the rounding noise, ``"threefry"`` (``jax.random.uniform``, the
      default) or ``"hash"`` (:func:`dadjax._core.keys.hash_unit`: a counter
      hash on the same float grid, several times cheaper to draw; spec
      ``qsgd:16:noise=hash``).
    route: ``"one_round"`` (all-gather of the payloads), ``"two_phase"``
      (:func:`~dadjax.compress.two_phase`: one norm per ``bucket_size``
      entries of a chunk, 512 by default) or ``"auto"``; spec
      ``qsgd:16:route=two_phase``.

  Returns:
    A ``"gather"`` :class:`Compressor`.

  Raises:
    ValueError: if ``levels < 1``, ``bucket_size < 1``, ``noise`` or
      ``route`` is unknown.

  References:
    Alistarh et al., "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", NeurIPS 2017 (https://arxiv.org/abs/1610.02132).
  """
  s = check_int("levels", levels, 1)
  if bucket_size is not None:
    bucket_size = check_int("bucket_size", bucket_size, 1)
  draw = _noise_draw(noise)
  opts = _Qsgd(s, 1 + code_bits(s + 1), bucket_size, noise, draw)
  bound = lambda f: functools.partial(f, opts)
  base = leafwise(bound(_qsgd_compress_leaf), bound(_qsgd_decompress_leaf), "gather",
                  name="qsgd", shardable=bucket_size is None)
  return two_phase(seg.segmented(base, bound(_qsgd_compress_all), bound(_qsgd_decode_all)),
                   _qsgd_codec(s, opts.bits, bucket_size or tp.BLOCK, draw), route)


class _Qsgd(NamedTuple):
  """The options of :func:`qsgd`, checked: ``s`` levels, ``bits`` per entry, buckets, noise."""

  s: int
  bits: int
  bucket_size: int | None
  noise: str
  draw: Any


def _qsgd_buckets(opts: _Qsgd, d: int) -> tuple[int, int]:
  """Bucket length and number of buckets of a leaf of ``d`` entries."""
  b = d if opts.bucket_size is None else min(opts.bucket_size, d)
  return b, -(-d // b)


def _qsgd_compress_leaf(opts: _Qsgd, x, key):
  if opts.bucket_size is None:  # one norm per tensor, codes in the leaf's shape (pack_leaf)
    v = x.astype(jnp.float32)
    norm = _whole_norm(v)  # no underflow of tiny g^2
    codes = _qsgd_codes(v, norm, slice_uniform(key.site, x.shape, opts.draw), opts.s)
    return QuantizedPayload(norm, pack_leaf(codes, opts.bits))
  flat = x.reshape(-1).astype(jnp.float32)  # buckets run along the flattened leaf
  d = flat.shape[0]
  b, nb = _qsgd_buckets(opts, d)
  v = jnp.pad(flat, (0, nb * b - d)).reshape(nb, b)
  norm = safe_norm(v, axis=1)  # no overflow of 1e30^2 nor underflow of 1e-30^2
  codes = _qsgd_codes(v, norm[:, None], opts.draw(key.site, v.size).reshape(v.shape), opts.s)
  return QuantizedPayload(norm, pack_bits(codes.reshape(-1)[:d], opts.bits))


def _qsgd_decompress_leaf(opts: _Qsgd, p, like, key):
  del key
  d = _size(like)
  if opts.bucket_size is None:
    codes = unpack_leaf(p.words, opts.bits, like.shape)
    return _qsgd_values(codes, p.scale, opts.s).astype(like.dtype)
  b, _ = _qsgd_buckets(opts, d)
  codes = unpack_bits(p.words, opts.bits, d)
  norm = jnp.repeat(p.scale, b)[:d]
  return _qsgd_values(codes, norm, opts.s).reshape(like.shape).astype(like.dtype)


def _qsgd_entry_norms(opts: _Qsgd, norm, d: int):
  """A leaf's norm(s) (batch + () or batch + (buckets,)) repeated to its entries: batch + (d,)."""
  if opts.bucket_size is None:
    return jnp.broadcast_to(norm[..., None], norm.shape + (d,))
  return jnp.repeat(norm, _qsgd_buckets(opts, d)[0], axis=-1)[..., :d]


def _qsgd_compress_all(opts: _Qsgd, xs, paths, key):
  """Every leaf's codes in one segmented buffer (one noise draw, one packing)."""
  flats = [x.reshape(-1).astype(jnp.float32) for x in xs]
  lay = seg.layout([f.size for f in flats])
  if opts.bucket_size is None:
    norms = [safe_norm(f) for f in flats]
  else:
    norms = [safe_norm(jnp.pad(f, (0, nb * b - f.size)).reshape(nb, b), axis=1)
             for f in flats for b, nb in [_qsgd_buckets(opts, f.size)]]
  norm = seg.segments([_qsgd_entry_norms(opts, n, f.size) for n, f in zip(norms, flats)], lay,
                      1.0)
  u = _segment_noise(opts.noise, seg.leaf_site_keys(key.site, "qsgd", paths), lay)
  words = seg.pack_segments(_qsgd_codes(seg.segments(flats, lay), norm, u, opts.s), opts.bits,
                            lay)
  return [QuantizedPayload(n, w) for n, w in zip(norms, words)]


def _qsgd_decode_all(opts: _Qsgd, payloads, likes):
  lay = seg.layout(seg.sizes_of(likes))
  codes = seg.unpack_segments([p.words for p in payloads], opts.bits, lay)
  norm = seg.segments([_qsgd_entry_norms(opts, p.scale, d) for p, d in zip(payloads, lay.counts)],
                      lay, 1.0)
  return seg.split(_qsgd_values(codes, norm, opts.s), lay)


def _qsgd_codec(s: int, bits: int, block: int, draw) -> Codec:
  """QSGD's chunks: one norm per ``block`` entries of a chunk."""

  def encode(v, key, rows, lay):
    del rows, lay
    norm = tp.per_block(v, block, lambda x, axis: safe_norm(x, axis=axis))
    codes = _qsgd_codes(v, tp.to_entries(norm, v.shape[1], block), tp.noise(draw, key, v.shape), s)
    return tp.with_scales(norm, tp.pack_rows(codes, bits))

  def decode(buf, rows, lay):
    del rows
    norm, codes = tp.split_scales(buf, bits, lay.chunk, block)
    return _qsgd_values(codes, norm, s)

  return Codec(encode, decode)


def _qsgd_codes(v, norm, noise, s):
  """QSGD's codes ``level << 1 | negative`` of entries ``v`` with (broadcast) norms and uniform noise."""
  scaled = jnp.abs(v) / jnp.where(norm > 0, norm, 1.0) * s
  lower = jnp.floor(scaled)
  up = noise < scaled - lower
  level = jnp.minimum(lower + up, s).astype(jnp.uint32)
  return (level << 1) | (v < 0).astype(jnp.uint32)


def _qsgd_values(codes, norm, s):
  """fp32 values of QSGD codes with per-entry norms."""
  magnitude = (codes >> 1).astype(jnp.float32) * (norm / s)
  return _signed(magnitude, (codes & 1) == 1)


@register_compressor("terngrad", Arg("clip", float, within="(0, inf)", doc="clip at clip * std"),
                     _NOISE_ARG, route_arg("two_phase from N = 3 sites"))
def terngrad(clip: float | None = 2.5, noise: str = "threefry",
             route: str = "one_round") -> Compressor:
  """TernGrad: ``max|g| * sign(g_i) * Bernoulli(|g_i| / max|g|)`` per tensor.

  Unbiased for the (clipped) gradient; the Bernoulli draws come from the
  per-site key. Each entry travels as 2 bits (non-zero, negative), each
  tensor adds its fp32 scale ``max|g|``.

  Args:
    clip: clip each tensor to ``[-clip * sigma, clip * sigma]`` before
      ternarizing, as the paper does (``c = 2.5``); ``None`` disables it
      (then the estimate is unbiased for the raw gradient). ``sigma =
      sqrt(mean(g^2))`` is the standard deviation about 0 of the paper's
      zero-mean gradient model; unlike the sample standard deviation it is
      non-zero for every non-zero tensor, so scalar, one-entry and
      constant tensors are not clipped to 0 (they are sent exactly).
    noise: the Bernoulli draws' noise, ``"threefry"`` (default) or
      ``"hash"`` (as :func:`qsgd`'s).
    route: ``"one_round"``, ``"two_phase"`` or ``"auto"`` (as :func:`qsgd`'s).
      On the two-phase route each 512 entries of a chunk have their own
      scale (and clipping bound); the chunk owner ternarizes the fp32 mean again
      without clipping, so the estimate stays unbiased for the clipped
      gradients.

  Returns:
    A ``"gather"`` :class:`Compressor`.

  Raises:
    ValueError: if ``clip`` is not ``None`` or a number ``> 0``, or ``noise``
      or ``route`` is unknown.

  References:
    Wen et al., "TernGrad: Ternary Gradients to Reduce Communication in
    Distributed Deep Learning", NeurIPS 2017 (https://arxiv.org/abs/1705.07878).
  """
  if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                           or not clip > 0):
    raise ValueError(f"clip must be None or a number > 0, got {clip!r}")
  draw = _noise_draw(noise)

  def compress_leaf(x, key):
    v = x.astype(jnp.float32)  # in the leaf's shape (pack_leaf)
    if clip is not None:
      bound = clip * _whole_norm(v) / math.sqrt(whole_size(v.size))  # no underflow of g^2
      v = jnp.clip(v, -bound, bound)
    scale = whole_max(jnp.max(jnp.abs(v)))
    u = slice_uniform(key.site, x.shape, draw)
    return QuantizedPayload(scale, pack_leaf(_terngrad_codes(v, scale, u), 2))

  def decompress_leaf(p, like, key):
    del key
    codes = unpack_leaf(p.words, 2, like.shape)
    return _terngrad_values(codes, p.scale).astype(like.dtype)

  def compress_all(xs, paths, key):
    flats = [x.reshape(-1).astype(jnp.float32) for x in xs]
    lay = seg.layout([f.size for f in flats])
    v = seg.segments(flats, lay)
    if clip is not None:
      bounds = [clip * safe_norm(f) / math.sqrt(f.size) for f in flats]
      v = jnp.clip(v, -seg.per_entry(bounds, lay), seg.per_entry(bounds, lay))
      # max |clip(x, -b, b)| = min(max |x|, b), exactly
      scales = [jnp.minimum(jnp.max(jnp.abs(f)), b) for f, b in zip(flats, bounds)]
    else:
      scales = [jnp.max(jnp.abs(f)) for f in flats]
    u = _segment_noise(noise, seg.leaf_site_keys(key.site, "terngrad", paths), lay)
    codes = _terngrad_codes(v, seg.per_entry(scales, lay), u)
    return [QuantizedPayload(c, w) for c, w in zip(scales, seg.pack_segments(codes, 2, lay))]

  def decode_all(payloads, likes):
    lay = seg.layout(seg.sizes_of(likes))
    codes = seg.unpack_segments([p.words for p in payloads], 2, lay)
    return seg.split(_terngrad_values(codes, seg.per_entry([p.scale for p in payloads], lay)), lay)

  base = leafwise(compress_leaf, decompress_leaf, "gather", name="terngrad", shardable=True)
  return two_phase(seg.segmented(base, compress_all, decode_all), _terngrad_codec(clip, draw),
                    route)


def _valid_counts(rows, lay, block):
  """Real (not padding) entries of each block of the chunks ``rows``: ``[R, nb]``, at least 1."""
  valid = lay.valid(rows).astype(jnp.float32)
  return jnp.maximum(tp.per_block(valid, block, jnp.sum), 1.0)


def _terngrad_codec(clip: float | None, draw) -> Codec:
  """TernGrad's chunks: one scale per block; phase two does not clip (the mean stays unbiased)."""
  block = tp.BLOCK

  def encoder(clipping):
    def encode(v, key, rows, lay):
      m = v.shape[1]
      if clipping is not None:
        norm = tp.per_block(v, block, lambda x, axis: safe_norm(x, axis=axis))
        bound = tp.to_entries(clipping * norm / jnp.sqrt(_valid_counts(rows, lay, block)), m,
                              block)
        v = jnp.clip(v, -bound, bound)
      scale = tp.per_block(jnp.abs(v), block, jnp.max)
      codes = _terngrad_codes(v, tp.to_entries(scale, m, block), tp.noise(draw, key, v.shape))
      return tp.with_scales(scale, tp.pack_rows(codes, 2))
    return encode

  def decode(buf, rows, lay):
    del rows
    scale, codes = tp.split_scales(buf, 2, lay.chunk, block)
    return _terngrad_values(codes, scale)

  return Codec(encoder(clip), decode, encode2=encoder(None))


def _terngrad_codes(flat, scale, noise):
  """TernGrad's 2-bit codes ``negative << 1 | kept`` (``scale`` broadcasts against ``flat``)."""
  keep = noise < jnp.abs(flat) / jnp.where(scale > 0, scale, 1.0)
  return keep.astype(jnp.uint32) | ((flat < 0).astype(jnp.uint32) << 1)


def _terngrad_values(codes, scale):
  """fp32 values of TernGrad codes with (broadcast) scales."""
  magnitude = (codes & 1).astype(jnp.float32) * scale
  return _signed(magnitude, (codes >> 1) == 1)


def _sign_codes(x):
  """1 bit per entry, in ``x``'s shape: 1 for negative, 0 for non-negative (sign(0) = +1)."""
  return (x < 0).astype(jnp.uint32)


@register_compressor("sign", route_arg("two_phase from N = 4 sites"))
def sign(route: str = "one_round") -> Compressor:
  """signSGD with majority vote: send 1-bit signs, apply the sign of their sum.

  Each site sends ``sign(g_i)`` (``sign(0) = +1``, the paper's convention)
  packed 32 per uint32 word, plus one bit per tensor that says the site's
  whole tensor is zero (a parameter without gradient, e.g. an unused head):
  such a site abstains. Sites all-gather the words and every site applies
  the elementwise majority ``sign(sum_voting sites sign(g_i))`` (0 on a tie,
  and 0 when every site abstains, so a parameter without gradient stays
  where it is). On one site the result is ``sign(g)`` (0 for a zero
  tensor). Use a small learning rate, as the paper does.

  Args:
    route: ``"one_round"`` (all-gather of the signs), ``"two_phase"`` or
      ``"auto"`` (spec ``sign:route=two_phase``). On the two-phase route each
      site sends each chunk's 1-bit signs and its per-tensor abstain bits to
      the chunk's owner, who counts the votes as integers and all-gathers
      their 2-bit sign (``+1``, ``-1`` or ``0`` on a tie): the result equals
      the all-gather's majority vote exactly, for ``(N-1)/N * (1 + 2)`` wire
      bits per entry instead of ``N - 1``.

  Returns:
    A ``"gather"`` :class:`Compressor` of ``32 + 32 * ceil(d / 32)`` bits
    per tensor of ``d`` entries (the signs, packed in the tensor's shape, and
    one word for the abstain bit; the opt-in one-buffer form packs that bit
    after the signs: ``32 * ceil((d + 1) / 32)``).

  References:
    Bernstein et al., "signSGD: Compressed Optimisation for Non-Convex
    Problems", ICML 2018 (https://arxiv.org/abs/1802.04434); Bernstein et
    al., "signSGD with Majority Vote is Communication Efficient and Fault
    Tolerant", ICLR 2019 (https://arxiv.org/abs/1810.05291).
  """

  base = leafwise(_sign_compress_leaf, _sign_decompress_leaf, "gather", _sign_aggregate_leaf,
                  name="sign", shardable=True)
  return two_phase(seg.segmented(base, _sign_compress_all, _sign_decode_all, _sign_aggregate_all),
                   _sign_codec(), route)


def _sign_compress_leaf(x, key):
  """One tensor: its 1-bit signs packed in its shape (:func:`pack_leaf`) and, in one word of its
  own (a bit appended to the signs would flatten a sharded leaf), the abstain flag."""
  del key
  abstain = whole_max(jnp.max(jnp.abs(x))) == 0  # the whole tensor has no gradient here
  return pack_leaf(_sign_codes(x), 1), abstain.astype(jnp.uint32)[None]


def _sign_decompress_leaf(payload, like, key):
  """One site's votes: +-1, or 0 everywhere when it abstained."""
  del key
  words, abstain = payload
  votes = jnp.where(unpack_leaf(words, 1, like.shape) == 1, -1.0, 1.0) * (abstain[0] == 0)
  return votes.astype(like.dtype)


def _sign_aggregate_leaf(gathered, like, key):
  """The majority of the voting sites (0 on a tie), counted as integers in the leaf's shape."""
  del key
  words, abstain = gathered  # (sites, ...) each
  negatives = jnp.sum(unpack_leaf(words, 1, like.shape), axis=0, dtype=jnp.int32)
  voters = words.shape[0] - jnp.sum(abstain, dtype=jnp.int32)  # abstainers send +0
  return jnp.sign(voters - 2 * negatives).astype(like.dtype)


def _sign_flags(lay):
  """Buffer positions of each leaf's abstain code (right after its ``d`` signs)."""
  return np.array([o + d - 1 for o, d in zip(lay.offsets, lay.counts)])


def _sign_compress_all(xs, paths, key):
  """Every tensor's signs and abstain bit in one segmented buffer."""
  del paths, key
  lay = seg.layout([x.size + 1 for x in xs])
  abstain = jnp.stack([jnp.max(jnp.abs(x)) == 0 for x in xs]).astype(jnp.uint32)
  codes = seg.segments([_sign_codes(x).reshape(-1) for x in xs], lay).at[
      _sign_flags(lay)].set(abstain)
  return seg.pack_segments(codes, 1, lay)


def _sign_decode_all(payloads, likes):
  """One site's votes of every tensor, from the segmented buffer."""
  lay = seg.layout([d + 1 for d in seg.sizes_of(likes)])
  codes = seg.unpack_segments(payloads, 1, lay)
  voting = seg.per_entry(list(jnp.moveaxis(codes[..., _sign_flags(lay)] == 0, -1, 0)), lay)
  votes = jnp.where(codes == 1, -1.0, 1.0) * voting
  return [v[..., :-1] for v in seg.split(votes, lay)]


def _sign_aggregate_all(gathered, likes):
  """The majority vote of every tensor, from the sites' segmented buffers."""
  lay = seg.layout([d + 1 for d in seg.sizes_of(likes)])
  codes = seg.unpack_segments(gathered, 1, lay)  # (sites, N)
  negatives = jnp.sum(codes, axis=0, dtype=jnp.int32)
  voters = codes.shape[0] - jnp.sum(codes[:, _sign_flags(lay)], axis=0, dtype=jnp.int32)
  vote = jnp.sign(seg.per_entry(list(voters), lay) - 2 * negatives)
  return [v[:-1].reshape(l.shape).astype(l.dtype) for v, l in zip(seg.split(vote, lay), likes)]


def _sign_codec() -> Codec:
  """Majority vote in two phases: 1-bit signs and abstain bits in, 2-bit votes out."""

  def mask_words(lay):
    return -(-lay.leaves // 32)

  def encode(v, key, rows, lay):
    del key
    # A site abstains on a tensor that is zero here (as on the one-round route); every chunk
    # carries the site's abstain bit of every tensor, so its owner can count the voters.
    leaf_of = lay.leaf_of(rows).reshape(-1)
    top = jax.ops.segment_max(jnp.abs(v).reshape(-1), leaf_of, lay.leaves)
    mask = pack_bits((top <= 0).astype(jnp.uint32), 1)
    signs = tp.pack_rows((v < 0).astype(jnp.uint32), 1)
    return jnp.concatenate([jnp.broadcast_to(mask, (v.shape[0], mask.shape[0])), signs], axis=1)

  def unpack(buf, lay):
    w = mask_words(lay)
    abstain = jax.vmap(lambda x: unpack_bits(x, 1, lay.leaves))(buf[:, :w]).astype(jnp.int32)
    return abstain, tp.unpack_rows(buf[:, w:], 1, lay.chunk).astype(jnp.int32)

  def decode(buf, rows, lay):
    abstain, negative = unpack(buf, lay)
    leaf_of = lay.leaf_of(rows)
    silent = jnp.take_along_axis(abstain, leaf_of, axis=1)
    return jnp.where(negative == 1, -1.0, 1.0) * (1 - silent)

  def combine(received, mine, lay):
    abstain, negative = unpack(received, lay)  # (sites, L), (sites, m)
    leaf_of = lay.leaf_of(mine[None])[0]
    voters = received.shape[0] - jnp.sum(abstain, axis=0)[leaf_of]
    return jnp.sign(voters - 2 * jnp.sum(negative, axis=0)).astype(jnp.float32)

  def encode2(vote, key, rows, lay):
    del key, rows, lay
    return tp.pack_rows((vote != 0).astype(jnp.uint32) | ((vote < 0).astype(jnp.uint32) << 1), 2)

  def decode2(buf, rows, lay):
    del rows
    return _terngrad_values(tp.unpack_rows(buf, 2, lay.chunk), 1.0)

  return Codec(encode, decode, combine, encode2, decode2)


@register_compressor("scaled_sign", route_arg("two_phase from N = 3 sites"))
def scaled_sign(route: str = "one_round") -> Compressor:
  """Scaled sign: ``(||g||_1 / d) * sign(g)`` per tensor (EF-signSGD's compressor).

  Each tensor travels as one fp32 scale plus 1-bit signs; sites all-gather
  and average. Biased: use it with :func:`error_feedback`
  (``"ef_scaled_sign"``), which is EF-signSGD. A zero tensor sends scale 0.

  Args:
    route: ``"one_round"``, ``"two_phase"`` (one scale per 512 entries of a chunk;
      the owner sends the scaled sign of the chunk's mean) or ``"auto"``.

  Returns:
    A ``"gather"`` :class:`Compressor` of ``32 + 32 * ceil(d / 32)`` bits
    per tensor.

  References:
    Karimireddy et al., "Error Feedback Fixes SignSGD and other Gradient
    Compression Schemes", ICML 2019 (https://arxiv.org/abs/1901.09847).
  """

  def compress_leaf(x, key):
    del key
    total = whole_sum(jnp.sum(jnp.abs(x.astype(jnp.float32))))
    return QuantizedPayload(total / whole_size(x.size), pack_leaf(_sign_codes(x), 1))

  def decompress_leaf(p, like, key):
    del key
    negative = unpack_leaf(p.words, 1, like.shape) == 1
    return _signed(p.scale, negative).astype(like.dtype)

  def compress_all(xs, paths, key):
    del paths, key
    lay = seg.layout([x.size for x in xs])
    scales = [jnp.sum(jnp.abs(x.astype(jnp.float32))) / x.size for x in xs]
    words = seg.pack_segments(seg.segments([_sign_codes(x).reshape(-1) for x in xs], lay), 1,
                              lay)
    return [QuantizedPayload(c, w) for c, w in zip(scales, words)]

  def decode_all(payloads, likes):
    lay = seg.layout(seg.sizes_of(likes))
    negative = seg.unpack_segments([p.words for p in payloads], 1, lay) == 1
    return seg.split(_signed(seg.per_entry([p.scale for p in payloads], lay), negative), lay)

  base = leafwise(compress_leaf, decompress_leaf, "gather", name="scaled_sign", shardable=True)
  return two_phase(seg.segmented(base, compress_all, decode_all), _scaled_sign_codec(), route)


def _scaled_sign_codec() -> Codec:
  """Scaled sign's chunks: the mean magnitude of each block's real entries, and 1-bit signs."""
  block = tp.BLOCK

  def encode(v, key, rows, lay):
    del key
    scale = tp.per_block(jnp.abs(v), block, jnp.sum) / _valid_counts(rows, lay, block)
    return tp.with_scales(scale, tp.pack_rows((v < 0).astype(jnp.uint32), 1))

  def decode(buf, rows, lay):
    del rows
    scale, codes = tp.split_scales(buf, 1, lay.chunk, block)
    return _signed(scale, codes == 1)

  return Codec(encode, decode)


def _int_codes(v, scale, noise, top):
  """Unbiased stochastic rounding of ``v / scale * top`` to integers in ``[-top, top]``, offset by
  ``top`` (codes in ``[0, 2 top]``)."""
  scaled = v / jnp.where(scale > 0, scale, 1.0) * top
  lower = jnp.floor(scaled)
  level = jnp.clip(lower + (noise < scaled - lower), -top, top)
  return (level + top).astype(jnp.uint32)


def _int_values(codes, scale, top):
  return (codes.astype(jnp.float32) - top) * (scale / top)


@register_compressor("quantize", Arg("bits", int, within="[2, 16]", doc="bits per entry"),
                     _NOISE_ARG, route_arg("two_phase from N = 3 sites"))
def quantize(bits: int = 8, noise: str = "threefry", route: str = "one_round") -> Compressor:
  """Quantize to ``bits`` bits with stochastic rounding: ``2^(b-1) - 1`` levels each side of 0.

  Each tensor (each 512 entries of a chunk on the two-phase route) sends its fp32 scale
  ``max |g|`` and every entry as the integer ``l_i`` in ``[-L, L]``,
  ``L = 2^(b-1) - 1``, rounded from ``L g_i / max|g|`` up with probability
  equal to the fractional part: ``E[scale * l_i / L] = g_i`` (unbiased).

  Args:
    bits: bits per entry ``b``, in ``[2, 16]``.
    noise: rounding noise, ``"threefry"`` or ``"hash"`` (as :func:`qsgd`'s).
    route: ``"one_round"`` (all-gather), ``"two_phase"`` or ``"auto"`` (spec
      ``quantize:4:route=two_phase``).

  Returns:
    A ``"gather"`` :class:`Compressor` of ``32 + b * 32 * ceil(d / 32)`` bits
    per tensor of ``d`` entries.

  Raises:
    ValueError: if ``bits`` is outside ``[2, 16]``, ``noise`` or ``route`` is
      unknown.

  References:
    Gupta et al., "Deep Learning with Limited Numerical Precision", ICML 2015
    (https://arxiv.org/abs/1502.02551) (stochastic rounding); Wang et al.,
    "ZeRO++" (qgZ's block quantization), 2023 (https://arxiv.org/abs/2306.10209).
  """
  b = check_int("bits", bits, 2)
  if b > 16:
    raise ValueError(f"bits must be an int in [2, 16], got {bits!r}")
  tp.check_route(route)
  draw = _noise_draw(noise)
  top = float(2 ** (b - 1) - 1)

  def compress_leaf(x, key):
    v = x.astype(jnp.float32)  # in the leaf's shape (pack_leaf)
    scale = whole_max(jnp.max(jnp.abs(v)))
    u = slice_uniform(key.site, x.shape, draw)
    return QuantizedPayload(scale, pack_leaf(_int_codes(v, scale, u, top), b))

  def decompress_leaf(p, like, key):
    del key
    codes = unpack_leaf(p.words, b, like.shape)
    return _int_values(codes, p.scale, top).astype(like.dtype)

  def encode(v, key, rows, lay):
    del rows, lay
    scale = tp.per_block(jnp.abs(v), tp.BLOCK, jnp.max)
    entries = tp.to_entries(scale, v.shape[1], tp.BLOCK)
    return tp.with_scales(scale, tp.pack_rows(_int_codes(v, entries, tp.noise(draw, key, v.shape),
                                                         top), b))

  def decode(buf, rows, lay):
    del rows
    scale, codes = tp.split_scales(buf, b, lay.chunk, tp.BLOCK)
    return _int_values(codes, scale, top)

  base = leafwise(compress_leaf, decompress_leaf, "gather", name=f"quantize{b}", shardable=True)
  return two_phase(base, Codec(encode, decode), route)
