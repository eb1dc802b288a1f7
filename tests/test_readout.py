"""One read-out: every number a user reads is :func:`dadjax.comm.report`'s, and no row column
silently overwrites another."""
import json
from typing import NamedTuple

import jax
import numpy as np
import pytest

from dadjax import cli
from dadjax._core.protocols import collect_rows, merge_rows
from dadjax.comm import host_array, report
from dadjax.config import Config
from dadjax.run import compiled_ops, format_table, json_row, network_model
from dadjax.train import train

CONFIG = Config(steps=2, eval_every=2, num_sites=8, batch_per_site=4, method="topk:0.01",
                model_kwargs={"hidden": [16]})


@pytest.fixture(scope="module")
def run():
  return train(CONFIG, progress=False)


def _report_row(run):
  """``report(...).row()`` of the run's final state, with the compiled step's ops."""
  rows = CONFIG.num_sites * CONFIG.batch_per_site
  batch = {"x": run.dataset.x_train[:rows], "y": run.dataset.y_train[:rows]}
  ops, intra_ops = compiled_ops(run.step_fn, run.state, batch)
  return report(run.state, network_model(CONFIG), ops=ops, intra_ops=intra_ops).row()


def test_merge_rows_refuses_a_column_from_two_sources():
  assert merge_rows(("a", {"x": 1}), ("b", {"y": 2})) == {"x": 1, "y": 2}
  with pytest.raises(ValueError, match=r"'x' comes from both a and c"):
    merge_rows(("a", {"x": 1}), ("b", {"y": 2}), ("c", {"x": 1}))


class _Reports(NamedTuple):
  n: jax.Array

  def metrics_row(self):
    return {"wire_bits_per_step": int(np.ravel(host_array(self.n))[0])}


def test_two_state_nodes_with_one_column_are_refused():
  with pytest.raises(ValueError, match=r"'wire_bits_per_step' comes from both _Reports"):
    collect_rows((_Reports(np.array([1])), {"b": _Reports(np.array([2]))}))


class _ClashingStep:
  """The run's step, but its state's parts report a column of the report."""

  def __init__(self, step_fn):
    self._step_fn = step_fn

  def __getattr__(self, name):
    return getattr(self._step_fn, name)

  def metrics_row(self, state):
    del state
    return {"wire_bits_per_step": 0}


def test_a_state_row_that_would_overwrite_a_report_column_raises(run):
  from dadjax.run._loop import _log_row  # pylint: disable=g-import-not-at-top
  metrics = {"loss": np.zeros(CONFIG.num_sites, np.float32)}
  with pytest.raises(ValueError, match=r"'wire_bits_per_step' comes from both "
                                       r"dadjax\.comm\.report and the train state"):
    _log_row(CONFIG, _ClashingStep(run.step_fn), run.state, metrics, run.dataset,
             network_model(CONFIG), CONFIG.steps, 0.0, 1, (None, None))


def test_loop_rows_are_the_report_row(run):
  expected = _report_row(run)
  assert {"step_bits_per_step", "dense_bits_per_step", "wire_ratio"} <= set(expected)
  assert {k: run.final[k] for k in expected} == expected  # equal, not recomputed
  assert expected["step_bits_per_step"] > 0  # the metrics' all-reduce, in the step's ledger


def test_cli_row_is_the_report_row(run, capsys):
  overrides = [f"{k}={json.dumps(v)}" if not isinstance(v, str) else f"{k}={v}"
               for k, v in (("steps", 2), ("eval_every", 2), ("num_sites", 8),
                            ("batch_per_site", 4), ("method", "topk:0.01"))]
  assert cli.main(["train", "--no-progress", *overrides, "model_kwargs={\"hidden\": [16]}"]) == 0
  printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  expected = json.loads(json_row(_report_row(run)))
  assert {k: printed[k] for k in expected} == expected


def test_demo_table_reads_the_report_row(run):
  expected = _report_row(run)
  cells = [c.strip() for c in format_table([run]).splitlines()[2].split("|")]
  assert cells[4:9] == [f"{expected['payload_bits_per_step']:,}",
                        f"{expected['wire_bits_per_step']:,.0f}",
                        f"{expected['wire_ratio_fp32']:.1f}x",
                        f"{expected['wire_ratio_bf16']:.2f}x",
                        f"{expected['modeled_comm_s_per_step']:.4f}"]
