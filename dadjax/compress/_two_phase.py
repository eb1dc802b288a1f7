"""The two-phase route of an elementwise compressor: a quantized all-reduce.

An all-gather of every site's payload costs each site ``(N-1) * B`` wire
bits, growing with the number of sites ``N``. The two-phase route costs
about ``2 (N-1)/N * B`` at any ``N``, as DeepSpeed ZeRO++'s qgZ and torchft's
quantized collectives do:

1. every site flattens all its gradient leaves into one fp32 vector of ``D``
   entries, pads it to ``N`` chunks of ``m`` entries (``m`` a multiple of 32,
   so each chunk packs into whole uint32 words) and quantizes each chunk on
   its own, with its own scales (one fp32 scale per :data:`BLOCK` = 512
   entries of the chunk, or per QSGD bucket);
2. an all-to-all sends chunk ``j`` to site ``j`` (a reduce-scatter of the
   quantized chunks);
3. site ``j`` dequantizes the ``N`` versions of its chunk and averages them in
   fp32 (sign: sums the votes as integers);
4. it quantizes the average again, with noise of its own (an independent
   second stochastic rounding: the estimate stays unbiased, since
   ``E[Q2(mean_i Q1(g_i))] = mean_i g_i``);
5. an all-gather of the re-quantized chunks gives every site the whole mean.

Error feedback (:func:`~dadjax.compress.error_feedback`) wraps the route as
any compressor: the residual it keeps is ``g + e - Q1(g + e)``, the first
quantization's error, on the site that made it. The second quantization's
error is made once per chunk, by the chunk's owner, on the *average*; it is
the same on every site and lands in the step every site applies; no site
keeps it (for an unbiased quantizer it is zero-mean noise; for sign, scaled
sign and the round-to-nearest fp8 cast it is a bias no memory corrects).

Wire: per site, the all-to-all sends ``(N-1)/N`` of the phase-one buffer
and the all-gather ``(N-1)`` times one re-quantized chunk. The ledger books
both at their storage sizes (codes, scales, the padding of the last chunk
to whole words) as all-gather traffic: the all-to-all as one destination's
row (:func:`dadjax.comm.metered_all_to_all`).

References:
  Wang et al., "ZeRO++: Extremely Efficient Collective Communication for
  Giant Model Training" (qgZ), 2023 (https://arxiv.org/abs/2306.10209);
  Bernstein et al., "signSGD with Majority Vote is Communication Efficient
  and Fault Tolerant", ICLR 2019 (https://arxiv.org/abs/1810.05291).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.keys import derive_key
from dadjax._core.packing import WORD_BITS, pack_bits, unpack_bits
from dadjax._core.trees import check_float_leaves, tree_nbits
from dadjax.comm import (NO_TRAFFIC, axis_size, metered_all_gather, metered_all_to_all,
                         site_index, traffic_add)
from dadjax.compress._base import Compressor, Exchanged, as_keys, one_round_exchange

ROUTES = ("one_round", "two_phase", "auto")

# Entries per fp32 scale of a chunk on the two-phase route (ZeRO++ qgZ's block quantization):
# +1/16 bit per entry. A chunk cuts across leaves of very different magnitudes; one scale per
# chunk (~232,000 entries on a 1.86M MLP at N = 8) let QSGD's second rounding diverge.
BLOCK = 512


class Layout(NamedTuple):
  """Where each entry of the flat gradient sits: ``sites`` chunks of ``chunk`` entries.

  Attributes:
    sites: ``N``.
    chunk: entries per chunk ``m`` (a multiple of 32).
    size: real entries ``D`` (the rest of ``N * m`` is padding).
    ends: the flat end of each leaf (cumulative sizes), a tuple of ``L`` ints.
  """

  sites: int
  chunk: int
  size: int
  ends: tuple

  @property
  def leaves(self) -> int:
    return len(self.ends)

  def positions(self, rows: jax.Array) -> jax.Array:
    """Flat positions of the entries of chunks ``rows``: ``int32[R, m]``."""
    return rows[:, None] * self.chunk + jnp.arange(self.chunk, dtype=jnp.int32)

  def leaf_of(self, rows: jax.Array) -> jax.Array:
    """The leaf of each entry of chunks ``rows`` (padding: the last leaf), ``int32[R, m]``.

    Computed, not stored: a constant table of every position would be folded
    by XLA at compile time (seconds for 2M entries).
    """
    ends = jnp.asarray(self.ends[:-1], jnp.int32)
    method = "compare_all" if len(ends) <= 64 else "sort"  # the default scan is slow on CPU
    return jnp.searchsorted(ends, self.positions(rows), side="right", method=method).astype(jnp.int32)

  def valid(self, rows: jax.Array) -> jax.Array:
    """Whether each entry of chunks ``rows`` is real (not padding), ``bool[R, m]``."""
    return self.positions(rows) < self.size


def layout(sizes: list[int], sites: int) -> Layout:
  """The chunk layout of leaves of ``sizes`` entries over ``sites`` sites."""
  d = sum(sizes)
  m = WORD_BITS * max(1, -(-d // (sites * WORD_BITS)))
  return Layout(sites, m, d, tuple(int(e) for e in np.cumsum(sizes)))


class Codec(NamedTuple):
  """How a compressor encodes chunks on the two-phase route.

  Buffers are uint32 (codes and fp32 scales bit-cast), one row per chunk, so
  what moves is exactly what the ledger books and no collective is 8- or
  16-bit (XLA:CPU would widen those when it compiles).

  Attributes:
    encode: ``(v f32[R, m], key, rows int32[R], lay) -> u32[R, w]``; ``rows``
      are the chunks' indices (:class:`Layout` gives their entries' leaves).
    decode: ``(buf u32[R, w], rows, lay) -> f32[R, m]``.
    combine: ``(received u32[N, w], mine, lay) -> f32[m]``, the value the
      owner of chunk ``mine`` sends in phase two; ``None``: the fp32 mean of
      the decoded rows.
    encode2, decode2: phase two's pair; ``None``: ``encode`` / ``decode``.
  """

  encode: Callable[..., jax.Array]
  decode: Callable[..., jax.Array]
  combine: Callable[..., jax.Array] | None = None
  encode2: Callable[..., jax.Array] | None = None
  decode2: Callable[..., jax.Array] | None = None


def check_route(route: str) -> str:
  """``route`` if it is one of :data:`ROUTES`, else a ``ValueError`` naming it."""
  if route not in ROUTES:
    raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
  return route


def check_block(block) -> int | None:
  if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
    raise ValueError(f"block must be None or an int >= 1, got {block!r}")
  return block


# -- helpers the codecs share ---------------------------------------------------------------


def blocks(m: int, block: int | None) -> tuple[int, int]:
  """``(entries per block, blocks per chunk)`` of a chunk of ``m`` entries."""
  b = m if block is None else min(block, m)
  return b, -(-m // b)


def per_block(v: jax.Array, block: int | None, reduce: Callable) -> jax.Array:
  """``reduce(v_block, axis=-1)`` of each block of each row: ``[R, nb]`` (padding: zeros)."""
  r, m = v.shape
  b, nb = blocks(m, block)
  return reduce(jnp.pad(v, ((0, 0), (0, nb * b - m))).reshape(r, nb, b), axis=-1)


def to_entries(scale: jax.Array, m: int, block: int | None) -> jax.Array:
  """Per-block ``scale`` ``[R, nb]`` repeated to the entries: ``[R, m]``."""
  b, _ = blocks(m, block)
  return jnp.repeat(scale, b, axis=-1)[:, :m]


def pack_rows(codes: jax.Array, bits: int) -> jax.Array:
  """Codes ``[R, m]`` (``m`` a multiple of 32) packed per row: ``u32[R, m * bits / 32]``."""
  r = codes.shape[0]
  return pack_bits(codes.reshape(-1), bits).reshape(r, -1)


def unpack_rows(words: jax.Array, bits: int, m: int) -> jax.Array:
  r = words.shape[0]
  return unpack_bits(words.reshape(-1), bits, r * m).reshape(r, m)


def with_scales(scales: jax.Array, words: jax.Array) -> jax.Array:
  """One uint32 buffer: the fp32 ``scales`` bit-cast, then the code ``words``."""
  return jnp.concatenate([jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint32),
                          words], axis=1)


def split_scales(buf: jax.Array, bits: int, m: int, block: int) -> tuple[jax.Array, jax.Array]:
  """A :func:`with_scales` buffer of ``m``-entry rows read back: ``(scale of each entry
  f32[R, m], codes u32[R, m])``, one scale per ``block`` entries, ``bits`` per code."""
  nb = blocks(m, block)[1]
  scales = jax.lax.bitcast_convert_type(buf[:, :nb], jnp.float32)
  return to_entries(scales, m, block), unpack_rows(buf[:, nb:], bits, m)


def noise(draw: Callable, key: jax.Array, shape: tuple[int, int]) -> jax.Array:
  return draw(key, math.prod(shape)).reshape(shape)


# -- the route ------------------------------------------------------------------------------


def _flatten(grads):
  leaves, treedef = jax.tree.flatten(grads)
  flat = jnp.concatenate([jnp.ravel(x).astype(jnp.float32) for x in leaves]) if leaves else \
      jnp.zeros((0,), jnp.float32)
  return leaves, treedef, flat


def _unflatten(flat, leaves, treedef, size):
  out, start = [], 0
  flat = flat.reshape(-1)[:size]
  for x in leaves:
    out.append(flat[start:start + x.size].reshape(x.shape).astype(x.dtype))
    start += x.size
  return jax.tree.unflatten(treedef, out)


def _phase_keys(key, name: str):
  return (derive_key(key.site, name, "two_phase", 1), derive_key(key.site, name, "two_phase", 2))


def two_phase_exchange(codec: Codec, grads: Any, key: Any, axis_name: str | None,
                       name: str = "") -> tuple[Any, Any, Any]:
  """Run the two phases on ``grads``: ``(mean, local, traffic)`` (module docstring).

  ``local`` is the decoding of this site's own phase-one chunks (what error
  feedback subtracts); ``mean`` is the decoded all-gather of phase two.
  """
  key = as_keys(key)
  n = axis_size(axis_name)
  leaves, treedef, flat = _flatten(grads)
  if flat.size == 0:
    return grads, grads, NO_TRAFFIC
  lay = layout([x.size for x in leaves], n)
  v = jnp.pad(flat, (0, n * lay.chunk - lay.size)).reshape(n, lay.chunk)
  k1, k2 = _phase_keys(key, name)
  rows = jnp.arange(n, dtype=jnp.int32)
  sent = codec.encode(v, k1, rows, lay)
  local = _unflatten(codec.decode(sent, rows, lay), leaves, treedef, lay.size)
  received, t1 = metered_all_to_all(sent, axis_name)
  mine = jnp.asarray(site_index(axis_name), jnp.int32)
  if codec.combine is None:
    owned = jnp.mean(codec.decode(received, jnp.full((n,), mine), lay), axis=0)
  else:
    owned = codec.combine(received, mine, lay)
  encode2 = codec.encode if codec.encode2 is None else codec.encode2
  decode2 = codec.decode if codec.decode2 is None else codec.decode2
  chunk = encode2(owned[None], k2, mine[None], lay)
  gathered, t2 = metered_all_gather(chunk[0], axis_name)
  mean = _unflatten(decode2(gathered, rows, lay), leaves, treedef, lay.size)
  return mean, local, traffic_add(t1, t2)


def two_phase_bits(codec: Codec, like: Any, num_sites: int) -> tuple[int, int]:
  """Payload bits of the two phases for gradients like ``like`` over ``num_sites`` sites.

  Returns:
    ``(all_to_all_buffer_bits, all_gather_chunk_bits)``: the whole phase-one
    buffer a site hands to the all-to-all, and the one chunk it hands to the
    all-gather (trace-time ints, from the codec's shapes).
  """
  leaves = jax.tree.leaves(like)
  sizes = [math.prod(jnp.shape(x)) for x in leaves]
  if sum(sizes) == 0:
    return 0, 0
  lay = layout(sizes, num_sites)
  n, m = num_sites, lay.chunk
  key = jax.random.key(0)
  rows = jax.ShapeDtypeStruct((n,), jnp.int32)
  one = jax.eval_shape(lambda v, r: codec.encode(v, key, r, lay),
                       jax.ShapeDtypeStruct((n, m), jnp.float32), rows)
  encode2 = codec.encode if codec.encode2 is None else codec.encode2
  two = jax.eval_shape(lambda v, r: encode2(v, key, r, lay),
                       jax.ShapeDtypeStruct((1, m), jnp.float32),
                       jax.ShapeDtypeStruct((1,), jnp.int32))
  return tree_nbits(one), tree_nbits(two)


def route_wire_bits(compressor: Compressor, like: Any, num_sites: int) -> dict[str, float]:
  """Ring wire bits per site of each route of ``compressor`` for gradients like ``like``.

  Args:
    compressor: a compressor built with a ``route`` (:func:`two_phase`).
    like: the gradients (arrays or ``ShapeDtypeStruct``).
    num_sites: ``N``.

  Returns:
    ``{"one_round": bits, "two_phase": bits}`` (``two_phase`` absent when the
    compressor has no two-phase form).
  """
  codec = getattr(compressor.exchange, "codec", None)
  base = getattr(compressor.exchange, "base", compressor)
  out = {"one_round": _one_round_wire(base, like, num_sites)}
  if codec is not None:
    a2a, chunk = two_phase_bits(codec, like, num_sites)
    out["two_phase"] = float((num_sites - 1) * (a2a // num_sites + chunk))
  return out


def _one_round_wire(base: Compressor, like: Any, n: int) -> float:
  like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), like)
  payload = jax.eval_shape(lambda g: base.compress(g, base.init(g), jax.random.key(0))[0], like)
  bits = tree_nbits(payload)
  if base.communication == "reduce":
    return 2 * (n - 1) / n * bits
  return float((n - 1) * bits)


def two_phase(base: Compressor, codec: Codec, route: str = "two_phase") -> Compressor:
  """``base`` on the named route: its own one collective, the two phases, or the cheaper.

  Args:
    base: an elementwise compressor (its one-round form).
    codec: its chunk :class:`Codec` for the two phases.
    route: ``"one_round"`` (``base`` unchanged: one all-gather, or one
      all-reduce for the casts), ``"two_phase"`` (module docstring) or
      ``"auto"``: per number of sites ``N`` and per gradient shapes, at trace
      time, whichever of the two puts fewer ring wire bits on the wire
      (:func:`route_wire_bits`; a tie keeps one round).

  Returns:
    A :class:`Compressor` with ``base``'s compress / decompress / bits and,
    for ``"two_phase"`` / ``"auto"``, an ``exchange`` of its own (stateless;
    not shardable within a site: the chunks cut across leaves).

  Raises:
    ValueError: if ``route`` is not one of :data:`ROUTES`.

  References:
    Wang et al., "ZeRO++" (qgZ), 2023 (https://arxiv.org/abs/2306.10209).
  """
  check_route(route)
  if route == "one_round":
    return base
  name = base.name

  def exchange(grads, state, key, axis_name):
    check_float_leaves(grads, name or "two_phase")
    n = axis_size(axis_name)
    if route == "auto":
      wire = route_wire_bits(two_phase(base, codec, "two_phase"), grads, n)
      if not wire["two_phase"] < wire["one_round"]:
        return one_round_exchange(base, grads, state, key, axis_name)
    mean, local, traffic = two_phase_exchange(codec, grads, key, axis_name, name)
    return Exchanged(mean, local, state, traffic)

  exchange.codec, exchange.base = codec, base  # read by route_wire_bits
  suffix = "" if route == "two_phase" else "_auto"
  return base._replace(exchange=exchange, shardable=False,
                       name=f"{name}_two_phase{suffix}" if name else f"two_phase{suffix}")


def chosen_route(compressor: Compressor, like: Any, num_sites: int) -> str:
  """The route ``compressor`` takes for gradients like ``like`` over ``num_sites`` sites."""
  codec = getattr(compressor.exchange, "codec", None)
  if codec is None:
    return "one_round"
  if not compressor.name.endswith("_auto"):
    return "two_phase"
  wire = route_wire_bits(compressor, like, num_sites)
  return "two_phase" if wire["two_phase"] < wire["one_round"] else "one_round"


def route_arg(auto: str):
  """The catalog's ``route`` option (``qsgd:16:route=two_phase``); ``auto`` says where auto switches."""
  from dadjax.registry import Arg  # pylint: disable=g-import-not-at-top
  return Arg("route", str, choices=ROUTES, positional=False,
             doc=f"one_round (one collective), two_phase (all-to-all of quantized chunks, fp32 "
                 f"sums, all-gather) or auto (the fewer wire bits; {auto})")
