"""Property-based tests of every compressor's contract (hypothesis).

On random pytrees of random shapes (including 0-size and scalar leaves) and
float dtypes (float32, bfloat16, float16), compress + decompress on one
site (``axis_name=None``, one cached ``jax.jit`` per compressor) must:

* raise nothing but the documented ``ValueError`` (non-float leaves);
* return the gradients' structure, shapes and dtypes, with no NaN or inf;
* be the identity at ratio 1 / full rank (TopK, RandomK, PowerSGD) and for
  the fp32 cast;
* be unbiased where claimed (RandomK, QSGD, TernGrad without clipping):
  over ``N`` draws, every coordinate's sample mean is within 6 standard
  errors of the gradient, using an upper bound of the per-coordinate
  variance (RandomK ``g_i^2 (d/k - 1)``, QSGD ``(||v||/s)^2 / 4``, TernGrad
  ``max|g| |g_i|``); a false failure has probability below ``1e-8`` per
  coordinate (normal approximation).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dadjax import compress as C

SETTINGS = dict(max_examples=12, deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])
SHAPES = [(), (0,), (0, 5), (5, 0), (1,), (3,), (7,), (2, 3), (4, 5), (1, 6), (2, 2, 3)]
FLOATS = [jnp.float32, jnp.bfloat16, jnp.float16]
SPECS = ["identity", "bf16", "fp16", "topk:0.3", "randomk:0.3", "qsgd:4", "qsgd:1", "terngrad",
         "sign", "scaled_sign", "powersgd:1", "powersgd:3", "ef_topk:0.3", "ef_scaled_sign",
         "ef_powersgd:2", "ef_qsgd:2"]


@st.composite
def leaves(draw, dtypes=FLOATS):
  shape = draw(st.sampled_from(SHAPES))
  dtype = draw(st.sampled_from(dtypes))
  kind = draw(st.sampled_from(["normal", "constant", "zeros", "sparse"]))
  scale = draw(st.sampled_from([1.0, 1e-3, 100.0]))
  rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
  x = rng.normal(size=shape)
  if kind == "constant":
    x = np.full(shape, rng.normal())
  elif kind == "zeros":
    x = np.zeros(shape)
  elif kind == "sparse":
    x = x * (rng.random(shape) < 0.2)
  return jnp.asarray(x * scale, dtype)


@st.composite
def pytrees(draw, leaf=leaves()):
  tree = {}
  for i in range(draw(st.integers(1, 4))):
    form = draw(st.sampled_from(["leaf", "list", "nested"]))
    if form == "leaf":
      tree[f"p{i}"] = draw(leaf)
    elif form == "list":
      tree[f"p{i}"] = [draw(leaf) for _ in range(draw(st.integers(1, 2)))]
    else:
      tree[f"p{i}"] = {"kernel": draw(leaf), "bias": (draw(leaf),)}
  return tree


@functools.lru_cache(maxsize=None)
def _exchange(c):
  return jax.jit(lambda tree, state, key: C.exchange(c, tree, state, key, None))


@functools.lru_cache(maxsize=None)
def _compressor(spec):
  if spec == "full_rank_powersgd":  # rank 6 >= min(m, n) of every shape drawn
    return C.powersgd(rank=6, error_feedback=False, min_compression_rate=0.0)
  return C.get_compressor(spec)


def _run(spec, tree, key, steps=2):
  """``steps`` compress + decompress rounds on one site; the last output."""
  c = _compressor(spec)
  state = c.init(tree)
  for step in range(steps):
    out = _exchange(c)(tree, state, jax.random.fold_in(key, step))
    state = out.state
  return out


def _assert_finite_like(out, tree):
  assert jax.tree.structure(out) == jax.tree.structure(tree)
  for o, t in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    assert o.shape == t.shape and o.dtype == t.dtype
    assert np.all(np.isfinite(np.asarray(o, np.float32)))


@settings(**{**SETTINGS, "max_examples": 10})
@given(spec=st.sampled_from(SPECS), tree=pytrees(), seed=st.integers(0, 2**31 - 1))
def test_every_compressor_is_finite_and_keeps_the_tree(spec, tree, seed):
  out = _run(spec, tree, jax.random.key(seed))
  _assert_finite_like(out.mean, tree)
  _assert_finite_like(out.local, tree)
  for leaf in jax.tree.leaves(out.state):
    assert np.all(np.isfinite(np.asarray(leaf, np.float32)))
  bits = int(out.traffic.reduce) + int(out.traffic.gather)
  assert bits >= 0
  if all(math.prod(x.shape) == 0 for x in jax.tree.leaves(tree)):
    assert bits == 0  # empty leaves send nothing


@settings(**SETTINGS)
@given(spec=st.sampled_from(SPECS),
       tree=pytrees(leaves(dtypes=FLOATS + [jnp.int32, jnp.int8, jnp.bool_])),
       seed=st.integers(0, 2**31 - 1))
def test_only_non_float_leaves_raise_and_with_a_value_error(spec, tree, seed):
  floats = all(jnp.issubdtype(x.dtype, jnp.floating) for x in jax.tree.leaves(tree))
  if floats:
    _assert_finite_like(_run(spec, tree, jax.random.key(seed), steps=1).mean, tree)
  else:
    with pytest.raises(ValueError, match="has dtype"):
      _run(spec, tree, jax.random.key(seed), steps=1)


@settings(**{**SETTINGS, "max_examples": 8})
@given(spec=st.sampled_from(["identity", "topk:1", "randomk:1", "full_rank_powersgd",
                             "ef_topk:1", "ef_randomk:1"]),
       tree=pytrees(), seed=st.integers(0, 2**31 - 1))
def test_ratio_one_and_full_rank_are_the_identity(spec, tree, seed):
  out = _run(spec, tree, jax.random.key(seed), steps=1).mean
  for o, x in zip(jax.tree.leaves(out), jax.tree.leaves(tree)):
    xf, of = np.asarray(x, np.float32), np.asarray(o, np.float32)
    if spec != "full_rank_powersgd":  # exact: values travel unchanged
      np.testing.assert_array_equal(of, xf)
    elif xf.size:  # float32 power iteration, output rounded to the leaf's dtype
      assert np.all(np.abs(of - xf) <= 1e-3 * np.abs(xf).max() + 1e-2 * np.abs(xf)), spec


_UNBIASED = {
    "randomk": (C.randomk(0.3), lambda g, d, k: g**2 * (d / k - 1)),
    "qsgd": (C.qsgd(levels=2), lambda g, d, k: np.full_like(g, (np.linalg.norm(g) / 2) ** 2 / 4)),
    "terngrad": (C.terngrad(clip=None), lambda g, d, k: np.abs(g).max() * np.abs(g)),
}


@settings(**{**SETTINGS, "max_examples": 8})
@given(name=st.sampled_from(sorted(_UNBIASED)),
       leaf=leaves(dtypes=[jnp.float32]).filter(lambda x: x.size > 0),
       seed=st.integers(0, 2**31 - 1))
def test_unbiased_compressors_are_unbiased(name, leaf, seed):
  c, var_bound = _UNBIASED[name]
  n = 4000
  keys = jax.random.split(jax.random.key(seed), n)

  def one(key):
    payload, _ = c.compress(leaf, c.init(leaf), key)
    return c.decompress(payload, leaf, key)

  samples = np.asarray(jax.jit(jax.vmap(one))(keys), np.float64)
  g = np.asarray(leaf, np.float64)
  d = g.size
  var = var_bound(g.ravel(), d, min(d, max(1, round(0.3 * d)))).reshape(g.shape)
  bound = 6 * np.sqrt(var / n) + 1e-6 * (np.abs(g).max() + 1e-30)
  assert np.all(np.abs(samples.mean(0) - g) <= bound), name
