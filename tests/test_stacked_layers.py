"""Leaves stacked by nn.scan are L tensors for every communicating transformation."""
import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax.methods import build_method

LAYERS, WIDTH, ROWS = 3, 16, 16


def _init(names):
  return nn.with_partitioning(nn.initializers.lecun_normal(), names)


class Block(nn.Module):
  dense: type = nn.Dense
  annotate: bool = True  # partitioning names (nn.scan then needs metadata_params)

  @nn.compact
  def __call__(self, h, _):
    init = _init((None, None)) if self.annotate else nn.initializers.lecun_normal()
    return h + jnp.tanh(self.dense(WIDTH, kernel_init=init)(h)), None


class Scanned(nn.Module):
  """``LAYERS`` residual blocks under ``nn.scan`` (kernels ``(LAYERS, WIDTH, WIDTH)``)."""

  dense: type = nn.Dense
  layer_names: bool = True

  @nn.compact
  def __call__(self, x, train=False):
    del train
    h = self.dense(WIDTH)(x)
    meta = {nn.PARTITION_NAME: "layers"} if self.layer_names else {}
    stack = nn.scan(Block, variable_axes={True: 0}, split_rngs={"params": True},
                    length=LAYERS, metadata_params=meta)
    h, _ = stack(self.dense, self.layer_names, name="blocks")(h, None)
    return self.dense(4)(h)


class Unrolled(nn.Module):
  """The unscanned twin: the same blocks, one module each."""

  dense: type = nn.Dense

  @nn.compact
  def __call__(self, x, train=False):
    del train
    h = self.dense(WIDTH)(x)
    for i in range(LAYERS):
      h, _ = Block(self.dense, name=f"block_{i}")(h, None)
    return self.dense(4)(h)


def _batch(step):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(ROWS, 8)).astype(np.float32),
          "y": rng.integers(0, 4, ROWS).astype(np.int32)}


def _twin_params(scanned):
  """The unrolled twin's parameters holding the scanned model's layers."""
  p = dict(scanned)
  blocks = p.pop("blocks")
  for i in range(LAYERS):
    p[f"block_{i}"] = jax.tree.map(lambda x, i=i: x[i], blocks)
  return p


def _run(spec, model, params=None, steps=2, **kwargs):
  method = build_method(spec, steps_per_epoch=1)
  if method.dense is not None:
    model = model.clone(dense=method.dense)
  ts = dadjax.make_train_step(model, method.optimizer(optax.sgd(0.1)), backend="vmap",
                              num_sites=2, collections=dict(method.collections), **kwargs)
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  if params is not None:
    state = state._replace(params=dadjax.parallel.stack_sites(params, 2))
  start = ts.params(state)
  for i in range(steps):
    state, _ = ts(state, _batch(i))
  return ts, state, start


def test_layer_axes_are_read_from_the_models_partitioning_names():
  variables = Scanned().init(jax.random.key(0), _batch(0)["x"][:2])
  # the bias has no partitioning names: it is stacked because its module is
  stacked = {"blocks/Dense_0/kernel": 0, "blocks/Dense_0/bias": 0}
  assert dadjax.parallel.layer_axes_of(variables["params"]) == stacked
  ts, _, _ = _run("allreduce", Scanned(), steps=0)
  assert ts.layer_axes == stacked
  ts, _, _ = _run("allreduce", Scanned(layer_names=False), steps=0)
  assert ts.layer_axes == {}


def _grads(step):
  """Two sites' gradients of a stacked tree and of its unrolled twin (the same numbers)."""
  k = jax.random.split(jax.random.key(step), 2)
  stacked = {"blocks": {"kernel": jax.random.normal(k[0], (2, LAYERS, WIDTH, WIDTH))},
             "head": {"kernel": jax.random.normal(k[1], (2, WIDTH, 4))}}
  twin = {"head": stacked["head"],
          **{f"block_{i}": {"kernel": stacked["blocks"]["kernel"][:, i]} for i in range(LAYERS)}}
  return stacked, twin


# suite time: the error-fed and scaled variants of the twins run with -m slow
@pytest.mark.parametrize("spec", ["topk:0.25", pytest.param("ef(topk:0.25)", marks=pytest.mark.slow),
                                  "sign", pytest.param("ef_scaled_sign", marks=pytest.mark.slow),
                                  pytest.param("scaled_sign", marks=pytest.mark.slow), "bf16"])
def test_deterministic_compressors_equal_the_unscanned_twin(spec):
  tx = dadjax.compressed(dadjax.compress.get_compressor(spec))

  def run(grads, axes):
    def sites(gs):
      with dadjax.stacked_layers(axes):
        state = tx.init(jax.tree.map(lambda g: g[0], gs[0]))
        state = jax.tree.map(lambda x: jnp.stack([x, x]), state)

        def step(g, s):
          with dadjax.stacked_layers(axes):
            return tx.update(g, s)
        out = []
        for g in gs:
          u, state = jax.vmap(step, axis_name="data")(g, state)
          out.append(u)
      return out, state
    return sites(grads)

  steps = [_grads(i) for i in range(2)]
  scanned, s_state = run([s for s, _ in steps], {"blocks/kernel": 0})
  twin, t_state = run([t for _, t in steps], {})
  for got, want in zip(scanned, twin):
    np.testing.assert_array_equal(got["head"]["kernel"], want["head"]["kernel"])
    for i in range(LAYERS):
      np.testing.assert_array_equal(got["blocks"]["kernel"][:, i], want[f"block_{i}"]["kernel"])
  a, b = dadjax.comm_stats(s_state), dadjax.comm_stats(t_state)
  assert (a.reduce_bits, a.gather_bits, a.total_bits) == (b.reduce_bits, b.gather_bits,
                                                          b.total_bits)


def test_a_scanned_model_trains_like_its_twin_through_the_step():
  _, scanned, start = _run("ef(topk:0.25)", Scanned())
  ts, twin, _ = _run("ef(topk:0.25)", Unrolled(), params=_twin_params(start))
  got = _twin_params(jax.tree.map(lambda x: np.asarray(x)[0], scanned.params))
  # scan and the unrolled loop order the float work differently (no more than that)
  chex.assert_trees_all_close(got, ts.params(twin), atol=2e-4, rtol=2e-3)
  a, b = dadjax.comm_stats(scanned), dadjax.comm_stats(twin)
  assert (a.reduce_bits, a.gather_bits, a.total_bits) == (b.reduce_bits, b.gather_bits,
                                                          b.total_bits)


@pytest.mark.parametrize("spec", ["powersgd:2", "qsgd:4", pytest.param("rank_dad:2", marks=pytest.mark.slow),
                                  pytest.param(
    "accordion(powersgd:2,powersgd:1,window=1,interval=1)", marks=pytest.mark.slow)])
def test_keyed_methods_book_the_twins_bits(spec):
  """Keyed draws (PowerSGD's first Q, QSGD's rounding) come from each layer's own key, so the
  updates equal the twin's in distribution; the bits are the twin's exactly."""
  _, scanned, start = _run(spec, Scanned())
  _, twin, _ = _run(spec, Unrolled(), params=_twin_params(start))
  a, b = dadjax.comm_stats(scanned), dadjax.comm_stats(twin)
  assert (a.reduce_bits, a.gather_bits, a.total_bits) == (b.reduce_bits, b.gather_bits,
                                                          b.total_bits)


def test_powersgd_update_has_rank_r_per_layer_not_over_the_stack():
  grads = {"k": jax.random.normal(jax.random.key(1), (2, 6, 32, 32))}  # 2 sites, 6 layers
  tx = dadjax.compressed(dadjax.compress.powersgd(rank=2))

  def site(g):
    with dadjax.stacked_layers({"k": 0}):
      state = tx.init(g)
      return tx.update(g, state)[0]

  update = np.asarray(jax.vmap(site, axis_name="data")(grads)["k"][0])
  assert [np.linalg.matrix_rank(u, tol=1e-4) for u in update] == [2] * 6
  flat = jax.vmap(lambda g: tx.update(g, tx.init(g))[0], axis_name="data")(grads)["k"][0]
  assert np.linalg.matrix_rank(np.asarray(flat).reshape(6 * 32, 32), tol=1e-4) == 2


def test_qsgd_takes_each_layers_own_norm():
  grads = {"k": jnp.stack([jnp.full((2, 8, 8), 1e-3), jnp.full((2, 8, 8), 10.0)], axis=1)}
  tx = dadjax.compressed(dadjax.compress.get_compressor("qsgd:4"))

  def site(g, stacked):
    with dadjax.stacked_layers({"k": 0} if stacked else {}):
      return tx.update(g, tx.init(g))[0]

  per_layer = np.asarray(jax.vmap(lambda g: site(g, True), axis_name="data")(grads)["k"][0])
  whole = np.asarray(jax.vmap(lambda g: site(g, False), axis_name="data")(grads)["k"][0])
  # per layer, the small layer is quantized on its own grid (levels of its norm 0.008 / 4);
  # with one norm for both, its entries fall below the coarse grid: 0 or a level of 40 / 4
  small = np.linalg.norm(np.full(64, 1e-3))
  assert 0 < np.abs(per_layer[0]).max() <= small
  levels = np.abs(per_layer[0]) / (small / 4 / 2)  # the mean of 2 sites' levels: halves
  np.testing.assert_allclose(levels, np.round(levels), atol=1e-4)
  assert np.abs(whole[0]).max() == 0 or np.abs(whole[0]).max() > 1


def test_bad_layer_axes_are_clear_errors():
  with pytest.raises(ValueError, match="layer_axes must map leaf paths"):
    dadjax.make_train_step(Scanned(), dadjax.allreduce(), backend="vmap", num_sites=2,
                           layer_axes={"blocks": -1})
  tx = dadjax.compressed(dadjax.compress.get_compressor("sign"))
  with pytest.raises(ValueError, match=r"layer_axes: the leaf k has shape \(3,\)"):
    with dadjax.stacked_layers({"k": 1}):
      tx.init({"k": jnp.zeros(3)})


def test_an_explicit_argument_replaces_the_metadata():
  ts, scanned, start = _run("topk:0.25", Scanned(layer_names=False),
                            layer_axes={"blocks/Dense_0/kernel": 0, "blocks/Dense_0/bias": 0})
  tw, twin, _ = _run("topk:0.25", Unrolled(), params=_twin_params(start))
  got = _twin_params(jax.tree.map(lambda x: np.asarray(x)[0], scanned.params))
  chex.assert_trees_all_close(got, tw.params(twin), atol=2e-4, rtol=2e-3)


def test_per_layer_state_of_a_sharded_stack_follows_the_layers_sharding():
  mesh = dadjax.make_mesh(sites=2, inner={"model": 4})
  specs = {"blocks": {"Dense_0": {"kernel": jax.sharding.PartitionSpec(None, None, "model")}}}
  ts = dadjax.make_train_step(Scanned(), dadjax.build_method("ef(topk:0.25)").optimizer(
      optax.sgd(0.1)), mesh=mesh, param_specs=specs)
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  state, _ = ts(state, _batch(0))
  memories = [x for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
              if "kernel" in jax.tree_util.keystr(p) and np.shape(x)[1:] == (WIDTH, WIDTH)]
  assert len(memories) == LAYERS  # one error-feedback memory per layer
  for m in memories:  # (sites, m, n) of one layer, split like the stack's columns
    assert m.sharding.spec == jax.sharding.PartitionSpec("data", None, "model")


def test_accordion_decides_per_layer_of_a_stack():
  ts, state, _ = _run("accordion(topk:0.5,topk:0.1,window=1,interval=1)", Scanned(), steps=3)
  row = ts.metrics_row(state)
  layers = [k for k in row if k.startswith("accordion/critical/blocks/Dense_0/kernel/")]
  assert sorted(layers) == [f"accordion/critical/blocks/Dense_0/kernel/{i}" for i in range(LAYERS)]

