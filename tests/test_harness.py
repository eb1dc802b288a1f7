"""dadjax.run.to_target and the experiments' shared harness (experiments/harness.py)."""
import math
import pathlib
import sys

import pytest

from dadjax.run import higher_is_better, to_target

sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "experiments"))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _rows(metric, values, bits_per_step=100.0, seconds_per_step=0.5, every=10):
  """Rows as the run loop logs them: every ``every`` steps, cumulative bits and seconds."""
  return [{"step": every * (i + 1), metric: v, "total_wire_bits": bits_per_step * every * (i + 1),
           "modeled_comm_s": seconds_per_step * every * (i + 1)} for i, v in enumerate(values)]


def test_a_rising_accuracy_reaches_its_target_at_the_first_row_at_or_above_it():
  rows = _rows("test_accuracy", [0.3, 0.79, 0.8, 0.95, 0.7])
  got = to_target(rows, "test_accuracy", 0.8)
  assert (got.index, got.step, got.value) == (2, 30, 0.8)
  # the row's own cumulative figures, not steps times a per-step one
  assert got.bits == rows[2]["total_wire_bits"] and got.seconds == rows[2]["modeled_comm_s"]


@pytest.mark.parametrize("metric", ["test_loss", "test_bits_per_byte"])
def test_a_falling_loss_reaches_its_target_at_the_first_row_at_or_below_it(metric):
  rows = _rows(metric, [5.0, 4.2, 3.4, 3.6])
  got = to_target(rows, metric, 3.5)
  assert (got.index, got.step) == (2, 30)
  # read the other way (higher is better), the first row is already "at" 3.5
  assert to_target(rows, metric, 3.5, higher=True).index == 0


def test_a_target_never_reached_is_none_and_nan_or_missing_values_are_skipped():
  assert to_target(_rows("test_accuracy", [0.1, 0.2]), "test_accuracy", 0.9) is None
  assert to_target([], "test_accuracy", 0.5) is None
  rows = [{"step": 1, "test_accuracy": math.nan}, {"step": 2}, {"step": 3, "test_accuracy": 0.6}]
  got = to_target(rows, "test_accuracy", 0.5)
  assert (got.index, got.step, got.bits, got.seconds) == (2, 3, None, None)


def test_other_columns_and_the_direction_by_name():
  rows = _rows("test_accuracy", [0.2, 0.9])
  for row in rows:
    row["total_payload_bits"] = row["total_wire_bits"] / 4
  got = to_target(rows, "test_accuracy", 0.5, bits="total_payload_bits")
  assert got.bits == rows[1]["total_wire_bits"] / 4
  assert higher_is_better("accuracy") and not higher_is_better("train_loss")
  with pytest.raises(ValueError, match="higher="):
    higher_is_better("throughput")


def test_mean_std_over_seeds():
  assert harness.mean_std([1.0, 3.0]) == "2 ± 1"
  assert harness.mean_std([0.5], fmt="{:.2f}") == "0.50"
  # runs that did not reach a target (None / NaN) are left out and counted
  assert harness.mean_std([2.0, None, math.nan, 4.0], fmt="{:.0f}") == "3 ± 1 (2/4 seeds)"
  assert harness.mean_std([None, None]) == "not reached"
  assert harness.mean_std([0.81234, 0.80123], fmt="{:.3f}", std="{:.3f}") == "0.807 ± 0.006"


def test_markdown_table_escapes_cells_and_checks_widths():
  text = harness.table(["method", "acc"], [["demo:lr=0.1|momentum=0", 0.5], ["sgd", "x"]])
  assert text.splitlines() == ["| method | acc |", "|---|---|",
                               "| demo:lr=0.1\\|momentum=0 | 0.5 |", "| sgd | x |"]
  with pytest.raises(ValueError, match="2 columns"):
    harness.table(["a", "b"], [[1]])


def test_grid_runs_every_setting_method_and_seed_in_order():
  calls = []
  results = harness.grid(["a", "b"], [0, 1], lambda s, m, seed: calls.append((s, m, seed)) or seed,
                         settings=["x"])
  assert calls == [("x", "a", 0), ("x", "a", 1), ("x", "b", 0), ("x", "b", 1)]
  assert results == {("x", "a"): [0, 1], ("x", "b"): [0, 1]}


def test_command_line_quotes_what_the_shell_would_split():
  assert harness.command_line("local.py", ["--methods", "allreduce;diloco:4", "--quick"]) == (
      "python experiments/local.py --methods 'allreduce;diloco:4' --quick")


def test_the_usual_fixtures_train_and_their_rows_read_out_to_a_target(tiny_step, tiny_batch):
  from helpers import run_steps  # pylint: disable=g-import-not-at-top
  from dadjax.comm import NetworkModel, report  # pylint: disable=g-import-not-at-top
  state, history = run_steps(tiny_step, tiny_batch, 4)
  assert len(history) == 4
  row = {"step": 4, "test_loss": float(history[-1]["loss"].mean()),
         **report(state, NetworkModel(num_sites=4)).row()}
  got = to_target([row], "test_loss", row["test_loss"])
  assert got.bits == row["total_wire_bits"] > 0 and got.step == 4
