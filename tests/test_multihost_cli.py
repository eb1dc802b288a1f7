"""``dadjax train`` over two processes (gloo, 2 CPU devices each) equals the one-process run,
each process sampling and holding only its own sites' rows."""
import json
import os
import re
import subprocess
import sys

import jax
import pytest

from test_multihost import HERE, _free_port

OVERRIDES = ["num_sites=4", "batch_per_site=4", "steps=4", "eval_every=2",
             'model_kwargs={"hidden": [16]}', "method=ef_topk:0.5"]
KEYS = ("step", "loss", "test_loss", "test_accuracy", "total_payload_bits")


def _env(devices):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(HERE.parent) + os.pathsep + env.get("PYTHONPATH", "")
  env["JAX_PLATFORMS"] = "cpu"
  if devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return env


def _rows(out):
  rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
  return [{k: r[k] for k in KEYS} for r in rows if "step" in r]


def _train(*flags, devices=None):
  return subprocess.Popen([sys.executable, "-m", "dadjax.cli", "train", "--no-progress", *flags,
                           *OVERRIDES], env=_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _wait(procs):
  outs = []
  for p in procs:
    try:
      outs.append(p.communicate(timeout=240))
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("dadjax train processes timed out")
  for p, (_, err) in zip(procs, outs):
    assert p.returncode == 0, err[-3000:]
  return [(_rows(out), err) for out, err in outs]


def _sampled(err):
  """(sites, host batch shape) a process reported it samples each step."""
  (m,) = re.findall(r"samples the rows of sites \[([\d, ]+)\] of 4: host batch \(([\d, ]+)\)",
                    err)
  return [int(s) for s in m[0].split(",")], tuple(int(d) for d in m[1].split(",") if d.strip())


@pytest.mark.multihost
def test_two_process_cli_train_equals_one_process_run():
  port = _free_port()
  procs = [_train("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                  "--process-id", str(i), devices=2) for i in range(2)]
  single = _train()  # one process: 8 simulated devices, the first 4 are the sites
  (first, err0), (second, err1) = _wait(procs)
  ((whole, err_whole),) = _wait([single])
  assert [r["step"] for r in whole] == [2, 4]
  # each process sampled only its own two sites' rows: 2 sites x batch_per_site=4 rows
  (sites0, shape0), (sites1, shape1) = _sampled(err0), _sampled(err1)
  assert (sites0, sites1) == ([0, 1], [2, 3])
  assert shape0[0] == shape1[0] == 2 * 4 and shape0 == shape1
  assert "samples the rows" not in err_whole  # one process: the whole global batch
  assert first == second  # every process logs the same global rows
  for got, ref in zip(first, whole, strict=True):
    assert got["step"] == ref["step"]
    assert got["total_payload_bits"] == ref["total_payload_bits"]
    for k in ("loss", "test_loss", "test_accuracy"):
      assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (k, got, ref)


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "localhost"], "--coordinator must be HOST:PORT"),
    (["--num-processes", "0"], "--num-processes must be >= 1"),
    (["--num-processes", "2", "--process-id", "2"], "--process-id must be in [0, 2)"),
])
def test_bad_distributed_flags_are_one_line_errors(flags, message, capsys):
  from dadjax.cli import main
  assert main(["train", *flags, *OVERRIDES]) == 2
  assert message in capsys.readouterr().err


def test_distributed_auto_outside_a_cluster_is_a_one_line_error():
  p = subprocess.run([sys.executable, "-m", "dadjax.cli", "train", "--distributed", "auto",
                      "--no-progress", "steps=1"], env=_env(None), capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2, p.stderr[-3000:]
  assert "dadjax: error: cannot start the multi-process runtime" in p.stderr


@pytest.mark.parametrize("backend, per_site", [("shard_map", 1), ("shard_map", 2), ("vmap", 1)])
def test_a_batch_of_some_sites_rows_places_like_the_global_batch(backend, per_site):
  # What each process of the run above does with its own sites' rows, on one process:
  # the rows of the sites in any order, placed, are the global batch, and the step refuses
  # a batch that leaves out a site this process feeds.
  import numpy as np
  import optax
  import dadjax
  from dadjax import data, models
  rng = np.random.default_rng(0)
  x, y = rng.normal(size=(96, 5)).astype(np.float32), rng.integers(0, 3, 96).astype(np.int32)
  batcher = data.SiteBatcher(x, y, data.partition(y, 4, seed=0), batch_per_site=4, seed=1)
  idx = batcher.indices_at(3)
  assert (batcher.indices_at(3, [3, 1]) == np.concatenate([idx[12:16], idx[4:8]])).all()
  with pytest.raises(ValueError, match="distinct site ids"):
    batcher.indices_at(3, [4])
  placement = ({"mesh": dadjax.make_mesh(sites=4, per_site=per_site)} if per_site > 1
               else {"num_sites": 4})
  step = dadjax.make_train_step(models.get_model("mlp", 3, hidden=(8,)),
                                optax.chain(dadjax.allreduce("data"), optax.sgd(0.1)),
                                backend=backend, **placement)
  assert step.local_sites == (0, 1, 2, 3)
  order = [2, 0, 3, 1]
  gx, gy = batcher.batch_at(2)
  lx, ly = batcher.batch_at(2, order)
  whole = step.place_batch({"x": gx, "y": gy})
  some = step.place_batch({"x": lx, "y": ly}, sites=order)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(some), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(ValueError, match=r"leave out site\(s\) \[1, 3\]"):
    step.place_batch({"x": lx[:8], "y": ly[:8]}, sites=[2, 0])
  with pytest.raises(ValueError, match=r"distinct site ids in \[0, 4\)"):
    step.place_batch({"x": lx, "y": ly}, sites=[2, 0, 3, 3])


def _train_with(overrides, *flags, devices=None):
  return subprocess.Popen([sys.executable, "-m", "dadjax.cli", "train", "--no-progress", *flags,
                           *overrides], env=_env(devices), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


_FAMILIES = ["ef_topk:0.5", "dad", "powersgd:2", "dataquant:2:classes=10", "diloco:2",
             "accordion(powersgd:2,powersgd:1,window=2,interval=1)"]


@pytest.mark.multihost
@pytest.mark.parametrize("method", [
    pytest.param(m, marks=() if i < 1 else pytest.mark.slow) for i, m in enumerate(_FAMILIES)])
def test_sites_of_four_devices_two_processes_equal_one_process(method):
  """Each process is one site of 4 devices (FSDP x TP axes, parameters sharded in the site)."""
  overrides = ["num_sites=2", 'mesh_inner={"fsdp": 2, "model": 2}', "shard_params=true",
               "batch_per_site=8", "steps=4", "eval_every=2", 'model_kwargs={"hidden": [16]}',
               f"method={method}"]
  port = _free_port()
  procs = [_train_with(overrides, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                       "--process-id", str(i), devices=4) for i in range(2)]
  single = _train_with(overrides, devices=8)
  (first, _), (second, _) = _wait(procs)
  ((whole, _),) = _wait([single])
  assert first == second and [r["step"] for r in whole] == [2, 4]
  for got, ref in zip(first, whole, strict=True):
    assert got["total_payload_bits"] == ref["total_payload_bits"]
    for k in ("loss", "test_loss", "test_accuracy"):
      assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-6), (k, got, ref)
