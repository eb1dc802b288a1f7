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
from multihost_common import STEPS, make_problem

HERE = pathlib.Path(__file__).parent


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.multihost
def test_two_processes_equal_one_process_with_eight_devices(tmp_path):
  out = tmp_path / "params.npz"
  port = _free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(HERE) + os.pathsep + env.get("PYTHONPATH", "")
  procs = [subprocess.Popen([sys.executable, str(HERE / "multihost_worker.py"), str(port), str(i), str(out)],
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

  model, tx, batches = make_problem()
  ts = dadjax.make_train_step(model, tx, num_sites=8)
  state = ts.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches[:STEPS]:
    state, _ = ts(state, batch)
  expected = jax.tree.leaves(ts.params(state))
  got = np.load(out)
  for i, leaf in enumerate(expected):
    np.testing.assert_allclose(got[f"p{i}"], leaf, rtol=1e-5, atol=1e-6)
  assert int(got["total_bits"]) == dadjax.comm_stats(state.opt_state).total
