"""Accordion in a training run: the method spec, the step LR decay handed to it,
its decisions in metrics.jsonl, and ``dadjax plot``."""
import json

import jax
import numpy as np
import optax
import pytest

from dadjax import adaptive as A
from dadjax import cli
from dadjax.config import Config, load_config, parse_lr_schedule
from dadjax.errors import ConfigError
from dadjax.methods import build_method
from dadjax.cli import describe_methods as describe
from dadjax.registry import SpecError
from dadjax.parallel import make_train_step
from dadjax.train import build, local_optimizer, make_optimizer, make_schedule, train

# 512 examples over 4 sites x 8 rows: 16 steps per epoch.
SMALL = dict(dataset="synthetic", dataset_kwargs={"num_train": 512, "num_test": 64},
             batch_per_site=8, num_sites=4, backend="vmap", model_kwargs={"hidden": [16]},
             eval_every=1)


# -- the spec ------------------------------------------------------------------------------


def test_spec_builds_and_is_listed():
  assert "accordion(LOW, HIGH[, window=.., interval=.., eta=..])" in describe()
  for spec in ("accordion(powersgd:2,powersgd:1)", "accordion(ef(topk:0.99),ef(topk:0.1))",
               "accordion(qsgd:16, qsgd:2, window=5, interval=2, eta=0.25)"):
    method = build_method(spec, steps_per_epoch=3)
    assert method.name == spec and method.dense is None and method.batch_stage is None
    state = method.tx.init({"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)})
    assert isinstance(state, A.AccordionState)
  for bad, what in (("accordion(topk:0.1)", "missing required argument 'high'"),
                    ("accordion(topk:0.1,topk:0.01,window=0)", r"window must be an int in \[1"),
                    ("accordion(topk:0.1,topk:0.01,eta=-1)", "eta must be a float in"),
                    ("accordion(topk:0.1,allreduce)", "high: no compressor named 'allreduce'")):
    with pytest.raises(SpecError, match=what):
      build_method(bad)


def test_other_builders_ignore_the_run_facts():
  # steps_per_epoch / lr_schedule reach only the builders that take them.
  sched = optax.constant_schedule(0.1)
  for spec in ("allreduce", "topk:0.1", "ef(topk:0.1)", "rank_dad:2"):
    assert build_method(spec, steps_per_epoch=4, lr_schedule=sched).name == spec


def test_batch_mode_as_a_method_equals_the_hand_built_wrapper():
  assert "accordion_batch(METHOD[, small=.., large=.., window=.., interval=.., eta=..])" in (
      describe())
  config = Config(**{**SMALL, "eval_every": 12}, steps=12,
                  method="accordion_batch(topk:0.5, 1, 3, window=4)")
  run = train(config, progress=False)
  # The same run composed by hand: the whole chain (compressor + local SGD) inside the wrapper.
  dataset, _, batcher, built = build(config)
  inner = build_method("topk:0.5")
  tx = A.accordion_batch(optax.chain(inner.tx, local_optimizer(config)), 1, 3, window=4)
  step = make_train_step(built.model, tx, num_sites=4, backend="vmap")
  state = step.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
  for t in range(12):
    x, y = batcher.batch_at(t)
    state, _ = step(state, {"x": x, "y": y})
  for got, want in zip(jax.tree.leaves(run.params), jax.tree.leaves(step.params(state))):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  row = run.final
  # Fewer updates than micro-steps: the collective and the optimizer ran once per cycle.
  assert row["accordion_batch/micro"] == 12 and 4 <= row["accordion_batch/updates"] < 12
  for bad, what in (("accordion_batch(allreduce, 4, 1)", "large must be an int >= small=4"),
                    ("accordion_batch(dad)", "wraps optimizer-side methods"),
                    ("accordion_batch(topk:0.1, 0)", r"small must be an int in \[1")):
    with pytest.raises(SpecError, match=what):
      build_method(bad)


# -- the step learning-rate decay ----------------------------------------------------------------


def test_lr_schedule_config_and_optimizer():
  assert parse_lr_schedule("constant") == (1.0, ())
  assert parse_lr_schedule("step:0.1:150:250") == (0.1, (150, 250))
  config = load_config(None, ["lr=0.2", "lr_schedule=step:0.5:3:5"])
  sched = make_schedule(config)
  np.testing.assert_allclose([float(sched(t)) for t in range(7)],
                             [0.2, 0.2, 0.2, 0.1, 0.1, 0.05, 0.05], rtol=1e-6)
  # The optimizer steps with the schedule: plain SGD moves by lr(t) * g.
  tx = make_optimizer(config.replace(momentum=0.0), optax.identity())
  params, state = np.zeros(1, np.float32), None
  state = tx.init(params)
  moves = []
  for _ in range(6):
    upd, state = tx.update(np.ones(1, np.float32), state)
    moves.append(float(upd[0]))
  np.testing.assert_allclose(moves, [-0.2, -0.2, -0.2, -0.1, -0.1, -0.05], rtol=1e-6)
  for bad, what in (("linear", "unknown schedule"), ("step:1.5:3", "FACTOR must be"),
                    ("step:0.1", "unknown schedule"), ("step:0.1:5:3", "increasing"),
                    ("step:0.1:0", "increasing ints >= 1"), ("step:x:3", "FACTOR must be"),
                    ("step:0.1:a", "ints >= 1")):
    with pytest.raises(ConfigError, match=f"config.lr_schedule: .*{what}"):
      Config(lr_schedule=bad)


# -- decisions in metrics.jsonl and the plot ------------------------------------------------------


@pytest.fixture(scope="module")
def accordion_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("acc")
  config = Config(**SMALL, steps=40, method="accordion(powersgd:2,powersgd:1)",
                  lr_schedule="step:0.1:36", out_dir=str(out))
  return train(config, progress=False), out


def test_rows_hold_decisions_norms_and_lr(accordion_run):
  run, out = accordion_run
  rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(1, 41))
  names = A.tensor_names(run.params)
  kernels = [n for n in names if n.endswith("kernel")]
  assert kernels and all(f"accordion/low/{n}" in rows[0] for n in kernels)
  assert not any(f"accordion/low/{n}" in rows[0] for n in names if n not in kernels)
  assert all(f"accordion/norm/{n}" in rows[0] and f"accordion/critical/{n}" in rows[0]
             for n in names)
  # The window defaults to the run's 16 steps per epoch.
  assert run.steps_per_epoch == 16
  assert [r["accordion/window"] for r in rows] == [t // 16 for t in range(1, 41)]
  # Window 0 and the first check run with low; norms are zero until a window closes.
  assert all(r[f"accordion/low/{n}"] == 1 for r in rows[:16] for n in kernels)
  assert all(r[f"accordion/norm/{n}"] == 0.0 for r in rows[:15] for n in names)
  assert all(r[f"accordion/norm/{n}"] > 0 for r in rows[15:] for n in names)
  # The decay at step 36 reaches the detector: every tensor sends low from then
  # until the next check (step 48 > 40).
  np.testing.assert_allclose([r["accordion/lr"] for r in rows],
                             [0.1] * 36 + [0.01] * 4, rtol=1e-6)
  assert all(r[f"accordion/low/{n}"] == 1 for r in rows[36:] for n in kernels)
  assert all(r[f"accordion/critical/{n}"] == 1 for r in rows[36:] for n in names)
  # Bits: the ledger row counts what was sent (less than fp32 with PowerSGD).
  assert rows[-1]["wire_ratio_fp32"] > 1


def test_plot_cli_draws_the_heat_map(accordion_run, tmp_path, capsys):
  _, out = accordion_run
  png = tmp_path / "d.png"
  assert cli.main(["plot", str(out), "--out", str(png)]) == 0
  assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert cli.main(["plot", str(out)]) == 0
  assert (out / "decisions.png").exists()
  capsys.readouterr()
  assert cli.main(["plot", str(tmp_path / "nowhere")]) == 2
  assert "metrics.jsonl" in capsys.readouterr().err
  plain = tmp_path / "plain"
  plain.mkdir()
  (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
  assert cli.main(["plot", str(plain)]) == 2
  err = capsys.readouterr().err
  assert err.startswith("dadjax: error:") and "no row holds Accordion decisions" in err


def test_runs_without_accordion_have_no_accordion_keys(tmp_path):
  run = train(Config(**{**SMALL, "eval_every": 2}, steps=2, out_dir=str(tmp_path)), progress=False)
  assert not any(k.startswith("accordion") for k in run.final)
