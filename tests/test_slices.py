"""Sites made of several devices: the site axis is manual, the in-site axes are GSPMD's."""
import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax.comm import HierarchicalNetwork, NetworkModel
from dadjax.comm._hlo import collective_ops
from dadjax.methods import build_method
from dadjax.models import MLP
from helpers import batch, run_steps

ROWS = 32


def _batch(step, rows=ROWS):
  return batch(rows, 12, 5, seed=step)  # this file's task: 12 features, 5 classes


def _kernel(names, logical=False):
  wrap = nn.with_logical_partitioning if logical else nn.with_partitioning
  return wrap(nn.initializers.lecun_normal(), names)


class TPNet(nn.Module):
  """A Megatron-style pair (column-parallel, then row-parallel) and a head, all annotated."""

  dense: type = nn.Dense
  logical: bool = False

  @nn.compact
  def __call__(self, x, train=False):
    del train
    col, row = (("embed", "mlp"), ("mlp", "embed")) if self.logical else (
        (None, "model"), ("model", None))
    h = nn.relu(self.dense(32, kernel_init=_kernel(col, self.logical))(x))
    if self.logical:
      h = nn.with_logical_constraint(h, ("batch", "mlp"))
    h = self.dense(16, kernel_init=_kernel(row, self.logical))(h)
    return self.dense(5)(nn.relu(h))


def _step(spec, mesh, model=None, opt=None, **kwargs):
  method = build_method(spec, steps_per_epoch=2)
  dense = {"dense": method.dense} if method.dense else {}
  model = MLP(hidden=(16,), num_classes=5, **dense) if model is None else model.clone(**dense)
  extra = {"batch_stage": method.batch_stage} if method.batch_stage is not None else {}
  return dadjax.make_train_step(model, method.optimizer(opt or optax.sgd(0.1, momentum=0.9)),
                                mesh=mesh, collections=dict(method.collections), **extra,
                                **kwargs)


def _train(spec, mesh, steps=3, **kwargs):
  ts = _step(spec, mesh, **kwargs)
  state, metrics = run_steps(ts, _batch, steps)
  return ts, state, metrics[-1]


def _device_bytes(tree):
  """Bytes one device holds of a placed tree."""
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def test_make_mesh_shapes_and_errors():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  assert mesh.axis_names == ("data", "replica") and mesh.devices.shape == (2, 4)
  assert list(mesh.devices[1]) == jax.devices()[4:8]  # site s = devices [4s, 4s + 4)
  assert dadjax.make_mesh(per_site=2).devices.shape == (4, 2)
  assert dadjax.make_mesh(4).axis_names == ("data",)  # the 1-D call is unchanged
  named = dadjax.make_mesh(sites=2, inner={"fsdp": 2, "model": 2})
  assert named.axis_names == ("data", "fsdp", "model") and named.devices.shape == (2, 2, 2)
  assert list(named.devices[1].ravel()) == jax.devices()[4:8]
  with pytest.raises(ValueError, match="sites must be"):
    dadjax.make_mesh(sites=3, per_site=4)
  with pytest.raises(ValueError, match="per_site must be"):
    dadjax.make_mesh(sites=1, per_site=0)
  with pytest.raises(ValueError, match="inner_axis must differ"):
    dadjax.make_mesh(sites=2, per_site=4, inner_axis="data")
  with pytest.raises(ValueError, match="inner must be a non-empty dict"):
    dadjax.make_mesh(sites=2, inner={"data": 4})
  with pytest.raises(ValueError, match="either as per_site"):
    dadjax.make_mesh(sites=2, per_site=2, inner={"model": 2})


def test_bad_arguments_are_clear_errors():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  with pytest.raises(ValueError, match="mesh is for backend='shard_map'"):
    _step("allreduce", mesh, backend="vmap", num_sites=2)
  with pytest.raises(ValueError, match="num_sites=4 differs"):
    _step("allreduce", mesh, num_sites=4)
  ts = _step("allreduce", mesh)
  with pytest.raises(ValueError, match=r"num_sites=2 x 4 devices per site; use a multiple of 8"):
    ts.check_batch(_batch(0, rows=12))
  with pytest.raises(ValueError, match="batch_axes must be a tuple of in-site axes"):
    _step("allreduce", mesh, batch_axes=("data",))
  with pytest.raises(ValueError, match=r"\['param_specs'\] describe a mesh's in-site layout"):
    _step("allreduce", None, backend="vmap", num_sites=2, param_specs=P())
  with pytest.raises(ValueError, match="shard_params=True splits parameters"):
    _step("allreduce", dadjax.make_mesh(4), shard_params=True)
  with pytest.raises(ValueError, match="shard_params must be a bool"):
    _step("allreduce", mesh, shard_params="yes")


@pytest.mark.parametrize("spec", ["allreduce", "dad"])
@pytest.mark.parametrize("shape", [(2, 4), (4, 2)])
def test_a_site_of_several_devices_trains_like_one_device_with_its_rows(spec, shape):
  sites, per_site = shape
  ts, state, metrics = _train(spec, dadjax.make_mesh(sites=sites, per_site=per_site))
  ref_ts, ref_state, ref_metrics = _train(spec, dadjax.make_mesh(sites))
  got = ts.params(state)
  chex.assert_trees_all_close(got, ref_ts.params(ref_state), atol=2e-6, rtol=1e-5)
  chex.assert_trees_all_close(ts.params(state, site=sites - 1), got, atol=0)
  np.testing.assert_allclose(np.asarray(metrics["loss"]), np.asarray(ref_metrics["loss"]),
                             rtol=1e-5)
  summary, ref = dadjax.comm_stats(state), dadjax.comm_stats(ref_state)
  # the ledger books what a site sends over the site axis: the same as one device per site
  assert (summary.reduce_bits, summary.gather_bits) == (ref.reduce_bits, ref.gather_bits)
  assert state.intra_comm is None  # the in-site traffic is GSPMD's: read from the program


def test_in_site_traffic_is_read_from_the_compiled_program_per_axis():
  mesh = dadjax.make_mesh(sites=2, inner={"fsdp": 2, "model": 2})
  ts, state, _ = _train("qsgd:8", mesh, steps=1, model=TPNet(), shard_params=True)
  by_axis = ts.traffic_by_axis(state, _batch(0))
  assert by_axis.get("data", 0) > 0  # the method's collectives
  assert set(by_axis) - {"data"} and all(
      "data" not in k.split("+") for k in by_axis if k != "data")  # no op spans both kinds
  intra = ts.collectives(state, _batch(0), link="intra")
  inter = ts.collectives(state, _batch(0), link="inter")
  assert sum(v for k, v in by_axis.items() if k != "data") == 8 * sum(intra.nbytes.values())
  assert by_axis["data"] == 8 * sum(inter.nbytes.values())
  net = HierarchicalNetwork(NetworkModel(bandwidth=10e9, latency=1e-3, num_sites=2),
                            intra_bandwidth=800e9, intra_latency=5e-6, per_site=4)
  report = dadjax.comm.report(state, net, step=ts, batch=_batch(0))
  assert report.intra_payload_bits_per_step == 8 * sum(intra.nbytes.values()) > 0
  assert report.modeled_intra_comm_s_per_step > 0
  assert report.setting == "ring, N=2 sites x 4 devices"


def test_hlo_method_collectives_run_only_over_the_site_axis():
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  ts, state, _ = _train("qsgd:8", mesh, steps=1)
  ops = collective_ops(ts._run.lower(state, ts.place_batch(_batch(0))).compile().as_text())
  links = {ts.link_of(op.groups) for op in ops}
  assert "mixed" not in links and "inter" in links
  # the site-axis program bits equal what the ledger booked (checked on the first step too)
  check = ts.ledger_check(state, _batch(1))
  assert check["program_bits"] <= check["booked_bits"]
  assert check["program_bits"] > 0


def test_replica_groups_parse_both_hlo_forms():
  from dadjax.comm._hlo import _replica_groups
  explicit = "channel_id=1, replica_groups={{0,4},{1,5},{2,6},{3,7}}, use_global_device_ids=true"
  iota = "channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true"
  assert _replica_groups(explicit) == _replica_groups(iota) == ((0, 4), (1, 5), (2, 6), (3, 7))
  assert _replica_groups("replica_groups=[2,4]<=[8], x") == ((0, 1, 2, 3), (4, 5, 6, 7))
  assert _replica_groups("replica_groups={}, x") == ()


def test_hierarchical_network_charges_each_link_class():
  inter = NetworkModel(bandwidth=10e9, latency=1e-3, num_sites=2)
  net = HierarchicalNetwork(inter, intra_bandwidth=800e9, intra_latency=5e-6, per_site=4)
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  ts, state, _ = _train("bf16", mesh, steps=1, shard_params=True)
  ops = ts.collectives(state, _batch(0), link="intra")
  summary = dadjax.comm.compiled_intra(dadjax.comm_stats(state), ops)
  intra_bits = summary.intra_bits_per_step
  assert intra_bits == 8 * sum(ops.nbytes.values()) > 0
  assert net.intra_time(summary) > 0
  assert net.step_time(summary) == pytest.approx(net.intra_time(summary) + inter.step_time(summary))
  assert HierarchicalNetwork(inter).intra_time(summary) == 0.0  # per_site=1: no in-site links
  with pytest.raises(ValueError, match="per_site must be"):
    HierarchicalNetwork(inter, per_site=0)


def test_config_per_site_trains_a_2d_mesh_and_rows_report_both_link_classes():
  from dadjax.config import Config, load_config
  from dadjax.errors import ConfigError
  from dadjax.train import train
  with pytest.raises(ConfigError, match="per_site=4 needs backend='shard_map'"):
    Config(num_sites=2, per_site=4, backend="vmap")
  root = pathlib.Path(__file__).parent.parent
  shipped = load_config(root / "experiments" / "configs" / "multislice.toml")
  assert (shipped.num_sites, shipped.per_site, shipped.intra_bandwidth) == (2, 4, 800e9)
  config = Config(num_sites=2, per_site=4, batch_per_site=8, steps=2, eval_every=2,
                  method="qsgd:8", model_kwargs={"hidden": [16]}, shard_params=True)
  run = train(config, progress=False)
  assert run.step_fn.mesh.devices.shape == (2, 4) and run.step_fn.per_site == 4
  row = run.history[-1]
  summary = dadjax.comm_stats(run.state)
  assert row["payload_bits_per_step"] == summary.bits_per_step
  assert row["intra_payload_bits_per_step"] > 0
  assert row["modeled_intra_comm_s_per_step"] > 0
  assert row["modeled_comm_s_per_step"] > row["modeled_intra_comm_s_per_step"]


# --- Parameters sharded within a site: FSDP, tensor parallelism, both --------------------------


def test_shard_dims_split_the_largest_divisible_dimension():
  params = {"kernel": np.zeros((12, 16)), "bias": np.zeros((5,)), "scalar": np.zeros(()),
            "square": np.zeros((8, 8)), "odd": np.zeros((3, 6))}
  assert dadjax.parallel.shard_dims(params, 4) == {
      "kernel": 1, "bias": None, "scalar": None, "square": 0, "odd": None}
  assert dadjax.parallel.shard_dims(params, 2)["odd"] == 1
  assert dadjax.parallel.shard_dims(params, 1)["kernel"] is None


# One method of every family, and the whole-tensor methods the old FSDP refused.
# Suite time: the default run keeps one method of each family; the rest run with -m slow.
_SLOW = pytest.mark.slow
FAMILIES = ["allreduce", pytest.param("bf16", marks=_SLOW), "ef(topk:0.1)", "powersgd:2",
            pytest.param("qsgd:8", marks=_SLOW), pytest.param("sign", marks=_SLOW),
            pytest.param("accordion(powersgd:2,powersgd:1,window=1,interval=1)", marks=_SLOW),
            "dad", pytest.param("rank_dad:2", marks=_SLOW), pytest.param("dad:bucket", marks=_SLOW),
            "dataquant:2:classes=5", "diloco:2:compress=powersgd(2)",
            # 4 x 4 blocks: a kernel's grid of blocks splits unevenly over the site's devices
            "sparseloco:2:k=3:chunk=4", pytest.param("demo:1:k=3:chunk=4", marks=_SLOW)]
LAYOUTS = {"tp": {"model": 4}, "fsdp_tp": {"fsdp": 2, "model": 2}}


@pytest.mark.parametrize("spec", FAMILIES)
@pytest.mark.parametrize("layout", [pytest.param("tp", marks=pytest.mark.slow), "fsdp_tp"])
def test_every_family_trains_a_sharded_model_like_the_replicated_one(spec, layout):
  mesh = dadjax.make_mesh(sites=2, inner=LAYOUTS[layout])
  fsdp = layout == "fsdp_tp"
  ts, state, metrics = _train(spec, mesh, steps=3, model=TPNet(), shard_params=fsdp)
  ref_ts, ref_state, ref_metrics = _train(spec, dadjax.make_mesh(2), steps=3, model=TPNet())
  # float order differs (GSPMD splits the products): rank-dAD's power iteration amplifies it
  tol = 5e-4 if spec.startswith("rank_dad") else 2e-5
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=tol, rtol=tol)
  np.testing.assert_allclose(np.asarray(metrics["loss"]), np.asarray(ref_metrics["loss"]),
                             rtol=1e-4)
  got, ref = dadjax.comm_stats(state), dadjax.comm_stats(ref_state)
  assert (got.reduce_bits, got.gather_bits, got.total_bits) == (
      ref.reduce_bits, ref.gather_bits, ref.total_bits)
  kernel = state.params["Dense_0"]["kernel"]  # (sites, 12, 32), columns over "model"
  assert kernel.sharding.spec == P("data", "fsdp" if fsdp else None, "model")
  assert kernel.addressable_shards[0].data.shape == (1, 12 // (2 if fsdp else 1),
                                                    32 // mesh.shape["model"])


def test_per_device_memory_follows_the_sharding():
  sizes = {}
  for name, kwargs in {"replicated": dict(mesh=dadjax.make_mesh(2)),
                       "fsdp": dict(mesh=dadjax.make_mesh(sites=2, per_site=4),
                                    shard_params=True),
                       "tp": dict(mesh=dadjax.make_mesh(sites=2, inner={"model": 4}),
                                  param_specs={"hidden_0": {"kernel": P(None, "model"),
                                                            "bias": P("model")},
                                               "hidden_1": {"kernel": P("model", None)}})}.items():
    ts = _step("ef(topk:0.1)", model=MLP(hidden=(64, 64), num_classes=8), opt=optax.adam(1e-3),
               **kwargs)
    state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
    sizes[name] = (_device_bytes(state.params), _device_bytes(state.opt_state))
  (p_rep, o_rep), (p_fsdp, o_fsdp), (p_tp, _) = sizes["replicated"], sizes["fsdp"], sizes["tp"]
  # FSDP over 4 devices: every leaf with a dimension 4 divides is split (the 5-wide head's
  # bias stays whole); Adam's moments and the error-feedback memory follow their parameters
  assert p_fsdp <= p_rep / 4 + 8 * 4 and o_fsdp <= o_rep / 4 + 64 * 4
  assert p_tp < p_rep / 2


@pytest.mark.parametrize("inner", [{"replica": 4}, {"fsdp": 2, "model": 2}])
def test_state_that_mirrors_no_parameter_is_split_over_the_site(inner):
  """PowerSGD's memories and Q factors, stacked per same-shape group, mirror no parameter:
  those of at least SPREAD_MIN_ENTRIES entries are split over the site's devices (ZeRO-1),
  and training is unchanged."""
  from dadjax.parallel._site_mesh import SPREAD_MIN_ENTRIES  # pylint: disable=g-import-not-at-top
  model = MLP(hidden=(128, 128, 128), num_classes=8)
  ts, state, _ = _train("powersgd:2", dadjax.make_mesh(sites=2, inner=inner), model=model,
                        shard_params=True)
  ref_ts, ref_state, _ = _train("powersgd:2", dadjax.make_mesh(2), model=model)
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=1e-5, rtol=1e-4)
  method_state = [x for x in jax.tree.leaves(state.opt_state)
                  if x.size // 2 >= SPREAD_MIN_ENTRIES]
  assert method_state  # the stacked (2, 128, 128) memory and more
  for x in method_state:
    assert x.addressable_shards[0].data.nbytes == x.nbytes // 2 // 4, (x.shape, x.sharding)
  # with the momentum split like its parameters, a device holds under a third of a site's state
  assert _device_bytes(state.opt_state) < _device_bytes(ref_state.opt_state) / 3


def test_whole_tree_optax_transformations_train_on_sharded_parameters():
  """What the hand-written FSDP refused (each device saw a slice) equals the replicated run."""
  for opt in (lambda: optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(0.1)),
              lambda: optax.lamb(1e-2)):
    ts, state, _ = _train("allreduce", dadjax.make_mesh(sites=2, per_site=4), opt=opt(),
                          shard_params=True)
    ref_ts, ref_state, _ = _train("allreduce", dadjax.make_mesh(2), opt=opt())
    chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=2e-6, rtol=1e-5)


def test_logical_partitioning_with_rules_and_activation_constraints():
  rules = (("batch", "data"), ("embed", "fsdp"), ("mlp", "model"))  # "data" is the site axis
  mesh = dadjax.make_mesh(sites=2, inner={"fsdp": 2, "model": 2})
  ts, state, _ = _train("powersgd:2", mesh, model=TPNet(logical=True), rules=rules)
  kernel = state.params["Dense_0"]["kernel"]
  assert kernel.sharding.spec == P("data", "fsdp", "model")
  # the same rules given as flax's context when the step is built
  with nn.logical_axis_rules(rules):
    ctx_ts = _step("powersgd:2", mesh, model=TPNet(logical=True))
  ctx_state = ctx_ts.init(jax.random.key(0), _batch(0)["x"][:2])
  for i in range(3):
    ctx_state, _ = ctx_ts(ctx_state, _batch(i))
  chex.assert_trees_all_close(ctx_ts.params(ctx_state), ts.params(state), atol=0)
  ref_ts, ref_state, _ = _train("powersgd:2", dadjax.make_mesh(2), model=TPNet(logical=True),
                                rules=None)
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=2e-5, rtol=2e-5)


def test_diloco_with_a_compressed_outer_gradient_on_sharded_parameters():
  """Regression: the hand-written FSDP crashed inside the step (incompatible shapes)."""
  mesh = dadjax.make_mesh(sites=2, per_site=4)
  ts, state, _ = _train("diloco:2:compress=powersgd(2)", mesh, steps=4, shard_params=True)
  ref_ts, ref_state, _ = _train("diloco:2:compress=powersgd(2)", dadjax.make_mesh(2), steps=4)
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=2e-5, rtol=2e-5)


def _text(tmp_path):
  line = b"the quick brown fox jumps over the lazy dog. "
  for i in range(8):
    (tmp_path / f"f{i}.txt").write_bytes(line * (12 + i))
  return f"text:{tmp_path}/*.txt"


@pytest.mark.parametrize("method", ["ef(topk:0.1)",
                                    pytest.param("powersgd:2", marks=pytest.mark.slow)])
def test_dadjax_train_shards_a_gpt_by_its_logical_rules(tmp_path, method):
  from dadjax.config import Config
  from dadjax.train import train
  base = dict(dataset=_text(tmp_path), dataset_kwargs={"seq_len": 16}, model="gpt_tiny",
              num_sites=2, batch_per_site=4, steps=3, eval_every=3, lr=0.1, method=method)
  sharded = train(Config(**base, mesh_inner={"fsdp": 2, "model": 2}, rules="fsdp_tp"),
                  progress=False)
  ref = train(Config(**base, backend="vmap"), progress=False)
  got, want = sharded.step_fn.params(sharded.state), ref.step_fn.params(ref.state)
  chex.assert_trees_all_close(got, want, atol=5e-5, rtol=5e-4)
  # the scanned blocks' kernels stack layers and are split over both in-site axes
  specs = {str(x.sharding.spec) for x in jax.tree.leaves(sharded.state.params)
           if np.ndim(x) == 4}
  assert any("fsdp" in s and "model" in s for s in specs), specs
  assert sharded.step_fn.layer_axes and all(a == 0 for a in sharded.step_fn.layer_axes.values())
  from dadjax.errors import ConfigError
  with pytest.raises(ConfigError, match="config.mesh_inner must map"):
    Config(**base, mesh_inner={"data": 2})
  with pytest.raises(ConfigError, match="config.rules must be one of"):
    Config(**base, rules="megatron")


def test_the_xla_workarounds_give_the_unsharded_numbers():
  """Two programs a partially manual site program can hold abort XLA:CPU on some machines (jax
  0.10): the gradient of a lookup in a table sharded over an automatic axis, and a bf16
  all-reduce over the manual axis. dadjax avoids both (the GPT reads its table whole inside a
  site; on CPU, bf16 sums are gathered and summed in fp32). Both routes must give the numbers
  of the unsharded program."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from dadjax.comm import metered_psum
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  rng = np.random.default_rng(0)
  table = rng.normal(size=(2, 64, 32)).astype(np.float32)
  ids = rng.integers(0, 64, size=(8, 4)).astype(np.int32)

  def site(t, x):
    whole = jax.lax.with_sharding_constraint(
        t[0], NamedSharding(jax.sharding.get_abstract_mesh(), P()))
    grad = jax.grad(lambda w: jnp.mean(jnp.take(w, x, axis=0) ** 2))(whole)
    total, _ = metered_psum(t[0].astype(jnp.bfloat16), "data")
    return grad[None], total.astype(jnp.float32)[None]

  run = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P("data"), P("data")),
                              out_specs=(P("data"), P("data")), axis_names={"data"}))
  grad, total = run(jax.device_put(table, NamedSharding(mesh, P("data", None, "model"))),
                    jax.device_put(ids, NamedSharding(mesh, P("data"))))
  for s in range(2):
    want = jax.grad(lambda w: jnp.mean(jnp.take(w, ids[4 * s:4 * s + 4], axis=0) ** 2))(table[s])
    np.testing.assert_allclose(grad[s], want, rtol=1e-6, atol=1e-7)
  want_total = np.asarray(jnp.asarray(table, jnp.bfloat16).astype(jnp.float32).sum(0))
  np.testing.assert_allclose(total[0], want_total, rtol=1e-2, atol=1e-2)
  np.testing.assert_array_equal(total[0], total[1])


def test_bf16_compute_from_fp32_master_weights():
  from dadjax.config import Config
  from dadjax.errors import ConfigError
  from dadjax.train import train
  mesh = dadjax.make_mesh(sites=2, inner={"model": 4})
  ts, state, _ = _train("allreduce", mesh, model=TPNet(), compute_dtype=jnp.bfloat16)
  ref_ts, ref_state, _ = _train("allreduce", mesh, model=TPNet())
  params = jax.tree.leaves(state.params)
  assert all(x.dtype == jnp.float32 for x in params)  # master weights stay fp32
  # the method averaged fp32 gradients: the same bits as the fp32 run
  assert dadjax.comm_stats(state).total_bits == dadjax.comm_stats(ref_state).total_bits
  got, want = ts.params(state), ref_ts.params(ref_state)
  diff = max(float(np.max(np.abs(a - b))) for a, b in zip(jax.tree.leaves(got),
                                                            jax.tree.leaves(want)))
  assert 0 < diff < 5e-3  # bf16 rounding in the forward and backward pass, no more
  with pytest.raises(ValueError, match="compute_dtype must be a floating dtype"):
    _step("allreduce", mesh, model=TPNet(), compute_dtype=jnp.int8)
  with pytest.raises(ConfigError, match="config.compute_dtype must be one of"):
    Config(compute_dtype="fp8")
  run = train(Config(num_sites=2, batch_per_site=8, steps=2, eval_every=2, backend="vmap",
                     compute_dtype="bfloat16", model_kwargs={"hidden": [16]}), progress=False)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(run.state.params))
  assert np.isfinite(run.final["loss"])


def test_nnx_sharding_metadata_lays_out_the_site():
  from flax import nnx

  class NnxTP(nnx.Module):
    def __init__(self, rngs):
      init = nnx.initializers.lecun_normal()
      self.up = nnx.Linear(12, 32, kernel_init=nnx.with_partitioning(init, (None, "model")),
                           rngs=rngs)
      self.down = nnx.Linear(32, 5, kernel_init=nnx.with_partitioning(init, ("model", None)),
                             rngs=rngs)

    def __call__(self, x):
      return self.down(nnx.relu(self.up(x)))

  with nnx.use_eager_sharding(False):  # metadata only: the step places the arrays
    net = NnxTP(nnx.Rngs(0))
  mesh = dadjax.make_mesh(sites=2, inner={"model": 4})
  ts = dadjax.make_train_step(net, optax.chain(dadjax.compressed(dadjax.powersgd(2)),
                                               optax.sgd(0.1)), mesh=mesh)
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  for i in range(2):
    state, _ = ts(state, _batch(i))
  assert state.params["up"]["kernel"].sharding.spec == P("data", None, "model")
  assert state.params["down"]["kernel"].sharding.spec == P("data", "model")
  ref = dadjax.make_train_step(net, optax.chain(dadjax.compressed(dadjax.powersgd(2)),
                                                optax.sgd(0.1)), mesh=dadjax.make_mesh(2))
  ref_state = ref.init(jax.random.key(0), _batch(0)["x"][:2])
  for i in range(2):
    ref_state, _ = ref(ref_state, _batch(i))
  chex.assert_trees_all_close(ts.params(state), ref.params(ref_state), atol=2e-5, rtol=2e-5)


def _catalog():
  from test_step_refusals import _method_specs  # every registered method, with its arguments
  return _method_specs()


@pytest.mark.slow  # every catalog method, 20 steps, on both sharded layouts (~10 min)
@pytest.mark.parametrize("spec", _catalog())
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_catalog_method_trains_a_sharded_model_for_20_steps(spec, layout):
  mesh = dadjax.make_mesh(sites=2, inner=LAYOUTS[layout])
  ts, state, _ = _train(spec, mesh, steps=20, model=TPNet(), shard_params=layout == "fsdp_tp")
  ref_ts, ref_state, _ = _train(spec, dadjax.make_mesh(2), steps=20, model=TPNet())
  tol = 5e-3 if "rank_dad" in spec else 1e-4  # float order, amplified by power iterations
  chex.assert_trees_all_close(ts.params(state), ref_ts.params(ref_state), atol=tol, rtol=tol)
  assert dadjax.comm_stats(state).total_bits == dadjax.comm_stats(ref_state).total_bits
