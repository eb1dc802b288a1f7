"""The 2025 frontier of compressed local updates: SparseLoCo, DeMo, Muon by name, and a
communicating transformation declared to follow per-site state (dadjax.after_local_state)."""
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import cli, local
from dadjax.config import Config
from dadjax.local._chunked import chunked_bits
from dadjax.models import MLP
from dadjax.train import train
from helpers import run_steps

SITES = 4
METRIC_BITS = 2 * 32  # the step's pmean of loss and accuracy
TEACHER = np.random.default_rng(7).normal(size=(12, 5)).astype(np.float32)


def _batch(step, rows=16 * SITES):
  """A learnable task: labels of a fixed linear teacher, fresh inputs every step."""
  x = np.random.default_rng(step).normal(size=(rows, 12)).astype(np.float32)
  return {"x": x, "y": np.argmax(x @ TEACHER, axis=1).astype(np.int32)}


def _train(tx, steps, **kwargs):
  ts = dadjax.make_train_step(MLP(hidden=(16,), num_classes=5), tx, num_sites=SITES,
                              backend=kwargs.pop("backend", "vmap"), **kwargs)
  # the teacher's task (not helpers.batch's random labels): the loss must fall
  state, history = run_steps(ts, lambda i: _batch(i + 1), steps, init_x=_batch(0)["x"][:2])
  return ts, state, [float(np.mean(m["loss"])) for m in history]


def _shapes(state):
  return [tuple(np.shape(x))[1:] for x in jax.tree.leaves(state.params)]  # without the site axis


def _falls(losses):
  return np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4])


# -- the DCT chunking ----------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(12, 16), (784, 64), (7,), (3, 4, 6), (), (10,)])
@pytest.mark.parametrize("dct", [False, True])
def test_chunk_round_trip_is_the_identity(shape, dct):
  x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
  lay = local.chunk_layout(shape, 8)
  rows = local.to_chunks(x, lay, dct)
  assert rows.shape == (lay.chunks, lay.size) and lay.chunks * lay.size == x.size
  np.testing.assert_allclose(local.from_chunks(rows, lay, dct), x, atol=2e-6)
  grid = local.to_chunks(x, lay, dct, grid=True)  # the same chunks, block rows and columns apart
  assert grid.shape == lay.grid + (lay.size,)
  np.testing.assert_array_equal(np.reshape(grid, rows.shape), rows)
  np.testing.assert_allclose(local.from_chunks(grid, lay, dct), x, atol=2e-6)
  # orthonormal: the transform keeps the Euclidean norm
  np.testing.assert_allclose(np.linalg.norm(rows), np.linalg.norm(x), rtol=1e-5)


def test_dct_matrix_is_the_orthonormal_dct_ii_and_blocks_follow_demos_rule():
  d = local.dct_matrix(8)
  np.testing.assert_allclose(d @ d.T, np.eye(8), atol=1e-12)
  x = np.random.default_rng(2).normal(size=8)
  n = np.arange(8)
  for k in range(8):  # the DCT-II sum, scaled to be orthonormal
    ref = np.sum(x * np.cos(np.pi * (2 * n + 1) * k / 16)) * np.sqrt((1 if k else 0.5) * 2 / 8)
    np.testing.assert_allclose((d @ x)[k], ref, atol=1e-12)
  assert local.chunk_layout((784, 1024), 64)[3:] == (56, 64)   # largest divisors <= 64
  assert local.chunk_layout((10,), 64)[3:] == (1, 10)
  with pytest.raises(ValueError, match="chunk side must be an int >= 1"):
    local.chunk_layout((4, 4), 0)


# -- the exchange: a decaying error-feedback memory over chunked top-k ------------------------

def _exchange(communicate, deltas, steps=1):
  """Run ``communicate`` on 2 vmapped sites; returns (mean, state) after ``steps`` exchanges."""
  state = jax.vmap(communicate.init)(deltas)

  @jax.jit
  def run(d, s, t):
    return jax.vmap(lambda d, s: communicate.run(d, s, t)[:2], axis_name="data")(d, s)

  for t in range(steps):
    mean, state = run(deltas, state, jnp.int32(t))
  return mean, state


DELTAS = {"w": np.random.default_rng(3).normal(size=(2, 8, 12)).astype(np.float32),
          "b": np.random.default_rng(4).normal(size=(2, 12)).astype(np.float32)}


def test_at_full_density_demo_shares_the_whole_momentum():
  full = local.averaging(local.chunked_topk(16, 4, dct=True), decay=0.999)
  mean, state = _exchange(full, DELTAS)
  jax.tree.map(lambda m, d: np.testing.assert_allclose(m[0], d.mean(0), atol=2e-6), mean, DELTAS)
  jax.tree.map(lambda e: np.testing.assert_allclose(e, 0.0, atol=2e-6), state.memory)


def test_partial_density_keeps_what_it_did_not_send():
  """e <- decay * e + delta; sent = C(e) (k per block of DCT coefficients); e <- e - sent."""
  decay, k = 0.9, 3
  tx = local.averaging(local.chunked_topk(k, 4, dct=True), decay=decay)
  _, s1 = _exchange(tx, DELTAS, steps=1)
  _, s2 = _exchange(tx, DELTAS, steps=2)
  for name in DELTAS:
    corrected = DELTAS[name] + decay * np.asarray(s1.memory[name])
    sent = corrected - np.asarray(s2.memory[name])
    lay = local.chunk_layout(DELTAS[name].shape[1:], 4)
    for site in range(2):
      coeffs = np.asarray(local.to_chunks(sent[site], lay, dct=True))
      assert ((np.abs(coeffs) > 1e-5).sum(axis=1) <= k).all()      # k per block
      top = np.asarray(local.to_chunks(corrected[site], lay, dct=True))
      kept = np.abs(coeffs) > 1e-5
      # what was sent is the largest coefficients of the corrected memory, exactly them
      np.testing.assert_allclose(coeffs[kept], top[kept], rtol=1e-4, atol=1e-5)


def test_decay_needs_an_error_feedback_memory():
  with pytest.raises(ValueError, match="decay needs a compressor"):
    local.averaging(None, decay=0.9)
  with pytest.raises(ValueError, match=r"decay must be None or a float in \[0, 1\]"):
    local.averaging(dadjax.topk(0.5), decay=1.5)
  tx = local.averaging(dadjax.powersgd(1), decay=0.9)  # PowerSGD keeps its own memory
  with pytest.raises(ValueError, match="keeps its own"):
    tx.init({"w": jnp.zeros((4, 4))})


# -- SparseLoCo and DeMo in the train step ---------------------------------------------------

def test_sparseloco_trains_and_books_its_payload():
  h, steps = 2, 16
  tx = local.sparseloco(optax.adam(0.02), every=h, k=2, chunk=4)
  ts, state, losses = _train(tx, steps)
  assert _falls(losses), losses
  # per synchronization: 2 entries per block at 2 bits (+ one fp32 scale per tensor) and
  # their positions at ceil(log2(16)) = 4 bits, each packed in uint32 words
  payload = chunked_bits(_shapes(state), k=2, chunk=4, value_bits=2, scale_bits=32)
  assert dadjax.comm_stats(state.opt_state).total == steps // h * payload
  assert dadjax.comm_stats(state).peak_bits_per_step == payload + METRIC_BITS
  # the memory replaced the outer momentum: the outer state is plain SGD's
  assert isinstance(state.opt_state.codec[0], dadjax.ErrorFeedbackState)


def test_demo_trains_and_books_its_payload_in_the_compiled_program():
  steps = 12
  tx = local.demo(optax.sgd(1.0), lr=0.02, k=2, chunk=4)
  ts, state, losses = _train(tx, steps, backend="shard_map")
  assert _falls(losses), losses
  payload = chunked_bits(_shapes(state), k=2, chunk=4)            # fp32 values, 4-bit positions
  assert dadjax.comm_stats(state.opt_state).total == steps * payload
  ops = ts.collectives(state, _batch(0))
  assert 8 * ops.conditional_nbytes["gather"] == payload           # what the program gathers


def test_demo_at_full_density_is_sign_sgd_on_the_mean_step():
  """every=1, k = block size: the momentum is sent whole, so the step is -lr sign(mean g)."""
  p = {"w": jnp.array([[1.0, -2.0], [0.5, 3.0]])}
  g = np.array([[[1.0, -3.0], [0.2, 0.0]], [[-2.0, 1.0], [0.1, 0.0]]], np.float32)
  tx = local.demo(optax.sgd(0.1), lr=0.01, k=4, chunk=2)
  stacked = jax.tree.map(lambda x: jnp.stack([x] * 2), p)
  state = jax.vmap(tx.init)(stacked)
  u, _ = jax.jit(jax.vmap(lambda g, s, p: tx.update({"w": g}, s, p), axis_name="data"))(
      g, state, stacked)
  expect = -0.01 * np.sign(0.1 * g.mean(0))
  for site in range(2):
    np.testing.assert_allclose(u["w"][site], expect, atol=1e-6)


@pytest.mark.parametrize("method", [
    "sparseloco:4:k=2:chunk=4",
    # the same state (an error-feedback memory per site) as SparseLoCo's, so slow-marked
    pytest.param("demo:2:k=2:chunk=4", marks=pytest.mark.slow)])
def test_resume_in_the_middle_of_a_phase_is_bit_identical(tmp_path, method):
  ckpt = tmp_path / "ckpt"
  config = Config(steps=6, eval_every=3, batch_per_site=8, num_sites=2, backend="vmap",
                  model_kwargs={"hidden": [16]}, method=method, checkpoint_dir=str(ckpt),
                  checkpoint_every=3)
  whole = train(config, progress=False)  # checkpoints at step 3 (mid phase: 3 of 4, 1 of 2) and 6
  shutil.rmtree(ckpt / "6")              # so the next run resumes from step 3
  resumed = train(config, progress=False)
  assert [row["step"] for row in resumed.history] == [6]
  jax.tree.map(np.testing.assert_array_equal, resumed.state.params, whole.state.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.state.opt_state, whole.state.opt_state)
  assert dadjax.comm_stats(resumed.state).total == dadjax.comm_stats(whole.state).total


DIGITS_SHAPES = [(64,), (64, 64), (64,), (64, 64), (10,), (64, 10)]  # the default digits MLP


@pytest.mark.parametrize("argv, syncs, payload", [
    (["method=sparseloco:2", "optimizer=muon", "lr=0.02"], 2,
     chunked_bits(DIGITS_SHAPES, k=64, chunk=64, value_bits=2, scale_bits=32)),
    (["method=demo:k=8", "optimizer=sgd", "momentum=0", "lr=0.01"], 4,
     chunked_bits(DIGITS_SHAPES, k=8, chunk=64)),
])
def test_cli_trains_the_frontier_specs(capsys, argv, syncs, payload):
  assert cli.main(["train", "--no-progress", "steps=4", "eval_every=4", "num_sites=2",
                   "backend=vmap", "batch_per_site=4", *argv]) == 0
  final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert final["step"] == 4 and np.isfinite(final["loss"])
  assert final["total_payload_bits"] == syncs * payload + 4 * METRIC_BITS


def test_specs_state_their_defaults_and_refuse_bad_values():
  text = cli.describe_methods()
  assert "sparseloco(EVERY[, k=.." in text and "demo[:EVERY][:sign]" in text
  for spec, match in [("sparseloco:4:k=0", r"k must be an int in \[1, inf\)"),
                      ("sparseloco:4:decay=2", r"decay must be a float in \[0, 1\]"),
                      ("demo:chunk=0", r"chunk must be an int in \[1, inf\)")]:
    with pytest.raises(dadjax.SpecError, match=match):
      dadjax.build_method(spec)
  with pytest.raises(ValueError, match="values must be a stateless compressor"):
    local.sparseloco(optax.sgd(0.1), 2, values="ef(topk(0.5))").init({"w": jnp.zeros((4, 4))})


def test_muon_by_name_is_optax_contribs():
  from dadjax.run import _optim  # pylint: disable=g-import-not-at-top  (moved with the run layer)
  call = _optim.parse_optimizer("muon(beta=0.9)")
  assert call.fn is optax.contrib.muon and call.kwargs == {"beta": 0.9}
  assert "muon" in _optim.CONTRIB  # `dadjax train optimizer=muon` trains: the CLI test below


# -- a communicating transformation after per-site state, on purpose ----------------------------

def test_declared_chain_averages_the_sites_adam_updates_and_the_plain_one_is_refused():
  tx = optax.chain(optax.adam(0.02), dadjax.after_local_state(dadjax.allreduce("data")))
  ts, state, losses = _train(tx, 12)
  assert _falls(losses), losses
  sites = [dadjax.parallel.unstack_site(state.params, s) for s in range(SITES)]
  for other in sites[1:]:  # the averaged update keeps every site on the same parameters
    jax.tree.map(np.testing.assert_array_equal, sites[0], other)
  assert dadjax.comm_stats(state).total > 0
  plain = optax.chain(optax.adam(0.02), dadjax.allreduce("data"))
  with pytest.raises(ValueError, match=r"the optimizer chain runs per-site stateful "
                     r"transformation\(s\) .* before its communicating transformation"):
    _train(plain, 1)
  with pytest.raises(ValueError, match="tx must be an optax GradientTransformation"):
    dadjax.after_local_state("allreduce")


@pytest.mark.parametrize("k, chunk", [(3, 4), (5, 4), (10, 4), (16, 4), (2, 8)])
def test_chunk_selection_is_the_catalogs_topk_on_every_chunk(k, chunk):
  # The chunk selection (top_k, and above half a chunk a stable sort) keeps the catalog's set
  # and order: largest magnitude first, ties to the lower position, NaN kept first; above half
  # a chunk, ascending positions.
  from dadjax.local._chunked import _Chunked, _select
  from dadjax.local._dct import chunk_layout, to_chunks
  rng = np.random.default_rng(k)
  x = rng.integers(-3, 4, size=(8, 8)).astype(np.float32)  # many ties
  x[1, 2] = np.nan
  layout = chunk_layout(x.shape, chunk)
  rows = to_chunks(jnp.asarray(x), layout)
  values, positions = _select(_Chunked(k, chunk, False, None, "t"), rows, layout)
  kept = min(k, layout.size)
  top = dadjax.topk(kept / layout.size)
  for i in range(rows.shape[0]):
    want = top.compress(rows[i], dadjax.compress.EmptyState(), jax.random.key(0))[0][0]
    np.testing.assert_array_equal(positions[i], want.indices)
    np.testing.assert_array_equal(values[i], want.values)
