"""Structured power iteration: a rank-r factorization of ``A^T D`` (+ ``M``).

rank-dAD factorizes a site's local weight gradient ``G = A^T D`` (d_in x
d_out, the layout of a Flax kernel) from the captured rows ``A`` (n x d_in)
and deltas ``D`` (n x d_out) without forming ``G`` when that is the
expensive route: the power iteration only needs products with ``G^T G``,
and ``G^T G b = D^T (A A^T) (D b)`` costs ``O(n^2 + n d_out)`` per step once
the n x n Gram matrix ``A A^T`` is known (the "Gram trick"). An optional
dense term ``M`` (an error-feedback memory) is supported through the
factored products ``G b = A^T (D b) + M b``.

Shapes are static, as JAX requires: ``rank`` components are always
returned; components after the first one that stops carrying signal
(``sigma`` at round-off level, or exactly zero) are masked to zero, and the
count of unmasked ones is the *effective rank*.

Two iterations (``method``): ``"deflated"`` (the default) finds one component
at a time, each a power iteration on one vector deflated against the ones
found, with its own convergence test; ``"block"`` iterates all ``r`` vectors
at once (subspace iteration, orthonormalized by QR each step, then a
Rayleigh-Ritz rotation by the SVD of the small ``G B``), so each step reads
``A`` and ``D`` once, as matrix-matrix products, instead of ``r`` times as
matrix-vector products.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dadjax._core.vma import vary_like
from dadjax._core.keys import hash_uniform
from dadjax._core.linalg import pow2_scale, pow2_unit, project_out, safe_norm


POWER_METHODS = ("deflated", "block")


class Factors(NamedTuple):
  """A masked rank-r factorization ``G ~= u @ v.T``.

  Attributes:
    u: (d_in, r) left factors scaled by the singular values,
      ``u[:, k] = G v[:, k] = sigma_k q_k``; zero for masked components.
    v: (d_out, r) orthonormal right factors ``b_k``; zero when masked.
    sigma: (r,) estimated singular values (zero when masked).
    rank: () int32, the effective rank (number of unmasked components).
    iterations: (r,) int32, power iterations each component ran (0 when
      masked before starting).
  """

  u: jax.Array
  v: jax.Array
  sigma: jax.Array
  rank: jax.Array
  iterations: jax.Array


def product_route(n: int, d_in: int, d_out: int, steps: int, memory: bool) -> str:
  """The cheapest way to apply ``G^T G`` ``steps`` times (trace-time choice).

  Args:
    n: rows of ``A`` and ``D``.
    d_in: columns of ``A``.
    d_out: columns of ``D``.
    steps: total power-iteration steps (``rank * iters``).
    memory: whether a dense ``d_in x d_out`` term is added to ``G``.

  Returns:
    ``"gram"`` (form ``A A^T``, n x n), ``"factored"`` (products with ``A``
    and ``D``) or ``"dense"`` (form ``G``), by multiply-add count.
  """
  costs = {
      "factored": steps * 2 * n * (d_in + d_out) + (steps * 2 * d_in * d_out if memory else 0),
      "dense": n * d_in * d_out + steps * 2 * d_in * d_out,
  }
  if not memory:  # the Gram matrix cannot absorb a dense additive term
    costs["gram"] = n * n * d_in + steps * (2 * n * d_out + n * n)
  return min(costs, key=costs.get)


def _operators(a, d, memory, route, precision):
  """``(g_mv, gtg_mv)``: ``b -> G b`` (d_out -> d_in) and ``b -> G^T G b``."""
  dot = lambda x, y: jnp.dot(x, y, precision=precision)
  if route == "dense":
    g = dot(a.T, d)
    if memory is not None:
      g = g + memory
    return (lambda b: dot(g, b)), (lambda b: dot(g.T, dot(g, b)))
  if route == "gram":
    gram = dot(a, a.T)
    return (lambda b: dot(a.T, dot(d, b))), (lambda b: dot(d.T, dot(gram, dot(d, b))))

  def g_mv(b):
    out = dot(a.T, dot(d, b))
    return out if memory is None else out + dot(memory, b)

  def gt_mv(u):
    out = dot(d.T, dot(a, u))
    return out if memory is None else out + dot(memory.T, u)

  return g_mv, (lambda b: gt_mv(g_mv(b)))


def factorize(
    a: jax.Array,
    d: jax.Array,
    *,
    rank: int,
    iters: int,
    tol: float,
    key: jax.Array,
    init: jax.Array | None = None,
    memory: jax.Array | None = None,
    precision=None,
    method: str = "deflated",
) -> Factors:
  """Rank-``rank`` factorization of ``G = a.T @ d (+ memory)`` by deflated power iteration.

  Long because of its docstring (the structured power iteration's contract); the code sets up
  an :class:`_Iteration` for :func:`_deflated_factors` or :func:`_block_factors`.

  Component k starts from ``init[:, k]`` (a warm start) when that column is
  non-zero, else from :func:`~dadjax._core.keys.hash_uniform` ``(key, k)``; the
  start is orthogonalized against the components already found and then
  iterated with ``b <- normalize(deflate(G^T G b))`` until the change
  ``||b_new - b||`` drops below ``tol`` or ``iters`` steps ran. Then
  ``u_k = G b_k`` and ``sigma_k = ||u_k||``. A component is masked (and so
  are all later ones) when ``sigma_k <= sqrt(eps) * sigma_0`` or
  ``sigma_k = 0``; no NaN arises for a zero gradient. The iteration works
  on ``G^T G``, whose round-off is ``eps * sigma_0^2``, so directions with
  ``sigma_k / sigma_0`` below ``sqrt(eps)`` (3.5e-4 in float32) cannot be
  resolved: such components are round-off, would break the orthogonality
  of the basis, and carry at most ``eps * sigma_0^2`` of energy. For the
  same reason a vector whose norm drops below ``sqrt(eps)`` times its norm
  when deflated against the found components is treated as 0 (it lay in
  their span; normalizing the round-off left over would add a direction
  that is not in ``G``), and at most ``min(n, d_in, d_out)`` components are
  kept: ``G`` has no more. A warm start that lies in the span of the found
  components falls back to the random start.

  ``method="block"`` (:func:`_block_factors`) starts from all ``r`` columns at
  once (the same starts: ``init``'s non-zero columns, else the hashes),
  iterates ``B <- qr(G^T G B)`` until the part of the new basis outside the
  old one, ``||B_new - B B^T B_new||_F``, drops below ``tol`` or ``iters``
  steps ran, and then rotates ``B`` by the SVD of ``G B`` so that the
  components come out with ``sigma`` descending. Its masking and its
  exactness at ``rank >= rank(G)`` are the deflated iteration's; every
  component reports the same iteration count. Per step it costs what one
  deflated component step costs times ``r`` in multiply-adds, but reads
  ``A`` and ``D`` once: on a 520 x 512 by 520 x 2048 layer at rank 4, 30 ms
  against 95 ms per factorization on 2 CPU cores (``experiments/bench_factorize.py``;
  ``experiments/bench_scale.py`` measures the step).

  ``a`` and ``d`` are first scaled exactly by powers of two to entries below 1
  (``u`` and ``sigma`` are scaled back), so ``G^T G`` neither overflows for
  gradients of 1e30 nor underflows for 1e-30; elsewhere the result has the
  same bits as without the scaling.

  Because the found ``b_k`` are orthonormal and ``u = G v``, the result is
  the projection ``G v v^T``: once ``rank`` >= rank(G) the factorization is
  exact, whether or not each component has fully converged.

  Args:
    a: (n, d_in) layer inputs.
    d: (n, d_out) output deltas.
    rank: number of components r >= 1 (static).
    iters: maximum power iterations per component, >= 1 (static).
    tol: convergence threshold on ``||b_new - b||``, >= 0 (0: always run
      ``iters`` steps).
    key: PRNG key for the random starts; the same key on every site gives
      the same starts (no aligned generators needed).
    init: optional (d_out, r) warm start (e.g. last step's ``v``).
    memory: optional dense (d_in, d_out) term added to ``G``.
    precision: ``jax.lax.Precision`` for the products (default: JAX's).
    method: ``"deflated"`` (one component at a time) or ``"block"`` (all at
      once; see above). Default ``"deflated"``.

  Returns:
    :class:`Factors` with ``u`` (d_in, r), ``v`` (d_out, r), ``sigma`` (r,).

  Raises:
    ValueError: for a ``method`` outside :data:`POWER_METHODS`.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """
  if method not in POWER_METHODS:
    raise ValueError(f"method must be one of {POWER_METHODS}, got {method!r}")
  n, d_in = a.shape
  d_out = d.shape[1]
  dtype = jnp.result_type(a.dtype, d.dtype, jnp.float32)
  # Scaled by powers of two (exact) so that G^T G neither overflows (1e30 gradients) nor
  # underflows (1e-30): the iteration rounds as on the unscaled G; u and sigma are scaled back.
  (a, e_a), (d, e_d) = pow2_unit(a.astype(dtype)), pow2_unit(d.astype(dtype))
  if memory is not None:
    memory = pow2_scale(memory.astype(dtype), -(e_a + e_d))
  route = product_route(n, d_in, d_out, rank * iters, memory is not None)
  g_mv, gtg_mv = _operators(a, d, memory, route, precision)
  refs = (a, d, jax.random.key_data(key)) + tuple(x for x in (init, memory) if x is not None)
  spec = _Iteration(g_mv, gtg_mv, rank, iters, tol, key, init, (d_in, d_out), dtype,
                    cap=min(n, d_in, d_out),  # rank(G) <= cap: further components are round-off
                    resolution=float(np.sqrt(np.finfo(np.dtype(dtype)).eps)), refs=refs)
  run = _block_factors if method == "block" else _deflated_factors
  us, basis, sigmas, used = run(spec)
  us, sigmas = pow2_scale(us, e_a + e_d), pow2_scale(sigmas, e_a + e_d)
  return Factors(u=us, v=basis, sigma=sigmas, rank=jnp.sum(sigmas > 0).astype(jnp.int32),
                 iterations=used)


class _Iteration(NamedTuple):
  """The setup of one factorization, in the scaled units (what the iterations share).

  ``g_mv`` / ``gtg_mv``: ``b -> G b`` and ``b -> G^T G b``; ``shape``:
  ``(d_in, d_out)``; ``cap``: ``min(n, d_in, d_out)``, the components ``G``
  can have; ``resolution``: ``sqrt(eps)`` of ``dtype``; ``refs``: the
  operands whose variance (per site under ``shard_map``) the loop carries take.
  """

  g_mv: Any
  gtg_mv: Any
  rank: int
  iters: int
  tol: float
  key: jax.Array
  init: jax.Array | None
  shape: tuple[int, int]
  dtype: Any
  cap: int
  resolution: float
  refs: tuple


def _deflated_component(spec: _Iteration, k, carry):
  """Component ``k`` of the deflated iteration: start, iterate ``G^T G`` deflated, keep or mask."""
  basis, us, sigmas, used, alive, sigma0 = carry
  alive = alive & (k < spec.cap)
  start = hash_uniform(spec.key, k, spec.shape[1], spec.dtype)
  b0, _ = project_out(start, basis, spec.resolution)
  if spec.init is not None:
    warm = jax.lax.dynamic_index_in_dim(spec.init, k, axis=1, keepdims=False).astype(spec.dtype)
    warm, warm_norm = project_out(warm, basis, spec.resolution)
    b0 = jnp.where(warm_norm > 0, warm, b0)

  def cond(inner):
    it, _, change = inner
    # Once a component is masked so are all later ones: skip their work.
    return alive & (it < spec.iters) & (change >= spec.tol)

  def body(inner):
    it, b, _ = inner
    b_new, _ = project_out(spec.gtg_mv(b), basis, spec.resolution)
    return it + 1, b_new, jnp.linalg.norm(b_new - b)

  inner = jax.tree.map(lambda c: vary_like(c, *spec.refs),
                       (jnp.int32(0), b0, jnp.asarray(jnp.inf, spec.dtype)))
  it, b, _ = jax.lax.while_loop(cond, body, inner)
  u = spec.g_mv(b)
  sigma = safe_norm(u)
  sigma0 = jnp.where(k == 0, sigma, sigma0)
  keep = alive & (sigma > 0) & (sigma > spec.resolution * sigma0) & jnp.isfinite(sigma)
  basis = basis.at[:, k].set(jnp.where(keep, b, 0))
  us = us.at[:, k].set(jnp.where(keep, u, 0))
  sigmas = sigmas.at[k].set(jnp.where(keep, sigma, 0))
  used = used.at[k].set(it)
  return basis, us, sigmas, used, keep, sigma0


def _deflated_factors(spec: _Iteration):
  """One component at a time: ``(u, v, sigma, iterations)`` of :func:`factorize`'s
  ``method="deflated"``, in the scaled units. One loop over components (not a Python
  unroll) keeps compile time independent of the rank."""
  d_in, d_out = spec.shape
  carry = (jnp.zeros((d_out, spec.rank), spec.dtype), jnp.zeros((d_in, spec.rank), spec.dtype),
           jnp.zeros((spec.rank,), spec.dtype), jnp.zeros((spec.rank,), jnp.int32),
           jnp.bool_(True), jnp.zeros((), spec.dtype))
  carry = jax.tree.map(lambda c: vary_like(c, *spec.refs), carry)
  basis, us, sigmas, used, _, _ = jax.lax.fori_loop(
      0, spec.rank, functools.partial(_deflated_component, spec), carry)
  return us, basis, sigmas, used


def _block_factors(spec: _Iteration):
  """Subspace iteration on ``G^T G``: ``(u, v, sigma, iterations)`` of :func:`factorize`'s
  ``method="block"``, in the scaled units (the caller scales ``u`` and ``sigma`` back)."""
  g_mv, gtg_mv, rank, iters, tol, key, init, (d_in, d_out), dtype, cap, resolution, refs = spec
  width = min(rank, d_in, d_out)  # a QR basis has at most d_out columns; G at most d_in
  starts = jax.vmap(lambda k: hash_uniform(key, k, d_out, dtype), out_axes=1)(jnp.arange(width))
  if init is not None:
    warm = init[:, :width].astype(dtype)
    starts = jnp.where(jnp.any(warm != 0, axis=0), warm, starts)
  orth = lambda x: jnp.linalg.qr(x)[0]

  def cond(carry):
    it, _, change = carry
    return (it < iters) & (change >= tol)

  def body(carry):
    it, b, _ = carry
    b_new = orth(gtg_mv(b))
    # The part of the new basis outside the old one (invariant to the columns' signs).
    return it + 1, b_new, jnp.linalg.norm(b_new - b @ (b.T @ b_new))

  carry = jax.tree.map(lambda c: vary_like(c, *refs),
                       (jnp.int32(0), orth(starts), jnp.asarray(jnp.inf, dtype)))
  it, b, _ = jax.lax.while_loop(cond, body, carry)
  # Rayleigh-Ritz: rotate the basis so that u = G v has orthogonal columns, sigma descending.
  gb = g_mv(b)
  _, _, zt = jnp.linalg.svd(gb, full_matrices=False)
  v, u = b @ zt.T, gb @ zt.T
  sigma = safe_norm(u, axis=0)
  index = jnp.arange(width)
  keep = (index < cap) & (sigma > 0) & (sigma > resolution * sigma[0]) & jnp.isfinite(sigma)
  keep = jnp.cumprod(keep.astype(jnp.int32)).astype(bool)  # masked from the first that fails
  pad = rank - width
  widen = lambda x: jnp.pad(jnp.where(keep, x, 0), [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  used = jnp.pad(jnp.where(keep, it, 0).astype(jnp.int32), (0, pad))
  return widen(u), widen(v), widen(sigma), used
