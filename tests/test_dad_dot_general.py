"""dAD as an injected dot_general: user-written Flax layers with ``dot_general_cls``.

Exact dAD through :class:`dadjax.dad.DotGeneral` on a user's own linen
transformer block (``nn.MultiHeadDotProductAttention`` with
``qkv_dot_general_cls`` / ``out_dot_general_cls`` + an ``nn.Dense`` MLP) and
on ``nn.DenseGeneral(axis=(-2, -1))`` must equal pooled training (the
all-reduce of the plain model); rank-dAD must run on them; the ledger must
equal the bytes the compiled all-gathers move. Eight CPU devices
(tests/conftest.py).
"""

import dataclasses
import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dad
from dadjax.comm import hlo_collectives
from helpers import compiled_dad_step

SITES = 8
AXIS = "data"


class UserBlock(nn.Module):
  """A user's transformer block: Flax attention and an nn.Dense MLP, dot_general injectable."""

  dg: object = None

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm(name="ln")(x)
    h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_dot_general_cls=self.dg,
                                        out_dot_general_cls=self.dg, name="attn")(h)
    x = x + h
    h = nn.gelu(nn.Dense(12, dot_general_cls=self.dg, name="mlp_in")(x))
    x = x + nn.Dense(8, dot_general_cls=self.dg, name="mlp_out")(h)
    return nn.Dense(3, dot_general_cls=self.dg, name="head")(x.mean(axis=1))


class UserGeneral(nn.Module):
  """``DenseGeneral(axis=(-2, -1))`` on (batch, 3, 4) inputs, then a plain head."""

  dg: object = None

  @nn.compact
  def __call__(self, x):
    h = nn.DenseGeneral((2, 5), axis=(-2, -1), dot_general_cls=self.dg, name="general")(x)
    return nn.Dense(3, name="head")(jnp.tanh(h).reshape(h.shape[0], -1))


def _data(shape, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=shape).astype(np.float32),
          rng.integers(0, 3, shape[0]).astype(np.int32))


def _train(model, tx, x, y, backend, steps=2):
  step = dadjax.make_train_step(model, tx, num_sites=SITES if backend == "vmap" else None,
                                backend=backend)
  state = step.init(jax.random.key(0), x[: x.shape[0] // SITES])
  for _ in range(steps):
    state, _ = step(state, {"x": x, "y": y})
  return state


def _pooled_vs_dad(make, x, y, backend, **options):
  sgd = optax.sgd(0.5)
  ref = _train(make(None), optax.chain(dadjax.allreduce(AXIS), sgd), x, y, backend)
  model = make(functools.partial(dad.DotGeneral, **options))
  mask = dad.layer_mask(model, x[: x.shape[0] // SITES])
  got = _train(model, optax.chain(dad.synchronize(mask), sgd), x, y, backend)
  return ref, got, mask


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_exact_user_attention_block_equals_pooled(backend):
  x, y = _data((16, 4, 8))
  ref, got, mask = _pooled_vs_dad(UserBlock, x, y, backend)
  chex.assert_trees_all_close(dadjax.parallel.unstack_site(got.params),
                              dadjax.parallel.unstack_site(ref.params), atol=1e-5, rtol=1e-5)
  attn = mask["attn"]
  assert all(attn[n]["kernel"] for n in ("query", "key", "value", "out"))
  assert not any(attn[n]["bias"] for n in ("query", "key", "value", "out"))
  assert mask["mlp_in"]["kernel"] and not mask["mlp_in"]["bias"]
  assert not any(jax.tree.leaves(mask["ln"]))
  state = jax.tree.map(lambda v: np.asarray(v)[0], got.model_state["dad_state"])
  entry = state["attn"]["query"]["DotGeneral_0"]["dad_kernel"]
  assert int(entry["step"]) == 2 and float(entry["uses"]) == 1


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_exact_dense_general_two_axes_equals_pooled(backend):
  x, y = _data((16, 3, 4))
  ref, got, mask = _pooled_vs_dad(UserGeneral, x, y, backend)
  chex.assert_trees_all_close(dadjax.parallel.unstack_site(got.params),
                              dadjax.parallel.unstack_site(ref.params), atol=1e-5, rtol=1e-5)
  assert mask["general"]["kernel"] and not mask["general"]["bias"] and not mask["head"]["kernel"]
  # Ledger: the gather of [A, D] (2 rows x (12 + 10)) plus the all-reduce of the rest.
  stats = dadjax.comm_stats(got.opt_state)
  assert stats.gather_bits[0] == 2 * (12 + 10) * 32
  plan = dad.layer_plan(model := UserGeneral(dad.DotGeneral), x[:2], num_sites=SITES)
  del model
  assert [(p.path, p.route, p.rows, p.d_in, p.d_out) for p in plan] == [
      ("general", "gather", 2, 12, 10)]
  assert plan[0].gather_bits == stats.gather_bits[0] and plan[0].dense_bits == 12 * 10 * 32


@pytest.mark.parametrize("make, shape, options", [
    (UserBlock, (16, 4, 8), dict(mode="rank", rank=2, iters=2, warm_start=True,
                                 error_feedback=True)),
    (UserGeneral, (16, 3, 4), dict(mode="rank", rank=2, aggregation="two_way")),
])
def test_rank_dad_runs_on_user_layers(make, shape, options):
  x, y = _data(shape)
  model = make(functools.partial(dad.DotGeneral, **options))
  mask = dad.layer_mask(model, x[:2])
  state = _train(model, optax.chain(dad.synchronize(mask), optax.sgd(0.1)), x, y, "vmap",
                 steps=1)
  assert all(np.isfinite(np.asarray(v)).all() for v in jax.tree.leaves(state.params))
  ranks = dad.effective_ranks(state.model_state)
  assert ranks and all(0 < float(np.ravel(r)[0]) <= 2 for r in ranks.values())
  stats = dadjax.comm_stats(state.opt_state)
  assert stats.gather_bits[0] > 0


@pytest.mark.parametrize("power", ["deflated", "block"])
def test_rank_dad_vmap_equals_shard_map(power):
  x, y = _data((16, 3, 4))
  model = UserGeneral(functools.partial(dad.DotGeneral, mode="rank", rank=2, warm_start=True,
                                        power=power))
  mask = dad.layer_mask(model, x[:2])
  tx = optax.chain(dad.synchronize(mask), optax.sgd(0.1))
  a = _train(model, tx, x, y, "vmap")
  b = _train(model, tx, x, y, "shard_map")
  chex.assert_trees_all_close(dadjax.parallel.unstack_site(a.params),
                              dadjax.parallel.unstack_site(b.params), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [dict(mode="exact"), pytest.param(
    dict(mode="rank", rank=2, iters=2, aggregation="two_way"), marks=pytest.mark.slow)])
def test_compiled_gather_bytes_equal_ledger(options):
  rows = 2
  model = UserBlock(functools.partial(dad.DotGeneral, **options))
  x, y = _data((SITES * rows, 4, 8))
  compiled, stats = compiled_dad_step(model, x, y, rows, SITES, AXIS)
  ops = hlo_collectives(compiled.as_text())
  assert 8 * ops.nbytes["gather"] == stats.gather_bits[0]
  assert 8 * ops.nbytes["reduce"] == stats.reduce_bits[0]
  assert stats.gather_bits[0] > 0
  plan = dad.layer_plan(model, x[:rows], num_sites=SITES)
  assert {p.path for p in plan} == {"attn/query", "attn/key", "attn/value", "attn/out",
                                    "mlp_in", "mlp_out", "head"}
  assert sum(p.gather_bits for p in plan) == stats.gather_bits[0]


def test_method_factory_offers_dot_general_with_mask():
  x, _ = _data((2, 4, 8))
  tx, factory = dad.get_method("rank_dad:2:warm")
  del tx
  model = UserBlock(factory.dot_general_cls)
  variables = model.init(jax.random.key(0), x)
  assert factory.mask(variables["params"]) == dad.layer_mask(variables)
  entry = variables["dad_state"]["mlp_in"]["DotGeneral_0"]["dad_kernel"]
  assert entry["basis"].shape == (12, 2)  # warm start from the method's options
  assert not factory.paths and ("attn", "out", "kernel") in factory.kernels


def test_einsum_and_batch_axes_equal_lax():
  # The einsum form and batch axes (one kernel per entry) give dot_general's values and
  # gradients; a batched kernel's state carries the batch axis.
  class Mixed(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = self.param("kernel", nn.initializers.normal(), (8, 2, 3))
      h = dad.DotGeneral(axis_name=None)("btd,dhk->bthk", x, k)
      g = nn.DenseGeneral(5, batch_dims=(0,), axis=-1, dot_general_cls=functools.partial(
          dad.DotGeneral, axis_name=None), name="per_token")
      return g(jnp.swapaxes(h.reshape(h.shape[:2] + (6,)), 0, 1))

  class Plain(nn.Module):
    @nn.compact
    def __call__(self, x):
      k = self.param("kernel", nn.initializers.normal(), (8, 2, 3))
      h = jnp.einsum("btd,dhk->bthk", x, k)
      g = nn.DenseGeneral(5, batch_dims=(0,), axis=-1, name="per_token")
      return g(jnp.swapaxes(h.reshape(h.shape[:2] + (6,)), 0, 1))

  x, _ = _data((2, 4, 8))
  v = Mixed().init(jax.random.key(0), x)
  assert v["dad_state"]["per_token"]["DotGeneral_0"]["dad_kernel"]["uses"].shape == (4,)
  params = v["params"]
  loss = lambda m, p, s: jnp.sum(jnp.sin(m.apply({"params": p, **s}, x)))
  state = {"dad_state": v["dad_state"]}
  chex.assert_trees_all_close(jax.grad(loss, argnums=1)(Mixed(), params, state),
                              jax.grad(loss, argnums=1)(Plain(), params, {}), atol=1e-5)
  mask = dad.layer_mask(v)
  assert mask["kernel"] and mask["per_token"]["kernel"] and not mask["per_token"]["bias"]
  with pytest.raises(ValueError, match="einsum"):
    dad.DotGeneral(axis_name=None).apply({}, "btd,dhk", x, params["kernel"])


# One valid, non-default value of every DadConfig field (with the fields it needs).
_OPTION_EXAMPLES = {
    "axis_name": dict(axis_name="sites"),
    "mode": dict(mode="rank"),
    "rank": dict(rank=2),
    "iters": dict(iters=3),
    "tol": dict(tol=0.5),
    "aggregation": dict(mode="rank", aggregation="two_way"),
    "warm_start": dict(mode="rank", warm_start=True),
    "error_feedback": dict(mode="rank", error_feedback=True),
    "seed": dict(seed=5),
    "precision": dict(precision=jax.lax.Precision.HIGHEST),
    "rank_low": dict(mode="rank", rank=4, rank_low=2),
    "accordion_window": dict(accordion_window=3),
    "accordion_interval": dict(accordion_interval=2),
    "accordion_eta": dict(accordion_eta=0.25),
    "lr_schedule": dict(lr_schedule=optax.constant_schedule(0.1)),
    "quantize_bits": dict(quantize_bits=4),
    "power": dict(mode="rank", power="block"),
    "bucket": dict(bucket=True),
}


def test_every_dad_config_field_is_a_keyword_option_of_every_layer():
  # The options are written once (DadConfig); each layer takes them by keyword, so a new
  # field is an option of dad.Dense, dad.DotGeneral and dad.NnxDotGeneral without a line there.
  fields = [f.name for f in dataclasses.fields(dad.DadConfig)]
  assert sorted(_OPTION_EXAMPLES) == sorted(fields)
  for name, options in _OPTION_EXAMPLES.items():
    want = dad.DadConfig(**options)
    assert dad.DotGeneral(**options).config == want, name
    assert dad.NnxDotGeneral(**options, shape=(3, 2)).config == want, name
    dense = dad.Dense(4, **options)
    if name == "precision":  # nn.Dense's own field, and the route's matmul precision
      assert dense.precision == options["precision"] and dense.config == dad.DadConfig()
    else:
      assert dense.config == want, name
  base = dad.DadConfig(mode="rank", rank=3)
  assert dad.DotGeneral(config=base, rank=2).config == dad.DadConfig(mode="rank", rank=2)
  for make in (dad.DotGeneral, functools.partial(dad.Dense, 4), dad.NnxDotGeneral):
    with pytest.raises(TypeError):
      make(not_an_option=1)
    with pytest.raises(ValueError, match="rank must be"):
      make(rank=0)
