"""The one route of every dAD layer: linen :class:`~dadjax.dad.Dense` and
:class:`~dadjax.dad.DotGeneral`, NNX :class:`~dadjax.dad.NnxDotGeneral`.

A layer call is: the canonical view of its contraction
(:func:`~dadjax.dad._dot_general.contraction`), the refusals, the bucket
(one all-gather per backward pass, :mod:`dadjax.dad._bucket`) when the layer
joins one, else its own route with its state entry, and the record of what
its backward pass hands to collectives (:func:`comm_row`, sown into
``"comm"``). The layers differ only in where their variables live, which a
:class:`Host` answers: a linen module's collections, or an NNX module's
Variables and ``nnx.capture``.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from dadjax.comm import COMM_COLLECTION, bits_const
from dadjax.dad._bucket import bucketed_output
from dadjax.dad._config import DadConfig
from dadjax.dad._cost import layer_traffic
from dadjax.dad._dot_general import Contraction, contract, contraction
from dadjax.dad._rank_accordion import accordion_gather_bits


class Host:
  """Where a dAD layer's variables live (the linen and NNX layers each implement it).

  Attributes:
    path: the layer's module path (linen), or ``None`` where a layer does
      not know it (NNX).

  Methods:
    state(config, c): the layer's ``"dad_state"`` entry for contraction
      ``c`` (a fresh transient one where the layer keeps none).
    sow(collection, name, value): append ``value`` to ``name`` of an output
      collection; returns how many values ``name`` held before, or ``None``
      when the collection is not being collected (then nothing is kept).
    slot(collection, name, like): the zero *slot* ``name`` of an output
      collection, typed like ``like`` (its value is the one the caller of
      the model passed in that collection, zeros otherwise).
    joins_bucket(): whether the ``"dad_bucket"`` collection is being
      collected (linen also creates its marker at init here).
  """

  path: tuple | None = None

  def state(self, config: DadConfig, c: Contraction) -> Any:
    raise NotImplementedError

  def sow(self, collection: str, name: str, value: Any) -> int | None:
    raise NotImplementedError

  def slot(self, collection: str, name: str, like: jax.Array) -> jax.Array:
    raise NotImplementedError

  def joins_bucket(self) -> bool:
    raise NotImplementedError


def comm_row(config: DadConfig, c: Contraction, lhs, rhs, bias, state) -> dict[str, Any]:
  """What one backward pass of a layer call hands to collectives, as ``"comm"`` entries.

  ``gather_bits`` / ``reduce_bits`` (:class:`~dadjax.comm.Bits`) with
  ``gather_calls`` / ``reduce_calls`` (int8 zeros, one per collective
  call), read from the route's own payloads on these operands (dtype
  promotion, bias and variance typing included). A contraction with batch
  axes sends its entries' payloads in one call (bits times the entries).
  Under Accordion (``rank_low``) the gather follows the rank the state says
  this step runs at.
  """
  a, k = c.operands(lhs, rhs)
  one = state
  if c.batch_shape:
    a, k = a[0], k[0]
    one = None if state is None else jax.tree.map(lambda v: v[0], state)
  traffic = layer_traffic(config, a, k, bias, one)
  row = {}
  if traffic.gather_calls:
    if config.rank_low is not None and one is not None:
      row["gather_bits"] = accordion_gather_bits(config, traffic.gather, (c.d_in, c.d_out),
                                                 k.dtype, one)
    else:
      row["gather_bits"] = bits_const(traffic.gather * c.batch)
    row["gather_calls"] = jnp.zeros((traffic.gather_calls,), jnp.int8)
  if traffic.reduce_calls:
    row["reduce_bits"] = bits_const(traffic.reduce * c.batch)
    row["reduce_calls"] = jnp.zeros((traffic.reduce_calls,), jnp.int8)
  return row


def check_contraction(config: DadConfig, c: Contraction) -> None:
  """The layer route's refusals for this contraction (raises ``ValueError``)."""
  if c.batch_shape and config.rank_low is not None:
    raise ValueError("rank_low: Accordion's rank switching is per layer; a dot_general with "
                     "batch axes (one kernel per batch entry) does not support it")


def layer_output(host: Host, lhs, rhs, dimension_numbers, config: DadConfig, *,
                 bias: jax.Array | None = None, preferred_element_type: Any = None,
                 contract_fn: Callable = contract) -> jax.Array:
  """A dAD layer's output ``lax.dot_general(lhs, rhs, dimension_numbers) (+ bias)``.

  Args:
    host: the calling layer (:class:`Host`).
    lhs: the input (its gradient stays local).
    rhs: the kernel (its gradient is synchronized by ``config``'s route).
    dimension_numbers: as for ``lax.dot_general``.
    config: the layer's :class:`~dadjax.dad.DadConfig` (seed and precision
      already the layer's).
    bias: (d_out,) added inside the route (exact gradient from ``D``), or
      ``None`` (the caller adds its own bias outside).
    preferred_element_type: output dtype.
    contract_fn: the contraction (default
      :func:`~dadjax.dad._dot_general.contract`).

  Returns:
    The output in ``lax.dot_general``'s layout.

  Raises:
    ValueError: for malformed dimension numbers and the refusals of
      :func:`check_contraction`.
  """
  c = contraction(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
  check_contraction(config, c)
  y = None
  if config.bucket:  # the train step gathers A and D with every other layer's
    a, k = c.operands(lhs, rhs)
    y = bucketed_output(host, a, k, bias, config)
  if y is not None:
    y = y.reshape(c.out_shape)
  else:  # the layer's own route
    state = None
    if config.mode != "local" and not config.bucket:
      state = host.state(config, c)
    y = contract_fn(c, lhs, rhs, bias, state, config)
    if config.axis_name is not None:
      for name, value in comm_row(config, c, lhs, rhs, bias, state).items():
        host.sow(COMM_COLLECTION, name, value)
  return y if preferred_element_type is None else y.astype(preferred_element_type)
