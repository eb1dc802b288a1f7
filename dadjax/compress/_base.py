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
PowerSGD's initial ``Q``), ``site = fold_in(shared, site_index)`` drives
independent per-site noise (stochastic rounding). ``decompress`` and
``aggregate`` may use only ``shared``: they also decode other sites'
payloads. Compressors work per leaf; leaf ``i`` folds ``i`` into the keys.

A compressor whose collective cannot be written as one psum / all-gather of
a payload (PowerSGD's two rounds) supplies ``exchange`` itself; every other
compressor gets :func:`one_round_exchange`.
"""

from __future__ import annotations

import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from dadjax._tree_utils import tree_cast_like, tree_nbits, tree_scale
from dadjax.comm import (Bits, Traffic, axis_size, metered_all_gather, metered_psum,  # noqa: F401
                         site_index)

COMMUNICATIONS = ("reduce", "gather")


class Keys(NamedTuple):
  """The randomness of one step: ``shared`` by all sites, and this ``site``'s own."""

  shared: jax.Array
  site: jax.Array


def as_keys(key: Keys | jax.Array) -> Keys:
  """Accept a :class:`Keys` or a plain key (one site: ``site = fold_in(key, 0)``)."""
  if isinstance(key, Keys):
    return key
  return Keys(key, jax.random.fold_in(key, 0))


def step_keys(seed: int, step: jax.Array, axis_name: str | None) -> Keys:
  """Keys of a step: ``shared = fold_in(key(seed), step)``, ``site = fold_in(shared, site)``."""
  shared = jax.random.fold_in(jax.random.key(seed), step)
  return Keys(shared, jax.random.fold_in(shared, site_index(axis_name)))


def leaf_keys(keys: Keys, i: int) -> Keys:
  """The keys of leaf ``i``."""
  return Keys(jax.random.fold_in(keys.shared, i), jax.random.fold_in(keys.site, i))


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
  """

  init: Callable[[Any], Any]
  compress: Callable[[Any, Any, Any], tuple[Any, Any]]
  decompress: Callable[[Any, Any, Any], Any]
  bits: Callable[[Any], int | Bits]
  communication: str
  aggregate: Callable[[Any, Any, Any], Any] | None = None
  exchange: Callable[[Any, Any, Any, str | None], Exchanged] | None = None


class EmptyState(NamedTuple):
  """State of a stateless compressor."""


def mean_of_decompressed(compressor: Compressor, gathered: Any, like: Any, key: Keys) -> Any:
  """Default ``aggregate``: average the decompression of every site's payload."""
  per_site = jax.vmap(lambda p: compressor.decompress(p, like, key))(gathered)
  return jax.tree.map(lambda x: jnp.mean(x, axis=0), per_site)


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
  payload, state = compressor.compress(grads, state, key)
  local = compressor.decompress(payload, grads, key)
  if compressor.communication == "reduce":
    summed, traffic = metered_psum(payload, axis_name)
    mean = tree_scale(compressor.decompress(summed, grads, key), 1.0 / axis_size(axis_name))
  else:
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
) -> Compressor:
  """A stateless compressor applied to each leaf separately.

  The Python loop over leaves runs at trace time; leaf ``i`` gets
  :func:`leaf_keys` ``(key, i)``. The payload is a tuple with one entry per
  leaf, and its size is its storage size (:func:`tree_nbits`).

  Args:
    compress_leaf: ``(x, keys) -> leaf payload``.
    decompress_leaf: ``(leaf payload, like_leaf, keys) -> x``.
    communication: ``"reduce"`` or ``"gather"``.
    aggregate_leaf: ``(gathered leaf payload, like_leaf, keys) -> x`` or
      ``None`` (mean of decompressions).

  Returns:
    A :class:`Compressor`.
  """
  if communication not in COMMUNICATIONS:
    raise ValueError(f"communication must be one of {COMMUNICATIONS}, got {communication!r}")

  def init(params):
    del params
    return EmptyState()

  def compress(grads, state, key):
    key = as_keys(key)
    leaves = jax.tree.leaves(grads)
    payload = tuple(compress_leaf(x, leaf_keys(key, i)) for i, x in enumerate(leaves))
    return payload, state

  def over_leaves(leaf_fn):
    """Lift ``leaf_fn(payload_i, like_i, keys_i)`` to the whole payload tuple."""

    def apply(payload, like, key):
      key = as_keys(key)
      like_leaves, treedef = jax.tree.flatten(like)
      out = [leaf_fn(p, l, leaf_keys(key, i)) for i, (p, l) in enumerate(zip(payload, like_leaves))]
      return jax.tree.unflatten(treedef, out)

    return apply

  aggregate = None if aggregate_leaf is None else over_leaves(aggregate_leaf)
  return Compressor(init, compress, over_leaves(decompress_leaf), tree_nbits, communication,
                    aggregate)


def check_ratio(name: str, value) -> float:
  """``value`` as a float in (0, 1], else a ValueError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= 1:
    raise ValueError(f"{name} must be a number in (0, 1], got {value!r}")
  return float(value)


def check_int(name: str, value, minimum: int = 1) -> int:
  """``value`` as an int >= ``minimum``, else a ValueError naming ``name``."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
  return int(value)


def num_kept(size: int, ratio: float) -> int:
  """Entries a sparsifier keeps of ``size``: ``round(ratio * size)`` clipped to [1, size]."""
  return min(size, max(1, round(ratio * size)))
