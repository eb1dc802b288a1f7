"""Training loop, checkpoints, config files and the CLI."""
import io
import json
import sys

import chex
import numpy as np
import pytest

import dadjax
from dadjax import cli
from dadjax.config import Config, load_config
from dadjax.train import train

SMALL = dict(steps=6, eval_every=3, batch_per_site=8, num_sites=4, backend="vmap",
             model_kwargs={"hidden": [16]})


def test_resume_from_checkpoint_equals_uninterrupted_run(tmp_path):
  uninterrupted = train(Config(**SMALL), progress=False)
  ckpt = str(tmp_path / "ckpt")
  first = train(Config(**{**SMALL, "steps": 3}, checkpoint_dir=ckpt, checkpoint_every=3), progress=False)
  assert first.final["step"] == 3
  resumed = train(Config(**SMALL, checkpoint_dir=ckpt, checkpoint_every=3), progress=False)
  # The resumed run started at step 3 and logged only step 6.
  assert [row["step"] for row in resumed.history] == [6]
  chex.assert_trees_all_close(resumed.params, uninterrupted.params, atol=0, rtol=0)
  # The ledger came back with the optimizer state: totals cover all 6 steps.
  assert dadjax.comm_stats(resumed.state.opt_state).total == dadjax.comm_stats(uninterrupted.state.opt_state).total
  assert resumed.final["test_accuracy"] == uninterrupted.final["test_accuracy"]


def test_metrics_jsonl_is_written(tmp_path):
  run = train(Config(**SMALL, out_dir=str(tmp_path)), progress=False)
  rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [3, 6]
  import jax
  n_params = sum(np.size(p) for p in jax.tree.leaves(run.params))
  metric_bits = 2 * 32  # the step's pmean of loss and accuracy, booked in state.comm
  assert rows[-1]["payload_bits_per_step"] == 32 * n_params + metric_bits
  assert rows[-1]["step_bits_per_step"] == metric_bits
  assert rows[-1]["total_payload_bits"] == 6 * (32 * n_params + metric_bits)
  # wire bits: ring all-reduce at the config's N, per compiled op; nothing payload-based is
  # called a ratio
  n = run.config.num_sites
  assert rows[-1]["wire_bits_per_step"] == pytest.approx(2 * (n - 1) / n * (32 * n_params + metric_bits))
  assert rows[-1]["total_wire_bits"] == pytest.approx(6 * rows[-1]["wire_bits_per_step"])
  assert rows[-1]["latency_per"] == "recorded call"  # vmap compiles no collective ops
  assert "compression_ratio" not in rows[-1] and rows[-1]["payload_ratio"] < 1
  assert rows[-1]["epoch"] == 6 / run.steps_per_epoch
  assert {"train_accuracy", "test_accuracy", "test_loss"} <= set(rows[-1])
  assert rows[-1]["modeled_comm_s"] > 0


def test_progress_off_a_terminal_is_a_line_per_evaluation(capsys):
  # captured stderr is not a terminal (a CI log, `| tee`): no bar frames, a line per row
  run = train(Config(**{**SMALL, "steps": 5, "eval_every": 2}))
  err = capsys.readouterr().err
  assert "\r" not in err and "it/s" not in err
  lines = [line for line in err.splitlines() if line.startswith("dadjax: allreduce step ")]
  assert [row["step"] for row in run.history] == [2, 4, 5]
  assert len(lines) == len(run.history)  # exactly one per evaluation interval
  for line, row in zip(lines, run.history):
    assert line.startswith(f"dadjax: allreduce step {row['step']}/5: loss {row['loss']:.4g}, ")
    assert f"test accuracy {row['test_accuracy']:.4g}" in line and line.endswith(" s")
  train(Config(**{**SMALL, "steps": 2, "eval_every": 2}), progress=False)
  assert "dadjax: allreduce step" not in capsys.readouterr().err


def test_progress_on_a_terminal_is_a_bar(monkeypatch):
  class Terminal(io.StringIO):
    def isatty(self):
      return True
  terminal = Terminal()
  monkeypatch.setattr(sys, "stderr", terminal)
  train(Config(**{**SMALL, "steps": 4, "eval_every": 2}))
  out = terminal.getvalue()
  assert "\r" in out and "allreduce" in out  # tqdm's frames, redrawn in place
  assert "dadjax: allreduce step" not in out


def test_training_learns_the_embedded_digits():
  run = train(Config(steps=150, eval_every=150, backend="vmap"), progress=False)
  assert run.final["test_accuracy"] > 0.85


def test_batchnorm_and_dropout_models_train_from_a_config():
  import jax
  bn = train(Config(**{**SMALL, "model": "resnet",
                       "model_kwargs": {"stage_sizes": [1], "width": 4, "norm": "batch"}}),
             progress=False)
  stats = bn.state.model_state["batch_stats"]
  stats_bits = 32 * sum(np.size(v[0]) for v in jax.tree.leaves(jax.device_get(stats)))
  assert bn.final["step_bits_per_step"] == 2 * 32 + stats_bits  # metrics + averaged stats
  assert 0.0 <= bn.final["test_accuracy"] <= 1.0 and np.isfinite(bn.final["test_loss"])
  drop = train(Config(**{**SMALL, "model_kwargs": {"hidden": [16], "dropout": 0.3}}), progress=False)
  assert np.isfinite(drop.final["loss"])


def test_config_file_and_overrides(tmp_path):
  path = tmp_path / "run.toml"
  path.write_text('method = "allreduce"\nsteps = 12\nmodel_kwargs = {hidden = [8]}\n')
  config = load_config(path, ["steps=20", "lr=0.05", "checkpoint_dir=None"])
  assert (config.steps, config.lr, config.model_kwargs) == (20, 0.05, {"hidden": [8]})
  jpath = tmp_path / "run.json"
  jpath.write_text(json.dumps({"num_sites": 2}))
  assert load_config(jpath).num_sites == 2


@pytest.mark.parametrize("overrides,match", [
    (["stepz=3"], "unknown config key"), (["steps"], "key=value"),
    (["steps=0"], "config.steps"), (["optimizer=lbfgs"], "config.optimizer")])
def test_bad_config_is_a_clear_error(overrides, match):
  with pytest.raises(ValueError, match=match):
    load_config(None, overrides)


def test_unknown_key_in_config_file(tmp_path):
  path = tmp_path / "bad.toml"
  path.write_text("learning_rate = 0.1\n")
  with pytest.raises(ValueError, match="learning_rate"):
    load_config(path)


def test_cli_train_runs_and_rejects_unknown_keys(capsys):
  assert cli.main(["train", "--no-progress", "steps=2", "eval_every=2", "num_sites=2",
                   "backend=vmap", "batch_per_site=4"]) == 0
  final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert final["step"] == 2
  assert cli.main(["train", "stepz=2"]) == 2
  assert "dadjax: error: unknown config key" in capsys.readouterr().err


def test_unknown_method_lists_the_valid_ones():
  with pytest.raises(ValueError, match="unknown method 'topq:0.1'.*rank_dad.*topk"):
    train(Config(**{**SMALL, "method": "topq:0.1"}), progress=False)


def test_divergence_stops_before_a_nan_is_checkpointed(tmp_path):
  ckpt = tmp_path / "ckpt"
  good = Config(**{**SMALL, "steps": 3}, checkpoint_dir=str(ckpt), checkpoint_every=3)
  train(good, progress=False)
  # An absurd learning rate is another run: refused against this checkpoint.
  bad = good.replace(steps=9, lr=1e30)
  with pytest.raises(ValueError, match="differing fields: lr"):
    train(bad, progress=False)
  # Its own run diverges at step 2; the finite step-1 checkpoint is kept.
  bad = bad.replace(checkpoint_dir=str(tmp_path / "bad"), checkpoint_every=1)
  with pytest.raises(FloatingPointError, match="diverged.*last finite checkpoint, step 1"):
    train(bad, progress=False)
  resumed = train(good.replace(steps=6), progress=False)
  assert resumed.final["step"] == 6 and np.isfinite(resumed.final["loss"])
