"""One site of an elastic run from a :class:`Config`: ``dadjax train --lighthouse HOST:PORT --site I``.

The config's data, model, inner optimizer and local-update method become a
:func:`dadjax.elastic.run_site` call: the method spec (``diloco:H``,
``local_sgd:H``, ``streaming_diloco:H``, ``sparseloco:H``, ``demo[:H]``, with
their arguments) maps to the :class:`~dadjax.elastic.ElasticDiLoCo` of the
same exchange; the config's optimizer and schedule are the inner optimizer;
``config.num_sites`` is the number of data partitions (a site id is one of
them). Every other method is an error: the lighthouse carries outer steps,
not per-step gradient collectives.
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Any, Callable

import jax
import numpy as np
import optax

from dadjax import elastic
from dadjax.errors import ConfigError
from dadjax.parallel import make_train_step, unstack_site
from dadjax.registry import Resolved, SpecError, resolve
from dadjax.run._config import Config, validate
from dadjax.run._loop import _memory_data, evaluate, local_optimizer, make_schedule, \
    method_and_model
from dadjax.run._metrics_file import MetricsFile

ELASTIC_METHODS = ("local_sgd", "diloco", "streaming_diloco", "sparseloco", "demo")


def _spec_text(value: Any) -> Any:
  """A nested compressor spec (a :class:`~dadjax.registry.Resolved`) as its text."""
  return value.text if isinstance(value, Resolved) else value


def elastic_method(config: Config, loss_fn: Callable[[Any, Any], jax.Array],
                   inner: optax.GradientTransformation) -> elastic.ElasticDiLoCo:
  """The :class:`~dadjax.elastic.ElasticDiLoCo` of ``config.method`` (one of :data:`ELASTIC_METHODS`).

  The spec's arguments keep their meaning and defaults: ``diloco(10, outer_lr=0.5,
  compress=qsgd:8)`` is outer Nesterov SGD (lr 0.5, momentum 0.9) on the
  quorum's mean of 8-bit QSGD pseudo-gradients; ``local_sgd:H`` is the
  parameter mean (outer SGD with lr 1); ``demo``'s ``lr`` defaults to the
  run's schedule, as in ``dadjax train``.

  Raises:
    ConfigError: the method is not a local-update method, or its arguments
      do not fit an elastic run.
  """
  try:
    entry, kwargs = resolve("method", config.method)
  except SpecError as e:
    raise ConfigError(f"config.method: {e}") from None
  if entry.name not in ELASTIC_METHODS:
    raise ConfigError(
        f"config.method={config.method!r}: an elastic run (--lighthouse) takes a local-update "
        f"method, one of {list(ELASTIC_METHODS)} (each site's outer step goes through the "
        "lighthouse; a per-step gradient collective has no quorum to go through)")
  kw = {k: _spec_text(v) for k, v in kwargs.items()}
  seed = config.seed

  def outer() -> optax.GradientTransformation:
    momentum = kw.get("outer_momentum", 0.9)
    return optax.sgd(kw.get("outer_lr", 0.7), momentum=momentum or None, nesterov=bool(momentum))

  try:
    if entry.name == "local_sgd":
      return elastic.ElasticDiLoCo(loss_fn, inner, kw["every"], outer=optax.sgd(1.0), seed=seed)
    if entry.name == "diloco":
      return elastic.ElasticDiLoCo(loss_fn, inner, kw["every"], outer=outer(),
                                   compressor=kw.get("compress"), seed=seed)
    if entry.name == "streaming_diloco":
      return elastic.streaming_diloco(
          loss_fn, inner, kw["every"], kw.get("fragments", 2), kw.get("delay", 1),
          kw.get("alpha", 0.5), outer(), kw.get("compress"), seed=seed)
    if entry.name == "sparseloco":
      return elastic.sparseloco(loss_fn, inner, kw["every"], seed=seed,
                                **{k: kw[k] for k in ("k", "chunk", "values", "decay", "outer_lr")
                                   if k in kw})
    lr = kw.pop("lr", None)
    return elastic.demo(loss_fn, inner, kw.pop("every", 1),
                        lr=make_schedule(config) if lr is None else lr, seed=seed, **kw)
  except ValueError as e:
    raise ConfigError(f"config.method={config.method!r}: {e}") from None


def _check(config: Config, site: int) -> None:
  if config.pipeline != "memory":
    raise ConfigError(f"config.pipeline={config.pipeline!r}: an elastic site reads its rows "
                      "from memory (pipeline='memory')")
  if config.backend != "shard_map" or config.per_site != 1:
    raise ConfigError("an elastic site is one JAX program on one device: config.per_site must "
                      f"be 1 and config.backend 'shard_map' (the default), got per_site="
                      f"{config.per_site}, backend={config.backend!r}")
  if isinstance(site, bool) or not isinstance(site, int) or not 0 <= site < config.num_sites:
    raise ConfigError(f"site must be an int in [0, {config.num_sites - 1}] (one of "
                      f"config.num_sites={config.num_sites} data partitions), got {site!r}")


def train_site(config: Config, lighthouse: str, site: int, *,
               log: Callable[[dict], None] | None = None,
               timeout_s: float = 600.0) -> elastic.SiteRun:
  """Train site ``site`` of an elastic run of ``config`` through the lighthouse at ``lighthouse``.

  Every site runs the same config; site ``I`` trains on partition ``I`` of
  ``config.num_sites`` (``config.partition``), starting from the parameters of
  ``config.seed``, for ``config.steps`` inner steps (a multiple of the
  method's ``H``). A lost site is dropped at the next outer step; a site
  started again with the same id joins from a live site's state (or, with
  none, from its checkpoint in ``config.checkpoint_dir/site{I}``, kept every
  ``ceil(checkpoint_every / H)`` rounds). One row per outer step (``round``,
  ``step``, ``quorum``, ``dropped``, ``loss``, ``sent_bits``, ``received_bits``,
  and the anchor's ``test_*`` metrics every ``config.eval_every`` steps and at
  the end) goes to ``log`` and to ``config.out_dir/site{I}/metrics.jsonl``.

  Args:
    config: the run's config; its method one of :data:`ELASTIC_METHODS`.
    lighthouse: ``"host:port"`` of the run's :class:`~dadjax.elastic.Lighthouse`
      (``dadjax lighthouse``).
    site: this site's id, in ``[0, config.num_sites)``.
    log: called with each row.
    timeout_s: how long a request to the lighthouse may take, seconds.

  Returns:
    The site's :class:`~dadjax.elastic.SiteRun`.

  Raises:
    ConfigError: a config an elastic site cannot run (method, pipeline,
      placement, a model with mutable collections such as BatchNorm's).
    LighthouseUnreachable: the lighthouse did not answer.
  """
  validate(config)
  _check(config, site)
  dataset, batcher, step_fn, state, inner = _one_site(config)
  key = jax.random.key(config.seed)

  def loss_fn(params, batch):
    rng = jax.random.fold_in(jax.random.fold_in(key, batch["site"]), batch["step"])
    rows = {"x": batch["x"], "y": batch["y"]}
    return step_fn.loss_fn(params, {}, rows, rng, True)[0]

  def batch_at(s: int, step: int) -> dict:
    x, y = batcher.batch_at(step, [s])
    return {"x": x, "y": y, "site": np.int32(s), "step": np.int32(step)}

  method = elastic_method(config, loss_fn, inner)
  out = None
  if config.out_dir:
    (pathlib.Path(config.out_dir) / f"site{site}").mkdir(parents=True, exist_ok=True)
    out = MetricsFile(pathlib.Path(config.out_dir) / f"site{site}")
  checkpoint_dir = (None if config.checkpoint_dir is None
                    else pathlib.Path(config.checkpoint_dir) / f"site{site}")
  on_round = _RoundRows(config, site, dataset, step_fn, state, out, log)
  try:
    return elastic.run_site(method, unstack_site(state.params, 0), batch_at,
                            lighthouse=lighthouse, site=site, steps=config.steps,
                            checkpoint_dir=checkpoint_dir,
                            checkpoint_every_rounds=max(1, math.ceil(
                                config.checkpoint_every / method.every)),
                            timeout_s=timeout_s, on_round=on_round)
  except ValueError as e:
    raise ConfigError(f"cannot run site {site} of the config: {e}") from None
  finally:
    if out is not None:
      out.close()


def _one_site(config: Config):
  """``(dataset, batcher, step_fn, state, inner)``: the run's data, and its own step on one
  device for the model, the loss and the evaluation (the inner optimizer its optimizer)."""
  dataset, _, batcher = _memory_data(config)
  schedule, _, model = method_and_model(config, dataset, batcher.steps_per_epoch)
  inner = local_optimizer(config, schedule)
  step_fn = make_train_step(model, inner, num_sites=1, backend="vmap")
  state = step_fn.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
  if jax.tree.leaves(state.model_state):
    raise ConfigError(f"config.model={config.model!r} keeps mutable collections "
                      f"{sorted(state.model_state)}: an elastic run exchanges parameters only "
                      "(choose a model without BatchNorm-style state)")
  return dataset, batcher, step_fn, state, inner


class _RoundRows:
  """``on_round``: a site's row per round, with the anchor's test metrics every ``eval_every``
  steps and at the end, to ``out`` (a :class:`MetricsFile`) and ``log``."""

  def __init__(self, config: Config, site: int, dataset, step_fn, state, out, log):
    self.config, self.site, self.dataset, self.step_fn, self.state = (config, site, dataset,
                                                                      step_fn, state)
    self.out, self.log, self.start, self.last_eval = out, log, time.time(), 0

  def __call__(self, row: dict, after: elastic.SiteState) -> None:
    config = self.config
    row = {"site": self.site, "method": config.method, **row, "wall_s": time.time() - self.start}
    if (row["step"] // config.eval_every > self.last_eval // config.eval_every
        or row["step"] == config.steps):
      self.last_eval = row["step"]
      anchor = self.state._replace(
          params=jax.tree.map(lambda a: np.asarray(a)[None], after.anchor))
      row.update({f"test_{k}": v for k, v in evaluate(
          self.step_fn, anchor, self.dataset.x_test, self.dataset.y_test).items()})
    if self.out is not None:
      self.out.write(row)
    if self.log is not None:
      self.log(row)
