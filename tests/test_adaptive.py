"""Accordion: the critical-regime detector, the per-tensor switch between two
compressor settings (both states kept), decisions equal on every site under
shard_map, the ledger of the chosen branch, batch-size mode, the heat map."""
import re

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import adaptive as A
from dadjax import compress as C
from dadjax.compress._base import leaf_keys

SITES = 8


# -- the detector on hand-made norm sequences ----------------------------------


def _run_detector(norms_per_step, *, window=1, interval=1, eta=0.5, decay_at=()):
  """Feed steps whose gradient of tensor j is ``[n_j]``; record (critical, norms) after each."""
  norms_per_step = np.asarray(norms_per_step, np.float32)
  tensors = norms_per_step.shape[1]
  params = {f"t{j}": jnp.zeros((1,)) for j in range(tensors)}
  state = A.detector_init(params)
  chex.assert_trees_all_equal(state.critical, jnp.ones([tensors], bool))  # first window
  update = jax.jit(lambda s, g: A.detector_update(s, g, window=window, interval=interval,
                                                  eta=eta, axis_name=None))
  critical, norms, ended = [], [], []
  for t, row in enumerate(norms_per_step):
    if t in decay_at:
      state = A.detector_lr_decrease(state, True)
    grads = {f"t{j}": jnp.asarray([row[j]]) for j in range(tensors)}
    state, end = update(state, grads)
    critical.append(np.asarray(state.critical))
    norms.append(np.asarray(state.norms))
    ended.append(bool(end))
  return np.array(critical), np.array(norms), ended


def test_rule_and_zero_old_norm():
  old = jnp.asarray([1.0, 1.0, 1.0, 2.0, 0.0, 0.0])
  new = jnp.asarray([1.0, 0.5, 1.49, 3.0, 0.0, 5.0])
  got = A.is_critical(old, new, 0.5)
  # |1-0.5|/1 = 0.5 >= 0.5 exactly; 0.49 < 0.5; |2-3|/2 = 0.5; zero old: critical, no NaN.
  np.testing.assert_array_equal(got, [False, True, False, True, True, True])


def test_first_window_then_steady_then_sudden_change():
  # two tensors; tensor 0 steady, tensor 1 jumps x3 at step 4 and drops x0.45 at step 6.
  seq = [[1, 1], [1, 1], [1, 1], [1, 1], [1, 3], [1, 3], [1, 1.35]]
  critical, norms, ended = _run_detector(seq)
  assert all(ended)  # window = 1: every step ends a window
  np.testing.assert_allclose(norms[:, 1], [1, 1, 1, 1, 3, 3, 1.35], rtol=1e-6)
  # window 0 has no earlier norm (0 -> critical); window 1 compares with window 0.
  np.testing.assert_array_equal(critical[:, 0], [1, 0, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(critical[:, 1], [1, 0, 0, 0, 1, 0, 1])


def test_window_accumulates_the_gradient_not_its_norms():
  # window 2: +1, -1 cancel -> the window's norm is 0; then 0 -> 2 is critical (zero old).
  critical, norms, ended = _run_detector([[1], [-1], [1], [1], [1], [1]], window=2)
  assert ended == [False, True, False, True, False, True]
  np.testing.assert_allclose(norms[:, 0], [0, 0, 0, 2, 2, 2])
  np.testing.assert_array_equal(critical[:, 0], [1, 1, 1, 1, 1, 0])


def test_lr_decay_makes_every_tensor_critical_until_the_next_check():
  seq = [[1, 1]] * 7
  critical, _, _ = _run_detector(seq, window=2, decay_at=(4,))
  # checks at steps 1, 3, 5 (ends of windows 0, 1, 2): window 0 critical, steady afterwards;
  # the decay at step 4 forces critical until the check at step 5 clears it.
  np.testing.assert_array_equal(critical[:, 0], [1, 1, 1, 0, 1, 0, 0])
  np.testing.assert_array_equal(critical[:, 1], critical[:, 0])


def test_interval_compares_with_the_window_interval_earlier():
  # interval 3: checks at windows 0, 3, 6, 9; windows in between never decide.
  seq = [[1], [5], [0.1], [1.2], [9], [9], [1.3], [0.1], [7], [3.0]]
  critical, _, _ = _run_detector(seq, interval=3)
  # w0: old 0 -> critical (kept through w1, w2); w3: |1-1.2|/1 < .5 -> high (kept w4, w5);
  # w6: |1.2-1.3|/1.2 -> high; w9: |1.3-3|/1.3 -> critical.
  np.testing.assert_array_equal(critical[:, 0], [1, 1, 1, 0, 0, 0, 0, 0, 0, 1])


def test_whole_model_norm_and_lr_schedule_signal():
  params = {"a": jnp.zeros((2,)), "b": jnp.zeros((1,))}
  s = A.detector_init(params, whole_model=True)
  s, _ = A.detector_update(s, {"a": jnp.asarray([3.0, 0.0]), "b": jnp.asarray([4.0])}, window=1,
                           axis_name=None, whole_model=True)
  np.testing.assert_allclose(s.norms, [5.0])
  sched = optax.piecewise_constant_schedule(0.1, {3: 0.1})
  got = [bool(A.lr_decreased(sched, jnp.int32(t))) for t in range(6)]
  assert got == [False, False, False, True, False, False]


def test_hyperparameters_are_validated_at_construction():
  low, high = C.powersgd(2), C.powersgd(1)
  with pytest.raises(ValueError, match="window"):
    A.accordion(low, high, window=0)
  with pytest.raises(ValueError, match="interval"):
    A.accordion(low, high, window=1, interval=0)
  with pytest.raises(ValueError, match="eta"):
    A.accordion(low, high, window=1, eta=0.0)
  with pytest.raises(ValueError, match="eta"):
    A.accordion(low, high, window=1, eta=float("nan"))
  with pytest.raises(ValueError, match="high"):
    A.accordion(low, "powersgd:1", window=1)
  with pytest.raises(ValueError, match="lr_schedule"):
    A.accordion(low, high, window=1, lr_schedule=0.1)
  with pytest.raises(ValueError, match="large"):
    A.accordion_batch(optax.sgd(0.1), 4, 2, window=1)
  with pytest.raises(ValueError, match="small"):
    A.accordion_batch(optax.sgd(0.1), 0, 2, window=1)
  with pytest.raises(ValueError, match="scale_lr"):
    A.accordion_batch(optax.sgd(0.1), 1, 2, window=1, scale_lr="yes")


# -- a switch keeps both settings' states ---------------------------------------


def _params():
  k = jax.random.split(jax.random.key(0), 3)
  return {"w": jax.random.normal(k[0], (12, 6)), "b": jax.random.normal(k[1], (6,)),
          "v": jax.random.normal(k[2], (3, 2, 5))}


def _grads(t):
  return jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)) + 0.1 * t, _params())


def _forced(update, state, grads, low: bool):
  """One update with the decision forced (no window ends: window is huge)."""
  det = state.detector._replace(critical=jnp.full_like(state.detector.critical, low))
  return update(grads, state._replace(detector=det))


@pytest.mark.parametrize("low_spec, high_spec", [("powersgd:2", "powersgd:1"),
                                                 ("ef_topk:0.5", "ef_topk:0.1"),
                                                 ("qsgd:64", "qsgd:4")])
def test_switch_preserves_both_settings_states(low_spec, high_spec):
  low, high = C.get_compressor(low_spec), C.get_compressor(high_spec)
  tx = A.accordion(low, high, window=10_000, axis_name=None, seed=3, share_memory=False)
  params = _params()
  state = tx.init(params)
  plan = [True, True, False, False, True]  # low -> high -> low
  history = []
  update = jax.jit(tx.update)
  for t, chosen in enumerate(plan):
    updates, state = _forced(update, state, _grads(t), chosen)
    history.append((updates, state))
  names = sorted(params)  # leaf order of a dict
  w = names.index("w")
  # the excursion to high does not touch low's state, and vice versa before it.
  chex.assert_trees_all_equal(history[1][1].low, history[3][1].low)
  chex.assert_trees_all_equal(history[0][1].high, history[1][1].high)
  chex.assert_trees_all_equal(history[3][1].high, history[4][1].high)
  # the state of each setting is the one of a static run on the steps it ran.
  for setting, comp, steps in (("low", low, [0, 1, 4]), ("high", high, [2, 3])):
    run = jax.jit(lambda g, s, k, comp=comp: C.exchange(comp, g, s, k, None))
    for i, name in enumerate(names):
      x = params[name]
      if x.ndim < 2:
        continue
      s = comp.init((x,))
      for t in steps:
        keys = leaf_keys(C.step_keys(3, jnp.int32(t), None), i)
        out = run((_grads(t)[name],), s, keys)
        s = out.state
        chex.assert_trees_all_close(history[t][0][name], out.mean[0], rtol=1e-6, atol=1e-6)
      chex.assert_trees_all_close(getattr(history[-1][1], setting)[i], s, rtol=1e-6, atol=1e-6)
  if low_spec.startswith("qsgd"):
    return  # stateless: the per-step equality above is the check
  # the warm start / memory is real state (not zeros) that the excursion kept.
  assert any(float(jnp.abs(x).sum()) > 0 for x in jax.tree.leaves(history[-1][1].low[w]))
  # uncompressed 1-D tensors are the plain average (one site: the gradient itself).
  np.testing.assert_allclose(history[2][0]["b"], _grads(2)["b"], rtol=1e-6)


@pytest.mark.parametrize("low_spec, high_spec", [("powersgd:2", "powersgd:1"),
                                                 ("ef_topk:0.5", "ef_topk:0.1")])
def test_shared_memory_is_one_residual_threaded_through_both_settings(low_spec, high_spec):
  low, high = C.get_compressor(low_spec), C.get_compressor(high_spec)
  tx = A.accordion(low, high, window=10_000, axis_name=None, seed=3)  # share_memory=True
  params = _params()
  state = tx.init(params)
  names = sorted(params)
  for i, name in enumerate(names):  # one memory per matrix, none held by the settings
    assert (jax.tree.leaves(state.memory[i]) != []) == (params[name].ndim >= 2)
    assert jax.tree.leaves(getattr(state.low[i], "memory", ())) == []
  plan = [True, False, False, True, False]  # low -> high -> low -> high
  update = jax.jit(tx.update)
  run = jax.jit(lambda comp, g, s, k: C.exchange(comp, g, s, k, None), static_argnums=0)
  ref = {}
  for i, name in enumerate(names):
    if params[name].ndim >= 2:
      a, b = low.init((params[name],)), high.init((params[name],))
      ref[name] = {"low": a._replace(memory=()), "high": b._replace(memory=()), "m": a.memory}
  for t, chosen in enumerate(plan):
    updates, state = _forced(update, state, _grads(t), chosen)
    for i, name in enumerate(names):
      if name not in ref:
        continue
      r, setting = ref[name], "low" if chosen else "high"
      keys = leaf_keys(C.step_keys(3, jnp.int32(t), None), i)
      out = run(low if chosen else high, (_grads(t)[name],), r[setting]._replace(memory=r["m"]),
                keys)
      r[setting], r["m"] = out.state._replace(memory=()), out.state.memory
      chex.assert_trees_all_close(updates[name], out.mean[0], rtol=1e-6, atol=1e-6)
      chex.assert_trees_all_close(state.memory[i], r["m"], rtol=1e-6, atol=1e-6)
      chex.assert_trees_all_close((state.low[i], state.high[i]), (r["low"], r["high"]),
                                  rtol=1e-6, atol=1e-6)
  assert float(sum(jnp.abs(x).sum() for x in jax.tree.leaves(state.memory))) > 0


@pytest.mark.parametrize("low_spec, high_spec, tol, steps", [
    ("ef_topk:0.5", "ef_topk:0.1", 0.0, 5),
    pytest.param("ef_topk:0.5", "ef_topk:0.1", 0.0, 20, marks=pytest.mark.slow),
    pytest.param("powersgd:2", "powersgd:1", 1e-5, 20, marks=pytest.mark.slow)])
def test_batched_switch_equals_per_tensor_exchanges(low_spec, high_spec, tol, steps):
  """Three equal-shape matrices form one batch; decisions drawn at random (mixed batches).

  Each tensor's update equals its own one-tensor exchange with its own keys and state (the
  per-tensor ``lax.cond`` of earlier releases): exactly for EF-TopK; PowerSGD's batched
  products may round differently (measured: at most 4e-6 on O(1) gradients over 20 steps).
  The default run takes 5 steps of the exact case; the 20-step runs are slow-marked.
  The ledger books each member's payload of the setting it chose, once.
  """
  low, high = C.get_compressor(low_spec), C.get_compressor(high_spec)
  k = jax.random.split(jax.random.key(1), 4)
  params = {"a": jax.random.normal(k[0], (12, 6)), "b": jax.random.normal(k[1], (12, 6)),
            "c": jax.random.normal(k[2], (12, 6)), "d": jax.random.normal(k[3], (6,))}
  grads = lambda t: jax.tree.map(lambda x: jnp.sin(x * (t + 1.0)) + 0.1 * t, params)
  tx = A.accordion(low, high, window=10_000, axis_name=None, seed=3, share_memory=False)
  state, update = tx.init(params), jax.jit(tx.update)
  run = jax.jit(lambda comp, g, s, key: C.exchange(comp, g, s, key, None), static_argnums=0)
  ref = {n: {"low": low.init((params[n],)), "high": high.init((params[n],))} for n in "abc"}
  bits = {name: _exchange_bits(comp, params["a"])[0] + _exchange_bits(comp, params["a"])[1]
          for name, comp in (("low", low), ("high", high))}
  rng = np.random.default_rng(0)
  total = 0
  for t in range(steps):
    critical = rng.random(4) < 0.5
    det = state.detector._replace(critical=jnp.asarray(critical))
    before = dadjax.comm_stats(state).total
    updates, state = update(grads(t), state._replace(detector=det))
    for i, n in enumerate("abc"):
      name = "low" if critical[i] else "high"
      out = run(low if critical[i] else high, (grads(t)[n],), ref[n][name],
                leaf_keys(C.step_keys(3, jnp.int32(t), None), i))
      ref[n][name] = out.state
      np.testing.assert_allclose(updates[n], out.mean[0], rtol=tol, atol=tol)
    # each member books its own setting's payload once (the per-tensor decisions' bits)
    sent = sum(bits["low"] if c else bits["high"] for c in critical[:3])
    total += sent
    assert dadjax.comm_stats(state).total - before == sent + 32 * 6  # + the fp32 1-D tensor
  assert total > 0


def test_ledger_and_row_on_one_site():
  params = _params()
  sched = optax.piecewise_constant_schedule(0.1, {3: 0.5})
  tx = A.accordion(C.powersgd(2), C.powersgd(1), window=1, eta=100.0, lr_schedule=sched,
                   axis_name=None)
  state = tx.init(params)
  update = jax.jit(tx.update)
  # payload bits of each setting per tensor (rank r: 32 r (m + n)); "b" goes in fp32.
  low_bits = 32 * 2 * ((12 + 6) + (6 + 5))
  high_bits = 32 * 1 * ((12 + 6) + (6 + 5))
  raw_bits, norm_bits = 32 * 6, 32 * 3
  expect_low = [1, 1, 0, 1, 0]  # windows 0, 1 critical; eta huge; the LR decay at step 3
  rows = []
  for t in range(5):
    _, state = update(_grads(t), state)
    row = A.accordion_row(state, params)
    rows.append(row)
    assert row["accordion/low/w"] == row["accordion/low/v"] == expect_low[t]
    assert "accordion/low/b" not in row and "accordion/critical/b" in row
    stats = dadjax.comm_stats(state)
    sent = (low_bits if expect_low[t] else high_bits) + raw_bits + norm_bits
    assert stats.reduce_bits == (sent,) and stats.gather_bits == (0,)
  assert [r["accordion/lr"] for r in rows] == pytest.approx([0.1, 0.1, 0.1, 0.05, 0.05])
  assert stats.total == sum((low_bits if e else high_bits) + raw_bits + norm_bits
                             for e in expect_low)
  steps, names, low, lr = A.decision_matrix(rows)
  assert names == ["v", "w"] and list(steps) == [1, 2, 3, 4, 5]
  np.testing.assert_array_equal(low, [expect_low, expect_low])
  np.testing.assert_allclose(lr, [0.1, 0.1, 0.1, 0.05, 0.05])


def test_heat_map_is_drawn(tmp_path):
  rows = [{"accordion/step": t, "accordion/lr": 0.1 if t < 3 else 0.01,
           "accordion/low/a": int(t < 2 or t == 3), "accordion/low/b": int(t < 1)}
          for t in range(6)]
  fig = A.plot_decisions(rows, tmp_path / "heat.png")
  assert (tmp_path / "heat.png").stat().st_size > 1000
  assert len(fig.axes) == 2
  with pytest.raises(ValueError, match="rows"):
    A.decision_matrix([{"loss": 1.0}])


# -- under shard_map: equal decisions, both branches compiled, the chosen one's bits ------


class TinyMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(4)(nn.relu(nn.Dense(12)(x)))


def _non_iid_batch(step, rows_per_site=4):
  """Site i sees inputs shifted and scaled by i and mostly label i % 4."""
  rng = np.random.default_rng(step)
  xs, ys = [], []
  for i in range(SITES):
    xs.append(rng.normal(loc=i, scale=1 + i, size=(rows_per_site, 6)))
    ys.append(np.where(rng.random(rows_per_site) < 0.8, i % 4, rng.integers(0, 4, rows_per_site)))
  return {"x": np.concatenate(xs).astype(np.float32), "y": np.concatenate(ys).astype(np.int32)}


def _branch_collectives(hlo: str) -> list[tuple[set, set]]:
  """For each ``conditional`` of an HLO module: the collective opcodes in each of its branches."""
  bodies, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
    if head and not line.startswith(" "):
      name = head.group(1)
      bodies[name] = []
    elif name is not None:
      bodies[name].append(line)
  found = []
  for lines in bodies.values():
    for line in lines:
      m = re.search(r"\sconditional\(.*branch_computations=\{([^}]*)\}", line)
      if m:
        branches = [b.strip().lstrip("%") for b in m.group(1).split(",")]
        found.append(tuple(
            {op for op in ("all-reduce", "all-gather")
             if any(re.search(rf"\s{op}(?:-start)?\(", l) for l in bodies[b])}
            for b in branches))
  return found


def _exchange_bits(comp, leaf):
  out = C.exchange(comp, (leaf,), comp.init((leaf,)), C.step_keys(0, jnp.int32(0), None), None)
  t = out.traffic
  return int(t.reduce), int(t.gather)


def test_shard_map_decisions_equal_on_all_sites_and_ledger_is_the_chosen_branch():
  low, high = C.powersgd(2), C.get_compressor("ef_topk:0.1")
  sched = optax.piecewise_constant_schedule(0.05, {4: 0.5})
  acc = A.accordion(low, high, window=1, eta=0.5, lr_schedule=sched)
  tx = optax.chain(acc, optax.sgd(sched))
  ts = dadjax.make_train_step(TinyMLP(), tx, num_sites=SITES, backend="shard_map")
  state = ts.init(jax.random.key(0), _non_iid_batch(0)["x"][:2])
  params = ts.params(state)
  leaves = jax.tree.leaves(params)
  per_low = [_exchange_bits(low, x) if x.ndim >= 2 else None for x in leaves]
  per_high = [_exchange_bits(high, x) if x.ndim >= 2 else None for x in leaves]
  raw = sum(32 * x.size for x in leaves if x.ndim < 2)

  hlo = ts._run.lower(state, ts.place_batch(_non_iid_batch(0))).compile().as_text()
  # one conditional per chunk of a shape group (here each matrix is its own group of one):
  # a branch with PowerSGD's all-reduces (low) and one with TopK's all-gather (high); the
  # 1-D tensors ride with the window-end norms in one conditional whose branches both
  # all-reduce (riders + norms, or the riders alone).
  found = _branch_collectives(hlo)
  switches = sorted(sorted(map(sorted, b)) for b in found if {"all-gather"} in b)
  assert switches == [[["all-gather"], ["all-reduce"]]] * 2, found
  assert ({"all-reduce"}, {"all-reduce"}) in found, found
  seen_low, seen_high = False, False
  for t in range(8):
    state, _ = ts(state, _non_iid_batch(t))
    opt = A.find_accordion_state(state.opt_state)
    decisions = np.asarray(opt.sent_low)
    critical = np.asarray(opt.detector.critical)
    norms = np.asarray(opt.detector.norms)
    assert (decisions == decisions[0]).all() and (critical == critical[0]).all()
    assert (norms == norms[0]).all()  # all-reduced: bitwise equal on every site
    chex.assert_trees_all_equal(*[jax.tree.map(lambda x, i=i: np.asarray(x)[i], state.params)
                                  for i in (0, SITES - 1)])
    expect_r, expect_g = raw + 32 * len(leaves), 0  # fp32 1-D tensors; norms (window 1)
    for j, x in enumerate(leaves):
      if x.ndim >= 2:
        r, g = per_low[j] if decisions[0][j] else per_high[j]
        expect_r, expect_g = expect_r + r, expect_g + g
        seen_low |= bool(decisions[0][j])
        seen_high |= not decisions[0][j]
    stats = dadjax.comm_stats(state.opt_state)
    assert stats.reduce_bits == (expect_r,) * SITES, t
    assert stats.gather_bits == (expect_g,) * SITES, t
  assert seen_low and seen_high  # both settings ran in this run


@pytest.mark.slow  # the shard_map test above pins decisions and ledger; this one is long
def test_vmap_simulation_equals_shard_map():
  low, high = C.powersgd(2), C.get_compressor("ef_topk:0.1")
  sched = optax.piecewise_constant_schedule(0.05, {2: 0.5})
  tx = optax.chain(A.accordion(low, high, window=1, eta=100.0, lr_schedule=sched),
                   optax.sgd(sched))
  out = {}
  for backend in ("shard_map", "vmap"):
    ts = dadjax.make_train_step(TinyMLP(), tx, num_sites=SITES, backend=backend)
    state = ts.init(jax.random.key(0), _non_iid_batch(0)["x"][:2])
    lows = []
    for t in range(4):
      state, _ = ts(state, _non_iid_batch(t))
      lows.append(np.asarray(A.find_accordion_state(state.opt_state).sent_low))
    out[backend] = (ts.params(state), np.array(lows), dadjax.comm_stats(state.opt_state))
  (p_s, low_s, st_s), (p_v, low_v, st_v) = out["shard_map"], out["vmap"]
  np.testing.assert_array_equal(low_s, low_v)
  # windows 0, 1 critical; eta huge: high; the LR decay at step 2: low once more.
  assert low_s[:, 0].any(axis=1).tolist() == [True, True, True, False]
  chex.assert_trees_all_close(p_s, p_v, rtol=1e-5, atol=1e-6)
  assert st_s.total_bits == st_v.total_bits


# -- batch-size mode ---------------------------------------------------------------


def _loss(model, params, batch):
  logits = model.apply({"params": params}, batch["x"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def test_batch_mode_changes_the_effective_batch_in_lock_step():
  lr = 0.1
  micro_sched = optax.piecewise_constant_schedule(1.0, {10: 0.5})  # decay at micro-step 10
  tx = A.accordion_batch(optax.chain(dadjax.allreduce("data"), optax.sgd(lr)), 1, 4,
                         window=2, eta=100.0, lr_schedule=micro_sched)
  model = TinyMLP()
  ts = dadjax.make_train_step(model, tx, num_sites=SITES, backend="shard_map")
  state = ts.init(jax.random.key(1), _non_iid_batch(0)["x"][:2])
  ks, last_ks, changed = [], [], []
  cycle, before = [], ts.params(state)
  for t in range(14):
    batch = _non_iid_batch(t)
    cycle.append(batch)
    state, _ = ts(state, batch)
    row = A.batch_row(state)
    ks.append(row["accordion_batch/k"])
    after = ts.params(state)
    moved = any(not np.array_equal(a, b) for a, b in
                zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    changed.append(moved)
    for i in range(1, SITES):  # lock-step: every site holds the same parameters and counters
      chex.assert_trees_all_equal(after, ts.params(state, i))
      assert A.batch_row(state, site=i) == row
    if moved:
      last_ks.append(row["accordion_batch/last_k"])
      # the update is lr * (k / small) * gradient of the union of the k global batches.
      union = {k: np.concatenate([b[k] for b in cycle]) for k in ("x", "y")}
      grads = jax.grad(lambda p: _loss(model, p, union))(before)
      k = len(cycle)
      expect = jax.tree.map(lambda p, g: p - lr * k * g, before, grads)
      chex.assert_trees_all_close(after, expect, rtol=2e-4, atol=2e-6)
      cycle, before = [], after
  # windows 0 and 1 (micro-steps 0-3) are critical: k = 1; the check ending window 1
  # switches to 4 micro-batches; the decay at micro-step 10 (cleared by the check at 11)
  # gives one cycle of 1, then 4 again.
  assert last_ks == [1, 1, 1, 1, 4, 4, 1], last_ks
  assert changed == [True, True, True, True, False, False, False, True,
                     False, False, False, True, True, False]
  assert ks[3] == 4 and ks[11] == 1 and ks[12] == 4
