"""Tests for dadjax.compress: exactness, unbiasedness, PowerSGD, error
feedback, ledger formulas, packing, shard_map == vmap, optax composition."""

import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import compress as C
from dadjax import extend
from helpers import run_steps

AXIS = "sites"


def _tree(seed=0):
  """A small gradient-like pytree: dense kernels (one too small for rank 2), a bias, a conv kernel."""
  k = jax.random.split(jax.random.key(seed), 4)
  return {
      "w": jax.random.normal(k[0], (10, 16)),
      "b": jax.random.normal(k[1], (16,)),
      "conv": jax.random.normal(k[2], (3, 3, 4, 8)),
      "s": jax.random.normal(k[3], (2, 4)),
  }


def _roundtrip(c, grads, key=None):
  key = jax.random.key(7) if key is None else key

  @jax.jit
  def run(grads, key):
    payload, state = c.compress(grads, c.init(grads), key)
    return c.decompress(payload, grads, key), payload, state

  return run(grads, key)


def _sites_exchange(c, grads_per_site, step=0, seed=0, state=None):
  """Run an exchange over a leading site axis with jax.vmap(axis_name=AXIS)."""
  n = jax.tree.leaves(grads_per_site)[0].shape[0]
  if state is None:
    one = jax.tree.map(lambda x: x[0], grads_per_site)
    state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), c.init(one))

  def site(g, s):
    keys = C.step_keys(seed, jnp.int32(step), AXIS)
    out = C.exchange(c, g, s, keys, AXIS)
    return out.mean, out.local, out.state

  return jax.jit(jax.vmap(site, axis_name=AXIS))(grads_per_site, state)


# --------------------------------------------------------------------- packing

@pytest.mark.parametrize("n", [1, 32, 100])
def test_pack_roundtrip_every_width(n):
  rng = np.random.default_rng(n)
  widths = range(1, 33)
  codes = [rng.integers(0, 2**b, size=n, dtype=np.uint64).astype(np.uint32) for b in widths]
  for b, c in zip(widths, codes):
    c[0] = (1 << b) - 1  # the largest code must survive

  @jax.jit
  def roundtrip(codes):
    words = [extend.pack_bits(c, b) for b, c in zip(widths, codes)]
    return words, [extend.unpack_bits(w, b, n) for b, w in zip(widths, words)]

  words, back = roundtrip([jnp.asarray(c) for c in codes])
  for b, c, w, r in zip(widths, codes, words, back):
    assert w.dtype == jnp.uint32 and w.shape == (math.ceil(n / 32) * b,)
    np.testing.assert_array_equal(np.asarray(r), c)


def test_pack_is_dense():
  # 1-bit codes: bit j of word 0 is code j (little-endian), nothing else set.
  codes = np.zeros(40, np.uint32)
  codes[[0, 5, 31, 32, 39]] = 1
  words = np.asarray(extend.pack_bits(jnp.asarray(codes), 1))
  assert words.tolist() == [(1 << 0) | (1 << 5) | (1 << 31), (1 << 0) | (1 << 7)]
  # 3-bit codes straddle words: code 10 occupies bits 30..32.
  codes = np.zeros(32, np.uint32)
  codes[10] = 0b111
  words = np.asarray(extend.pack_bits(jnp.asarray(codes), 3))
  assert words.tolist() == [0b11 << 30, 0b1, 0]


# ------------------------------------------------------------ exact reductions

@pytest.mark.parametrize("spec", ["identity", "topk:1.0", "randomk:1.0"])
def test_ratio_one_is_identity(spec):
  g = _tree()
  out, _, _ = _roundtrip(C.get_compressor(spec), g)
  chex.assert_trees_all_equal(out, g)
  tx = C.compressed(C.get_compressor(spec), axis_name=None)
  upd, _ = jax.jit(tx.update)(g, tx.init(g))
  chex.assert_trees_all_equal(upd, g)


def test_powersgd_full_rank_is_exact():
  k = jax.random.split(jax.random.key(5), 3)
  g = {"w": jax.random.normal(k[0], (7, 4)), "b": jax.random.normal(k[1], (4,)),
       "conv": jax.random.normal(k[2], (2, 2, 2, 3))}
  # rank >= min(m, n) for every matrix; min_compression_rate=0 forces the
  # power iteration to run on them instead of sending them raw.
  c = C.powersgd(rank=4, error_feedback=False, min_compression_rate=0.0)
  out, payload, _ = _roundtrip(c, g)
  assert [p.shape for p in payload.p] == [(1, 8, 3), (1, 7, 4)]  # conv, w
  chex.assert_trees_all_close(out, g, atol=2e-5, rtol=2e-5)
  # Distributed: the average over 4 sites is exact too.
  sites = jax.tree.map(lambda x: jnp.stack([x * (i + 1) + i for i in range(4)]), g)
  mean, _, _ = _sites_exchange(c, sites)
  expect = jax.tree.map(lambda x: jnp.broadcast_to(x.mean(0), x.shape), sites)
  chex.assert_trees_all_close(mean, expect, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- unbiasedness

def _randomk_var(g, k):
  return g**2 * (g.size / k - 1)


def _qsgd_var(g, s, bucket):
  v = g.reshape(-1, bucket)
  norm = np.linalg.norm(v, axis=1, keepdims=True)
  r = np.abs(v) / norm * s
  p = r - np.floor(r)
  return ((norm / s) ** 2 * p * (1 - p)).reshape(g.shape)


def _terngrad_var(g):
  return np.abs(g).max() * np.abs(g) - g**2


@pytest.mark.parametrize("name, noise", [
    ("randomk", None), ("qsgd", "threefry"), ("qsgd_bucket", "threefry"), ("terngrad", "threefry"),
    ("qsgd", "hash"), ("qsgd_bucket", "hash"), ("terngrad", "hash")])
def test_unbiased(name, noise):
  # noise="hash": the counter-hash rounding noise must keep the estimators' mean and variance.
  g = np.asarray(jax.random.normal(jax.random.key(3), (4, 6)), np.float64)
  # Every estimator here takes two values per entry, delta apart: var = delta^2 p (1 - p).
  if name == "randomk":
    c, var, delta = C.randomk(0.25), _randomk_var(g, 6), np.abs(g) * 4
  elif name == "qsgd":
    c, var = C.qsgd(levels=2, noise=noise), _qsgd_var(g, 2, 24)
    delta = np.full_like(g, np.linalg.norm(g) / 2)
  elif name == "qsgd_bucket":
    c, var = C.qsgd(levels=3, bucket_size=6, noise=noise), _qsgd_var(g, 3, 6)
    delta = np.repeat(np.linalg.norm(g.reshape(-1, 6), axis=1) / 3, 6).reshape(g.shape)
  else:
    c, var = C.terngrad(clip=None, noise=noise), _terngrad_var(g)
    delta = np.full_like(g, np.abs(g).max())
  assert var.max() > 0.01  # the estimator is genuinely random
  n = 20000
  keys = jax.random.split(jax.random.key(11), n)
  gj = jnp.asarray(g, jnp.float32)

  def one(key):
    payload, _ = c.compress(gj, c.init(gj), key)
    return c.decompress(payload, gj, key)

  samples = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)
  mean = samples.mean(0)
  # 5 standard errors per coordinate (the variance is exact, from the formula).
  bound = 5 * np.sqrt(var / n) + 1e-5
  assert np.all(np.abs(mean - g) <= bound), np.max(np.abs(mean - g) / bound)
  # The empirical variance matches the formula, to 5 of its standard errors (a two-point
  # variable's fourth central moment is var delta^2 - 3 var^2).
  se_var = np.sqrt(np.maximum(var * delta**2 - 4 * var**2, 0) / n)
  err = np.abs(samples.var(0) - var)
  assert np.all(err <= 5 * se_var + 1e-4), np.max(err / (5 * se_var + 1e-4))


def test_terngrad_clip_is_unbiased_for_clipped_gradient():
  g = jnp.array([0.1, -0.2, 0.05, 8.0, -0.3, 0.15, 0.0, 0.25])
  c = C.terngrad(clip=1.0)
  keys = jax.random.split(jax.random.key(0), 20000)
  samples = jax.vmap(lambda k: c.decompress(c.compress(g, c.init(g), k)[0], g, k))(keys)
  bound = 1.0 * np.sqrt(np.mean(np.asarray(g) ** 2))  # sigma about 0
  clipped = np.clip(np.asarray(g), -bound, bound)
  var = np.abs(clipped).max() * np.abs(clipped) - clipped**2
  mean = np.asarray(samples, np.float64).mean(0)
  assert np.all(np.abs(mean - clipped) <= 5 * np.sqrt(var / 20000) + 1e-5)


# ------------------------------------------------------------------------ TopK

def test_topk_keeps_exactly_the_k_largest():
  g = _tree(1)
  c = C.topk(0.25)
  out, payload, _ = _roundtrip(c, g)
  for name in g:
    x, y = np.asarray(g[name]).ravel(), np.asarray(out[name]).ravel()
    k = round(0.25 * x.size)
    assert np.count_nonzero(y) == k
    largest = set(np.argsort(-np.abs(x))[:k].tolist())
    assert set(np.flatnonzero(y).tolist()) == largest
    np.testing.assert_array_equal(y[list(largest)], x[list(largest)])
  assert all(p.indices.dtype == jnp.int32 for p in payload)


@pytest.mark.parametrize("size,k", [(10, 10), (10, 9), (11, 6), (11, 5), (1000, 990), (1000, 10)])
def test_largest_magnitude_indices_keeps_top_k_set_ties_included(size, k):
  from dadjax.extend import largest_magnitude_indices  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(size + k)
  # Few distinct magnitudes of both signs, zeros among them: ties at the boundary.
  x = (rng.integers(-3, 4, size) * 0.5).astype(np.float32)
  idx = np.asarray(jax.jit(largest_magnitude_indices, static_argnums=1)(jnp.asarray(x), k))
  assert idx.dtype == np.int32 and idx.shape == (k,)
  _, expected = jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)
  assert sorted(idx.tolist()) == sorted(np.asarray(expected).tolist())


def test_largest_magnitude_indices_keeps_nan_like_top_k():
  from dadjax.extend import largest_magnitude_indices  # pylint: disable=g-import-not-at-top
  x = jnp.asarray([0.1, np.nan, -3.0, 0.2, np.inf, 0.0, -0.5, 2.0, 0.3, 1.0], jnp.float32)
  for k in (6, 9):
    kept = set(np.asarray(largest_magnitude_indices(x, k)).tolist())
    assert {1, 2, 4} <= kept  # NaN and the infinities are kept, as top_k keeps them
    assert kept == set(np.asarray(jax.lax.top_k(jnp.abs(x), k)[1]).tolist())


def test_topk_high_ratio_equals_top_k_under_error_feedback():
  """The complement selection (ratio above 1/2) gives the plain top_k's tensors, memory included."""
  g = _tree(3)
  for ratio in (0.99, 0.6):
    c = C.get_compressor(f"ef_topk:{ratio}")
    out, _, state = _roundtrip(c, g)
    for name in g:
      x = np.asarray(g[name]).ravel()
      k = round(ratio * x.size)
      _, top = jax.lax.top_k(jnp.abs(jnp.asarray(x)), k)
      y = np.zeros_like(x)
      y[np.asarray(top)] = x[np.asarray(top)]
      np.testing.assert_array_equal(np.asarray(out[name]).ravel(), y)
      np.testing.assert_array_equal(np.asarray(state.memory[name]).ravel(), x - y)


def test_topk_average_over_sites_is_mean_of_sparse_tensors():
  sites = jax.tree.map(lambda x: jnp.stack([x + i for i in range(4)]), _tree(2))
  c = C.topk(0.1)
  mean, local, _ = _sites_exchange(c, sites)
  for name in sites:
    per_site = []
    for i in range(4):
      x = np.asarray(sites[name][i]).ravel()
      k = round(0.1 * x.size)
      y = np.zeros_like(x)
      top = np.argsort(-np.abs(x))[:k]
      y[top] = x[top]
      per_site.append(y)
      np.testing.assert_array_equal(np.asarray(local[name][i]).ravel(), y)
    for i in range(4):
      np.testing.assert_allclose(np.asarray(mean[name][i]).ravel(), np.mean(per_site, 0),
                                 rtol=1e-6, atol=1e-6)


def test_randomk_shares_indices_and_psums():
  sites = jax.tree.map(lambda x: jnp.stack([x * (i + 1) for i in range(4)]), _tree(3))
  c = C.randomk(0.25)
  mean, local, _ = _sites_exchange(c, sites, step=5)
  for name in sites:
    d = sites[name][0].size
    k = round(0.25 * d)
    masks = np.asarray(local[name]).reshape(4, -1) != 0
    assert all(np.array_equal(masks[0], m) for m in masks)  # the same coordinates
    assert masks[0].sum() == k
    dense_mean = np.asarray(sites[name]).reshape(4, -1).mean(0)
    np.testing.assert_allclose(np.asarray(mean[name][2]).ravel(),
                               np.where(masks[0], dense_mean * d / k, 0), rtol=1e-5, atol=1e-5)


def test_stochastic_rounding_is_per_site_and_keyed_by_step():
  g = jnp.stack([_tree()["w"]] * 2)  # identical gradient on both sites
  _, local0, _ = _sites_exchange(C.qsgd(2), g, step=0)
  _, local1, _ = _sites_exchange(C.qsgd(2), g, step=1)
  _, again, _ = _sites_exchange(C.qsgd(2), g, step=0)
  assert not np.array_equal(local0[0], local0[1])  # per-site noise
  assert not np.array_equal(local0[0], local1[0])  # fresh noise per step
  np.testing.assert_array_equal(local0, again)  # reproducible from seed + step


# -------------------------------------------------------------------- PowerSGD

def _low_rank_matrix(m=24, n=12, seed=0):
  u, _ = np.linalg.qr(np.random.default_rng(seed).normal(size=(m, n)))
  v, _ = np.linalg.qr(np.random.default_rng(seed + 1).normal(size=(n, n)))
  sigma = np.array([8.0, 4.0, 1.0, 0.5] + [0.1] * (n - 4))
  return (u * sigma) @ v.T


def test_powersgd_warm_start_converges_to_best_rank_r():
  mat = _low_rank_matrix()
  u, s, vt = np.linalg.svd(mat)
  best = (u[:, :2] * s[:2]) @ vt[:2]
  g = {"m": jnp.asarray(mat, jnp.float32)}

  def errors(warm):
    c = C.powersgd(rank=2, warm_start=warm, error_feedback=False)

    @jax.jit
    def step(state, key):
      payload, state = c.compress(g, state, key)
      return c.decompress(payload, g, key)["m"], state

    state, errs = c.init(g), []
    for t in range(25):
      out, state = step(state, jax.random.key(t))
      errs.append(np.linalg.norm(np.asarray(out) - best))
    return errs

  warm, cold = errors(True), errors(False)
  assert warm[-1] < 1e-4 * np.linalg.norm(best)
  assert warm[0] > 100 * warm[-1]  # it converged, it did not start there
  assert min(cold[-5:]) > 100 * warm[-1]  # without warm start one iteration is not enough


def test_powersgd_batches_same_shape_matrices_and_sends_small_raw():
  g = {"a": jnp.ones((8, 6)), "b": jnp.ones((8, 6)) * 2, "conv": jnp.ones((3, 3, 2, 6)),
       "bias": jnp.ones((6,)), "tiny": jnp.ones((2, 3))}
  _, payload, state = _roundtrip(C.powersgd(rank=2), g)
  # leaves order: a, b, bias, conv, tiny; a and b stack into one group.
  assert [p.shape for p in payload.p] == [(2, 8, 2), (1, 18, 2)]
  assert [q.shape for q in state.q] == [(2, 6, 2), (1, 6, 2)]
  assert [r.shape for r in payload.raw] == [(6,), (2, 3)]  # 2*(2+3) >= 6 -> raw


def test_powersgd_error_feedback_memory():
  g = {"m": jnp.asarray(_low_rank_matrix(), jnp.float32)}
  c = C.powersgd(rank=1)
  out, _, state = _roundtrip(c, g)
  np.testing.assert_allclose(state.memory[0][0], g["m"] - out["m"], atol=1e-5)
  assert np.linalg.matrix_rank(np.asarray(out["m"]), tol=1e-3) == 1
  # Distributed: memory = this site's corrected gradient - the applied average.
  sites = {"m": jnp.stack([g["m"], -0.5 * g["m"], 2 * g["m"]])}
  mean, _, st = _sites_exchange(c, sites)
  for i in range(3):
    np.testing.assert_allclose(st.memory[0][i, 0], sites["m"][i] - mean["m"][i], atol=1e-5)


@pytest.mark.parametrize("spec", ["powersgd:2", "qsgd:4", "scaled_sign", "terngrad",
                                  "ef_scaled_sign", "ef_topk:0.1", "sign"])
def test_zero_gradient_gives_no_nan(spec):
  zeros = jax.tree.map(jnp.zeros_like, _tree())
  c = C.get_compressor(spec)
  tx = C.compressed(c, axis_name=None)
  state = tx.init(zeros)
  update = jax.jit(tx.update)
  for _ in range(2):
    upd, state = update(zeros, state)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves((upd, state)))
  if spec != "sign":  # sign(0) = +1 by convention; every other method sends 0
    chex.assert_trees_all_equal(upd, zeros)


def test_powersgd_recovers_after_zero_gradient():
  c = C.powersgd(rank=12, error_feedback=False, min_compression_rate=0.0)
  g = {"m": jnp.asarray(_low_rank_matrix(), jnp.float32)}
  zeros = jax.tree.map(jnp.zeros_like, g)
  compress = jax.jit(c.compress)
  _, state = compress(zeros, c.init(g), jax.random.key(0))
  assert not np.any(np.asarray(state.q[0]))  # the warm-start Q collapsed to 0
  payload, _ = compress(g, state, jax.random.key(1))  # zero columns re-drawn
  chex.assert_trees_all_close(c.decompress(payload, g, None), g, atol=1e-4)


def test_orthogonalize_drops_dependent_columns():
  a = np.random.default_rng(0).normal(size=(9, 1))
  p = jnp.asarray(np.concatenate([a, 2 * a, np.zeros_like(a), np.ones_like(a)], 1), jnp.float32)
  q = np.asarray(extend.orthogonalize(p))
  np.testing.assert_allclose(np.linalg.norm(q, axis=0), [1, 0, 0, 1], atol=1e-6)
  np.testing.assert_allclose(q[:, 0] @ q[:, 3], 0, atol=1e-6)


# -------------------------------------------------------------- error feedback

def test_error_feedback_memory_is_grad_minus_what_was_sent():
  c = C.error_feedback(C.topk(0.1))
  state = c.init(_tree())
  memory = jax.tree.map(np.zeros_like, _tree())
  compress = jax.jit(c.compress)
  for step in range(3):
    g = _tree(step)
    payload, state = compress(g, state, jax.random.key(step))
    for i, name in enumerate(sorted(g)):  # leaves order is sorted dict keys
      corrected = np.asarray(g[name]).ravel() + memory[name].ravel()
      k = round(0.1 * corrected.size)
      top = np.argsort(-np.abs(corrected))[:k]
      np.testing.assert_array_equal(np.sort(payload[i].indices), np.sort(top))
      sent = np.zeros_like(corrected)
      sent[top] = corrected[top]
      memory[name] = (corrected - sent).reshape(g[name].shape)
      np.testing.assert_allclose(state.memory[name], memory[name], rtol=1e-6, atol=1e-6)


def test_error_feedback_uses_the_local_decompression():
  c = C.error_feedback(C.scaled_sign())
  sites = jax.tree.map(lambda x: jnp.stack([x, -3 * x + 1, x**2]), _tree())
  mean, local, state = _sites_exchange(c, sites)
  for name in sites:
    for i in range(3):
      x = np.asarray(sites[name][i])
      sent = np.abs(x).mean() * np.where(x < 0, -1.0, 1.0)
      np.testing.assert_allclose(local[name][i], sent, rtol=1e-6)
      np.testing.assert_allclose(state.memory[name][i], x - sent, rtol=1e-5, atol=1e-6)
    assert not np.allclose(mean[name][0], local[name][0])


def test_sign_majority_vote():
  votes = np.array([[1, -1, 1, -1, 0.5],
                    [1, -1, -1, -1, -2],
                    [-1, -1, 1, 1, 3],
                    [1, 2, -1, 1, -1]], np.float32)  # 4 sites, 5 coordinates
  mean, _, _ = _sites_exchange(C.sign(), {"g": jnp.asarray(votes)})
  expect = np.sign(np.sign(votes).sum(0))  # ties -> 0
  assert expect.tolist() == [1, -1, 0, 0, 0]
  for i in range(4):
    np.testing.assert_array_equal(mean["g"][i], expect)


# ---------------------------------------------------------------------- ledger

def _packed(d, bits):
  return 32 * math.ceil(d / 32) * bits


_FORMULAS = {
    "identity": lambda shape, d: 32 * d,
    "bf16": lambda shape, d: 16 * d,
    "fp16": lambda shape, d: 16 * d,
    "topk:0.25": lambda shape, d: (32 + 32) * (d // 4),
    "ef_topk:0.25": lambda shape, d: (32 + 32) * (d // 4),
    "randomk:0.25": lambda shape, d: 32 * (d // 4),
    "qsgd:4": lambda shape, d: 32 + _packed(d, 1 + 3),  # levels 0..4 -> 3 bits + sign
    "qsgd:16": lambda shape, d: 32 + _packed(d, 1 + 5),  # levels 0..16 -> 5 bits + sign
    "terngrad": lambda shape, d: 32 + _packed(d, 2),
    "sign": lambda shape, d: 32 + _packed(d, 1),  # the signs and a word for the abstain bit
    "scaled_sign": lambda shape, d: 32 + _packed(d, 1),
    "ef_scaled_sign": lambda shape, d: 32 + _packed(d, 1),
}


def _powersgd_bits(shape, d, r):
  if len(shape) < 2:
    return 32 * d
  m, n = d // shape[-1], shape[-1]
  return 32 * r * (m + n) if r * (m + n) < m * n else 32 * d


@pytest.mark.parametrize("spec", list(_FORMULAS) + ["powersgd:2"])
def test_ledger_bits_match_formula(spec):
  g = _tree()
  if spec.startswith("powersgd"):
    r = int(spec.split(":")[1])
    formula = lambda shape, d: _powersgd_bits(shape, d, r)  # noqa: E731
  else:
    formula = _FORMULAS[spec]
  expect = sum(formula(x.shape, x.size) for x in jax.tree.leaves(g))
  dense = 32 * sum(x.size for x in jax.tree.leaves(g))
  tx = C.compressed(C.get_compressor(spec), axis_name=AXIS)
  sites = jax.tree.map(lambda x: jnp.stack([x + i for i in range(4)]), g)
  states = jax.vmap(tx.init)(sites)
  _, states = jax.jit(jax.vmap(tx.update, axis_name=AXIS))(sites, states)
  s = dadjax.comm_stats(states)
  assert s.bits_per_step == expect
  assert s.dense_bits_per_step == dense
  kind = "gather" if spec.split(":")[0].removeprefix("ef_") in {
      "topk", "qsgd", "terngrad", "sign", "scaled_sign"} else "reduce"
  sent = s.gather_bits if kind == "gather" else s.reduce_bits
  unused = s.reduce_bits if kind == "gather" else s.gather_bits
  assert (sent, unused) == ((expect,) * 4, (0,) * 4)  # every site, the right collective


def test_powersgd_iters_multiply_factor_bits():
  g = {"w": jnp.ones((10, 16)), "b": jnp.ones((16,))}
  tx = C.compressed(C.powersgd(rank=2, iters=3), axis_name=None)
  _, state = jax.jit(tx.update)(g, tx.init(g))
  assert dadjax.comm_stats(state).bits_per_step == 32 * (3 * 2 * (10 + 16) + 16)


# ---------------------------------------------------- distributed consistency

class _MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Dense(16)(x))
    x = nn.relu(nn.Dense(12)(x))
    return nn.Dense(3)(x)


def _batch():
  x = jax.random.normal(jax.random.key(0), (32, 10))
  y = jax.random.randint(jax.random.key(1), (32,), 0, 3)
  return {"x": x, "y": y}


def _train(tx, backend, steps=3, sites=8):
  ts = dadjax.make_train_step(_MLP(), tx, num_sites=sites, backend=backend)
  return ts, run_steps(ts, _batch(), steps, init_rows=4)[0]


@pytest.mark.parametrize("spec", [
    "topk:0.25", "powersgd:2",
    # the same code path as topk (one all-gather); kept out of the default run for time
    pytest.param("qsgd:4", marks=pytest.mark.slow), pytest.param("sign", marks=pytest.mark.slow)])
def test_shard_map_equals_vmap_simulation(spec):
  runs = {}
  for backend in ("shard_map", "vmap"):
    tx = optax.chain(C.compressed(C.get_compressor(spec)), optax.sgd(0.05, momentum=0.9))
    ts, state = _train(tx, backend)
    runs[backend] = (jax.tree.map(np.asarray, (state.params, state.opt_state)),
                     dadjax.comm_stats(state.opt_state))
  (tree_s, stats_s), (tree_v, stats_v) = runs["shard_map"], runs["vmap"]
  chex.assert_trees_all_close(tree_s, tree_v, atol=1e-5, rtol=1e-5)
  assert stats_s == stats_v
  assert stats_s.updates == 3
  p0 = jax.tree.map(lambda x: x[0], tree_s[0])
  init = jax.tree.map(np.asarray, _MLP().init(jax.random.key(0), _batch()["x"][:4])["params"])
  assert not all(np.allclose(a, b) for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(init)))
  for leaf in jax.tree.leaves(tree_s[0]):  # parameters stay replicated
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), atol=1e-6)


# ----------------------------------------------------------------- composition

def test_chain_with_momentum_matches_plain_sgd_when_lossless():
  g = _tree()
  params = jax.tree.map(jnp.zeros_like, g)
  lossless = optax.chain(C.compressed(C.topk(1.0), axis_name=None), optax.sgd(0.1, momentum=0.9))
  plain = optax.sgd(0.1, momentum=0.9)
  s1, s2 = lossless.init(params), plain.init(params)
  update1, update2 = jax.jit(lossless.update), jax.jit(plain.update)
  for t in range(3):
    grads = _tree(t)
    u1, s1 = update1(grads, s1, params)
    u2, s2 = update2(grads, s2, params)
    chex.assert_trees_all_close(u1, u2, atol=1e-6)
  assert dadjax.comm_stats(s1).updates == 3


def test_accumulation_updates_every_k_and_ledger_reads_through():
  # dadjax.accumulate, not optax.MultiSteps (the step refuses MultiSteps around a ledger)
  tx = dadjax.accumulate(optax.chain(C.compressed(C.powersgd(2)), optax.sgd(0.1, momentum=0.9)),
                         2)
  ts, state = _train(tx, "vmap", steps=3, sites=4)
  s = dadjax.comm_stats(state.opt_state)
  assert s.updates == 1  # steps 1 and 3 accumulate, step 2 communicates
  shapes = [x.shape[1:] for x in jax.tree.leaves(state.params)]
  assert s.bits_per_step == sum(_powersgd_bits(sh, math.prod(sh), 2) for sh in shapes)
  state4, _ = ts(state, _batch())
  assert dadjax.comm_stats(state4.opt_state).updates == 2


@pytest.mark.parametrize("wrapper", ["partition", "masked"])
def test_partition_and_masked_with_allreduce_on_1d_leaves(wrapper):
  spec = "ef_topk:0.25"
  is_matrix = lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)  # noqa: E731
  if wrapper == "partition":
    labels = lambda p: jax.tree.map(lambda x: "c" if x.ndim >= 2 else "d", p)  # noqa: E731
    comm = optax.partition({"c": C.compressed(C.get_compressor(spec)),
                            "d": dadjax.allreduce()}, labels)
  else:
    comm = optax.chain(
        optax.masked(C.compressed(C.get_compressor(spec)), is_matrix),
        optax.masked(dadjax.allreduce(), lambda p: jax.tree.map(lambda m: not m, is_matrix(p))))
  ts, state = _train(optax.chain(comm, optax.sgd(0.1, momentum=0.9)), "vmap", steps=2, sites=4)
  s = dadjax.comm_stats(state.opt_state)
  leaves = [x.shape[1:] for x in jax.tree.leaves(state.params)]
  expect = sum(64 * round(0.25 * math.prod(sh)) if len(sh) >= 2 else 32 * math.prod(sh)
               for sh in leaves)
  assert s.bits_per_step == expect
  assert s.gather_bits == (sum(64 * round(0.25 * math.prod(sh)) for sh in leaves if len(sh) >= 2),) * 4
  assert s.dense_bits_per_step == 32 * sum(math.prod(sh) for sh in leaves)
  for leaf in jax.tree.leaves(state.params):  # parameters stay replicated
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[:1], leaf.shape), atol=1e-6)


# -------------------------------------------------------------- bad parameters

@pytest.mark.parametrize("make, match", [
    (lambda: C.topk(0), "ratio"), (lambda: C.topk(1.5), "ratio"), (lambda: C.topk(-0.1), "ratio"),
    (lambda: C.randomk(0.0), "ratio"), (lambda: C.randomk(2), "ratio"),
    (lambda: C.qsgd(0), "levels"), (lambda: C.qsgd(2.5), "levels"),
    (lambda: C.qsgd(4, bucket_size=0), "bucket_size"),
    (lambda: C.powersgd(rank=0), "rank"), (lambda: C.powersgd(iters=0), "iters"),
    (lambda: C.powersgd(min_compression_rate=-1), "min_compression_rate"),
    (lambda: C.cast("int8"), "dtype"), (lambda: C.cast(jnp.float64), "dtype"),
    (lambda: C.terngrad(clip=0), "clip"),
    (lambda: C.get_compressor("topk:0"), "ratio"),
    (lambda: C.get_compressor("powersgd:0"), "rank"),
])
def test_bad_parameters_raise(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("spec", ["nope", "topk:abc", "sign:3", "ef_", "powersgd:2.5"])
def test_unknown_spec_lists_valid_forms(spec):
  with pytest.raises(ValueError, match=r"valid forms: .*identity.*ef_.*powersgd\[:RANK\].*topk\[:RATIO\]"):
    C.get_compressor(spec)


def test_get_compressor_specs():
  for spec in ["identity", "bf16", "fp16", "topk:0.01", "randomk:0.1", "qsgd:16", "terngrad",
               "sign", "scaled_sign", "ef_scaled_sign", "powersgd:4", "ef_topk:0.01", "qsgd"]:
    c = C.get_compressor(spec)
    assert isinstance(c, C.Compressor)
    assert c.communication in ("reduce", "gather")
  assert isinstance(C.get_compressor("ef_topk:0.5").init({"a": jnp.ones(3)}), C.ErrorFeedbackState)


def test_topk_approx_option_keeps_k_true_entries_with_high_recall():
  x = jax.random.normal(jax.random.key(4), (20000,))
  exact = C.get_compressor("topk:0.01")
  approx = C.get_compressor("topk:0.01:approx=1")
  key = C.step_keys(0, jnp.int32(0), None)
  (pe,), _ = exact.compress((x,), exact.init((x,)), key)
  (pa,), _ = approx.compress((x,), approx.init((x,)), key)
  assert pa.indices.shape == pe.indices.shape == (200,)
  np.testing.assert_array_equal(np.asarray(pa.values), np.asarray(x)[np.asarray(pa.indices)])
  assert len(np.unique(np.asarray(pa.indices))) == 200
  recall = len(np.intersect1d(np.asarray(pa.indices), np.asarray(pe.indices))) / 200
  assert recall >= 0.95
  with pytest.raises(ValueError, match="approx"):
    C.topk(0.01, approx="yes")


def test_hash_noise_is_uniform_and_independent_across_keys():
  from dadjax._core.keys import hash_unit  # pylint: disable=g-import-not-at-top
  n = 1 << 20
  u = np.asarray(hash_unit(jax.random.key(0), n), np.float64)
  assert u.min() >= 0 and u.max() < 1
  counts = np.histogram(u, bins=64, range=(0, 1))[0]
  chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum()
  assert chi2 < 120, chi2  # 63 degrees of freedom: P(chi2 > 120) < 1e-5
  # neighbours and other keys (the next site, the next step) are uncorrelated
  others = [np.asarray(hash_unit(k, n), np.float64) for k in
            (jax.random.key(1), jax.random.fold_in(jax.random.key(0), 1))]
  for v in [u[1:], *others]:
    w = u[:v.size]
    assert abs(np.corrcoef(w, v)[0, 1]) < 5 / np.sqrt(n)
  assert np.array_equal(u, np.asarray(hash_unit(jax.random.key(0), n)))  # deterministic


def test_noise_choice_is_checked():
  with pytest.raises(ValueError, match="noise must be one of"):
    C.qsgd(noise="philox")
  with pytest.raises(ValueError, match="noise"):
    C.get_compressor("terngrad:noise=philox")
