"""dAD layer state: the int32 ``step`` counter is read by the layer and owned by the train step."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dad
from dadjax._core.keys import start_key

SITES, AXIS = 4, "data"
BIG = 2**24 + 1  # float32 cannot hold it (float32(2**24 + 1) == 2**24)


class _TwoHeads(nn.Module):
  """A shared trunk and two rank-dAD heads; ``use_b=False`` computes head B but discards it."""

  use_b: bool = True

  @nn.compact
  def __call__(self, x, train=False):
    del train
    dense = functools.partial(dad.Dense, axis_name=AXIS, mode="rank", rank=1, warm_start=True)
    h = nn.tanh(dense(8, name="trunk")(x))
    a = dense(3, name="head_a")(h)
    b = dense(3, name="head_b")(h)
    return a + b if self.use_b else a


def _steps(state):
  tree = state.model_state["dad_state"]
  out = {}
  for name, layer in tree.items():
    step = layer["dad"]["step"]
    assert step.dtype == jnp.int32, (name, step.dtype)
    values = np.asarray(jax.device_get(step))
    assert values.shape == (SITES,) and np.all(values == values[0]), (name, values)
    out[name] = int(values[0])
  return out


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_step_counter_is_int32_advances_once_per_step_and_counts_past_2_24(backend):
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(SITES * 4, 6)).astype(np.float32),
           "y": rng.integers(0, 3, SITES * 4).astype(np.int32)}
  both, only_a = _TwoHeads(), _TwoHeads(use_b=False)
  tx = optax.chain(dad.synchronize(dad.layer_mask(both, batch["x"][:4])), optax.sgd(0.1))
  step_both = dadjax.make_train_step(both, tx, num_sites=SITES, backend=backend)
  step_a = dadjax.make_train_step(only_a, tx, num_sites=SITES, backend=backend)
  state = step_both.init(jax.random.key(0), batch["x"][:4])
  assert _steps(state) == {"trunk": 0, "head_a": 0, "head_b": 0}
  state, _ = step_both(state, batch)
  assert _steps(state) == {"trunk": 1, "head_a": 1, "head_b": 1}
  # Past float32's exact range: trunk and head B at 2**24 + 1, head A as it is.
  dad_state = dict(state.model_state["dad_state"])
  for name in ("trunk", "head_b"):
    layer = dict(dad_state[name]["dad"])
    layer["step"] = layer["step"] + (BIG - 1)
    dad_state[name] = {"dad": layer}
  state = state._replace(model_state={**state.model_state, "dad_state": dad_state})
  kept_b = jax.device_get(dad_state["head_b"]["dad"])
  state, _ = step_a(state, batch)  # head B computed but off the loss's path: no cotangent
  assert _steps(state) == {"trunk": BIG + 1, "head_a": 2, "head_b": BIG}
  got_b = jax.device_get(state.model_state["dad_state"]["head_b"]["dad"])
  jax.tree.map(np.testing.assert_array_equal, got_b, kept_b)  # the whole state kept
  state, _ = step_both(state, batch)
  assert _steps(state) == {"trunk": BIG + 2, "head_a": 3, "head_b": BIG + 1}


def _rank_one_grad(config, a, d, step):
  """One site's rank-dAD kernel gradient at ``step`` (``d`` fed as the output cotangent)."""
  state = {**dad.init_state(config, a.shape[1], d.shape[1]), "uses": jnp.float32(1),
           "step": jnp.asarray(step, jnp.int32)}
  kernel = jnp.zeros((a.shape[1], d.shape[1]))
  _, vjp = jax.vjp(lambda k, s: dad.dense(a, k, None, s, config=config), kernel, state)
  gk, ct = vjp(d)
  assert ct["step"].dtype == jax.dtypes.float0  # the layer never writes its counter
  return gk


def test_rank_dad_start_key_holds_the_int_step():
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)
  d = jnp.asarray(rng.normal(size=(6, 4)), jnp.float32)
  # One power iteration from the random start: the result depends on the key.
  config = dad.DadConfig(axis_name=None, mode="rank", rank=1, iters=1, tol=0.0, seed=7)
  grad = jax.jit(functools.partial(_rank_one_grad, config))
  run = lambda a, d, step: np.asarray(grad(a, d, step))
  for step in (0, 5, BIG):
    key_local = start_key(7, step, "rank_dad/local")
    fac = dad.factorize(a, d, rank=1, iters=1, tol=0.0, key=key_local)
    np.testing.assert_allclose(run(a, d, step), np.asarray(fac.u @ fac.v.T), rtol=1e-5,
                               atol=1e-6)
  # Steps one apart draw different starts, also where float32 would merge them.
  for step in (5, BIG - 1):
    assert np.abs(run(a, d, step) - run(a, d, step + 1)).max() > 1e-4, step


def test_int_counter_survives_a_checkpoint_resume(tmp_path):
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  small = dict(steps=4, eval_every=2, batch_per_site=8, num_sites=SITES, backend="vmap",
               model_kwargs={"hidden": [16]}, method="rank_dad:2:warm")
  uninterrupted = train(Config(**small), progress=False)
  ckpt = str(tmp_path / "ckpt")
  train(Config(**{**small, "steps": 2}, checkpoint_dir=ckpt, checkpoint_every=2), progress=False)
  resumed = train(Config(**small, checkpoint_dir=ckpt, checkpoint_every=2), progress=False)
  for run in (uninterrupted, resumed):
    for layer in run.state.model_state["dad_state"].values():
      assert layer["dad"]["step"].dtype == jnp.int32
      np.testing.assert_array_equal(np.asarray(layer["dad"]["step"]), 4)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.model_state),
               jax.device_get(uninterrupted.state.model_state))
  jax.tree.map(np.testing.assert_array_equal, resumed.params, uninterrupted.params)
