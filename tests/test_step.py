"""The general train step: loss_fn, rngs, train flag, mutable collections, metrics, batch stage."""
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dad, models
from dadjax.comm import metered_all_gather, site_index
from dadjax.parallel import (
    classification_loss,
    regression_loss,
    stack_sites,
    unstack_site,
)
from dadjax.extend import BatchStage, GradResult, StageOutput
from helpers import images, sgd_allreduce

SITES = 4


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


# -- BatchNorm -----------------------------------------------------------------


def _resnet(width=4):
  return models.ResNet(stage_sizes=(1,), width=width, num_classes=10, norm="batch")


def _bn_train(backend, average=("batch_stats",), steps=12):
  x, _ = images(SITES * 8)
  # Learnable labels: the argmax of fixed random projections of the image.
  w = np.random.default_rng(1).normal(size=(64, 10))
  y = np.argmax(x.reshape(len(x), -1) @ w, -1).astype(np.int32)
  step = dadjax.make_train_step(_resnet(8), sgd_allreduce(0.2), num_sites=SITES,
                                backend=backend, average=average)
  state = step.init(jax.random.key(0), x[:8])
  init_stats = _host(state.model_state["batch_stats"])
  losses = []
  for _ in range(steps):
    state, metrics = step(state, {"x": x, "y": y})
    losses.append(float(np.asarray(metrics["loss"])[0]))
  return step, state, init_stats, losses, (x, y)


def test_batchnorm_resnet_trains_and_evaluates_with_running_averages():
  step, state, init_stats, losses, (x, y) = _bn_train("vmap")
  assert np.mean(losses[-3:]) < 0.8 * losses[0]  # measured: 2.64 -> 1.91
  stats = _host(state.model_state["batch_stats"])
  # The running statistics moved, and were averaged: every site holds the same.
  moved = [np.abs(a - b).max() for a, b in zip(jax.tree.leaves(stats), jax.tree.leaves(init_stats))]
  assert min(moved) > 1e-3
  for leaf in jax.tree.leaves(stats):
    np.testing.assert_allclose(leaf, np.broadcast_to(leaf[0], leaf.shape), atol=1e-6)
  # Evaluation = model.apply with train=False on site 0's running averages.
  variables = {"params": step.params(state), "batch_stats": unstack_site(stats)}
  logits = step.model.apply(variables, x, train=False)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  got = step.evaluate(state, {"x": x, "y": y})
  np.testing.assert_allclose(got["loss"], want, rtol=1e-5)
  np.testing.assert_allclose(got["accuracy"], np.mean(np.argmax(logits, -1) == y), atol=1e-6)
  # ... which differs from normalizing with the batch's own statistics.
  train_logits, _ = step.model.apply(variables, x, train=True, mutable=["batch_stats"])
  assert np.abs(np.asarray(train_logits) - np.asarray(logits)).max() > 1e-3


def test_batch_stats_per_site_and_their_ledger():
  _, local, _, _, _ = _bn_train("vmap", average=(), steps=2)
  stats = _host(local.model_state["batch_stats"])
  # Different rows per site: different running statistics per site.
  assert max(np.abs(leaf[1] - leaf[0]).max() for leaf in jax.tree.leaves(stats)) > 1e-4
  _, synced, _, _, _ = _bn_train("vmap", steps=2)
  stats_bits = 32 * sum(np.size(v[0]) for v in jax.tree.leaves(stats))
  metric_bits = 2 * 32  # loss, accuracy
  assert dadjax.comm_stats(local.comm).bits_per_step == metric_bits
  assert dadjax.comm_stats(synced.comm).bits_per_step == metric_bits + stats_bits
  whole = dadjax.comm_stats(synced)
  opt = dadjax.comm_stats(synced.opt_state)
  assert whole.bits_per_step == opt.bits_per_step + metric_bits + stats_bits
  assert whole.total == opt.total + 2 * (metric_bits + stats_bits)
  assert whole.reduce_calls == opt.reduce_calls + 2


# -- dropout and rngs ------------------------------------------------------------


def _dropout_step(tx, backend="vmap", **kwargs):
  model = models.MLP(hidden=(32,), num_classes=10, dropout=0.5)
  return dadjax.make_train_step(model, tx, num_sites=SITES, backend=backend, **kwargs)


def test_dropout_masks_differ_per_site_and_eval_is_deterministic():
  # Same rows on every site and no communication: sites can only drift apart
  # through their dropout masks.
  x, y = images(8)
  batch = {"x": np.tile(x, (SITES, 1, 1, 1)), "y": np.tile(y, SITES)}
  step = _dropout_step(optax.sgd(0.1), allow_local=True)  # apart on purpose
  state = step.init(jax.random.key(0), x)
  state, _ = step(state, batch)
  p = _host(state.params)
  for site in range(1, SITES):
    assert max(np.abs(a[site] - a[0]).max() for a in jax.tree.leaves(p)) > 1e-6
  # train=False: no dropout, the same numbers every call, = the plain forward pass.
  first, again = step.evaluate(state, {"x": x, "y": y}), step.evaluate(state, {"x": x, "y": y})
  assert first == again
  logits = step.model.apply({"params": step.params(state)}, x)
  np.testing.assert_allclose(first["loss"],
                             optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
                             rtol=1e-5)


def test_dropout_trains_and_resumes_exactly():
  x, y = images(SITES * 8)
  step = _dropout_step(sgd_allreduce())
  state0 = step.init(jax.random.key(1), x[:8])
  state = state0
  losses = []
  for t in range(20):
    state, metrics = step(state, {"x": x, "y": y})
    losses.append(float(np.asarray(metrics["loss"])[0]))
    if t == 9:
      saved = _host(state)  # a checkpoint: host copy of the whole state
  assert np.mean(losses[-3:]) < 0.8 * losses[0]
  resumed = step.place(saved)
  for _ in range(10):
    resumed, _ = step(resumed, {"x": x, "y": y})
  chex.assert_trees_all_close(_host(resumed.params), _host(state.params), atol=0, rtol=0)
  # A different init key gives different masks (the base key is in the state).
  other = step.place(_host(state0)._replace(rng=stack_sites(
      np.asarray(jax.random.key_data(jax.random.key(7))), SITES)))
  a, _ = step(state0, {"x": x, "y": y})
  b, _ = step(other, {"x": x, "y": y})
  assert max(np.abs(u - v).max() for u, v in zip(jax.tree.leaves(_host(a.params)),
                                                  jax.tree.leaves(_host(b.params)))) > 1e-6


def test_site_keys_are_domain_separated():
  base = jax.random.key(0)
  model, shared, site = dadjax.parallel.site_keys(base, 3, 1)
  model0, shared0, site0 = dadjax.parallel.site_keys(base, 3, 0)
  data = [np.asarray(jax.random.key_data(k)).tolist() for k in
          (model, shared, site, model0, site0, jax.random.fold_in(shared, 1))]
  assert len({tuple(d) for d in data}) == len(data)
  assert np.array_equal(jax.random.key_data(shared), jax.random.key_data(shared0))
  assert np.array_equal(jax.random.key_data(dadjax.parallel.site_keys(base, 3, 1)[0]),
                        jax.random.key_data(model))


# -- backends ------------------------------------------------------------------------


@pytest.mark.parametrize("make", ["dropout", "batchnorm"])
def test_backends_agree_with_rngs_and_batch_stats(make):
  x, y = images(SITES * 4)
  results = {}
  for backend in dadjax.parallel.BACKENDS:
    if make == "dropout":
      step = _dropout_step(sgd_allreduce(), backend)
    else:
      step = dadjax.make_train_step(_resnet(), sgd_allreduce(0.05), num_sites=SITES,
                                    backend=backend)
    state = step.init(jax.random.key(0), x[:4])
    for t in range(2):
      state, metrics = step(state, {"x": x[::(-1) ** t], "y": y[::(-1) ** t]})
    results[backend] = (_host(state.params), _host(state.model_state), _host(metrics))
  for backend in ("shard_map", "pmap"):
    chex.assert_trees_all_close(results[backend], results["vmap"], atol=1e-5, rtol=1e-5)


# -- regression and arbitrary batches ---------------------------------------------


def test_mse_regression_with_2d_targets_trains():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SITES * 16, 6)).astype(np.float32)
  w = rng.normal(size=(6, 3)).astype(np.float32)
  y = (x @ w).astype(np.float32)  # (rows, 3) targets
  model = models.MLP(hidden=(32,), num_classes=3)
  step = dadjax.make_train_step(model, sgd_allreduce(0.02), loss_fn=regression_loss(model),
                                num_sites=SITES, backend="vmap")
  state = step.init(jax.random.key(0), x[:16])
  first = step.evaluate(state, {"x": x, "y": y})
  for _ in range(60):
    state, metrics = step(state, {"x": x, "y": y})
  assert set(metrics) == {"loss", "mse"}
  np.testing.assert_allclose(metrics["mse"], metrics["loss"], rtol=1e-6)
  last = step.evaluate(state, {"x": x, "y": y})
  assert last["mse"] < 0.1 * first["mse"]
  pred = model.apply({"params": step.params(state)}, x)
  np.testing.assert_allclose(last["mse"], np.mean((np.asarray(pred) - y) ** 2), rtol=1e-5)


def test_custom_loss_on_a_tuple_batch_with_custom_metrics():
  x, y = images(SITES * 4)
  model = models.MLP(hidden=(16,))

  def loss_fn(params, variables, batch, rng, train):
    del rng, train
    inputs, labels = batch
    logits = model.apply({"params": params, **variables}, inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  def metrics_fn(aux, batch):
    return {"top_logit": jnp.max(aux), "rows": jnp.float32(batch[1].shape[0])}

  step = dadjax.make_train_step(model, sgd_allreduce(), loss_fn=loss_fn, metrics_fn=metrics_fn,
                                num_sites=SITES, backend="shard_map")
  state = step.init(jax.random.key(0), x[:4])
  state, metrics = step(state, (x, y))
  assert set(metrics) == {"loss", "top_logit", "rows"}
  np.testing.assert_array_equal(np.asarray(metrics["rows"]), 4.0)
  # Same parameters as the default classification loss on the dict batch.
  ref = dadjax.make_train_step(model, sgd_allreduce(), num_sites=SITES, backend="shard_map")
  ref_state, _ = ref(ref.init(jax.random.key(0), x[:4]), {"x": x, "y": y})
  chex.assert_trees_all_close(step.params(state), ref.params(ref_state), atol=1e-6)


def test_bad_step_arguments():
  model, tx = models.MLP(), dadjax.allreduce()
  with pytest.raises(ValueError, match="mutable"):
    dadjax.make_train_step(model, tx, mutable=("params",), backend="vmap", num_sites=2)
  with pytest.raises(ValueError, match="average"):
    dadjax.make_train_step(model, tx, average=("stats",), backend="vmap", num_sites=2)
  with pytest.raises(ValueError, match="mutable"):
    dadjax.make_train_step(model, tx, mutable="batch_stats", backend="vmap", num_sites=2)
  with pytest.raises(ValueError, match="batch_stage"):
    dadjax.make_train_step(model, tx, batch_stage=lambda b: b, backend="vmap", num_sites=2)
  step = dadjax.make_train_step(model, tx, backend="vmap", num_sites=2)
  step.check_batch({"x": np.zeros((4, 3)), "y": np.zeros((6,))})  # each leaf splits in 2
  with pytest.raises(ValueError, match="does not divide"):
    step.check_batch({"x": np.zeros((4, 3)), "y": np.zeros(())})
  with pytest.raises(ValueError, match="no arrays"):
    step.check_batch({})
  with pytest.raises(ValueError, match="mutable"):
    dadjax.make_train_step(model, tx, mutable=("cache",), average=(), backend="vmap",
                           num_sites=2).init(jax.random.key(0), np.zeros((2, 64), np.float32))


# -- the batch stage hook ------------------------------------------------------------


def _gather_stage():
  """All-gathers the batch and returns the gradient on the gathered rows.

  Its state counts steps and records the keys the step handed over.
  """

  def init(params):
    del params
    key = np.zeros_like(np.asarray(jax.random.key_data(jax.random.key(0))))
    return {"calls": jnp.int32(0), "key": key, "shared": key}

  def apply(ctx, params, batch, state):
    gathered, traffic = metered_all_gather(batch, ctx.axis_name)
    rows = jax.tree.map(lambda v: v.reshape((-1,) + v.shape[2:]), gathered)
    result = ctx.grad_fn(params, rows)
    b = batch["y"].shape[0]
    own = jax.lax.dynamic_slice_in_dim(result.aux["logits"], site_index(ctx.axis_name) * b, b)
    result = result._replace(aux={**result.aux, "logits": own})
    new = {"calls": state["calls"] + 1, "key": jax.random.key_data(ctx.key),
           "shared": jax.random.key_data(ctx.shared_key)}
    return StageOutput(result, new, traffic)

  return BatchStage(init, apply)


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_batch_stage_gathered_gradient_equals_allreduce(backend):
  x, y = images(SITES * 4)
  model = models.MLP(hidden=(16,))
  ref = dadjax.make_train_step(model, optax.chain(dadjax.allreduce("data"), optax.sgd(0.5)),
                               num_sites=SITES, backend=backend)
  # Every site computes the same gradient: no collective in the optimizer.
  staged = dadjax.make_train_step(model, optax.sgd(0.5), batch_stage=_gather_stage(),
                                  num_sites=SITES, backend=backend)
  r, s = ref.init(jax.random.key(0), x[:4]), staged.init(jax.random.key(0), x[:4])
  for t in range(3):
    batch = {"x": x[::(-1) ** t], "y": y[::(-1) ** t]}
    r, rm = ref(r, batch)
    s, sm = staged(s, batch)
  chex.assert_trees_all_close(staged.params(s), ref.params(r), atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(sm["loss"]), np.asarray(rm["loss"]), rtol=1e-5)
  np.testing.assert_allclose(np.asarray(sm["accuracy"]), np.asarray(rm["accuracy"]), atol=1e-6)
  stage_state = _host(s.stage_state)
  np.testing.assert_array_equal(stage_state["calls"], 3)
  # Shared key: one per step for all sites; site keys: all different.
  assert len({tuple(k) for k in stage_state["shared"]}) == 1
  assert len({tuple(k) for k in stage_state["key"]}) == SITES
  # The step's ledger holds the gather (x float32, y int32) and the metrics.
  gather_bits = 4 * (8 * 8 * 32 + 32)
  summary = dadjax.comm_stats(s)
  assert summary.gather_bits == (gather_bits,) * SITES
  assert summary.reduce_bits == (2 * 32,) * SITES
  assert summary.total == 3 * (gather_bits + 2 * 32)
  assert (summary.gather_calls, summary.reduce_calls) == (1, 1)


# -- dAD layers that get no cotangent ------------------------------------------------


class _TwoHeads(nn.Module):
  """A shared trunk and two dAD heads; ``use_b=False`` computes head B but discards it."""

  dense: object = nn.Dense
  use_b: bool = True

  @nn.compact
  def __call__(self, x, train=False):
    del train
    h = nn.tanh(self.dense(8, name="trunk")(x))
    a = self.dense(3, name="head_a")(h)
    b = self.dense(3, name="head_b")(h)
    return a + b if self.use_b else a


def test_dad_layer_without_cotangent_keeps_its_state():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SITES * 4, 6)).astype(np.float32)
  y = rng.integers(0, 3, SITES * 4).astype(np.int32)
  dense = functools.partial(dad.Dense, axis_name="data", mode="rank", rank=1, warm_start=True,
                            error_feedback=True)
  both, only_a = _TwoHeads(dense), _TwoHeads(dense, use_b=False)
  mask = dad.layer_mask(both, x[:4])
  tx = optax.chain(dad.synchronize(mask), optax.sgd(0.1))
  step_both = dadjax.make_train_step(both, tx, num_sites=SITES, backend="vmap")
  step_a = dadjax.make_train_step(only_a, tx, num_sites=SITES, backend="vmap")
  state = step_both.init(jax.random.key(0), x[:4])
  batch = {"x": x, "y": y}
  state, _ = step_both(state, batch)
  before = _host(state.model_state["dad_state"])
  assert np.all(before["head_b"]["dad"]["uses"] == 1)
  assert np.abs(before["head_b"]["dad"]["basis"]).max() > 0
  state, _ = step_a(state, batch)  # head B is computed but not on the loss's path
  after = _host(state.model_state["dad_state"])
  chex.assert_trees_all_equal(after["head_b"], before["head_b"])
  # The layers that ran advanced their counter.
  assert np.all(after["head_a"]["dad"]["step"] == 2) and np.all(after["trunk"]["dad"]["step"] == 2)
  # And head B resumes from its kept state: its step counter continues at 2.
  state, _ = step_both(state, batch)
  np.testing.assert_array_equal(_host(state.model_state["dad_state"])["head_b"]["dad"]["step"], 2)


def test_keep_unused_state_per_stacked_layer():
  old = {"l": {"uses": jnp.array([1.0, 2.0]), "step": jnp.array([3, 7], jnp.int32),
               "basis": jnp.ones((2, 3, 1))}}
  new = {"l": {"uses": jnp.array([0.0, 1.0]), "step": None, "basis": jnp.full((2, 3, 1), 5.0)}}
  out = dadjax.parallel.keep_unused_state(new, old)
  np.testing.assert_array_equal(out["l"]["uses"], [1.0, 1.0])
  np.testing.assert_array_equal(out["l"]["basis"][0], 1.0)
  np.testing.assert_array_equal(out["l"]["basis"][1], 5.0)
  # The step owns the counter: +1 only where the stacked layer ran, dtype kept.
  assert out["l"]["step"].dtype == jnp.int32
  np.testing.assert_array_equal(out["l"]["step"], [3, 8])
  chex.assert_trees_all_equal(out, dad.next_state(old, new))


def test_default_losses_honour_row_weights():
  x, y = images(6)
  model = models.MLP(hidden=(8,))
  params = model.init(jax.random.key(0), x)["params"]
  w = np.array([0.0, 1.0, 2.0, 0.5, 0.0, 3.0], np.float32)
  loss, aux = classification_loss(model)(params, {}, {"x": x, "y": y, "weight": w},
                                         jax.random.key(1), True)
  rows = optax.softmax_cross_entropy_with_integer_labels(aux["logits"], y)
  np.testing.assert_allclose(loss, np.mean(w * rows), rtol=1e-6)  # / rows, not / sum(w)
  assert set(aux) == {"logits", "model_state"}
  metrics = dadjax.parallel.default_metrics({"logits": aux["logits"]}, {"y": y, "weight": w})
  hit = (np.argmax(aux["logits"], -1) == y).astype(np.float32)
  np.testing.assert_allclose(metrics["accuracy"], np.sum(w * hit) / np.sum(w), rtol=1e-6)
