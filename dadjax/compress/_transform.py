"""The optax face: a compressor plus its collective as a GradientTransformation."""

from __future__ import annotations

import functools
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax import registry
from dadjax._core.layers import per_layer
from dadjax._core.shards import require_whole_leaves
from dadjax._core.trees import SpecMemo, check_axis_name, check_float_leaves
from dadjax.comm import CommStats, ledger_init, ledger_record, tree_dense_bits
from dadjax.compress._base import Compressor, exchange, step_keys


class CompressedState(NamedTuple):
  """Step counter (drives the keys), the compressor's state and the ledger."""

  count: jax.Array
  inner: Any
  comm: CommStats


def shardable_compressors() -> list[str]:
  """The registered compressors whose (deprecated, inert) ``shardable`` flag is set.

  Kept with the flag until the next minor version (:mod:`dadjax._core.shards`).
  """
  names = []
  for entry in registry.entries("compressor"):
    if any(a.required for a in entry.args):
      continue
    if registry.get_compressor(entry.name).shardable:
      names.append(entry.name)
  return names + ["ef(...) of these"]


def compressed(
    compressor: Compressor,
    axis_name: str | None = "data",
    *,
    seed: int = 0,
) -> optax.GradientTransformation:
  """Average gradients over sites through a compressor.

  Each update compresses this site's gradient, performs the real collective
  over ``axis_name`` (a ``psum`` of linear payloads, e.g. PowerSGD's P and
  Q or shared-index RandomK values; an all-gather of TopK, QSGD, TernGrad or
  sign payloads), decompresses, averages over sites and records the ledger:
  the payload bits as reduce / gather traffic, and ``dense`` = the fp32 size
  of the gradients. Step ``t`` uses :func:`~dadjax.compress.step_keys`
  ``(seed, t)``: a ``shared`` key equal on every site and an independent
  ``site`` key per site, further separated per method and leaf path.

  A leaf stacked by ``nn.scan`` (inside :func:`dadjax.stacked_layers`, which
  the train step enters from the model's ``"layers"`` partitioning names) is
  compressed as its ``L`` layers, as the unscanned twin's leaves are.

  Composes like any optax transformation, e.g. ``optax.chain(compressed(
  topk(0.01)), optax.sgd(0.1, momentum=0.9))``, inside
  :func:`dadjax.accumulate` for gradient accumulation (the train step
  refuses ``optax.MultiSteps`` around it: its collective would run on every
  micro-step and be booked once), or with ``optax.partition`` /
  ``optax.masked`` to treat some leaves differently.

  Args:
    compressor: a :class:`~dadjax.compress.Compressor`, e.g.
      ``powersgd(rank=4)`` or ``get_compressor("ef_topk:0.01")``.
    axis_name: the mesh / pmap / vmap axis of the sites; ``None`` runs as one
      site (compress and decompress only, bits still recorded).
    seed: seed of the keys (an int).

  Returns:
    An ``optax.GradientTransformation`` with state :class:`CompressedState`.

  Raises:
    ValueError: at construction, if ``compressor`` is not a
      :class:`~dadjax.compress.Compressor`, ``axis_name`` is not a str, a
      tuple of str or ``None``, or ``seed`` is not an int; at ``init`` /
      ``update``, for a leaf that is not floating point; at ``update``,
      if the updates' tree structure, shapes or dtypes differ from the
      params given to ``init`` (the message names the first differing leaf).

  References:
    Xu et al., "GRACE: A Compressed Communication Framework for Distributed
    Machine Learning", ICDCS 2021 (https://arxiv.org/abs/1910.03474) -- the
    compress / communicate / decompress decomposition.
  """
  if not isinstance(compressor, Compressor):
    raise ValueError(f"compressor must be a Compressor (e.g. dadjax.compress.topk(0.01)), "
                     f"got {type(compressor).__name__}: {compressor!r}")
  axis_name = check_axis_name(axis_name)
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed must be an int, got {seed!r}")
  opts = _Compressed(compressor, axis_name, int(seed), SpecMemo("compressed"))
  # a leaf stacked by nn.scan is compressed, counted and booked layer by layer
  return per_layer(optax.GradientTransformation(functools.partial(_compressed_init, opts),
                                                functools.partial(_compressed_update, opts)))


class _Compressed(NamedTuple):
  """The options of :func:`compressed`; ``specs`` remembers the params' layout at ``init``."""

  compressor: Compressor
  axis_name: Any
  seed: int
  specs: SpecMemo


def _compressed_init(opts: _Compressed, params) -> CompressedState:
  check_float_leaves(params, "compressed")
  opts.specs.record(params)
  return CompressedState(jnp.zeros([], jnp.int32), opts.compressor.init(params), ledger_init())


def _compressed_update(opts: _Compressed, updates, state: CompressedState, params=None):
  """The exchange of ``updates`` through the compressor, booked in the ledger."""
  del params
  compressor = opts.compressor
  if not compressor.shardable:
    require_whole_leaves(compressor.name or "this compressor", shardable_compressors)
  opts.specs.check(updates)
  check_float_leaves(updates, "compressed")
  keys = step_keys(opts.seed, state.count, opts.axis_name)
  out = exchange(compressor, updates, state.inner, keys, opts.axis_name)
  comm = ledger_record(state.comm, reduce=out.traffic.reduce, gather=out.traffic.gather,
                       dense=tree_dense_bits(updates), reduce_calls=out.traffic.reduce_calls,
                       gather_calls=out.traffic.gather_calls)
  return out.mean, CompressedState(state.count + 1, out.state, comm)
