"""Experiment scripts still run end to end (small settings; marked slow) and check their arguments."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent


def _run(args, tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1800)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  return proc.stdout


@pytest.mark.slow
def test_dad_experiment_runs(tmp_path):
  _run(["experiments/dad.py", "--config", "experiments/configs/dad_mlp.json", "--steps", "20",
        "--methods", "allreduce,dad,rank_dad:2,powersgd:2", "--out", str(tmp_path)], tmp_path)
  table = (tmp_path / "dad.md").read_text()
  for method in ("allreduce", "dad", "rank_dad:2", "powersgd:2"):
    assert f"| {method} |" in table
  assert "| wire bits/step/site (ring, N=8) | wire ratio vs fp32 | vs bf16 |" in table
  assert "steps to 0.95" in table and "More wire bits than an fp32 all-reduce:" in table


@pytest.mark.slow
def test_compressor_benchmark_runs(tmp_path):
  out = tmp_path / "bench.md"
  _run(["experiments/bench_compressors.py", "--host-devices", "2", "--sites", "2", "--batch", "4",
        "--width", "8", "--steps", "2", "--warmup", "1", "--methods", "topk:0.01,powersgd:4",
        "--wire-sites", "8", "--markdown", str(out)], tmp_path)
  text = out.read_text()
  assert "topk:0.01" in text and "powersgd:4" in text
  assert "| wire bits/step/site (ring, N=8) | wire ratio vs fp32 | vs bf16 |" in text


@pytest.mark.slow
def test_bench_scale_quick_runs(tmp_path):
  out = tmp_path / "bench_scale.md"
  _run(["experiments/bench_scale.py", "--quick", "--models", "mlp", "--methods",
        "allreduce,qsgd:16,powersgd:4,accordion(powersgd:4,powersgd:1)", "--pairs", "2",
        "--ablate", "--processes", "--torch", "off", "--out", str(out)], tmp_path)
  text = out.read_text()
  assert text.startswith("Command: `python experiments/bench_scale.py --quick")
  # the same methods again, each site its own process (gloo over 127.0.0.1)
  layout = text.split("#### dadjax on the MLP in the same layout (2 processes")[1]
  for method in ("allreduce", "qsgd:16", "powersgd:4"):
    assert f"| `{method}` | " in layout
  assert "Load before: `" in text and "Load after: `" in text
  for method in ("allreduce", "qsgd:16", "powersgd:4", "accordion(powersgd:4,powersgd:1)"):
    assert f"| `{method}` | " in text
  # QSGD's payload (fp32 norms, uint32 words) in at most one all-gather per dtype
  assert re.search(r"\| `qsgd:16` \|[^\n]*\| 1 AR \+ [12] AG \|", text), text
  assert "Kernel ablations" in text and "recall" in text


@pytest.mark.slow
def test_accordion_experiment_runs(tmp_path):
  _run(["experiments/accordion.py", "--steps", "12", "--seeds", "0", "--models", "mlp",
        "--partitions", "iid", "--out", str(tmp_path)], tmp_path)
  text = (tmp_path / "accordion.md").read_text()
  for spec in ("powersgd:4", "powersgd:1", "accordion(powersgd:4,powersgd:1)", "ef(topk:0.99)",
               "ef(topk:0.1)", "accordion(ef(topk:0.99),ef(topk:0.1))"):
    assert f"`{spec}`" in text
  assert "| mlp | iid | powersgd |" in text and "| mlp | iid | topk |" in text
  for png in ("accordion_bits.png", "accordion_decisions.png"):
    assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_dataquant_experiment_runs(tmp_path):
  _run(["experiments/dataquant.py", "--steps", "4", "--eval-every", "2", "--seeds", "0,1",
        "--models", "mlp", "--methods", "allreduce,powersgd:2,qdad:4,dataquant:2:classes=10",
        "--widths", "16,32", "--out", str(tmp_path)], tmp_path)
  text = (tmp_path / "dataquant.md").read_text()
  for method in ("allreduce", "powersgd:2", "qdad:4", "dataquant:2:classes=10"):
    assert f"| {method} |" in text
  assert "Width sweep" in text and (tmp_path / "dataquant.png").stat().st_size > 10_000


# -- the real workloads (Fashion-MNIST and text from Debian's packages), --quick -----------------

sys.path.insert(0, str(ROOT / "experiments"))
import workloads  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _needs(*names):
  missing = [workloads.get(n).available() for n in names]
  missing = [m for m in missing if m]
  return pytest.mark.skipif(bool(missing), reason="; ".join(missing) or "available")


@pytest.mark.slow
@_needs("text_lm")
def test_dad_workload_quick(tmp_path):
  _run(["experiments/dad.py", "--workload", "text_lm", "--quick", "--steps", "4", "--seeds", "0,1",
        "--partitions", "iid,non_iid", "--methods", "pooled,allreduce,rank_dad:2,powersgd:2",
        "--out", str(tmp_path)], tmp_path)
  text = (tmp_path / "dad.md").read_text()
  for part in ("text_lm_iid", "text_lm_non_iid"):
    assert f"### {part}: transformer_lm" in text and (tmp_path / f"dad_{part}.png").exists()
  assert "| rank_dad:2 |" in text and " ± " in text and "seeds 0,1" in text
  assert "wire bits/step/site (ring, N=8)" in text and "Measured:" in text


def _accordion_quick(tmp_path, *flags):
  """experiments/accordion.py on the quick Fashion-MNIST CNN, seed 0, IID; its results page."""
  _run(["experiments/accordion.py", "--workload", "fashion_cnn", "--quick", "--seeds", "0",
        "--partitions", "iid", *flags, "--out", str(tmp_path)], tmp_path)
  return (tmp_path / "accordion.md").read_text()


@pytest.mark.slow
@_needs("fashion_cnn")
def test_accordion_workload_quick(tmp_path):
  text = _accordion_quick(tmp_path, "--steps", "6", "--families", "powersgd21")
  assert "`accordion(powersgd:2,powersgd:1)`" in text and "| fashion_cnn | iid |" in text


@pytest.mark.slow
@_needs("fashion_cnn")
def test_accordion_batch_family_charges_only_the_cycles_that_communicate(tmp_path):
  text = _accordion_quick(tmp_path, "--steps", "16", "--examples", "256", "--families", "batch")
  rows = {m.group(1): float(m.group(2)) for m in re.finditer(
      r"\| batch \| (static low|static high|accordion) \| `[^`]+` \| [^|]+ \| ([\d.]+) \|", text)}
  assert set(rows) == {"static low", "static high", "accordion"}, text
  # 16 micro-steps: 16 all-reduces of the small batch, 2 of the large one (each cycle of 8
  # accumulates locally); a step that only accumulates must not be charged its last record.
  assert rows["static high"] < rows["static low"] / 6, rows


@pytest.mark.slow
@_needs("fashion_mlp")
def test_local_workload_quick(tmp_path):
  _run(["experiments/local.py", "--workload", "fashion_mlp", "--quick", "--seeds", "0",
        "--methods", "allreduce;diloco:4", "--out", str(tmp_path)], tmp_path)
  text = (tmp_path / "local.md").read_text()
  assert "Workload `fashion_mlp`" in text and "| `diloco:4` |" in text


@pytest.mark.slow
@_needs("fashion_mlp")
def test_dataquant_workload_quick(tmp_path):
  _run(["experiments/dataquant.py", "--workload", "fashion_mlp", "--quick", "--steps", "4",
        "--eval-every", "2", "--seeds", "0", "--methods", "allreduce,dataquant:2:classes=10",
        "--widths", "none", "--out", str(tmp_path)], tmp_path)
  text = (tmp_path / "dataquant.md").read_text()
  assert "### fashion_mlp: Fashion-MNIST" in text and "| dataquant:2:classes=10 |" in text
  assert "| modeled comm s to target |" in text
  # The all-reduce row's wire bits per step are the quick MLP's fp32 all-reduce on a ring of 8:
  # 269,322 parameters x 32 bits x 1.75, plus the metrics' pmean (2 fp32 scalars).
  row = next(line for line in text.splitlines() if line.startswith("| allreduce |"))
  assert row.split("|")[3].strip() == f"{round((269_322 * 32 + 2 * 32) * 1.75):,}"


@pytest.mark.slow
@_needs("fashion_mlp")
def test_scaling_workload_quick(tmp_path):
  _run(["experiments/scaling.py", "--workload", "fashion_mlp", "--quick", "--steps", "2",
        "--methods", "allreduce,bf16,rank_dad:2", "--out", str(tmp_path)], tmp_path)
  assert "| rank_dad:2 |" in (tmp_path / "scaling.md").read_text()


@pytest.mark.slow
def test_device_run_tiny_on_cpu(tmp_path):
  if workloads.get("text_lm").available() or workloads.get("fashion_mlp").available():
    pytest.skip("needs the Fashion-MNIST and Python documentation packages (make data)")
  env = {**os.environ, "OUT": str(tmp_path / "device"), "PYTHON": sys.executable,
         "DADJAX_FASHION_MNIST": workloads.FASHION_DIR, "DADJAX_TEXT_GLOB": workloads.TEXT_GLOB}
  proc = subprocess.run(["bash", "experiments/device_run.sh", "--tiny", "all"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=3000)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  for name in ("gpt_125m_device.md", "time_gpt.txt", "dad_device.md", "dataquant_device.md",
               "scaling_device.md", "time.txt"):
    assert (tmp_path / "device" / name).exists(), name
  # the GPT part at gpt_tiny: every method of the comparison has its row
  table = (tmp_path / "device" / "gpt_125m_device.md").read_text()
  for spec in ("allreduce", "bf16", "powersgd:4", "ef_topk:0.01", "dad", "rank_dad:4",
               "diloco:10", "diloco:50", "diloco:10:compress=qsgd(7)"):
    assert f"| `{spec}` |" in table, spec


def test_device_run_names_its_parts():
  proc = subprocess.run(["bash", "experiments/device_run.sh", "--tiny", "gpu"], cwd=ROOT,
                        capture_output=True, text=True, timeout=60)
  assert proc.returncode == 2
  assert "PART must be gpt, earlier or all, got 'gpu'" in proc.stdout
