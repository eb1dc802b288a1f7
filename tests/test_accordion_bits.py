"""Accordion sends what its decisions say: a shape group whose members disagree books, and
sends, exactly the per-tensor decisions' payloads, and each update equals its own exchange."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dadjax
from dadjax import adaptive as A
from dadjax import compress as C
from dadjax.adaptive._switch import chunk_low, chunk_sizes
from dadjax.compress._base import leaf_keys


@pytest.mark.parametrize("members", list(range(1, 18)) + [31, 32, 33, 100])
def test_chunks_hold_every_count_of_low_members(members):
  sizes = chunk_sizes(members)
  assert sum(sizes) == members
  assert len(sizes) <= members.bit_length()  # floor(log2(members)) + 1 chunks at most
  ks = jnp.arange(members + 1)
  low = np.asarray(jax.vmap(lambda k: chunk_low(members, k))(ks))
  np.testing.assert_array_equal(low.astype(int) @ np.asarray(sizes), np.arange(members + 1))


# Independent payload sizes (one site, bits) of each setting on an (m, n) fp32 matrix, from the
# methods' definitions: PowerSGD rank r sends P (m x r) and Q (n x r) in fp32; TopK sends
# round(ratio * m * n) fp32 values with int32 indices.
def _powersgd_bits(rank):
  return lambda m, n: 32 * min(rank, m, n) * (m + n)


def _topk_bits(ratio):
  return lambda m, n: 64 * min(m * n, max(1, round(ratio * m * n)))


# One group of five (16, 8) matrices (chunks 1, 2, 2), one lone (8, 4) matrix and a bias.
_SHAPES = {"a": (16, 8), "b": (16, 8), "c": (16, 8), "d": (16, 8), "e": (16, 8),
           "f": (8, 4), "g": (4,)}
_PLAN = [  # decisions of a..f per step: mixed, all low, all high, mixed again
    [1, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0], [0, 0, 0, 0, 0, 1], [0, 1, 0, 0, 1, 0],
    [1, 1, 0, 1, 1, 1], [0, 0, 0, 1, 0, 0]]


@pytest.mark.parametrize("low_spec, high_spec, low_bits, high_bits, tol", [
    ("ef_topk:0.5", "ef_topk:0.1", _topk_bits(0.5), _topk_bits(0.1), 0.0),
    ("powersgd:2", "powersgd:1", _powersgd_bits(2), _powersgd_bits(1), 1e-5)])
def test_disagreeing_same_shape_layers_book_per_tensor_bits(low_spec, high_spec, low_bits,
                                                            high_bits, tol):
  """PowerSGD's batched products may round differently from one matrix's (hence ``tol``)."""
  low, high = C.get_compressor(low_spec), C.get_compressor(high_spec)
  keys = jax.random.split(jax.random.key(2), len(_SHAPES))
  params = {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, _SHAPES.items())}
  grads = lambda t: jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)) + 0.1 * t, params)
  tx = A.accordion(low, high, window=10_000, axis_name=None, seed=5)  # shared memory
  state, update = tx.init(params), jax.jit(tx.update)
  run = jax.jit(lambda comp, g, s, key: C.exchange(comp, g, s, key, None), static_argnums=0)
  names = sorted(params)
  ref = {}
  for n in names[:-1]:
    a, b = low.init((params[n],)), high.init((params[n],))
    ref[n] = {"low": a._replace(memory=()), "high": b._replace(memory=()), "m": a.memory}
  for t, plan in enumerate(_PLAN):
    critical = jnp.asarray(plan + [True])  # the bias's entry is not read
    before = dadjax.comm_stats(state).total
    updates, state = update(grads(t), state._replace(
        detector=state.detector._replace(critical=critical)))
    expect = 32 * 4  # the fp32 bias; no window end (no norms)
    for i, n in enumerate(names[:-1]):
      setting = "low" if plan[i] else "high"
      expect += (low_bits if plan[i] else high_bits)(*_SHAPES[n])
      r = ref[n]
      out = run(low if plan[i] else high, (grads(t)[n],), r[setting]._replace(memory=r["m"]),
                leaf_keys(C.step_keys(5, jnp.int32(t), None), i))
      r[setting], r["m"] = out.state._replace(memory=()), out.state.memory
      np.testing.assert_allclose(updates[n], out.mean[0], rtol=tol, atol=tol)
      chex.assert_trees_all_close((state.low[i], state.high[i], state.memory[i]),
                                  (r["low"], r["high"], r["m"]), rtol=tol, atol=tol)
    assert dadjax.comm_stats(state).total - before == expect, t
    np.testing.assert_array_equal(state.sent_low[:-1], plan)
