"""Fault injection: killed runs, damaged checkpoints, misused directories, bad input.

Each test asserts the documented outcome (README, "When things go wrong"):
which checkpoint is resumed, the message the user sees, and that the final
parameters equal an uninterrupted run wherever a run was resumed.
"""
import dataclasses
import glob
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from dadjax import cli
from dadjax.run._checkpoint import FINGERPRINT_EXCLUDED, CheckpointDir, fingerprint, state_digest
from dadjax.config import Config, load_config
from dadjax.errors import CheckpointError, ConfigError, DadjaxError, DivergenceError
from dadjax.train import train

SMALL = dict(steps=6, eval_every=2, checkpoint_every=2, batch_per_site=8, num_sites=4,
             backend="vmap", model_kwargs={"hidden": [16]})
ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs a training in a child process; "train:N" kills it (SIGKILL) right after
# step N is logged, "write:N" kills it while checkpoint N is being written
# (its files are on disk under a temporary name, the final rename not done),
# "pause:N" holds the run (and its lock) after step N until stdin closes.
WORKER = r"""
import json, os, signal, sys
mode, at = sys.argv[2].split(":")
at = int(at)
if mode == "write":
  from orbax.checkpoint._src.path import atomicity
  finalize = atomicity.AtomicRenameTemporaryPath.finalize
  async def killing_finalize(self):
    if self._final_path.name == str(at):
      os.kill(os.getpid(), signal.SIGKILL)
    return await finalize(self)
  atomicity.AtomicRenameTemporaryPath.finalize = killing_finalize
from dadjax.config import Config
from dadjax.train import train
def log(row):
  if row["step"] == at and mode == "train":
    os.kill(os.getpid(), signal.SIGKILL)
  if row["step"] == at and mode == "pause":
    print("paused", flush=True)
    sys.stdin.read()
train(Config(**json.loads(sys.argv[1])), progress=False, log=log)
"""


def _env():
  return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _worker(config: dict, mode: str, **kw):
  kw.setdefault("stderr", subprocess.PIPE)
  return subprocess.Popen([sys.executable, "-c", WORKER, json.dumps(config), mode], env=_env(),
                          stdout=subprocess.PIPE, text=True, **kw)


def _steps(ckpt) -> list[int]:
  return sorted(int(p.name) for p in pathlib.Path(ckpt).iterdir() if p.name.isdigit())


@pytest.fixture(scope="module")
def reference():
  """The uninterrupted 6-step run every resumed run must reproduce exactly."""
  return train(Config(**SMALL), progress=False)


def _resume(ckpt, capsys, **changes):
  run = train(Config(**{**SMALL, **changes}, checkpoint_dir=str(ckpt)), progress=False)
  return run, capsys.readouterr().err


# The state each checkpoint directory's step 4 holds (to find its bytes on disk).
_SAVED_AT_4: dict = {}


def _first_two_checkpoints(tmp_path):
  ckpt = tmp_path / "ckpt"
  run = train(Config(**{**SMALL, "steps": 4}, checkpoint_dir=str(ckpt)), progress=False)
  assert _steps(ckpt) == [2, 4]
  _SAVED_AT_4[str(ckpt / "4")] = run.state
  return ckpt


# -- killed runs -----------------------------------------------------------------------------


def test_sigkill_during_training_resumes_the_newest_checkpoint(tmp_path, reference, capsys):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  proc = _worker({**SMALL, "checkpoint_dir": str(ckpt), "out_dir": str(out), "eval_every": 1},
                 "train:5")
  proc.communicate(timeout=600)
  assert proc.returncode == -signal.SIGKILL
  finalized = _steps(ckpt)
  assert finalized and max(finalized) in (2, 4)  # step 4's write may have been cut short
  rows_before = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows_before] == [1, 2, 3, 4, 5]
  run = train(Config(**{**SMALL, "eval_every": 1}, checkpoint_dir=str(ckpt), out_dir=str(out)),
              progress=False)
  err = capsys.readouterr().err
  assert f"resuming from checkpoint step {max(finalized)} in" in err
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
  # No row twice: rows after the resumed step were cut, then logged again.
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  # Wall time continues from the checkpoint's instead of restarting at 0.
  assert all(b["wall_s"] > a["wall_s"] for a, b in zip(rows, rows[1:]))


def test_sigkill_during_a_checkpoint_write_keeps_the_previous_one(tmp_path, reference, capsys):
  ckpt = tmp_path / "ckpt"
  proc = _worker({**SMALL, "checkpoint_dir": str(ckpt)}, "write:4")
  proc.communicate(timeout=600)
  assert proc.returncode == -signal.SIGKILL
  assert _steps(ckpt) == [2]
  assert any("tmp" in p.name for p in ckpt.iterdir())  # the half-written step 4
  run, err = _resume(ckpt, capsys)
  assert "resuming from checkpoint step 2 in" in err and "damaged" not in err
  assert not any("tmp" in p.name for p in ckpt.iterdir())
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)


# -- damaged checkpoints ---------------------------------------------------------------------


def _largest_data_file(step_dir) -> str:
  return max(glob.glob(str(step_dir / "state" / "ocdbt.process_0" / "d" / "*")),
             key=os.path.getsize)


def _truncate(step_dir):
  path = _largest_data_file(step_dir)
  os.truncate(path, os.path.getsize(path) // 2)


def _flip_bytes(step_dir):
  """Flip one byte in the middle of the largest data file (zstd-compressed chunks)."""
  path = _largest_data_file(step_dir)
  data = bytearray(pathlib.Path(path).read_bytes())
  data[len(data) // 2] ^= 0xFF
  pathlib.Path(path).write_bytes(bytes(data))


def _silently_change_a_value(step_dir):
  """Rewrite the stored state, readable as ever, with one value of the head kernel changed.

  What bit rot that the storage and the decoder let through looks like:
  only the checksums recorded at save time can tell.
  """
  state = _SAVED_AT_4[str(step_dir)]
  kernel = np.array(state.params["head"]["kernel"])
  kernel[0, 3, 2] += 1.0
  changed = state._replace(params={**state.params, "head": {**state.params["head"],
                                                             "kernel": kernel}})
  changed = jax.tree.map(np.asarray, changed)
  shutil.rmtree(step_dir / "state")
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(step_dir / "state", changed)


@pytest.mark.parametrize("damage,reason", [
    (_truncate, "the state cannot be restored"),
    (lambda d: os.remove(d / "state" / "_METADATA"), "the state cannot be restored"),
    (lambda d: os.remove(d / "meta" / "metadata"), "its metadata cannot be read"),
    # a flipped compressed byte breaks the decoder or, when it decodes, the checksum
    (_flip_bytes, "(the state cannot be restored|the checksum of .)"),
    (_silently_change_a_value, r"the checksum of \.params\['head'\]\['kernel'\] differs"),
], ids=["truncated_file", "deleted_metadata", "deleted_record", "flipped_bytes", "changed_value"])
def test_damaged_newest_checkpoint_falls_back(tmp_path, reference, capsys, damage, reason):
  ckpt = _first_two_checkpoints(tmp_path)
  capsys.readouterr()
  damage(ckpt / "4")
  run, err = _resume(ckpt, capsys)
  assert re.search(re.escape(f"checkpoint step 4 in {ckpt} is damaged (") + reason, err), err
  assert "resuming from checkpoint step 2 in" in err and "deleted the damaged step(s) [4]" in err
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  assert _steps(ckpt) == [4, 6]  # step 4 rewritten from the resumed run


def test_no_intact_checkpoint_is_an_error_naming_each(tmp_path):
  ckpt = _first_two_checkpoints(tmp_path)
  _silently_change_a_value(ckpt / "4")
  _truncate(ckpt / "2")
  with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step 4: the checksum.*"
                     r"step 2: the state cannot be restored.*restart=True \(--restart\)"):
    train(Config(**SMALL, checkpoint_dir=str(ckpt)), progress=False)
  run = train(Config(**SMALL, checkpoint_dir=str(ckpt)), progress=False, restart=True)
  assert run.final["step"] == 6


@pytest.mark.slow  # about 10 s; the damaged-checkpoint fallbacks run by default
def test_deleted_step_metadata_alone_still_resumes(tmp_path, reference, capsys):
  # orbax's per-step _CHECKPOINT_METADATA (timestamps) is not needed to restore;
  # the content checksums pass, so nothing valid is thrown away.
  ckpt = _first_two_checkpoints(tmp_path)
  os.remove(ckpt / "4" / "_CHECKPOINT_METADATA")
  capsys.readouterr()
  run, err = _resume(ckpt, capsys)
  assert "resuming from checkpoint step 4 in" in err and "damaged" not in err
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)


# -- non-finite states -----------------------------------------------------------------------


def test_nan_step_keeps_the_last_finite_checkpoint(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  bad = Config(**{**SMALL, "lr": 1e35, "checkpoint_every": 1, "eval_every": 1},
               checkpoint_dir=str(ckpt))
  with pytest.raises(DivergenceError, match=r"training diverged: loss is nan at step 2 "
                     r"\(method='allreduce', lr=1e\+35\); "
                     r"the last finite checkpoint, step 1, is kept") as info:
    train(bad, progress=False)
  assert isinstance(info.value, FloatingPointError)
  assert _steps(ckpt) == [1]
  # Rerunning with a sane lr is a different run: refused, naming lr and the two ways out.
  sane = bad.replace(lr=0.1)
  with pytest.raises(CheckpointError, match=r"differing fields: lr: 1e\+35 in the checkpoint, "
                     r"0.1 now. To train this config, use a new checkpoint_dir, or restart=True"):
    train(sane, progress=False)
  capsys.readouterr()
  run = train(sane, progress=False, restart=True)
  assert "restart: deleted the checkpoints at steps [1]" in capsys.readouterr().err
  assert run.final["step"] == 6 and np.isfinite(run.final["loss"])


def test_the_saved_state_is_checked_not_the_loss(tmp_path, monkeypatch):
  # Without the loss check, the state after a diverging update reaches the
  # save: it is refused there, and the finite checkpoint before it is kept.
  monkeypatch.setattr("dadjax.run._loop._check_finite", lambda *a, **k: None)
  ckpt = tmp_path / "ckpt"
  bad = Config(**{**SMALL, "lr": 1e35, "checkpoint_every": 1, "eval_every": 6},
               checkpoint_dir=str(ckpt))
  with pytest.raises(DivergenceError, match=r"training diverged: \.params\['\w+'\]\['\w+'\] is not "
                     r"finite at step 2 .*it was not checkpointed; the last finite checkpoint, "
                     r"step 1, is kept"):
    train(bad, progress=False)
  assert _steps(ckpt) == [1]
  with CheckpointDir(ckpt, bad) as store:
    restored = store.restore(_template(bad))
  assert restored.step == 1 and state_digest(restored.state)[1] == []


def _template(config):
  from dadjax.train import build  # pylint: disable=g-import-not-at-top
  dataset, _, _, step_fn = build(config)
  return step_fn.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])


# -- misused directories ---------------------------------------------------------------------


@pytest.mark.parametrize("change,fields", [
    ({"method": "topk:0.5"}, "method: 'topk:0.1' in the checkpoint, 'topk:0.5' now"),
    ({"num_sites": 2}, "num_sites: 4 in the checkpoint, 2 now"),
    ({"model_kwargs": {"hidden": [32]}, "optimizer": "adam"},
     "model_kwargs: {'hidden': [16]} in the checkpoint, {'hidden': [32]} now; optimizer"),
])
def test_config_change_is_refused_naming_the_fields(tmp_path, change, fields):
  ckpt = tmp_path / "ckpt"
  first = Config(**{**SMALL, "steps": 2, "method": "topk:0.1"}, checkpoint_dir=str(ckpt))
  train(first, progress=False)
  with pytest.raises(CheckpointError) as info:
    train(first.replace(steps=4, **change), progress=False)
  message = str(info.value)
  assert fields in message
  assert "use a new checkpoint_dir, or restart=True (--restart)" in message
  assert _steps(ckpt) == [2]  # nothing was touched


def test_fields_that_may_change_on_resume(tmp_path, reference):
  assert {"steps", "eval_every", "checkpoint_every", "out_dir", "backend"} <= FINGERPRINT_EXCLUDED
  fp = fingerprint(Config(**SMALL))
  assert {"method", "model", "model_kwargs", "optimizer", "lr", "momentum", "num_sites",
          "dataset", "dataset_kwargs", "partition", "seed", "batch_per_site", "version"} <= set(fp)
  ckpt = tmp_path / "ckpt"
  train(Config(**{**SMALL, "steps": 2}, checkpoint_dir=str(ckpt)), progress=False)
  run = train(Config(**{**SMALL, "eval_every": 3, "checkpoint_every": 3},
                     checkpoint_dir=str(ckpt), out_dir=str(tmp_path)), progress=False)
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)


def test_two_concurrent_runs(tmp_path, reference):
  ckpt = tmp_path / "ckpt"
  # stderr to a file: the pipe is not read while the worker runs.
  log = open(tmp_path / "worker.err", "w")  # pylint: disable=consider-using-with
  proc = _worker({**SMALL, "checkpoint_dir": str(ckpt)}, "pause:2", stdin=subprocess.PIPE,
                 stderr=log)
  try:
    assert proc.stdout.readline().strip() == "paused"
    with pytest.raises(CheckpointError,
                       match=f"checkpoint_dir '{ckpt}' is in use by pid {proc.pid}; "):
      train(Config(**SMALL, checkpoint_dir=str(ckpt)), progress=False)
  finally:
    proc.stdin.close()
    proc.wait(timeout=600)
    log.close()
  assert proc.returncode == 0 and _steps(ckpt) == [4, 6]  # the first run was not disturbed
  run = train(Config(**SMALL, checkpoint_dir=str(ckpt)), progress=False)  # lock released
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)


@pytest.mark.slow  # about 10 s
def test_finished_run_reruns_as_a_no_op(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  args = ["train", "--no-progress", f"checkpoint_dir={ckpt}", "steps=4", "eval_every=2",
          "num_sites=4", "backend=vmap", "batch_per_site=8", 'model_kwargs={"hidden": [16]}']
  assert cli.main(args) == 0
  final = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert final["step"] == 4
  assert cli.main(args) == 0
  captured = capsys.readouterr()
  assert json.loads(captured.out) == final  # only the final metrics, nothing retrained
  assert "already finished at step 4; nothing to do" in captured.err
  assert cli.main(args[:-5] + ["steps=2"] + args[-4:]) == 2
  err = capsys.readouterr().err
  assert err.strip().splitlines()[-1] == (
      f"dadjax: error: config.steps=2 is smaller than the step of the checkpoint in "
      f"checkpoint_dir '{ckpt}' (4); set steps >= 4, or use a new checkpoint_dir or "
      "restart=True (--restart)")
  assert cli.main(args[:-5] + ["steps=6"] + args[-4:]) == 0  # more steps: resumes
  capsys.readouterr()
  assert cli.main(args + ["--restart"]) == 0  # starts over from step 0
  captured = capsys.readouterr()
  assert "restart: deleted the checkpoints at steps [4, 6]" in captured.err
  assert [json.loads(r)["step"] for r in captured.out.splitlines()] == [2, 4]  # the final row once
  assert json.loads(captured.out.splitlines()[-1])["loss"] == final["loss"]


# -- checksums -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8, jnp.bool_])
def test_checksum_sees_any_single_element_change(dtype):
  x = (jnp.arange(300) % 7).astype(dtype)
  base = state_digest({"x": x})[0]["['x']"]
  for i in (0, 150, 299):
    y = x.at[i].set(jnp.logical_not(x[i]) if dtype == jnp.bool_ else x[i] + 1)
    assert state_digest({"x": y})[0]["['x']"] != base
  # A permutation changes it too (weights depend on the position).
  assert state_digest({"x": x[::-1]})[0]["['x']"] != base


def test_checksum_is_the_same_for_every_sharding():
  x = jnp.arange(8 * 5, dtype=jnp.float32).reshape(8, 5)
  mesh = jax.make_mesh((8,), ("s",))
  sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("s")))
  assert state_digest([x]) == state_digest([sharded])
  assert state_digest([x.at[3, 1].set(jnp.nan)])[1] == ["[0]"]


# -- bad input: one line, exit code 2 --------------------------------------------------------

TINY = ["steps=1", "eval_every=1", "num_sites=2", "backend=vmap", "batch_per_site=4"]


@pytest.mark.parametrize("argv,message", [
    (["--config", "missing.toml"], "config file 'missing.toml' not found"),
    (["method=topq:0.1"], "config.method: unknown method 'topq:0.1'"),
    (["lr=inf"], "config.lr must be finite and in (0, inf], got inf"),
    (["lr=-1"], "config.lr must be finite and in (0, inf], got -1.0"),
    (["momentum=nan"], "config.momentum must be finite and in [0, 1), got nan"),
    (["momentum=1"], "config.momentum must be finite and in [0, 1), got 1.0"),
    (["steps=ten"], "override steps='ten': not a valid int"),
    (['model_kwargs={"hidden": [0]}'], "config.model_kwargs['hidden'] must hold ints >= 1"),
    (['model_kwargs={"hiden": [8]}'],
     "config.model_kwargs has unknown key(s) ['hiden']; valid keys: ['dropout', 'hidden']"),
    (['model_kwargs={"hidden": [8'], "override model_kwargs="),
    (['dataset_kwargs={"n_train": 5}'],
     "config.dataset_kwargs has unknown key(s) ['n_train']; valid keys: ['seed', 'test_fraction']"),
    (["model=mlpp"], "config.model: unknown model 'mlpp'; valid names: ["),
    (["dataset=nosuchdataset"], "cannot build the run from the config: Unknown data set name"),
    (['dataset_kwargs={"test_fraction": 2}'], "cannot build the run from the config: "),
    (["model=vit", 'model_kwargs={"patch_size": 3}'],
     "cannot build the run from the config: image 8x8 not divisible by patch_size=3"),
    (["model=cnn", 'model_kwargs={"features": [4, 4, 4, 4]}'],
     "model 'cnn' with {'features': [4, 4, 4, 4]} has a layer with no inputs for input shape"),
    (["partition=random"], "config.partition must be one of ['iid', 'by_class', 'dirichlet']"),
    (["stepz=3"], "unknown config key(s) ['stepz']; valid keys: ["),
    (["shard_params=true"], "config.shard_params=True splits parameters over the devices of a "
                            "site: it needs config.per_site >= 2, got 1"),
    # upper bounds: past them a value exhausts the machine or overflows a counter
    (["num_sites=1400", "backend=shard_map"],
     "config.num_sites * config.per_site = 1400 devices is more than 1024"),
    (['model_kwargs={"hidden": [1e9]}'],
     "config.model_kwargs['hidden'] must hold ints in [1, 1048576] (a width, depth or size;"),
    (["lr_schedule=step:0.1:100000000000000000000"],
     "config.lr_schedule: the decay steps must be ints <= 2147483647 (the step counter is int32)"),
    (["steps=100000000000000000000000000000"],
     "config.steps must be an int in [1, 2147483647] (the step counter is int32), got 1"),
])
def test_cli_errors_are_one_line(capsys, argv, message):
  assert cli.main(["train", "--no-progress", *TINY, *argv]) == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert lines == [lines[0]] and lines[0].startswith("dadjax: error: ")
  assert message in lines[0]
  assert "Traceback" not in captured.err and captured.out == ""


def test_unwritable_out_dir_is_a_config_error_that_releases_the_lock(tmp_path, capsys):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  ckpt = tmp_path / "ckpt"
  argv = ["train", "--no-progress", *TINY, f"checkpoint_dir={ckpt}"]
  assert cli.main([*argv, f"out_dir={blocker / 'out'}"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith(f"dadjax: error: config.out_dir '{blocker / 'out'}' cannot hold "
                        "metrics.jsonl: ") and "choose a writable directory" in err
  assert cli.main([*argv, f"out_dir={tmp_path / 'out'}"]) == 0  # the lock was released
  assert (tmp_path / "out" / "metrics.jsonl").read_text().count("\n") == 1


def test_malformed_toml_names_the_file(tmp_path, capsys):
  path = tmp_path / "run.toml"
  path.write_text("steps = = 3\n")
  assert cli.main(["train", "--config", str(path)]) == 2
  assert f"dadjax: error: config file '{path}' is not valid TOML: " in capsys.readouterr().err
  path.write_text('steps = "ten"\n')
  with pytest.raises(ConfigError, match=r"config.steps must be int, got 'ten'"):
    load_config(path)
  path.write_text("learning_rate = 0.1\n")
  with pytest.raises(ConfigError, match=f"config file '{path}': unknown config key"):
    load_config(path)


def test_debug_shows_the_traceback(capsys):
  assert cli.main(["--debug", "train", "lr=inf"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" in err and "ConfigError" in err and "dadjax: error: config.lr" in err
  assert cli.main(["train", "--debug", "lr=inf"]) == 2
  assert "Traceback" in capsys.readouterr().err


def test_errors_are_value_errors():
  assert issubclass(DadjaxError, ValueError)
  assert issubclass(ConfigError, DadjaxError) and issubclass(CheckpointError, DadjaxError)
  with pytest.raises(ValueError, match="config.lr"):
    Config(lr=float("nan"))


def test_cli_simulates_enough_devices_for_the_config(tmp_path):
  env = {k: v for k, v in _env().items() if k != "XLA_FLAGS"}
  env["JAX_PLATFORMS"] = "cpu"
  proc = subprocess.run(
      [sys.executable, "-m", "dadjax.cli", "train", "--no-progress", "num_sites=12",
       "backend=shard_map", "steps=1", "eval_every=1", "batch_per_site=2",
       'model_kwargs={"hidden": [8]}'], env=env, capture_output=True, text=True, timeout=600,
      cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout.strip().splitlines()[-1])["step"] == 1


def test_directory_without_dadjax_records_or_unusable(tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  foreign = tmp_path / "foreign"
  with ocp.CheckpointManager(foreign, options=ocp.CheckpointManagerOptions(create=True)) as m:
    m.save(2, args=ocp.args.StandardSave({"a": jnp.ones(3)}))
  with pytest.raises(CheckpointError, match=r"no intact checkpoint .*step 2: it has no dadjax "
                     r"record \(an older format, or not written by dadjax\)"):
    train(Config(**{**SMALL, "steps": 2}, checkpoint_dir=str(foreign)), progress=False)
  (tmp_path / "file").write_text("")
  with pytest.raises(CheckpointError, match=f"checkpoint_dir '{tmp_path / 'file'}' cannot be used"):
    train(Config(**{**SMALL, "steps": 2}, checkpoint_dir=str(tmp_path / "file")), progress=False)



def test_run_final_without_a_logged_row_is_a_clear_error():
  run = train(Config(**SMALL), progress=False)
  assert run.final["step"] == SMALL["steps"]
  empty = dataclasses.replace(run, history=[])  # e.g. a rerun that logged nothing
  with pytest.raises(DadjaxError, match="no metrics row was logged by this run"):
    empty.final  # pylint: disable=pointless-statement


# -- signals, full disks, vanishing directories (issue: runs that survive clusters) ---------

# The command line in a child process; a hook runs as each metrics row is formatted
# (before it is written): "slow" sleeps per row (time to deliver a signal between
# steps), "fill:N:DIR" fills the file system of DIR before row N, "chmod:N:DIR" makes
# DIR read-only before row N.
CLI_WORKER = r"""
import os, sys, time
import dadjax.run._metrics_file as io
hooks = [h.split(":", 2) for h in sys.argv[1].split(",") if h]
format_row = io.json_row
done = set()
def hooked(row):
  for hook in hooks:
    if hook[0] == "slow":
      time.sleep(float(hook[1]))
    elif int(hook[1]) == row["step"] and tuple(hook) not in done:
      done.add(tuple(hook))
      import glob  # first let the checkpoint writes in flight finish
      while glob.glob(os.path.join(hook[2], "**", "*orbax-checkpoint-tmp*"), recursive=True):
        time.sleep(0.01)
      if hook[0] == "fill":
        with open(os.path.join(hook[2], "filler"), "ab", buffering=0) as f:
          for size in (65536, 1):
            try:
              while True:
                f.write(b"x" * size)
            except OSError:
              pass
      elif hook[0] == "chmod":
        os.chmod(hook[2], 0o555)
  return format_row(row)
io.json_row = hooked
from dadjax import cli
sys.exit(cli.main(sys.argv[2:]))
"""

RUN_ARGS = ["train", "--no-progress", "num_sites=4", "backend=vmap", "batch_per_site=8",
            'model_kwargs={"hidden": [16]}']
NO_CAPS = ["setpriv", "--inh-caps=-dac_override,-dac_read_search",
           "--bounding-set=-dac_override,-dac_read_search"]


def _cli_worker(hooks, args, *, prefix=(), **kw):
  return subprocess.Popen([*prefix, sys.executable, "-c", CLI_WORKER, ",".join(hooks), *RUN_ARGS,
                           *args], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, **kw)


def _signal_at(proc, step, signum=signal.SIGTERM) -> None:
  """Send ``signum`` to ``proc`` once it has logged the metrics row of ``step``."""
  for line in proc.stdout:
    if json.loads(line)["step"] == step:
      proc.send_signal(signum)
      return


def _config_of(args) -> Config:
  return load_config(None, [a for a in RUN_ARGS + args if "=" in a])


@pytest.mark.parametrize("signum", [signal.SIGTERM,
                                    pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGTERM", "SIGINT"])
def test_signal_between_checkpoints_saves_that_step_and_resumes_identically(tmp_path, capsys,
                                                                               signum):
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  args = ["steps=40", "eval_every=1", "checkpoint_every=20", f"checkpoint_dir={ckpt}",
          f"out_dir={out}"]
  at = np.random.default_rng(int(signum)).integers(3, 12)  # between the checkpoints 0 and 20
  proc = _cli_worker(["slow:0.05"], args)
  try:
    _signal_at(proc, at, signum)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  name = signal.Signals(signum).name
  assert proc.returncode == 128 + signum  # 143 / 130
  last = err.strip().splitlines()[-1]
  found = re.fullmatch(rf"dadjax: stopped by {name} at step (\d+); checkpoint (\d+) saved in "
                       rf"{re.escape(str(ckpt))}; rerun the same command to resume", last)
  assert found, err[-2000:]
  stopped = int(found[1])
  assert found[2] == found[1] and at <= stopped < 20 and _steps(ckpt) == [stopped]
  assert (ckpt / "dadjax.lock").read_text() == ""  # released
  run = train(_config_of(args), progress=False)  # the rerun resumes from that step
  assert f"resuming from checkpoint step {stopped} in" in capsys.readouterr().err
  reference = train(_config_of(args).replace(checkpoint_dir=None, out_dir=None), progress=False)
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 41))


def test_signal_during_the_last_step_is_not_absorbed(tmp_path, reference):
  from dadjax.errors import Stopped  # pylint: disable=g-import-not-at-top
  ckpt = tmp_path / "ckpt"
  config = Config(**SMALL, checkpoint_dir=str(ckpt))

  def log(row):  # the signal arrives while the last step is logged, before it is saved
    if row["step"] == config.steps:
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(Stopped) as info:
    train(config, progress=False, log=log)
  assert info.value.exit_code == 143 and info.value.step == config.steps
  assert str(info.value) == (f"stopped by SIGTERM at step {config.steps}; checkpoint "
                             f"{config.steps} saved in {ckpt}; that is the last step: the run is "
                             "complete (a rerun has nothing to do)")
  run = train(config, progress=False)  # nothing to do; the saved state is the final one
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)


def test_second_signal_stops_at_once(tmp_path):
  ckpt = tmp_path / "ckpt"
  args = ["steps=40", "eval_every=1", "checkpoint_every=4", f"checkpoint_dir={ckpt}"]
  proc = _cli_worker(["slow:0.2"], args)
  try:
    _signal_at(proc, 6)
    for line in proc.stderr:  # the first one was handled: the run is finishing its step
      if "SIGTERM received" in line:
        proc.send_signal(signal.SIGTERM)
        break
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 143
  assert "dadjax: second SIGTERM: stopping at once, without a new checkpoint; the last " \
         "checkpoint, step 4, is intact" in err, err[-2000:]
  assert _steps(ckpt) == [4]


def test_grace_time_bounds_the_stop(tmp_path):
  args = ["steps=40", "eval_every=1", "checkpoint_every=4", "signal_grace_s=0.05",
          f"checkpoint_dir={tmp_path / 'ckpt'}"]
  proc = _cli_worker(["slow:0.3"], args)
  try:
    _signal_at(proc, 5)
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == 143
  assert ("dadjax: the stop after SIGTERM took longer than signal_grace_s=0.05, without a new "
          "checkpoint; the last checkpoint, step 4, is intact") in err, err[-2000:]


def test_stale_lock_of_a_dead_process_is_taken_over(tmp_path, capsys):
  ckpt = tmp_path / "ckpt"
  ckpt.mkdir()
  dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                        capture_output=True, text=True, check=True)
  pid = int(dead.stdout)
  (ckpt / "dadjax.lock").write_text(f"{pid}\n")  # what a killed run leaves behind
  train(Config(**{**SMALL, "steps": 2}, checkpoint_dir=str(ckpt)), progress=False)
  assert (f"dadjax: taking over the lock of {ckpt} from pid {pid}, which is no longer running"
          in capsys.readouterr().err)


def test_signal_with_checkpoint_on_signal_false_acts_as_usual(tmp_path):
  proc = _cli_worker(["slow:0.05"], ["steps=40", "eval_every=1", "checkpoint_on_signal=false",
                                     f"checkpoint_dir={tmp_path / 'ckpt'}"])
  try:
    _signal_at(proc, 3)
    proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == -signal.SIGTERM


# -- bad data --------------------------------------------------------------------------------


def _digits_with(monkeypatch, **changes):
  from dadjax import data as data_lib  # pylint: disable=g-import-not-at-top
  clean = data_lib.load("digits")
  changed = clean._replace(**{k: (v(clean) if callable(v) else v) for k, v in changes.items()})
  monkeypatch.setattr(data_lib, "load", lambda *a, **k: changed)
  return changed


def _set(array, index, value, dtype=None):
  array = np.array(array, dtype=dtype or np.asarray(array).dtype)
  array[index] = value
  return array


@pytest.mark.parametrize("changes,message", [
    ({"y_train": lambda d: _set(d.y_train, [5, 9], -1)},
     "data set 'digits', train split: 2 of 1437 labels are outside [0, 10) (num_classes=10); "
     "the first is row 5: -1"),
    ({"y_test": lambda d: _set(d.y_test, 7, 10)},
     "data set 'digits', test split: 1 of 360 labels are outside [0, 10) (num_classes=10); "
     "the first is row 7: 10"),
    ({"num_classes": 5}, "data set 'digits', train split: "),
    ({"x_train": lambda d: _set(d.x_train, (3, 0, 1, 0), np.nan)},
     "data set 'digits', train split: 1 of 1437 rows hold non-finite features (NaN or inf); "
     "the first is row 3"),
    ({"x_test": lambda d: _set(d.x_test, (11, 2, 2, 0), np.inf)},
     "data set 'digits', test split: 1 of 360 rows hold non-finite features (NaN or inf); "
     "the first is row 11"),
    ({"y_train": lambda d: d.y_train.astype(np.float32)},
     "data set 'digits', train split: labels must be integers (class ids) for a classification "
     "loss, got dtype float32"),
    ({"x_test": lambda d: d.x_test[:0], "y_test": lambda d: d.y_test[:0]},
     "data set 'digits', test split: it is empty (0 inputs, 0 labels)"),
    ({"y_train": lambda d: d.y_train[:-3]},
     "data set 'digits', train split: 1437 inputs but 1434 labels"),
], ids=["label_-1", "label_10", "num_classes_5", "nan_feature", "inf_test_feature",
        "float_labels", "empty_test", "length_mismatch"])
def test_bad_data_is_a_data_error_before_any_step(monkeypatch, changes, message):
  from dadjax.errors import DataError  # pylint: disable=g-import-not-at-top
  _digits_with(monkeypatch, **changes)
  calls = []
  monkeypatch.setattr("dadjax.run._loop.make_train_step",
                      lambda *a, **k: calls.append(1))  # never reached
  with pytest.raises(DataError) as info:
    train(Config(**SMALL), progress=False)
  assert message in str(info.value) and calls == []
  if "num_classes" in changes:
    assert "labels are outside [0, 5) (num_classes=5)" in str(info.value)


@pytest.mark.parametrize("labels,message", [
    (lambda y: y.astype(np.float32),
     "data set 'fl', train split: labels must be integers (class ids) for a classification "
     "loss, got dtype float32; every value is a whole number (the first is row 0: {first}): "
     "store them as integers"),
    (lambda y: _set(y.astype(np.float32), [7, 9], [0.5, np.nan]),
     "data set 'fl', train split: labels must be integers (class ids) for a classification "
     "loss, got dtype float32; 2 of 40 rows hold values that are not whole numbers; the first "
     "is row 7: 0.5"),
], ids=["whole_floats", "fractions_and_nan"])
def test_float_labels_in_an_npz_name_the_split_and_the_first_row(tmp_path, capsys, labels,
                                                                 message):
  rng = np.random.default_rng(0)
  y = rng.integers(0, 3, 40)
  path = tmp_path / "fl.npz"
  np.savez(path, x_train=rng.normal(size=(40, 8)).astype(np.float32), y_train=labels(y),
           x_test=rng.normal(size=(10, 8)).astype(np.float32), y_test=rng.integers(0, 3, 10))
  assert cli.main(["train", "--no-progress", f"dataset={path}", "steps=1"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("dadjax: error: " + message.format(first=float(y[0]))), err
  assert len(err.splitlines()) == 1


def test_metrics_stay_strict_json_when_the_test_loss_is_nan(tmp_path, monkeypatch):
  # finite but huge test inputs: the forward pass overflows, the test loss is not finite
  _digits_with(monkeypatch, x_test=lambda d: (d.x_test * 3e38).astype(np.float32))
  run = train(Config(**SMALL, out_dir=str(tmp_path)), progress=False)
  assert not np.isfinite(run.final["test_loss"])

  def refuse(name):
    raise ValueError(f"not JSON: {name}")

  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  rows = [json.loads(line, parse_constant=refuse) for line in lines]
  assert len(rows) == 3 and all(r["test_loss"] is None and "test_loss" in r["nonfinite"]
                                for r in rows)
  assert all(np.isfinite(r["loss"]) for r in rows)


# -- full disks and vanishing directories ----------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
  """A 4 MB tmpfs (mounted by the test, unmounted after), or a skip with the reason."""
  mnt = tmp_path / "disk"
  mnt.mkdir()
  proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)],
                        capture_output=True, text=True, check=False)
  if proc.returncode != 0:
    pytest.skip(f"cannot mount a small tmpfs ({proc.stderr.strip() or proc.returncode})")
  try:
    yield mnt
  finally:
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def _check_no_space(proc, target):
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err[-3000:]
  last = err.strip().splitlines()[-1]
  found = re.fullmatch(rf"dadjax: error: no space left on device writing {re.escape(target)} "
                       r"\(.*No space left on device\); the last checkpoint, step (\d+), is intact",
                       last)
  assert found, err[-3000:]
  assert err.strip() == last, err[-3000:]  # that one line and nothing else (no orbax report)
  return int(found[1])


def test_no_space_left_during_a_checkpoint(small_disk, tmp_path, capsys):
  ckpt, out = small_disk / "ckpt", tmp_path / "out"
  args = ["steps=8", "eval_every=2", "checkpoint_every=2", f"checkpoint_dir={ckpt}",
          f"out_dir={out}"]
  kept = _check_no_space(_cli_worker([f"fill:4:{small_disk}"], args), str(ckpt))
  assert kept == 2 and _steps(ckpt) == [2]
  assert not [p for p in ckpt.iterdir() if "tmp" in p.name]  # the half-written step is removed
  os.remove(small_disk / "filler")  # space freed: the rerun resumes from step 2
  run = train(_config_of(args), progress=False)
  assert "resuming from checkpoint step 2 in" in capsys.readouterr().err
  reference = train(_config_of(args).replace(checkpoint_dir=None, out_dir=None), progress=False)
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [2, 4, 6, 8]


@pytest.mark.slow  # about 18 s; the checkpoint's full disk runs by default
def test_no_space_left_during_a_metrics_write(small_disk, tmp_path, capsys):
  ckpt, out = tmp_path / "ckpt", small_disk / "out"
  args = ["steps=30", "eval_every=1", "checkpoint_every=2", f"checkpoint_dir={ckpt}",
          f"out_dir={out}"]
  # the disk is full from row 3 on; the file grows into a new page within a few rows
  kept = _check_no_space(_cli_worker([f"fill:3:{small_disk}"], args),
                         str(out / "metrics.jsonl"))
  lines = (out / "metrics.jsonl").read_text().splitlines()
  steps = [json.loads(line)["step"] for line in lines]  # every line whole
  assert steps == list(range(1, len(steps) + 1)) and kept <= len(steps) < 30
  os.remove(small_disk / "filler")
  run = train(_config_of(args), progress=False)
  assert f"resuming from checkpoint step {kept} in" in capsys.readouterr().err
  reference = train(_config_of(args).replace(checkpoint_dir=None, out_dir=None), progress=False)
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 31))


def test_read_only_checkpoint_dir_ends_the_process_with_one_line(tmp_path):
  ckpt = tmp_path / "ckpt"
  prefix = ()
  if os.geteuid() == 0:  # root writes anywhere: drop that privilege in the child
    if not shutil.which("setpriv"):
      pytest.skip("running as root without setpriv: a read-only directory cannot be simulated")
    prefix = NO_CAPS
  args = ["steps=8", "eval_every=2", "checkpoint_every=2", f"checkpoint_dir={ckpt}"]
  proc = _cli_worker([f"chmod:4:{ckpt}"], args, prefix=prefix)
  try:
    _, err = proc.communicate(timeout=60)  # never hangs in orbax's writer threads
  finally:
    proc.kill()
    os.chmod(ckpt, 0o755)
  assert proc.returncode == 2, err[-3000:]
  last = err.strip().splitlines()[-1]
  assert re.fullmatch(rf"dadjax: error: checkpoint step 4 could not be written in "
                      rf"{re.escape(str(ckpt))} \(PermissionError: .*\); the last checkpoint, "
                      rf"step 2, is intact", last), last
  assert "Traceback" not in err and _steps(ckpt) == [2]


def _remove_tree(path):
  """``rm -rf path`` as a user would, while the run's asynchronous checkpoint writer may still
  rename or add files inside it (``shutil.rmtree`` alone raises when an entry it listed
  vanishes)."""
  for _ in range(100):
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
      return
    time.sleep(0.02)


def _break_at(step, action):
  def log(row):
    if row["step"] == step:
      action()
  return log


@pytest.mark.parametrize("action,message", [
    (lambda d: shutil.rmtree(d / "out"), "out_dir '{d}/out' was deleted or replaced while the "
                                         "run wrote to it"),
    (lambda d: (os.remove(d / "out" / "metrics.jsonl"), (d / "out" / "metrics.jsonl").mkdir()),
     "'{d}/out/metrics.jsonl' was deleted or replaced while the run wrote to it"),
    (lambda d: _remove_tree(d / "ckpt"), "the lock '{d}/ckpt/dadjax.lock' of this run was "
                                         "deleted or replaced"),
    (lambda d: os.remove(d / "ckpt" / "dadjax.lock"), "the lock '{d}/ckpt/dadjax.lock' of this "
                                                      "run was deleted or replaced"),
], ids=["out_dir_deleted", "metrics_replaced_by_a_dir", "checkpoint_dir_deleted",
        "lock_deleted"])
def test_vanishing_directories_stop_the_run(tmp_path, action, message):
  config = Config(**{**SMALL, "eval_every": 1, "checkpoint_every": 3},
                  checkpoint_dir=str(tmp_path / "ckpt"), out_dir=str(tmp_path / "out"))
  with pytest.raises(DadjaxError, match=re.escape(message.format(d=tmp_path))):
    train(config, progress=False, log=_break_at(4, lambda: action(tmp_path)))


def test_foreign_folders_and_links_beside_checkpoints_are_untouched(tmp_path, reference, capsys):
  ckpt = _first_two_checkpoints(tmp_path)
  (ckpt / "2024").mkdir()
  (ckpt / "2024" / "notes.txt").write_text("mine")
  outside = tmp_path / "outside"
  shutil.copytree(ckpt / "2", outside)  # a real checkpoint, reached through a link
  os.symlink(outside, ckpt / "9")
  capsys.readouterr()
  run, err = _resume(ckpt, capsys)
  assert "resuming from checkpoint step 4 in" in err
  assert f"9, 2024 in {ckpt}: not dadjax checkpoints (no dadjax record, or a link); left " \
         "untouched" in err
  chex.assert_trees_all_close(run.params, reference.params, atol=0, rtol=0)
  assert _steps(ckpt) == [4, 6, 9, 2024]  # 9: the link; steps rotate among dadjax's own only
  assert (ckpt / "2024" / "notes.txt").read_text() == "mine" and (outside / "meta").is_dir()
  train(Config(**SMALL, checkpoint_dir=str(ckpt)), progress=False, restart=True)
  assert (ckpt / "2024" / "notes.txt").exists() and (ckpt / "9").is_symlink()
  assert (outside / "state").is_dir()


# -- two processes (gloo): preemption and a lost host ----------------------------------------

MH_WORKER = ROOT / "tests" / "faults_multihost_worker.py"


def _free_port():
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_processes(tmp_path, ckpt, steps, slow, *overrides):
  env = {k: v for k, v in _env().items() if k != "XLA_FLAGS"}
  env["PYTHONPATH"] = str(ROOT / "tests") + os.pathsep + env["PYTHONPATH"]
  port = _free_port()
  return [subprocess.Popen([sys.executable, str(MH_WORKER), str(port), str(i),
                            str(tmp_path / "params.npz"), str(ckpt), str(steps), str(slow),
                            *overrides], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True) for i in range(2)]


def _finish(procs, timeout=120):
  errs = []
  try:
    for p in procs:
      errs.append(p.communicate(timeout=timeout)[1])
  finally:
    for p in procs:
      p.kill()
  return errs


def _wait_for_row(proc, step):
  for line in proc.stdout:
    if line.strip() == f"row {step}":
      return
  pytest.fail(f"the worker ended before step {step}")


def test_transport_errors_are_told_from_a_process_s_own_errors():
  from dadjax.run import _peers  # pylint: disable=g-import-not-at-top
  gloo = jax.errors.JaxRuntimeError("INTERNAL: Gloo AllGather failed: [gloo/transport/tcp/"
                                    "pair.cc:547] Connection closed by peer [127.0.0.1]:4")
  reset = jax.errors.JaxRuntimeError("INTERNAL: ... pair.cc:538] Connection reset by peer")
  assert _peers.is_transport_error(gloo) and _peers.is_transport_error(reset)
  try:  # wrapped, as a checkpoint's agreement wraps it
    try:
      raise gloo
    except Exception as e:
      raise CheckpointError("the processes could not exchange their verdicts") from e
  except CheckpointError as wrapped:
    assert _peers.is_transport_error(wrapped)
  assert not _peers.is_transport_error(jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of "
                                                                  "memory allocating 8 GB"))
  assert not _peers.is_transport_error(RuntimeError("Connection closed by peer"))  # not JAX's
  watch = _peers.PeerWatch(1.0, step=lambda: 0, last_checkpoint=lambda: None)
  with watch:  # one process: nothing to wait for
    started = time.monotonic()
    watch.confirm(gloo)
    assert time.monotonic() - started < 0.5


@pytest.mark.slow  # 45 s; the one-process signal tests and the lost-process test stay default
@pytest.mark.multihost
def test_two_processes_sigterm_to_one_both_save_the_same_step_and_resume(tmp_path):
  ckpt = tmp_path / "ckpt"
  overrides = ["eval_every=1", "checkpoint_every=10"]
  procs = _two_processes(tmp_path, ckpt, 12, 0.2, *overrides)
  _wait_for_row(procs[0], 3)
  procs[1].send_signal(signal.SIGTERM)  # JAX's preemption service tells process 0
  errs = _finish(procs)
  stops = [re.search(r"dadjax: stopped by SIGTERM at step (\d+); checkpoint (\d+) saved in "
                     + re.escape(str(ckpt)), e) for e in errs]
  assert [p.returncode for p in procs] == [143, 143], errs[0][-2000:] + errs[1][-2000:]
  assert all(stops) and stops[0][1] == stops[1][1] == stops[0][2], errs
  stopped = int(stops[0][1])
  assert 3 <= stopped < 10 and _steps(ckpt) == [stopped]
  procs = _two_processes(tmp_path, ckpt, 12, 0, *overrides)  # the rerun resumes there
  errs = _finish(procs)
  assert [p.returncode for p in procs] == [0, 0], errs
  assert all(f"dadjax: resuming from checkpoint step {stopped} in {ckpt}" in e for e in errs)
  got = dict(np.load(tmp_path / "params.npz"))
  whole = tmp_path / "uninterrupted"  # the same two processes, never stopped
  whole.mkdir()
  errs = _finish(_two_processes(whole, whole / "ckpt", 12, 0, *overrides))
  want = dict(np.load(whole / "params.npz"))
  assert sorted(got) == sorted(want) and want, errs
  for name, leaf in want.items():
    np.testing.assert_array_equal(got[name], leaf)


@pytest.mark.multihost
def test_lost_process_stops_the_survivor_within_peer_timeout(tmp_path):
  ckpt = tmp_path / "ckpt"
  procs = _two_processes(tmp_path, ckpt, 200, 0.1, "eval_every=1", "checkpoint_every=2",
                         "peer_timeout_s=3")
  _wait_for_row(procs[0], 5)
  procs[1].kill()
  killed = time.monotonic()
  procs[0].wait(timeout=60)  # JAX alone would wait 100 s, then abort
  waited = time.monotonic() - killed
  errs = _finish(procs, timeout=60)
  assert procs[0].returncode == 2, errs[0][-3000:]
  # The bound is peer_timeout_s plus one heartbeat look; the slack is for a loaded machine.
  assert waited < 3 + 20, waited
  last = errs[0].strip().splitlines()[-1]
  assert re.fullmatch(r"dadjax: error: process 1 stopped responding at step \d+ \(no sign of "
                      r"life for 3 s\); the last checkpoint is step \d+; restart all processes "
                      r"to resume", last), last


@pytest.mark.multihost
@pytest.mark.parametrize("fails", [1, pytest.param(0, marks=pytest.mark.slow)],
                         ids=["process-1-fails", "process-0-fails"])
def test_an_error_in_one_process_ends_the_other_promptly_with_that_error(tmp_path, fails):
  ckpt = tmp_path / "ckpt"
  procs = _two_processes(tmp_path, ckpt, 200, 0.1, "eval_every=1", "checkpoint_every=2",
                         "peer_timeout_s=30", "fail_at=5", f"fails={fails}")
  _wait_for_row(procs[fails], 5)  # that process raises right after this row
  failed = time.monotonic()
  errs = _finish(procs, timeout=60)
  took = time.monotonic() - failed
  other = 1 - fails
  assert procs[other].returncode == 2, errs[other][-3000:]
  assert re.fullmatch(rf"dadjax: error: process {fails} failed at step 5: RuntimeError: injected "
                      r"failure after step 5; the last checkpoint is step 4; restart all "
                      r"processes to resume", errs[other].strip().splitlines()[-1]), errs[other]
  # the failed process printed its own error and left with Python's code, not JAX's abort
  assert procs[fails].returncode == 1, errs[fails][-3000:]
  assert errs[fails].strip().endswith("RuntimeError: injected failure after step 5"), errs[fails]
  assert took < 15, took  # one look at the peers (3 s), not peer_timeout_s (30 s)


@pytest.mark.slow  # 35 s; the one-process missing-part tests stay default
@pytest.mark.multihost
def test_two_processes_agree_when_one_part_of_the_newest_checkpoint_is_missing(tmp_path):
  ckpt = tmp_path / "ckpt"
  errs = _finish(_two_processes(tmp_path, ckpt, 4, 0, "checkpoint_every=2"), timeout=240)
  assert _steps(ckpt) == [2, 4], errs
  shutil.rmtree(ckpt / "4" / "state" / "ocdbt.process_1")  # process 1's shards of step 4
  procs = _two_processes(tmp_path, ckpt, 6, 0, "checkpoint_every=2")
  errs = _finish(procs, timeout=240)  # no process waits for the other in a collective
  assert [p.returncode for p in procs] == [0, 0], errs[0][-3000:] + errs[1][-3000:]
  for err in errs:
    assert f"checkpoint step 4 in {ckpt} is damaged (" in err
    assert f"dadjax: resuming from checkpoint step 2 in {ckpt}" in err
