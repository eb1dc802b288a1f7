"""The core's exact power-of-two scaling and its hash start vectors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dadjax._core.keys import hash_uniform, start_key
from dadjax._core.linalg import pow2_scale, pow2_unit
from dadjax._core.running import running_count


def _frexp_unit(x):
  """pow2_unit's contract written with jnp.frexp / jnp.ldexp."""
  top = jnp.max(jnp.abs(x))
  _, e = jnp.frexp(top)
  e = jnp.where((top > 0) & jnp.isfinite(top), jnp.clip(e, -125, 126), 0).astype(jnp.int32)
  return x * jnp.ldexp(jnp.ones((), x.dtype), -e), e


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("top", [0.0, 1e-45, 1e-40, 2.0 ** -126, 2.0 ** -125, 1e-30, 0.5, 1.0,
                                 1.5, 2.0 ** 126, 3e38, np.inf, np.nan, -7.0])
def test_pow2_unit_equals_frexp_on_every_kind_of_top(top, dtype):
  x = jnp.asarray([top, top / 3, -top / 7], dtype)
  got, e = pow2_unit(x)
  want, e_want = _frexp_unit(x)
  assert int(e) == int(e_want)
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pow2_scale_is_exact_over_its_whole_range():
  x = jnp.asarray([1.0, 3.0, 1e-30, 1e30, 2.0 ** -140], jnp.float32)
  one = jnp.ones((), jnp.float32)
  for e in range(-252, 253):
    half = e // 2
    want = x * jnp.ldexp(one, half) * jnp.ldexp(one, e - half)
    np.testing.assert_array_equal(np.asarray(pow2_scale(x, jnp.int32(e))), np.asarray(want))
  # undoes pow2_unit exactly
  y = jnp.asarray([1e30, -2e29, 5.0], jnp.float32)
  unit, e = pow2_unit(y)
  assert float(jnp.max(jnp.abs(unit))) < 1
  np.testing.assert_array_equal(np.asarray(pow2_scale(unit, e)), np.asarray(y))


def test_hash_uniform_is_deterministic_spread_and_keyed():
  key = start_key(3, 11, "rank_dad/local")
  u = np.asarray(hash_uniform(key, 0, 50_000))
  assert u.dtype == np.float32 and u.shape == (50_000,)
  assert -1 < u.min() and u.max() < 1
  assert abs(u.mean()) < 0.01 and abs(u.std() - 1 / np.sqrt(3)) < 0.01  # uniform on (-1, 1)
  np.testing.assert_array_equal(u, np.asarray(jax.jit(hash_uniform, static_argnums=2)(
      key, 0, 50_000)))
  others = [hash_uniform(key, 1, 50_000), hash_uniform(start_key(3, 12, "rank_dad/local"), 0,
            50_000), hash_uniform(start_key(3, 11, "rank_dad/global"), 0, 50_000),
            hash_uniform(start_key(4, 11, "rank_dad/local"), 0, 50_000)]
  for other in others:  # counter, step, purpose and seed each decorrelate the vector
    assert abs(np.corrcoef(u, np.asarray(other))[0, 1]) < 0.02
  # steps beyond float32's integers stay distinct
  big = 2 ** 24 + 1
  assert not np.array_equal(np.asarray(hash_uniform(start_key(0, big, "p"), 0, 8)),
                            np.asarray(hash_uniform(start_key(0, big - 1, "p"), 0, 8)))


# 1 and 2 blocks, a ragged last block, and three levels of block totals (128**2 < 70001),
# where the totals outgrow bfloat16 and go through the float32 product
@pytest.mark.parametrize("n", [1, 2, 127, 128, 129, 16_385, 70_001])
@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_running_count_is_cumsum(n, density):
  mask = np.random.default_rng(n).random(n) < density
  got = np.asarray(jax.jit(running_count)(jnp.asarray(mask)))
  assert got.dtype == np.int32
  np.testing.assert_array_equal(got, np.cumsum(mask))
  if n < 1000:  # a small block: many levels, each total past bfloat16's exact integers
    np.testing.assert_array_equal(running_count(jnp.asarray(mask), block=3), np.cumsum(mask))


def test_running_count_names_bad_input():
  with pytest.raises(ValueError, match="mask must be 1-D"):
    running_count(jnp.ones((2, 2), bool))
  with pytest.raises(ValueError, match="block must be at least 2"):
    running_count(jnp.ones((4,), bool), block=1)
