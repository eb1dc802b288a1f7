"""Compressors on edge-case leaves, key domain separation, and argument / pytree checks.

Empty, scalar, one-entry, constant, tiny and integer leaves; keys of two
transforms under ``optax.partition``; ``ef_powersgd`` applying its memory
once; construction-time argument checks and update-time pytree checks of
``compressed``, ``error_feedback``, ``allreduce`` and ``synchronize``.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import compress as C
from dadjax import dad
from dadjax._core.linalg import orthogonalize
from dadjax.compress._base import leaf_keys

AXIS = "sites"
SPECS = ["identity", "bf16", "fp16", "topk:0.5", "randomk:0.5", "qsgd:4", "terngrad", "sign",
         "scaled_sign", "powersgd:2", "ef_topk:0.5", "ef_scaled_sign", "ef_powersgd:1"]


def _one_site(spec_or_compressor, tree, steps=1, seed=0):
  c = (C.get_compressor(spec_or_compressor) if isinstance(spec_or_compressor, str)
       else spec_or_compressor)
  tx = C.compressed(c, axis_name=None, seed=seed)
  state = tx.init(tree)
  update = jax.jit(tx.update)
  outs = []
  for _ in range(steps):
    out, state = update(tree, state)
    outs.append(out)
  return outs, state


# ------------------------------------------------------------------- leaves

@pytest.mark.parametrize("spec", SPECS)
def test_empty_leaves_pass_through_with_zero_bits(spec):
  tree = {"e0": jnp.zeros((0,)), "e05": jnp.zeros((0, 5)), "e50": jnp.zeros((5, 0)),
          "w": jnp.arange(12.0).reshape(3, 4) - 5}
  (out,), state = _one_site(spec, tree)
  chex.assert_trees_all_equal_shapes_and_dtypes(out, tree)
  assert np.all(np.isfinite(np.asarray(out["w"])))
  (_, alone), _ = _one_site(spec, {"w": tree["w"]}, steps=2)  # the empty leaves cost 0 bits
  (_, both), _ = _one_site(spec, tree, steps=2)
  chex.assert_trees_all_close(both["w"], alone["w"])


@pytest.mark.parametrize("clip", [2.5, 1.0, None])
def test_terngrad_sends_scalar_single_and_constant_leaves_exactly(clip):
  tree = {"scalar": jnp.float32(-0.7), "one": jnp.array([2.5]), "const": jnp.full((6,), 0.25),
          "tiny": jnp.full((3,), 1e-30)}
  (out,), _ = _one_site(C.terngrad(clip), tree)
  chex.assert_trees_all_equal(out, tree)


def test_terngrad_clips_at_sigma_about_zero():
  g = jnp.array([1.0, -1.0, 1.0, -1.0, 100.0])
  sigma = float(np.sqrt(np.mean(np.asarray(g) ** 2)))
  (out,), _ = _one_site(C.terngrad(clip=1.0), {"g": g})
  assert float(jnp.max(jnp.abs(out["g"]))) == pytest.approx(sigma, rel=1e-6)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.uint8, jnp.bool_])
def test_non_float_leaves_are_rejected_naming_the_leaf(spec, dtype):
  tree = {"w": jnp.ones((3, 4)), "block": {"count": jnp.ones((4,), dtype)}}
  with pytest.raises(ValueError, match="'block/count' has dtype"):
    C.compressed(C.get_compressor(spec), axis_name=None).init(tree)
  c = C.get_compressor(spec)
  with pytest.raises(ValueError, match="'block/count' has dtype"):
    c.init(tree)
  state = c.init({"w": tree["w"]})
  if not isinstance(state, C.ErrorFeedbackState):  # (its memory check names the leaf first)
    with pytest.raises(ValueError, match="'block/count' has dtype"):
      c.compress(tree, state, jax.random.key(0))


# ------------------------------------------------------------ ef_powersgd

def test_ef_powersgd_applies_powersgd_memory_once():
  c = C.get_compressor("ef_powersgd:1")
  assert c.memory and isinstance(c.init({"w": jnp.ones((6, 5))}), C.PowerSGDState)
  assert C.error_feedback(c) is c
  rng = np.random.default_rng(0)
  tree = {"w": jnp.asarray(rng.normal(size=(6, 5)), jnp.float32)}
  got, _ = _one_site(c, tree, steps=3)
  want, _ = _one_site(C.powersgd(rank=1), tree, steps=3)
  for g, w in zip(got, want):
    chex.assert_trees_all_close(g, w, atol=1e-6)
  # Without its own memory PowerSGD can still be wrapped (the generic memory).
  plain = C.error_feedback(C.powersgd(rank=1, error_feedback=False))
  assert isinstance(plain.init(tree), C.ErrorFeedbackState)
  topk_ef = C.error_feedback(C.topk(0.5))
  assert C.error_feedback(topk_ef) is topk_ef


def test_qsgd_tiny_gradients_are_not_flushed_to_zero():
  # ||g||^2 of 1e-30 entries underflows float32; the norm is taken without squaring them.
  rng = np.random.default_rng(4)
  g = jnp.asarray(rng.uniform(0.5, 1.5, size=64) * 1e-30, jnp.float32)
  compressor = C.qsgd(4)
  def estimate(key):
    payload, _ = compressor.compress({"w": g}, compressor.init({"w": g}), key)
    return compressor.decompress(payload, {"w": g}, key)["w"]
  draws = jax.vmap(estimate)(jax.random.split(jax.random.key(0), 2000))
  mean = np.asarray(draws, np.float64).mean(axis=0) * 1e30
  assert np.all(np.isfinite(mean)) and np.asarray(draws).any()
  np.testing.assert_allclose(mean, np.asarray(g, np.float64) * 1e30, rtol=0.15)  # unbiased


# -------------------------------------------------------------- PowerSGD

def test_powersgd_tiny_gradients_keep_a_finite_correct_direction():
  rng = np.random.default_rng(1)
  g = rng.normal(size=(12, 2)) @ rng.normal(size=(2, 8))  # rank 2: exact at rank 2
  tree = {"m": jnp.asarray(g * 1e-30, jnp.float32)}
  outs, state = _one_site(C.powersgd(rank=2, error_feedback=False, min_compression_rate=0.0),
                          tree, steps=10)
  for out in outs:
    m = np.asarray(out["m"], np.float64) * 1e30
    assert np.all(np.isfinite(m))
    assert np.linalg.norm(m - g) <= 1e-4 * np.linalg.norm(g)
  q = np.asarray(state.inner.q[0][0])
  np.testing.assert_allclose(q.T @ q, np.eye(2), atol=1e-5)  # the warm start stays orthonormal


def test_orthogonalize_is_scale_safe():
  p = jnp.asarray(np.random.default_rng(2).normal(size=(7, 3)) * 1e-30, jnp.float32)
  q = np.asarray(orthogonalize(p))
  np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-5)


# ------------------------------------------------------------------ keys

def test_two_transforms_under_partition_draw_different_keys():
  w = jnp.asarray(np.random.default_rng(3).normal(size=(8, 8)), jnp.float32)
  params = {"a": w, "b": w}
  for spec in ("qsgd:2", "randomk:0.25", "terngrad"):
    tx = optax.partition({"x": C.compressed(C.get_compressor(spec), axis_name=None),
                          "y": C.compressed(C.get_compressor(spec), axis_name=None)},
                         {"a": "x", "b": "y"})
    out, _ = jax.jit(tx.update)(params, tx.init(params))
    assert not np.array_equal(np.asarray(out["a"]), np.asarray(out["b"])), spec


def test_site_keys_are_separate_from_shared_and_leaf_keys():
  n = 4

  def site(_):
    keys = C.step_keys(0, jnp.int32(3), AXIS)
    leaves = [leaf_keys(keys, i) for i in range(n)]
    leaves += [leaf_keys(keys, p, "qsgd") for p in ("a", "b")]
    data = jax.random.key_data
    return (data(keys.shared), data(keys.site), jnp.stack([data(k.shared) for k in leaves]),
            jnp.stack([data(k.site) for k in leaves]))

  shared, sites, leaf_shared, leaf_site = map(
      np.asarray, jax.vmap(site, axis_name=AXIS)(jnp.arange(n)))
  assert (shared == shared[:1]).all() and (leaf_shared == leaf_shared[:1]).all()
  every = [tuple(k) for k in sites] + [tuple(k) for k in leaf_shared[0]] + [tuple(shared[0])]
  every += [tuple(k) for s in range(n) for k in leaf_site[s]]
  assert len(set(every)) == len(every)


# --------------------------------------------------------------- arguments

@pytest.mark.parametrize("make, match", [
    (lambda: C.compressed(C.topk(0.1), axis_name=3), "axis_name"),
    (lambda: C.compressed(C.topk(0.1), axis_name=()), "axis_name"),
    (lambda: C.compressed("topk:0.1"), "compressor"),
    (lambda: C.compressed(None), "compressor"),
    (lambda: C.compressed(C.topk(0.1), seed=1.5), "seed"),
    (lambda: C.error_feedback(None), "Compressor"),
    (lambda: C.error_feedback("topk"), "Compressor"),
    (lambda: dadjax.allreduce(axis_name=3), "axis_name"),
    (lambda: dad.synchronize({"w": True}, axis_name=["data"]), "axis_name"),
    (lambda: dad.synchronize({"w": True}, other="allreduce"), "other"),
    (lambda: dad.synchronize(None), "mask"),
    (lambda: dad.synchronize({"w": True}, record_model_comm="yes"), "record_model_comm"),
])
def test_bad_arguments_raise_at_construction(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def _transforms():
  yield "compressed(topk)", C.compressed(C.topk(0.5), axis_name=None)
  yield "compressed(powersgd)", C.compressed(C.powersgd(2), axis_name=None)
  yield "compressed(qsgd)", C.compressed(C.qsgd(4), axis_name=None)
  yield "allreduce", dadjax.allreduce(axis_name=None)
  yield "synchronize", dad.synchronize(lambda p: jax.tree.map(lambda _: False, p), axis_name=None)


_PARAMS = {"w": jnp.ones((4, 3)), "b": jnp.ones((3,))}


@pytest.mark.parametrize("updates, match", [
    ({"w": jnp.ones((4, 3)), "b": jnp.ones((3,)), "extra": jnp.ones((2,))}, "'extra' is not in"),
    ({"w": jnp.ones((4, 3))}, "'b' of the tree given at init is missing"),
    ({"w": jnp.ones((4, 2)), "b": jnp.ones((3,))}, r"'w' has shape \(4, 2\), expected \(4, 3\)"),
    ({"w": jnp.ones((4, 3)), "b": jnp.ones((3,), jnp.bfloat16)}, "'b' has dtype bfloat16"),
    ([jnp.ones((3,)), jnp.ones((4, 3))], "'0' is not in"),
])
def test_update_tree_must_match_init(updates, match):
  for name, tx in _transforms():
    state = tx.init(_PARAMS)
    tx.update(_PARAMS, state)  # the same tree is fine
    with pytest.raises(ValueError, match=match):
      tx.update(updates, state)
  c = C.error_feedback(C.topk(0.5))
  state = c.init(_PARAMS)
  with pytest.raises(ValueError, match="error_feedback.*" + match):
    c.compress(updates, state, jax.random.key(0))


# ------------------------------------------------------- a site of several devices


@pytest.mark.parametrize("shape,split,dtype", [((12, 16), 1, "float32"), ((16, 12), 0, "float32"),
                                               ((5, 7), 0, "float32"), ((3, 4, 8), 2, "float32"),
                                               ((8, 12), 1, "bfloat16")])
def test_top_k_on_a_sites_devices_keeps_the_catalog_entries(shape, split, dtype):
  # Sites of 4 devices (a partially manual shard_map, the leaf split over "fsdp"): TopK
  # selects on each device's own run of the flat tensor. The kept set must be top_k's, ties
  # to the lower flat index and NaN first, and the mean over sites the same tensor.
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  size = int(np.prod(shape))
  x = np.round(np.random.default_rng(size).standard_normal((2,) + shape) * 2) / 2  # ties
  x = x.astype(jnp.dtype(dtype))
  x[0].reshape(-1)[[1, size - 2]] = np.nan
  x[1].reshape(-1)[3] = -np.inf
  spec = [None] * len(shape)
  if shape[split] % 4 == 0:
    spec[split] = "fsdp"
  placed = jax.device_put(x, NamedSharding(mesh, P("data", *spec)))
  c = C.topk(0.3)
  keys = C.Keys(jax.random.key(0), jax.random.key(1))

  def site(g):
    payload, _ = c.compress({"w": g[0]}, c.init({"w": g[0]}), keys)
    return jax.tree.map(lambda a: a[None], payload)

  got = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                              axis_names={"data"}))(placed)
  got = jax.tree.leaves(got, is_leaf=lambda a: isinstance(a, C.SparsePayload))[0]
  k = round(0.3 * size)
  for i in range(2):
    want = np.asarray(C.largest_magnitude_indices(jnp.asarray(x[i].reshape(-1)), k))
    idx = np.asarray(got.indices[i])
    np.testing.assert_array_equal(idx, np.sort(want))
    np.testing.assert_array_equal(np.asarray(got.values[i]), x[i].reshape(-1)[idx])

  def mean(g):
    return C.compressed(c, axis_name="data").update({"w": g[0]}, C.compressed(
        c, axis_name="data").init({"w": g[0]}))[0]["w"][None]

  dense = jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P("data"), out_specs=P("data"),
                                axis_names={"data"}))(placed)
  want = np.zeros((2, size), np.float32)
  for i in range(2):
    kept = np.asarray(C.largest_magnitude_indices(jnp.asarray(x[i].reshape(-1)), k))
    want[i, kept] = x[i].reshape(-1)[kept]
  np.testing.assert_array_equal(np.asarray(dense[0], np.float32).reshape(-1),
                                want.mean(0).astype(x.dtype).astype(np.float32))
