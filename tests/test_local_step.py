"""Local updates in the train step: compiled program, ledger, backends, 2-D meshes, resume."""
import json

import jax
import numpy as np
import optax
import pytest

import dadjax
from dadjax import cli, local
from dadjax.config import Config
from dadjax.methods import build_method
from dadjax.models import MLP
from dadjax.train import train

SITES, ROWS, H = 8, 32, 2
PARAM_BITS = (12 * 16 + 16 + 16 * 5 + 5) * 32
METRIC_BITS = 2 * 32  # the step's pmean of loss and accuracy


def _batch(step, rows=ROWS):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(rows, 12)).astype(np.float32),
          "y": rng.integers(0, 5, rows).astype(np.int32)}


def _step(tx, **kwargs):
  kwargs.setdefault("num_sites", None if "mesh" in kwargs else SITES)
  return dadjax.make_train_step(MLP(hidden=(16,), num_classes=5), tx, **kwargs)


def _train(ts, steps):
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  for i in range(steps):
    state, _ = ts(state, _batch(i))
  return state


@pytest.fixture(scope="module")
def runs():
  """A DiLoCo run of 2H steps on each backend (and its compiled collectives)."""
  out = {}
  for backend in ("shard_map", "pmap", "vmap"):
    ts = _step(local.diloco(optax.sgd(0.1, momentum=0.9), every=H), backend=backend)
    state = _train(ts, 2 * H)
    out[backend] = (ts, state, ts.collectives(state, _batch(0)))
  return out


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "vmap"])
def test_ledger_over_2h_steps_is_two_payloads(runs, backend):
  _, state, _ = runs[backend]
  s = dadjax.comm_stats(state)
  assert s.total == 2 * PARAM_BITS + 2 * H * METRIC_BITS
  assert s.bits_per_step == PARAM_BITS // H + METRIC_BITS      # the rate, per optimizer step
  assert s.peak_bits_per_step == PARAM_BITS + METRIC_BITS      # a synchronization step
  assert s.dense_bits_per_step == PARAM_BITS                    # fp32 all-reduce every step
  assert dadjax.comm_stats(state.opt_state).total == 2 * PARAM_BITS


def test_backends_give_the_same_parameters(runs):
  ref = runs["shard_map"][1]
  for backend in ("pmap", "vmap"):
    state = runs[backend][1]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 np.asarray(jax.tree.leaves(ref.params)[0]),
                 np.asarray(jax.tree.leaves(state.params)[0]))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
                 ref.opt_state.anchor, state.opt_state.anchor)
  # after a synchronization (step 2H) every site holds the anchor
  anchor = dadjax.parallel.unstack_site(ref.opt_state.anchor, 0)
  for site in range(SITES):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6),
                 runs["shard_map"][0].params(ref, site), anchor)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_pseudo_gradient_collective_only_in_the_sync_branch(runs, backend):
  ops = runs[backend][2]
  # Outside the conditional only the step's metrics are reduced; the fp32
  # pseudo-gradient all-reduce sits in the synchronization branch.
  assert ops.conditional_count["reduce"] >= 1
  assert 8 * ops.conditional_nbytes["reduce"] == PARAM_BITS
  assert ops.bits("reduce") - 8 * ops.conditional_nbytes["reduce"] == METRIC_BITS
  assert ops.count["gather"] == 0


def test_between_syncs_sites_differ_and_evaluation_reads_the_anchor(runs):
  ts, _, _ = runs["vmap"]
  state = _train(ts, H + 1)  # one inner step after a synchronization
  # the sites' own parameters (ts.params reads the evaluation parameters: the anchor)
  site0, site1 = (dadjax.parallel.unstack_site(state.params, s) for s in (0, 1))
  assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(site0),
                                                      jax.tree.leaves(site1)))
  anchor = state.opt_state.evaluation_params(state.params)
  jax.tree.map(lambda a: np.testing.assert_array_equal(a[0], a[1]), anchor)


def test_2d_mesh_averages_in_site_and_runs_diloco_across_sites():
  one_d = _step(local.diloco(optax.sgd(0.1), every=H), mesh=dadjax.make_mesh(2))
  two_d = _step(local.diloco(optax.sgd(0.1), every=H),
                mesh=dadjax.make_mesh(sites=2, per_site=4))
  a, b = _train(one_d, 2 * H + 1), _train(two_d, 2 * H + 1)
  jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, rtol=2e-5, atol=2e-6),
               one_d.params(a, 1), two_d.params(b, 1))
  sa, sb = dadjax.comm_stats(a), dadjax.comm_stats(b)
  assert sa.total == sb.total == 2 * PARAM_BITS + (2 * H + 1) * METRIC_BITS
  # in-site traffic is GSPMD's (the rows split over the site's devices), read from the program
  assert two_d.collectives(b, _batch(0), link="intra").ops > 0 and a.intra_comm is None
  inter = two_d.collectives(b, _batch(0), link="inter")
  assert 8 * inter.conditional_nbytes["reduce"] == PARAM_BITS


def test_dad_layers_are_refused_with_a_clear_error():
  method = build_method("dad")
  ts = dadjax.make_train_step(MLP(hidden=(16,), num_classes=5, dense=method.dense),
                              local.diloco(optax.sgd(0.1), every=2), num_sites=2, backend="vmap")
  state = ts.init(jax.random.key(0), _batch(0)["x"][:2])
  with pytest.raises(ValueError, match="diloco: dAD layers communicate in every backward pass"):
    ts(state, _batch(0, rows=8))


SMALL = dict(steps=6, eval_every=3, batch_per_site=8, num_sites=4, backend="vmap",
             model_kwargs={"hidden": [16]})


@pytest.mark.parametrize("method", [pytest.param("diloco:4:compress=ef(qsgd(4))",
                                                 marks=pytest.mark.slow),
                                    "streaming_diloco:4:fragments=2:delay=1"])
def test_resume_in_the_middle_of_an_inner_phase_is_bit_identical(tmp_path, method):
  config = Config(**SMALL, method=method)
  whole = train(config, progress=False)
  ckpt = str(tmp_path / "ckpt")
  first = train(config.replace(steps=3, checkpoint_dir=ckpt, checkpoint_every=3), progress=False)
  assert first.final["step"] == 3  # step 3 of a period of 4: mid inner phase
  resumed = train(config.replace(checkpoint_dir=ckpt, checkpoint_every=3), progress=False)
  jax.tree.map(np.testing.assert_array_equal, resumed.state.params, whole.state.params)
  jax.tree.map(np.testing.assert_array_equal, resumed.state.opt_state, whole.state.opt_state)
  assert dadjax.comm_stats(resumed.state).total == dadjax.comm_stats(whole.state).total


def test_cli_trains_diloco_from_a_spec(capsys):
  assert cli.main(["train", "--no-progress", "steps=4", "eval_every=4", "num_sites=2",
                   "backend=vmap", "batch_per_site=4", "method=diloco:2:outer_lr=0.5",
                   "optimizer=adam", "lr=0.01"]) == 0
  final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert final["step"] == 4 and final["method"] == "diloco:2:outer_lr=0.5"
  n_params = 64 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10  # digits MLP, default hidden=(64, 64)
  assert final["total_payload_bits"] == 2 * 32 * n_params + 4 * METRIC_BITS
  assert final["peak_payload_bits_per_step"] == 32 * n_params + METRIC_BITS
