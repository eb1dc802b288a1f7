"""The main job: `dadjax demo` prints and writes the comparison table; the published tables
(the README's, docs/results.md's short run) are what the commands next to them print."""
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from dadjax.run._demo import DEFAULT_METHODS
from dadjax.registry import split_specs

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"


def test_demo_covers_compressors_and_dad():
  for spec in ("allreduce", "topk:0.01", "powersgd:2", "qsgd:16", "sign", "dad", "rank_dad:2"):
    assert spec in DEFAULT_METHODS


def _published(page: pathlib.Path) -> tuple[list[str], list[str]]:
  """The first ``dadjax demo`` command a page shows and the output printed under it: the
  table, the baselines line and the network line."""
  m = re.search(r"^```bash\n(dadjax demo[^\n]*)\n```\n(.*?^Network model:[^\n]*)$", page.read_text(),
                re.S | re.M)
  assert m, f"{page.name} shows no `dadjax demo` command with its table"
  return shlex.split(m.group(1))[1:], [l for l in m.group(2).splitlines() if l.strip()]


def _without_wall(lines: list[str]) -> list[str]:
  """Every line but a table row's last cell (wall time, which no two machines share)."""
  return [l.rsplit("|", 2)[0] if l.startswith("|") else l for l in lines]


def _check_published(page, tmp_path):
  """Runs the page's command as a user does (its own process, XLA's default optimization: the
  suite's faster compile flags change a float's last bits) and compares its table."""
  args, published = _published(page)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  run = subprocess.run([sys.executable, "-m", "dadjax.cli", *args, "--no-progress", "--out",
                        str(tmp_path)], env=env, capture_output=True, text=True, check=False)
  assert run.returncode == 0, run.stderr[-3000:]
  out = run.stdout
  table = (tmp_path / "table.md").read_text()
  assert table.strip() in out
  written = [l for l in table.splitlines() if l.strip()]
  assert _without_wall(written) == _without_wall(published), (
      f"{page.name}'s demo table differs from what `dadjax {' '.join(args)}` prints now; "
      f"paste the new table:\n{table}")
  return args, table


def test_published_demo_table_and_plot(tmp_path):
  """The short demo run docs/results.md publishes is what the command prints (wall aside)."""
  args, table = _check_published(DOCS / "results.md", tmp_path)
  methods = args[args.index("--methods") + 1]
  assert (tmp_path / "accuracy_vs_bits.png").stat().st_size > 10_000
  rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:] if line.startswith("|")}
  assert set(rows) == set(split_specs(methods))
  assert "| 1.0x |" in rows["allreduce"]
  # Every compressed / factored method sends fewer bits than fp32.
  bits = {m: int(r.split("|")[4].strip().replace(",", "")) for m, r in rows.items()}
  assert all(bits[m] < bits["allreduce"] for m in bits if m != "allreduce")


@pytest.mark.slow
def test_readme_demo_table_is_what_make_demo_prints(tmp_path):
  """The README's table is `dadjax demo` (what `make demo` runs) at its defaults (wall aside)."""
  args, _ = _check_published(ROOT / "README.md", tmp_path)
  assert args == ["demo"]


def test_cli_rows_and_demo_table_are_one_read_out(tmp_path):
  """metrics.jsonl, the demo table and NetworkModel agree exactly: one read-out, compiled ops."""
  import json

  import pytest

  from dadjax.comm import NetworkModel, comm_stats
  from dadjax.config import Config
  from dadjax.run._demo import format_table
  from dadjax.train import train
  config = Config(steps=4, eval_every=4, num_sites=8, batch_per_site=4, method="topk:0.01",
                  model_kwargs={"hidden": [32]}, out_dir=str(tmp_path))
  run = train(config, progress=False)
  row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
  rows = 8 * config.batch_per_site
  batch = {"x": run.dataset.x_train[:rows], "y": run.dataset.y_train[:rows]}
  ops = run.step_fn.collectives(run.state, batch)
  network = NetworkModel(config.bandwidth, config.latency, config.num_sites, config.topology)
  summary = comm_stats(run.state)
  assert row["latency_per"] == "compiled op"
  assert row["modeled_comm_s_per_step"] == pytest.approx(network.step_time(summary, ops=ops),
                                                         rel=1e-12)
  # TopK gathers each leaf separately: the compiled ops, not the one recorded call, set latency
  assert ops.count["gather"] > summary.gather_calls
  assert row["modeled_comm_s_per_step"] > network.step_time(summary)
  assert row["wire_bits_per_step"] == summary.wire_bits(8, "ring")
  table = format_table([run]).splitlines()[2]
  cells = [c.strip() for c in table.split("|")]
  assert cells[4] == f"{row['payload_bits_per_step']:,}"
  assert cells[5] == f"{row['wire_bits_per_step']:,.0f}"
  assert cells[8] == f"{row['modeled_comm_s_per_step']:.4f}"
