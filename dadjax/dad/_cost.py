"""The routes' cost model: which route a layer call takes and what it sends.

Nothing here writes a bits formula: the bits of a route are the
:class:`~dadjax.comm.Traffic` of :func:`dadjax.dad._routes.backward`
evaluated abstractly (``jax.eval_shape``) on operands of the layer's shapes
and dtypes, i.e. the payloads the backward pass really builds.

``mode="auto"`` picks, per layer call, the exact route with fewer bits *on
the wire* for the real number of sites ``N`` (``axis_size`` at trace time):
an all-gather of ``B_g`` bits per site sends ``(N-1) B_g`` on a ring, an
all-reduce of ``B_r`` sends ``2 (N-1)/N B_r``, so the gather route is taken
iff ``N B_g < 2 B_r`` (the same rule under a parameter server, see
:mod:`dadjax.comm._wire`). Ties go to the all-reduce (one fewer moving
part, and a reduce can use in-network aggregation).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dadjax.comm import Traffic, wire_bits
from dadjax.dad._config import DadConfig
from dadjax.dad._routes import backward, forward
from dadjax.dad._state import init_state


def axis_bound(axis_name: str | None) -> bool:
  """Whether ``axis_name`` is bound here (inside shard_map / pmap / vmap over it)."""
  if axis_name is None:
    return False
  try:
    jax.lax.axis_size(axis_name)
  except NameError:
    return False
  return True


def _sites(config: DadConfig, num_sites: int | None) -> int:
  if num_sites is not None:
    return num_sites
  return jax.lax.axis_size(config.axis_name) if axis_bound(config.axis_name) else 1


def _structs(rows, d_in, d_out, use_bias, dtype):
  x = jax.ShapeDtypeStruct((rows, d_in), dtype)
  kernel = jax.ShapeDtypeStruct((d_in, d_out), dtype)
  bias = jax.ShapeDtypeStruct((d_out,), dtype) if use_bias else None
  return x, kernel, bias


def route_traffic(config: DadConfig, route: str, x, kernel, bias=None, state=None, *,
                  num_sites: int | None = None) -> Traffic:
  """The :class:`~dadjax.comm.Traffic` of one backward pass of one layer call by ``route``.

  Evaluates :func:`~dadjax.dad._routes.backward` abstractly. Where the
  layer's axis is bound (inside the mapped step) the operands' variance
  types are kept, so collectives that only re-type a cotangent under
  ``shard_map`` are counted; elsewhere the route's own payloads are.

  Args:
    config: the layer's :class:`DadConfig`.
    route: one of :data:`~dadjax.dad.ROUTES`.
    x, kernel, bias, state: the layer's operands (arrays, tracers or
      ``jax.ShapeDtypeStruct``; ``x`` after dtype promotion).
    num_sites: ``N``; default the axis size where bound, else 1.

  Returns:
    A :class:`Traffic` with static (Python int) bits.
  """
  n = _sites(config, num_sites)
  if not axis_bound(config.axis_name):
    config = dataclasses.replace(config, axis_name=None)
  found = []

  def run(x, kernel, bias, state):
    y = forward(x, kernel, bias, config)
    *cts, traffic = backward(config, route, (x, kernel, bias, state), jnp.zeros_like(y),
                             num_sites=n)
    found.append(traffic)
    return cts

  jax.eval_shape(run, x, kernel, bias, state)
  return found[0]


def choose_route(config: DadConfig, x, kernel, bias=None, state=None, *,
                 num_sites: int | None = None) -> str:
  """The route of a layer call (trace-time choice; module docstring for ``"auto"``)."""
  if config.mode == "exact":
    return "gather"
  if config.mode == "rank":
    return "factors"
  if config.mode == "local":
    return "local"
  n = _sites(config, num_sites)
  bare = dataclasses.replace(config, axis_name=None)  # the routes' own payloads
  gather = route_traffic(bare, "gather", x, kernel, bias, state, num_sites=n).gather
  reduce = route_traffic(bare, "allreduce", x, kernel, bias, state, num_sites=n).reduce
  if n == 1:  # nothing moves: fewer payload bits, ties to the all-reduce
    return "gather" if gather < reduce else "allreduce"
  cheaper = wire_bits("gather", gather, n) < wire_bits("reduce", reduce, n)
  return "gather" if cheaper else "allreduce"


def layer_route(config: DadConfig, rows: int, d_in: int, d_out: int, use_bias: bool = True, *,
                num_sites: int | None = None, dtype=jnp.float32) -> str:
  """How a layer call synchronizes its gradient (trace-time choice).

  Args:
    config: the layer's :class:`DadConfig`.
    rows: rows per site of this call (product of the input's leading axes).
    d_in: input features.
    d_out: output features.
    use_bias: whether the layer has a bias.
    num_sites: ``N`` (``"auto"`` compares wire bits at this ``N``); default
      the axis size where the axis is bound, else 1.
    dtype: the dtype the rows travel in (after promotion). Default float32.

  Returns:
    ``"gather"`` (exact dAD), ``"factors"`` (rank-dAD), ``"allreduce"``
    (psum of ``A^T D``) or ``"local"`` (no communication).
  """
  x, kernel, bias = _structs(rows, d_in, d_out, use_bias, dtype)
  return choose_route(config, x, kernel, bias, None, num_sites=num_sites)


def layer_traffic(config: DadConfig, x, kernel, bias=None, state=None, *,
                  num_sites: int | None = None) -> Traffic:
  """What one backward pass of this layer call hands to collectives (chosen route)."""
  route = choose_route(config, x, kernel, bias, state, num_sites=num_sites)
  return route_traffic(config, route, x, kernel, bias, state, num_sites=num_sites)


def layer_bits(config: DadConfig, rows: int, d_in: int, d_out: int, use_bias: bool = True,
               number_bits: int = 32, *, num_sites: int | None = None) -> tuple[int, int]:
  """Payload bits one site hands to collectives in one backward pass of one call.

  Read from the payloads of :func:`~dadjax.dad._routes.backward` (no
  formula): exact dAD gathers ``[A, D]``; rank-dAD gathers its factors
  (at least fp32) and, with a bias, ``D``'s column sums, and two-way adds
  a psum of the global factors; the all-reduce route sends ``A^T D`` (and
  the bias gradient with a bias). Without an axis nothing is sent.

  Args:
    config: the layer's :class:`DadConfig`.
    rows: rows per site of this call.
    d_in: input features.
    d_out: output features.
    use_bias: whether the layer has a bias.
    number_bits: bits per number of the rows after promotion (16 or 32; 64
      only with 64-bit mode). Default 32.
    num_sites: ``N`` for ``"auto"``; default the bound axis size, else 1.

  Returns:
    ``(gather_bits, reduce_bits)`` as Python ints.
  """
  if config.axis_name is None:
    return 0, 0
  dtype = {16: jnp.bfloat16, 32: jnp.float32, 64: jnp.float64}[number_bits]
  x, kernel, bias = _structs(rows, d_in, d_out, use_bias, dtype)
  state = None
  if config.warm_start or config.error_feedback:
    state = jax.eval_shape(lambda: init_state(config, d_in, d_out))
  t = layer_traffic(config, x, kernel, bias, state, num_sites=num_sites)
  return int(t.gather), int(t.reduce)
