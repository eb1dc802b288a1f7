"""rank-dAD under Accordion: a layer's rank switches between two values.

A :class:`~dadjax.dad.Dense` layer with ``mode="rank"`` and ``rank_low`` set
factorizes its local ``A^T D`` at rank ``rank`` (the high rank) every step
and keeps only the first ``rank_low`` components when its detector says the
layer is *not* in a critical regime. The components of the structured power
iteration do not depend on later ones, so the masked factorization equals
the rank-``rank_low`` factorization: the lower rank is a runtime mask, not a
recompilation. The factors travel in one all-gather whose size follows the
decision (a ``lax.cond`` on a value equal on every site, so every site issues
the same collective): ``rank_low (d_in + d_out)`` numbers in the low-rank
branch instead of ``rank (d_in + d_out)``.

The detector is Accordion's (:mod:`dadjax.adaptive`), kept in the layer's
``"dad_state"``: the window statistic is built from the captured ``A`` and
``D`` without forming the gradient, ``||A^T D||_F^2 = tr(A A^T D D^T)``
(the two n x n Gram matrices; the gradient itself is formed instead when
that is cheaper, ``n (d_in + d_out) > d_in d_out``). The layer never holds
its local gradient, so a window is summarized by the root of the summed
per-step squared norms, ``sqrt(sum_t ||A_t^T D_t||_F^2)``, not by the norm
of the summed gradient that the optimizer-side detector uses; each site adds
its window statistic as one more number to the factors it gathers every
step (32 bits), and at a window end every site takes the same mean. A check
every ``interval`` windows compares it with the previous check's:
critical (high rank) when ``|old - new| / old >= eta``; a decrease of
``lr_schedule`` makes the layer critical until the next check; the first
window runs at the high rank.

Nothing is squared outside a scale: ``A`` and ``D`` are scaled exactly by
powers of two to entries below 1 before the products (:func:`product_norm`),
the window keeps the norm itself (``win_norm``) and adds each step's with
``hypot``, and the mean over sites is taken of the norms scaled the same
way, so gradients of ``1e30`` (whose squares overflow float32) and
``1e-30`` (whose squares underflow) give finite, non-zero statistics.

References:
  Agarwal et al., "Accordion: Adaptive Gradient Communication via Critical
  Learning Regime Identification", MLSys 2021 (https://arxiv.org/abs/2010.16248);
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dadjax._core.critical import is_critical, lr_decreased
from dadjax._core.keys import start_key
from dadjax._core.linalg import pow2_scale, pow2_unit, safe_norm
from dadjax._core.vma import cond
from dadjax.comm import Bits, Traffic, bits_add, bits_const, bits_from_count, metered_all_gather
from dadjax.dad._power import factorize
from dadjax.dad._state import current_state


def high_rank_now(config, cur: dict[str, jax.Array]) -> jax.Array:
  """Whether this step runs at the high rank: the last decision, or an LR decrease now.

  Before the first step (``step == 0``, when :func:`current_state` reads the
  fresh state's float fields as zeros) the layer is critical.
  """
  step = jnp.asarray(cur["step"]).astype(jnp.int32)
  high = (cur["critical"] > 0.5) | (step == 0)
  if config.lr_schedule is not None:
    high = high | lr_decreased(config.lr_schedule, step)
  return high


def accordion_gather_bits(config, high_bits: int, kernel_shape, dtype, state) -> Bits:
  """The bits this step's gather carries: ``high_bits`` at the high rank, less
  ``(rank - rank_low) (d_in + d_out)`` factor entries at the low one."""
  d_in, d_out = kernel_shape
  number = jnp.dtype(jnp.result_type(dtype, jnp.float32)).itemsize * 8
  low_bits = high_bits - (config.rank - config.rank_low) * (d_in + d_out) * number
  high = high_rank_now(config, current_state(state))
  return bits_add(bits_const(low_bits), bits_from_count(high, high_bits - low_bits))


def product_norm(a: jax.Array, d: jax.Array, precision=None) -> jax.Array:
  """``||a.T @ d||_F`` without squaring anything unscaled.

  ``a`` (n, d_in) and ``d`` (n, d_out) are first scaled exactly by powers of
  two to entries below 1 (:func:`~dadjax._core.linalg.pow2_unit`), so no
  product overflows and the result is the scaled norm times ``2^(e_a + e_d)``:
  through the Gram matrices, ``sqrt(tr(a' a'^T d' d'^T))`` (the same bits as
  the unscaled formula wherever that does not overflow), when that is
  cheaper (``n (d_in + d_out) <= d_in d_out``), else the scale-safe norm of
  the formed ``a'^T d'``. Zero when either is zero; float32.
  """
  n, d_in = a.shape
  d_out = d.shape[1]
  dot = functools.partial(jnp.dot, precision=precision)
  (a, e_a), (d, e_d) = pow2_unit(a.astype(jnp.float32)), pow2_unit(d.astype(jnp.float32))
  if n * (d_in + d_out) <= d_in * d_out:  # >= 0 in exact arithmetic; round-off may dip below
    scaled = jnp.sqrt(jnp.maximum(jnp.sum(dot(a, a.T) * dot(d, d.T)), 0.0))
  else:
    scaled = safe_norm(dot(a.T, d).reshape(-1))
  return pow2_scale(scaled, e_a + e_d)


def squared_norm(a: jax.Array, d: jax.Array, precision=None) -> jax.Array:
  """``||a.T @ d||_F^2`` (:func:`product_norm` squared: overflows past float32's range)."""
  return jnp.square(product_norm(a, d, precision))


def scale_safe_mean(x: jax.Array) -> jax.Array:
  """The mean of 1-D ``x`` with no overflow of the sum: taken on ``x`` scaled exactly by a
  power of two to entries below 1 (the same bits as ``jnp.mean(x)`` where that is finite)."""
  x, e = pow2_unit(x)
  return pow2_scale(jnp.mean(x), e)


def gather_factors(config, u, v, bias_sum, stat, high, invariant):
  """All-gather the kept factors, ``D``'s column sums (or ``None``) and the window statistic.

  Returns ``((sum_s u_s v_s^T, sum_s bias_sum_s or None, mean_s stat_s),
  traffic)``; the gather carries ``rank`` or ``rank_low`` components as
  ``high`` says, and ``traffic`` is the high-rank branch's (the most the
  compiled step sends; the layer reports the chosen branch's bits).
  """
  axis = config.axis_name
  d_in, d_out = u.shape[0], v.shape[0]
  has_bias = bias_sum is not None
  traffic = {}

  def send(r):
    def run(ops):
      u, v, b, s = ops
      parts = [u[:, :r].ravel(), v[:, :r].ravel()] + ([b] if has_bias else []) + [s[None]]
      gathered, traffic[r] = metered_all_gather(jnp.concatenate(parts), axis,
                                                invariant=invariant)
      n = gathered.shape[0]
      u_all = gathered[:, :d_in * r].reshape(n, d_in, r)
      v_all = gathered[:, d_in * r:(d_in + d_out) * r].reshape(n, d_out, r)
      one_way = jnp.einsum("sir,sor->io", u_all, v_all, precision=config.precision)
      gb = jnp.sum(gathered[:, (d_in + d_out) * r:-1], axis=0) if has_bias else jnp.zeros(())
      return one_way, gb, scale_safe_mean(gathered[:, -1])
    return run

  bias_op = bias_sum if has_bias else jnp.zeros((), u.dtype)
  one_way, gb, mean = cond(high, send(config.rank), send(config.rank_low),
                           (u, v, bias_op, stat.astype(u.dtype)))
  return (one_way, gb if has_bias else None, mean), traffic[config.rank]


def detector_step(config, cur, high, win_norm, mean):
  """Close the step's window accounting; at a window end decide the next step's rank.

  Args:
    config: the layer's ``DadConfig``.
    cur: the current state (``current_state``).
    high: this step's decision (after an LR decrease).
    win_norm: this site's window statistic so far, this step included,
      ``sqrt(sum_t ||A_t^T D_t||_F^2)``.
    mean: the sites' mean of ``win_norm`` (equal on every site).

  Returns:
    The detector's new state fields.
  """
  steps = cur["win_steps"] + 1
  end = steps >= config.accordion_window
  windows = jnp.round(cur["windows"])
  check = end & (jnp.mod(windows, config.accordion_interval) == 0)
  critical = jnp.where(check, is_critical(cur["ref_norm"], mean, config.accordion_eta), high)
  return {
      "critical": critical.astype(jnp.float32),
      "win_norm": jnp.where(end, 0.0, win_norm),
      "win_steps": jnp.where(end, 0.0, steps),
      "windows": windows + end.astype(jnp.float32),
      "ref_norm": jnp.where(check, mean, cur["ref_norm"]),
      "norm": jnp.where(end, mean, cur["norm"]),
      "rank_used": jnp.where(high, config.rank, config.rank_low).astype(jnp.float32),
  }


def rank_dad_accordion(config, a, d, cur, invariant, scale, has_bias
                       ) -> tuple[jax.Array, jax.Array | None, dict, Traffic]:
  """rank-dAD with the detector's rank (one-way): ``(gk, gb, extra_state, traffic)``."""
  r_high = config.rank
  dot = functools.partial(jnp.dot, precision=config.precision)
  high = high_rank_now(config, cur)
  step = jnp.asarray(cur["step"]).astype(jnp.int32)
  # The same starts as static rank-dAD's one-way factorization.
  key_local = start_key(config.seed, step, "rank_dad/local")
  memory = cur.get("memory")
  fac = factorize(a, d, rank=r_high, iters=config.iters, tol=config.tol, key=key_local,
                  init=cur.get("basis"), memory=memory, precision=config.precision,
                  method=config.power)
  keep = jnp.arange(r_high) < jnp.where(high, r_high, config.rank_low)
  u, v = fac.u * keep, fac.v * keep
  bias_sum = jnp.sum(d, axis=0).astype(fac.u.dtype) if has_bias else None
  win_norm = jnp.hypot(cur["win_norm"], product_norm(a, d, config.precision))  # no squares
  (one_way, gb, mean), traffic = gather_factors(config, u, v, bias_sum, win_norm, high, invariant)
  extra = detector_step(config, cur, high, win_norm, mean)
  extra["rank"] = jnp.sum((fac.sigma > 0) & keep).astype(jnp.float32)
  if config.warm_start:
    extra["basis"] = v
  if config.error_feedback:
    extra["memory"] = dot(a.T, d) + memory - dot(u, v.T)
  return one_way * scale, None if gb is None else gb * scale, extra, traffic
