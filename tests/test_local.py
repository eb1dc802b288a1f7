"""dadjax.local: local SGD, DiLoCo and Streaming DiLoCo as transformations.

The transformations run here on vmap-simulated sites (``axis_name="data"``)
with known gradients; tests/test_local_step.py runs them in the train step.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import cli, local
from dadjax.comm import PeriodicStats

SITES = 2


def _run(tx, params, grads, sites=SITES):
  """Apply ``tx`` on ``sites`` vmapped sites to the per-step gradients ``grads[t]`` (site-stacked).

  Returns the per-site params after every step and the final state.
  """
  stacked = jax.tree.map(lambda x: jnp.stack([x] * sites), params)
  state = jax.vmap(tx.init)(stacked)

  @jax.jit
  def step(g, s, p):
    def site(g, s, p):
      u, s = tx.update(g, s, p)
      return optax.apply_updates(p, u), s
    return jax.vmap(site, axis_name="data")(g, s, p)

  history = []
  for g in grads:
    stacked, state = step(g, state, stacked)
    history.append(jax.tree.map(np.asarray, stacked))
  return history, state


def _grads(steps, shapes, sites=SITES, seed=0):
  rng = np.random.default_rng(seed)
  return [{k: rng.normal(size=(sites,) + s).astype(np.float32) for k, s in shapes.items()}
          for _ in range(steps)]


PARAMS = {"a": jnp.array([1.0, -2.0]), "b": jnp.array([0.5, 3.0, -1.0])}
SHAPES = {"a": (2,), "b": (3,)}


def test_local_sgd_h1_equals_allreduce_training():
  grads = _grads(4, SHAPES)
  got, _ = _run(local.local_sgd(optax.sgd(0.1), every=1), PARAMS, grads)
  ref, _ = _run(optax.chain(dadjax.allreduce("data"), optax.sgd(0.1)), PARAMS, grads)
  for g, r in zip(got, ref):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-6), g, r)


def test_diloco_h1_outer_sgd1_equals_mean_of_inner_steps():
  grads = _grads(4, SHAPES)
  tx = local.diloco(optax.adam(0.05), every=1, outer=optax.sgd(1.0))
  got, _ = _run(tx, PARAMS, grads)
  ref, _ = _run(optax.chain(optax.adam(0.05), dadjax.allreduce("data")), PARAMS, grads)
  for g, r in zip(got, ref):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=1e-5), g, r)


def test_identity_compressor_equals_uncompressed_exactly():
  grads = _grads(6, SHAPES)
  plain, s1 = _run(local.diloco(optax.sgd(0.1, momentum=0.9), every=3), PARAMS, grads)
  ident, s2 = _run(local.diloco(optax.sgd(0.1, momentum=0.9), every=3,
                                compressor=dadjax.identity()), PARAMS, grads)
  for g, r in zip(plain, ident):
    jax.tree.map(np.testing.assert_array_equal, g, r)
  jax.tree.map(np.testing.assert_array_equal, s1.anchor, s2.anchor)


def test_two_site_diloco_by_hand():
  """2 inner SGD steps (lr 0.1) per period, outer Nesterov SGD (lr 0.7, momentum 0.9)."""
  p0 = {"w": jnp.array([1.0, 2.0])}
  g = [{"w": np.array([[1.0, 0.0], [3.0, 2.0]], np.float32)},   # step 1: site 0, site 1
       {"w": np.array([[0.0, 1.0], [1.0, -1.0]], np.float32)},   # step 2
       {"w": np.array([[2.0, 2.0], [0.0, 0.0]], np.float32)},    # step 3
       {"w": np.array([[-1.0, 0.0], [1.0, 4.0]], np.float32)}]   # step 4
  hist, state = _run(local.diloco(optax.sgd(0.1), every=2), p0, g)
  # step 1: no synchronization, every site took its own step
  np.testing.assert_allclose(hist[0]["w"], [[0.9, 2.0], [0.7, 1.8]], rtol=1e-6)
  # step 2: pseudo-gradients 0.1 * (g1 + g2) = [0.1, 0.1] and [0.4, 0.1]; mean [0.25, 0.1]
  d1 = np.array([0.25, 0.1])
  m1 = d1                       # momentum trace m = d + 0.9 * 0
  anchor1 = np.array([1.0, 2.0]) - 0.7 * (d1 + 0.9 * m1)   # Nesterov: d + 0.9 m
  np.testing.assert_allclose(hist[1]["w"], [anchor1, anchor1], rtol=1e-6)
  # steps 3-4: from anchor1; pseudo-gradients 0.1 * [1, 2] and 0.1 * [1, 4]; mean [0.1, 0.3]
  d2 = np.array([0.1, 0.3])
  m2 = d2 + 0.9 * m1
  anchor2 = anchor1 - 0.7 * (d2 + 0.9 * m2)
  np.testing.assert_allclose(hist[3]["w"], [anchor2, anchor2], rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(state.anchor["w"], [anchor2, anchor2], rtol=1e-6, atol=1e-7)
  assert state.evaluation_params(None) is state.anchor  # evaluation reads the anchor


def test_streaming_schedule_three_fragments():
  params = {"a": jnp.zeros(2), "b": jnp.zeros(2), "c": jnp.zeros(2)}
  plan = local.sync_plan(params, every=3, fragments=3, delay=1)
  assert plan.leaves == (0, 1, 2)        # one leaf per fragment, in flattening order
  assert plan.send == (1, 2, 0) and plan.merge == (2, 0, 1) and plan.first == (1, 2, 3)
  assert [plan.sends(t) for t in range(1, 8)] == [(0,), (1,), (2,), (0,), (1,), (2,), (0,)]
  assert [plan.merges(t) for t in range(1, 8)] == [(), (0,), (1,), (2,), (0,), (1,), (2,)]
  # unequal leaves: contiguous runs of about equal size, each at least one leaf
  sized = {"a": jnp.zeros(10), "b": jnp.zeros(1), "c": jnp.zeros(1), "d": jnp.zeros(8)}
  assert local.sync_plan(sized, every=4, fragments=2).leaves == (0, 1, 1, 1)
  assert local.sync_plan(sized, every=4, fragments=4).leaves == (0, 1, 2, 3)
  assert local.sync_plan(sized, every=4).send == (0,)      # one fragment: DiLoCo's schedule


def test_streaming_diloco_by_hand():
  """3 fragments, H = 3, tau = 1, alpha = 0.5, inner SGD lr 0.1, outer SGD lr 0.5, 2 sites."""
  p0 = {"a": jnp.array([1.0]), "b": jnp.array([2.0]), "c": jnp.array([3.0])}
  steps = 7
  rng = np.random.default_rng(3)
  grads = [{k: rng.integers(-3, 4, (2, 1)).astype(np.float32) for k in "abc"}
           for _ in range(steps)]
  tx = local.streaming_diloco(optax.sgd(0.1), every=3, fragments=3, delay=1, alpha=0.5,
                              outer=optax.sgd(0.5))
  hist, state = _run(tx, p0, grads)
  # By hand: fragment a sends at steps 1, 4, 7 and merges at 2, 5; b sends at 2, 5 and
  # merges at 3, 6; c sends at 3, 6 and merges at 4, 7.
  sends = {"a": (1, 4, 7), "b": (2, 5), "c": (3, 6)}
  merges = {"a": (2, 5), "b": (3, 6), "c": (4, 7)}
  x = {k: np.array([float(p0[k][0])] * 2) for k in "abc"}       # per site
  anchor = {k: float(p0[k][0]) for k in "abc"}
  inflight = {}
  for t in range(1, steps + 1):
    for k in "abc":
      x[k] = x[k] - 0.1 * grads[t - 1][k][:, 0]
      if t in sends[k]:
        inflight[k] = np.mean(anchor[k] - x[k])
      if t in merges[k]:
        anchor[k] = anchor[k] - 0.5 * inflight[k]
        x[k] = 0.5 * x[k] + 0.5 * anchor[k]
    for k in "abc":
      np.testing.assert_allclose(hist[t - 1][k][:, 0], x[k], rtol=1e-5, atol=1e-6,
                                 err_msg=f"{k} at step {t}")
  for k in "abc":
    np.testing.assert_allclose(state.anchor[k][:, 0], anchor[k], rtol=1e-5)
  # every site's ledger: one fragment of 32 bits per send, 7 sends in 7 steps
  led = state.ledger
  assert isinstance(led, PeriodicStats)
  summary = dadjax.comm_stats(state)
  assert summary.total == 7 * 32 and summary.peak_bits_per_step == 32
  assert summary.bits_per_step == 7 * 32 // 7


def test_streaming_with_one_fragment_no_delay_alpha0_is_diloco():
  grads = _grads(6, SHAPES)
  a, _ = _run(local.diloco(optax.sgd(0.1), every=3), PARAMS, grads)
  b, _ = _run(local.streaming_diloco(optax.sgd(0.1), every=3, fragments=1, delay=0, alpha=0.0),
              PARAMS, grads)
  for g, r in zip(a, b):
    jax.tree.map(np.testing.assert_array_equal, g, r)


def test_compressed_outer_gradients_keep_state_and_book_bits():
  grads = _grads(8, SHAPES)
  for spec in ("bf16", "qsgd(4)", "ef(topk(0.5))", "powersgd(1)", "randomk(0.5)"):
    hist, state = _run(local.diloco(optax.sgd(0.1), every=4, compressor=spec), PARAMS, grads)
    summary = dadjax.comm_stats(state)
    assert summary.updates == 8 and summary.total > 0, spec
    assert summary.peak_bits_per_step * 2 == summary.total, spec  # two equal exchanges
    # after a synchronization both sites hold the same parameters
    jax.tree.map(lambda x: np.testing.assert_array_equal(x[0], x[1]), hist[3])


def test_ledger_rates_mean_and_peak():
  grads = _grads(8, SHAPES)
  _, state = _run(local.diloco(optax.sgd(0.1), every=4), PARAMS, grads)
  payload = 5 * 32
  s = dadjax.comm_stats(state)
  assert s.total == 2 * payload and s.updates == 8
  assert s.bits_per_step == payload // 4 and s.peak_bits_per_step == payload
  assert s.reduce_calls == 2 / 8 and s.peak_reduce_calls == 1
  assert s.dense_bits_per_step == payload and s.total_dense == 8 * payload
  net = dadjax.NetworkModel(bandwidth=1e6, latency=0.0, num_sites=8)
  assert net.peak_step_time(s) == pytest.approx(4 * net.step_time(s))
  out = dadjax.comm.report(s, net)
  assert out.peak_payload_bits_per_step == payload
  assert out.peak_comm_s_per_step == pytest.approx(4 * out.modeled_comm_s_per_step)
  # compiled ops in the synchronization branch run once per period on the mean step
  ops = {"reduce": 3}
  class _Ops:  # pylint: disable=too-few-public-methods
    count, conditional_count = {"reduce": 3}, {"reduce": 2}
  lat = dadjax.NetworkModel(bandwidth=1e30, latency=1.0, num_sites=2)
  assert lat.step_time(s, ops) == pytest.approx(2 * 3)           # no conditional info: all ops
  assert lat.step_time(s, _Ops()) == pytest.approx(2 * (1 + 2 / 4))
  assert lat.peak_step_time(s, _Ops()) == pytest.approx(2 * 3)


@pytest.mark.parametrize("make, match", [
    (lambda: local.diloco(optax.sgd(0.1), every=0), r"diloco: every must be an int >= 1"),
    (lambda: local.local_sgd(optax.sgd(0.1), every=1.5), r"every must be an int >= 1"),
    (lambda: local.streaming_diloco(optax.sgd(0.1), every=4, delay=4),
     r"delay must be an int in \[0, 3\]"),
    (lambda: local.streaming_diloco(optax.sgd(0.1), every=4, fragments=5),
     r"fragments must be an int in \[1, 4\]"),
    (lambda: local.streaming_diloco(optax.sgd(0.1), every=4, alpha=1.5),
     r"alpha must be a float in \[0, 1\]"),
    (lambda: local.diloco(optax.sgd(0.1), every=4, compressor="qsgd(4"),
     r"diloco: compressor must be .* 'qsgd\(4' does not parse"),
    (lambda: local.diloco(optax.sgd(0.1), every=4, compressor="nope"),
     r"compressor must be .*no compressor named 'nope'"),
    (lambda: local.diloco(optax.sgd(0.1), every=4,
                          compressor=dadjax.compressed(dadjax.qsgd(4))),
     r"not an optax transformation"),
    (lambda: local.diloco("sgd", every=4), r"inner must be an optax GradientTransformation"),
])
def test_bad_arguments_are_one_clear_error(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def test_fragments_above_leaves_refused_at_init():
  tx = local.streaming_diloco(optax.sgd(0.1), every=8, fragments=3)
  with pytest.raises(ValueError, match=r"fragments must be in \[1, 2\] \(the number of parameter"):
    tx.init({"a": jnp.zeros(2), "b": jnp.zeros(3)})


def test_communicating_or_accumulating_inner_is_refused():
  with pytest.raises(ValueError, match="the inner optimizer communicates"):
    local.diloco(optax.chain(dadjax.allreduce("data"), optax.sgd(0.1)), every=2).init(PARAMS)
  with pytest.raises(ValueError, match=r"dadjax.accumulate\(diloco\(inner, every=H\), k\)"):
    local.diloco(dadjax.accumulate(optax.sgd(0.1), 2), every=2).init(PARAMS)


def test_accumulate_around_diloco_counts_optimizer_steps():
  """accumulate(diloco(...), k): H counts optimizer steps; equals diloco on the mean gradient."""
  k, h = 2, 2
  micro = _grads(2 * k * h, SHAPES)
  acc, s_acc = _run(dadjax.accumulate(local.diloco(optax.sgd(0.1), every=h), k), PARAMS, micro)
  means = [jax.tree.map(lambda *g: sum(g) / k, *micro[i:i + k]) for i in range(0, len(micro), k)]
  ref, s_ref = _run(local.diloco(optax.sgd(0.1), every=h), PARAMS, means)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7),
               acc[-1], ref[-1])
  assert dadjax.comm_stats(s_acc).total == dadjax.comm_stats(s_ref).total == 2 * 5 * 32


def test_specs_build_and_wrap_the_local_optimizer():
  names = {e.name for e in dadjax.registry.entries() if e.family == "local"}
  assert names == {"local_sgd", "diloco", "streaming_diloco", "sparseloco", "demo"}
  text = cli.describe_methods()  # what `dadjax methods` prints
  for form in ("local_sgd:EVERY", "diloco(EVERY", "streaming_diloco(EVERY"):
    assert form in text
  grads = _grads(6, SHAPES)
  for spec, direct in [
      ("local_sgd:3", local.local_sgd(optax.sgd(0.1), 3)),
      ("diloco:3:outer_lr=0.5:compress=qsgd(4)",
       local.diloco(optax.sgd(0.1), 3, optax.sgd(0.5, momentum=0.9, nesterov=True), "qsgd:4")),
      ("streaming_diloco:3:fragments=2:delay=1:outer_momentum=0",
       local.streaming_diloco(optax.sgd(0.1), 3, 2, 1, 0.5, optax.sgd(0.7)))]:
    method = dadjax.build_method(spec)
    assert method.tx is None and method.wrap is not None
    a, _ = _run(method.optimizer(optax.sgd(0.1)), PARAMS, grads)
    b, _ = _run(direct, PARAMS, grads)
    jax.tree.map(np.testing.assert_array_equal, a[-1], b[-1])


@pytest.mark.parametrize("spec, match", [
    ("diloco:0", r"diloco: every must be an int in \[1, inf\)"),
    ("streaming_diloco:4:delay=4", r"streaming_diloco: delay must be an int in \[0, 3\]"),
    ("streaming_diloco:4:fragments=5", r"fragments must be an int in \[1, 4\]"),
    ("streaming_diloco:4:alpha=2", r"alpha must be a float in \[0, 1\]"),
    ("diloco:4:compress=nope(1)", r"diloco: compress: no compressor named 'nope'"),
])
def test_bad_specs_are_one_clear_error(spec, match):
  with pytest.raises(dadjax.SpecError, match=match):
    dadjax.build_method(spec)


def test_accordion_batch_around_diloco_keeps_both():
  method = dadjax.build_method("accordion_batch(diloco(2), small=1, large=2, window=2)")
  tx = method.optimizer(optax.sgd(0.1))
  state = tx.init(PARAMS)
  found = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, local.LocalState))
  assert any(isinstance(x, local.LocalState) for x in found)
