"""dadjax.accumulate: k micro-steps, one collective, one optimizer step.

Tiny MLP (8 -> 6 -> 3) on 8 sites, k = 4 micro-batches of 2 rows per site.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import compress as C
from dadjax import dad

SITES, K, ROWS = 8, 4, 2


class _MLP(nn.Module):
  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x):
    return self.dense(3, name="head")(nn.tanh(nn.Dense(6, name="hidden")(x)))


def _micro_batches(seed=0):
  rng = np.random.default_rng(seed)
  xs = rng.normal(size=(K, SITES * ROWS, 8)).astype(np.float32)
  ys = rng.integers(0, 3, (K, SITES * ROWS)).astype(np.int32)
  return xs, ys


def _concatenated(xs, ys):
  """Site i's rows of every micro-batch, in one site-major global batch."""
  x = xs.reshape(K, SITES, ROWS, -1).transpose(1, 0, 2, 3).reshape(SITES * K * ROWS, -1)
  y = ys.reshape(K, SITES, ROWS).transpose(1, 0, 2).reshape(-1)
  return x, y


PARAM_BITS = (8 * 6 + 6 + 6 * 3 + 3) * 32


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "vmap"])
def test_accumulate_k4_communicates_once_and_equals_one_big_step(backend):
  xs, ys = _micro_batches()
  make = lambda tx: dadjax.make_train_step(_MLP(), tx, num_sites=SITES, backend=backend)
  acc = make(dadjax.accumulate(optax.chain(dadjax.allreduce("data"), optax.sgd(0.5)), K))
  big = make(optax.chain(dadjax.allreduce("data"), optax.sgd(0.5)))
  state = acc.init(jax.random.key(0), xs[0, :2])
  ref = big.init(jax.random.key(0), xs[0, :2])
  batch = {"x": xs[0], "y": ys[0]}
  ops = acc.collectives(state, batch)
  for j in range(K):
    before = acc.params(state)
    state, _ = acc(state, {"x": xs[j], "y": ys[j]})
    if j < K - 1:  # no update before the k-th micro-step
      jax.tree.map(np.testing.assert_array_equal, before, acc.params(state))
  x, y = _concatenated(xs, ys)
  ref, _ = big(ref, {"x": x, "y": y})
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6),
               acc.params(state), big.params(ref))
  stats = dadjax.comm_stats(state.opt_state)
  assert stats.updates == 1 and stats.bits_per_step == PARAM_BITS
  assert stats.total == PARAM_BITS  # one payload for four micro-steps
  if backend == "vmap":
    assert ops.ops == 0  # one device: the sites' psum is not a collective op
  else:
    # The gradient all-reduce sits only in the conditional's branch; outside
    # it only the step's metrics (loss, accuracy: 2 f32) are reduced.
    assert ops.bits("reduce") - 8 * ops.conditional_nbytes["reduce"] == 2 * 32
    assert 8 * ops.conditional_nbytes["reduce"] == PARAM_BITS
    assert ops.conditional_count["reduce"] >= 1


def test_accumulate_stateful_compressor_advances_once_per_optimizer_step():
  tx = dadjax.accumulate(C.compressed(C.get_compressor("powersgd:1"), axis_name=None), K)
  params = {"w": jnp.ones((5, 4)), "b": jnp.ones(4)}
  state = tx.init(params)
  for j in range(2 * K):
    g = jax.tree.map(lambda p: p * (j + 1), params)
    out, state = tx.update(g, state, params)
    fired = (j + 1) % K == 0
    assert bool(jnp.any(out["w"] != 0)) == fired
  assert int(state.inner.count) == 2  # two optimizer steps
  assert int(state.micro_step) == 0


def test_accumulate_traced_k_and_bad_k():
  params = {"w": jnp.ones(3)}

  @jax.jit
  def run(k):
    tx = dadjax.accumulate(optax.sgd(1.0), k)
    state = tx.init(params)
    outs = []
    for j in range(4):
      out, state = tx.update({"w": jnp.full(3, j + 1.0)}, state)
      outs.append(out["w"][0])
    return jnp.stack(outs)

  np.testing.assert_allclose(run(2), [0, -1.5, 0, -3.5])
  np.testing.assert_allclose(run(1), [-1, -2, -3, -4])
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="every_k"):
      dadjax.accumulate(optax.sgd(1.0), bad)


def test_dad_ledger_outside_and_inside_give_bits_per_optimizer_step():
  """dAD layers gather every micro-step; the rest is all-reduced once per optimizer step."""
  xs, ys = _micro_batches(1)
  model = _MLP(dense=dad.Dense)
  mask = dad.layer_mask(model, xs[0, :ROWS])
  tx = optax.chain(dad.model_ledger(), dadjax.accumulate(optax.chain(
      dad.synchronize(mask, record_model_comm=False), optax.sgd(0.1)), K))
  step = dadjax.make_train_step(model, tx, num_sites=SITES, backend="shard_map")
  state = step.init(jax.random.key(0), xs[0, :ROWS])
  for j in range(K):
    state, _ = step(state, {"x": xs[j], "y": ys[j]})
  stats = dadjax.comm_stats(state.opt_state)
  head_gather = ROWS * (6 + 3) * 32  # exact dAD: [A, D] per micro-step
  hidden_reduce = (8 * 6 + 6) * 32  # all-reduced once per optimizer step
  assert (stats.updates, stats.micro_steps) == (1, K)
  assert stats.gather_bits == (K * head_gather,) * SITES
  assert stats.reduce_bits == (hidden_reduce,) * SITES
  assert stats.total == K * head_gather + hidden_reduce
  assert stats.bits_per_micro_step == (K * head_gather + hidden_reduce) / K
