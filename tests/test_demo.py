"""The main job: `dadjax demo` prints and writes the comparison table."""
from dadjax import cli
from dadjax.run._demo import DEFAULT_METHODS
from dadjax.registry import split_specs


def test_demo_covers_compressors_and_dad():
  for spec in ("allreduce", "topk:0.01", "powersgd:2", "qsgd:16", "sign", "dad", "rank_dad:2"):
    assert spec in DEFAULT_METHODS


def test_demo_table_and_plot(tmp_path, capsys):
  methods = "allreduce,topk:0.01,powersgd:2,dad,rank_dad:2,dataquant:2:classes=10,accordion(powersgd:2,powersgd:1)"
  assert cli.main(["demo", "--no-progress", "--steps", "12", "--methods", methods,
                   "--out", str(tmp_path)]) == 0
  out = capsys.readouterr().out
  table = (tmp_path / "table.md").read_text()
  assert (tmp_path / "accuracy_vs_bits.png").stat().st_size > 10_000
  rows = {line.split("|")[1].strip(): line for line in table.splitlines()[2:] if line.startswith("|")}
  assert set(rows) == set(split_specs(methods))
  assert "| 1.0x |" in rows["allreduce"]
  # Every compressed / factored method sends fewer bits than fp32.
  bits = {m: int(r.split("|")[4].strip().replace(",", "")) for m, r in rows.items()}
  assert all(bits[m] < bits["allreduce"] for m in bits if m != "allreduce")
  assert table.strip() in out


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
