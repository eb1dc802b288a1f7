"""The GPT decoder (dadjax.models.GPT): scanned / rematerialized blocks, logical partitioning,
dAD through dot_general_cls, the FSDP / TP rules, and the dry run's memory numbers."""

import functools
import math

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from dadjax import cli, dad, models
from dadjax.config import load_config
from dadjax.models import GPT, gpt_memory, gpt_rules, make_gpt

TINY = models.gpt_config("gpt_tiny")


def _tokens(shape, seed=0, vocab=256):
  return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), jnp.int32)


def _loss(model, params, x, y, **apply_kw):
  logits = model.apply({"params": params}, x, **apply_kw)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _count(fields: dict) -> int:
  """Parameters of a GPT from its fields, counted by hand (no Flax)."""
  d, m, v, n = fields["d_model"], fields["mlp_dim"], fields["vocab_size"], fields["num_layers"]
  block = 4 * d * d + 2 * d * m + 2 * 2 * d  # q, k, v, out; mlp in, out; two LayerNorms
  total = v * d + n * block + 2 * d  # embedding, blocks, final LayerNorm
  if fields["positions"] == "learned":
    total += fields["max_len"] * d
  if not fields["tie_embeddings"]:
    total += d * v
  return total


def test_gpt_tiny_init_apply_shapes_and_causality():
  model = models.get_model("gpt_tiny", 10)  # registered by name; num_classes is not a field
  x = _tokens((3, 12))
  variables = jax.jit(model.init)(jax.random.key(0), x)
  apply = jax.jit(model.apply)
  logits = apply(variables, x)
  chex.assert_shape(logits, (3, 12, TINY["vocab_size"]))
  assert logits.dtype == jnp.float32
  params = nn.unbox(variables["params"])
  n = TINY["num_layers"]
  chex.assert_shape(params["layers"]["query"]["kernel"], (n, 64, 4, 16))
  chex.assert_shape(params["layers"]["mlp_in"]["kernel"], (n, 64, 256))
  assert models.gpt_param_count(model) == _count(TINY)
  # Position t sees tokens 0..t only.
  x2 = x.at[:, 7:].set((x[:, 7:] + 1) % 256)
  chex.assert_trees_all_close(apply(variables, x2)[:, :7], logits[:, :7], atol=1e-5)
  assert not np.allclose(apply(variables, x2)[:, 7:], logits[:, 7:])


def test_every_parameter_is_logically_named_and_scanned_kernels_lead_with_layers():
  model = make_gpt("gpt_tiny", tie_embeddings=False, positions="learned")
  boxed = jax.eval_shape(model.init, jax.random.key(0), _tokens((2, 8)))["params"]
  leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
  assert all(isinstance(x, nn.LogicallyPartitioned) for x in leaves)
  specs = nn.get_partition_spec(boxed)
  layers = specs["layers"]
  assert layers["query"]["kernel"] == P("layers", "embed", "heads", "kv")
  assert layers["out"]["kernel"] == P("layers", "heads", "kv", "embed")
  assert layers["mlp_in"]["kernel"] == P("layers", "embed", "mlp")
  assert layers["mlp_out"]["kernel"] == P("layers", "mlp", "embed")
  assert layers["ln_attn"]["scale"] == P("layers", "embed")
  assert specs["embed"]["embedding"] == P("vocab", "embed")
  assert specs["head"]["kernel"] == P("embed", "vocab")
  assert specs["pos_embed"] == P(None, "embed")
  # The placement reads the stacking axis from the same metadata.
  from dadjax.parallel import layer_axes_of  # pylint: disable=g-import-not-at-top
  axes = layer_axes_of(boxed)
  assert axes and set(axes.values()) == {0} and all(k.startswith("layers") for k in axes)


def test_tied_and_untied_parameter_counts():
  tied, untied = make_gpt("gpt_tiny"), make_gpt("gpt_tiny", tie_embeddings=False)
  x = _tokens((2, 8))
  p_tied = nn.unbox(jax.eval_shape(tied.init, jax.random.key(0), x)["params"])
  p_untied = nn.unbox(jax.eval_shape(untied.init, jax.random.key(0), x)["params"])
  assert "head" not in p_tied and p_untied["head"]["kernel"].shape == (64, 256)
  d, v = TINY["d_model"], TINY["vocab_size"]
  assert models.gpt_param_count(untied) - models.gpt_param_count(tied) == d * v
  for name in ("gpt_cpu", "gpt_125m", "gpt_1b"):
    assert models.gpt_param_count(make_gpt(name)) == _count(models.gpt_config(name))
  assert models.gpt_param_count(make_gpt("gpt_cpu")) >= 5_000_000


def test_rotary_and_learned_positions():
  x = _tokens((2, 16))
  rotary, learned = make_gpt("gpt_tiny"), make_gpt("gpt_tiny", positions="learned")
  p_r = nn.unbox(jax.eval_shape(rotary.init, jax.random.key(0), x)["params"])
  p_l = nn.unbox(jax.jit(learned.init)(jax.random.key(0), x)["params"])
  assert "pos_embed" not in p_r and p_l["pos_embed"].shape == (TINY["max_len"], TINY["d_model"])
  # Same weights, different position coding: different outputs.
  shared = {k: v for k, v in p_l.items() if k != "pos_embed"}
  assert not np.allclose(jax.jit(rotary.apply)({"params": shared}, x),
                         jax.jit(learned.apply)({"params": p_l}, x), atol=1e-4)
  # Rotary scores depend on the offset only: <R_i q, R_j k> == <R_{i+s} q, R_{j+s} k>.
  from dadjax.models._gpt import _rotary  # pylint: disable=g-import-not-at-top
  q, k = (jax.random.normal(jax.random.key(i), (1, 1, 2, 16)) for i in (1, 2))
  score = lambda i, j: jnp.sum(_rotary(q, jnp.array([i])) * _rotary(k, jnp.array([j])), -1)
  np.testing.assert_allclose(score(3, 1), score(10, 8), rtol=1e-4, atol=1e-5)
  assert not np.allclose(score(3, 1), score(3, 2), atol=1e-3)
  with pytest.raises(ValueError, match="positions"):
    make_gpt("gpt_tiny", positions="alibi")


def _tiny(**options):
  """``(model, params, x, y)``: gpt_tiny with ``options``, its parameters, two 16-token rows and
  their targets."""
  x, y = _tokens((2, 16)), _tokens((2, 16), seed=1)
  model = make_gpt("gpt_tiny", **options)
  return model, nn.unbox(jax.jit(model.init)(jax.random.key(0), x)["params"]), x, y


def test_remat_and_scan_do_not_change_the_loss_or_the_gradient():
  ref, params, x, y = _tiny(remat="none")
  want = jax.jit(jax.value_and_grad(functools.partial(_loss, ref)))(params, x, y)
  got = jax.jit(jax.value_and_grad(functools.partial(_loss, make_gpt("gpt_tiny"))))(params, x, y)
  chex.assert_trees_all_close(got, want, atol=1e-6, rtol=1e-5)  # default: nothing_saveable
  # The unrolled twin with the stacked parameters split per layer.
  unrolled = make_gpt("gpt_tiny", scan_layers=False)
  split = {k: v for k, v in params.items() if k != "layers"}
  for i in range(TINY["num_layers"]):
    split[f"block_{i}"] = jax.tree.map(lambda a, i=i: a[i], params["layers"])
  chex.assert_trees_all_close(jax.jit(functools.partial(_loss, unrolled))(split, x, y), want[0],
                              atol=1e-6, rtol=1e-5)
  with pytest.raises(ValueError, match="remat"):
    make_gpt("gpt_tiny", remat="save_only_these_names")


def test_bf16_compute_keeps_fp32_parameters_and_gradients():
  model, params, x, y = _tiny(dtype="bfloat16")
  assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
  loss, grads = jax.jit(jax.value_and_grad(functools.partial(_loss, model)))(params, x, y)
  assert {a.dtype for a in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
  jaxpr = str(jax.make_jaxpr(lambda p: model.apply({"params": p}, x))(params))
  assert "bf16" in jaxpr and model.apply({"params": params}, x).dtype == jnp.float32
  # bf16 rounding moves the loss a little, not a lot.
  ref = jax.jit(functools.partial(_loss, make_gpt("gpt_tiny")))(params, x, y)
  assert abs(float(loss) - float(ref)) < 0.05 and np.isfinite(float(loss))
  with pytest.raises(ValueError, match="dtype"):
    make_gpt("gpt_tiny", dtype="int8")


@pytest.mark.parametrize("sites", [1, 2])
def test_dad_dot_general_gradient_equals_the_plain_gradient(sites):
  # vmap over the site axis "data": with exact dAD every dense kernel's gradient is the mean
  # over the sites of the plain per-site gradients (1 site: plain jax.grad itself); the
  # embedding and LayerNorms are not dAD layers and keep their local gradient.
  x, y = _tokens((sites, 2, 8)), _tokens((sites, 2, 8), seed=1)
  plain = make_gpt("gpt_tiny", tie_embeddings=False)
  params = nn.unbox(jax.jit(plain.init)(jax.random.key(0), x[0])["params"])
  local = jax.jit(jax.vmap(jax.grad(functools.partial(_loss, plain)), in_axes=(None, 0, 0)))(
      params, x, y)
  model = make_gpt("gpt_tiny", tie_embeddings=False, dot_general_cls=dad.DotGeneral)

  def dad_grad(x, y):
    def loss(p):
      logits, _ = model.apply({"params": p}, x, mutable=["dad_state", "comm"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return jax.grad(loss)(params)

  got = jax.jit(jax.vmap(dad_grad, axis_name="data"))(x, y)
  mean = jax.tree.map(lambda g: g.mean(0), local)
  for path in (("layers", "query"), ("layers", "out"), ("layers", "mlp_in"),
               ("layers", "mlp_out"), ("head",)):
    g, m = functools.reduce(dict.__getitem__, path, got), functools.reduce(dict.__getitem__,
                                                                          path, mean)
    for s in range(sites):
      chex.assert_trees_all_close(g["kernel"][s], m["kernel"], atol=1e-5, rtol=1e-4)
  chex.assert_trees_all_close(got["embed"], local["embed"], atol=1e-6)


def test_a_dad_methods_factory_reaches_every_projection():
  factory = dad.DenseFactory(axis_name="data")
  model = models.get_model("gpt_tiny", 256, dense=factory)
  params = jax.eval_shape(model.init, jax.random.key(0), _tokens((2, 8)))["params"]
  mask = factory.mask(nn.unbox(params))
  assert all(mask["layers"][n]["kernel"] for n in ("query", "key", "value", "out", "mlp_in",
                                                   "mlp_out"))
  assert not any(jax.tree.leaves(mask["embed"])) and not any(jax.tree.leaves(mask["ln_final"]))
  with pytest.raises(ValueError, match="dense"):
    GPT(dense=lambda *a, **k: None)


def _spec(rules, names):
  return P(*nn.logical_to_mesh_axes(names, rules))


def test_rules_give_fsdp_tp_and_both():
  for kind in ("fsdp", "tp", "fsdp_tp", "replicated"):
    rules = gpt_rules(kind)
    assert "data" not in str(rules)  # the site axis is manual
    names = {n for n, _ in rules}
    assert {"batch", "length", "embed", "mlp", "heads", "kv", "vocab", "layers"} <= names
  fsdp, tp, both = gpt_rules("fsdp"), gpt_rules("tp"), gpt_rules("fsdp_tp")
  mlp_in, out = ("layers", "embed", "mlp"), ("layers", "heads", "kv", "embed")
  act = ("batch", "length", "embed")
  assert _spec(fsdp, mlp_in) == P(None, "fsdp", None)
  assert _spec(fsdp, act) == P("fsdp", None, None)  # batch over fsdp; embed then stays whole
  assert _spec(tp, mlp_in) == P(None, None, "model")  # column-parallel
  assert _spec(tp, ("layers", "mlp", "embed")) == P(None, "model", None)  # row-parallel
  assert _spec(tp, out) == P(None, "model", None, None)
  assert _spec(tp, act) == P(None, None, None)
  assert _spec(both, mlp_in) == P(None, "fsdp", "model")
  assert _spec(both, ("batch", "length", "mlp")) == P("fsdp", None, "model")
  assert _spec(both, ("vocab", "embed")) == P("model", "fsdp")
  with pytest.raises(ValueError, match="kind"):
    gpt_rules("zero3")


@pytest.mark.slow
@pytest.mark.parametrize("kind, inner", [("tp", {"model": 4}), ("fsdp", {"fsdp": 4}),
                                         ("fsdp_tp", {"fsdp": 2, "model": 2})])
def test_trains_on_sites_of_four_devices_as_on_one(kind, inner):
  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax.parallel import make_mesh, unstack_site  # pylint: disable=g-import-not-at-top
  model = make_gpt("gpt_tiny")
  x = np.random.default_rng(0).integers(0, 256, (16, 17)).astype(np.int32)
  batch = {"x": x[:, :-1], "y": x[:, 1:]}

  def run(**placement):
    tx = optax.chain(dadjax.allreduce("data"), optax.adam(1e-3))
    step = dadjax.make_train_step(model, tx, **placement)
    state = step.init(jax.random.key(0), batch["x"][:8])
    for _ in range(3):
      state, _ = step(state, batch)
    return state

  ref = run(num_sites=2, backend="vmap")
  got = run(mesh=make_mesh(sites=2, inner=inner), rules=gpt_rules(kind))
  kernel = got.params["layers"]["mlp_in"]["kernel"]  # (site, layers, embed, mlp)
  want = {"tp": P("data", None, None, "model"), "fsdp": P("data", None, "fsdp"),
          "fsdp_tp": P("data", None, "fsdp", "model")}[kind]
  assert kernel.sharding.spec == want
  chex.assert_trees_all_close(unstack_site(got.params), unstack_site(ref.params), atol=1e-5)


def test_gpt_memory_equals_an_independent_count():
  fields = models.gpt_config("gpt_125m")
  count = _count(fields)
  mem = gpt_memory("gpt_125m", {"data": 2, "fsdp": 16, "model": 1}, "fsdp", batch_per_site=16,
                   seq_len=1024)
  assert mem.param_count == count
  # Every parameter has an "embed" axis (768 = 48 x 16): split 16 ways.
  assert mem.params == count * 4 // 16 and mem.grads == mem.params
  assert mem.optimizer == 2 * mem.params
  assert mem.specs["layers"]["mlp_in"]["kernel"] == P(None, "fsdp")
  assert mem.total == mem.params + mem.grads + mem.optimizer + mem.activations
  assert mem.fits(16 * 2**30)
  # TP: mlp / heads / vocab kernels split 4 ways, LayerNorms whole.
  tp = gpt_memory("gpt_125m", {"data": 2, "model": 4}, "tp", batch_per_site=16, seq_len=1024)
  d, m, n, v = 768, 3072, 12, fields["vocab_size"]
  whole = fields["max_len"] * d + n * 4 * d + 2 * d
  assert tp.params == 4 * ((count - whole) // 4 + whole)
  assert tp.specs["layers"]["out"]["kernel"] == P(None, "model")
  assert 2 * gpt_memory("gpt_125m", {"data": 1}, "fsdp", batch_per_site=16).activations > (
      gpt_memory("gpt_125m", {"data": 1}, "fsdp", batch_per_site=8).activations)
  assert gpt_memory("gpt_tiny", {"data": 8}, sites_per_device=8).params == 8 * 4 * _count(TINY)
  with pytest.raises(ValueError, match="site axis"):
    gpt_memory("gpt_tiny", {"data": 2, "fsdp": 4}, (("embed", "data"),))
  with pytest.raises(ValueError, match="mesh_shape"):
    gpt_memory("gpt_tiny", {"fsdp": 4})
  with pytest.raises(ValueError, match="seq_len"):
    gpt_memory("gpt_tiny", seq_len=10 ** 6)
  del v


def test_the_activation_estimate_is_near_xlas_compiled_temp_memory():
  # The estimate against what XLA allocates for one loss + gradient (abstract inputs: nothing
  # allocated); measured 0.8x-1.25x at gpt_tiny .. gpt_1b with the default remat.
  model, batch = make_gpt("gpt_tiny", vocab_size=1024, num_layers=4), 16
  shapes = nn.unbox(jax.eval_shape(lambda k: model.init(k, _tokens((1, 8)))["params"],
                                   jax.random.key(0)))
  x = jax.ShapeDtypeStruct((batch, 64), jnp.int32)
  compiled = jax.jit(jax.grad(functools.partial(_loss, model))).lower(shapes, x, x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  est = gpt_memory(model, batch_per_site=batch, seq_len=64).activations
  assert 0.5 * temp < est < 2 * temp


def test_sharded_parameter_bytes_equal_xlas_per_device_arguments():
  # FSDP x TP over 8 CPU devices: the dry run's per-device parameter bytes are exactly what XLA
  # compiles as each device's arguments; its activation estimate is near XLA's temp memory.
  # (Also the regression of nn.DenseGeneral, whose flat-drawn multi-axis kernel failed its own
  # sharding constraint under a mesh with logical rules.)
  model, rules = make_gpt("gpt_tiny"), gpt_rules("fsdp_tp")
  mem = gpt_memory(model, {"data": 1, "fsdp": 4, "model": 2}, rules, batch_per_site=8,
                   seq_len=64, optimizer="none")
  mesh = jax.make_mesh((4, 2), ("fsdp", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  shapes = nn.unbox(jax.eval_shape(lambda k: model.init(k, _tokens((1, 8)))["params"],
                                   jax.random.key(0)))
  shard = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), mem.specs,
                       is_leaf=lambda s: isinstance(s, P))

  def grad(p, x):
    with nn.logical_axis_rules(rules):
      return jax.grad(functools.partial(_loss, model))(p, x, x)

  x = jax.ShapeDtypeStruct((8, 64), jnp.int32)
  rows = jax.sharding.NamedSharding(mesh, P("fsdp"))
  with jax.set_mesh(mesh):
    compiled = jax.jit(grad, in_shardings=(shard, rows), out_shardings=shard).lower(
        shapes, x).compile()
  analysis = compiled.memory_analysis()
  assert analysis.argument_size_in_bytes == mem.params + 8 * 64 * 4 // 4  # + one row shard
  assert 0.5 * analysis.temp_size_in_bytes < mem.activations < 2 * analysis.temp_size_in_bytes


@pytest.mark.parametrize("model, extra, mesh, fits", [
    ("gpt_1b", [], "data=2 x fsdp=16", True),
    ("gpt_1b", ['mesh_inner={"fsdp": 4, "model": 4}', "rules=fsdp_tp"], "data=2 x fsdp=4 x model=4",
     True),
    # TP alone over 16 chips: 8 heads do not split 16 ways and the batch is not split at all.
    ("gpt_1b", ["--mesh", "data=2,model=16", "--rules", "tp"], "data=2 x model=16", False),
    ("gpt_125m", ['dataset_kwargs={"seq_len": 1024}'], "data=2 x fsdp=16", True)])
def test_the_dryrun_command_prints_memory_that_fits_v5e(capsys, model, extra, mesh, fits):
  argv = ["dryrun", "experiments/configs/gpt_v5e.toml", f"model={model}", "--hbm-gib", "16", *extra]
  assert cli.main(argv) == 0
  out = capsys.readouterr().out
  assert f"model={model}" in out and f"mesh            {mesh} " in out
  assert ("does NOT fit in 16 GiB HBM" in out) == (not fits)
  assert ("  fits in 16 GiB HBM" in out) == fits
  count = models.gpt_param_count(make_gpt(model))
  assert f"{count:,}" in out
  assert cli.main(["dryrun", "experiments/configs/gpt_v5e.toml", "--mesh", "data=two"]) == 2


def test_the_configs_load_and_name_gpt_models():
  for name in ("gpt_cpu", "gpt_gpu", "gpt_v5e"):
    config = load_config(f"experiments/configs/{name}.toml")
    assert config.model in models.GPT_CONFIGS
  v5e = load_config("experiments/configs/gpt_v5e.toml")
  assert (v5e.num_sites, v5e.per_site) == (2, 16)


def test_gpt_tiny_trains_from_a_config(tmp_path):
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  line = b"the quick brown fox jumps over the lazy dog. "
  for i in range(12):
    (tmp_path / f"f{i}.txt").write_bytes(line * (20 + i))
  cfg = Config(dataset=f"text:{tmp_path}/*.txt", dataset_kwargs={"seq_len": 16},
               model="gpt_tiny", num_sites=2, batch_per_site=8, steps=20, eval_every=20,
               backend="vmap", optimizer="adam", lr=1e-2, partition="by_class")
  final = train(cfg, progress=False).final
  # Untrained: about 8 bits per byte; the repeated line is learnt within 20 steps.
  assert final["test_bits_per_byte"] < 6.0 and math.isfinite(final["train_bits_per_byte"])
