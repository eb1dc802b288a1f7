"""Flax NNX models through the train step (dadjax.nnx.Model) and dAD for NNX layers.

An NNX MLP and an NNX attention block train with allreduce, ``powersgd:2``
and exact dAD exactly as their linen twins (same parameters, same method):
same parameters after the steps, same ledger.
"""

import functools
import json
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


def _train(model, method, x, y, backend, params=None, steps=2):
  # an nnx.Module goes to make_train_step as it is; the mask reads its variables
  variables = (dnx.Model(model) if isinstance(model, nnx.Module) else model).init(
      jax.random.key(0), x[:2])
  tx = _tx(method, variables) if isinstance(method, str) else method
  step = dadjax.make_train_step(model, tx, num_sites=SITES, backend=backend)
  state = step.init(jax.random.key(0), x[:2])
  if params is not None:  # the linen twin starts from the NNX parameters
    assert jax.tree.structure(params) == jax.tree.structure(step.params(state))
    state = state._replace(params=step.place(stack_sites(params, SITES)))
  for _ in range(steps):
    state, metrics = step(state, {"x": x, "y": y})
  return step, state, metrics


def _twins():
  """Every (model pair, method, backend); the block's PowerSGD under shard_map compiles for
  half a minute on a loaded CPU, so it runs with -m slow (its vmap twin runs by default)."""
  for nnx_cls, linen_cls, shape in ((NnxMLP, LinenMLP, (16, 6)),
                                    (NnxBlock, LinenBlock, (16, 4, 8))):
    for method in ("allreduce", "powersgd:2", "dad"):
      for backend in ("vmap", "shard_map"):
        slow = nnx_cls is NnxBlock and method == "powersgd:2" and backend == "shard_map"
        yield pytest.param(method, nnx_cls, linen_cls, shape, backend,
                           marks=[pytest.mark.slow] if slow else [],
                           id=f"{nnx_cls.__name__}-{method}-{backend}")


@pytest.mark.parametrize("method, nnx_cls, linen_cls, shape, backend", list(_twins()))
def test_nnx_trains_like_its_linen_twin(method, nnx_cls, linen_cls, shape, backend):
  x, y = _data(shape)
  module = nnx_cls(nnx.Rngs(0))
  if method == "dad":
    dad.inject(module, mode="exact")
  step, state, metrics = _train(module, method, x, y, backend)  # the nnx.Module itself
  assert isinstance(step.model, dnx.Model)
  twin = linen_cls(dad.DotGeneral if method == "dad" else None)
  params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  _, ref, ref_metrics = _train(twin, method, x, y, backend, params=params)
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
      self.l1 = nnx.Linear(6, 5, dot_general=dad.NnxDotGeneral(mode="rank", rank=2), rngs=rngs)
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
  step, state, _ = _train(model, "dad", x, y, "vmap")
  stats = jax.tree.map(lambda v: np.asarray(v), state.model_state["batch_stats"])
  assert not np.allclose(stats["bn"]["mean"], 0)  # updated, then averaged over sites
  np.testing.assert_allclose(stats["bn"]["mean"][0], stats["bn"]["mean"][1])
  entry = jax.tree.map(np.asarray, state.model_state["dad_state"]["l1"]["dot_general"]
                       ["dad_kernel"])
  assert int(entry["step"][0]) == 2 and 0 < float(entry["rank"][0]) <= 2
  evaluated = step.evaluate(state, {"x": x, "y": y})  # train=False: eval mode, no rng
  assert np.isfinite(np.asarray(evaluated["loss"])).all()
  with pytest.raises(ValueError, match="shape"):
    dad.NnxDotGeneral(mode="rank", warm_start=True)
  with pytest.raises(ValueError, match="nnx.Module"):
    dnx.Model(LinenMLP())


class NnxNet(nnx.Module):
  """A user's NNX classifier, by import path: ``model=test_nnx:NnxNet``."""

  def __init__(self, in_features: int, hidden: int, num_classes: int, *, rngs: nnx.Rngs):
    self.l1 = nnx.Linear(in_features, hidden, rngs=rngs)
    self.drop = nnx.Dropout(0.2, rngs=rngs)
    self.l2 = nnx.Linear(hidden, num_classes, rngs=rngs)

  def __call__(self, x):
    return self.l2(self.drop(nnx.relu(self.l1(x.reshape(x.shape[0], -1)))))


def test_dadjax_train_takes_an_nnx_class_by_import_path(capsys):
  from dadjax import cli, models  # pylint: disable=g-import-not-at-top
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.errors import ConfigError  # pylint: disable=g-import-not-at-top
  from dadjax.train import build, local_optimizer, train  # pylint: disable=g-import-not-at-top
  kw = {"in_features": 64, "hidden": 8}
  config = Config(model="test_nnx:NnxNet", model_kwargs=kw, num_sites=4, batch_per_site=4,
                  steps=3, eval_every=3, backend="shard_map", seed=3)
  run = train(config, progress=False)
  # The same run by hand: the class built by the convention rngs=nnx.Rngs(seed, dropout=seed),
  # the nnx.Module itself into make_train_step, the loop's batches.
  net = NnxNet(**kw, num_classes=10, rngs=nnx.Rngs(3, dropout=3))
  step = dadjax.make_train_step(net, optax.chain(dadjax.allreduce(AXIS), local_optimizer(config)),
                                num_sites=4)
  batcher = build(config)[2]
  state = step.init(jax.random.key(3), np.zeros((4, 8, 8, 1), np.float32))
  for t in range(3):
    bx, by = batcher.batch_at(t)
    state, _ = step(state, {"x": bx, "y": by})
  chex.assert_trees_all_equal(run.params, step.params(state))
  assert np.isfinite(run.final["test_loss"])
  assert models.model_fields(NnxNet) == ["in_features", "hidden", "num_classes"]
  # From the command line, model_kwargs checked against the class's __init__.
  assert cli.main(["train", "--no-progress", "model=test_nnx:NnxNet",
                   'model_kwargs={"in_features": 64, "hidden": 4}', "steps=1", "eval_every=1",
                   "num_sites=2", "batch_per_site=4", "backend=vmap"]) == 0
  assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 1
  with pytest.raises(ConfigError, match=r"config.model_kwargs.*'width'.*in_features"):
    train(config.replace(model_kwargs={**kw, "width": 3}), progress=False)
  # A dAD method gives the class's layers dAD (dadjax.dad.inject_method): exact dAD's gradient
  # is the pooled one, so the run ends where the all-reduce's does, its layers gathering.
  dad_run = train(config.replace(method="dad"), progress=False)
  chex.assert_trees_all_close(dad_run.params, run.params, atol=1e-5, rtol=1e-5)
  assert jax.tree.leaves(dad_run.state.model_state["dad_state"])
  assert dadjax.comm_stats(dad_run.state.opt_state).gather_bits[0] > 0


def test_nnx_bucket_books_the_linen_bucket_and_equals_allreduce():
  # dad:bucket through the one layer route: the NNX layers join the step's one gather per
  # backward pass (not one per layer), book what linen's bucket books, and train as the
  # all-reduce of every gradient does.
  x, y = _data((16, 6))
  batch = {"x": x, "y": y}

  def bucket_tx():
    tx, factory = dad.get_method("dad:bucket")
    return optax.chain(tx, optax.sgd(0.3)), factory

  tx, factory = bucket_tx()
  module = dad.inject_method(NnxMLP(nnx.Rngs(0)), factory)
  step, state, _ = _train(module, tx, x, y, "shard_map", steps=1)
  params = nnx.to_pure_dict(nnx.state(module, nnx.Param))
  tx, factory = bucket_tx()
  twin_step, twin, _ = _train(LinenMLP(factory.dot_general_cls), tx, x, y, "shard_map",
                              params=params, steps=1)
  _, pooled, _ = _train(NnxMLP(nnx.Rngs(0)), "allreduce", x, y, "shard_map", steps=1)
  chex.assert_trees_all_close(step.params(state), step.params(pooled), atol=1e-5, rtol=1e-5)
  chex.assert_trees_all_close(step.params(state), twin_step.params(twin), atol=1e-5, rtol=1e-5)
  got, want = dadjax.comm_stats(state.opt_state), dadjax.comm_stats(twin.opt_state)
  assert got.gather_bits == want.gather_bits and got.gather_bits[0] > 0
  assert got.bits_per_step == want.bits_per_step and got.gather_calls == want.gather_calls == 1
  ops, twin_ops = step.collectives(state, batch), twin_step.collectives(twin, batch)
  assert ops.count == twin_ops.count and ops.count["gather"] == 1
  assert 8 * ops.nbytes["gather"] == got.gather_bits[0]


def test_nnx_refuses_rank_low_with_batch_axes_as_linen_does():
  options = dict(mode="rank", rank=2, rank_low=1)
  x = jnp.ones((4, 3, 6))
  linen = nn.DenseGeneral(5, batch_dims=(0,), axis=-1,
                          dot_general_cls=functools.partial(dad.DotGeneral, **options))
  with pytest.raises(ValueError, match="rank_low") as linen_error:
    linen.init(jax.random.key(0), x)
  layer = dad.inject(nnx.LinearGeneral(6, 5, axis=-1, batch_axis={0: 4}, rngs=nnx.Rngs(0)),
                     **options)
  with pytest.raises(ValueError, match="rank_low") as nnx_error:
    layer(x)
  assert str(nnx_error.value) == str(linen_error.value)


def test_the_nnx_adapter_knows_no_family():
  # dadjax.nnx.Model takes its collections from the registered rules and Flax's name
  # registry; the dAD layer for NNX lives in dadjax.dad.
  import ast  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  source = pathlib.Path(dnx.__file__).read_text()
  imported = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom):
      imported.add(node.module or "")
    elif isinstance(node, ast.Import):
      imported.update(alias.name for alias in node.names)
  families = tuple(f"dadjax.{f}" for f in ("dad", "compress", "dataquant", "local", "adaptive"))
  assert not [m for m in imported if m.startswith(families)]
  assert "dad_state" not in source
  assert dnx.__all__ == ["Model"]
  # the old NNX dAD names resolve to dadjax.dad's, with a warning
  with pytest.warns(DeprecationWarning, match="moved to dadjax.dad.NnxDotGeneral"):
    assert dnx.DotGeneral is dad.NnxDotGeneral
  with pytest.warns(DeprecationWarning):
    assert dnx.inject is dad.inject
