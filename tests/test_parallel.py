"""The SPMD train step: one site program, three backends, pooled equality."""
import chex
import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import dadjax
from helpers import batch, images, run_steps, sgd_allreduce


class TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(10)(nn.relu(nn.Dense(16)(x)))


def _train(backend, num_sites, steps=3, rows=32):
  ts = dadjax.make_train_step(TinyMLP(), sgd_allreduce(), num_sites=num_sites, backend=backend)
  state, metrics = run_steps(ts, lambda i: batch(rows, (8, 8, 1), 10, seed=i), steps)
  return ts, state, metrics[-1]


def _pooled_reference(steps=3, rows=32):
  """Plain optax on the pooled batch, one device, no dadjax in the loop."""
  x, _ = images(rows)
  model = TinyMLP()
  params = model.init(jax.random.key(0), x[:2])["params"]
  opt = optax.sgd(0.1, momentum=0.9)
  opt_state = opt.init(params)

  def loss(p, xb, yb):
    return optax.softmax_cross_entropy_with_integer_labels(model.apply({"params": p}, xb), yb).mean()

  for i in range(steps):
    xi, yi = images(rows, seed=i)
    grads = jax.grad(loss)(params, xi, yi)
    updates, opt_state = opt.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  return params


@pytest.mark.parametrize("num_sites", [1, pytest.param(2, marks=pytest.mark.slow),  # suite time
                                       pytest.param(4, marks=pytest.mark.slow), 8])
def test_backends_agree_and_equal_pooled_training(num_sites):
  reference = _pooled_reference()
  results = {}
  for backend in dadjax.parallel.BACKENDS:
    ts, state, _ = _train(backend, num_sites)
    results[backend] = ts.params(state)
    # Every site holds the same parameters.
    chex.assert_trees_all_close(ts.params(state, site=num_sites - 1), results[backend], atol=0)
  for backend, params in results.items():
    chex.assert_trees_all_close(params, results["vmap"], atol=1e-6, rtol=1e-5)
    chex.assert_trees_all_close(params, reference, atol=1e-6, rtol=1e-5)


def test_metrics_are_site_averages():
  ts, state, metrics = _train("vmap", 4, steps=1)
  loss = np.asarray(metrics["loss"])
  assert loss.shape == (4,)
  np.testing.assert_allclose(loss, loss[0])
  assert np.isfinite(loss).all()
  assert int(np.asarray(state.step)[0]) == 1


def test_ledger_counts_fp32_params_per_step():
  ts, state, _ = _train("shard_map", 8, steps=3)
  n_params = sum(np.size(p) for p in jax.tree.leaves(ts.params(state)))
  summary = dadjax.comm_stats(state.opt_state)
  assert summary.reduce_bits == (32 * n_params,) * 8
  assert summary.total == 3 * 32 * n_params


@pytest.mark.parametrize("backend", dadjax.parallel.BACKENDS)
def test_bad_batch_split_is_a_clear_error(backend):
  tx = dadjax.allreduce("data")
  ts = dadjax.make_train_step(TinyMLP(), tx, num_sites=4, backend=backend)
  state = ts.init(jax.random.key(0), np.zeros((2, 8, 8, 1), np.float32))
  x, y = images(30)
  with pytest.raises(ValueError, match="does not divide over num_sites=4"):
    ts(state, {"x": x, "y": y})


def test_bad_construction_arguments():
  tx = dadjax.allreduce("data")
  with pytest.raises(ValueError, match="backend"):
    dadjax.make_train_step(TinyMLP(), tx, backend="threads")
  with pytest.raises(ValueError, match="num_sites"):
    dadjax.make_train_step(TinyMLP(), tx, backend="vmap")
  with pytest.raises(ValueError, match="num_sites"):
    dadjax.make_mesh(num_sites=9)
  with pytest.raises(ValueError, match="axis_name"):
    dadjax.make_train_step(TinyMLP(), tx, mesh=dadjax.make_mesh(2, "sites"))


def test_vmap_simulates_more_sites_than_devices():
  _, state, metrics = _train("vmap", 16, steps=2, rows=32)
  assert np.asarray(state.step).shape == (16,)
  assert np.isfinite(np.asarray(metrics["loss"])).all()
