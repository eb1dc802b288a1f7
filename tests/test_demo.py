"""The main job: `dadjax demo` prints and writes the comparison table."""
from dadjax import cli
from dadjax.demo import DEFAULT_METHODS
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
