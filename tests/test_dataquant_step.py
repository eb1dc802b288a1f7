"""Data quantization through the real train step: contract, metrics, registry, ledger, rows."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dataquant as DQ
from dadjax import cli, registry
from dadjax.comm import bits_to_int
from dadjax.extend import packed_words
from dadjax.config import Config
from dadjax.models import MLP
from dadjax.train import build, train

SITES, ROWS, DIM, CLASSES = 8, 4, 6, 3
MODEL = MLP(hidden=(8,), num_classes=CLASSES)


def make_batch(seed, weighted=False):
  k = jax.random.split(jax.random.key(seed), 3)
  batch = {"x": np.asarray(jax.random.normal(k[0], (SITES * ROWS, DIM))),
           "y": np.asarray(jax.random.randint(k[1], (SITES * ROWS,), 0, CLASSES))}
  if weighted:
    batch["weight"] = np.asarray(jax.random.uniform(k[2], (SITES * ROWS,), minval=0.2,
                                                    maxval=2.0))
  return batch


def run(backend, tx, stage=None, steps=3, weighted=False):
  step = dadjax.make_train_step(MODEL, optax.chain(tx, optax.sgd(0.5)), batch_stage=stage,
                                num_sites=SITES, backend=backend)
  state = step.init(jax.random.key(0), np.zeros((1, DIM), np.float32))
  history = []
  for i in range(steps):
    state, metrics = step(state, make_batch(i, weighted))
    history.append({k: np.asarray(v) for k, v in metrics.items()})
  return step, state, history


@pytest.mark.parametrize("backend, weighted", [("vmap", False), ("vmap", True),
                                               ("shard_map", True)])
def test_unquantized_open_gate_trains_exactly_like_allreduce(backend, weighted):
  _, ref_state, ref_hist = run(backend, dadjax.allreduce("data"), weighted=weighted)
  method = dadjax.build_method("dataquant")  # bits=none: exact rows, every row sent
  assert method.tx is None and method.batch_stage is not None
  _, state, hist = run(backend, optax.identity(), method.batch_stage, weighted=weighted)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  for m, r in zip(hist, ref_hist):
    assert set(m) == set(r) == {"loss", "accuracy"}  # the site's own rows: metrics line up
    np.testing.assert_allclose(m["loss"], r["loss"], atol=1e-6)
    np.testing.assert_array_equal(m["accuracy"], r["accuracy"])


def test_metrics_are_of_the_site_rows_when_quantized_and_gated():
  stage = DQ.dataquant(1, gate=0.5, gate_mode="sample", correction="ef_scaled_sign")
  _, ref_state, ref_hist = run("vmap", dadjax.allreduce("data"), steps=1)
  _, state, hist = run("vmap", optax.identity(), stage, steps=1)
  # the first step's metrics are those of the same initial params on the same rows
  np.testing.assert_allclose(hist[0]["loss"], ref_hist[0]["loss"], atol=1e-6)
  np.testing.assert_array_equal(hist[0]["accuracy"], ref_hist[0]["accuracy"])
  # but the update differs: the gradient came from 1-bit, gated data
  gap = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
            for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref_state.params)))
  assert gap > 1e-4


@pytest.mark.parametrize("spec, expect", [
    ("dataquant:2", dict(bits=2)),
    ("dataquant:2:correct=ef_scaled_sign:gate=0.5", dict(bits=2, correct="ef", gate=0.5)),
    ("dataquant(2, correct=topk(0.1), gate=0.5, gate_mode=sample)",
     dict(bits=2, correct="topk", gate=0.5, gate_mode="sample")),
])
def test_registry_specs_build_a_batch_stage_method(spec, expect):
  method = dadjax.build_method(spec)
  assert method.name == spec and method.tx is None and method.dense is None
  assert isinstance(method.batch_stage, dadjax.BatchStage)
  entry, kwargs = registry.resolve("method", spec)
  assert entry.name == "dataquant" and entry.family == "dataquant"
  assert kwargs["bits"] == expect["bits"]
  assert kwargs.get("gate") == expect.get("gate")
  assert kwargs.get("gate_mode", "threshold") == expect.get("gate_mode", "threshold")
  if "correct" in expect:  # resolved, not built: the nested spec's entry and arguments
    assert isinstance(kwargs["correct"], registry.Resolved)
    assert kwargs["correct"].entry.name == expect["correct"]


@pytest.mark.parametrize("spec, why", [("dataquant:9", "bits"), ("dataquant:2:gate_mode=top",
                                                                 "gate_mode"),
                                       ("dataquant:2:gate=1.5:gate_mode=sample", "gate"),
                                       ("dataquant:2:correct=nope", "correct")])
def test_bad_specs_name_the_argument(spec, why):
  with pytest.raises(registry.SpecError, match=why):
    dadjax.build_method(spec)


def test_methods_listing_has_dataquant():
  text = cli.describe_methods()  # what `dadjax methods` prints
  assert "[dataquant] methods" in text and "dataquant([bits=.., correct=.., gate=.." in text


def test_training_rows_report_stage_bits_and_compute():
  config = Config(method="dataquant:2:classes=10:gate=0.5:gate_mode=sample", backend="vmap",
                  steps=2, eval_every=2, batch_per_site=8,
                  model_kwargs={"hidden": [16]})
  result = train(config, progress=False)
  row = result.final
  stats = dadjax.comm_stats(result.state)
  stage = result.state.stage_state
  wire = bits_to_int(stage.padded_bits)
  useful = bits_to_int(stage.useful_bits)
  # the ledger holds the stage's padded all-gather plus the metrics' pmean (2 fp32 scalars)
  assert list(stats.gather_bits) == wire
  assert list(stats.reduce_bits) == [2 * 32] * 8
  assert row["payload_bits_per_step"] == max(wire) + 64
  n_params = sum(x.size for x in jax.tree.leaves(result.params))
  assert row["dense_bits_per_step"] == 32 * n_params  # the all-reduce the stage replaces
  assert row["payload_ratio"] == pytest.approx(32 * n_params / (max(wire) + 64))
  assert row["stage_padded_bits_per_step"] == max(wire)
  assert row["useful_bits_per_step"] == max(useful) < max(wire)
  assert row["backward_rows_per_step"] == 8 * 8  # N R rows of the shared pass, loss scores only
  # the padded payload: every row's packed 2-bit codes + a 64-bit range, the 4-bit labels
  # (bit-plane packed), fp32 weights, a 32-bit count
  row_bits = 32 * packed_words(64, 2) + 64
  assert wire == [8 * row_bits + 32 * packed_words(8, 4) + 8 * 32 + 32] * 8


def test_quantized_stage_under_shard_map_keeps_its_state_placement():
  """``dataquant:4`` (uniform quantizer) under shard_map: the program compiled for the initial
  state runs on the states it returns (no state leaf changes its placement between steps; an
  empty codebook leaf once came back replicated, ``float32[2,0,0]`` placed ``P()``)."""
  method = dadjax.build_method("dataquant:4")
  step = dadjax.make_train_step(MODEL, optax.sgd(0.1), batch_stage=method.batch_stage,
                                num_sites=2, backend="shard_map")
  batch = step.place_batch({k: v[:2 * ROWS] for k, v in make_batch(0).items()})
  state = step.init(jax.random.key(0), np.zeros((1, DIM), np.float32))
  assert state.stage_state.codebook == ()  # the uniform quantizer keeps no codebook
  compiled = step._run.lower(state, batch).compile()
  specs = [x.sharding for x in jax.tree.leaves(state)]
  for _ in range(2):
    state, metrics = compiled(state, batch)
    assert [x.sharding for x in jax.tree.leaves(state)] == specs
  assert np.isfinite(np.asarray(metrics["loss"])).all()
