"""The bytes the compiled collectives move are the bits the ledger records.

Compiles a shard_map program over 8 CPU devices that holds only the
method's communication (the compressor's update on ResNet-18-shaped
gradients, or a dAD model's backward pass and :func:`dadjax.dad.synchronize`;
no metrics), reads every collective op of the optimized HLO with
:func:`dadjax.comm.hlo_collectives` and compares, per kind, the operand
bytes with the ledger's payload bits, and the op count with what the
network model charges. ResNet-18 has its 62 parameter leaves at width 4
(instead of 64) to keep compilation fast; the shapes' structure is the same.
"""

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import compress as C
from dadjax import dad
from dadjax.comm import hlo_collectives
from dadjax.comm._wire import latency_messages
from dadjax.models import ResNet18
from dadjax.parallel import softmax_cross_entropy, stack_sites
from helpers import compiled_dad_step

SITES = 8


def test_parser_on_known_text():
  hlo = """
HloModule m

%branch (p: f32[2]) -> f32[2] {
  %p = f32[2]{0} parameter(0)
  ROOT %r = f32[2]{0} all-reduce(%p), channel_id=3, to_apply=%add
}

%other (p: f32[2]) -> f32[2] {
  ROOT %p = f32[2]{0} parameter(0)
}

ENTRY %main (a: f32[4,3], b: u32[5], /*index=2*/c: pred[]) -> f32[4,3] {
  %p.1 = f32[4,3]{1,0} parameter(0)
  %w = u32[5]{0} parameter(1)
  %ar = (f32[4,3]{1,0}, f32[2]{0}) all-reduce(%p.1, f32[2]{0} %q), channel_id=1, to_apply=%add
  %ag = u32[8,5]{1,0} all-gather(%w), dimensions={0}
  %ags = (u32[5]{0}, u32[40]{0}) all-gather-start(u32[5]{0} %w), dimensions={0}
  %agd = u32[40]{0} all-gather-done(%ags)
  %t = (f32[1]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, /*index=5*/f32[3]{0}) parameter(2)
  %ar6 = (f32[1]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, f32[1]{0}, /*index=5*/f32[3]{0}) all-reduce(%a1, %a1, %a1, %a1, %a1, /*index=5*/%b3), to_apply=%add
  %a1 = f32[1]{0} parameter(3)
  %b3 = f32[3]{0} parameter(4)
  %c = (f32[2]{0}) conditional(%pred, %x, %y), branch_computations={%branch, %other}
}
"""
  ops = hlo_collectives(hlo)
  assert ops.nbytes["reduce"] == 48 + 8 + 8 + 4 * 8 and ops.nbytes["gather"] == 20 + 20
  assert ops.count["reduce"] == 3 and ops.count["gather"] == 2 and ops.ops == 5
  assert ops.conditional_count["reduce"] == 1 and ops.conditional_nbytes["reduce"] == 8
  assert ops.conditional_count["gather"] == 0


def _charged(ops, stats, latency=1e-3, bandwidth=1e9):
  """What the ring model must charge: wire bits over bandwidth, latency per compiled op."""
  n = SITES
  return (2 * (n - 1) / n * stats.reduce_bits[0] / bandwidth + (n - 1) * stats.gather_bits[0]
          / bandwidth + latency * (latency_messages("reduce", n) * ops.count["reduce"]
                                   + latency_messages("gather", n) * ops.count["gather"]))


def _check(compiled, stats, reduce_widening=1):
  ops = hlo_collectives(compiled.as_text())
  moved = {k: 8 * ops.nbytes[k] for k in ("reduce", "gather")}
  ledger = {"reduce": reduce_widening * stats.reduce_bits[0], "gather": stats.gather_bits[0]}
  assert moved == ledger, (moved, ledger, ops)
  assert ops.count["reduce_scatter"] == ops.count["all_to_all"] == ops.count["permute"] == 0
  assert stats.reduce_bits == (stats.reduce_bits[0],) * SITES  # every site sends the same
  net = dadjax.NetworkModel(bandwidth=1e9, latency=1e-3, num_sites=SITES)
  assert net.step_time(stats, ops) == pytest.approx(_charged(ops, stats))
  return ops


def _params():
  k = jax.random.split(jax.random.key(0), 4)
  return {"w": jax.random.normal(k[0], (10, 16)), "b": jax.random.normal(k[1], (16,)),
          "conv": jax.random.normal(k[2], (3, 3, 4, 8)), "v": jax.random.normal(k[3], (40, 6))}


def _mixed_params():
  """Leaves of every kind the one-buffer and the same-shape forms must cut right: bf16, scalar,
  one entry, empty, and repeated shapes (a group of three, of two, and bf16 beside fp32)."""
  k = jax.random.split(jax.random.key(2), 7)
  return {**_params(), "h": jax.random.normal(k[0], (7, 5)).astype(jnp.bfloat16),
          "s": jax.random.normal(k[1], ()), "one": jax.random.normal(k[2], (1,)),
          "e": jnp.zeros((0, 3)), "w2": jax.random.normal(k[3], (10, 16)),
          "w3": 1e-3 * jax.random.normal(k[4], (10, 16)), "b2": jax.random.normal(k[5], (16,)),
          "h32": jax.random.normal(k[6], (7, 5)), "e2": jnp.zeros((0, 3))}


@pytest.mark.parametrize("spec, kind", [
    ("topk:0.1", "gather"), ("ef_topk:0.1", "gather"), ("qsgd:4", "gather"),
    ("sign", "gather"), ("powersgd:2", "reduce"), ("randomk:0.25", "reduce"),
])
def test_compiled_collectives_move_the_ledger_bits(spec, kind):
  # _run_update asserts compiled operand bytes == ledger bits and op count == what is charged.
  ops = _run_update(_params(), C.compressed(C.get_compressor(spec), axis_name="data"), kind)
  other = "reduce" if kind == "gather" else "gather"
  assert ops.count[kind] >= 1 and ops.nbytes[other] == 0  # one kind of collective, as declared


def _resnet_params():
  model = ResNet18(width=4)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8, 8, 3))))
  leaves, treedef = jax.tree.flatten(shapes["params"])
  assert len(leaves) == 62
  keys = jax.random.split(jax.random.key(1), len(leaves))
  return jax.tree.unflatten(treedef, [jax.random.normal(k, l.shape) for k, l in zip(keys, leaves)])


@pytest.mark.parametrize("spec, kind", [
    ("allreduce", "reduce"), ("bf16", "reduce"), ("topk:0.01", "gather"), ("qsgd:4", "gather"),
    ("sign", "gather"), pytest.param("powersgd:1", "reduce", marks=pytest.mark.slow),
    ("powersgd:4", "reduce"),
])
def test_resnet18_compiled_bytes_equal_ledger_and_model_charges_ops(spec, kind):
  ops = _resnet_ops(spec, kind)
  if spec == "allreduce":
    assert 8 * ops.nbytes["reduce"] == 32 * sum(
        math.prod(x.shape) for x in jax.tree.leaves(_resnet_params()))


@functools.lru_cache(maxsize=None)
def _resnet_ops(spec, kind):
  """:func:`_run_update` of ``spec`` on the ResNet-18 gradients, compiled once per module run
  (the bytes and bucketing tests read the same program; every check runs on the first call)."""
  if spec == "allreduce":
    tx = dadjax.allreduce("data")
  else:
    tx = C.compressed(C.get_compressor(spec), axis_name="data")
  # XLA:CPU has no bf16 all-reduce: it widens the operands to f32, so on CPU
  # the compiled program moves twice the bf16 payload (GPU/TPU reduce bf16).
  widening = 2 if spec == "bf16" and jax.default_backend() == "cpu" else 1
  return _run_update(_resnet_params(), tx, kind, widening)


def _run_update(params, tx, kind, widening=1):
  mesh = dadjax.make_mesh(SITES, "data")
  grads = jax.tree.map(lambda x: jnp.stack([x + i for i in range(SITES)]), params)
  state = stack_sites(tx.init(params), SITES)

  def site(g, s):
    g, s = jax.tree.map(lambda x: x[0], (g, s))
    u, s = tx.update(g, s)
    return jax.tree.map(lambda x: x[None], (u, s))

  step = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=P("data")))
  compiled = step.lower(grads, state).compile()
  _, new_state = compiled(grads, state)
  stats = dadjax.comm_stats(new_state)
  ops = _check(compiled, stats, widening)
  assert ops.count[kind] >= 1 and ops.nbytes[kind] > 0
  return ops


class _DadNet(nn.Module):
  """dAD input and head layers around a plain layer that synchronize() all-reduces."""

  kw: tuple = ()
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    kw = dict(self.kw)
    h = dad.Dense(10, use_bias=self.use_bias, name="inp", **kw)(x)
    h = nn.Dense(10, name="plain")(jnp.tanh(h))
    return dad.Dense(3, use_bias=self.use_bias, name="head", **kw)(jnp.tanh(h))


@pytest.mark.parametrize("kw, use_bias, dtype", [
    ((("mode", "exact"),), True, jnp.float32),
    ((("mode", "exact"),), True, jnp.bfloat16),  # bf16 rows are promoted to f32 before the gather
    ((("mode", "rank"), ("rank", 2)), True, jnp.float32),
    ((("mode", "rank"), ("rank", 2)), False, jnp.float32),  # no bias: no column-sum block
    ((("mode", "rank"), ("rank", 2)), False, jnp.bfloat16),
    ((("mode", "rank"), ("rank", 2), ("aggregation", "two_way")), True, jnp.float32),
    ((("mode", "rank"), ("rank", 2), ("aggregation", "two_way")), False, jnp.bfloat16),
    ((("mode", "auto"),), True, jnp.float32),
    ((("mode", "auto"),), False, jnp.float32),
])
def test_dad_compiled_bytes_equal_ledger_and_model_charges_ops(kw, use_bias, dtype):
  rows = 4
  model = _DadNet(kw, use_bias)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(SITES * rows, 12)), dtype)
  y = jnp.asarray(np.arange(SITES * rows) % 3, jnp.int32)
  compiled, stats = compiled_dad_step(model, x, y, rows, SITES)
  _check(compiled, stats)
  # The plan reads the same payloads: sown bits == planned bits for N = 8.
  plan = dad.layer_plan(model, x[:rows], num_sites=SITES)
  plain = (10 * 10 + 10) * 32
  assert sum(p.gather_bits for p in plan) == stats.gather_bits[0]
  assert sum(p.reduce_bits for p in plan) + plain == stats.reduce_bits[0]


@pytest.mark.parametrize("kw", [(("mode", "exact"),), (("mode", "rank"), ("rank", 2))])
def test_replicated_params_typing_collectives_are_booked(kw):
  """P() (invariant) parameters and state under check_vma: re-typing reductions are metered too."""
  from jax.sharding import NamedSharding  # pylint: disable=g-import-not-at-top
  from dadjax.extend import bits_to_int, tree_bits  # pylint: disable=g-import-not-at-top
  rows = 2
  model = _DadNet(kw, True)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(SITES * rows, 12)), jnp.float32)
  y = jnp.asarray(np.arange(SITES * rows) % 3, jnp.int32)
  variables = dict(model.init(jax.random.key(0), x[:rows]))
  params = variables.pop("params")
  variables.pop("comm", None)
  mesh = dadjax.make_mesh(SITES, "data")

  def site(params, rest, x, y):
    def loss(p, r):
      logits, sown = model.apply({"params": p, **r}, x, mutable=["comm"])
      return jax.lax.pmean(softmax_cross_entropy(logits, y), "data"), sown["comm"]
    grads, sown = jax.grad(loss, argnums=(0, 1), has_aux=True, allow_int=True)(params, rest)
    return grads, sown

  put = lambda tree, spec: jax.tree.map(
      lambda v: jax.device_put(v, NamedSharding(mesh, spec)), tree)
  run = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                              out_specs=P(), check_vma=True))
  args = (put(params, P()), put(variables, P()), put(x, P("data")), put(y, P("data")))
  compiled = run.lower(*args).compile()
  _, sown = compiled(*args)
  ops = hlo_collectives(compiled.as_text())
  reduce = sum(bits_to_int(tree_bits(layer.get("reduce_bits", ()))) for layer in sown.values())
  gather = sum(bits_to_int(tree_bits(layer.get("gather_bits", ()))) for layer in sown.values())
  # (the loss value itself is unused by jax.grad: XLA drops its pmean)
  # The plain layer's gradient: JAX's own transpose of the implicit pvary (a psum).
  plain = (10 * 10 + 10) * 32
  assert 8 * ops.nbytes["gather"] == gather > 0
  assert 8 * ops.nbytes["reduce"] == reduce + plain
  if dict(kw)["mode"] == "rank":
    assert reduce > 0  # per-site effective ranks re-typed invariant: a real pmean, booked


# One ResNet program per family in the default run (each compiles for 5-20 s); the other
# variants of the same bucketing code run with -m slow.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("spec, kind, most", [
    ("topk:0.01", "gather", 2), ("ef_topk:0.01", "gather", 2), ("qsgd:4", "gather", 2),
    pytest.param("qsgd:4:64", "gather", 2, marks=_SLOW), ("sign", "gather", 1),
    pytest.param("ef_sign", "gather", 1, marks=_SLOW), ("scaled_sign", "gather", 2),
    pytest.param("ef_scaled_sign", "gather", 2, marks=_SLOW),
    pytest.param("terngrad", "gather", 2, marks=_SLOW),
    ("powersgd:4", "reduce", 2), pytest.param("powersgd:1", "reduce", 2, marks=_SLOW),
])
def test_resnet18_collectives_are_bucketed(spec, kind, most):
  # 62 parameter leaves, one packed buffer per collective kind and dtype (PowerSGD: one
  # all-reduce of all P matrices and one of all Q matrices per power-iteration round);
  # _run_update checks that the compiled bytes equal the ledger's.
  ops = _resnet_ops(spec, kind)
  assert 1 <= ops.count[kind] <= most, ops


_DEFAULT_BUCKETED = ("topk:0.1", "qsgd:16", "terngrad", "sign", "powersgd:2")  # the rest: -m slow


@pytest.mark.parametrize("spec, mixed", [
    pytest.param(s, m, marks=() if s in _DEFAULT_BUCKETED else pytest.mark.slow) for s, m in (
        *((s, True) for s in ("topk:0.1", "ef_topk:0.1", "qsgd:4:16", "qsgd:16", "terngrad",
                              "ef_terngrad", "sign", "powersgd:2", "ef_scaled_sign",
                              "randomk:0.25", "bf16")),
        ("qsgd:16:noise=hash", True), ("terngrad:noise=hash", True),
        ("qsgd:16", False), ("terngrad", False))])  # all fp32: the sites' mean in one op
def test_bucketed_parameters_equal_the_unbucketed_after_20_steps(spec, mixed, monkeypatch):
  # Bucketed collectives, the quantizers' one-buffer form (noise, rounding and packing of all
  # leaves at once) and same-shape leaves as one vmap, against one collective per leaf and the
  # per-leaf loop: bit-identical.
  from dadjax.comm import _metered  # pylint: disable=g-import-not-at-top
  from dadjax.compress import _base, _segments  # pylint: disable=g-import-not-at-top

  def run():
    tx = optax.chain(C.compressed(C.get_compressor(spec), axis_name="data"), optax.sgd(0.05))
    params = jax.tree.map(lambda x: jnp.stack([x] * 4), _mixed_params() if mixed else _params())
    state = jax.vmap(tx.init)(params)

    def step(params, state, i):
      grads = jax.tree.map(lambda p: jnp.sin(p * (1 + i) + jnp.arange(4.0).reshape(
          (4,) + (1,) * (p.ndim - 1))).astype(p.dtype), params)
      upd, state = jax.vmap(tx.update, axis_name="data")(grads, state, params)
      return optax.apply_updates(params, upd), state

    step = jax.jit(step)
    for i in range(20):
      params, state = step(params, state, i)
    return params

  monkeypatch.setattr(_segments, "FUSED", True)  # opt-in: faster to compile, slower to run
  bucketed = run()
  monkeypatch.setattr(_segments, "FUSED", False)
  grouped = run()  # the same-shape vmap (the default form)
  monkeypatch.setattr(_metered, "BUCKET", False)
  monkeypatch.setattr(_base, "GROUP_SAME_SHAPES", False)
  plain = run()
  for a, b in [*zip(jax.tree.leaves(bucketed), jax.tree.leaves(plain)),
               *zip(jax.tree.leaves(grouped), jax.tree.leaves(plain))]:
    if "scaled_sign" in spec or spec.startswith("qsgd"):
      # A per-leaf reduction (scaled sign's mean |g|, QSGD's norm): the one-buffer form reduces
      # within a segment of the flat buffer, the per-leaf form over the leaf in its own shape
      # (so a sharded leaf is never flattened), and the summation orders differ (1 ulp seen).
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0, err_msg=spec)
    else:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=spec)


def test_powersgd_one_batched_orthogonalization_equals_per_group():
  # The padded batch changes only the summation order of the dot products: float32 round-off.
  from dadjax._core.linalg import orthogonalize  # pylint: disable=g-import-not-at-top
  from dadjax.compress._powersgd import _orthogonalize_all  # pylint: disable=g-import-not-at-top
  k = jax.random.split(jax.random.key(3), 4)
  mats = [jax.random.normal(k[0], (3, 50, 4)), jax.random.normal(k[1], (1, 7, 4)),
          jax.random.normal(k[2], (2, 12, 2)), jnp.zeros((1, 9, 4))]
  mats[1] = mats[1].at[..., 3].set(mats[1][..., 0] * 2.0)  # a dependent column: dropped to 0
  for got, want in zip(_orthogonalize_all(mats), [orthogonalize(p) for p in mats]):
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
  assert not np.any(np.asarray(_orthogonalize_all(mats)[1][..., 3]))


@pytest.mark.parametrize("spec, grouped", [("qsgd:4", True), ("terngrad", True),
                                           ("sign", True), ("topk:0.1", False)])
def test_same_shape_leaves_compile_to_one_kernel_per_shape(spec, grouped, monkeypatch):
  # Grouped, a leaf more of a shape that is already there adds only its stacking and slicing
  # to the program, not another copy of the compressor; TopK stays per leaf (its batched
  # gathers are slow on CPU).
  from dadjax.compress import _base  # pylint: disable=g-import-not-at-top
  compressor = C.get_compressor(spec)
  keys = C.Keys(jax.random.key(0), jax.random.key(1))

  def program_size(leaves):
    grads = {f"w{i}": jnp.full((24, 16), 0.1 * i) for i in range(leaves)}
    grads |= {f"b{i}": jnp.full((16,), 0.2 * i) for i in range(leaves)}
    compress = lambda g: compressor.compress(g, compressor.init(g), keys)[0]
    return jax.jit(compress).lower(grads).as_text().count("\n")

  monkeypatch.setattr(_base, "GROUP_SAME_SHAPES", True)
  by_group = program_size(8) - program_size(4)
  monkeypatch.setattr(_base, "GROUP_SAME_SHAPES", False)
  by_leaf = program_size(8) - program_size(4)
  if grouped:
    assert by_group < by_leaf / 3, (by_group, by_leaf)
  else:
    assert by_group == by_leaf
