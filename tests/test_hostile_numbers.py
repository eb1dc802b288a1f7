"""Hostile numbers: huge and tiny gradients, parameters without gradient, fp16 parameters."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import adaptive, registry
from dadjax import compress as C
from helpers import batch

SITES = 4
AXIS = "data"

# Registered entries with required arguments, and the spec each is tried as.
FILL = {"ef": "ef_topk:0.25", "accordion_rank_dad": "accordion_rank_dad:2:1",
        "accordion": "accordion(powersgd:2,powersgd:1)",
        "accordion_batch": "accordion_batch(allreduce)", "local_sgd": "local_sgd:2",
        "diloco": "diloco:2", "streaming_diloco": "streaming_diloco:2",
        "sparseloco": "sparseloco:2", "demo": "demo:2"}
EXTRA_COMPRESSORS = ["qsgd:16:64", "ef_sign", "ef_scaled_sign", "ef_powersgd:1", "topk:0.25",
                     "randomk:0.25"]


def _specs(kind):
  out = []
  for entry in registry.entries(kind):
    if any(a.required for a in entry.args):
      assert entry.name in FILL, f"add a spec for {kind} {entry.name!r} to FILL"
      out.append(FILL[entry.name])
    else:
      out.append(entry.name)
  return out


COMPRESSORS = sorted(set(_specs("compressor")) | set(EXTRA_COMPRESSORS))
METHODS = sorted(set(_specs("method")) | set(COMPRESSORS))


def _hostile_tree():
  rng = np.random.default_rng(0)
  mixed = rng.normal(size=(8, 16)).astype(np.float32)
  mixed[:4] *= 1e30
  mixed[4:] *= 1e-30
  return {"big": (1e30 * rng.normal(size=(6, 8))).astype(np.float32),
          "tiny": (1e-30 * rng.normal(size=(5, 7))).astype(np.float32),
          "mixed": mixed, "bias": (1e30 * rng.normal(size=(9,))).astype(np.float32)}


def _run_sites(tx, grads, steps=2):
  sites = jax.tree.map(lambda x: jnp.stack([jnp.asarray(x) * (1 + 0.1 * i) for i in range(SITES)]),
                       grads)
  state = jax.vmap(tx.init)(sites)
  update = jax.jit(jax.vmap(tx.update, axis_name=AXIS))
  for _ in range(steps):
    out, state = update(sites, state)
  return out, state


def _finite(tree):
  return all(bool(np.all(np.isfinite(np.asarray(x, np.float64))))
             for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact))


@pytest.mark.parametrize("spec", COMPRESSORS)
def test_every_compressor_is_finite_on_huge_and_tiny_gradients(spec):
  tx = C.compressed(C.get_compressor(spec), axis_name=AXIS)
  out, state = _run_sites(tx, _hostile_tree())
  assert _finite(out), spec
  assert _finite(state), spec


@pytest.mark.slow  # suite time; test_compress's bucket tests cover buckets in the default run
def test_qsgd_buckets_keep_huge_and_tiny_entries():
  grads = _hostile_tree()
  c = C.get_compressor("qsgd:16:64")
  keys = jax.random.split(jax.random.key(0), 64)
  est = jax.vmap(lambda k: C.compressed(c, axis_name=None).update(
      grads, C.compressed(c, axis_name=None).init(grads))[0])(keys)  # same key: deterministic
  mean = jax.tree.map(lambda x: np.asarray(x).mean(0), est)
  for name in ("big", "tiny"):
    g = np.asarray(grads[name], np.float64)
    got = np.asarray(mean[name], np.float64)
    assert np.all(np.isfinite(got))
    # the norm is neither inf (1e30 squared) nor 0 (1e-30 squared): levels are not all 0
    assert np.any(got != 0) and np.max(np.abs(got)) <= 2 * np.linalg.norm(g)


def test_accordion_detector_norms_stay_finite_at_1e30():
  grads = _hostile_tree()
  tx = adaptive.accordion(C.get_compressor("powersgd:1"), C.get_compressor("powersgd:2"),
                          window=1, axis_name=AXIS)
  _, state = _run_sites(tx, grads, steps=3)
  norms = np.asarray(state.detector.norms)
  assert np.all(np.isfinite(norms)) and np.all(norms > 0)  # neither inf nor flushed to 0
  assert np.max(norms) > 1e30
  tiny = {"tiny": grads["tiny"]}
  _, state = _run_sites(adaptive.accordion(C.get_compressor("powersgd:1"),
                                           C.get_compressor("powersgd:2"), window=1,
                                           axis_name=AXIS), tiny, steps=2)
  assert np.all(np.asarray(state.detector.norms) > 0)  # 1e-30 squared would underflow to 0


def test_accordion_batch_detector_is_finite_at_1e30():
  tx = adaptive.accordion_batch(optax.chain(dadjax.allreduce(AXIS), optax.sgd(1e-32)),
                                window=1, axis_name=AXIS)
  out, state = _run_sites(tx, _hostile_tree(), steps=3)
  assert _finite(out) and np.all(np.isfinite(np.asarray(state.detector.norms)))


# -- a parameter without gradient stays where it is ---------------------------------------

class TwoHeads(nn.Module):
  """A hidden layer, the head the loss reads and a head nothing reads (no gradient)."""

  num_classes: int = 3
  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x, train=False):
    h = nn.relu(self.dense(8, name="hidden")(x))
    self.dense(5, name="unused")(h)
    return self.dense(self.num_classes, name="head")(h)


@pytest.mark.parametrize("spec", METHODS)
def test_a_parameter_without_gradient_stays_fixed(spec):
  method = dadjax.build_method(spec, steps_per_epoch=2)
  model = TwoHeads(dense=method.dense) if method.dense is not None else TwoHeads()
  step = dadjax.make_train_step(model, method.optimizer(optax.sgd(0.1)), num_sites=SITES,
                                backend="vmap", batch_stage=method.batch_stage)
  state = step.init(jax.random.key(0), np.zeros((1, 6), np.float32))
  before = jax.tree.map(np.asarray, state.params["unused"])
  moved = jax.tree.map(np.asarray, state.params["hidden"])
  for i in range(3):
    state, _ = step(state, batch(SITES * 4, seed=i))
  after = jax.tree.map(np.asarray, state.params["unused"])
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(a, b, err_msg=spec)
  changed = [not np.array_equal(a, b) for a, b in
             zip(jax.tree.leaves(jax.tree.map(np.asarray, state.params["hidden"])),
                 jax.tree.leaves(moved))]
  assert any(changed), f"{spec}: the used layers did not train either"


@pytest.mark.slow  # suite time; sign's majority vote is pinned in test_compress and test_two_phase
def test_sign_on_one_site_and_abstaining_sites():
  c = C.get_compressor("sign")
  g = {"w": jnp.zeros((3, 5)), "v": jnp.asarray([-2.0, 0.0, 3.0])}
  tx = C.compressed(c, axis_name=None)
  out, _ = tx.update(g, tx.init(g))
  np.testing.assert_array_equal(out["w"], 0.0)
  np.testing.assert_array_equal(out["v"], [-1.0, 1.0, 1.0])  # sign(0) = +1 inside a tensor
  # Two of four sites have no gradient: the other two decide; all four abstain: 0.
  sites = {"w": jnp.stack([jnp.full((4,), -1.0), jnp.full((4,), -2.0), jnp.zeros(4),
                           jnp.zeros(4)]), "z": jnp.zeros((4, 4))}
  txs = C.compressed(c, axis_name=AXIS)
  out, _ = jax.vmap(txs.update, axis_name=AXIS)(sites, jax.vmap(txs.init)(sites))
  np.testing.assert_array_equal(out["w"], -1.0)
  np.testing.assert_array_equal(out["z"], 0.0)


# -- fp16 parameters ------------------------------------------------------------------------

def _fp16_sites(value=30000.0, sites=8):
  """fp16 gradients that each fit fp16 (max 65504) but whose sum over the sites does not."""
  return {"w": jnp.full((sites, 4, 3), value, jnp.float16),
          "b": jnp.full((sites, 3), -value, jnp.float16)}


@pytest.mark.parametrize("spec", ["allreduce", "bf16", pytest.param("topk:0.5", marks=pytest.mark.slow),
                                  "identity"])
def test_fp16_gradients_are_averaged_without_overflow(spec):
  tx = (dadjax.allreduce(AXIS) if spec == "allreduce"
        else C.compressed(C.get_compressor(spec), axis_name=AXIS))
  sites = _fp16_sites()
  out, _ = jax.vmap(tx.update, axis_name=AXIS)(sites, jax.vmap(tx.init)(sites))
  assert out["w"].dtype == jnp.float16
  want = 30000.0 if spec != "topk:0.5" else None
  assert _finite(out), spec
  if want is not None:
    np.testing.assert_allclose(np.asarray(out["w"], np.float32), want, rtol=1e-2)  # bf16 wire
    np.testing.assert_allclose(np.asarray(out["b"], np.float32), -want, rtol=1e-2)


def test_fp16_parameters_train_with_allreduce():
  model = nn.Dense(3, param_dtype=jnp.float16, dtype=jnp.float16)

  def loss_fn(params, variables, batch, rng, train):
    del rng, train
    out = model.apply({**variables, "params": params}, batch["x"])
    return jnp.mean(out.astype(jnp.float32)) * 3e4, out  # d loss / d bias = 1e4 per site

  step = dadjax.make_train_step(model, optax.chain(dadjax.allreduce(AXIS), optax.sgd(1e-5)),
                                loss_fn=loss_fn, metrics_fn=lambda aux, batch: {},
                                num_sites=8, backend="vmap")
  state = step.init(jax.random.key(0), np.zeros((1, 4), np.float16))
  batch = {"x": np.full((8 * 2, 4), 5.0, np.float16), "y": np.zeros((16,), np.int32)}
  state, _ = step(state, batch)
  assert state.params["bias"].dtype == jnp.float16
  assert _finite(state.params)
  np.testing.assert_allclose(np.asarray(state.params["bias"], np.float32), -0.1, rtol=1e-2)


# -- rank-dAD under Accordion: the layer's own window norm --------------------------------

class HugeAndTiny(nn.Module):
  """A hidden layer and a head whose output columns get cotangents of 1e30 and 1e-30."""

  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x, train=False):
    h = nn.relu(self.dense(8, name="hidden")(x))
    return self.dense(4, name="head")(h)


MIXED, TINY = [1e30, -1e30, 1e-30, -1e-30], [1e-30, -1e-30, 2e-30, 1e-30]


@pytest.mark.parametrize("spec, weight", [
    pytest.param("accordion_rank_dad:2:1:window=2", MIXED, id="accordion-mixed"),
    pytest.param("accordion_rank_dad:2:1:window=2", TINY, id="accordion-tiny",
                 marks=pytest.mark.slow),
    pytest.param("rank_dad:2:two_way:warm:ef", MIXED, id="two-way-mixed", marks=pytest.mark.slow)])
def test_rank_dad_on_huge_and_tiny_gradients(spec, weight):
  from dadjax.run._checkpoint import state_digest
  method = dadjax.build_method(spec, steps_per_epoch=2)
  model = HugeAndTiny(dense=method.dense)
  weight = jnp.asarray(weight, jnp.float32)

  def loss_fn(params, variables, batch, rng, train):
    del rng, train
    out = model.apply({**variables, "params": params}, batch["x"])
    return jnp.mean(jnp.sum(out * weight, axis=1)), out  # kernel gradients of 1e30 and 1e-30

  big = float(np.max(np.abs(weight)))
  step = dadjax.make_train_step(model, method.optimizer(optax.sgd(0.01 / big)), loss_fn=loss_fn,
                                metrics_fn=lambda aux, batch: {}, num_sites=SITES,
                                backend="vmap", batch_stage=method.batch_stage)
  state = step.init(jax.random.key(0), np.zeros((1, 6), np.float32))
  before = np.asarray(state.params["head"]["kernel"])
  for i in range(7):  # three windows (each ends in a check), one step into the fourth
    state, _ = step(state, batch(SITES * 4, seed=i))
  assert _finite(state.params)
  assert state_digest(state)[1] == []  # nothing a save would call "training diverged"
  # the factors were not lost (G^T G of 1e30 overflows, of 1e-30 underflows)
  assert np.any(np.asarray(state.params["head"]["kernel"])[:, :2] != before[:, :2])
  if not spec.startswith("accordion"):
    return
  head = jax.tree.map(np.asarray, dadjax.dad.current_state(
      jax.tree.map(lambda x: x[0], state.model_state["dad_state"]["head"]["dad"])))
  # neither inf (1e30 squared) nor 0 (1e-30 squared), and each window is compared
  assert big < head["norm"] < np.inf and head["ref_norm"] == head["norm"]
  assert 0 < head["win_norm"] < np.inf and head["windows"] == 3


def test_dataquant_gradient_norm_scores_of_huge_and_tiny_rows():
  from dadjax import dataquant
  x = np.ones((3, 5), np.float32) * np.asarray([[1e30], [1e-30], [1.0]], np.float32)
  params = {"w": jnp.ones((5,)), "v": jnp.ones((2,))}
  loss_fn = lambda p, batch: (jnp.sum(batch["x"] @ p["w"] + batch["x"][:, 0] * jnp.sum(p["v"])),
                              None)  # a row's gradient: (x, x_0, x_0)
  scores = np.asarray(dataquant.grad_norm_scores(loss_fn, params, {"x": x}), np.float64)
  want = np.sqrt(7) * np.asarray([1e30, 1e-30, 1.0])
  np.testing.assert_allclose(scores, want, rtol=1e-6)  # neither inf (1e30^2) nor 0 (1e-30^2)


def test_dataquant_codebooks_of_huge_and_tiny_features_are_exactly_scaled():
  from dadjax.dataquant import _codebook
  rng = np.random.default_rng(3)
  x = rng.normal(size=(16, 12)).astype(np.float32)
  key = jax.random.key(0)
  book, sizes = _codebook.fit_codebook(x, 2, 4, key)
  codes = _codebook.encode_codebook(x, book, 2)
  for e in (70, -70):  # 2^70 ~ 1e21: squared distances overflow; 2^-70: they underflow
    big_book, big_sizes = _codebook.fit_codebook(np.ldexp(x, e), 2, 4, key)
    np.testing.assert_array_equal(big_book, np.ldexp(np.asarray(book), e))  # exact
    np.testing.assert_array_equal(big_sizes, sizes)
    np.testing.assert_array_equal(
        _codebook.encode_codebook(np.ldexp(x, e), np.ldexp(np.asarray(book), e), 2), codes)
