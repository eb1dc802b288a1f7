"""Experiment configuration: one dataclass, files, and ``key=value`` overrides.

A config file is TOML or JSON holding any subset of :class:`Config`'s
fields; overrides such as ``steps=200`` or ``method=topk:0.01`` are applied
on top, typed by the field they set. Unknown keys are an error that lists
the valid ones, so a typo never silently trains the default.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import tomllib
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything one training run needs.

  Attributes:
    dataset: ``"digits"`` (embedded, default), ``"synthetic"``,
      ``"synthetic_seq"`` or a tensorflow-datasets name (``"mnist"``, ...).
    data_dir: tensorflow-datasets directory (prepared offline).
    dataset_kwargs: extra loader arguments, e.g. ``{"max_examples": 5000}``.
    model: ``"mlp"``, ``"cnn"``, ``"resnet18"``, ``"gru"``, ``"transformer"``, ``"vit"``.
    model_kwargs: extra model fields, e.g. ``{"hidden": [128, 128]}``.
    method: communication method spec, see :func:`dadjax.methods.build_method`.
    num_sites: number of sites (devices, or simulated sites with ``vmap``).
    backend: ``"shard_map"``, ``"pmap"`` or ``"vmap"``.
    partition: ``"iid"``, ``"by_class"`` or ``"dirichlet"``.
    alpha: Dirichlet concentration for ``partition="dirichlet"``.
    batch_per_site: rows per site per step.
    steps: training steps.
    optimizer: ``"sgd"`` (with ``momentum``) or ``"adam"``.
    lr, momentum: optimizer hyperparameters.
    seed: seeds parameters, partitions, batches and compressors.
    eval_every: evaluate and log every this many steps (and at the end).
    checkpoint_dir: orbax checkpoint directory (``None``: no checkpoints).
    checkpoint_every: save every this many steps.
    out_dir: where ``metrics.jsonl`` goes (``None``: nowhere).
    bandwidth, latency, topology: network model for modeled comm time.
  """

  dataset: str = "digits"
  data_dir: str | None = None
  dataset_kwargs: dict = dataclasses.field(default_factory=dict)
  model: str = "mlp"
  model_kwargs: dict = dataclasses.field(default_factory=dict)
  method: str = "allreduce"
  num_sites: int = 8
  backend: str = "shard_map"
  partition: str = "iid"
  alpha: float = 0.5
  batch_per_site: int = 16
  steps: int = 300
  optimizer: str = "sgd"
  lr: float = 0.1
  momentum: float = 0.9
  seed: int = 0
  eval_every: int = 100
  checkpoint_dir: str | None = None
  checkpoint_every: int = 100
  out_dir: str | None = None
  bandwidth: float = 1e9
  latency: float = 50e-6
  topology: str = "ring"

  def __post_init__(self):
    positive = ("num_sites", "batch_per_site", "steps", "eval_every", "checkpoint_every")
    for name in positive:
      value = getattr(self, name)
      if not (isinstance(value, int) and value >= 1):
        raise ValueError(f"config.{name} must be an int >= 1, got {value!r}")
    if self.optimizer not in ("sgd", "adam"):
      raise ValueError(f"config.optimizer must be 'sgd' or 'adam', got {self.optimizer!r}")
    if not self.lr > 0:
      raise ValueError(f"config.lr must be > 0, got {self.lr}")

  def replace(self, **changes) -> "Config":
    _check_keys(changes)
    return dataclasses.replace(self, **changes)


def _fields() -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(Config)}


def _check_keys(keys: Iterable[str]) -> None:
  unknown = sorted(set(keys) - set(_fields()))
  if unknown:
    raise ValueError(f"unknown config key(s) {unknown}; valid keys: {sorted(_fields())}")


def _parse_value(name: str, text: str) -> Any:
  field = _fields()[name]
  kind = str(field.type)
  if text in ("None", "null") and "None" in kind:
    return None
  if kind.startswith("dict"):
    return json.loads(text)
  if kind.startswith("int"):
    return int(text)
  if kind.startswith("float"):
    return float(text)
  return text


def load_config(path: str | pathlib.Path | None = None, overrides: Iterable[str] = ()) -> Config:
  """Read a TOML / JSON config file (optional) and apply ``key=value`` overrides.

  Args:
    path: a ``.toml`` or ``.json`` file with any subset of :class:`Config` fields.
    overrides: strings ``"key=value"``; values are parsed by the field's type
      (``model_kwargs`` takes JSON).

  Returns:
    The :class:`Config`.

  Raises:
    ValueError: unknown keys, malformed overrides or out-of-range values.
  """
  values: dict[str, Any] = {}
  if path is not None:
    path = pathlib.Path(path)
    text = path.read_text()
    values = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    _check_keys(values)
  for item in overrides:
    if "=" not in item:
      raise ValueError(f"override {item!r} must look like key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    _check_keys([key])
    values[key] = _parse_value(key, text.strip())
  return Config(**values)
