"""The backward pass of a dAD layer, one function per route.

:func:`backward` is the whole backward pass of :func:`~dadjax.dad.dense`
for a given route. Every collective in it goes through the metered
wrappers of :mod:`dadjax.comm`, and it returns the resulting
:class:`~dadjax.comm.Traffic` next to the cotangents: the custom_vjp drops
it (a backward pass cannot return side outputs), and the cost model
(:mod:`dadjax.dad._cost`) obtains the same :class:`Traffic` by evaluating
this function abstractly (``jax.eval_shape``) on the layer's operands, so
the bits the ledger records are those of the payloads the backward pass
builds: after dtype promotion, with or without a bias, including the
collectives that only re-type a cotangent under ``shard_map``.

Routes (``y = x W + b``, rows ``A`` (n x d_in), deltas ``D`` (n x d_out)):

* ``"gather"`` (exact dAD): all-gather ``[A, D]``; with ``quantize_bits``
  (quantized dAD, :mod:`dadjax.dad._quantized`) their ``b``-bit codes and
  per-row ranges, decoded after the gather (exact in expectation).
* ``"allreduce"``: psum ``A^T D`` (and ``D``'s column sums with a bias).
* ``"factors"`` (rank-dAD): all-gather this site's rank-r factors of
  ``A^T D`` (and ``D``'s column sums with a bias); two-way adds a psum
  that broadcasts the global factors from site 0.
* ``"local"``: nothing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dadjax._core.keys import start_key
from dadjax._core.vma import is_varying, to_varying, vma
from dadjax.comm import (NO_TRAFFIC, Traffic, metered_all_gather, metered_pmean, metered_psum,
                         site_index, traffic_add)
from dadjax.dad._config import DadConfig
from dadjax.dad._power import factorize
from dadjax.dad._quantized import quantize_keys, quantized_gather
from dadjax.dad._rank_accordion import rank_dad_accordion
from dadjax.dad._state import current_state


def match_type(ct, primal, axis_name, typed: bool, reduce: str = "pmean"):
  """Give a cotangent the variance type of its primal; returns ``(ct, traffic)``.

  Only where types are checked (``shard_map(check_vma=True)``). A varying
  cotangent of an invariant primal is reduced: ``"psum"`` where per-site
  contributions add up (JAX's transpose of the implicit ``pvary``),
  ``"pmean"`` for values equal on every site by construction (synchronized
  gradients, the uses count), which types them invariant without
  changing them. That reduction is a real collective and is metered.
  """
  if not typed or ct is None:
    return ct, NO_TRAFFIC
  # Other mesh axes (the in-site axis of a 2-D mesh): a value computed
  # without them (a constant, the state's counters) takes the primal's type.
  ct = to_varying(ct, vma(primal) - {axis_name})
  want, have = is_varying(primal, axis_name), is_varying(ct, axis_name)
  if want and not have:
    return jax.lax.pcast(ct, axis_name, to="varying"), NO_TRAFFIC
  if have and not want:
    return (metered_psum if reduce == "psum" else metered_pmean)(ct, axis_name)
  return ct, NO_TRAFFIC


def forward(x, kernel, bias, config: DadConfig):
  y = jnp.dot(x, kernel, precision=config.precision)
  return y if bias is None else y + bias


def backward(config: DadConfig, route: str, res, dy, *, num_sites: int):
  """The backward pass by ``route``: ``(dx, d_kernel, d_bias, new_state, traffic)``.

  Args:
    config: the layer's :class:`DadConfig`.
    route: one of :data:`~dadjax.dad.ROUTES`.
    res: ``(x, kernel, bias, state)`` saved by the forward pass.
    dy: output cotangent.
    num_sites: sites along ``config.axis_name`` (scales the mean).
  """
  x, kernel, bias, state = res
  d_in, d_out = kernel.shape
  axis = config.axis_name
  dot = functools.partial(jnp.dot, precision=config.precision)
  a = x.reshape(-1, d_in)
  d = dy.reshape(-1, d_out)
  dx = dot(dy, kernel.T).astype(x.dtype)  # input gradient: local, like any layer

  typed = any(is_varying(v, axis) for v in (a, d, kernel, bias))
  invariant = typed and not is_varying(kernel, axis)
  # Replicated invariant kernel: JAX sums per-site contributions; otherwise
  # the data-parallel mean over sites.
  scale = 1.0 if invariant else 1.0 / num_sites
  cur = current_state(state) if state is not None else None
  # The new float fields; ``step`` is read here and advanced by the state's
  # owner (dadjax.dad.next_state), so its cotangent is zero.
  new_state = None if state is None else {"uses": jnp.ones((), jnp.float32)}
  sent = []

  if route == "gather" and config.quantize_bits is not None:
    step = cur["step"] if cur is not None else 0
    keys = quantize_keys(config.seed, step, axis)
    a_all, d_all, t = quantized_gather(a, d, config.quantize_bits, keys, axis,
                                       invariant=invariant)
    sent.append(t)
    gk = dot(a_all.T, d_all) * scale
    gb = jnp.sum(d_all, axis=0) * scale
  elif route == "gather":
    rows, t = metered_all_gather(jnp.concatenate([a, d], axis=1), axis, invariant=invariant)
    sent.append(t)
    rows = rows.reshape(-1, d_in + d_out)
    a_all, d_all = rows[:, :d_in], rows[:, d_in:]
    gk = dot(a_all.T, d_all) * scale
    gb = jnp.sum(d_all, axis=0) * scale
  elif route == "allreduce":
    local = (dot(a.T, d),) if bias is None else (dot(a.T, d), jnp.sum(d, axis=0))
    summed, t = metered_psum(local, axis)
    sent.append(t)
    gk = summed[0] * scale
    gb = summed[1] * scale if bias is not None else None
  elif route == "local":
    gk, gb = dot(a.T, d), jnp.sum(d, axis=0)
  else:
    rank_fn = rank_dad_accordion if config.rank_low is not None else _rank_dad
    gk, gb, extra, t = rank_fn(config, a, d, cur, invariant, scale, bias is not None)
    sent.append(t)
    if new_state is not None:
      new_state.update(extra)
    if "memory" in extra and typed and not is_varying(state["memory"], axis):
      raise ValueError("error_feedback keeps one memory per site: the layer's dad_state must "
                       "be per-site (varying along the axis), not a replicated value")

  dx, t = match_type(dx, x, axis, typed, reduce="psum")
  sent.append(t)
  gk, t = match_type(gk.astype(kernel.dtype), kernel, axis, typed)
  sent.append(t)
  if bias is None:
    gb = None
  else:
    gb, t = match_type(gb.astype(bias.dtype), bias, axis, typed)
    sent.append(t)
  if new_state is not None:
    typed_state = {}
    for k, v in new_state.items():
      typed_state[k], t = match_type(v.astype(jnp.float32), state[k], axis, typed)
      sent.append(t)
    # The step counter (and any integer field) is only read: no cotangent.
    new_state = {**typed_state, **{k: None for k, v in state.items()
                                   if k == "step" or not jnp.issubdtype(v.dtype, jnp.inexact)}}
  return dx, gk, gb, new_state, traffic_add(*sent)


def _rank_dad(config, a, d, cur, invariant, scale, has_bias):
  """rank-dAD: local factorization, all-gather of the factors, aggregation."""
  axis, r = config.axis_name, config.rank
  d_in, d_out = a.shape[1], d.shape[1]
  dot = functools.partial(jnp.dot, precision=config.precision)
  step = jnp.zeros((), jnp.int32) if cur is None else cur["step"]
  key_local = start_key(config.seed, step, "rank_dad/local")
  key_global = start_key(config.seed, step, "rank_dad/global")
  memory = cur.get("memory") if cur is not None else None
  fac = factorize(a, d, rank=r, iters=config.iters, tol=config.tol, key=key_local,
                  init=cur.get("basis") if cur is not None else None,
                  memory=memory, precision=config.precision, method=config.power)
  # One collective per layer: factors (and D's column sums for the exact
  # bias, only when the layer has a bias) travel together.
  parts = [fac.u.ravel(), fac.v.ravel()]
  if has_bias:
    parts.append(jnp.sum(d, axis=0).astype(fac.u.dtype))
  gathered, traffic = metered_all_gather(jnp.concatenate(parts), axis, invariant=invariant)
  sent = [traffic]
  n_sites = gathered.shape[0]
  u_all = gathered[:, :d_in * r].reshape(n_sites, d_in, r)
  v_all = gathered[:, d_in * r:(d_in + d_out) * r].reshape(n_sites, d_out, r)
  gb = jnp.sum(gathered[:, (d_in + d_out) * r:], axis=0) * scale if has_bias else None
  one_way = jnp.einsum("sir,sor->io", u_all, v_all, precision=config.precision)

  extra = {"rank": fac.rank.astype(jnp.float32)}
  if config.warm_start:
    extra["basis"] = fac.v
  applied = one_way
  if config.aggregation == "two_way":
    # The gathered factors are rows of a factored matrix:
    # sum_s U_s V_s^T = A2^T D2 with A2 = [U_s^T], D2 = [V_s^T] (N r rows).
    a2 = u_all.transpose(0, 2, 1).reshape(n_sites * r, d_in)
    d2 = v_all.transpose(0, 2, 1).reshape(n_sites * r, d_out)
    fac2 = factorize(a2, d2, rank=r, iters=config.iters, tol=config.tol, key=key_global,
                     init=cur.get("basis_global") if cur is not None else None,
                     precision=config.precision, method=config.power)
    # Second round of the protocol: site 0 broadcasts the global factors, so
    # every replica applies bit-identical updates even where hardware or
    # reduction order would make redundant local computations differ.
    payload2 = jnp.concatenate([fac2.u.ravel(), fac2.v.ravel()])
    payload2, traffic2 = metered_psum(jnp.where(site_index(axis) == 0, payload2, 0), axis)
    sent.append(traffic2)
    u2 = payload2[:d_in * r].reshape(d_in, r)
    v2 = payload2[d_in * r:].reshape(d_out, r)
    applied = dot(u2, v2.T)
    extra["rank_global"] = fac2.rank.astype(jnp.float32)
    if config.warm_start:
      extra["basis_global"] = v2
  if config.error_feedback:
    # Residual of this site's compression; for two-way each site also keeps
    # 1/N of the second stage's error, so the memories sum to exactly
    # (what should have been applied) - (what was applied).
    residual = dot(a.T, d) + memory - dot(fac.u, fac.v.T)
    if config.aggregation == "two_way":
      residual = residual + (one_way - applied) / n_sites
    extra["memory"] = residual
  return applied * scale, gb, extra, traffic_add(*sent)
