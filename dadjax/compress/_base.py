"""The compressor protocol and the one-round exchange every transform uses.

A compressor is a bundle of pure functions on pytrees (no collectives):

* ``init(params) -> state``
* ``compress(grads, state, key) -> (payload, state)``
* ``decompress(payload, like, key) -> grads``; ``like`` is a pytree with the
  gradients' structure, shapes and dtypes (arrays or ``ShapeDtypeStruct``)
* ``bits(payload) -> int | Bits``: exact size of the payload on the wire
* ``communication``: ``"reduce"`` (the payload is linear, so sites ``psum``
  it and decompress the sum) or ``"gather"`` (sites all-gather payloads and
  ``aggregate`` combines them; by default the mean of their decompressions)

Randomness comes only from ``key``, a :class:`Keys` pair: ``shared`` is the
same on every site (for choices sites must agree on, e.g. RandomK indices or
PowerSGD's initial ``Q``), ``site`` is this site's own and drives
independent per-site noise (stochastic rounding). ``decompress`` and
``aggregate`` may use only ``shared``: they also decode other sites'
payloads. Keys are derived with domain separation (:func:`derive_key`):
the shared and site keys of a step come from different branches of the
seed, and each leaf's keys fold in the method's name and the leaf's *path*
(not its position), so two transforms under ``optax.partition`` with the
same seed draw different keys, and no site key equals any leaf's shared key.

A compressor whose collective cannot be written as one psum / all-gather of
a payload (PowerSGD's two rounds) supplies ``exchange`` itself; every other
compressor gets :func:`one_round_exchange`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.keys import derive_key, derive_keys
from dadjax._core.shards import current_leaf, shard_axes
from dadjax._core.trees import check_float_leaves, leaf_path, tree_cast_like, tree_nbits, tree_scale
from dadjax.comm import (Bits, Traffic, axis_size, metered_all_gather, metered_psum,  # noqa: F401
                         site_index)

COMMUNICATIONS = ("reduce", "gather")

# Whether leafwise compressors run each group of same-shape leaves as one vmap (read at trace
# time; the per-leaf loop is the reference the tests compare against).
GROUP_SAME_SHAPES = True
# Leaves with more entries run alone: their kernels are large enough that launching one per leaf
# costs little, while stacking them costs a copy (QSGD on ResNet-18, whose 2.4M-entry convs
# were grouped, stepped at 1.70x the fp32 step against 1.48x per leaf).
GROUP_MAX_ENTRIES = 1 << 20


class Keys(NamedTuple):
  """The randomness of one step: ``shared`` by all sites, and this ``site``'s own."""

  shared: jax.Array
  site: jax.Array


def as_keys(key: Keys | jax.Array) -> Keys:
  """Accept a :class:`Keys` or a plain key (one site: ``site = derive_key(key, "site", 0)``)."""
  if isinstance(key, Keys):
    return key
  return Keys(key, derive_key(key, "site", 0))


def step_keys(seed: int, step: jax.Array, axis_name: str | None) -> Keys:
  """Keys of a step, equal ``shared`` on every site and one ``site`` key per site.

  ``shared = fold_in(derive_key(key(seed), "shared"), step)`` and
  ``site = fold_in(fold_in(derive_key(key(seed), "site"), step), site_index)``:
  the two come from separate branches of the seed, so no site key is a
  shared (or leaf) key of any step.
  """
  root = jax.random.key(seed)
  shared = jax.random.fold_in(derive_key(root, "shared"), step)
  site = jax.random.fold_in(jax.random.fold_in(derive_key(root, "site"), step),
                            site_index(axis_name))
  return Keys(shared, site)


def leaf_keys(keys: Keys, leaf: int | str, method: str = "") -> Keys:
  """The keys of one leaf: both keys folded with ``(method, "leaf", leaf)``.

  Args:
    keys: the step's :class:`Keys`.
    leaf: the leaf's path (``"['block']['kernel']"``, preferred: it does not
      depend on which other leaves a transform sees) or position.
    method: the compressor's name.
  """
  return Keys(derive_key(keys.shared, method, "leaf", leaf),
              derive_key(keys.site, method, "leaf", leaf))


class Exchanged(NamedTuple):
  """Result of an exchange.

  Attributes:
    mean: the decompressed average over sites (what the optimizer applies).
    local: the decompression of this site's own payload (error feedback).
    state: the compressor's new state.
    traffic: bits and collective calls of this site.
  """

  mean: Any
  local: Any
  state: Any
  traffic: Traffic


class Compressor(NamedTuple):
  """A gradient compressor: pure functions on pytrees (see module docstring).

  Attributes:
    init: ``params -> state``.
    compress: ``(grads, state, key) -> (payload, state)``.
    decompress: ``(payload, like, key) -> grads``.
    bits: ``payload -> int | Bits``, the exact bits this site sends.
    communication: ``"reduce"`` or ``"gather"``.
    aggregate: for ``"gather"``: ``(gathered, like, key) -> grads`` where each
      leaf of ``gathered`` has a leading site axis; ``None`` means the mean of
      the per-site decompressions.
    exchange: ``(grads, state, key, axis_name) -> Exchanged`` for protocols
      that are not one collective of one payload; ``None`` means
      :func:`one_round_exchange`.
    memory: ``True`` when the compressor already keeps an error-feedback
      memory of its own (PowerSGD with ``error_feedback=True``, or anything
      :func:`~dadjax.compress.error_feedback` returned); wrapping it in
      ``error_feedback`` again then returns it unchanged.
    name: the method's name (error messages and key separation).
    shardable: kept for compatibility; changes nothing since 0.5 (the step
      gives every compressor whole logical tensors, sharded or not:
      :mod:`dadjax._core.shards`). Goes in the next minor version.
  """

  init: Callable[[Any], Any]
  compress: Callable[[Any, Any, Any], tuple[Any, Any]]
  decompress: Callable[[Any, Any, Any], Any]
  bits: Callable[[Any], int | Bits]
  communication: str
  aggregate: Callable[[Any, Any, Any], Any] | None = None
  exchange: Callable[[Any, Any, Any, str | None], Exchanged] | None = None
  memory: bool = False
  name: str = ""
  shardable: bool = False


class EmptyState(NamedTuple):
  """State of a stateless compressor."""


def mean_of_decompressed(compressor: Compressor, gathered: Any, like: Any, key: Keys) -> Any:
  """Default ``aggregate``: average the decompression of every site's payload."""
  per_site = jax.vmap(lambda p: compressor.decompress(p, like, key))(gathered)
  return jax.tree.map(lambda x: jnp.mean(x, axis=0), per_site)


def _short_range(payload: Any) -> float:
  """The largest finite value of the payload's float types narrower in range than fp32
  (fp16: 65504), or 0 if there is none (fp32, bf16)."""
  tops = [float(jnp.finfo(x.dtype).max) for x in jax.tree.leaves(payload)
          if jnp.issubdtype(x.dtype, jnp.floating)
          and jnp.finfo(x.dtype).maxexp < jnp.finfo(jnp.float32).maxexp]
  return min(tops, default=0.0)


def one_round_exchange(compressor: Compressor, grads: Any, state: Any, key: Any,
                       axis_name: str | None) -> Exchanged:
  """Compress, one collective over ``axis_name``, decompress and average.

  Args:
    compressor: a :class:`Compressor` with ``exchange=None``.
    grads: this site's gradients.
    state: the compressor's state.
    key: :class:`Keys` of this step (``shared`` equal on every site).
    axis_name: the sites' axis; ``None`` is one site.

  Returns:
    :class:`Exchanged`; ``mean`` has the dtypes of ``grads``.
  """
  key = as_keys(key)
  before = state
  payload, state = compressor.compress(grads, before, key)
  if compressor.communication == "reduce":
    n = axis_size(axis_name)
    # Decode in (at least) fp32 and divide before casting back: a sum of fp16
    # gradients that each fit fp16 may not.
    wide = jax.tree.map(lambda g: jax.ShapeDtypeStruct(
        jnp.shape(g), jnp.promote_types(jnp.result_type(g), jnp.float32)), grads)
    top = _short_range(payload)
    if n > 1 and top:
      # The wire sum itself may overflow (fp16): each site sends its share of the
      # mean, as PyTorch's fp16 hook does (the payload is linear, so this is exact),
      # saturated so that the sum of n shares fits.
      share = jax.tree.map(lambda g: jnp.clip(g / n, -top / n, top / n).astype(g.dtype), grads)
      payload, state = compressor.compress(share, before, key)
      local = tree_cast_like(tree_scale(compressor.decompress(payload, wide, key), n), grads)
      summed, traffic = metered_psum(payload, axis_name)
      mean = compressor.decompress(summed, wide, key)
    else:
      local = compressor.decompress(payload, grads, key)
      summed, traffic = metered_psum(payload, axis_name)
      mean = tree_scale(compressor.decompress(summed, wide, key), 1.0 / n)
  else:
    local = compressor.decompress(payload, grads, key)
    gathered, traffic = metered_all_gather(payload, axis_name)
    if compressor.aggregate is None:
      mean = mean_of_decompressed(compressor, gathered, grads, key)
    else:
      mean = compressor.aggregate(gathered, grads, key)
  bits = compressor.bits(payload)
  kind_bits = traffic.reduce if compressor.communication == "reduce" else traffic.gather
  if isinstance(bits, int) and bits != kind_bits:
    # The payload's storage size is what moves; a compressor's own count
    # must agree with it (a mismatch is a bug in the compressor).
    raise ValueError(f"compressor.bits reports {bits} bits but its payload holds {kind_bits}")
  if not isinstance(bits, int):  # data-dependent size (traced): the compressor's count
    traffic = traffic._replace(**{compressor.communication: bits})
  return Exchanged(tree_cast_like(mean, grads), local, state, traffic)


def exchange(compressor: Compressor, grads: Any, state: Any, key: Any,
             axis_name: str | None) -> Exchanged:
  """Run ``compressor``'s exchange (its own, or :func:`one_round_exchange`)."""
  if compressor.exchange is not None:
    return compressor.exchange(grads, state, as_keys(key), axis_name)
  return one_round_exchange(compressor, grads, state, key, axis_name)


def leafwise(
    compress_leaf: Callable[[jax.Array, Keys], Any],
    decompress_leaf: Callable[[Any, Any, Keys], jax.Array],
    communication: str,
    aggregate_leaf: Callable[[Any, Any, Keys], jax.Array] | None = None,
    *,
    name: str = "",
    shardable: bool = False,
    group_same_shapes: bool = True,
) -> Compressor:
  """A stateless compressor applied to each leaf separately.

  Each leaf gets :func:`leaf_keys` ``(key, path, name)`` with its key path,
  so ``decompress`` and ``aggregate`` need a ``like`` with the gradients'
  structure. Leaves of one shape and dtype (a transformer's blocks repeat a
  handful of shapes over a hundred leaves) run as one ``jax.vmap`` of the
  leaf function over the stacked group, so the program holds one kernel per
  shape rather than per leaf (:func:`same_shape_groups`); each leaf still
  gets its own keys and its own statistics, so the results are the per-leaf
  loop's (bit for bit on XLA:CPU, tests/test_compress_hlo.py). Leaves of
  more than :data:`GROUP_MAX_ENTRIES` (2^20) entries run one at a time, and
  so does ``compress`` of every leaf when parameters are sharded within a
  site (its whole-tensor statistics depend on each leaf's slicing; decoding
  needs none). The
  payload is a tuple with one entry per leaf, and its size is its storage
  size (:func:`tree_nbits`). Empty leaves (a 0 in the shape) send nothing
  (an empty entry ``()``) and decompress to an empty array, so the leaf
  functions never see one. Leaves must be floating point: any other dtype
  raises a ``ValueError`` naming the leaf.

  Args:
    compress_leaf: ``(x, keys) -> leaf payload``.
    decompress_leaf: ``(leaf payload, like_leaf, keys) -> x``.
    communication: ``"reduce"`` or ``"gather"``.
    aggregate_leaf: ``(gathered leaf payload, like_leaf, keys) -> x`` or
      ``None`` (mean of decompressions).
    name: the method's name, folded into the keys.
    shardable: the compressor's ``shardable`` flag (see :class:`Compressor`).
    group_same_shapes: run same-shape leaves as one ``vmap`` (default). A
      compressor whose leaf function gathers or scatters at data-dependent
      indices passes ``False``: batched, XLA:CPU's top-k, gather and scatter
      ran TopK 7.8x the fp32 step on the ViT, against 1.2x one leaf at a time
      (``experiments/results/bench_scale.md``).

  Returns:
    A :class:`Compressor`.
  """
  if communication not in COMMUNICATIONS:
    raise ValueError(f"communication must be one of {COMMUNICATIONS}, got {communication!r}")
  opts = _Leafwise(name, group_same_shapes)
  decompress = functools.partial(_over_leaves, opts, decompress_leaf)
  if aggregate_leaf is None:
    aggregate_leaf = functools.partial(_mean_leaf, decompress_leaf)
  return Compressor(functools.partial(_leafwise_init, opts),
                    functools.partial(_leafwise_compress, opts, compress_leaf), decompress,
                    tree_nbits, communication,
                    functools.partial(_over_leaves, opts, aggregate_leaf), name=name,
                    shardable=shardable)


class _Leafwise(NamedTuple):
  """The options of :func:`leafwise` its parts share."""

  name: str
  group_same_shapes: bool

  @property
  def what(self) -> str:
    return self.name or "compressor"


def _leafwise_init(opts: _Leafwise, params):
  check_float_leaves(params, opts.what)
  return EmptyState()


def _leafwise_compress(opts: _Leafwise, compress_leaf, grads, state, key):
  """``compress_leaf`` on every leaf with its own keys, a group of same-shape leaves at a time."""
  key = as_keys(key)
  check_float_leaves(grads, opts.what)
  leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
  paths = [leaf_path(p) for p, _ in leaves]
  xs = [x for _, x in leaves]
  payload = [()] * len(xs)
  if shard_axes() is not None:  # sharded: whole-tensor statistics need each leaf's own slicing
    for i, x in enumerate(xs):
      with current_leaf(paths[i]):
        payload[i] = () if _empty(x) else compress_leaf(x, leaf_keys(key, paths[i], opts.name))
    return tuple(payload), state
  every_key = group_keys(key, paths, opts.name)  # one batched derivation for all leaves
  for group in same_shape_groups(xs, opts.group_same_shapes):
    outs = _vmapped(compress_leaf, [xs[i] for i in group], _rows(every_key, group))
    for i, out in zip(group, outs):
      payload[i] = out
  return tuple(payload), state


def _mean_leaf(decompress_leaf, gathered, like, key):
  """The mean of every site's decompressed leaf (the default ``aggregate_leaf``)."""
  per_site = jax.vmap(lambda p: decompress_leaf(p, like, key))(gathered)
  return jnp.mean(per_site.astype(jnp.float32), axis=0).astype(like.dtype)


def _over_leaves(opts: _Leafwise, leaf_fn, payload, like, key):
  """``leaf_fn(payload_i, like_i, keys_i)`` over the whole payload tuple, a group of same-shape
  leaves at a time."""
  key = as_keys(key)
  like_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
  likes = [l for _, l in like_leaves]
  out = [jnp.zeros(l.shape, l.dtype) if _empty(l) else None for l in likes]
  every_key = group_keys(key, [leaf_path(p) for p, _ in like_leaves], opts.name)
  for group in same_shape_groups(likes, opts.group_same_shapes):
    like0 = likes[group[0]]
    results = _vmapped(lambda p, k: leaf_fn(p, like0, k), [payload[i] for i in group],
                       _rows(every_key, group))
    for i, r in zip(group, results):
      out[i] = r
  return jax.tree.unflatten(treedef, out)


def _empty(x) -> bool:
  return math.prod(jnp.shape(x)) == 0


def grouping() -> bool:
  """Whether leafwise work runs grouped by shape now (:data:`GROUP_SAME_SHAPES`, read at trace
  time)."""
  return GROUP_SAME_SHAPES


def same_shape_groups(leaves: list, group: bool = True) -> list[list[int]]:
  """Positions of the non-empty ``leaves`` grouped by (shape, dtype), in first-seen order
  (each leaf alone when ``group`` or :data:`GROUP_SAME_SHAPES` is off, or when it has more
  than :data:`GROUP_MAX_ENTRIES` entries)."""
  groups: dict[tuple, list[int]] = {}
  for i, x in enumerate(leaves):
    if not _empty(x):
      size = math.prod(jnp.shape(x))
      together = group and GROUP_SAME_SHAPES and size <= GROUP_MAX_ENTRIES
      shape_key = (tuple(jnp.shape(x)), jnp.dtype(x.dtype)) if together else i
      groups.setdefault(shape_key, []).append(i)
  return list(groups.values())


def group_keys(key: Keys, paths: list[str], method: str) -> Keys:
  """:func:`leaf_keys` of each path, stacked (leading axis: the group), bit for bit."""
  parts = [(method, "leaf", p) for p in paths]
  return Keys(derive_keys(key.shared, parts), derive_keys(key.site, parts))


def _rows(keys: Keys, group: list[int]) -> Keys:
  """The keys of the leaves at ``group`` (static positions) of a stacked :class:`Keys`.

  The leaves' keys come from one :func:`group_keys` for the whole tree: each derivation is
  a threefry hash, and the TPU compiler spent about 0.6 s of a quantizer's 3 s step compile
  on one per group of same-shape leaves (docs/placement.md, "Compiled for the pod").
  """
  index = np.asarray(group)
  return Keys(keys.shared[index], keys.site[index])


def _vmapped(leaf_fn: Callable, args: list, keys: Keys) -> list:
  """``[leaf_fn(a, keys[i]) for i, a in enumerate(args)]``; one ``vmap`` when there are several."""
  if len(args) == 1:
    return [leaf_fn(args[0], jax.tree.map(lambda k: k[0], keys))]
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *args)
  out = jax.vmap(leaf_fn)(stacked, keys)
  return [jax.tree.map(lambda a, i=i: a[i], out) for i in range(len(args))]


def num_kept(size: int, ratio: float) -> int:
  """Entries a sparsifier keeps of ``size``: ``round(ratio * size)`` clipped to [1, size]."""
  return min(size, max(1, round(ratio * size)))
