"""Two processes x 4 CPU devices (gloo) train like one process x 8 devices."""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import dadjax
from multihost_common import STEPS, TRAIN_CONFIG, make_problem

HERE = pathlib.Path(__file__).parent


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(out, layout="flat", *extra, logs_out=None):
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(port), str(i),
                             str(out), layout, *map(str, extra)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i in range(2)]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("multi-host workers timed out")
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-3000:]
  if logs_out is not None:
    logs_out.extend(logs)
  return np.load(out)


def _train_here(mesh, shard_params=False):
  model, tx, batches = make_problem()
  ts = dadjax.make_train_step(model, tx, mesh=mesh, shard_params=shard_params)
  state = ts.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches[:STEPS]:
    state, _ = ts(state, batch)
  return ts, state


@pytest.mark.multihost
def test_two_processes_equal_one_process_with_eight_devices(tmp_path):
  got = _run_workers(tmp_path / "params.npz")
  model, tx, batches = make_problem()
  ts = dadjax.make_train_step(model, tx, num_sites=8)
  state = ts.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches[:STEPS]:
    state, _ = ts(state, batch)
  expected = jax.tree.leaves(ts.params(state))
  for i, leaf in enumerate(expected):
    np.testing.assert_allclose(got[f"p{i}"], leaf, rtol=1e-5, atol=1e-6)
  assert int(got["total_bits"]) == dadjax.comm_stats(state.opt_state).total


@pytest.mark.multihost
@pytest.mark.parametrize("layout", ["sites", "sharded"])
def test_each_process_one_site_equals_one_process_2x4_mesh_and_pooled(tmp_path, layout):
  # "sharded": each site's parameters are split over its 4 devices (shard_params=True)
  got = _run_workers(tmp_path / "params.npz", layout=layout)
  ts, state = _train_here(dadjax.make_mesh(sites=2, per_site=4))
  pooled_ts, pooled = _train_here(dadjax.make_mesh(1))  # one site holds every row
  for i, (leaf, ref) in enumerate(zip(jax.tree.leaves(ts.params(state)),
                                      jax.tree.leaves(pooled_ts.params(pooled)))):
    np.testing.assert_allclose(got[f"p{i}"], leaf, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[f"p{i}"], ref, rtol=1e-5, atol=1e-6)
  # the ledger books what a site sends over the site axis, whatever its in-site layout
  assert int(got["total_bits"]) == dadjax.comm_stats(state.opt_state).total
  assert float(got["held"]) == (0.25 if layout == "sharded" else 1.0)


@pytest.mark.slow  # 35 s; test_faults' lost-process and one-process resume tests stay default
@pytest.mark.multihost
def test_two_processes_checkpoint_and_resume_like_one_uninterrupted_run(tmp_path):
  from dadjax.config import Config
  from dadjax.train import train
  ckpt = tmp_path / "ckpt"
  _run_workers(tmp_path / "first.npz", "train", ckpt, 4)  # steps 1-4, checkpoints at 2 and 4
  assert sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) == ["2", "4"]
  assert (ckpt / "dadjax.lock").exists()  # taken by process 0, released at the end
  logs = []
  got = _run_workers(tmp_path / "resumed.npz", "train", ckpt, 6, logs_out=logs)  # resumes at 4
  assert all(f"dadjax: resuming from checkpoint step 4 in {ckpt}" in log for log in logs)
  whole = train(Config(**TRAIN_CONFIG, steps=6), progress=False)  # one process, 8 devices
  for i, leaf in enumerate(jax.tree.leaves(whole.params)):
    np.testing.assert_allclose(got[f"p{i}"], leaf, rtol=1e-5, atol=1e-6)
