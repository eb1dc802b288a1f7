"""``dadjax train --lighthouse``: an elastic site from a config equals the config's own run."""
import json
import os
import pathlib
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import dadjax.elastic as elastic
from dadjax.errors import ConfigError
from dadjax.run import Config, train, train_site

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
import elastic_worker  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
BASE = dict(dataset="digits", model="mlp", model_kwargs={"hidden": [32]}, num_sites=2,
            batch_per_site=16, optimizer="adam", lr=3e-3, eval_every=5, seed=3)


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _sites(config: Config, sites=(0, 1)) -> tuple[dict, dict]:
  rows = {s: [] for s in sites}
  with elastic.Lighthouse(expected_sites=len(sites), quorum_timeout_s=60) as lighthouse:
    runs = elastic_worker.in_threads(
        lambda site: train_site(config, lighthouse.address, site, log=rows[site].append), sites)
  return runs, rows


@pytest.mark.parametrize("method", [
    "diloco:5", "local_sgd:5", "diloco:5:outer_lr=0.5:outer_momentum=0",
    "streaming_diloco:6:fragments=2:delay=1", "demo:1:k=8:chunk=16",
])
def test_every_site_present_is_the_configs_own_run(method):
  # The same config run by `dadjax train` (both sites in one program, vmap) and as two elastic
  # sites through a lighthouse: the same data partition, initial parameters, inner optimizer
  # and outer step, so the same anchor (the lighthouse's mean is float64, pmean's float32).
  # Streaming DiLoCo's last round (sent at step 12) is merged at the elastic run's end: the
  # one-program run takes the delay's one step more to merge it (the anchor does not depend
  # on that step).
  streaming = method.startswith("streaming")
  config = Config(**BASE, method=method, steps=12 if streaming else 10, backend="vmap")
  reference = train(config.replace(steps=config.steps + streaming), progress=False).params
  runs, rows = _sites(config.replace(backend="shard_map"))
  for site in (0, 1):
    np.testing.assert_allclose(_flat(runs[site].anchor), _flat(reference), rtol=2e-5, atol=2e-6)
  assert [r["quorum"] for r in rows[0]] == [[0, 1]] * len(rows[0])
  last = rows[0][-1]
  assert last["step"] == config.steps and "test_accuracy" in last
  assert rows[0][-1]["test_loss"] == pytest.approx(rows[1][-1]["test_loss"], rel=1e-6)


@pytest.mark.parametrize("method", ["diloco(5, compress=qsgd:8)", "sparseloco:5:k=8:chunk=16"])
def test_a_compressed_outer_step_sends_less_and_every_site_ends_on_one_anchor(method, tmp_path):
  config = Config(**BASE, method=method, steps=10, out_dir=str(tmp_path))
  runs, rows = _sites(config)
  np.testing.assert_array_equal(_flat(runs[0].anchor), _flat(runs[1].anchor))
  dense = sum(np.size(x) for x in jax.tree.leaves(runs[0].anchor)) * 32
  assert 0 < rows[0][0]["sent_bits"] < dense / 3
  written = [json.loads(line) for line in (tmp_path / "site1" / "metrics.jsonl").open()]
  assert written == [json.loads(json.dumps(r)) for r in rows[1]]
  assert [r["round"] for r in written] == [0, 1]


@pytest.mark.parametrize("changes, match", [
    (dict(method="topk:0.01"), r"one of \['local_sgd', 'diloco', 'streaming_diloco'"),
    (dict(method="powersgd:2"), r"takes a local-update method"),
    (dict(method="diloco:5", steps=12), r"steps.*multiple"),
    (dict(method="diloco:5", pipeline="grain"), r"pipeline='grain'"),
    (dict(method="diloco:5", model="resnet18",
          model_kwargs={"norm": "batch", "width": 4, "stage_sizes": [1]}),
     r"mutable collections \['batch_stats'\]"),
])
def test_a_config_an_elastic_site_cannot_run_is_a_config_error(changes, match):
  config = Config(**{**BASE, **changes, "steps": changes.get("steps", 10)})
  with pytest.raises(ConfigError, match=match):
    train_site(config, "127.0.0.1:9", 0)


@pytest.mark.parametrize("site", [-1, 2, True])
def test_a_site_outside_the_partitions_is_a_config_error(site):
  with pytest.raises(ConfigError, match=r"site must be an int in \[0, 1\]"):
    train_site(Config(**BASE, method="diloco:5", steps=10), "127.0.0.1:9", site)


def _cli(*args, **kw):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-m", "dadjax.cli", *args], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def test_the_command_line_runs_a_lighthouse_and_its_sites(tmp_path):
  lighthouse = _cli("lighthouse", "--expected-sites", "2")
  try:
    line = lighthouse.stdout.readline()
    assert line.startswith("dadjax: elastic: lighthouse at 127.0.0.1:"), line
    address = line.split()[-1]
    overrides = ["method=diloco:5", "num_sites=2", "steps=10", 'model_kwargs={"hidden": [16]}',
                 f"out_dir={tmp_path}"]
    sites = [_cli("train", *overrides, "--lighthouse", address, "--site", str(s))
             for s in (0, 1)]
    outs = [p.communicate(timeout=240) for p in sites]
    assert [p.returncode for p in sites] == [0, 0], [o[1][-2000:] for o in outs]
    last = [json.loads(o[0].splitlines()[-1]) for o in outs]
    assert [r["site"] for r in last] == [0, 1] and {r["step"] for r in last} == {10}
    assert last[0]["test_loss"] == pytest.approx(last[1]["test_loss"], rel=1e-6)
    assert (tmp_path / "site0" / "metrics.jsonl").exists()
  finally:
    lighthouse.send_signal(signal.SIGTERM)
    lighthouse.communicate(timeout=30)
  assert lighthouse.returncode == 0


@pytest.mark.parametrize("args, match", [
    (["--lighthouse", "127.0.0.1:9"], "--lighthouse and --site go together"),
    (["--lighthouse", "127.0.0.1:9", "--site", "0", "--num-processes", "2"],
     "one site per process"),
    (["--lighthouse", "127.0.0.1:9", "--site", "0", "method=qsgd:4"], "local-update method"),
])
def test_command_line_mistakes_are_one_line(args, match):
  proc = _cli("train", "steps=10", *args)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 2, err
  assert err.startswith("dadjax: error:") and match in err and "Traceback" not in err
