"""The step knows no family: a method family written outside dadjax trains through it.

Also the step's collection rules, the reporting protocol, and regression tests of
defects of the former step (site-invariant collections on a 2-D mesh, a batch stage's
dense reference, pmap's num_sites, one definition of the largest site).
"""
import ast
import json
import pathlib
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import registry
from dadjax._core.protocols import collect_rows, evaluation_params
from dadjax.comm import (CommSummary, NetworkModel, comm_stats, host_array, ledger_init,
                         ledger_record, metered_pmean, tree_dense_bits)
from dadjax.config import Config
from dadjax.parallel import CollectionRule, register_rule
from dadjax.registry import Method, register_method
from dadjax.extend import BatchStage, StageOutput
from dadjax.train import train
from helpers import data

SITES = 4
ROWS = 4  # per site
ROOT = pathlib.Path(dadjax.__file__).parent

# -- a family defined here, outside dadjax -------------------------------------------------


class MeanSyncState(NamedTuple):
  """The family's optimizer state: its ledger and how many rounds it ran."""

  comm: dadjax.CommStats
  rounds: jax.Array

  def metrics_row(self) -> dict:
    return {"family/rounds": int(np.ravel(host_array(self.rounds))[0])}


def mean_sync(axis_name="data") -> optax.GradientTransformationExtraArgs:
  """A communicating transformation: the mean of the sites' gradients, booked in its ledger."""

  def init(params):
    del params
    return MeanSyncState(ledger_init(), jnp.zeros((), jnp.int32))

  def update(updates, state, params=None, **extra):
    del params, extra
    mean, traffic = metered_pmean(updates, axis_name)
    comm = ledger_record(state.comm, reduce=traffic.reduce, dense=tree_dense_bits(updates),
                         reduce_calls=traffic.reduce_calls)
    return mean, MeanSyncState(comm, state.rounds + 1)

  return optax.GradientTransformationExtraArgs(init, update)


class TallyDense(nn.Module):
  """A dense layer that also writes how many rows it saw this step into ``"tally"``."""

  features: int
  use_bias: bool = True

  @nn.compact
  def __call__(self, x):
    seen = self.variable("tally", "rows", lambda: jnp.zeros((), jnp.float32))
    if not self.is_initializing():
      seen.value = jnp.asarray(x.shape[0], jnp.float32)
    return nn.Dense(self.features, use_bias=self.use_bias)(x)


def _tally_row(value) -> dict:
  """Rows seen by the model's first tally layer since the start (site 0)."""
  leaves = jax.tree.leaves(value)
  return {"family/tally": float(np.ravel(host_array(leaves[0]))[0])}


# The family's collection rule: the model returns the rows of this step, the state
# keeps the running sum.
TALLY = register_rule("tally", CollectionRule(
    update=lambda old, new: jax.tree.map(jnp.add, old, new), metrics_row=_tally_row))


@pytest.fixture(scope="module")
def tally_method():
  name = "tally_mean"

  def build(ctx):
    return Method("", tx=mean_sync(ctx.axis_name or "data"), dense=TallyDense,
                  collections={"tally": TALLY})

  register_method(name, doc="Mean all-reduce with a row tally (test family).")(build)
  yield name
  registry.unregister("method", name)


def test_external_family_trains_through_make_train_step():
  model = dadjax.models.MLP(hidden=(8,), num_classes=3, dense=TallyDense)
  tx = optax.chain(mean_sync("data"), optax.sgd(0.1))
  step = dadjax.make_train_step(model, tx, backend="vmap", num_sites=SITES)
  x, y = data(SITES * ROWS)
  state = step.init(jax.random.key(0), x[:ROWS])
  for _ in range(3):
    state, _ = step(state, {"x": x, "y": y})
  params = jax.tree.leaves(state.params)
  for p in params:  # the family's all-reduce keeps the sites equal
    np.testing.assert_allclose(np.asarray(p), np.broadcast_to(np.asarray(p)[:1], p.shape),
                               atol=1e-6)
  tally = jax.tree.leaves(state.model_state["tally"])
  assert all(np.all(np.asarray(t) == 3 * ROWS) for t in tally)  # the rule's running sum
  row = step.metrics_row(state)
  assert row == {"family/rounds": 3, "family/tally": 3.0 * ROWS}
  n = sum(int(np.prod(p.shape[1:])) for p in params)
  assert comm_stats(state.opt_state).bits_per_step == 32 * n  # its own ledger


def test_collections_argument_overrides_a_registered_rule():
  model = dadjax.models.MLP(hidden=(8,), num_classes=3, dense=TallyDense)
  tx = optax.chain(mean_sync("data"), optax.sgd(0.1))
  step = dadjax.make_train_step(model, tx, backend="vmap", num_sites=2,
                                collections={"tally": CollectionRule()})  # replace, no sum
  x, y = data(2 * ROWS)
  state = step.init(jax.random.key(0), x[:ROWS])
  for _ in range(2):
    state, _ = step(state, {"x": x, "y": y})
  assert all(np.all(np.asarray(t) == ROWS) for t in jax.tree.leaves(state.model_state["tally"]))
  assert "family/tally" not in step.metrics_row(state)  # this rule has no metrics_row


def test_external_family_trains_through_config_and_reports(tmp_path, tally_method):
  config = Config(method=tally_method, steps=4, eval_every=2, batch_per_site=ROWS,
                  num_sites=SITES, backend="vmap", model_kwargs={"hidden": [8]},
                  out_dir=str(tmp_path))
  run = train(config, progress=False)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["family/rounds"] for r in rows] == [2, 4]
  assert [r["family/tally"] for r in rows] == [2.0 * ROWS, 4.0 * ROWS]
  assert rows[-1]["payload_bits_per_step"] > 0 and np.isfinite(rows[-1]["test_loss"])
  assert run.final["family/rounds"] == 4


FAMILIES = ("compress", "dad", "adaptive", "dataquant", "local")


def _imports(path: pathlib.Path) -> set[str]:
  found = set()
  package = ".".join(("dadjax",) + path.relative_to(ROOT).parent.parts)
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
      found.add(base)
      found.update(f"{base}.{a.name}" for a in node.names)
  return found


def test_the_step_and_the_loop_import_no_family():
  files = sorted((ROOT / "parallel").glob("*.py")) + [ROOT / "train.py", ROOT / "stage.py"]
  bad = [f"{f.name}: {i}" for f in files for i in sorted(_imports(f))
         if any(i == f"dadjax.{fam}" or i.startswith(f"dadjax.{fam}.") for fam in FAMILIES)]
  assert bad == []
  for f in sorted((ROOT / "parallel").glob("*.py")):  # no family's collection in the code
    names = [n.value for n in ast.walk(ast.parse(f.read_text()))
             if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    assert "dad_state" not in names, f.name


def test_parallel_modules_are_small():
  for f in sorted((ROOT / "parallel").glob("*.py")):
    if f.name == "_mesh.py":  # meshes and multi-host start-up, not the step
      continue
    lines = f.read_text().splitlines()
    assert len(lines) <= 300, f.name
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        # over 80 lines only with a one-line reason in the docstring
        long_ok = "Long because" in (ast.get_docstring(node) or "")
        assert node.end_lineno - node.lineno + 1 <= 80 or long_ok, (f.name, node.name)


# -- the reporting protocol ------------------------------------------------------------------


class _Anchor(NamedTuple):
  anchor: jax.Array

  def evaluation_params(self, params):
    return jax.tree.map(lambda p: p * 0 + self.anchor, params)


class _Rows(NamedTuple):
  n: jax.Array

  def metrics_row(self, params=None):
    return {"n": int(np.ravel(self.n)[0]), "named": params is not None}


def test_collect_rows_and_evaluation_params():
  tree = (optax.EmptyState(), {"a": _Rows(np.array([3, 3]))}, _Anchor(np.float32(2.0)))
  assert collect_rows(tree) == {"n": 3, "named": False}
  assert collect_rows(tree, {"w": 1}) == {"n": 3, "named": True}
  params = {"w": np.ones(3, np.float32)}
  np.testing.assert_array_equal(evaluation_params(tree, params)["w"], [2.0, 2.0, 2.0])
  assert evaluation_params((optax.EmptyState(),), params) is params


def test_train_step_params_and_evaluate_use_evaluation_params():

  def anchor_tx():
    return optax.GradientTransformation(lambda p: _Anchor(jnp.float32(0.0)),
                                        lambda u, s, p=None: (u, s))

  model = dadjax.models.MLP(hidden=(4,), num_classes=3)
  step = dadjax.make_train_step(model, optax.chain(dadjax.allreduce(), anchor_tx(),
                                                   optax.sgd(0.1)),
                                backend="vmap", num_sites=2)
  x, y = data(4)
  state = step.init(jax.random.key(0), x[:2])
  assert all(np.all(p == 0) for p in jax.tree.leaves(step.params(state)))
  logits_zero = step.evaluate(state, {"x": x, "y": y})["loss"]
  np.testing.assert_allclose(logits_zero, np.log(3.0), rtol=1e-6)  # all-zero model


# -- defects of the former step --------------------------------------------------------------


class _Counter(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = False):
    c = self.variable("counter", "value", lambda: jnp.zeros((), jnp.float32))
    if train:
      c.value = jnp.float32(7.0)  # site-invariant: the same constant on every device
    return nn.Dense(3)(x)


@pytest.mark.parametrize("layout", ["1d", "2d"])
def test_site_invariant_collection_update_is_kept(layout):
  mesh = (dadjax.make_mesh(2) if layout == "1d"
          else dadjax.make_mesh(sites=2, per_site=2))
  step = dadjax.make_train_step(_Counter(), optax.chain(dadjax.allreduce(), optax.sgd(0.1)),
                                mesh=mesh, mutable=("counter",), average=())
  x, y = data(8)
  state = step.init(jax.random.key(0), x[:2])
  state, _ = step(state, {"x": x, "y": y})
  np.testing.assert_array_equal(host_array(state.model_state["counter"]["value"]), [7.0, 7.0])


def _allreduce_stage():
  def apply(ctx, params, batch, state):
    r = ctx.grad_fn(params, batch)
    grads, traffic = metered_pmean(r.grads, ctx.axis_name)
    return StageOutput(r._replace(grads=grads), state, traffic)

  return BatchStage(lambda params: (), apply)


def test_batch_stage_dense_reference_is_fp32_with_bf16_gradients():
  model = nn.Dense(3, param_dtype=jnp.bfloat16, dtype=jnp.bfloat16)

  def loss_fn(params, variables, batch, rng, train):
    logits = model.apply({"params": params}, batch["x"].astype(jnp.bfloat16))
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["y"]).mean(), {}

  step = dadjax.make_train_step(model, optax.sgd(0.1), loss_fn=loss_fn, backend="vmap",
                                num_sites=2, batch_stage=_allreduce_stage())
  x, y = data(4)
  state = step.init(jax.random.key(0), x[:2])
  state, _ = step(state, {"x": x, "y": y})
  n = sum(int(np.prod(p.shape[1:])) for p in jax.tree.leaves(state.params))
  assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(state.params))
  assert comm_stats(state.comm).dense_bits_per_step == 32 * n  # the fp32 all-reduce replaced


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_pmap_refuses_a_bad_num_sites(bad):
  with pytest.raises(ValueError, match="num_sites must be an int >= 1 for backend='pmap'"):
    dadjax.make_train_step(dadjax.models.MLP(), dadjax.allreduce(), backend="pmap",
                           num_sites=bad)
  with pytest.raises(ValueError, match="num_sites must be an int >= 1 for backend='pmap'"):
    dadjax.make_train_step(dadjax.models.MLP(), dadjax.allreduce(),
                           backend=dadjax.parallel.Pmap(bad))


def test_step_time_takes_the_slowest_site_of_the_whole_step():
  # site 0 sends only all-reduce bits, site 1 only all-gather bits
  summary = CommSummary(reduce_bits=(8000, 0), gather_bits=(0, 6000), dense_bits=(8000, 8000),
                        total_bits=(8000, 6000), total_dense_bits=(8000, 8000),
                        reduce_calls=1, gather_calls=1, updates=1)
  net = NetworkModel(bandwidth=1e6, latency=1e-3, num_sites=2)
  per_site = [net.allreduce_time(8000, 1) + net.allgather_time(0, 1),
              net.allreduce_time(0, 1) + net.allgather_time(6000, 1)]
  assert net.step_time(summary) == pytest.approx(max(per_site))
  assert summary.bits_per_step == 8000  # the same site as the step time's
