"""``dadjax train`` over two processes (gloo, 2 CPU devices each) equals the one-process run."""
import json
import os
import subprocess
import sys

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
  return [_rows(out) for out, _ in outs]


@pytest.mark.multihost
def test_two_process_cli_train_equals_one_process_run():
  port = _free_port()
  procs = [_train("--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                  "--process-id", str(i), devices=2) for i in range(2)]
  single = _train()  # one process: 8 simulated devices, the first 4 are the sites
  first, second = _wait(procs)
  (whole,) = _wait([single])
  assert [r["step"] for r in whole] == [2, 4]
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
