"""The training loop: data, model, method, SPMD step, eval, logs, checkpoints.

``train(config)`` is the one entry point the CLI, the experiments and the
notebooks use. Batches are a pure function of ``(seed, step)``
(:class:`dadjax.data.SiteBatcher`), so the checkpointed step *is* the data
position and a resumed run continues exactly where it stopped. Each site's
rows depend only on ``(seed, site, step)``: on many processes each process
samples and holds only the rows of its own sites (``TrainStep.local_sites``)
and the global batch is assembled from them, equal to the one-process run's.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from dadjax import data as data_lib
from dadjax import models
import dadjax.run._peers as _peers
import dadjax.run._signals as _signals
from dadjax._core.protocols import collect_rows, merge_rows
from dadjax.run._metrics_file import MetricsFile
from dadjax.comm import HierarchicalNetwork, NetworkModel, host_array, report
from dadjax.run._checkpoint import CheckpointDir, truncate_metrics
import dadjax.run._optim as _optim
from dadjax.run._config import Config, validate
from dadjax.errors import CheckpointError, ConfigError, DadjaxError, DivergenceError, Stopped
from dadjax.methods import build_method
from dadjax.parallel import TrainState, TrainStep, make_mesh, make_train_step


@dataclasses.dataclass
class Run:
  """What a finished run returns: its final state, log rows and pieces."""

  config: Config
  state: TrainState
  step_fn: TrainStep
  history: list[dict]
  dataset: Any
  steps_per_epoch: int = 1

  @property
  def final(self) -> dict:
    """The last logged metrics row.

    Raises:
      DadjaxError: nothing was logged (a resumed run that had already
        finished before any row was written); the state is still in ``state``.
    """
    if not self.history:
      raise DadjaxError(
          f"Run.final: no metrics row was logged by this run (it resumed at step "
          f"{int(host_array(self.state.step)[0])} of {self.config.steps}); read run.state instead")
    return self.history[-1]

  @property
  def params(self):
    return self.step_fn.params(self.state)


def make_schedule(config: Config) -> optax.Schedule:
  """The learning rate of ``config`` as an optax schedule (step -> lr).

  ``config.lr_schedule="step:F:S1:S2"`` multiplies ``config.lr`` by ``F`` at
  steps ``S1`` and ``S2``; ``"constant"`` is ``config.lr`` throughout; an
  optax schedule spec is that schedule.
  """
  return _optim.make_schedule(config.lr_schedule, config.lr)


def local_optimizer(config: Config, schedule: optax.Schedule | None = None
                    ) -> optax.GradientTransformation:
  """The config's local optimizer (``config.optimizer``) with :func:`make_schedule`'s
  learning rate (a constant one as a float), after ``config.clip_global_norm``.

  Args:
    config: the run's config.
    schedule: the schedule already built for this run (default: built here).
  """
  if _optim.is_constant(config.lr_schedule):
    lr = config.lr
  else:
    lr = schedule if schedule is not None else make_schedule(config)
  return _optim.make_local_optimizer(config.optimizer, lr, config.momentum,
                                     config.clip_global_norm)


def make_optimizer(config: Config, comm_tx: optax.GradientTransformation
                   ) -> optax.GradientTransformation:
  """The communicating transformation first, then :func:`local_optimizer`."""
  return optax.chain(comm_tx, local_optimizer(config))


def evaluate(step_fn: TrainStep, state: TrainState, x: np.ndarray, y: np.ndarray,
             batch_size: int = 512) -> dict:
  """Metrics of site 0's model on ``(x, y)`` in evaluation mode (``train=False``).

  Runs the step's loss and metrics functions (:meth:`TrainStep.evaluate`)
  over batches of ``batch_size`` rows: no dropout, BatchNorm with its
  running averages. Every site holds the same parameters (and, with the
  default ``average``, the same running averages).

  Returns:
    ``{"loss": ..., "accuracy": ..., ...}``: the row-weighted mean of each
    metric over the whole set (host floats).
  """
  totals: dict[str, float] = {}
  for i in range(0, len(x), batch_size):
    rows = len(x[i:i + batch_size])
    metrics = step_fn.evaluate(state, {"x": x[i:i + batch_size], "y": y[i:i + batch_size]})
    for k, v in metrics.items():
      totals[k] = totals.get(k, 0.0) + v * rows
  return {k: v / max(1, len(x)) for k, v in totals.items()}


def method_and_model(config: Config, dataset, steps_per_epoch: int | None):
  """``(schedule, method, model)`` of a run: its lr schedule, its method (built for the
  schedule and the epoch length) and its model (with the method's dense layer and, for a
  token dataset, the data's vocabulary)."""
  schedule = make_schedule(config)  # one schedule: the optimizer's and the method's
  method = build_method(config.method, axis_name="data", seed=config.seed,
                        steps_per_epoch=steps_per_epoch, lr_schedule=schedule)
  # Flax modules must be hashable: JSON/TOML lists become tuples.
  model_kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in config.model_kwargs.items()}
  fields = models.model_fields(models.model_class(config.model)[0]) or ()
  if "vocab_size" in fields and dataset.vocab_size and np.issubdtype(
      dataset.x_train.dtype, np.integer):
    model_kwargs.setdefault("vocab_size", dataset.vocab_size)
  dense_kw = {"dense": method.dense} if method.dense is not None else {}
  model = models.get_model(config.model, dataset.num_classes, **dense_kw, **model_kwargs,
                           nnx_seed=config.seed)  # an NNX class: rngs=nnx.Rngs(seed, ...)
  return schedule, method, model


def build(config: Config):
  """Data, batcher, model and step for ``config`` (no training).

  The method's batch stage (data-side methods), if any, goes into the step.
  ``batcher.steps_per_epoch`` (``max(1, examples // global batch)``) is the
  epoch length the loop hands to methods that work in epochs.
  """
  if config.pipeline == "grain":  # each process reads only its own sites' rows, same batches
    dataset, parts, batcher = data_lib.grain_pipeline(config)
    data_lib.check_dataset(dataset)
  else:
    dataset, parts, batcher = _memory_data(config)
  step_fn = build_step(config, dataset, batcher.steps_per_epoch)
  if config.pipeline == "grain":
    batcher.use_sites(step_fn.local_sites)
  return dataset, parts, batcher, step_fn


def build_step(config: Config, dataset, steps_per_epoch: int | None, mesh=None) -> TrainStep:
  """The run's :class:`~dadjax.parallel.TrainStep` for ``dataset`` (its shapes, vocabulary and
  classes are read); ``mesh``: the mesh to place it on (default: the config's, over
  ``jax.devices()``; :func:`dadjax.pod.compile_config` passes a TPU topology's)."""
  schedule, method, model = method_and_model(config, dataset, steps_per_epoch)
  if mesh is None and config.per_site > 1:
    mesh = (make_mesh(sites=config.num_sites, inner=dict(config.mesh_inner))
            if config.mesh_inner else make_mesh(sites=config.num_sites, per_site=config.per_site))
  if mesh is not None:
    placement = {"mesh": mesh, "shard_params": config.shard_params,
                 "rules": None if config.rules is None else models.gpt_rules(config.rules)}
  else:
    placement = {"num_sites": config.num_sites}
  lm = np.ndim(dataset.y_train) == 2  # next-token targets (rows, T): per-token metrics
  return make_train_step(model, method.optimizer(local_optimizer(config, schedule)), **placement,
                         backend=config.backend,
                         metrics_fn=data_lib.language_model_metrics if lm else None,
                         batch_stage=getattr(method, "batch_stage", None),
                         compute_dtype=(None if config.compute_dtype == "float32"
                                        else jnp.dtype(config.compute_dtype)),
                         collections=getattr(method, "collections", None))


def _memory_data(config: Config):
  """``(dataset, parts, batcher)`` with every training row in memory (``pipeline="memory"``)."""
  dataset_kwargs = dict(config.dataset_kwargs)
  if config.data_dir:
    dataset_kwargs["data_dir"] = config.data_dir
  dataset = data_lib.load(config.dataset, **dataset_kwargs)
  data_lib.check_dataset(dataset)  # bad data is a DataError, before any step
  groups = getattr(dataset, "groups", None)  # e.g. the file of each text window
  parts = data_lib.partition(dataset.y_train if groups is None else groups, config.num_sites,
                             scheme=config.partition,
                             alpha=config.alpha, seed=config.seed)
  batcher = data_lib.SiteBatcher(dataset.x_train, dataset.y_train, parts, config.batch_per_site,
                                 seed=config.seed)
  return dataset, parts, batcher


def train(config: Config, *, progress: bool = True, log: Callable[[dict], None] | None = None,
          restart: bool = False) -> Run:
  """Train according to ``config``; resume from ``config.checkpoint_dir`` if it holds a checkpoint.

  The checkpoint directory is locked for the life of the run, only finite
  states are saved, and a checkpoint is resumed only if it was written by
  the same configuration (see :mod:`dadjax.run._checkpoint`). On resume,
  ``out_dir/metrics.jsonl`` is cut back to the resumed step and the wall
  time continues from the checkpoint's. A run whose checkpoint is already at
  ``config.steps`` does nothing and returns the last logged metrics.

  Args:
    config: the run's :class:`~dadjax.config.Config`.
    progress: show progress: a bar where the output is a terminal or a notebook,
      elsewhere (a pipe, a file, a CI log) one line on stderr per evaluation.
    log: called with each metrics row (also written to ``out_dir/metrics.jsonl``).
    restart: delete the checkpoints in ``config.checkpoint_dir`` and start
      from step 0 instead of resuming.

  Returns:
    A :class:`Run` with the final state and the logged rows.

  Raises:
    ConfigError: the config names a dataset, model or method that cannot be built,
      or an ``out_dir`` that cannot be written.
    CheckpointError: the checkpoint directory is in use, belongs to another
      configuration, is past ``config.steps``, or holds no intact checkpoint.
    DivergenceError: a non-finite loss or state (never logged or saved).
  """
  validate(config)
  stores: list = []  # the open checkpoint directory, for the message of an immediate stop
  def kept():
    return stores[0].finished_step() if stores else None
  with _signals.StopOnSignal(config.signal_grace_s, enabled=config.checkpoint_on_signal,
                             multi_process=jax.process_count() > 1,
                             last_checkpoint=kept) as stop, \
       _peers.PeerWatch(config.peer_timeout_s, step=lambda: stop.step,
                        last_checkpoint=kept) as watch:
    try:
      return _train(config, progress, log, restart, stop, stores)
    except Exception as e:  # pylint: disable=broad-except
      # A collective (finite check, metrics, evaluation, a checkpoint's agreement or save)
      # that failed because a peer is gone: the watch names that peer and ends the process.
      watch.confirm(e)
      raise


def _train(config: Config, progress: bool, log, restart: bool, stop, stores: list) -> Run:
  """:func:`train` with its signal handlers installed (``stop``)."""
  dataset, batcher, step_fn, state = _build_state(config)
  store, state, wall0, last_row = _resume(
      config, state, restart, pipeline=batcher if config.pipeline == "grain" else None)
  if store is not None:
    stores.append(store)
  if store is not None and int(host_array(state.step)[0]) == config.steps:
    store.close()
    print(f"dadjax: the run in {config.checkpoint_dir} already finished at step {config.steps}; "
          "nothing to do", file=sys.stderr, flush=True)
    return Run(config, state, step_fn, [last_row] if last_row else [], dataset)
  start = int(host_array(state.step)[0])
  out_file = _open_metrics(config, store, start)
  loop = _Loop(config, step_fn, dataset, batcher, network_model(config), store, stop, log,
               out_file, wall0, last_row)
  try:
    state, history = loop.run(state, start, progress)
  finally:
    if store is not None:
      store.close()
    if out_file:
      out_file.close()
    if config.pipeline == "grain":
      batcher.close()  # stop the pipeline's reader threads
  return Run(config, state, step_fn, history, dataset, batcher.steps_per_epoch)


def _build_state(config: Config):
  """``(dataset, batcher, step_fn, state)``: :func:`build` and the initial state; a config that
  cannot be built is a :class:`~dadjax.errors.ConfigError`."""
  dataset = None
  try:
    dataset, _, batcher, step_fn = build(config)
    state = step_fn.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
  except DadjaxError:
    raise
  except (ValueError, FileNotFoundError) as e:
    raise ConfigError(f"cannot build the run from the config: {e}") from e
  except ZeroDivisionError as e:  # an initializer saw a layer with no inputs
    raise ConfigError(
        f"cannot build the run from the config: model {config.model!r} with "
        f"{config.model_kwargs} has a layer with no inputs for input shape "
        f"{dataset.x_train.shape[1:]} ({e})") from e
  return dataset, batcher, step_fn, state


def _open_metrics(config: Config, store, start: int) -> MetricsFile | None:
  """``out_dir/metrics.jsonl`` cut back to ``start`` and opened (``None`` without ``out_dir``)."""
  if not config.out_dir:
    return None
  try:
    pathlib.Path(config.out_dir).mkdir(parents=True, exist_ok=True)
    truncate_metrics(pathlib.Path(config.out_dir) / "metrics.jsonl", start)
    return MetricsFile(config.out_dir,
                       kept=lambda: store.settled_step() if store is not None else None)
  except OSError as e:
    if store is not None:
      store.close()  # release the checkpoint lock: nothing ran
    raise ConfigError(f"config.out_dir {config.out_dir!r} cannot hold metrics.jsonl: "
                      f"{e.strerror or e}; choose a writable directory") from None


@dataclasses.dataclass
class _Loop:
  """The steps of one run: train, check, log, save, stop on a signal."""

  config: Config
  step_fn: TrainStep
  dataset: Any
  batcher: Any
  network: HierarchicalNetwork
  store: Any
  stop: Any
  log: Callable[[dict], None] | None
  out_file: MetricsFile | None
  wall0: float
  last_row: dict | None
  ops: Any = None

  def run(self, state, start: int, progress: bool) -> tuple[Any, list[dict]]:
    """Steps ``start`` to ``config.steps``; returns the final state and the logged rows."""
    config, step_fn, store, stop = self.config, self.step_fn, self.store, self.stop
    history: list[dict] = []
    # a bar where the output redraws in place; elsewhere a line per evaluation (_progress_line)
    bar = tqdm(range(start, config.steps), desc=config.method, initial=start,
               total=config.steps, leave=False) if progress and _interactive() else None
    t0 = time.perf_counter()
    sites = step_fn.local_sites  # this process samples and holds only its own sites' rows
    for step in bar if bar is not None else range(start, config.steps):
      x, y = self.batcher.batch_at(step, sites)
      if step == start:
        _report_rows(sites, x.shape, step_fn.num_sites)
      state, metrics = step_fn(state, {"x": x, "y": y}, sites)
      done = stop.step = step + 1  # the step a peer's or this process's error names
      log_now = done % config.eval_every == 0 or done == config.steps
      save_now = store is not None and (done % config.checkpoint_every == 0
                                        or done == config.steps)
      if log_now or save_now:  # the only host syncs of the loop
        _check_finite(metrics, done, config, store)
      if log_now:
        row = self.log_row(state, metrics, {"x": x, "y": y}, sites, done,
                           self.wall0 + time.perf_counter() - t0)
        history.append(row)
        if bar is not None:
          bar.set_postfix(loss=f"{row['loss']:.3f}", test_loss=f"{row['test_loss']:.3f}")
        elif progress:
          _progress_line(config, row)
      if save_now:
        store.save(done, state, wall_s=self.wall0 + time.perf_counter() - t0, row=self.last_row)
      if stop.stop_at(done) if done < config.steps else stop.stop_at_end(done):
        _stop_on_signal(config, store, stop, state, metrics, done, saved=save_now,
                        wall_s=self.wall0 + time.perf_counter() - t0, row=self.last_row)
    return state, history

  def log_row(self, state, metrics, batch, sites, step: int, seconds: float) -> dict:
    """Build the row of ``step``, write it to the metrics file and hand it to ``log``."""
    if self.ops is None:  # the compiled step's collective ops, read once
      self.ops = compiled_ops(self.step_fn, state, batch, sites)
    row = _log_row(self.config, self.step_fn, state, metrics, self.dataset, self.network, step,
                   seconds, self.batcher.steps_per_epoch, self.ops)
    self.last_row = row
    if self.out_file:
      self.out_file.write(row)  # strict JSON; a vanished out_dir or a full disk stops the run
    if self.log:
      self.log(row)
    return row


def _interactive(stream=None) -> bool:
  """Whether ``stream`` (default ``sys.stderr``) redraws a progress bar in place.

  A terminal or a notebook kernel (Jupyter, Colab) does; a pipe, a file or a
  CI log does not, and a bar there is a line per redraw.
  """
  stream = sys.stderr if stream is None else stream
  try:
    if stream.isatty():
      return True
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    pass
  get_ipython = getattr(sys.modules.get("IPython"), "get_ipython", None)
  return hasattr(get_ipython() if get_ipython is not None else None, "kernel")


def _progress_line(config: Config, row: dict) -> None:
  """The progress bar's stand-in off a terminal: one line on stderr per logged row, e.g.
  ``dadjax: topk:0.01 step 100/300: loss 0.412, test loss 0.45, test accuracy 0.91, 12.3 s``."""
  figures = [f"loss {row['loss']:.4g}"]
  figures += [f"test {k[len('test_'):].replace('_', ' ')} {v:.4g}" for k, v in row.items()
              if k.startswith("test_") and isinstance(v, (int, float))]
  print(f"dadjax: {config.method} step {row['step']}/{config.steps}: "
        f"{', '.join(figures)}, {row['wall_s']:.1f} s", file=sys.stderr, flush=True)


def _stop_on_signal(config: Config, store, stop, state, metrics, step: int, *, saved: bool,
                    wall_s: float, row) -> None:
  """Save ``step`` (unless just saved), wait for the writes, release the lock, raise Stopped."""
  if store is not None:
    if not saved:
      _check_finite(metrics, step, config, store)
      store.save(step, state, wall_s=wall_s, row=row)
    store.close()  # waits for every write (also an earlier one still in flight)
    what = (f"checkpoint {step} saved in {store.directory}; "
            + ("rerun the same command to resume" if step < config.steps else
               "that is the last step: the run is complete (a rerun has nothing to do)"))
    kept = step
  else:
    what = "no checkpoint_dir is set, so nothing was saved"
    kept = None
  raise Stopped(f"stopped by {stop.name} at step {step}; {what}", signal_name=stop.name,
                step=step, checkpoint_step=kept, exit_code=_signals.exit_code(stop.signum))


def _resume(config: Config, state, restart: bool, pipeline=None):
  """Open and lock ``config.checkpoint_dir`` and restore its newest intact checkpoint.

  Returns ``(store, state, wall_s, last_row)``; ``store`` is ``None`` without
  a checkpoint directory, and ``state`` the restored one if there was one.
  """
  if not config.checkpoint_dir:
    return None, state, 0.0, None
  store = CheckpointDir(config.checkpoint_dir, config, restart=restart, pipeline=pipeline)
  try:
    restored = store.restore(state)
    if restored is None:
      return store, state, 0.0, None
    if restored.step > config.steps:
      raise CheckpointError(
          f"config.steps={config.steps} is smaller than the step of the checkpoint in "
          f"checkpoint_dir {config.checkpoint_dir!r} ({restored.step}); set steps >= "
          f"{restored.step}, or use a new checkpoint_dir or restart=True (--restart)")
  except BaseException:
    store.close()
    raise
  return store, restored.state, restored.meta.get("wall_s", 0.0), restored.meta.get("row")


def _check_finite(metrics, step: int, config: Config, store) -> None:
  """Stop on a non-finite loss before it is logged or checkpointed."""
  loss = float(host_array(metrics["loss"])[0])
  if not np.isfinite(loss):
    kept = store.latest_step() if store is not None else None
    raise DivergenceError(
        f"training diverged: loss is {loss} at step {step} (method={config.method!r}, "
        f"lr={config.lr}); "
        + (f"the last finite checkpoint, step {kept}, is kept" if kept is not None
           else "no checkpoint was written"))


def compiled_ops(step_fn: TrainStep, state, batch, sites=None) -> tuple[Any, Any]:
  """``(ops, intra_ops)`` of the compiled step for :func:`dadjax.comm.report`, read once.

  The inter-site ops (every op on a 1-D mesh) and, on a 2-D mesh, the
  in-site ops. ``backend="vmap"`` simulates the sites on one device, so its
  program has no collective ops to read: ``(None, None)``, and the read-out
  charges latency per recorded call (its ``latency_per`` says so).
  ``batch`` is the global batch, or the rows of ``sites`` only.
  """
  if step_fn.backend == "vmap":
    return None, None
  if step_fn.per_site > 1:
    return (step_fn.collectives(state, batch, link="inter", sites=sites),
            step_fn.collectives(state, batch, link="intra", sites=sites))
  return step_fn.collectives(state, batch, sites=sites), None


def _report_rows(sites: tuple[int, ...], shape: tuple[int, ...], num_sites: int) -> None:
  """On many processes, say (stderr, once) which sites' rows this process samples."""
  if jax.process_count() > 1:
    print(f"dadjax: process {jax.process_index()} of {jax.process_count()} samples the rows "
          f"of sites {list(sites)} of {num_sites}: host batch {tuple(shape)} a step",
          file=sys.stderr, flush=True)


def network_model(config: Config) -> HierarchicalNetwork:
  """The network model of ``config`` the rows' modeled figures hold for (a 1-D mesh: one
  device per site, no in-site phase)."""
  return HierarchicalNetwork(
      NetworkModel(config.bandwidth, config.latency, config.num_sites, config.topology),
      config.intra_bandwidth, config.intra_latency, config.per_site)


def _log_row(config, step_fn, state, metrics, dataset, network_model, step, seconds,
             steps_per_epoch, ops) -> dict:
  """One metrics row.

  Every bit and time column is :func:`dadjax.comm.report`'s row: every
  ledger of the train state (the optimizer's and the step's own: batch
  stage, averaged collections, the metrics' ``pmean``), with latency charged
  per compiled op (``ops``: :func:`compiled_ops`).
  ``train_<name>`` are the step's site-averaged metrics of the last step,
  ``test_<name>`` the evaluation-mode metrics on the test set; then what the
  state's parts report (``metrics_row``). No column overwrites another
  (:func:`~dadjax._core.protocols.merge_rows`).
  """
  train_metrics = {k: float(host_array(v)[0]) for k, v in metrics.items()}
  test_metrics = evaluate(step_fn, state, dataset.x_test, dataset.y_test)
  loop_row = {"step": step, "epoch": step / steps_per_epoch, "method": config.method,
              "loss": train_metrics.pop("loss"),
              **{f"train_{k}": v for k, v in train_metrics.items()},
              **{f"test_{k}": v for k, v in test_metrics.items()}}
  return merge_rows(
      ("the train loop", loop_row),
      ("dadjax.comm.report", report(state, network_model, ops=ops[0], intra_ops=ops[1]).row()),
      ("the train loop", {"wall_s": seconds}),
      ("the train state's metrics_row", step_fn.metrics_row(state)))


def state_rows(opt_state: Any, params: Any) -> dict:
  """The merged ``metrics_row`` of every reporting part of an optimizer state
  (:func:`dadjax._core.protocols.collect_rows`; e.g. Accordion's decisions).

  Args:
    opt_state: the optimizer state (stacked per site or not).
    params: one site's parameters (for tensor names).
  """
  return collect_rows(opt_state, params)
