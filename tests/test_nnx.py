"""Flax NNX models through the train step (dadjax.nnx.Model) and dAD for NNX layers.

An NNX MLP and an NNX attention block train with allreduce, ``powersgd:2``
and exact dAD exactly as their linen twins (same parameters, same method):
same parameters after the steps, same ledger.
"""

import functools
import warnings

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dadjax
import dadjax.nnx as dnx
from dadjax import dad
from dadjax.parallel import stack_sites

SITES = 8
AXIS = "data"

warnings.filterwarnings("ignore", category=DeprecationWarning, module="flax")


class NnxMLP(nnx.Module):

  def __init__(self, rngs):
    self.l1 = nnx.Linear(6, 5, rngs=rngs)
    self.l2 = nnx.Linear(5, 3, rngs=rngs)

  def __call__(self, x):
    return self.l2(nnx.tanh(self.l1(x)))


class LinenMLP(nn.Module):
  dg: object = None

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(5, dot_general_cls=self.dg, name="l1")(x)
    return nn.Dense(3, dot_general_cls=self.dg, name="l2")(jnp.tanh(h))


class NnxBlock(nnx.Module):

  def __init__(self, rngs):
    self.ln = nnx.LayerNorm(8, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, 8, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(8, 12, rngs=rngs)
    self.head = nnx.Linear(12, 3, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.ln(x))
    return self.head(nnx.gelu(self.mlp(x)).mean(axis=1))


class LinenBlock(nn.Module):
  dg: object = None

  @nn.compact
  def __call__(self, x):
    x = x + nn.MultiHeadDotProductAttention(2, qkv_dot_general_cls=self.dg,
                                            out_dot_general_cls=self.dg,
                                            name="attn")(nn.LayerNorm(name="ln")(x))
    h = nn.gelu(nn.Dense(12, dot_general_cls=self.dg, name="mlp")(x))
    return nn.Dense(3, dot_general_cls=self.dg, name="head")(h.mean(axis=1))


def _data(shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape).astype(np.float32),
          rng.integers(0, 3, shape[0]).astype(np.int32))


def _tx(method, variables):
  if method == "allreduce":
    first = dadjax.allreduce(AXIS)
  elif method == "powersgd:2":
    first = dadjax.compress.compressed(dadjax.compress.get_compressor("powersgd:2"),
                                       axis_name=AXIS)
  else:
    first = dad.synchronize(dad.layer_mask(variables))
  return optax.chain(first, optax.sgd(0.3))


def _train(model, method, x, y, params=None, steps=2):
  variables = model.init(jax.random.key(0), x[:2])
  step = dadjax.make_train_step(model, _tx(method, variables), num_sites=SITES, backend="vmap")
  state = step.init(jax.random.key(0), x[:2])
  if params is not None:  # the linen twin starts from the NNX parameters
    assert jax.tree.structure(params) == jax.tree.structure(step.params(state))
    state = state._replace(params=step.place(stack_sites(params, SITES)))
  for _ in range(steps):
    state, metrics = step(state, {"x": x, "y": y})
  return step, state, metrics


@pytest.mark.parametrize("method", ["allreduce", "powersgd:2", "dad"])
@pytest.mark.parametrize("nnx_cls, linen_cls, shape", [(NnxMLP, LinenMLP, (16, 6)),
                                                       (NnxBlock, LinenBlock, (16, 4, 8))])
def test_nnx_trains_like_its_linen_twin(method, nnx_cls, linen_cls, shape):
  x, y = _data(shape)
  module = nnx_cls(nnx.Rngs(0))
  if method == "dad":
    dnx.inject(module, mode="exact")
  model = dnx.Model(module)
  step, state, metrics = _train(model, method, x, y)
  twin = linen_cls(dad.DotGeneral if method == "dad" else None)
  params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  _, ref, ref_metrics = _train(twin, method, x, y, params=params)
  chex.assert_trees_all_close(step.params(state), step.params(ref), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(metrics["loss"], ref_metrics["loss"], rtol=1e-5)
  got, want = dadjax.comm_stats(state.opt_state), dadjax.comm_stats(ref.opt_state)
  assert got.bits_per_step == want.bits_per_step > 0
  if method == "dad":
    assert got.gather_bits == want.gather_bits and got.gather_bits[0] > 0
    entry = jax.tree.leaves(state.model_state["dad_state"])
    assert entry  # the layers' "dad_state" rides the step's model state


def test_nnx_linear_dot_general_and_collections():
  # nnx.Linear(..., dot_general=DotGeneral()) directly; BatchNorm maps onto "batch_stats",
  # Dropout's RNG stream is reseeded per step and site.
  class Net(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(6, 5, dot_general=dnx.DotGeneral(mode="rank", rank=2), rngs=rngs)
      self.bn = nnx.BatchNorm(5, rngs=rngs)
      self.drop = nnx.Dropout(0.5, rngs=rngs)
      self.l2 = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.drop(self.bn(nnx.tanh(self.l1(x)))))

  x, y = _data((16, 6))
  model = dnx.Model(Net(nnx.Rngs(0, dropout=1)))
  variables = model.init(jax.random.key(0), x[:2])
  assert set(variables) == {"params", "dad_state", "batch_stats"}
  mask = dad.layer_mask(variables)
  assert mask["l1"]["kernel"] and not mask["l1"]["bias"] and not mask["l2"]["kernel"]
  step, state, _ = _train(model, "dad", x, y)
  stats = jax.tree.map(lambda v: np.asarray(v), state.model_state["batch_stats"])
  assert not np.allclose(stats["bn"]["mean"], 0)  # updated, then averaged over sites
  np.testing.assert_allclose(stats["bn"]["mean"][0], stats["bn"]["mean"][1])
  entry = jax.tree.map(np.asarray, state.model_state["dad_state"]["l1"]["dot_general"]
                       ["dad_kernel"])
  assert int(entry["step"][0]) == 2 and 0 < float(entry["rank"][0]) <= 2
  evaluated = step.evaluate(state, {"x": x, "y": y})  # train=False: eval mode, no rng
  assert np.isfinite(np.asarray(evaluated["loss"])).all()
  with pytest.raises(ValueError, match="shape"):
    dnx.DotGeneral(mode="rank", warm_start=True)
  with pytest.raises(ValueError, match="nnx.Module"):
    dnx.Model(LinenMLP())
