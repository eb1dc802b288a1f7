"""Sites made of several devices: 2-D meshes (site axis x in-site axis)."""
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import extend
from dadjax._core.shards import LeafShard, current_leaf, sharded_parameters
from dadjax.comm import HierarchicalNetwork, NetworkModel
from dadjax.comm._hlo import collective_ops
from dadjax.methods import build_method
from dadjax.models import MLP

ROWS = 32


def _batch(step, rows=ROWS):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(rows, 12)).astype(np.float32),
          "y": rng.integers(0, 5, rows).astype(np.int32)}


def _step(spec, mesh, **kwargs):
  method = build_method(spec)
  model = MLP(hidden=(16,), num_classes=5, **({"dense": method.dense} if method.dense else {}))
  return dadjax.make_train_step(model, optax.chain(method.tx, optax.sgd(0.1, momentum=0.9)),
                                mesh=mesh, **kwargs)


def _train(spec, mesh, steps=3):
  ts = _step(spec, mesh)
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  for i in range(steps):
    state, metrics = ts(state, _batch(i))
  return ts, state, metrics


def test_make_mesh_shapes_and_errors():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  assert mesh.axis_names == ("data", "replica") and mesh.devices.shape == (2, 4)
  assert list(mesh.devices[1]) == jax.devices()[4:8]  # site s = devices [4s, 4s + 4)
  assert dadjax.make_mesh(per_site=2).devices.shape == (4, 2)
  assert dadjax.make_mesh(4).axis_names == ("data",)  # the 1-D call is unchanged
  with pytest.raises(ValueError, match="sites must be"):
    dadjax.make_mesh(sites=3, per_site=4)
  with pytest.raises(ValueError, match="per_site must be"):
    dadjax.make_mesh(sites=1, per_site=0)
  with pytest.raises(ValueError, match="inner_axis must differ"):
    dadjax.make_mesh(sites=2, per_site=4, inner_axis="data")


def test_bad_2d_arguments_are_clear_errors():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  with pytest.raises(ValueError, match="mesh is for backend='shard_map'"):
    _step("allreduce", mesh, backend="vmap", num_sites=2)
  with pytest.raises(ValueError, match="num_sites=4 differs"):
    _step("allreduce", mesh, num_sites=4)
  ts = _step("allreduce", mesh)
  with pytest.raises(ValueError, match=r"num_sites=2 x per_site=4 devices; use a multiple of 8"):
    ts.check_batch(_batch(0, rows=12))


@pytest.mark.parametrize("spec", ["allreduce", "dad"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_2d_mesh_trains_like_pooled_training(spec, shape):
  sites, per_site = shape
  ts, state, metrics = _train(spec, dadjax.make_mesh(sites=sites, per_site=per_site))
  ref_ts, ref_state, ref_metrics = _train(spec, dadjax.make_mesh(1))  # one site, all rows
  got = ts.params(state)
  chex.assert_trees_all_close(got, ref_ts.params(ref_state), atol=2e-6, rtol=1e-5)
  chex.assert_trees_all_close(ts.params(state, site=sites - 1), got, atol=0)
  np.testing.assert_allclose(np.asarray(metrics["loss"])[0], np.asarray(ref_metrics["loss"])[0],
                             rtol=1e-5)
  summary = dadjax.comm_stats(state)
  # In-site: one fp32 pmean of the gradients (+ dAD's per-layer "uses"), the int32 "step"
  # counters taken exactly from the site's first device (a psum), and the metrics.
  n_params = sum(np.size(x) for x in jax.tree.leaves(got))
  n_state = 2 * 2 if spec == "dad" else 0  # two dAD layers x (fp32 "uses" + int32 "step")
  if spec == "dad":
    steps = [v["dad"]["step"] for v in state.model_state["dad_state"].values()]
    assert all(s.dtype == np.int32 and np.all(np.asarray(s) == 3) for s in steps)
  assert summary.intra_reduce_bits == (32 * (n_params + n_state + 2),) * sites
  assert summary.intra_gather_bits == (0,) * sites
  if spec == "dad":  # each device gathers its own b / per_site rows of (A, D) per layer
    rows = ROWS // (sites * per_site)
    gathered = 32 * rows * ((12 + 16) + (16 + 5))
    assert summary.gather_bits == (gathered,) * sites


@pytest.mark.parametrize("spec,shape", [
    ("bf16", (2, 4)), ("ef(topk:0.25)", (2, 4)), ("qsgd:8", (2, 4)), ("terngrad", (2, 4)),
    ("sign", (2, 4)), ("randomk:0.25", (2, 4)), ("powersgd:2", (2, 4)), ("qsgd:8", (4, 2)),
    ("ef(topk:0.25)", (4, 2)),
])
def test_compressors_on_2d_mesh_equal_1d_mesh_with_the_same_sites(spec, shape):
  sites, per_site = shape
  ts, state, _ = _train(spec, dadjax.make_mesh(sites=sites, per_site=per_site), steps=2)
  ref_ts, ref_state, _ = _train(spec, dadjax.make_mesh(sites), steps=2)
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=2e-6, rtol=1e-5)
  got, ref = dadjax.comm_stats(state), dadjax.comm_stats(ref_state)
  assert (got.reduce_bits, got.gather_bits, got.dense_bits, got.total_bits) == (
      ref.reduce_bits, ref.gather_bits, ref.dense_bits, ref.total_bits)
  assert (got.reduce_calls, got.gather_calls) == (ref.reduce_calls, ref.gather_calls)
  assert ref.intra_bits_per_step == 0 and got.intra_bits_per_step > 0


@pytest.mark.parametrize("spec", ["qsgd:8", "ef(topk:0.25)", "dad"])
def test_hlo_compressed_collectives_only_over_the_site_axis(spec):
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  ts, state, _ = _train(spec, mesh, steps=1)
  text = ts._run.lower(state, ts.place_batch(_batch(0))).compile().as_text()
  ops = collective_ops(text)
  site_groups = {(0, 4), (1, 5), (2, 6), (3, 7)}
  in_site_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}
  inter = [op for op in ops if set(op.groups) == site_groups]
  intra = [op for op in ops if set(op.groups) == in_site_groups]
  assert len(inter) + len(intra) == len(ops), [op.groups for op in ops]
  assert inter and intra
  assert {ts.link_of(op.groups) for op in inter} == {"inter"}
  assert {ts.link_of(op.groups) for op in intra} == {"intra"}
  # In-site: exact fp32 all-reduces (gradients, collections, metrics).
  assert {op.kind for op in intra} == {"reduce"}
  assert "f32[" in text and not any("s8[" in line or "u8[" in line or "pred[" in line
                                    for line in text.splitlines()
                                    if "replica_groups={{0,1,2,3}" in line)
  summary = dadjax.comm_stats(state)
  # The ledger's inter-site bits are the bytes of the site-axis collectives, and so in-site.
  assert 8 * sum(op.nbytes for op in inter) == summary.bits_per_step
  intra_hlo = 8 * sum(op.nbytes for op in intra)
  if spec == "dad":  # XLA merges the two layers' identical constant "uses" operands into one
    assert summary.intra_bits_per_step - intra_hlo == 32
  else:
    assert intra_hlo == summary.intra_bits_per_step
  by_link = ts.collectives(state, _batch(0), link="inter")
  assert by_link.bits("reduce") + by_link.bits("gather") == summary.bits_per_step
  if spec != "dad":  # compressed: less than the fp32 gradient over the slow links
    assert summary.bits_per_step < summary.intra_bits_per_step
    assert any("s8[" in l or "u8[" in l or "s32[" in l or "u32[" in l for l in text.splitlines()
               if "replica_groups={{0,4}" in l)


def test_hierarchical_network_charges_each_link_class():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  _, state, _ = _train("bf16", mesh, steps=1)
  summary = dadjax.comm_stats(state)
  inter = NetworkModel(bandwidth=10e9, latency=1e-3, num_sites=2)
  net = HierarchicalNetwork(inter, intra_bandwidth=800e9, intra_latency=5e-6, per_site=4)
  intra_bits = summary.intra_bits_per_step
  expect_intra = (2 * 3 / 4 * intra_bits / 800e9 + 2 * 3 * 5e-6 * summary.intra_reduce_calls)
  assert net.intra_time(summary) == pytest.approx(expect_intra, rel=1e-12)
  assert net.inter_time(summary) == pytest.approx(inter.step_time(summary), rel=1e-12)
  assert net.step_time(summary) == pytest.approx(expect_intra + inter.step_time(summary))
  report = dadjax.comm.report(summary, net)
  assert report.intra_payload_bits_per_step == intra_bits
  assert report.setting == "ring, N=2 sites x 4 devices"
  assert report.modeled_comm_s_per_step == pytest.approx(
      report.modeled_intra_comm_s_per_step + inter.step_time(summary))
  assert HierarchicalNetwork(inter).intra_time(summary) == 0.0  # per_site=1: no in-site links
  with pytest.raises(ValueError, match="per_site must be"):
    HierarchicalNetwork(inter, per_site=0)


def test_replica_groups_parse_both_hlo_forms():
  from dadjax.comm._hlo import _replica_groups
  explicit = "channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true"
  iota = "channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true"
  assert _replica_groups(explicit) == _replica_groups(iota) == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert _replica_groups("replica_groups=[2,4]<=[8], x") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert _replica_groups("replica_groups={}, x") == ()


def test_config_per_site_trains_a_2d_mesh_and_rows_report_both_link_classes():
  from dadjax.config import Config, load_config
  from dadjax.errors import ConfigError
  from dadjax.train import train
  with pytest.raises(ConfigError, match="per_site=4 needs backend='shard_map'"):
    Config(num_sites=2, per_site=4, backend="vmap")
  with pytest.raises(ConfigError, match="batch_per_site=6 must be a multiple of"):
    Config(num_sites=2, per_site=4, batch_per_site=6)
  root = pathlib.Path(__file__).parent.parent
  shipped = load_config(root / "experiments" / "configs" / "multislice.toml")
  assert (shipped.num_sites, shipped.per_site, shipped.intra_bandwidth) == (2, 4, 800e9)
  config = Config(num_sites=2, per_site=4, batch_per_site=8, steps=2, eval_every=2,
                  method="qsgd:8", model_kwargs={"hidden": [16]})
  run = train(config, progress=False)
  assert run.step_fn.mesh.devices.shape == (2, 4) and run.step_fn.per_site == 4
  row = run.history[-1]
  summary = dadjax.comm_stats(run.state)
  assert row["payload_bits_per_step"] == summary.bits_per_step
  assert row["intra_payload_bits_per_step"] == summary.intra_bits_per_step > 0
  assert row["modeled_intra_comm_s_per_step"] > 0
  assert row["modeled_comm_s_per_step"] > row["modeled_intra_comm_s_per_step"]


# --- Parameters sharded within a site (FSDP) ---------------------------------------------------


def _sharded_pair(spec, shape, opt=None, steps=2):
  """The same run with the site's parameters sharded over its devices, and replicated."""
  mesh = dadjax.make_mesh(sites=shape[0], per_site=shape[1])
  runs = []
  for shard in (True, False):
    method = build_method(spec)
    model = MLP(hidden=(16,), num_classes=5, **({"dense": method.dense} if method.dense else {}))
    tx = optax.chain(method.tx, opt() if opt else optax.sgd(0.1, momentum=0.9))
    ts = dadjax.make_train_step(model, tx, mesh=mesh, shard_params=shard)
    state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
    for i in range(steps):
      state, metrics = ts(state, _batch(i))
    runs.append((ts, state, metrics))
  return runs


def _local_shape(x):
  return x.addressable_shards[0].data.shape


def test_shard_dims_split_the_largest_divisible_dimension():
  params = {"kernel": np.zeros((12, 16)), "bias": np.zeros((5,)), "scalar": np.zeros(()),
            "square": np.zeros((8, 8)), "odd": np.zeros((3, 6))}
  assert dadjax.parallel.shard_dims(params, 4) == {
      "kernel": 1, "bias": None, "scalar": None, "square": 0, "odd": None}
  assert dadjax.parallel.shard_dims(params, 2)["odd"] == 1
  assert dadjax.parallel.shard_dims(params, 1)["kernel"] is None


@pytest.mark.parametrize("spec,shape,opt", [
    ("allreduce", (2, 4), None), ("allreduce", (4, 2), lambda: optax.adam(1e-2)),
    ("bf16", (2, 4), None), ("ef(sign)", (2, 4), None), ("dad", (2, 4), None),
    ("rank_dad:2", (4, 2), None), ("ef_scaled_sign", (2, 4), None), ("terngrad", (2, 4), None),
    ("qsgd:4", (4, 2), None),
])
def test_sharded_params_train_like_replicated_params(spec, shape, opt):
  (ts, state, metrics), (ref_ts, ref_state, ref_metrics) = _sharded_pair(spec, shape, opt)
  sites, per_site = shape
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=2e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(metrics["loss"]), np.asarray(ref_metrics["loss"]),
                             rtol=1e-5)
  # Stored sharded: a device holds 1/per_site of each kernel, and of the optimizer's copy of it.
  dims = dadjax.parallel.shard_dims(ts.params(state), per_site)
  kernel = state.params["hidden_0"]["kernel"]
  assert _local_shape(kernel)[1 + dims["hidden_0"]["kernel"]] * per_site == kernel.shape[
      1 + dims["hidden_0"]["kernel"]]
  mirrored = [x for p, x in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
              if p and p[-2:] == (jax.tree_util.DictKey("hidden_0"), jax.tree_util.DictKey("kernel"))]
  assert mirrored and all(_local_shape(x) == _local_shape(kernel) for x in mirrored)
  ref_kernel = ref_state.params["hidden_0"]["kernel"]
  assert _local_shape(ref_kernel) == (1,) + ref_kernel.shape[1:]  # replicated: the whole kernel
  # Ledger, per device: a sharded leaf's exchange carries its slice, a whole leaf all of it.
  got, ref = dadjax.comm_stats(state), dadjax.comm_stats(ref_state)
  if spec in ("allreduce", "bf16"):
    width = 32 if spec == "allreduce" else 16
    params = ts.params(state)
    entries = sum(np.size(x) // (per_site if d is not None else 1) for x, d in zip(
        jax.tree.leaves(params), jax.tree.structure(params).flatten_up_to(dims)))
    assert got.reduce_bits == (width * entries + 64,) * sites  # + the metrics' pmean
    assert ref.reduce_bits == (width * sum(np.size(x) for x in jax.tree.leaves(
        ts.params(state))) + 64,) * sites
  # In-site: the slices' all-gather + the gradients' reduce-scatter replace the all-reduce.
  assert got.intra_gather_bits[0] > 0 and ref.intra_gather_bits[0] == 0
  assert got.intra_reduce_bits[0] < ref.intra_reduce_bits[0]


def test_sharded_params_hlo_and_ledger_agree():
  (ts, state, _), _ = _sharded_pair("allreduce", (2, 4), steps=1)
  ops = ts.collectives(state, _batch(0), link="intra")
  assert ops.count["gather"] > 0 and ops.count["reduce_scatter"] > 0
  summary = dadjax.comm_stats(state)
  # A reduce-scatter of B operand bits is booked as the all-gather of its B/4 output slice.
  assert summary.intra_gather_bits[0] == ops.bits("gather") + ops.bits("reduce_scatter") // 4
  assert summary.intra_reduce_bits[0] == ops.bits("reduce")
  inter = ts.collectives(state, _batch(0), link="inter")
  assert inter.bits("reduce") == summary.bits_per_step
  assert ts.collectives(state, _batch(0)).count["reduce_scatter"] == ops.count["reduce_scatter"]


@pytest.mark.parametrize("spec,name", [
    ("topk:0.25", "topk"), ("powersgd:2", "powersgd"), ("qsgd:8:16", "qsgd"),
    ("randomk:0.25", "randomk"), ("ef_topk:0.25", "ef_topk"),
    ("accordion(topk:0.5,topk:0.25)", "accordion"),
])
def test_methods_that_need_whole_tensors_refuse_sharded_params(spec, name):
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  method = build_method(spec, steps_per_epoch=4) if spec.startswith("accordion") else build_method(
      spec)
  ts = dadjax.make_train_step(MLP(hidden=(16,), num_classes=5),
                              optax.chain(method.tx, optax.sgd(0.1)), mesh=mesh, shard_params=True)
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  before = ts.params(state)
  with pytest.raises(ValueError, match=rf"^{name} needs each parameter's whole tensor.*"
                                       r"shard_params=True.*Methods that support"):
    ts(state, _batch(0))
  chex.assert_trees_all_equal(ts.params(state), before)  # nothing ran, nothing was lost


def test_shard_params_argument_errors():
  model = MLP(hidden=(16,), num_classes=5)
  tx = build_method("allreduce").tx
  with pytest.raises(ValueError, match="needs backend='shard_map' and a 2-D mesh"):
    dadjax.make_train_step(model, tx, mesh=dadjax.make_mesh(4), shard_params=True)
  with pytest.raises(ValueError, match="needs backend='shard_map' and a 2-D mesh"):
    dadjax.make_train_step(model, tx, backend="vmap", num_sites=2, shard_params=True)
  with pytest.raises(ValueError, match="shard_params must be a bool"):
    dadjax.make_train_step(model, tx, mesh=dadjax.make_mesh(sites=2, per_site=4),
                           shard_params="yes")
  stage = build_method("dataquant:4").batch_stage
  with pytest.raises(ValueError, match="does not support a batch_stage"):
    dadjax.make_train_step(model, optax.sgd(0.1), mesh=dadjax.make_mesh(sites=2, per_site=4),
                           shard_params=True, batch_stage=stage)
  from dadjax.config import Config
  from dadjax.errors import ConfigError
  with pytest.raises(ConfigError, match="shard_params=True .* needs config.per_site >= 2"):
    Config(num_sites=2, shard_params=True)


def test_whole_tensor_helpers_equal_the_unsharded_computation():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  x = np.random.default_rng(0).normal(size=(2, 6, 8)).astype(np.float32)  # (sites, 6, 8)
  key = jax.random.key(3)

  def per_device(block):
    block = block[0]  # this device's (6, 2) slice of its site's (6, 8) leaf
    with sharded_parameters(("replica",), {"['w']": 1}):
      with current_leaf("['w']"):
        assert extend.leaf_shard() == LeafShard(("replica",), 1)
        out = (extend.whole_sum(jnp.sum(block)), extend.whole_max(jnp.max(block)),
               extend.whole_size(block.size), extend.slice_uniform(key, block.shape))
      with current_leaf("['b']"):
        with pytest.raises(ValueError, match=r"leaf \['b'\] is not a parameter"):
          extend.leaf_shard()
    return jax.tree.map(lambda v: jnp.asarray(v)[None], out)

  sums, maxes, sizes, noise = jax.jit(jax.shard_map(
      per_device, mesh=mesh, in_specs=P("data", None, "replica"),
      out_specs=(P("data"), P("data"), P("data"), P("data", None, "replica")),
      check_vma=False))(x)
  np.testing.assert_allclose(np.asarray(sums), x.sum(axis=(1, 2)), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(maxes), x.max(axis=(1, 2)))
  assert np.asarray(sizes).tolist() == [48, 48]
  whole = np.asarray(jax.random.uniform(key, (48,)).reshape(6, 8))
  np.testing.assert_array_equal(np.asarray(noise)[0], whole)  # the slices tile the whole draw
  # Outside a sharded step every helper is the local computation.
  assert extend.leaf_shard() is None and extend.whole_size(7) == 7
  np.testing.assert_array_equal(np.asarray(extend.slice_uniform(key, (6, 8))), whole)
