"""Experiment configuration: one dataclass, files, and ``key=value`` overrides.

A config file is TOML or JSON holding any subset of :class:`Config`'s
fields; overrides such as ``steps=200`` or ``method=topk:0.01`` are applied
on top, typed by the field they set. Unknown keys are an error that lists
the valid ones, so a typo never silently trains the default.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import pathlib
import tomllib
from typing import Any, Iterable

import dadjax.run._optim as _optim
from dadjax.errors import ConfigError

# Kept here (not imported from the step) so that reading a config never starts a JAX
# backend: the command line sets up simulated devices after reading the config.
BACKENDS = ("shard_map", "pmap", "vmap")
PARTITIONS = ("iid", "by_class", "dirichlet")
TOPOLOGIES = ("ring", "ps")
PIPELINES = ("memory", "grain")


@dataclasses.dataclass(frozen=True)
class Config:
  """Everything one training run needs.

  Attributes:
    dataset: a registered name (``"digits"``, embedded, default;
      ``"synthetic"``, ``"synthetic_seq"``, ``"fashion_mnist"`` (Debian's
      IDX files); see :func:`dadjax.data.dataset_names`), ``"text:GLOB"``
      (byte-level language modelling on the files GLOB matches),
      ``"idx:DIR"`` (MNIST-style IDX files in DIR), a ``.npz`` file, an
      import path ``"package.module:function"`` to your own loader
      (returning arrays, see :func:`dadjax.data.as_dataset`), or a
      tensorflow-datasets name (``"mnist"``, ...).
    data_dir: tensorflow-datasets directory (prepared offline).
    dataset_kwargs: extra loader arguments, e.g. ``{"max_examples": 5000}``.
    model: a registered name (``"mlp"``, ``"cnn"``, ``"resnet18"``, ``"gru"``,
      ``"transformer"``, ``"vit"``; see :func:`dadjax.models.model_names`)
      or an import path ``"package.module:Class"`` to a Flax module of
      your own (it gets ``num_classes`` and ``dense`` if it has those fields).
    model_kwargs: extra model fields, e.g. ``{"hidden": [128, 128]}``.
    method: communication method spec, see :func:`dadjax.methods.build_method`.
    num_sites: number of sites (devices, or simulated sites with ``vmap``).
    per_site: devices per site (default 1). ``> 1`` runs a 2-D mesh of
      ``num_sites x per_site`` devices (``backend="shard_map"`` only): the
      method communicates between sites, each site averages exactly over
      its devices, and ``batch_per_site`` rows split over them.
    shard_params: with ``per_site > 1``, FSDP: split each site's
      parameters (those the model does not shard itself) and their optimizer
      state over the site's devices (:func:`dadjax.make_train_step`).
      Default ``False``.
    mesh_inner: named in-site axes, e.g. ``{"fsdp": 2, "model": 2}``
      (:func:`dadjax.make_mesh`'s ``inner``) instead of one ``per_site``
      axis; ``per_site`` is then their product. Default ``{}``.
    compute_dtype: ``"float32"`` or ``"bfloat16"``: the model computes in
      bf16 from fp32 master weights; gradients and every method's averaging
      stay fp32 (:func:`dadjax.make_train_step`'s ``compute_dtype``).
    rules: the model's logical-axis rules by name (``"fsdp"``, ``"tp"``,
      ``"fsdp_tp"``, ``"replicated"``: :func:`dadjax.models.gpt_rules`,
      over mesh axes ``"fsdp"`` and ``"model"``); ``None``: the model's own
      partitioning only.
    backend: ``"shard_map"``, ``"pmap"`` or ``"vmap"``.
    partition: ``"iid"``, ``"by_class"`` or ``"dirichlet"``.
    pipeline: ``"memory"`` (default: the training rows held in memory,
      :class:`~dadjax.data.SiteBatcher`) or ``"grain"``: each process reads
      only its own sites' rows through a Grain pipeline
      (:class:`~dadjax.data.SitePipeline`; ``"text:GLOB"`` corpora are read
      from the files on demand), the same batches, with its iterator state
      checkpointed next to the train state.
    pipeline_prefetch: with ``pipeline="grain"``, steps read ahead (>= 0,
      default 2).
    alpha: Dirichlet concentration for ``partition="dirichlet"``.
    batch_per_site: rows per site per step.
    steps: training steps.
    optimizer: ``"sgd"`` (with ``momentum``), ``"adam"``, or any optax
      optimizer with keyword arguments, e.g. ``"adamw(weight_decay=0.1)"``
      or ``"adamw(learning_rate=3e-4, weight_decay=0.1)"`` (the learning
      rate defaults to ``lr`` / ``lr_schedule``).
    lr, momentum: optimizer hyperparameters (``momentum``: ``sgd`` only).
    lr_schedule: ``"constant"`` (default), a step decay
      ``"step:FACTOR:S1[:S2...]"``: the learning rate is multiplied by
      ``FACTOR`` (in (0, 1)) at each of the steps ``S1 < S2 < ...`` (ints >= 1),
      e.g. ``"step:0.1:150:250"``, or any optax schedule with its arguments,
      e.g. ``"warmup_cosine_decay_schedule(init_value=0, peak_value=0.1,
      warmup_steps=10, decay_steps=300)"`` (which then ignores ``lr``).
      Methods that react to decreases (Accordion) are handed the schedule.
    clip_global_norm: clip the communicated gradient to this global norm
      before the local optimizer (``optax.clip_by_global_norm``); ``None``
      (default): no clipping.
    seed: seeds parameters, partitions, batches and compressors.
    eval_every: evaluate and log every this many steps (and at the end).
    checkpoint_dir: orbax checkpoint directory (``None``: no checkpoints).
    checkpoint_every: save every this many steps.
    out_dir: where ``metrics.jsonl`` goes (``None``: nowhere).
    checkpoint_on_signal: on SIGTERM / SIGINT, finish the current step, save
      it and stop (exit code 143 / 130). ``False``: the signals act as usual.
    signal_grace_s: the longest such a stop may take (seconds, default 60);
      then the process ends at once, keeping the last finished checkpoint.
    peer_timeout_s: with several processes, a process that shows no sign of
      life for this long (seconds, default 20) is lost: the others stop with
      ``process K stopped responding at step N`` and exit code 2.
    bandwidth, latency, topology: network model for modeled comm time
      (the links between sites).
    intra_bandwidth, intra_latency: the links inside a site (``per_site >
      1``; default 800e9 bits/s = 100 GB/s and 5 us).
  """

  dataset: str = "digits"
  data_dir: str | None = None
  dataset_kwargs: dict = dataclasses.field(default_factory=dict)
  model: str = "mlp"
  model_kwargs: dict = dataclasses.field(default_factory=dict)
  method: str = "allreduce"
  num_sites: int = 8
  per_site: int = 1
  shard_params: bool = False
  mesh_inner: dict = dataclasses.field(default_factory=dict)
  rules: str | None = None
  compute_dtype: str = "float32"
  backend: str = "shard_map"
  partition: str = "iid"
  pipeline: str = "memory"
  pipeline_prefetch: int = 2
  alpha: float = 0.5
  batch_per_site: int = 16
  steps: int = 300
  optimizer: str = "sgd"
  lr: float = 0.1
  momentum: float = 0.9
  lr_schedule: str = "constant"
  clip_global_norm: float | None = None
  seed: int = 0
  eval_every: int = 100
  checkpoint_dir: str | None = None
  checkpoint_every: int = 100
  out_dir: str | None = None
  checkpoint_on_signal: bool = True
  signal_grace_s: float = 60.0
  peer_timeout_s: float = 20.0
  bandwidth: float = 1e9
  latency: float = 50e-6
  topology: str = "ring"
  intra_bandwidth: float = 800e9
  intra_latency: float = 5e-6

  def __post_init__(self):
    _check_types(self)
    positive = ("num_sites", "per_site", "batch_per_site", "steps", "eval_every",
                "checkpoint_every")
    for name in positive:
      if getattr(self, name) < 1:
        raise ConfigError(f"config.{name} must be an int >= 1, got {getattr(self, name)!r}")
    _check_upper_bounds(self)
    if self.seed < 0:
      raise ConfigError(f"config.seed must be an int >= 0, got {self.seed!r}")
    if self.pipeline_prefetch < 0:
      raise ConfigError(f"config.pipeline_prefetch must be an int >= 0, got "
                        f"{self.pipeline_prefetch!r}")
    choices = {"backend": BACKENDS, "partition": PARTITIONS, "topology": TOPOLOGIES,
               "pipeline": PIPELINES}
    for name, valid in choices.items():
      value = getattr(self, name)
      if value not in valid:
        raise ConfigError(f"config.{name} must be one of {list(valid)}, got {value!r}")
    _check_range("lr", self.lr, low=0.0)
    _check_range("momentum", self.momentum, low=0.0, high=1.0, low_open=False, high_open=True)
    parse_lr_schedule(self.lr_schedule)
    _optim.parse_optimizer(self.optimizer)
    if self.clip_global_norm is not None:
      _check_range("clip_global_norm", self.clip_global_norm, low=0.0)
    _check_range("alpha", self.alpha, low=0.0)
    _check_range("signal_grace_s", self.signal_grace_s, low=0.0)
    _check_range("peer_timeout_s", self.peer_timeout_s, low=0.0)
    _check_range("bandwidth", self.bandwidth, low=0.0)
    _check_range("latency", self.latency, low=0.0, low_open=False)
    _check_range("intra_bandwidth", self.intra_bandwidth, low=0.0)
    _check_range("intra_latency", self.intra_latency, low=0.0, low_open=False)
    if self.mesh_inner:
      sizes = list(self.mesh_inner.values())
      if any(not isinstance(k, str) or k == "data" for k in self.mesh_inner) or any(
          isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in sizes):
        raise ConfigError("config.mesh_inner must map in-site axis names (not 'data') to sizes "
                          f">= 1, got {self.mesh_inner!r}")
      if self.per_site not in (1, math.prod(sizes)):
        raise ConfigError(f"config.per_site={self.per_site} disagrees with config.mesh_inner="
                          f"{self.mesh_inner!r} (product {math.prod(sizes)}); give one of them")
      object.__setattr__(self, "per_site", math.prod(sizes))
    if self.compute_dtype not in ("float32", "bfloat16"):
      raise ConfigError("config.compute_dtype must be one of ['float32', 'bfloat16'], got "
                        f"{self.compute_dtype!r}")
    if self.rules is not None and self.rules not in ("fsdp", "tp", "fsdp_tp", "replicated"):
      raise ConfigError("config.rules must be one of ['fsdp', 'tp', 'fsdp_tp', 'replicated'] "
                        f"or None, got {self.rules!r}")
    if self.per_site > 1 and self.backend != "shard_map":
      raise ConfigError(f"config.per_site={self.per_site} needs backend='shard_map' (a 2-D "
                        f"mesh); backend={self.backend!r} runs one device per site")
    if self.shard_params and self.per_site < 2:
      raise ConfigError(f"config.shard_params=True splits parameters over the devices of a site: "
                        f"it needs config.per_site >= 2, got {self.per_site}")
    if self.batch_per_site % self.per_site:
      raise ConfigError(f"config.batch_per_site={self.batch_per_site} must be a multiple of "
                        f"config.per_site={self.per_site} (each device of a site takes an "
                        "equal share of the site's rows)")

  def replace(self, **changes) -> "Config":
    _check_keys(changes)
    return dataclasses.replace(self, **changes)


def parse_lr_schedule(text: str):
  """``config.lr_schedule`` parsed (once; the parse is cached).

  Returns:
    ``(factor, boundaries)`` for ``"constant"`` (``(1.0, ())``) and
    ``"step:..."``; for an optax schedule, the call that builds it.

  Raises:
    ConfigError: naming ``config.lr_schedule`` and the valid forms.
  """
  return _optim.parse_schedule(text)


def _fields() -> dict[str, dataclasses.Field]:
  return {f.name: f for f in dataclasses.fields(Config)}


def _check_keys(keys: Iterable[str]) -> None:
  unknown = sorted(set(keys) - set(_fields()))
  if unknown:
    raise ConfigError(f"unknown config key(s) {unknown}; valid keys: {sorted(_fields())}")


def _kinds(field: dataclasses.Field) -> set[str]:
  """The annotation's alternatives, e.g. ``{"str", "None"}`` for ``str | None``."""
  return {part.strip().split("[")[0] for part in str(field.type).split("|")}


def _check_types(config: Config) -> None:
  for name, field in _fields().items():
    value, kinds = getattr(config, name), _kinds(field)
    if value is None and "None" in kinds:
      continue
    ok = {"int": isinstance(value, int) and not isinstance(value, bool),
          "float": isinstance(value, (int, float)) and not isinstance(value, bool),
          "bool": isinstance(value, bool), "str": isinstance(value, str),
          "dict": isinstance(value, dict)}
    if not any(ok.get(kind, True) for kind in kinds - {"None"}):
      raise ConfigError(f"config.{name} must be {field.type}, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float = math.inf,
                 low_open: bool = True, high_open: bool = False) -> None:
  above = value > low if low_open else value >= low
  below = value < high if high_open else value <= high
  if not (math.isfinite(value) and above and below):
    interval = (("(" if low_open else "[") + f"{low:g}, "
                + (f"{high:g}" if math.isfinite(high) else "inf") + (")" if high_open else "]"))
    raise ConfigError(f"config.{name} must be finite and in {interval}, got {value!r}")


def _parse_value(name: str, text: str) -> Any:
  kinds = _kinds(_fields()[name])
  if text in ("None", "null") and "None" in kinds:
    return None
  try:
    if "dict" in kinds:
      return json.loads(text)
    if "bool" in kinds:
      if text.lower() not in ("true", "false", "1", "0"):
        raise ValueError("not true/false")
      return text.lower() in ("true", "1")
    if "int" in kinds:
      return int(text)
    if "float" in kinds:
      return float(text)
  except ValueError as e:
    raise ConfigError(f"override {name}={text!r}: not a valid {_fields()[name].type} ({e})") from e
  return text


def _read_file(path: pathlib.Path) -> dict:
  try:
    text = path.read_text()
  except FileNotFoundError:
    raise ConfigError(f"config file {str(path)!r} not found") from None
  except OSError as e:
    raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
  try:
    values = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
  except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
    kind = "TOML" if path.suffix == ".toml" else "JSON"
    raise ConfigError(f"config file {str(path)!r} is not valid {kind}: {e}") from None
  if not isinstance(values, dict):
    raise ConfigError(f"config file {str(path)!r} must hold a table of config keys")
  return values


def load_config(path: str | pathlib.Path | None = None, overrides: Iterable[str] = ()) -> Config:
  """Read a TOML / JSON config file (optional) and apply ``key=value`` overrides.

  Args:
    path: a ``.toml`` file, or a JSON file, with any subset of :class:`Config` fields.
    overrides: strings ``"key=value"``; values are parsed by the field's type
      (``model_kwargs`` and ``dataset_kwargs`` take JSON).

  Returns:
    The :class:`Config`.

  Raises:
    ConfigError: (a ``ValueError``) a missing or malformed file (named),
      unknown keys, malformed overrides or out-of-range values.
  """
  values: dict[str, Any] = {}
  if path is not None:
    path = pathlib.Path(path)
    values = _read_file(path)
    try:
      _check_keys(values)
    except ConfigError as e:
      raise ConfigError(f"config file {str(path)!r}: {e}") from None
  for item in overrides:
    if "=" not in item:
      raise ConfigError(f"override {item!r} must look like key=value")
    key, text = item.split("=", 1)
    key = key.strip()
    _check_keys([key])
    values[key] = _parse_value(key, text.strip())
  return Config(**values)


def _valid_names(fn_or_cls, exclude: Iterable[str] = ()) -> list[str]:
  if dataclasses.is_dataclass(fn_or_cls):
    names = [f.name for f in dataclasses.fields(fn_or_cls) if f.init]
  else:
    names = list(inspect.signature(fn_or_cls).parameters)
  return sorted(set(names) - set(exclude) - {"parent", "name"})


def _check_kwargs(what: str, given: dict, valid: list[str], note: str = "") -> None:
  unknown = sorted(set(given) - set(valid))
  if unknown:
    raise ConfigError(f"{what} has unknown key(s) {unknown}; valid keys: {valid}{note}")


def _check_sizes(what: str, kwargs: dict) -> None:
  """Integer model fields (widths, depths, sizes) must be in ``[1, MAX_WIDTH]``."""
  for key, value in kwargs.items():
    items = value if isinstance(value, (list, tuple)) else [value]
    ints = [v for v in items if isinstance(v, int) and not isinstance(v, bool)]
    if any(v < 1 for v in ints):
      raise ConfigError(f"{what}[{key!r}] must hold ints >= 1 (a width, depth or size), "
                        f"got {value!r}")
    numbers = [v for v in items if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if any(not math.isfinite(v) or v > MAX_WIDTH for v in numbers):
      raise ConfigError(f"{what}[{key!r}] must hold ints in [1, {MAX_WIDTH}] (a width, depth or "
                        f"size; larger ones exhaust the memory of any one device), got {value!r}")


# Upper bounds: past them a value exhausts the machine or overflows a counter.
MAX_INT32 = 2**31 - 1  # the train state's step counter is int32
MAX_WIDTH = 2**20  # one model width, depth or size (a 2**20 x 2**20 fp32 kernel is 4 TiB)
MAX_DEVICES = 1024  # simulated sites x devices per site (XLA starts threads per CPU device)


def _check_upper_bounds(config: "Config") -> None:
  for name in ("steps", "eval_every", "checkpoint_every", "batch_per_site"):
    if getattr(config, name) > MAX_INT32:
      raise ConfigError(f"config.{name} must be an int in [1, {MAX_INT32}] (the step counter is "
                        f"int32), got {getattr(config, name)!r}")
  if config.seed > 2**32 - 1:
    raise ConfigError(f"config.seed must be an int in [0, {2**32 - 1}], got {config.seed!r}")
  devices = config.num_sites * config.per_site
  if config.backend != "vmap" and devices > MAX_DEVICES:
    raise ConfigError(
        f"config.num_sites * config.per_site = {devices} devices is more than {MAX_DEVICES}, the "
        f"most one process can drive (simulated CPU devices each start threads); use "
        f"backend='vmap' to simulate many sites on one device, or fewer sites")
  if config.num_sites > MAX_WIDTH:
    raise ConfigError(f"config.num_sites must be an int in [1, {MAX_WIDTH}], got "
                      f"{config.num_sites!r}")


def _check_dataset(config: Config) -> None:
  from dadjax import data  # pylint: disable=g-import-not-at-top
  try:
    loader = data.get_dataset(config.dataset)
  except ValueError as e:
    raise ConfigError(f"config.dataset: {e}") from e
  exclude, note = (), ""
  if getattr(loader, "func", None) is data.load_tfds:
    exclude = ("name", "data_dir")
    note = (f" (dataset {config.dataset!r} is read with tensorflow-datasets; "
            "set data_dir in the config)")
  elif config.data_dir:
    raise ConfigError(f"config.data_dir is for tensorflow-datasets; dataset "
                      f"{config.dataset!r} is not read with it (registered names: "
                      f"{data.dataset_names()})")
  if not _takes_any_keyword(loader):
    _check_kwargs("config.dataset_kwargs", config.dataset_kwargs,
                  _valid_names(loader, exclude), note)


def _takes_any_keyword(fn) -> bool:
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return True
  return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _check_model(config: Config) -> None:
  from dadjax import models  # pylint: disable=g-import-not-at-top
  try:
    cls, _ = models.model_class(config.model)
  except ValueError as e:
    raise ConfigError(f"config.model: {e}") from e
  fields = models.model_fields(cls)
  if fields is not None:
    valid = sorted(set(fields) - {"dense", "num_classes"})
    _check_kwargs("config.model_kwargs", config.model_kwargs, valid,
                  " (num_classes comes from the dataset, dense from the method)")
  _check_sizes("config.model_kwargs", config.model_kwargs)


def validate(config: Config) -> None:
  """Check what the config names against the code, before anything is built.

  ``Config`` itself checks types, ranges, the optimizer and the schedule;
  this checks the dataset's and model's names and keyword arguments
  against the loader's and the model's signatures (listing the valid
  ones), model widths ``>= 1``, and resolves the method spec (its names and
  every argument, without building it: :func:`dadjax.train.build` builds it
  once, with the run's steps per epoch and schedule). Imports the model
  classes.

  Raises:
    ConfigError: naming the field and the valid choices.
  """
  from dadjax import registry  # pylint: disable=g-import-not-at-top
  _check_dataset(config)
  _check_model(config)
  try:
    registry.resolve("method", config.method)
  except registry.SpecError as e:
    raise ConfigError(f"config.method: {e}") from e
