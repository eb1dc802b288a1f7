"""Data quantization: quantizers, gate, correction and the batch stage.

The stage runs on 8 sites simulated with ``jax.vmap(..., axis_name="data")``
(and under shard_map / pmap where stated) with a hand-built StageContext
whose grad_fn is the value_and_grad of a tiny MLP's weighted cross-entropy.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import dataquant as DQ
from dadjax.comm import bits_to_int, hlo_collectives
from dadjax.extend import packed_words
from dadjax.models import MLP
from dadjax.extend import GradResult, StageContext


SITES, ROWS, DIM, CLASSES = 8, 8, 12, 3
MODEL = MLP(hidden=(8,), num_classes=CLASSES)


def collective_bytes(hlo: str) -> dict:
  """Operand bytes of the compiled all-reduces and all-gathers (per site)."""
  ops = hlo_collectives(hlo)
  return {"reduce": ops.nbytes.get("reduce", 0), "gather": ops.nbytes.get("gather", 0)}


def loss_fn(params, batch, rng=None):
  del rng
  logits = MODEL.apply({"params": params}, batch["x"])
  per_row = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
  w = batch.get("weight", jnp.ones(per_row.shape))
  return jnp.mean(w * per_row), logits  # the stage contract: sum(w l) / rows


def grad_fn(params, batch, rng=None):
  del rng
  (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
  return GradResult(loss, aux, grads, {}, {})


def make_data(seed=0, weighted=False):
  k = jax.random.split(jax.random.key(seed), 4)
  params = MODEL.init(k[0], jnp.zeros((1, DIM)))["params"]
  x = jax.random.uniform(k[1], (SITES, ROWS, DIM))
  y = jax.random.randint(k[2], (SITES, ROWS), 0, CLASSES)
  batch = {"x": x, "y": y}
  if weighted:
    batch["weight"] = jax.random.uniform(k[3], (SITES, ROWS), minval=0.2, maxval=2.0)
  return params, batch


def reference_grads(params, batch):
  """What a plain all-reduce computes: the mean over sites of each site's mean gradient."""
  per_site = jax.vmap(lambda b: grad_fn(params, b).grads)(batch)
  return jax.tree.map(lambda g: jnp.mean(g, 0), per_site)


def run_sites(stage, params, batch, state=None, key=jax.random.key(7), step=0):
  """One step of ``stage`` on SITES vmap-simulated sites; per-site outputs are stacked."""
  if state is None:
    state = jax.vmap(lambda _: stage.init(params))(jnp.arange(SITES))

  def site(b, s, key, step):
    i = jax.lax.axis_index("data")
    ctx = StageContext(grad_fn, loss_fn, "data", jax.random.fold_in(key, i), key, step)
    out = stage.apply(ctx, params, b, s)
    return out.result, out.state, out.traffic

  return jax.jit(jax.vmap(site, in_axes=(0, 0, None, None), axis_name="data"))(
      batch, state, key, jnp.int32(step))


def assert_tree_close(a, b, atol, rtol=0.0):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=atol, rtol=rtol)


def first_site(tree):
  return jax.tree.map(lambda x: x[0], tree)


def per_site(b):
  """A bit count or call count returned by the sites: a list of SITES Python ints."""
  if isinstance(b, tuple) and hasattr(b, "hi"):
    return bits_to_int(b)
  return [int(v) for v in np.broadcast_to(np.asarray(b), (SITES,))]


# ---- quantizers -------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", ["sample", "feature"])
def test_uniform_quantizer_is_unbiased_and_error_shrinks_with_bits(scale):
  x = jax.random.normal(jax.random.key(0), (4, 16))
  draws = 4000
  keys = jax.random.split(jax.random.key(1), draws)
  mses = []
  for bits in (1, 2, 4, 8):
    est = jax.vmap(lambda k: DQ.dequantize_uniform(
        DQ.quantize_uniform(x, bits, k, scale), bits, 16, scale))(keys)
    p = DQ.quantize_uniform(x, bits, keys[0], scale)
    step = np.asarray(p.step)[:, None] if scale == "sample" else np.asarray(p.step)[None, :]
    # Each draw is x + e with |e| <= step and Var(e) <= step^2 / 4: the mean of `draws`
    # draws lies within 5 standard errors of x (a per-coordinate bound, ~1e-6 false alarms).
    bound = 5 * (step / 2) / math.sqrt(draws) + 1e-5
    assert np.all(np.abs(np.mean(est, 0) - x) <= bound)
    assert np.all(np.abs(est - x) <= step + 1e-5)
    mse = float(np.mean((est - x) ** 2))
    assert mse <= float(np.mean(step ** 2)) / 4 * 1.05
    mses.append(mse)
  # one more bit roughly halves the step: the error falls by > 2x per added bit
  assert mses[0] > 2 * mses[1] > 0 and mses[1] > 4 * mses[2] > 0 and mses[2] > 16 * mses[3] > 0


def test_uniform_quantizer_exact_cases_and_bits():
  x = jnp.array([[0.0, 1.0, 2.0, 3.0], [5.0, 5.0, 5.0, 5.0]])
  p = DQ.quantize_uniform(x, 2, jax.random.key(0), "sample")
  np.testing.assert_array_equal(DQ.dequantize_uniform(p, 2, 4, "sample"), x)  # levels / constant
  for bits, dim, scale in [(2, 12, "sample"), (3, 40, "feature"), (8, 5, "sample")]:
    p = DQ.quantize_uniform(jnp.ones((6, dim)), bits, jax.random.key(0), scale)
    total = dadjax._core.trees.tree_nbits(p)
    assert total == 6 * DQ.uniform_row_bits(dim, bits, scale) + DQ.uniform_header_bits(dim, scale)
  assert DQ.uniform_row_bits(12, 2, "sample") == 64 + 64
  assert DQ.uniform_row_bits(40, 3, "feature") == 32 * 6
  assert DQ.uniform_header_bits(40, "feature") == 64 * 40


@pytest.mark.slow  # about 13 s
def test_codebook_learns_clusters_and_counts_bits():
  centers = jnp.array([[0.0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 0, 1], [5, 5, 0, 0]])
  idx = jax.random.randint(jax.random.key(0), (64, 3), 0, 4)
  x = centers[idx].reshape(64, 12)  # every block of 4 is one of the 4 centers
  cb, sizes = DQ.fit_codebook(x, 2, 4, jax.random.key(1), iters=20)
  words = DQ.encode_codebook(x, cb, 2)
  assert words.shape == (64, packed_words(3, 2))
  np.testing.assert_allclose(DQ.decode_codebook(words, cb, 2, 12), x, atol=1e-5)
  assert float(jnp.sum(sizes)) == 64 * 3
  merged = DQ.merge_codebooks(jnp.stack([cb, cb[::-1]]), jnp.stack([sizes, sizes[::-1]]),
                              jax.random.key(2))
  np.testing.assert_allclose(DQ.decode_codebook(DQ.encode_codebook(x, merged, 2), merged, 2, 12),
                             x, atol=1e-5)
  assert DQ.codebook_bits(2, 4) == 32 * 4 * 5
  assert DQ.codebook_row_bits(13, 2, 4) == 32 * packed_words(4, 2)


def test_labels_pack_and_count():
  y = jnp.array([0, 2, 1, 2, 2, 0, 1], jnp.int32)
  words = DQ.encode_labels(y, 3)
  assert words.dtype == jnp.uint32 and words.shape == (packed_words(7, 2),)
  np.testing.assert_array_equal(DQ.decode_labels(words, 3, 7, jnp.int32), y)
  assert DQ.label_bits(7, 3) == 64 and DQ.label_bits(7, None) == 7 * 32


# ---- gate -------------------------------------------------------------------------------------

def test_sample_gate_probabilities_and_reweighting():
  s = jnp.array([0.0, 1.0, 2.0, 5.0, 0.5, 0.5, 3.0, 0.0])
  p = DQ.send_probabilities(s, 0.5, 0.1)
  expected = np.minimum(1, 0.5 * 8 * (0.9 * np.asarray(s) / 12 + 0.1 / 8))
  np.testing.assert_allclose(p, expected, rtol=1e-6)
  np.testing.assert_allclose(DQ.send_probabilities(jnp.zeros(4), 0.25, 0.0), 0.25)
  w = jnp.arange(1.0, 9.0)
  keys = jax.random.split(jax.random.key(0), 20000)
  d = jax.vmap(lambda k: DQ.sample_gate(s, 0.5, k, w, 0.1))(keys)
  # E[weight_i] = w_i: each is w_i / p_i with probability p_i (1/p_i <= 1/0.05 = 20 here)
  mean = np.mean(np.asarray(d.weight), 0)
  sd = np.asarray(w) * np.sqrt((1 - expected) / expected) / math.sqrt(20000)
  assert np.all(np.abs(mean - np.asarray(w)) <= 5 * sd + 1e-6)
  t = DQ.threshold_gate(s, 1.0, w)
  np.testing.assert_array_equal(t.mask, np.asarray(s) >= 1.0)
  np.testing.assert_array_equal(t.weight, np.where(np.asarray(s) >= 1.0, w, 0.0))


# ---- the stage --------------------------------------------------------------------------------

@pytest.mark.parametrize("weighted", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_no_quantization_open_gate_equals_allreduce(weighted):
  params, batch = make_data(0, weighted)
  result, state, traffic = run_sites(DQ.dataquant(None), params, batch)
  ref = reference_grads(params, batch)
  for site in range(SITES):
    assert_tree_close(jax.tree.map(lambda g: g[site], result.grads), ref, atol=2e-6)
  assert int(state.backward_rows[0]) == SITES * ROWS


def test_no_quantization_sends_integer_rows_in_their_dtype():
  params, batch = make_data(10)
  pixels = {"x": (batch["x"] * 16).astype(jnp.uint8), "y": batch["y"]}
  result, state, traffic = run_sites(DQ.dataquant(None), params, pixels)
  assert per_site(traffic.gather) == [ROWS * DIM * 8 + ROWS * 32] * SITES
  ref = reference_grads(params, {"x": pixels["x"].astype(jnp.float32), "y": batch["y"]})
  assert_tree_close(first_site(result.grads), ref, atol=2e-6)


@pytest.mark.parametrize("kwargs", [
    dict(bits=1),
    dict(bits=2, scale="feature", num_classes=CLASSES),
    dict(bits=2, gate=0.5, gate_mode="sample"),
    dict(bits=1, gate=1.0, gate_mode="threshold", score="grad_norm"),
    dict(bits=2, quantizer="codebook", block=4),
])
def test_uncompressed_correction_gives_the_true_gradient(kwargs):
  params, batch = make_data(1, weighted=True)
  stage = DQ.dataquant(correction="identity", **kwargs)
  result, state, traffic = run_sites(stage, params, batch)
  ref = reference_grads(params, batch)
  uncorrected, _, _ = run_sites(DQ.dataquant(**kwargs), params, batch)
  gap = max(float(jnp.max(jnp.abs(a[0] - b))) for a, b in
            zip(jax.tree.leaves(uncorrected.grads), jax.tree.leaves(ref)))
  assert gap > 1e-4  # the quantized / gated estimate alone is not exact
  assert_tree_close(first_site(result.grads), ref, atol=3e-6)
  assert bool(state.correction_active[0])
  n_params = sum(x.size for x in jax.tree.leaves(params))
  assert per_site(traffic.reduce) == [32 * n_params] * SITES  # identity correction: fp32 psum
  assert int(state.backward_rows[0]) == SITES * ROWS + 2 * ROWS + (
      ROWS if kwargs.get("score") == "grad_norm" else 0)


def test_compressed_correction_runs_and_helps():
  params, batch = make_data(2)
  ref = reference_grads(params, batch)
  err = {}
  for name, corr in [("none", None), ("ef_scaled_sign", "ef_scaled_sign"), ("topk", "topk:0.5")]:
    result, state, traffic = run_sites(DQ.dataquant(1, correction=corr), params, batch)
    err[name] = optax.tree.norm(jax.tree.map(lambda a, b: a[0] - b, result.grads, ref))
  assert err["topk"] < err["none"]
  assert jnp.isfinite(err["ef_scaled_sign"])


def test_correct_every_k_steps():
  params, batch = make_data(3)
  stage = DQ.dataquant(2, correction="identity", correct_every=2)
  ref = reference_grads(params, batch)
  n_params = sum(x.size for x in jax.tree.leaves(params))
  for step, active in [(0, True), (1, False), (4, True)]:
    result, state, traffic = run_sites(stage, params, batch, step=step)
    assert bool(state.correction_active[0]) == active
    assert per_site(traffic.reduce) == [32 * n_params if active else 0] * SITES
    close = np.allclose(first_site(result.grads)["head"]["kernel"], ref["head"]["kernel"],
                        atol=3e-6)
    assert close == active
    assert int(state.backward_rows[0]) == SITES * ROWS + (2 * ROWS if active else 0)


def test_importance_sampling_is_unbiased():
  params, batch = make_data(4)
  stage = DQ.dataquant(None, gate=0.4, gate_mode="sample", score="loss", gate_floor=0.2)
  state = jax.vmap(lambda _: stage.init(params))(jnp.arange(SITES))
  draws = 3000
  keys = jax.random.split(jax.random.key(11), draws)
  ests = jax.lax.map(lambda k: first_site(run_sites(stage, params, batch, state, k)[0].grads),
                     keys, batch_size=500)
  ref = reference_grads(params, batch)
  for est, r in zip(jax.tree.leaves(ests), jax.tree.leaves(ref)):
    est = np.asarray(est)
    # per-coordinate: |mean - truth| <= 5 standard errors (+ float slack)
    se = est.std(0) / math.sqrt(draws)
    assert np.all(np.abs(est.mean(0) - np.asarray(r)) <= 5 * se + 1e-6)
  # and the gate does send about 40% of the rows
  _, st, _ = run_sites(stage, params, batch, state, keys[0])
  assert 0 < int(jnp.sum(st.sent_rows)) < SITES * ROWS


def test_threshold_gate_bias_is_bounded_by_the_threshold():
  params, batch = make_data(5)
  norms = jax.vmap(lambda b: DQ.grad_norm_scores(loss_fn, params, b))(batch)
  threshold = float(jnp.median(norms))  # about half the rows are held back
  result, state, _ = run_sites(
      DQ.dataquant(None, gate=threshold, score="grad_norm"), params, batch)
  ref = reference_grads(params, batch)
  bias = optax.tree.norm(jax.tree.map(lambda a, b: a[0] - b, result.grads, ref))
  sent = int(jnp.sum(state.sent_rows))
  assert 0 < sent < SITES * ROWS
  assert float(bias) <= threshold * (1 - sent / (SITES * ROWS)) + 1e-6


# ---- the ledger -------------------------------------------------------------------------------

def _cfgs():
  words = lambda n, b: packed_words(n, b)  # uint32 words of n packed b-bit codes
  return [
      # (kwargs, padded payload bits, useful bits as a function of the rows sent n)
      (dict(bits=2), ROWS * (32 * words(DIM, 2) + 64) + ROWS * 32,
       lambda n: ROWS * (32 * words(DIM, 2) + 64) + ROWS * 32),
      (dict(bits=3, scale="feature", num_classes=CLASSES),
       ROWS * 32 * words(DIM, 3) + 64 * DIM + 32 * words(ROWS, 2),
       lambda n: ROWS * 32 * words(DIM, 3) + 64 * DIM + 32 * words(ROWS, 2)),
      (dict(bits=2, gate=1.0, num_classes=CLASSES),
       ROWS * (32 * words(DIM, 2) + 64) + 32 * words(ROWS, 2) + 32,
       lambda n: n * (32 * words(DIM, 2) + 64) + 32 * 2 * math.ceil(n / 32) + 32),
      (dict(bits=1, gate=0.5, gate_mode="sample"),
       ROWS * (32 * words(DIM, 1) + 64) + ROWS * 32 + ROWS * 32 + 32,
       lambda n: n * (32 * words(DIM, 1) + 64) + n * 32 + n * 32 + 32),
      (dict(bits=None, gate=1.0), ROWS * 32 * DIM + ROWS * 32 + 32,
       lambda n: n * 32 * DIM + n * 32 + 32),
  ]


@pytest.mark.parametrize("cfg", range(5))
def test_ledger_bits_equal_the_hand_formula(cfg):
  kwargs, padded, useful = _cfgs()[cfg]
  params, batch = make_data(6)
  _, state, traffic = run_sites(DQ.dataquant(**kwargs), params, batch)
  assert per_site(traffic.gather) == [padded] * SITES and per_site(traffic.reduce) == [0] * SITES
  assert per_site(traffic.gather_calls) == [1] * SITES
  sent = np.asarray(state.sent_rows)
  assert list(bits_to_int(state.padded_bits)) == [padded] * SITES
  assert list(bits_to_int(state.useful_bits)) == [useful(int(n)) for n in sent]
  if "gate" in kwargs:
    assert sent.min() < ROWS  # some rows were actually held back


def test_ledger_counts_the_codebook_broadcast_once():
  params, batch = make_data(7)
  stage = DQ.dataquant(3, quantizer="codebook", block=4, num_classes=CLASSES)
  row = 32 * packed_words(3, 3)
  data = ROWS * row + 32 * packed_words(ROWS, 2)
  book = 32 * 8 * (4 + 1)
  _, state, traffic = run_sites(stage, params, batch)
  assert per_site(traffic.gather) == [data + book] * SITES
  assert bits_to_int(state.useful_bits) == [data + book] * SITES
  assert bool(state.codebook_ready[0])
  # every site holds the same merged codebook
  np.testing.assert_array_equal(state.codebook,
                                jnp.broadcast_to(state.codebook[0], state.codebook.shape))
  _, state2, traffic2 = run_sites(stage, params, batch, state, jax.random.key(8), step=1)
  assert per_site(traffic2.gather) == [data] * SITES
  np.testing.assert_array_equal(state2.codebook, state.codebook)


# ---- backends and the compiled collective -----------------------------------------------------

def _site_program(stage):
  """One site under shard_map / pmap: every input carries a leading site axis of 1.

  The parameters are passed per site (as the train step holds them): closed-over,
  replicated parameters would make shard_map all-reduce their gradient.
  """
  def site(p, b, s, key):
    p, b, s = first_site((p, b, s))
    i = jax.lax.axis_index("data")
    ctx = StageContext(grad_fn, loss_fn, "data", jax.random.fold_in(key, i), key, jnp.int32(0))
    out = stage.apply(ctx, p, b, s)
    return jax.tree.map(lambda x: x[None], (out.result.grads, out.state))
  return site


def stacked(tree):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (SITES,) + x.shape), tree)


@pytest.mark.parametrize("kwargs", [dict(bits=2, gate=1.0, num_classes=CLASSES),
                                    dict(bits=3, quantizer="codebook", block=4)])
def test_compiled_all_gather_moves_the_padded_payload(kwargs):
  params, batch = make_data(8)
  stage = DQ.dataquant(**kwargs)
  state = jax.vmap(lambda _: stage.init(params))(jnp.arange(SITES))
  mesh = dadjax.make_mesh(SITES, "data")
  key = jax.random.key(3)
  fn = jax.jit(jax.shard_map(_site_program(stage), mesh=mesh,
                             in_specs=(P("data"), P("data"), P("data"), P()), out_specs=P("data")))
  compiled = fn.lower(stacked(params), batch, state, key).compile()
  moved = hlo_collectives(compiled.as_text()).nbytes
  grads, new_state = compiled(stacked(params), batch, state, key)
  assert moved["reduce"] == 0
  assert 8 * moved["gather"] == bits_to_int(new_state.padded_bits)[0]
  # the same numbers as the vmap-simulated sites
  result, vstate, _ = run_sites(stage, params, batch, state, key)
  assert_tree_close(grads, result.grads, atol=1e-6)
  np.testing.assert_array_equal(new_state.sent_rows, vstate.sent_rows)


@pytest.mark.slow  # shard_map == vmap is in the default run; pmap is the same site program
def test_pmap_matches_vmap():
  params, batch = make_data(9)
  stage = DQ.dataquant(2, gate=0.5, gate_mode="sample", correction="ef_scaled_sign",
                       num_classes=CLASSES)
  state = jax.vmap(lambda _: stage.init(params))(jnp.arange(SITES))
  key = jax.random.key(4)
  add = lambda t: jax.tree.map(lambda x: x[:, None], t)
  grads, pstate = jax.pmap(_site_program(stage), axis_name="data", in_axes=(0, 0, 0, None))(
      add(stacked(params)), add(batch), add(state), key)
  result, vstate, _ = run_sites(stage, params, batch, state, key)
  assert_tree_close(jax.tree.map(lambda g: g[:, 0], grads), result.grads, atol=1e-6)
  np.testing.assert_array_equal(pstate.sent_rows[:, 0], vstate.sent_rows)


# ---- arguments --------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    (dict(bits=0), "bits"), (dict(bits=9), "bits"), (dict(bits=2.0), "bits"),
    (dict(scale="row"), "scale"), (dict(quantizer="pq"), "quantizer"),
    (dict(bits=None, quantizer="codebook"), "bits"), (dict(block=0), "block"),
    (dict(correction="nope"), "compressor spec"), (dict(correction=3), "correction"),
    (dict(correct_every=0), "correct_every"), (dict(gate=-1.0), "gate"),
    (dict(gate=1.5, gate_mode="sample"), "gate"), (dict(gate=0.5, gate_mode="top"), "gate_mode"),
    (dict(gate_floor=2.0), "gate_floor"), (dict(score="entropy"), "score"),
    (dict(num_classes=1), "num_classes"), (dict(kmeans_iters=0), "kmeans_iters"),
])
def test_bad_arguments_raise_at_construction(kwargs, name):
  with pytest.raises(ValueError, match=name):
    DQ.dataquant(**kwargs)


def test_axis_mismatch_is_reported():
  params, batch = make_data(0)
  stage = DQ.dataquant(2, axis_name="sites")
  with pytest.raises(ValueError, match="axis_name"):
    run_sites(stage, params, batch)
