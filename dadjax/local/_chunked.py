"""Top-k per chunk (optionally of DCT coefficients, optionally with quantized values).

The compressor SparseLoCo and DeMo send: every tensor is cut into chunks
(:mod:`dadjax.local._dct`), each chunk keeps its ``k`` largest-magnitude
entries (the set and order of the catalog's :func:`~dadjax.compress.topk` on every chunk),
the kept values travel as they are or through a stateless quantizer of the
catalog (``terngrad``: 2 bits), and their positions inside the chunk travel
packed at ``ceil(log2(chunk size))`` bits each (12 bits for a 64 x 64 block).
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from dadjax._core.packing import code_bits, pack_leaf, unpack_leaf
from dadjax._core.trees import check_float_leaves, tree_nbits
from dadjax.comm import in_site_axes, in_site_devices
from dadjax.compress import Compressor, EmptyState
from dadjax.local._dct import ChunkLayout, chunk_layout, from_chunks, to_chunks


class ChunkedPayload(NamedTuple):
  """What a site sends: the kept values (raw, or the quantizer's payload) and packed positions.

  Attributes:
    values: a tuple with one ``grid + (k,)`` array per leaf (``grid``: the leaf's
      :attr:`~dadjax.local.ChunkLayout.grid` of chunks), or the value quantizer's payload
      of that tuple.
    positions: a tuple with one uint32 word array per leaf: the kept
      positions inside their chunks, ``code_bits(chunk size)`` bits each.
  """

  values: Any
  positions: tuple


def _kept(layout: ChunkLayout, k: int) -> int:
  return min(k, layout.size)


def chunked_topk(k: int = 32, chunk: int = 64, *, dct: bool = False,
                 values: Compressor | None = None) -> Compressor:
  """Keep the ``k`` largest-magnitude entries of every chunk of every tensor.

  Each tensor is cut into ``a x b`` blocks of at most ``chunk x chunk``
  entries (vectors: 1-D chunks of at most ``chunk``; see
  :mod:`dadjax.local._dct`); with ``dct=True`` each block is first replaced
  by its orthonormal DCT-II coefficients (DeMo). Every chunk keeps its
  ``min(k, chunk size)`` largest coefficients by magnitude (ties to the
  lower position, :func:`~dadjax.compress.topk`'s rule). Sites all-gather
  the payloads; the average is the sum of every site's sparse chunks over
  the number of sites, brought back by the inverse DCT.

  Args:
    k: entries kept per chunk, an int >= 1 (DeMo: 32; SparseLoCo: 64 of a
      4096-entry block, 1.56%).
    chunk: target block side ``s``, an int >= 1 (both papers: 64).
    dct: select DCT coefficients instead of entries.
    values: a stateless compressor of the kept values (each tensor's
      ``grid + (k,)`` values are one leaf for it), e.g.
      ``dadjax.compress.terngrad()`` for 2 bits; ``None`` sends them in the
      tensor's dtype.

  Returns:
    A ``"gather"`` :class:`~dadjax.compress.Compressor` whose payload is a
    :class:`ChunkedPayload`; its bits are the payload's storage size.

  Raises:
    ValueError: ``k`` or ``chunk`` not an int >= 1, ``values`` not a
      compressor; at ``init``, a stateful ``values`` compressor.

  References:
    B. Peng, J. Quesnelle, D. P. Kingma, "DeMo: Decoupled Momentum
    Optimization", 2024 (https://arxiv.org/abs/2411.19870); A. Sarfi et al.,
    "Communication Efficient LLM Pre-training with SparseLoCo", 2025
    (https://arxiv.org/abs/2508.15706).
  """
  for name, v in (("k", k), ("chunk", chunk)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"chunked_topk: {name} must be an int >= 1, got {v!r}")
  if values is not None and not isinstance(values, Compressor):
    raise ValueError(f"chunked_topk: values must be None or a dadjax Compressor (e.g. "
                     f"dadjax.compress.terngrad()), got {type(values).__name__}")
  opts = _Chunked(k, chunk, bool(dct), values, ("dct_" if dct else "") + "chunked_topk")
  bound = lambda f: functools.partial(f, opts)
  return Compressor(bound(_init), bound(_compress), bound(_decompress), tree_nbits, "gather",
                    bound(_aggregate), name=opts.name)


class _Chunked(NamedTuple):
  """The options of :func:`chunked_topk`, checked."""

  k: int
  chunk: int
  dct: bool
  values: Compressor | None
  name: str


def _layouts(opts: _Chunked, tree) -> list[ChunkLayout]:
  return [chunk_layout(tuple(jnp.shape(x)), opts.chunk) for x in jax.tree.leaves(tree)]


def _values_like(opts: _Chunked, tree):
  """The tree of kept values: one ``grid + (k,)`` array per leaf, paths kept."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [
      jax.ShapeDtypeStruct(lay.grid + (_kept(lay, opts.k),), jnp.result_type(x))
      for x, lay in zip(leaves, _layouts(opts, tree))])


def _init(opts: _Chunked, params):
  check_float_leaves(params, opts.name)
  if opts.values is not None and jax.tree.leaves(opts.values.init(_values_like(opts, params))):
    raise ValueError(f"{opts.name}: values must be a stateless compressor (no error feedback, no "
                     "warm start): the kept values are new every exchange")
  return EmptyState()


_NEGATIVE, _NAN = 1 << 30, 1 << 29  # flags beside a position (< 2**29) in a sort's operand


def _select(opts: _Chunked, rows: jax.Array, layout: ChunkLayout):
  """The catalog's top-k on every chunk (the last axis of ``rows``): ``(values, positions)``,
  each ``rows.shape[:-1] + (k,)``.

  The entries and order of :func:`~dadjax.compress.topk` per chunk: ``top_k`` of the
  magnitudes (largest first, ties to the lower position, NaN first) and the values at its
  positions; above half the chunk, the same set in ascending position, found by one stable
  sort of the magnitudes carrying each entry's position and sign. Run on each device's own
  chunks (:func:`_on_own_chunks`): the SPMD partitioner aborted the TPU compiler on the
  batched gather of a chunk split over many chips (``Check failed:
  partition_group_list.num_replica_groups() * ...``), and a sort of every chunk instead
  compiled 3x slower than ``top_k``.
  """
  kept = _kept(layout, opts.k)
  if 2 * kept <= layout.size:
    _, positions = jax.lax.top_k(jnp.abs(rows), kept)
    return jnp.take_along_axis(rows, positions, axis=-1), positions.astype(jnp.int32)
  if layout.size >= _NAN:
    raise ValueError(f"{opts.name}: a chunk of {layout.size} entries is too large")
  nan = jnp.isnan(rows)
  key = jnp.where(nan, -jnp.inf, -jnp.abs(rows))  # ascending: the largest magnitude first
  code = (jax.lax.broadcasted_iota(jnp.int32, rows.shape, rows.ndim - 1)
          | jnp.where(rows < 0, _NEGATIVE, 0) | jnp.where(nan, _NAN, 0))
  key, code = jax.lax.sort((key, code), dimension=rows.ndim - 1, is_stable=True, num_keys=1)
  key, code = key[..., :kept], code[..., :kept]
  values = jnp.where(code & _NAN, jnp.nan, jnp.where(code & _NEGATIVE, key, -key))
  positions = code & (_NAN - 1)
  # topk's order for a large k: ascending positions
  positions, values = jax.lax.sort((positions, values), dimension=rows.ndim - 1, num_keys=1)
  return values.astype(rows.dtype), positions


def _on_own_chunks(fn, layout: ChunkLayout, *arrays):
  """``fn(*arrays)`` for ``arrays`` of ``layout.grid + (n,)`` (``n`` of each its own), run on
  each device's own chunks when sites are groups of devices.

  ``fn`` maps arrays with any leading chunk axes to outputs with the same ones. Inside the
  sites' partially manual ``shard_map`` the SPMD partitioner gathers a scatter's or a
  gather's operands on every chip of the site; here the chunks are one axis, padded to a
  multiple of the site's devices, and each device applies ``fn`` to its run of them in a
  manual region (a column-split tensor gets there by one all-to-all of its shard).
  """
  axes = in_site_axes()
  if not axes:
    return fn(*arrays)
  pad = -layout.chunks % in_site_devices(axes)
  flat = [jnp.pad(a.reshape(layout.chunks, -1), ((0, pad), (0, 0))) for a in arrays]
  out = jax.shard_map(fn, in_specs=(P(axes),) * len(flat), out_specs=P(axes),
                      axis_names=set(axes))(*flat)
  return jax.tree.map(lambda o: o[:layout.chunks].reshape(layout.grid + o.shape[1:]), out)


def _compress(opts: _Chunked, grads, state, key):
  check_float_leaves(grads, opts.name)
  leaves, treedef = jax.tree.flatten(grads)
  kept, words = [], []
  for x, lay in zip(leaves, _layouts(opts, grads)):
    vals, pos = _on_own_chunks(lambda rows, lay=lay: _select(opts, rows, lay), lay,
                               to_chunks(x, lay, opts.dct, grid=True))
    kept.append(vals.astype(x.dtype))
    words.append(pack_leaf(pos.astype(jnp.uint32), code_bits(lay.size)))
  vals = jax.tree.unflatten(treedef, kept)
  if opts.values is not None:
    vals, _ = opts.values.compress(vals, EmptyState(), key)
  return ChunkedPayload(vals, tuple(words)), state


def _rows_of(opts: _Chunked, payload, like, key, sites: bool = False) -> list:
  """Every leaf's dense ``grid + (size,)`` rows of coefficients (fp32), from one payload, or
  their sum over the gathered payloads of ``sites`` (a leading axis on every leaf): all sites'
  entries are added into one buffer per leaf, never one dense copy per site."""
  vals = payload.values
  if opts.values is not None:
    def decode(v):
      return opts.values.decompress(v, _values_like(opts, like), key)
    vals = jax.vmap(decode)(vals) if sites else decode(vals)
  out = []
  for lay, v, w in zip(_layouts(opts, like), jax.tree.leaves(vals), payload.positions):
    shape = lay.grid + (_kept(lay, opts.k),)
    pos = unpack_leaf(w, code_bits(lay.size), shape).astype(jnp.int32)
    v = v.astype(jnp.float32)
    if sites:  # (sites,) + grid + (kept,) -> grid + (sites * kept,)
      pos, v = (jnp.moveaxis(a, 0, -2).reshape(lay.grid + (-1,)) for a in (pos, v))
    out.append(_on_own_chunks(lambda p, w, size=lay.size: _add_at_positions(p, w, size), lay,
                              pos, v))
  return out


def _add_at_positions(pos: jax.Array, v: jax.Array, size: int) -> jax.Array:
  """Chunks of ``size`` zeros with ``v`` added at ``pos`` along the last axis, in fp32."""
  # each grid axis indexed by an iota: a scatter the SPMD partitioner splits as the grid is
  # split (under vmap, as batching dimensions, it aborts the TPU compiler on 1,024 chips)
  grid = tuple(jax.lax.broadcasted_iota(jnp.int32, pos.shape, d) for d in range(pos.ndim - 1))
  return jnp.zeros(pos.shape[:-1] + (size,), jnp.float32).at[(*grid, pos)].add(v)


def _back(opts: _Chunked, rows: list, like):
  leaves, treedef = jax.tree.flatten(like)
  return jax.tree.unflatten(treedef, [
      from_chunks(r, lay, opts.dct).astype(jnp.result_type(x))
      for r, x, lay in zip(rows, leaves, _layouts(opts, like))])


def _decompress(opts: _Chunked, payload, like, key):
  return _back(opts, _rows_of(opts, payload, like, key), like)


def _aggregate(opts: _Chunked, gathered, like, key):
  n = jax.tree.leaves(gathered)[0].shape[0]
  # the inverse DCT is linear: average the coefficients, transform once
  return _back(opts, [r / n for r in _rows_of(opts, gathered, like, key, sites=True)], like)


def chunked_bits(shapes: list[tuple[int, ...]], k: int, chunk: int, value_bits: int = 32,
                 scale_bits: int = 0) -> int:
  """The payload bits :func:`chunked_topk` sends for tensors of ``shapes``, from the layout alone.

  Values: ``value_bits`` per kept entry (packed in 32-bit words when below
  32) plus ``scale_bits`` per tensor; positions: ``code_bits(chunk size)``
  bits per kept entry, packed in uint32 words (:mod:`dadjax._core.packing`).
  """
  total = 0
  for shape in shapes:
    lay = chunk_layout(tuple(shape), chunk)
    n = lay.chunks * _kept(lay, k)
    total += 32 * math.ceil(n / 32) * code_bits(lay.size)
    total += n * value_bits if value_bits == 32 else 32 * math.ceil(n / 32) * value_bits
    total += scale_bits
  return total
