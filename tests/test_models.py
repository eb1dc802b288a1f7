"""Tests for dadjax.models: shapes, swappable dense factory, ResNet-18 size,
finite gradients, GRU scan vs. a python-loop reference, GRU with
stack_time_rows vs. the scan, get_model."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dadjax.models import (
  CNN,
  MLP,
  GRUClassifier,
  ResNet,
  ResNet18,
  Transformer,
  TransformerBlock,
  get_model,
)

B, NC = 4, 5


def _key(seed=0):
  # "rbg" keys: same API, far cheaper to compile on CPU than threefry (keeps
  # the suite fast; model code is PRNG-agnostic).
  return jax.random.key(seed, impl="rbg")


def _normal(seed, shape):
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _digits():
  return _normal(1, (B, 8, 8, 1))


def _tokens():
  return jnp.asarray(np.random.default_rng(2).integers(0, 20, (B, 12)), jnp.int32)


def _cases(dense=nn.Dense):
  """(name, model, input) for every model family."""
  return [
    ("mlp", MLP(num_classes=NC, dense=dense), _digits()),
    ("cnn", CNN(num_classes=NC, dense=dense), _digits()),
    ("cnn_cifar", CNN(num_classes=NC, dense=dense), _normal(3, (B, 32, 32, 3))),
    ("resnet", ResNet18(width=8, num_classes=NC, dense=dense), _normal(3, (B, 32, 32, 3))),
    ("gru_tokens", GRUClassifier(hidden=16, num_classes=NC, vocab_size=20, dense=dense), _tokens()),
    ("gru_float", GRUClassifier(hidden=16, num_classes=NC, dense=dense), _normal(4, (B, 12, 3))),
    (
      "transformer",
      Transformer(
        num_layers=2,
        d_model=32,
        num_heads=4,
        mlp_dim=64,
        num_classes=NC,
        vocab_size=20,
        max_len=16,
        dense=dense,
      ),
      _tokens(),
    ),
    (
      "vit",
      Transformer(
        d_model=32, num_heads=4, mlp_dim=64, num_classes=NC, patch_size=4, max_len=16, dense=dense
      ),
      _digits(),
    ),
  ]


CASES = _cases()


@pytest.mark.parametrize("name,model,x", CASES, ids=[c[0] for c in CASES])
def test_output_shape_and_finite_grads(name, model, x):
  variables = jax.jit(model.init)(_key(), x)
  assert set(variables) == {"params"}  # pure function of params (no batch_stats)
  y = jnp.arange(B) % NC

  def loss(p):
    lg = model.apply({"params": p}, x)
    return -jnp.mean(jax.nn.log_softmax(lg)[jnp.arange(B), y]), lg

  grads, logits = jax.jit(jax.grad(loss, has_aux=True))(variables["params"])
  assert logits.shape == (B, NC)
  leaves = jax.tree.leaves(grads)
  assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
  assert any(float(jnp.abs(g).sum()) > 0 for g in leaves)


class TaggedDense(nn.Dense):
  """nn.Dense that leaves a marker in the "dad_state" collection (a
  collection the GRU scan broadcasts, as dAD layers will use)."""

  @nn.compact
  def __call__(self, x):
    self.variable("dad_state", "tag", lambda: jnp.ones((), jnp.int32))
    return super().__call__(x)


def _paths(tree, leaf_name, pred=lambda v: True):
  out = set()
  for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
    keys = tuple(k.key for k in path)
    if keys[-1] == leaf_name and pred(v):
      out.add(keys[:-1])
  return out


TAGGED = _cases(TaggedDense)


@pytest.mark.parametrize("name,model,x", TAGGED, ids=[c[0] for c in TAGGED])
def test_every_dense_goes_through_factory(name, model, x):
  variables = jax.eval_shape(model.init, _key(), x)
  dense_paths = _paths(variables["params"], "kernel", lambda v: v.ndim == 2)
  tagged = _paths(variables["dad_state"], "tag")
  assert dense_paths and dense_paths == tagged


def test_transformer_block_alone():
  blk = TransformerBlock(d_model=16, num_heads=2, mlp_dim=32)
  x = _normal(0, (3, 7, 16))
  v = jax.jit(blk.init)(_key(1), x)
  assert jax.jit(blk.apply)(v, x).shape == (3, 7, 16)
  assert set(v["params"]) >= {"query", "key", "value", "out", "mlp_in", "mlp_out"}


def test_resnet18_param_count():
  model = ResNet18(width=64, num_classes=10)
  shapes = jax.eval_shape(model.init, _key(), jnp.zeros((1, 32, 32, 3)))
  n = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(shapes["params"]))
  assert abs(n - 11_173_962) / 11_173_962 < 0.01, n


def test_resnet_batchnorm_mode():
  model = ResNet(stage_sizes=(1, 1), width=8, num_classes=NC, norm="batch")
  x = _normal(0, (B, 16, 16, 3))
  v = jax.jit(model.init)(_key(1), x)
  assert "batch_stats" in v
  out, upd = jax.jit(lambda v: model.apply(v, x, train=True, mutable=["batch_stats"]))(v)
  assert out.shape == (B, NC) and "batch_stats" in upd
  assert jax.jit(model.apply)(v, x).shape == (B, NC)


def _gru_reference(params, tokens):
  """Python-loop GRU with the same parameters (PyTorch gate convention)."""
  p = params
  x = p["embed"]["embedding"][tokens]
  xp = x @ p["ih"]["kernel"] + p["ih"]["bias"]
  hid = p["cell"]["hh"]["kernel"].shape[0]
  h = jnp.zeros((x.shape[0], hid))
  for t in range(x.shape[1]):
    hp = h @ p["cell"]["hh"]["kernel"] + p["cell"]["hh"]["bias"]
    xr, xz, xn = jnp.split(xp[:, t], 3, -1)
    hr, hz, hn = jnp.split(hp, 3, -1)
    r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    n = jnp.tanh(xn + r * hn)
    h = (1 - z) * n + z * h
  return h @ p["head"]["kernel"] + p["head"]["bias"]


def test_gru_scan_matches_python_loop_and_is_order_sensitive():
  model = GRUClassifier(hidden=16, num_classes=NC, vocab_size=20)
  tok = _tokens()
  v = jax.jit(model.init)(_key(), tok)
  apply = jax.jit(model.apply)
  out = apply(v, tok)
  ref = jax.jit(_gru_reference)(v["params"], tok)
  np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
  out_rev = apply(v, tok[:, ::-1])
  assert not np.allclose(out, out_rev)


def test_gru_comm_collection_is_stacked_over_time():
  class SowDense(nn.Dense):
    @nn.compact
    def __call__(self, x):
      self.sow("comm", "rows", jnp.asarray(x.reshape(-1, x.shape[-1]).shape[0]))
      return super().__call__(x)

  model = GRUClassifier(hidden=8, num_classes=NC, vocab_size=20, dense=SowDense)
  tok = _tokens()
  params = jax.jit(model.init)(_key(), tok)["params"]
  _, state = jax.jit(lambda p: model.apply({"params": p}, tok, mutable=["comm"]))(params)
  assert state["comm"]["cell"]["hh"]["rows"][0].shape == (12,)  # one entry per step
  assert int(state["comm"]["ih"]["rows"][0]) == B * 12  # projected once, rows = B*T


def test_gru_stack_time_rows_matches_scan_and_calls_hh_once():
  # Same parameter tree, outputs and gradients as the scan; hh runs once on B*T rows.
  class SowDense(nn.Dense):
    @nn.compact
    def __call__(self, x):
      self.sow("comm", "rows", jnp.asarray(x.reshape(-1, x.shape[-1]).shape[0]))
      return super().__call__(x)

  kw = dict(hidden=16, num_classes=NC, vocab_size=20, dense=SowDense)
  base, rows = GRUClassifier(**kw), GRUClassifier(**kw, stack_time_rows=True)
  x = _tokens()
  params = jax.jit(base.init)(_key(), x)["params"]
  shapes = lambda m: jax.tree.map(jnp.shape, jax.eval_shape(m.init, _key(), x)["params"])
  assert shapes(rows) == shapes(base)
  y = jnp.arange(B) % NC

  def loss(model, p):
    lg, sown = model.apply({"params": p}, x, mutable=["comm"])
    return -jnp.mean(jax.nn.log_softmax(lg)[jnp.arange(B), y]), (lg, sown["comm"])

  grads = jax.jit(
    lambda p: [jax.grad(lambda q, m=m: loss(m, q), has_aux=True)(p) for m in (base, rows)]
  )
  (g_ref, (out_ref, comm_ref)), (g, (out, comm)) = grads(params)
  np.testing.assert_allclose(out, out_ref, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, jax.jit(_gru_reference)(params, x), rtol=1e-5, atol=1e-5)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  assert comm_ref["cell"]["hh"]["rows"][0].shape == (12,)  # scan: one call per step
  (n,) = comm["cell"]["hh"]["rows"]  # stack_time_rows: one call, rows = B * T
  assert n.shape == () and int(n) == B * 12


def test_get_model():
  assert isinstance(get_model("mlp", 3), MLP)
  assert isinstance(get_model("cnn", 3), CNN)
  assert isinstance(get_model("resnet18", 3, width=8), ResNet)
  assert isinstance(get_model("gru", 3, vocab_size=20), GRUClassifier)
  vit = get_model("vit", 3, d_model=16, num_heads=2, mlp_dim=32)
  assert isinstance(vit, Transformer) and vit.patch_size == 4
  assert jax.eval_shape(vit.init_with_output, _key(), _digits())[0].shape == (B, 3)
  assert get_model("transformer", 3, dense=TaggedDense).dense is TaggedDense
  with pytest.raises(ValueError, match="valid names"):
    get_model("nope", 3)


@pytest.mark.parametrize("make", [
    lambda rate: MLP(hidden=(32,), num_classes=NC, dropout=rate),
    lambda rate: Transformer(d_model=8, num_heads=2, mlp_dim=16, num_classes=NC, dropout=rate),
])
def test_dropout_only_in_training(make):
  x = _normal(0, (B, 6, 8))
  model, plain = make(0.5), make(0.0)
  v = model.init(_key(1), x)
  assert jax.tree.structure(v) == jax.tree.structure(plain.init(_key(1), x))
  evals = [model.apply(v, x) for _ in range(2)]
  np.testing.assert_array_equal(evals[0], evals[1])
  np.testing.assert_allclose(evals[0], plain.apply(v, x), rtol=1e-6)
  a = model.apply(v, x, train=True, rngs={"dropout": _key(2)})
  b = model.apply(v, x, train=True, rngs={"dropout": _key(3)})
  assert np.abs(np.asarray(a) - np.asarray(evals[0])).max() > 1e-4
  assert np.abs(np.asarray(a) - np.asarray(b)).max() > 1e-4
  with pytest.raises(ValueError, match="dropout"):
    make(1.0)
