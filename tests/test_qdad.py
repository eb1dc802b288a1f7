"""Quantized dAD: A and D all-gathered at b bits, unbiased; its ledger is what the collective moves."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax.comm import hlo_collectives
from dadjax import dad
from dadjax.extend import packed_words
from dadjax.dad._dense import DadConfig, dense, layer_bits
from dadjax.dad._quantized import quantized_gather_bits
from dadjax.models import MLP


SITES, ROWS, D_IN, D_OUT = 8, 4, 12, 5


def collective_bytes(hlo: str) -> dict:
  """Operand bytes of the compiled all-reduces and all-gathers (per site)."""
  ops = hlo_collectives(hlo)
  return {"reduce": ops.nbytes.get("reduce", 0), "gather": ops.nbytes.get("gather", 0)}


def site_grads(config, x, kernel, bias, cot, step):
  """Per-site gradients of sum(y * cot) through dense() on SITES vmap-simulated sites."""
  state = {"uses": jnp.float32(1), "step": jnp.asarray(step, jnp.int32)}

  def one(x, cot):
    f = lambda k, b: jnp.sum(dense(x, k, b, state, config=config) * cot)
    return jax.grad(f, argnums=(0, 1))(kernel, bias)

  return jax.vmap(one, axis_name="data")(x, cot)


def make_layer(seed=0):
  k = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(k[0], (SITES, ROWS, D_IN))
  kernel = jax.random.normal(k[1], (D_IN, D_OUT)) / math.sqrt(D_IN)
  bias = jax.random.normal(k[2], (D_OUT,))
  cot = jax.random.normal(k[3], (SITES, ROWS, D_OUT))
  return x, kernel, bias, cot


def test_quantized_dad_is_unbiased_and_not_exact():
  x, kernel, bias, cot = make_layer()
  exact = site_grads(DadConfig(), x, kernel, bias, cot, 0)
  config = DadConfig(quantize_bits=1)
  draws = 4000
  ests = jax.jit(jax.vmap(lambda t: jax.tree.map(lambda g: g[0],
                                                 site_grads(config, x, kernel, bias, cot, t))))(
      jnp.arange(draws))
  for est, ref in zip(ests, exact):
    est, ref = np.asarray(est), np.asarray(ref[0])
    # every site holds the same gradient, and one draw is not the exact one
    assert np.max(np.abs(est[0] - ref)) > 1e-2
    # per coordinate: |mean - exact| <= 5 standard errors (+ float slack)
    se = est.std(0) / math.sqrt(draws)
    assert np.all(np.abs(est.mean(0) - ref) <= 5 * se + 1e-5)
  one = site_grads(config, x, kernel, bias, cot, 3)
  for g in one:  # the same gathered rows on every site: the same gradient
    np.testing.assert_array_equal(np.asarray(g), np.broadcast_to(np.asarray(g[0]), g.shape))


def test_error_shrinks_with_bits():
  x, kernel, bias, cot = make_layer(1)
  exact = site_grads(DadConfig(), x, kernel, bias, cot, 0)[0][0]
  errs = [float(jnp.mean(jnp.stack([jnp.sum((site_grads(DadConfig(quantize_bits=b), x, kernel,
                                                                  bias, cot, t)[0][0] - exact) ** 2)
                                     for t in range(8)])))
          for b in (1, 2, 4, 8)]
  assert errs[0] > errs[1] > errs[2] > errs[3]
  assert errs[3] < 1e-3 * errs[0]


def test_bits_formula():
  config = DadConfig(quantize_bits=3)
  expect = ROWS * (32 * packed_words(D_IN, 3) + 64 + 32 * packed_words(D_OUT, 3) + 64)
  assert quantized_gather_bits(ROWS, D_IN, D_OUT, 3) == expect
  assert layer_bits(config, ROWS, D_IN, D_OUT) == (expect, 0)
  assert layer_bits(DadConfig(), ROWS, D_IN, D_OUT) == (ROWS * (D_IN + D_OUT) * 32, 0)


@pytest.mark.parametrize("kwargs, name", [
    (dict(quantize_bits=0), "quantize_bits"), (dict(quantize_bits=9), "quantize_bits"),
    (dict(quantize_bits=2.0), "quantize_bits"), (dict(quantize_bits=2, mode="rank"), "mode"),
])
def test_bad_options_raise(kwargs, name):
  with pytest.raises(ValueError, match=name):
    DadConfig(**kwargs)
  with pytest.raises(ValueError, match=name):
    dad.Dense(4, **kwargs)


def test_spec_and_train_step_ledger_matches_the_compiled_all_gather():
  method = dadjax.build_method("qdad:4")
  assert method.dense.options["quantize_bits"] == 4
  model = MLP(hidden=(16,), num_classes=3, dense=method.dense)
  step = dadjax.make_train_step(model, optax.chain(method.tx, optax.sgd(0.1)), num_sites=SITES,
                                backend="shard_map")
  state = step.init(jax.random.key(0), np.zeros((1, D_IN), np.float32))
  k = jax.random.split(jax.random.key(1), 2)
  batch = {"x": np.asarray(jax.random.normal(k[0], (SITES * ROWS, D_IN))),
           "y": np.asarray(jax.random.randint(k[1], (SITES * ROWS,), 0, 3))}
  placed = step.place_batch(batch)
  moved = collective_bytes(step._run.lower(state, placed).compile().as_text())
  losses = []
  for _ in range(3):
    state, metrics = step.run(state, placed)
    losses.append(float(np.asarray(metrics["loss"])[0]))
  stats = dadjax.comm_stats(state)
  layers = [(D_IN, 16), (16, 3)]
  expect = sum(quantized_gather_bits(ROWS, i, o, 4) for i, o in layers)
  assert stats.gather_bits == (expect,) * SITES
  assert 8 * moved["gather"] == expect  # the ledger is what the compiled all-gathers move
  assert 8 * moved["reduce"] == max(stats.reduce_bits)  # the metrics' pmean only
  assert losses[-1] < losses[0]
