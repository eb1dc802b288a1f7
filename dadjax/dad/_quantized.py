"""Quantized dAD: the gathered rows ``A`` and deltas ``D`` travel at ``b`` bits per number.

Exact dAD all-gathers each site's layer inputs ``A`` (n x d_in) and output
deltas ``D`` (n x d_out) and computes ``A_all^T D_all``. Here each site
rounds both to ``b`` bits per coordinate with the data quantizer of
:func:`dadjax.dataquant.quantize_uniform` (per-row range, stochastic
rounding, unbiased: ``E[Q(x)] = x``), with independent noise for ``A`` and
``D`` and for every site and step. Then for every row ``i``
``E[Q(a_i) Q(d_i)^T] = E[Q(a_i)] E[Q(d_i)]^T = a_i d_i^T``, so the gathered
weight gradient ``Q(A)_all^T Q(D)_all`` and the bias gradient (column sums
of ``Q(D)_all``) are unbiased for the exact dAD gradient.

Bits a site hands to the all-gather per call: ``n`` rows of
``32 packed_words(d_in, b) + 64`` plus ``32 packed_words(d_out, b) + 64``
(codes packed into uint32 words, and each row's fp32 offset and step):
:func:`quantized_gather_bits`, which equals the metered payload the
backward pass builds (the ledger reads that payload).

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631) for dAD; Hanna et al.,
  "Quantizing data for distributed learning" (https://arxiv.org/abs/2012.07913)
  and Alistarh et al., "QSGD" (https://arxiv.org/abs/1610.02132) for the
  unbiased stochastic rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dadjax._core.keys import fold, seed_step_key
from dadjax.comm import Traffic, metered_all_gather, site_index
from dadjax._core.quantize import dequantize_uniform, quantize_uniform, uniform_row_bits


def quantized_gather_bits(rows: int, d_in: int, d_out: int, bits: int) -> int:
  """Bits one site all-gathers for ``rows`` rows of ``A`` and ``D`` at ``bits`` bits."""
  return rows * (uniform_row_bits(d_in, bits) + uniform_row_bits(d_out, bits))


def quantize_keys(seed: int, step: jax.Array, axis_name: str | None) -> tuple[jax.Array,
                                                                                 jax.Array]:
  """This site's rounding keys for ``A`` and ``D`` at ``step``: independent per site and step."""
  key = fold(seed_step_key(seed, step), site_index(axis_name))
  return fold(key, 0), fold(key, 1)


def quantized_gather(a: jax.Array, d: jax.Array, bits: int, keys: tuple[jax.Array, jax.Array],
                     axis_name: str | None, *,
                     invariant: bool = False) -> tuple[jax.Array, jax.Array, Traffic]:
  """Quantize this site's ``A`` and ``D``, all-gather them, decode every site's rows.

  Args:
    a: (n, d_in) this site's layer inputs.
    d: (n, d_out) this site's output deltas.
    bits: bits per coordinate, in ``[1, 8]``.
    keys: the rounding keys of ``A`` and ``D`` (:func:`quantize_keys`).
    axis_name: the sites' axis (``None``: one site).
    invariant: type the gathered result invariant (replicated parameters
      under ``shard_map(check_vma=True)``; see :func:`dadjax.comm.metered_all_gather`).

  Returns:
    ``(A_all, D_all, traffic)``: fp32 ``(N n, d_in)`` and ``(N n, d_out)``,
    every site's decoded rows, site-major, unbiased for the exact rows; and
    the all-gather's :class:`~dadjax.comm.Traffic`.
  """
  d_in, d_out = a.shape[1], d.shape[1]
  payload = (quantize_uniform(a, bits, keys[0]), quantize_uniform(d, bits, keys[1]))
  (pa, pd), traffic = metered_all_gather(payload, axis_name, invariant=invariant)
  a_all = jax.vmap(lambda p: dequantize_uniform(p, bits, d_in))(pa).reshape(-1, d_in)
  d_all = jax.vmap(lambda p: dequantize_uniform(p, bits, d_out))(pd).reshape(-1, d_out)
  return a_all, d_all, traffic
