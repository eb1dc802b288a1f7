"""The real workloads the experiment scripts share (``--workload NAME``, ``--quick``).

* ``fashion_mlp``: Fashion-MNIST, MLP 784-1024-1024-10 (1.86M parameters: wide
  layers, 16 rows per site: the regime of dAD and of data quantization).
* ``fashion_cnn``: Fashion-MNIST, CNN conv 32-64 + dense 256 (0.83M parameters).
* ``text_lm``: byte-level language model on the Python 3.11 documentation
  sources, decoder-only transformer (2 layers, d_model 128, 64-byte context).
* ``text_lstm``: the same text, a one-layer LSTM LM (hidden 256; Accordion's
  WikiText-2 setting at byte level).
* ``text_gpt_tiny`` / ``text_gpt_cpu`` / ``text_gpt_125m``: the same text,
  the GPT decoder of :mod:`dadjax.models` (``gpt_tiny``: 2 x 64; ``gpt_cpu``:
  8 x 256, 6.4M parameters, about 12 minutes for 300 steps of 8 sites on 2
  cores; ``gpt_125m``: 12 x 768, 85M parameters with the byte vocabulary, one
  GPU).

The defaults are sized for 2 CPU cores; ``--quick`` shrinks data, widths and
steps so that a script's whole grid finishes in minutes (the slow-marked
tests run it). The data come from Debian's packages (``make data``);
``DADJAX_FASHION_MNIST`` (a directory) and ``DADJAX_TEXT_GLOB`` (a glob)
point elsewhere, e.g. at a copy carried to another machine.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Optional

from dadjax.config import Config

FASHION_DIR = os.environ.get("DADJAX_FASHION_MNIST", "/usr/share/datasets/fashion-mnist")
TEXT_GLOB = os.environ.get("DADJAX_TEXT_GLOB",
                           "/usr/share/doc/python3.11/html/_sources/**/*.txt")


@dataclasses.dataclass(frozen=True)
class Workload:
  """A workload: Config fields, the ``--quick`` overrides, and the target metric.

  ``metric`` is ``"accuracy"`` (higher is better) or ``"bits_per_byte"``
  (test loss / ln 2, lower is better); ``target`` / ``quick_target`` the
  value the "to target" columns measure up to. ``non_iid`` the Config
  fields of the non-IID partition.
  """

  name: str
  fields: dict
  quick: dict
  metric: str
  target: float
  quick_target: float
  non_iid: dict
  description: str

  def config(self, quick: bool = False, **overrides) -> Config:
    fields = {**self.fields, **(self.quick if quick else {})}
    for key in ("model_kwargs", "dataset_kwargs"):  # merge, do not replace
      if key in (self.quick if quick else {}):
        fields[key] = {**self.fields.get(key, {}), **self.quick[key]}
    fields.update(overrides)
    return Config(**fields)

  def describe(self, quick: bool) -> str:
    """The description, with the quick model sizes when ``quick``."""
    return self.description + (f" (quick: {self.quick['model_kwargs']})" if quick else "")

  def target_for(self, quick: bool) -> float:
    return self.quick_target if quick else self.target

  def reached(self, value: float, quick: bool) -> bool:
    t = self.target_for(quick)
    return value >= t if self.metric == "accuracy" else value <= t

  def available(self) -> Optional[str]:
    """``None`` if the data are installed, else the reason (naming the package)."""
    if self.fields["dataset"] == "fashion_mnist":
      path = pathlib.Path(self.fields.get("dataset_kwargs", {}).get("path", FASHION_DIR))
      if not (path / "train-images-idx3-ubyte.gz").exists() and not (
          path / "train-images-idx3-ubyte").exists():
        return f"Fashion-MNIST not in {path} (apt-get install -y dataset-fashion-mnist)"
    else:
      import glob  # pylint: disable=g-import-not-at-top
      if not glob.glob(TEXT_GLOB, recursive=True):
        return f"no files match {TEXT_GLOB} (apt-get install -y python3.11-doc)"
    return None


_FASHION = {"dataset": "fashion_mnist", "dataset_kwargs": {"path": FASHION_DIR},
            "num_sites": 8, "batch_per_site": 16, "backend": "vmap", "optimizer": "sgd",
            "lr": 0.05, "momentum": 0.9}
_FASHION_QUICK = {"dataset_kwargs": {"max_examples": 4000}, "steps": 60, "eval_every": 20}
_TEXT = {"dataset": "text:" + TEXT_GLOB, "num_sites": 8, "batch_per_site": 8,
         "backend": "vmap", "optimizer": "adam", "lr": 2e-3}
_TEXT_QUICK = {"dataset_kwargs": {"seq_len": 32, "max_windows": 20000, "max_eval_windows": 256},
               "steps": 60, "eval_every": 20}

WORKLOADS = {
    "fashion_mlp": Workload(
        "fashion_mlp",
        {**_FASHION, "model": "mlp", "model_kwargs": {"hidden": [1024, 1024]}, "steps": 300,
         "eval_every": 50},
        {**_FASHION_QUICK, "model_kwargs": {"hidden": [256, 256]}},
        "accuracy", 0.80, 0.70, {"partition": "dirichlet", "alpha": 0.5},
        "Fashion-MNIST, MLP 784-1024-1024-10"),
    "fashion_cnn": Workload(
        "fashion_cnn",
        {**_FASHION, "model": "cnn", "model_kwargs": {"features": [32, 64], "hidden": 256},
         "steps": 300, "eval_every": 50},
        {**_FASHION_QUICK, "model_kwargs": {"features": [8, 16], "hidden": 64}},
        "accuracy", 0.80, 0.65, {"partition": "dirichlet", "alpha": 0.5},
        "Fashion-MNIST, CNN conv 32-64 + dense 256"),
    "text_lm": Workload(
        "text_lm",
        {**_TEXT, "dataset_kwargs": {"seq_len": 64, "max_eval_windows": 1024},
         "model": "transformer_lm",
         "model_kwargs": {"num_layers": 2, "d_model": 128, "num_heads": 4, "mlp_dim": 512,
                          "max_len": 64}, "steps": 300, "eval_every": 50},
        {**_TEXT_QUICK, "model_kwargs": {"num_layers": 1, "d_model": 64, "num_heads": 4,
                                         "mlp_dim": 128, "max_len": 32}},
        "bits_per_byte", 3.5, 4.5, {"partition": "by_class"},
        "Python 3.11 docs (bytes), decoder-only transformer"),
    "text_lstm": Workload(
        "text_lstm",
        {**_TEXT, "dataset_kwargs": {"seq_len": 64, "max_eval_windows": 1024},
         "model": "lstm_lm", "model_kwargs": {"hidden": 256, "embed_dim": 64}, "steps": 300,
         "eval_every": 50},
        {**_TEXT_QUICK, "model_kwargs": {"hidden": 64, "embed_dim": 32}},
        "bits_per_byte", 3.5, 4.8, {"partition": "by_class"},
        "Python 3.11 docs (bytes), LSTM LM"),
    # Accelerator sizes (experiments/device_run.sh); --quick: tiny, for a CPU smoke test.
    "fashion_resnet18": Workload(
        "fashion_resnet18",
        {**_FASHION, "dataset_kwargs": {"path": FASHION_DIR, "pad_to": 32}, "model": "resnet18",
         "model_kwargs": {"width": 64}, "batch_per_site": 32, "lr": 0.05, "steps": 400,
         "eval_every": 100},
        {"dataset_kwargs": {"max_examples": 512}, "model_kwargs": {"width": 4},
         "batch_per_site": 4, "steps": 4, "eval_every": 2},
        "accuracy", 0.85, 0.2, {"partition": "dirichlet", "alpha": 0.5},
        "Fashion-MNIST padded to 32x32, ResNet-18 width 64"),
    # The GPT decoder of dadjax.models (scanned pre-norm blocks, rotary positions, tied byte
    # embeddings); gpt_cpu is the largest that runs 300 steps of 8 sites in ~15 min on 2 cores.
    "text_gpt_tiny": Workload(
        "text_gpt_tiny",
        {**_TEXT, "dataset_kwargs": {"seq_len": 64, "max_eval_windows": 1024},
         "model": "gpt_tiny", "model_kwargs": {}, "steps": 300, "eval_every": 50},
        {**_TEXT_QUICK, "model_kwargs": {}},
        "bits_per_byte", 3.5, 6.0, {"partition": "by_class"},
        "Python 3.11 docs (bytes), GPT decoder gpt_tiny (2 x 64)"),
    "text_gpt_cpu": Workload(
        "text_gpt_cpu",
        {**_TEXT, "dataset_kwargs": {"seq_len": 64, "max_eval_windows": 1024},
         "model": "gpt_cpu", "model_kwargs": {}, "steps": 300, "eval_every": 50},
        {**_TEXT_QUICK, "model": "gpt_tiny", "model_kwargs": {}},
        "bits_per_byte", 3.5, 6.0, {"partition": "by_class"},
        "Python 3.11 docs (bytes), GPT decoder gpt_cpu (8 x 256, 6.4M parameters)"),
    # gpt_125m's blocks on the byte corpus (vocabulary 256: 85M parameters; bf16 compute, fp32
    # parameters), as experiments/configs/gpt_gpu.toml: one GPU (experiments/device_run.sh).
    "text_gpt_125m": Workload(
        "text_gpt_125m",
        {**_TEXT, "dataset_kwargs": {"seq_len": 256, "max_eval_windows": 512},
         "model": "gpt_125m", "model_kwargs": {}, "optimizer": "adamw(weight_decay=0.1)",
         "lr": 6e-4, "steps": 150, "eval_every": 50},
        {**_TEXT_QUICK, "model": "gpt_tiny", "model_kwargs": {}},
        "bits_per_byte", 3.5, 6.0, {"partition": "by_class"},
        "Python 3.11 docs (bytes), GPT decoder gpt_125m (12 x 768, 85M parameters)"),
    "text_lm_512": Workload(
        "text_lm_512",
        {**_TEXT, "dataset_kwargs": {"seq_len": 128, "max_eval_windows": 2048},
         "model": "transformer_lm",
         "model_kwargs": {"num_layers": 4, "d_model": 512, "num_heads": 8, "mlp_dim": 2048,
                          "max_len": 128}, "batch_per_site": 16, "lr": 5e-4, "steps": 400,
         "eval_every": 100},
        {"dataset_kwargs": {"seq_len": 16, "max_windows": 2000, "max_eval_windows": 64},
         "model_kwargs": {"num_layers": 1, "d_model": 16, "num_heads": 2, "mlp_dim": 32,
                          "max_len": 16}, "batch_per_site": 2, "steps": 4, "eval_every": 2},
        "bits_per_byte", 2.5, 7.9, {"partition": "by_class"},
        "Python 3.11 docs (bytes), decoder-only transformer d_model 512"),
}


def get(name: str) -> Workload:
  if name not in WORKLOADS:
    raise SystemExit(f"unknown workload {name!r}; valid: {sorted(WORKLOADS)}")
  return WORKLOADS[name]


def partition_fields(workload: Workload, partition: str) -> dict:
  """``"iid"`` or ``"non_iid"`` (the workload's non-IID split) as Config fields."""
  if partition == "iid":
    return {"partition": "iid"}
  if partition == "non_iid":
    return dict(workload.non_iid)
  raise SystemExit(f"unknown partition {partition!r}; valid: iid, non_iid")


def metric_of(test_metrics: dict, metric: str) -> float:
  """The workload's metric from an evaluation (``bits_per_byte`` = loss / ln 2)."""
  if metric == "bits_per_byte":
    return test_metrics.get("bits_per_byte", test_metrics["loss"] / math.log(2.0))
  return test_metrics["accuracy"]


def with_metric(rows: list[dict], metric: str) -> list[dict]:
  """Metrics rows of :func:`dadjax.run.train` with ``test_<metric>`` filled (a language model's
  bits per byte from its test loss when its metrics lack it)."""
  key = f"test_{metric}"
  return [row if key in row else {**row, key: metric_of(
      {k[len("test_"):]: v for k, v in row.items() if k.startswith("test_")}, metric)}
          for row in rows]
