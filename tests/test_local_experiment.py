"""experiments/local.py: its quick mode end to end (marked slow), the modeled time at further
bandwidths and the saved runs' re-rendering."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from dadjax.run import Config, train

ROOT = pathlib.Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "experiments"))
import local  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.mark.slow
def test_local_experiment_quick_mode(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, "experiments/local.py", "--quick", "--out", str(tmp_path)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  text = (tmp_path / "local.md").read_text()
  for spec in ("allreduce", "diloco:4", "diloco:4:compress=qsgd(7)"):
    assert f"| `{spec}` |" in text
  assert "streaming_diloco:4" in text and "Command: `python experiments/local.py --quick" in text
  assert (tmp_path / "local.png").read_bytes()[:4] == b"\x89PNG"


def _config(method, bandwidth):
  return Config(dataset="digits", model="mlp", model_kwargs={"hidden": [16]}, method=method,
                num_sites=8, backend="vmap", batch_per_site=4, steps=8, eval_every=4,
                lr=0.1, bandwidth=bandwidth, latency=1e-3, out_dir=None)


@pytest.mark.parametrize("method", ["allreduce", "diloco:4"])
def test_time_at_another_bandwidth_equals_a_run_at_that_bandwidth(method):
  slow = train(_config(method, 1e8), progress=False)
  fast = train(_config(method, 4e9), progress=False)
  rows = local.at_bandwidths(slow, [4e9])
  got = [row[local.seconds_column(4e9)] for row in rows]
  want = [row["modeled_comm_s"] for row in fast.history]
  assert got == pytest.approx(want, rel=1e-9)
  # the bandwidth matters here: the two runs' own times differ
  assert [r["modeled_comm_s"] for r in slow.history] != pytest.approx(want, rel=1e-3)


def test_saved_runs_render_again_at_another_target(tmp_path, capsys):
  common = ["--quick", "--seeds", "0", "--methods", "allreduce", "--out", str(tmp_path)]
  assert local.main([*common, "--target", "0.99", "--also-bandwidths", "1e8,1e11"]) == 0
  saved = json.loads((tmp_path / "local.json").read_text())
  (entry,) = saved["methods"]
  assert entry["spec"] == "allreduce" and len(entry["runs"]) == 1 and saved["seeds"] == [0]
  history = entry["runs"][0]["rows"]
  # a slower link takes longer for the same traffic
  assert all(r["modeled_comm_s_at_1e+08"] > r["modeled_comm_s_at_1e+11"] for r in history)
  first = history[0]["test_accuracy"]
  # only the render's own options: the rest (--quick's steps, the methods) come from the saved run
  assert local.main(["--from-json", str(tmp_path / "local.json"), "--out", str(tmp_path),
                     "--name", "again", "--target", str(first), "--also-bandwidths", "1e8,1e11"]) == 0
  row = next(line for line in (tmp_path / "again.md").read_text().splitlines()
             if line.startswith("| fp32 all-reduce |"))
  cells = [c.strip() for c in row.strip("|").split("|")]
  # steps to target: the first evaluation; the two further bandwidths' times are that row's
  assert cells[7] == f"{history[0]['step']}"
  assert cells[10] == f"{history[0]['modeled_comm_s_at_1e+08']:.3g}"
  assert cells[11] == f"{history[0]['modeled_comm_s_at_1e+11']:.3g}"
  again = (tmp_path / "again.md").read_text()
  assert saved["command"] in again and "Rendered again from the saved runs" in again
  assert f"{history[-1]['step']} steps for every method" in again
  capsys.readouterr()
