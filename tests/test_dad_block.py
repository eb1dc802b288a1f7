"""rank-dAD's block power iteration (``factorize(method="block")``, spec flag ``:block``).

The block iteration must keep the deflated iteration's contract: exact at
``rank >= rank(G)``, masked components beyond ``rank(G)``, zeros (no NaN) for
a zero gradient, warm starts honoured, ``sigma`` descending; and it must find
the top-r subspace at least as well as the deflated iteration.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dad

from test_dad_dot_general import UserGeneral, _data, _train


def _rows(n, d_in, d_out, seed=0, rank=None):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(n, d_in))
  if rank is not None:  # rows of A in a rank-dimensional subspace: rank(G) = rank
    a = a[:, :rank] @ rng.normal(size=(rank, d_in))
  return jnp.asarray(a, jnp.float32), jnp.asarray(rng.normal(size=(n, d_out)), jnp.float32)


def _block(a, d, **kw):
  kw = {"iters": 30, "tol": 0.0, "key": jax.random.key(0), **kw}
  return dad.factorize(a, d, method="block", **kw)


def test_block_finds_the_top_singular_subspace_sigma_descending():
  a, d = _rows(64, 40, 30, seed=1)
  g = np.asarray(a.T @ d, np.float64)
  s = np.linalg.svd(g, compute_uv=False)
  fac = _block(a, d, rank=4, iters=200)
  sigma = np.asarray(fac.sigma)
  assert np.all(np.diff(sigma) <= 0)
  np.testing.assert_allclose(sigma, s[:4], rtol=1e-3)
  best = np.sqrt(np.sum(s[4:] ** 2))  # Eckart-Young: the best rank-4 error
  err = np.linalg.norm(g - np.asarray(fac.u @ fac.v.T, np.float64))
  assert err <= best * (1 + 1e-3)
  # At equal iterations the block iteration is at least as close as the deflated one.
  few = dict(rank=4, iters=3, tol=0.0, key=jax.random.key(0))
  errs = {m: np.linalg.norm(g - np.asarray((f := dad.factorize(a, d, method=m, **few)).u
                                           @ f.v.T, np.float64))
          for m in ("deflated", "block")}
  assert errs["block"] <= errs["deflated"] * 1.01


def test_block_rank_deficient_masks_the_rest_and_zero_gradient_gives_zeros():
  a, d = _rows(20, 12, 9, seed=2, rank=2)
  fac = _block(a, d, rank=5)
  assert int(fac.rank) == 2
  g = np.asarray(a.T @ d)
  np.testing.assert_allclose(np.asarray(fac.u @ fac.v.T), g, atol=1e-4 * np.abs(g).max())
  zero = _block(jnp.zeros((6, 4)), jnp.zeros((6, 3)), rank=2)
  for leaf in (zero.u, zero.v, zero.sigma):
    assert np.all(np.asarray(leaf) == 0)
  assert int(zero.rank) == 0


@pytest.mark.slow  # about 13 s
def test_block_warm_start_from_the_answer_converges_at_once_and_memory_is_added():
  a, d = _rows(30, 10, 8, seed=3)
  first = _block(a, d, rank=3, iters=300)
  again = _block(a, d, rank=3, iters=50, tol=1e-4, init=first.v)
  assert int(again.iterations[0]) <= 2
  np.testing.assert_allclose(np.asarray(again.sigma), np.asarray(first.sigma), rtol=1e-4)
  # A zero column of init takes the random start: the result is the same subspace.
  partial = _block(a, d, rank=3, iters=300, init=first.v.at[:, 2].set(0.0))
  np.testing.assert_allclose(np.asarray(partial.sigma), np.asarray(first.sigma), rtol=1e-3)
  memory = jnp.asarray(np.random.default_rng(4).normal(size=(10, 8)), jnp.float32)
  full = _block(a, d, rank=8, memory=memory)
  np.testing.assert_allclose(np.asarray(full.u @ full.v.T), np.asarray(a.T @ d + memory),
                             atol=1e-3)


def test_block_survives_extreme_scales():
  a, d = _rows(16, 6, 5, seed=5)
  ref = _block(a, d, rank=2)
  for scale in (1e-30, 1e30):
    fac = _block(a * scale, d, rank=2)
    np.testing.assert_allclose(np.asarray(fac.sigma) / scale, np.asarray(ref.sigma), rtol=1e-5)
    assert np.all(np.isfinite(np.asarray(fac.u)))


def test_bad_power_method_is_refused_naming_the_argument():
  a, d = _rows(4, 3, 2)
  with pytest.raises(ValueError, match="method must be one of"):
    dad.factorize(a, d, rank=1, iters=1, tol=0.0, key=jax.random.key(0), method="lanczos")
  with pytest.raises(ValueError, match="power must be one of"):
    dad.DadConfig(mode="rank", power="lanczos")


def test_block_spec_selects_the_block_iteration():
  for spec, power in (("rank_dad:2:block:warm", "block"), ("rank_dad:2:warm", "deflated"),
                      ("accordion_rank_dad:4:2:block:window=5", "block")):
    _, factory = dad.get_method(spec, axis_name=None)
    assert factory.options.get("power", "deflated") == power, spec
  assert dadjax.build_method("rank_dad:2:block", axis_name=None).name == "rank_dad:2:block"


def test_block_rank_dad_trains_and_sends_the_deflated_payloads():
  # (vmap == shard_map for both iterations: test_dad_dot_general.py)
  x, y = _data((16, 3, 4))
  tx = optax.chain(dad.synchronize(dad.layer_mask(UserGeneral(dad.DotGeneral), x[:2])),
                   optax.sgd(0.1))
  runs = {power: _train(UserGeneral(functools.partial(dad.DotGeneral, mode="rank", rank=2,
                                                      warm_start=True, power=power)),
                        tx, x, y, "vmap")
          for power in ("deflated", "block")}
  ranks = dad.effective_ranks(runs["block"].model_state)
  assert ranks and all(0 < float(np.ravel(r)[0]) <= 2 for r in ranks.values())
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(runs["block"].params))
  bits = {k: dadjax.comm_stats(r.opt_state).gather_bits[0] for k, r in runs.items()}
  assert bits["block"] == bits["deflated"] > 0
