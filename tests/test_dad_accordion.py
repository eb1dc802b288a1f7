"""rank-dAD under Accordion: a dAD layer's rank chosen by the detector equals
static rank-dAD at the chosen rank step by step; bits follow the rank;
decisions agree on every site."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dadjax import dad
from dadjax.adaptive import decision_matrix
from dadjax.config import Config
from dadjax.dad import _rank_accordion
from dadjax.methods import build_method
from dadjax.train import train

SITES, AXIS = 4, "data"


def _vjp_run(config):
  """``run(a, d, state) -> (gk, gb, new_state)`` per site (stacked), D fed exactly;
  ``new_state`` is ``dad.next_state`` of the state and its cotangent."""

  def site(a, d, kernel, bias, state):
    _, vjp = jax.vjp(lambda k, b, s: dad.dense(a, k, b, s, config=config), kernel, bias, state)
    return vjp(d)

  run = jax.jit(jax.vmap(site, axis_name=AXIS))

  def call(a, d, state):
    kernel = jnp.zeros((SITES, a.shape[2], d.shape[2]))
    bias = jnp.zeros((SITES, d.shape[2]))
    gk, gb, ct = run(a, d, kernel, bias, state)
    return gk, gb, dad.next_state(state, ct)

  return call


def _stack(state):
  return jax.tree.map(lambda x: jnp.broadcast_to(x, (SITES,) + jnp.shape(x)), state)


def test_squared_norm_without_forming_the_gradient():
  rng = np.random.default_rng(0)
  for n, d_in, d_out in ((3, 20, 30), (50, 4, 5)):  # Gram route, then the dense one
    a = rng.normal(size=(n, d_in)).astype(np.float32)
    d = rng.normal(size=(n, d_out)).astype(np.float32)
    np.testing.assert_allclose(_rank_accordion.squared_norm(a, d),
                               np.sum((a.T.astype(np.float64) @ d) ** 2), rtol=1e-5)


@pytest.mark.parametrize("options", [{}, {"warm_start": True}, {"error_feedback": True}],
                         ids=["plain", "warm", "ef"])
def test_equals_static_rank_dad_at_the_chosen_rank_step_by_step(options):
  high, low, n, d_in, d_out = 3, 1, 6, 12, 9
  acc_cfg = dad.DadConfig(axis_name=AXIS, mode="rank", rank=high, rank_low=low, seed=3,
                          accordion_window=2, accordion_eta=0.5, tol=0.0, iters=8, **options)
  static_cfg = {r: dad.DadConfig(axis_name=AXIS, mode="rank", rank=r, seed=3, tol=0.0, iters=8,
                                 **options) for r in (low, high)}
  acc_run = _vjp_run(acc_cfg)
  static_run = {r: _vjp_run(c) for r, c in static_cfg.items()}
  state = _stack(dad.init_state(acc_cfg, d_in, d_out))
  rng = np.random.default_rng(1)
  # Gradient scale per step: steady, a jump (critical), steady again.
  scales = [1, 1, 1, 1, 8, 8, 8, 8, 8, 8, 8, 8]
  chosen = []
  for t, scale in enumerate(scales):
    a = rng.normal(size=(SITES, n, d_in)).astype(np.float32)
    d = (scale * rng.normal(size=(SITES, n, d_out))).astype(np.float32)
    cur = jax.vmap(dad.current_state)(state)
    is_high = bool(_rank_accordion.high_rank_now(acc_cfg, cur)[0])
    r = high if is_high else low
    chosen.append(r)
    gk, gb, new_state = acc_run(a, d, state)
    # The static layer at rank r from the same state (its fields, r columns).
    static_state = {k: cur[k] for k in dad.init_state(static_cfg[r], d_in, d_out)}
    if "basis" in static_state:
      static_state["basis"] = cur["basis"][:, :, :r]
    sk, sb, s_new = static_run[r](a, d, static_state)
    np.testing.assert_allclose(gk, sk, rtol=2e-5, atol=2e-5 * float(np.abs(sk).max()))
    np.testing.assert_allclose(gb, sb, rtol=1e-6, atol=1e-6)
    new_cur = jax.vmap(dad.current_state)(new_state)
    np.testing.assert_array_equal(new_cur["rank"], jax.vmap(dad.current_state)(s_new)["rank"])
    if "memory" in options or options.get("error_feedback"):
      np.testing.assert_allclose(new_cur["memory"], jax.vmap(dad.current_state)(s_new)["memory"],
                                 rtol=1e-4, atol=1e-4)
    assert float(new_cur["rank_used"][0]) == r
    # Decisions equal on every site (made from the gathered window statistics).
    assert np.all(np.asarray(new_cur["critical"]) == float(new_cur["critical"][0]))
    state = new_state
  # Window 0 (steps 0, 1) runs high and so does window 1 (the first check has
  # no earlier norm); window 1 was steady against window 0, so window 2 goes
  # low; the 8x jump in window 2 is critical, so window 3 runs high; steady
  # again, windows 4 and 5 go low.
  assert chosen == [3, 3, 3, 3, 1, 1, 3, 3, 1, 1, 1, 1], chosen


def test_lr_decrease_makes_the_layer_high_rank_until_the_next_check():
  sched = optax.piecewise_constant_schedule(0.1, {3: 0.1})
  cfg = dad.DadConfig(axis_name=AXIS, mode="rank", rank=2, rank_low=1, accordion_window=5,
                      lr_schedule=sched)
  run = _vjp_run(cfg)
  state = _stack(dad.init_state(cfg, 4, 3))
  # A decided state at step 1: low rank.
  state = {**state, "critical": jnp.zeros((SITES,)), "uses": jnp.ones((SITES,)),
           "step": jnp.ones((SITES,), jnp.int32)}
  used = []
  rng = np.random.default_rng(0)
  for _ in range(5):
    a = rng.normal(size=(SITES, 2, 4)).astype(np.float32)
    d = rng.normal(size=(SITES, 2, 3)).astype(np.float32)
    _, _, state = run(a, d, state)
    used.append(float(jax.vmap(dad.current_state)(state)["rank_used"][0]))
  assert used == [1, 1, 2, 2, 2]  # steps 1..5; the decay at step 3 holds until step 6's check


def test_sown_bits_follow_the_rank():
  layer = dad.Dense(7, mode="rank", rank=3, rank_low=1, axis_name=AXIS)
  x = jnp.ones((SITES, 5, 4))
  variables = jax.vmap(lambda x: layer.init(jax.random.key(0), x), axis_name=AXIS)(x)

  def bits(critical):
    v = {"params": variables["params"], "dad_state": dict(variables["dad_state"])}
    v["dad_state"]["dad"] = {**v["dad_state"]["dad"], "critical": jnp.full((SITES,), critical),
                             "uses": jnp.ones((SITES,)),
                             "step": jnp.ones((SITES,), jnp.int32)}
    _, out = jax.vmap(lambda v, x: layer.apply(v, x, mutable=["comm"]), axis_name=AXIS)(v, x)
    (b,) = out["comm"]["gather_bits"]
    return int(b.hi[0]) * 2**32 + int(b.lo[0])

  stat, bias = 1, 7
  assert bits(1.0) == (3 * (4 + 7) + bias + stat) * 32
  assert bits(0.0) == (1 * (4 + 7) + bias + stat) * 32


def test_bad_arguments():
  for kwargs, name in (({"mode": "exact", "rank_low": 1}, "rank_low"),
                       ({"mode": "rank", "rank": 2, "rank_low": 2}, "rank_low"),
                       ({"mode": "rank", "rank": 2, "rank_low": 1, "aggregation": "two_way"},
                        "rank_low"),
                       ({"accordion_window": 0}, "accordion_window"),
                       ({"accordion_eta": float("nan")}, "accordion_eta"),
                       ({"lr_schedule": 0.1}, "lr_schedule")):
    with pytest.raises(ValueError, match=name):
      dad.DadConfig(**kwargs)
  with pytest.raises(ValueError, match="rank_low"):
    dad.dense(jnp.ones((2, 3)), jnp.ones((3, 2)), config=dad.DadConfig(
        mode="rank", rank=2, rank_low=1, axis_name=None))


def test_method_in_a_shard_map_run_keeps_sites_in_lock_step():
  assert build_method("accordion_rank_dad:4:1", steps_per_epoch=3).dense.options["rank_low"] == 1
  config = Config(dataset="synthetic", dataset_kwargs={"num_train": 256, "num_test": 64},
                  num_sites=4, backend="shard_map", partition="dirichlet", alpha=0.3,
                  batch_per_site=8, steps=12, eval_every=12, model_kwargs={"hidden": [16]},
                  method="accordion_rank_dad(4, 1, window=2)")
  run = train(config, progress=False)
  states = jax.tree.leaves(run.state.model_state["dad_state"],
                           is_leaf=lambda x: isinstance(x, dict) and "critical" in x)
  layers = [s for s in states if isinstance(s, dict) and "critical" in s]
  assert layers
  for s in layers:
    for key in ("critical", "ref_norm", "norm", "windows", "rank_used"):
      values = np.asarray(s[key])
      assert np.all(values == values[0]), (key, values)
  assert np.isfinite(run.final["loss"])
  # The decisions reach the metrics rows, and the heat map reads them.
  row = run.history[-1]
  layers_in_row = sorted(k.split("/", 2)[2] for k in row if k.startswith("accordion/rank/"))
  assert layers_in_row == ["head", "hidden_0"]
  for layer in layers_in_row:
    state = run.state.model_state["dad_state"][layer]["dad"]
    uses = np.asarray(state["uses"])[0]
    assert row[f"accordion/rank/{layer}"] == round(float(np.asarray(state["rank_used"])[0]) / uses)
    assert row[f"accordion/rank/{layer}"] in (1, 4)
    assert row[f"accordion/critical/{layer}"] in (0, 1)
  steps, names, decided, _ = decision_matrix(run.history)
  assert names == ["hidden_0", "head"] or names == ["head", "hidden_0"]
  assert decided.shape == (2, len(run.history)) and set(np.unique(decided)) <= {0, 1}
  assert steps[-1] == 12
