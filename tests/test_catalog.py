"""The method catalog's contracts, models and data sets by name, and the CLI around them."""

import json
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import cli, data, models, registry
from dadjax.config import Config
from dadjax.methods import build_method
from dadjax.registry import BuildContext, SpecError

TINY = ["steps=2", "eval_every=1", "num_sites=2", "backend=vmap", "batch_per_site=4",
        'model_kwargs={"hidden": [8]}']


# -- dAD: one factory, two models (defect: the mask merged them) ---------------------------


class _TwoLayers(nn.Module):
  """``body`` then ``head``; ``plain_body`` builds the body as a plain nn.Dense."""

  dense: object
  plain_body: bool = False

  @nn.compact
  def __call__(self, x):
    body = nn.Dense(4, name="body") if self.plain_body else self.dense(4, name="body")
    return self.dense(3, name="head")(nn.relu(body(x)))


def test_dense_factory_reused_for_a_second_model_masks_only_its_layers():
  method = build_method("dad", axis_name=None)
  x = jnp.ones((2, 5))
  first = _TwoLayers(method.dense).init(jax.random.key(0), x)["params"]
  assert method.dense.mask(first) == {"body": {"bias": True, "kernel": True},
                                      "head": {"bias": True, "kernel": True}}
  # The same factory in a second model whose body is a plain layer: that body's gradient
  # is not synchronized by any dAD layer, so the mask must leave it to the all-reduce.
  second = _TwoLayers(method.dense, plain_body=True).init(jax.random.key(0), x)["params"]
  assert method.dense.mask(second) == {"body": {"bias": False, "kernel": False},
                                       "head": {"bias": True, "kernel": True}}
  assert method.dense.paths == {("head",)}
  # A third model of another shape; the first model's parameters still find their own layers.
  third = models.MLP(num_classes=3, hidden=(4, 4), dense=method.dense).init(
      jax.random.key(0), x)["params"]
  assert all(jax.tree.leaves(method.dense.mask(third)))
  tx = method.tx
  state = tx.init(second)  # the synchronizer's mask, through the optimizer
  assert state is not None
  with pytest.raises(ValueError, match="belong to none of the models"):
    method.dense.mask({"other": {"kernel": jnp.ones((2, 2))}})


# -- builders' errors: the user's vs the library's --------------------------------------------


@pytest.mark.parametrize("spec", ["accordion(powersgd:2, powersgd:1)",
                                  "accordion_batch(topk:0.5, 1, 4)",
                                  "accordion_rank_dad(4, 2)"])
def test_accordion_without_a_window_is_refused_naming_both_fixes(spec):
  with pytest.raises(SpecError) as info:
    build_method(spec)
  msg = str(info.value)
  assert "window=STEPS" in msg and "steps_per_epoch" in msg
  build_method(spec, steps_per_epoch=5)
  build_method(spec.replace(")", ", window=5)"))


@pytest.mark.parametrize("spec", ["accordion(powersgd:1, powersgd:4, window=2)",
                                  "accordion(topk:0.01, topk:0.5, window=2)",
                                  "accordion(qsgd:2, qsgd:16, window=2)"])
def test_accordion_with_low_compressing_more_than_high_is_refused(spec):
  with pytest.raises(SpecError, match=r"low \(.*bits.*\) compresses more than high .*swap the "
                     "two"):
    build_method(spec)
  low, high = spec[len("accordion("):-len(", window=2)")].split(", ")
  assert build_method(f"accordion({high}, {low}, window=2)").tx is not None
  assert build_method(f"accordion({low}, {low}, window=2)").tx is not None  # equal is fine


def test_dad_get_method_keeps_its_keyword_api_and_lets_defects_through():
  tx, dense = dadjax.dad.get_method("rank_dad:2:warm", axis_name=None, seed=5,
                                    other=optax.identity())
  assert dense.options["seed"] == 5 and dense.options["warm_start"] is True
  with pytest.raises(SpecError, match="low must be an int < high=2"):
    dadjax.dad.get_method("accordion_rank_dad(2, 2, window=3)")


def test_build_context_is_the_one_argument_of_every_method_builder():
  ctx = BuildContext(axis_name=None, seed=2, steps_per_epoch=7)
  method = registry.build("method", "accordion(powersgd:2, powersgd:1)", ctx)
  assert method.tx is not None and method.collections == {}
  assert registry.build("method", "allreduce", axis_name=None).name == "allreduce"
  assert ctx.epoch_window(None) == 7 and ctx.epoch_window(3) == 3
  with pytest.raises(registry.ArgumentError, match="window=STEPS"):
    BuildContext().epoch_window(None)


# -- models and data sets by name ------------------------------------------------------------


class _UserNet(nn.Module):
  """A user's model without a ``dense`` field."""

  width: int = 8
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train=False):
    del train
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes)(nn.relu(nn.Dense(self.width)(x)))


def test_models_by_name_and_import_path():
  assert {"mlp", "cnn", "resnet18", "gru", "transformer", "vit"} <= set(models.model_names())
  cls, defaults = models.model_class("ViT")
  assert cls is models.Transformer and defaults == {"patch_size": 4}
  net = models.get_model("test_catalog:_UserNet", 3, width=5)
  assert isinstance(net, _UserNet) and net.num_classes == 3 and net.width == 5
  with pytest.raises(ValueError, match="no `dense` field"):
    models.get_model("test_catalog:_UserNet", 3, dense=dadjax.dad.DenseFactory())
  with pytest.raises(ValueError, match="unknown model 'nope'; valid names: "):
    models.model_class("nope")
  with pytest.raises(ValueError, match="has no 'Nope'"):
    models.model_class("test_catalog:Nope")
  models.register_model("user_net", _UserNet, width=6)
  try:
    assert models.get_model("user_net", 2).width == 6
  finally:
    models._lookup._MODELS.pop("user_net")  # pylint: disable=protected-access


def _arrays(n_train=64, n_test=16, features=6, classes=3, seed=0):
  rng = np.random.default_rng(seed)
  return {"x_train": rng.normal(size=(n_train, features)).astype(np.float32),
          "y_train": rng.integers(0, classes, n_train),
          "x_test": rng.normal(size=(n_test, features)).astype(np.float32),
          "y_test": rng.integers(0, classes, n_test)}


def user_loader(n_train: int = 64):
  """A user's data-set function returning a tuple of arrays."""
  a = _arrays(n_train=n_train)
  return a["x_train"], a["y_train"], a["x_test"], a["y_test"]


def test_data_sets_by_name_file_and_import_path(tmp_path):
  assert {"digits", "synthetic", "synthetic_seq"} <= set(data.dataset_names())
  path = tmp_path / "mine.npz"
  np.savez(path, **_arrays(), num_classes=4)
  ds = data.load(str(path))
  assert ds.num_classes == 4 and ds.x_train.shape == (64, 6) and ds.y_train.dtype == np.int32
  ds = data.load("test_catalog:user_loader", n_train=32)
  assert ds.x_train.shape == (32, 6) and ds.num_classes == 3 and ds.name == "user_loader"
  data.register_dataset("mine", lambda: data.load(str(path)))
  try:
    assert data.load("mine").num_classes == 4
  finally:
    data._lookup._DATASETS.pop("mine")  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=r"data set 'bad', train split: labels must be integers "):
    data.as_dataset({**_arrays(), "y_train": np.zeros((64, 2))}, "bad")
  assert set(data.dataset_names()) >= {"fashion_mnist", "text:ARG", "idx:ARG"}
  assert data.get_dataset("text:some/*.txt").args == ("some/*.txt",)
  with pytest.raises(ValueError, match=r"missing \['x_test'\]"):
    data.as_dataset({k: v for k, v in _arrays().items() if k != "x_test"}, "bad")


def test_train_with_a_user_model_and_data_set(tmp_path):
  path = tmp_path / "mine.npz"
  np.savez(path, **_arrays(n_train=128))
  config = Config(dataset=str(path), model="test_catalog:_UserNet", model_kwargs={"width": 4},
                  steps=2, eval_every=2, num_sites=2, batch_per_site=8, backend="vmap",
                  method="topk:0.5")
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  run = train(config, progress=False)
  assert run.final["step"] == 2 and np.isfinite(run.final["loss"])


# -- the command line -------------------------------------------------------------------------


def test_flags_may_sit_between_overrides(tmp_path, capsys):
  out = tmp_path / "run"
  assert cli.main(["train", "steps=1", "--no-progress", f"out_dir={out}", *TINY[1:]]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert (out / "metrics.jsonl").exists()
  # The final row is printed once (it is also the last logged row).
  assert len(rows) == 1 and rows[0]["step"] == 1
  with pytest.raises(SystemExit):
    cli.main(["train", "steps=1", "--no-such-flag"])


def test_final_row_printed_once(capsys):
  assert cli.main(["train", "--no-progress", *TINY]) == 0
  rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert [r["step"] for r in rows] == [1, 2]


def test_methods_into_a_closed_pipe_ends_quietly():
  code = ("import sys; from dadjax import cli; sys.exit(cli.main(['methods']))")
  proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE)
  proc.stdout.close()  # the reader is gone before the listing is written (`| head -0`)
  err = proc.stderr.read().decode()
  proc.wait(timeout=300)
  assert "Traceback" not in err and "BrokenPipeError" not in err, err


# -- your own optimizer, schedule and method by name ---------------------------------------------


def test_optimizer_and_schedule_by_optax_name():
  from dadjax.train import local_optimizer, make_schedule  # pylint: disable=g-import-not-at-top
  config = Config(optimizer="adamw(learning_rate=3e-4, weight_decay=0.1)",
                  lr_schedule="warmup_cosine_decay_schedule(init_value=0, peak_value=0.1, "
                              "warmup_steps=2, decay_steps=10)", clip_global_norm=1.0)
  sched = make_schedule(config)
  want = optax.warmup_cosine_decay_schedule(0.0, 0.1, 2, 10)
  np.testing.assert_allclose([float(sched(t)) for t in range(12)],
                             [float(want(t)) for t in range(12)], rtol=1e-6)
  params = {"w": jnp.ones(3)}
  grads = {"w": jnp.array([30.0, 40.0, 0.0])}  # global norm 50: clipped to 1
  tx = local_optimizer(config)
  ref = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-4, weight_decay=0.1))
  got, _ = tx.update(grads, tx.init(params), params)
  expect, _ = ref.update(grads, ref.init(params), params)
  np.testing.assert_allclose(got["w"], expect["w"], rtol=1e-6)
  # No learning_rate in the spec: the config's schedule is the learning rate.
  tx = local_optimizer(Config(optimizer="sgd(nesterov=true)", lr=0.5, momentum=0.0))
  got, _ = tx.update(grads, tx.init(params), params)
  np.testing.assert_allclose(got["w"], [-15.0, -20.0, 0.0], rtol=1e-6)
  # The built-in words keep their meaning (sgd takes the config's momentum).
  for cfg, ref in ((Config(), optax.sgd(0.1, momentum=0.9)), (Config(optimizer="adam"),
                                                             optax.adam(0.1))):
    tx = local_optimizer(cfg)
    a, _ = tx.update(grads, tx.init(params), params)
    b, _ = ref.update(grads, ref.init(params), params)
    np.testing.assert_allclose(a["w"], b["w"], rtol=1e-6)


@pytest.mark.parametrize("field, value, message", [
    ("optimizer", "lbfgs", "'lbfgs' is not an optax optimizer"),
    ("optimizer", "adamw(weight_decai=0.1)", "adamw: got an unexpected keyword argument"),
    ("optimizer", "adamw(", "config.optimizer: cannot read"),
    ("lr_schedule", "cosine_decay_schedul(decay_steps=3)", "is not an optax schedule"),
    ("lr_schedule", "linear", "unknown schedule 'linear'"),
    ("clip_global_norm", -1.0, "config.clip_global_norm must be finite and in (0, inf]"),
])
def test_bad_optimizer_or_schedule_names_the_field(field, value, message):
  with pytest.raises(dadjax.errors.ConfigError) as info:
    Config(**{field: value})
  assert f"config.{field}" in str(info.value) and message in str(info.value)


_PLUGIN = '''
"""A compressor from an installed package (a test plugin)."""
import dadjax
from dadjax import registry


@registry.register_compressor("its_compressor", registry.Arg("levels", int, within="[1, 64]",
                                                             doc="quantization levels"))
def its_compressor(levels: int = 4):
  """QSGD under another name, from a plugin."""
  return dadjax.qsgd(levels)
'''

_NETS = '''
"""A model from the installed package: ``model=its_compressor.nets:Net``."""
import flax.linen as nn


class Net(nn.Module):
  width: int = 8
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(self.num_classes)(nn.tanh(nn.Dense(self.width)(x)))
'''

_PYPROJECT = '''
[build-system]
requires = []
build-backend = "wheel_backend"
backend-path = ["."]

[project]
name = "its-compressor"
version = "0.1"

[project.entry-points."dadjax.methods"]
its_compressor = "its_compressor"
'''

# A PEP 517 backend small enough to sit in the test (no wheel or setuptools needed): it
# writes the package and its entry points into a wheel.
_BACKEND = '''
import base64, hashlib, os, zipfile

NAME, VERSION = "its_compressor", "0.1"
DIST = f"{NAME}-{VERSION}.dist-info"
FILES = {
    f"{DIST}/METADATA": "Metadata-Version: 2.1\\nName: its-compressor\\nVersion: 0.1\\n",
    f"{DIST}/WHEEL": ("Wheel-Version: 1.0\\nGenerator: test\\nRoot-Is-Purelib: true\\n"
                      "Tag: py3-none-any\\n"),
    f"{DIST}/entry_points.txt": "[dadjax.methods]\\nits_compressor = its_compressor\\n",
}


def get_requires_for_build_wheel(config_settings=None):
  return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
  files = {f"{NAME}/{f}": open(os.path.join(NAME, f)).read()
           for f in sorted(os.listdir(NAME)) if f.endswith(".py")}
  files.update(FILES)
  record = []
  name = f"{NAME}-{VERSION}-py3-none-any.whl"
  with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as whl:
    for path, text in files.items():
      data = text.encode()
      digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
      record.append(f"{path},sha256={digest},{len(data)}")
      whl.writestr(path, data)
    whl.writestr(f"{DIST}/RECORD", "\\n".join(record + [f"{DIST}/RECORD,,"]) + "\\n")
  return name
'''


def test_installed_plugin_trains_from_the_command_line(tmp_path):
  import os  # pylint: disable=g-import-not-at-top
  import pathlib  # pylint: disable=g-import-not-at-top
  import site  # pylint: disable=g-import-not-at-top
  src = tmp_path / "src"
  (src / "its_compressor").mkdir(parents=True)
  (src / "its_compressor" / "__init__.py").write_text(_PLUGIN)
  (src / "its_compressor" / "nets.py").write_text(_NETS)
  (src / "pyproject.toml").write_text(_PYPROJECT)
  (src / "wheel_backend.py").write_text(_BACKEND)
  venv = tmp_path / "venv"
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
  py = venv / "bin" / "python"
  # The new environment sees this one's packages (jax, pip, setuptools): no network needed.
  new_site = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"],
                            capture_output=True, text=True, check=True).stdout.strip()
  pathlib.Path(new_site, "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
  root = pathlib.Path(__file__).resolve().parent.parent
  env = {**os.environ, "PYTHONPATH": str(root), "PIP_NO_INDEX": "1",
         "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
  subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                  str(src)], check=True, env=env, capture_output=True)
  out = tmp_path / "run"
  proc = subprocess.run(
      [str(py), "-m", "dadjax.cli", "train", "--no-progress", "method=its_compressor:4",
       "optimizer=adamw(learning_rate=1e-3, weight_decay=0.01)",
       "lr_schedule=warmup_cosine_decay_schedule(init_value=0, peak_value=1e-3, warmup_steps=1, "
       "decay_steps=4)", f"out_dir={out}", "model=its_compressor.nets:Net",
       *[a for a in TINY if not a.startswith("model_kwargs")], 'model_kwargs={"width": 6}'],
      capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  row = json.loads(proc.stdout.strip().splitlines()[-1])
  assert row["method"] == "its_compressor:4" and row["step"] == 2
  # the package's Net (digits 8x8 -> 6 -> 10) was the model: the dense bits count its parameters
  assert row["dense_bits_per_step"] == 32 * (64 * 6 + 6 + 6 * 10 + 10), row
  # Not installed here: the name is unknown to this process.
  assert registry.lookup("compressor", "its_compressor") is None


def test_plugin_flag_imports_a_module(tmp_path, capsys, monkeypatch):
  (tmp_path / "flag_plugin.py").write_text(_PLUGIN.replace("its_compressor", "flag_compressor"))
  monkeypatch.syspath_prepend(str(tmp_path))
  try:
    assert cli.main(["train", "--no-progress", "--plugin", "flag_plugin",
                     "method=ef(flag_compressor:8)", *TINY]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["method"] == (
        "ef(flag_compressor:8)")
    assert cli.main(["methods"]) == 0  # listed under its package
    assert "[flag_plugin] methods" not in (out := capsys.readouterr().out)
    assert "flag_compressor[:LEVELS]" in out and "QSGD under another name" in out
    assert cli.main(["methods", "--plugin", "no_such_plugin_module"]) == 2
    assert "plugin module 'no_such_plugin_module' cannot be imported" in capsys.readouterr().err
  finally:
    registry.unregister("compressor", "flag_compressor")
