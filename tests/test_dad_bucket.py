"""Exact dAD with one all-gather per backward pass (``dad:bucket``, :mod:`dadjax.dad._bucket`)."""

from __future__ import annotations

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import dad
from dadjax.comm import hlo_collectives
from dadjax.parallel import local_gradients, softmax_cross_entropy, unstack_site

SITES = 8
AXIS = "data"


class Mixed(nn.Module):
  """dAD Dense layers (one applied twice), attention and DenseGeneral through dot_general."""

  dense: object
  dg: object

  @nn.compact
  def __call__(self, x):
    h = nn.relu(self.dense(16, name="first")(x))                  # (b, t, 16)
    shared = self.dense(16, name="shared")
    h = h + nn.relu(shared(nn.relu(shared(h))))                   # applied twice
    h = h + nn.MultiHeadDotProductAttention(2, qkv_dot_general_cls=self.dg,
                                            out_dot_general_cls=self.dg, name="attn")(h)
    h = nn.DenseGeneral((2, 4), dot_general_cls=self.dg, name="general")(h)
    h = nn.DenseGeneral(5, batch_dims=(0,), axis=-1, dot_general_cls=self.dg,
                        name="per_token")(jnp.swapaxes(h.reshape(h.shape[:2] + (8,)), 0, 1))
    return nn.Dense(3, dot_general_cls=self.dg, name="head")(jnp.swapaxes(h, 0, 1).mean(1))


class Cell(nn.Module):
  dense: object

  @nn.compact
  def __call__(self, h, _):
    return jnp.tanh(self.dense(8, name="cell")(h)), None


class Scanned(nn.Module):
  """A dAD layer under ``nn.scan``; ``carry_bucket`` puts ``"dad_bucket"`` in its axes."""

  dense: object
  carry_bucket: bool = False

  @nn.compact
  def __call__(self, x):
    axes = {"comm": 0, **({"dad_bucket": 0} if self.carry_bucket else {})}
    scan = nn.scan(Cell, variable_broadcast="params", variable_axes=axes,
                   split_rngs={"params": False}, length=3)
    h, _ = scan(self.dense, name="scan")(self.dense(8, name="inp")(x), None)
    return self.dense(3, name="head")(h)


def _data(shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape).astype(np.float32),
          rng.integers(0, 3, shape[0]).astype(np.int32))


def _build(spec, make):
  tx, factory = dad.get_method(spec)
  return make(factory), optax.chain(tx, optax.sgd(0.3))


def _train(spec, make, x, y, backend, steps):
  model, tx = _build(spec, make)
  step = dadjax.make_train_step(model, tx, num_sites=SITES if backend == "vmap" else None,
                                backend=backend)
  state = step.init(jax.random.key(0), x[: x.shape[0] // SITES])
  for _ in range(steps):
    state, _ = step(state, {"x": x, "y": y})
  return state, step


def _mixed(factory):
  return Mixed(factory, factory.dot_general_cls)


@pytest.mark.parametrize("backend", [pytest.param("vmap", marks=pytest.mark.slow), "shard_map"])
def test_bucket_equals_per_layer_dad_and_pooled_after_20_steps(backend):
  # The same products A^T D, formed after the backward pass instead of inside it.
  x, y = _data((16, 4, 6))
  plain, _ = _train("dad", _mixed, x, y, backend, 20)
  bucket, _ = _train("dad:bucket", _mixed, x, y, backend, 20)
  chex.assert_trees_all_close(unstack_site(bucket.params), unstack_site(plain.params),
                              atol=2e-5, rtol=2e-5)
  if backend == "vmap":  # and the all-reduce of every gradient (per-layer dAD's own tests: both)
    pooled, _ = _train("local_dad", _mixed, x, y, backend, 20)
    chex.assert_trees_all_close(unstack_site(bucket.params), unstack_site(pooled.params),
                                atol=2e-5, rtol=2e-5)
  # the ledger books the same payload: n (d_in + d_out) numbers per layer call
  assert (dadjax.comm_stats(bucket.opt_state).gather_bits
          == dadjax.comm_stats(plain.opt_state).gather_bits)


def test_bucket_compiles_to_one_gather_and_the_ledger_equals_its_bytes():
  x, y = _data((16, 4, 6))
  plain, plain_step = _train("dad", _mixed, x, y, "shard_map", 1)
  bucket, step = _train("dad:bucket", _mixed, x, y, "shard_map", 1)
  batch = {"x": x, "y": y}
  layers = plain_step.collectives(plain, batch).count["gather"]
  assert layers == 10  # first, shared twice, q/k/v/out, general, per_token, head
  ops = step.collectives(bucket, batch)
  assert ops.count["gather"] == 1
  stats = dadjax.comm_stats(bucket.opt_state)
  assert 8 * ops.nbytes["gather"] == stats.gather_bits[0]
  assert stats.gather_calls == 1 and dadjax.comm_stats(plain.opt_state).gather_calls == 10


@pytest.mark.parametrize("carry_bucket, gathers", [(False, 2), (True, 1)])
def test_scanned_layer_joins_the_bucket_only_when_scan_carries_it(carry_bucket, gathers):
  # Without "dad_bucket" in the scan's variable_axes the cell takes its own route
  # (one gather in the loop body); with it, the cell's T calls join the one gather.
  x, y = _data((16, 6))
  make = functools.partial(Scanned, carry_bucket=carry_bucket)
  plain, _ = _train("dad", make, x, y, "shard_map", 3)
  bucket, step = _train("dad:bucket", make, x, y, "shard_map", 3)
  chex.assert_trees_all_close(unstack_site(bucket.params), unstack_site(plain.params),
                              atol=2e-5, rtol=2e-5)
  assert step.collectives(bucket, {"x": x, "y": y}).count["gather"] == gathers


def test_bucket_with_replicated_kernels_in_a_users_shard_map():
  # P() parameters under shard_map(check_vma=True): JAX sums the sites' contributions,
  # and the bucketed gradient (gathered typed invariant) matches jax.grad of nn.Dense.
  class Net(nn.Module):
    dense: object

    @nn.compact
    def __call__(self, x):
      return self.dense(3, name="out")(jnp.tanh(self.dense(8, name="hid")(x)))

  x, y = _data((SITES * 2, 5))
  factory = dad.DenseFactory(bucket=True)
  model = Net(factory)
  variables = dict(model.init(jax.random.key(0), x[:2]))
  params = variables.pop("params")
  mesh = dadjax.make_mesh(SITES, AXIS)

  def dad_grads(params, variables, x, y):
    return local_gradients(model, softmax_cross_entropy, params, variables,
                           {"x": x, "y": y}).grads

  def ref_grads(params, x, y):
    plain = Net(lambda features, name: nn.Dense(features, name=name))
    loss = lambda p: softmax_cross_entropy(plain.apply({"params": p}, x), y)
    return jax.grad(loss)(params)

  got = jax.jit(jax.shard_map(dad_grads, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                              out_specs=P()))(params, variables, x, y)
  want = jax.jit(jax.shard_map(ref_grads, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS)),
                               out_specs=P()))(params, x, y)
  chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-5)


def test_bucket_outside_the_step_is_plain_exact_dad():
  # Differentiating model.apply directly (no bucketed pass traced) takes each
  # layer's own route: the gradient is the same.
  x, y = _data((SITES * 2, 5))
  layer = dad.Dense(4, axis_name=AXIS, bucket=True)
  variables = layer.init(jax.random.key(0), x[:2])
  assert "dad_bucket" in variables and "dad_state" not in variables

  def grads(mode_bucket, x):
    model = dad.Dense(4, axis_name=AXIS, bucket=mode_bucket)
    return jax.grad(lambda p: model.apply({"params": p}, x).sum())(variables["params"])

  xs = x.reshape(SITES, 2, 5)
  got = jax.vmap(functools.partial(grads, True), axis_name=AXIS)(xs)
  want = jax.vmap(functools.partial(grads, False), axis_name=AXIS)(xs)
  chex.assert_trees_all_close(got, want, atol=1e-6)


def test_bucket_bf16_layers_gather_one_buffer():
  x, y = _data((16, 6))
  make = lambda factory: Scanned(factory, carry_bucket=True)
  tx, factory = dad.get_method("dad:bucket")
  factory.options.update(dtype=jnp.bfloat16)
  step = dadjax.make_train_step(make(factory), optax.chain(tx, optax.sgd(0.1)))
  state = step.init(jax.random.key(0), x[:2])
  state, metrics = step(state, {"x": x, "y": y})
  assert np.isfinite(np.asarray(metrics["loss"])).all()
  assert step.collectives(state, {"x": x, "y": y}).count["gather"] == 1
  # XLA:CPU widens 16-bit collectives when it compiles: compare the traced program
  check = step.ledger_check(state, {"x": x, "y": y})
  assert check["program_bits"] == check["booked_bits"]


@pytest.mark.parametrize("options, match", [
    (dict(mode="rank", bucket=True), "bucket applies to mode='exact'"),
    (dict(quantize_bits=4, bucket=True), "bucket applies to mode='exact'"),
    (dict(bucket=1), "bucket must be a bool"),
])
def test_bucket_bad_options_name_the_argument(options, match):
  with pytest.raises(ValueError, match=match):
    dad.DadConfig(**options)


def test_bucket_spec():
  _, factory = dad.get_method("dad:bucket")
  assert factory.options["bucket"] is True
  with pytest.raises(ValueError, match="bucket"):
    dad.get_method("rank_dad:2:bucket")


@pytest.mark.slow  # suite time; the one-level bucket tests run by default
def test_bucket_on_a_two_level_mesh_with_fsdp_equals_per_layer_dad():
  # Sites of 4 devices each (rows split within a site, parameters FSDP-sharded):
  # the bucket gathers over the site axis only, the step averages within the site.
  x, y = _data((16, 4, 6))

  def train(spec):
    model, tx = _build(spec, _mixed)
    step = dadjax.make_train_step(model, tx, mesh=dadjax.make_mesh(sites=2, per_site=4),
                                  shard_params=True)
    state = step.init(jax.random.key(0), x[:2])
    for _ in range(3):
      state, _ = step(state, {"x": x, "y": y})
    return state

  chex.assert_trees_all_close(jax.device_get(train("dad:bucket").params),
                              jax.device_get(train("dad").params), atol=2e-5, rtol=2e-5)
