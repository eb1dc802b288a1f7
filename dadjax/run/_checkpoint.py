"""Checkpoints that are never poisoned and never silently misused.

A run's ``checkpoint_dir`` holds orbax checkpoints, one directory per step,
each with two items: ``state`` (the :class:`~dadjax.parallel.TrainState`)
and ``meta`` (JSON: the run's fingerprint, a checksum of every leaf of the
state, the wall time so far and the last logged metrics row), and with
``pipeline="grain"`` a third, ``data`` (the input pipeline's Grain iterator
state, one JSON file per process).
:class:`CheckpointDir` guards the directory for the life of a run:

- **Lock.** An exclusive ``fcntl`` lock on ``checkpoint_dir/dadjax.lock``;
  a second run on the same directory fails with "in use by pid N". The
  kernel drops the lock when the process dies, so a killed run never
  leaves the directory locked.
- **Finite saves only.** :meth:`CheckpointDir.save` checks the state being
  saved (every floating leaf of the parameters, optimizer and model state)
  and raises :class:`~dadjax.errors.DivergenceError` instead of writing a
  non-finite one.
- **Fingerprint.** What must match to resume (:func:`fingerprint`: method
  spec, model and kwargs, optimizer and hyperparameters, sites, data and
  partition, seed, library version) is stored in every checkpoint; a
  different one is refused with one message naming the differing fields.
- **Verified restore.** Each checkpoint, newest first, must restore through
  orbax and match its stored checksums; a damaged one is reported, deleted
  and the next older one is tried.
- **Only its own steps.** A step directory counts (is restored, kept in
  rotation, deleted) only if it is a real directory, not a symbolic link,
  and holds dadjax's ``meta`` record; anything else beside the checkpoints
  (a folder ``2024/``, a link) is never read, rotated or deleted.
- **Failed saves end the run.** A save that cannot be written (no space,
  a read-only or vanished directory, a deleted or replaced lock) raises
  :class:`~dadjax.errors.CheckpointError` naming the last intact step.
  Saves are synchronous (orbax's public
  ``CheckpointManagerOptions(enable_async_checkpointing=False)``): a failure
  surfaces in the :meth:`CheckpointDir.save` call that wrote the step, on the
  calling thread, and no orbax writer thread is left waiting for it, so the
  process exits at once.

dadjax uses orbax's public API only (``CheckpointManager``,
``CheckpointManagerOptions``, ``args``, ``step.NameFormat``). What a failed
save would still print (orbax's error logs, and the reports of TensorStore
writes that complete after orbax closed the event loop awaiting them) is
dropped by Python's own ``logging`` filters and a ``sys.unraisablehook``
wrapper matching only those reports, both installed for the save alone
(:func:`_quiet_save`).

Checksums are computed on the device by one jitted reduction per leaf
(``sum(bits[i] * w[i]) mod 2**32`` with distinct odd weights ``w[i]``), so
any change of a single element is always detected, the value is the same
for every sharding and process, and nothing is copied to the host.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gc
import json
import logging
import os
import pathlib
import shutil
import sys
import warnings
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from dadjax.comm import host_array
from dadjax.run._config import Config
from dadjax.errors import CheckpointError, DivergenceError
from dadjax._core.procs import pid_alive

__all__ = ["CheckpointDir", "Restored", "fingerprint", "state_digest", "truncate_metrics",
           "FINGERPRINT_EXCLUDED"]

FORMAT = 1

# Config fields that may change between a run and its resumption; every
# other field (including ones added later) is part of the fingerprint.
FINGERPRINT_EXCLUDED = frozenset({
    "steps", "eval_every", "checkpoint_dir", "checkpoint_every", "out_dir", "data_dir",
    "backend", "bandwidth", "latency", "topology", "intra_bandwidth", "intra_latency",
    "checkpoint_on_signal", "signal_grace_s", "peer_timeout_s", "pipeline_prefetch"})

LOCK_FILE = "dadjax.lock"


class _QuietFailedWriters(logging.Filter):
  """Drop orbax's error logs (with tracebacks) of a failed save.

  Every such failure reaches the caller of :meth:`CheckpointDir.save` as one
  :class:`~dadjax.errors.CheckpointError`. Installed on the ``absl`` logger
  by a :class:`CheckpointDir` for its life, removed by its close.
  """

  def filter(self, record: logging.LogRecord) -> bool:
    return not (record.levelno >= logging.ERROR
                and f"{os.sep}orbax{os.sep}" in (record.pathname or ""))


# What asyncio logs (on its own logger) when a failed save's writes are garbage-collected.
_DROPPED_WRITE_NOTES = ("exception was never retrieved", "Task was destroyed but it is pending")


class _DroppedWrites(logging.Filter):
  """After a failed save: drop asyncio's notes of the failed writes' tasks and futures."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not any(note in str(record.msg) for note in _DROPPED_WRITE_NOTES)


def _is_closed_loop_report(unraisable: Any) -> bool:
  """Whether an unraisable exception is a write's completion posted to a closed event loop.

  orbax awaits each save's TensorStore writes in an event loop of its own that it closes as
  soon as one write fails (there is no public option to let the others settle first); each
  other write then completes on a TensorStore thread whose callback calls
  ``loop.call_soon_threadsafe`` on the closed loop, and Python reports that ``RuntimeError``
  with no object. Only exactly that is matched.
  """
  error = unraisable.exc_value
  if (unraisable.object is not None or type(error) is not RuntimeError
      or str(error) != "Event loop is closed"):
    return False
  tb = unraisable.exc_traceback
  while tb is not None:
    code = tb.tb_frame.f_code
    if code.co_name == "call_soon_threadsafe" and code.co_filename.endswith(
        os.path.join("asyncio", "base_events.py")):
      return True
    tb = tb.tb_next
  return False


@contextlib.contextmanager
def _quiet_save() -> Iterator[None]:
  """While a save runs and a failure of it is handled: the reports of its failed writes.

  A failed save reaches its caller as one :class:`~dadjax.errors.CheckpointError`; what
  its writes left behind is dropped on purpose, for this block only: the reports of
  writes completing after their event loop was closed (:func:`_is_closed_loop_report`;
  every other unraisable exception goes to the hook that was in place), Python's "never
  awaited" warning of coroutines that never ran, and asyncio's notes of the tasks and
  futures left unread (collected before the block ends).
  """
  previous = sys.unraisablehook

  def hook(unraisable):
    if not _is_closed_loop_report(unraisable):
      previous(unraisable)

  dropped = _DroppedWrites()
  asyncio_log = logging.getLogger("asyncio")
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", r"coroutine .* was never awaited", RuntimeWarning)
    asyncio_log.addFilter(dropped)
    sys.unraisablehook = hook
    try:
      yield
    finally:
      try:
        gc.collect()
      finally:
        if sys.unraisablehook is hook:  # unless someone replaced it meanwhile
          sys.unraisablehook = previous
        asyncio_log.removeFilter(dropped)


def _say(message: str) -> None:
  print(f"dadjax: {message}", file=sys.stderr, flush=True)


def fingerprint(config: Config) -> dict[str, Any]:
  """What must match for a checkpoint of one run to resume another.

  Every :class:`~dadjax.config.Config` field except those in
  ``FINGERPRINT_EXCLUDED`` (steps, eval and checkpoint cadence, output
  locations, backend and the network model), plus the library version.
  Values are JSON-normalized (tuples become lists).
  """
  import dadjax  # pylint: disable=g-import-not-at-top
  values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in FINGERPRINT_EXCLUDED}
  values["version"] = dadjax.__version__
  return json.loads(json.dumps(values, sort_keys=True, default=str))


def _fingerprint_diff(saved: dict, current: dict) -> list[str]:
  return [f"{k}: {saved.get(k, '<absent>')!r} in the checkpoint, {current.get(k, '<absent>')!r} now"
          for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def _as_words(x: jax.Array) -> jax.Array:
  """The bits of ``x`` as a flat uint32 vector (one word per element, or two for 64-bit)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if jnp.iscomplexobj(x):
    x = jnp.stack([jnp.real(x), jnp.imag(x)], -1)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).ravel()
  size = x.dtype.itemsize
  if size == 4 or size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32).ravel()
  small = {2: jnp.uint16, 1: jnp.uint8}[size]
  return jax.lax.bitcast_convert_type(x, small).astype(jnp.uint32).ravel()


def _leaf_digest(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  x = jnp.asarray(x)
  words = _as_words(x)
  index = jnp.arange(words.size, dtype=jnp.uint32)
  weights = index * jnp.uint32(0x9E3779B9) * jnp.uint32(2) + jnp.uint32(1)  # odd: invertible
  checksum = jnp.sum(words * weights, dtype=jnp.uint32)
  finite = (jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.array(True))
  return checksum, finite


@jax.jit
def _digest(leaves: list) -> tuple[jax.Array, jax.Array]:
  """Checksums (uint32) and finiteness (bool), one entry per leaf, as two vectors."""
  pairs = [_leaf_digest(x) for x in leaves] or [(jnp.uint32(0), jnp.array(True))]
  return jnp.stack([c for c, _ in pairs]), jnp.stack([f for _, f in pairs])


def _fetch(x: jax.Array) -> np.ndarray:
  """A replicated result on the host (with many processes: this process's copy)."""
  if x.is_fully_addressable or not x.sharding.is_fully_replicated:
    return host_array(x)
  return np.asarray(x.addressable_data(0))


def state_digest(state: Any) -> tuple[dict[str, int], list[str]]:
  """Checksums of every leaf and the paths of the non-finite ones.

  Args:
    state: a pytree of arrays (possibly sharded over devices or processes).

  Returns:
    ``(checksums, nonfinite)``: ``{keypath: uint32 checksum}`` for every leaf
    (``sum(bits[i] * (2 * i * 0x9E3779B9 + 1)) mod 2**32`` over the leaf's
    elements as 32-bit words), and the key paths of floating leaves holding
    a NaN or an infinity, in tree order.
  """
  paths_leaves = jax.tree_util.tree_flatten_with_path(state)[0]
  paths = [jax.tree_util.keystr(p) for p, _ in paths_leaves]
  sums, finite = _digest([leaf for _, leaf in paths_leaves])
  sums, finite = _fetch(sums), _fetch(finite)  # the only two transfers
  checksums = {p: int(c) for p, c in zip(paths, sums)}
  nonfinite = [p for p, f in zip(paths, finite) if not f]
  return checksums, nonfinite


@dataclasses.dataclass
class Restored:
  """A verified checkpoint: its ``step``, ``state`` and ``meta`` (JSON dict), and the
  restored input pipeline iterator (``data``; ``None`` without a pipeline)."""

  step: int
  state: Any
  meta: dict
  data: Any = None


class _OwnSteps(ocp.step.NameFormat):
  """orbax's standard step names (``DIR/<step>``), counting only dadjax's own steps.

  A step directory is one of this run's kind if it is a real directory (not
  a symbolic link) holding the ``meta`` item; orbax then never lists,
  restores, rotates out or deletes anything else in the directory. Built on
  orbax's public ``step.standard_name_format()``, whose finds it filters.
  """

  def __init__(self):
    self._standard = ocp.step.standard_name_format()

  def __str__(self) -> str:
    return f"dadjax's own steps of {self._standard}"

  def build_name(self, step: int) -> str:
    return self._standard.build_name(step)

  def find_all(self, base_path):
    return (m for m in self._standard.find_all(base_path)
            if _is_own_step(pathlib.Path(str(m.path))))

  def find_step(self, base_path, step: int):
    metadata = self._standard.find_step(base_path, step)  # raises ValueError when absent
    if not _is_own_step(pathlib.Path(str(metadata.path))):
      raise ValueError(f"step {step} in {base_path} is not a dadjax checkpoint")
    return metadata


def _is_own_step(path: pathlib.Path) -> bool:
  return (not path.is_symlink() and path.is_dir() and not (path / "meta").is_symlink()
          and (path / "meta").is_dir())


def _foreign_steps(directory: pathlib.Path) -> list[str]:
  """Names of step-like entries (``DIR/<int>``) that are not dadjax's own steps."""
  try:
    entries = list(directory.iterdir())
  except OSError:
    return []
  return sorted((p.name for p in entries if p.name.isdigit() and not _is_own_step(p)),
                key=int)


class CheckpointDir:
  """A locked, fingerprinted, verified checkpoint directory for one run.

  Use as a context manager (or call :meth:`close`); the lock is held from
  construction until then.

  Args:
    directory: the checkpoint directory (created if missing).
    config: the run's config; its :func:`fingerprint` is checked against
      the checkpoints found and stored in the ones written.
    restart: delete the directory's checkpoints (of whatever run) instead
      of resuming from them.
    max_to_keep: checkpoints kept (>= 2, so that a damaged newest one has
      an older one to fall back to). Default 2.
    say: where notices go (default: stderr, prefixed ``dadjax:``).
    pipeline: the run's input pipeline (:class:`~dadjax.data.SitePipeline`),
      or ``None``. Its Grain iterator state is saved with every checkpoint
      as the item ``data`` (Grain's orbax handler: one JSON file per
      process) and restored with it; a checkpoint whose pipeline state is
      missing or not at its step is damaged.

  Raises:
    CheckpointError: the directory is in use by another process, or cannot
      be created or written.
  """

  def __init__(self, directory: str | os.PathLike, config: Config, *, restart: bool = False,
               max_to_keep: int = 2, say: Callable[[str], None] = _say, pipeline: Any = None):
    if max_to_keep < 2:
      raise ValueError(f"max_to_keep must be >= 2, got {max_to_keep}")
    self.directory = pathlib.Path(directory).absolute()
    self.fingerprint = fingerprint(config)
    self._say = say
    self._lock_fd = None
    self._lock_id = None
    self._saving = None
    self._restarted = restart
    self._manager = None
    self._pipeline = pipeline
    self._quiet = _QuietFailedWriters()
    try:
      self.directory.mkdir(parents=True, exist_ok=True)
      if jax.process_index() == 0:
        self._lock()
    except OSError as e:
      raise CheckpointError(f"checkpoint_dir {str(self.directory)!r} cannot be used: "
                            f"{e.strerror or e}") from e
    logging.getLogger("absl").addFilter(self._quiet)  # removed by close()
    try:
      self._manager = ocp.CheckpointManager(
          self.directory, options=ocp.CheckpointManagerOptions(
              max_to_keep=max_to_keep, create=True, cleanup_tmp_directories=True,
              # a failed save raises in save(), on the caller's thread, leaving no writer waiting
              enable_async_checkpointing=False,
              step_name_format=_OwnSteps()))
      if restart and self._manager.all_steps():
        steps = sorted(self._manager.all_steps())
        for step in steps:
          self._manager.delete(step)
        self._say(f"restart: deleted the checkpoints at steps {steps} in {self.directory}")
    except BaseException:
      self.close()
      raise

  # -- lock ------------------------------------------------------------------

  def _lock(self) -> None:
    path = self.directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
      os.close(fd)
      raise CheckpointError(
          f"checkpoint_dir {str(self.directory)!r} is in use by pid {holder}; wait for that run "
          "to finish, stop it, or use another checkpoint_dir") from None
    previous = os.pread(fd, 64, 0).decode(errors="replace").strip()
    if previous.isdigit() and int(previous) != os.getpid() and not pid_alive(int(previous)):
      self._say(f"taking over the lock of {self.directory} from pid {previous}, which is no "
                "longer running (a run that was killed)")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    self._lock_fd = fd
    self._lock_id = _file_id(os.fstat(fd))

  def check_lock(self) -> None:
    """Raise CheckpointError if the lock file was deleted or replaced (or the directory).

    Another run could then lock the directory and mix its checkpoints with
    this run's; the run stops instead.
    """
    message = self._lock_lost()
    if message:
      raise CheckpointError(f"{message}; {self._kept_text()}")

  def _lock_lost(self) -> str | None:
    if self._lock_fd is None:
      return None
    path = self.directory / LOCK_FILE
    try:
      if _file_id(os.stat(path)) == self._lock_id:
        return None
    except OSError:
      pass
    return (f"the lock {str(path)!r} of this run was deleted or replaced (was checkpoint_dir "
            "deleted or moved?); stopping so that no other run shares the directory")

  def close(self) -> None:
    """Wait for pending writes, close orbax and release the lock.

    Raises:
      CheckpointError: a write still in flight failed (see :meth:`save`).
    """
    try:
      if self._manager is not None:
        manager, self._manager = self._manager, None
        try:
          with _quiet_save():
            manager.wait_until_finished()
        except Exception as e:  # pylint: disable=broad-except
          self._failed(e, manager)
        manager.close()
    finally:
      logging.getLogger("absl").removeFilter(self._quiet)
      if self._lock_fd is not None:
        os.ftruncate(self._lock_fd, 0)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None

  def _failed(self, error: BaseException, manager) -> None:
    """A save failed: close orbax, remove the half-written step, raise CheckpointError."""
    with _quiet_save():
      try:
        manager.close()
      except Exception:  # pylint: disable=broad-except
        pass
    step = self._saving
    for tmp in (self.directory.glob(f"{step}.orbax-checkpoint-tmp*") if step is not None else ()):
      if tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp, ignore_errors=True)
    where = str(self.directory)
    lost = self._lock_lost()
    if lost:
      what = f"{lost}; checkpoint step {step} could not be written ({_first_line(error)})"
    elif _is_enospc(error):
      what = f"no space left on device writing {where} ({_first_line(error)})"
    else:
      what = f"checkpoint step {step} could not be written in {where} ({_first_line(error)})"
    raise CheckpointError(f"{what}; {self._kept_text()}") from error

  def __enter__(self) -> "CheckpointDir":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- save ------------------------------------------------------------------

  def latest_step(self) -> int | None:
    """The newest finalized step in the directory (``None``: none)."""
    return self._manager.latest_step()

  def finished_step(self) -> int | None:
    """The newest step directory on disk with dadjax's record (``None``: none).

    Reads the directory listing only (safe from a signal handler or another
    thread, while a save writes).
    """
    try:
      steps = [int(p.name) for p in self.directory.iterdir()
               if p.name.isdigit() and _is_own_step(p)]
    except OSError:
      return None
    return max(steps, default=None)

  def settled_step(self) -> int | None:
    """:meth:`finished_step` after the writes in flight are done (for an error message)."""
    if self._manager is not None:
      try:
        self._manager.wait_until_finished()
      except Exception:  # pylint: disable=broad-except  (the next save or close reports it)
        pass
    return self.finished_step()

  def _kept_text(self) -> str:
    kept = self.finished_step()
    return (f"the last checkpoint, step {kept}, is intact" if kept is not None
            else "no checkpoint was finished")

  def save(self, step: int, state: Any, **meta: Any) -> None:
    """Save ``state`` as ``step`` if every floating leaf is finite.

    Args:
      step: the step the state is at.
      state: the pytree to save (the state that will be restored).
      **meta: JSON-serializable extras stored with it (e.g. ``wall_s``, ``row``).

    Raises:
      DivergenceError: a leaf of ``state`` holds a NaN or an infinity;
        nothing is written and the message names the leaf and the kept
        checkpoint.
      CheckpointError: the lock was deleted or replaced, or this save
        failed: no space left, a read-only or vanished directory. The save
        is synchronous, so the error is raised here, by the save that failed;
        the half-written step is removed and the message names the last
        intact step; the directory can no longer be used by this object.
    """
    checksums, nonfinite = state_digest(state)
    if nonfinite:
      kept = self._manager.latest_step()
      raise DivergenceError(
          f"training diverged: {nonfinite[0]} is not finite at step {step}"
          + (f" ({len(nonfinite)} non-finite leaves)" if len(nonfinite) > 1 else "")
          + f" (method={self.fingerprint.get('method')!r}, lr={self.fingerprint.get('lr')}); "
          + (f"it was not checkpointed; the last finite checkpoint, step {kept}, is kept"
             if kept is not None else "it was not checkpointed; no checkpoint was written"))
    record = {"format": FORMAT, "step": step, "fingerprint": self.fingerprint,
              "checksums": checksums, **meta}
    self.check_lock()
    self._saving = step
    try:
      items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(record))
      if self._pipeline is not None:  # the input pipeline's iterator state, at this step
        import grain  # pylint: disable=g-import-not-at-top
        items["data"] = grain.checkpoint.CheckpointSave(self._pipeline.checkpoint_item(step))
      with _quiet_save():
        self._manager.save(step, args=ocp.args.Composite(**items))
    except Exception as e:  # pylint: disable=broad-except
      manager, self._manager = self._manager, None
      self._failed(e, manager)

  # -- restore ---------------------------------------------------------------

  def _check_fingerprint(self, step: int, meta: dict) -> None:
    saved = meta.get("fingerprint", {})
    diff = _fingerprint_diff(saved, self.fingerprint)
    if diff:
      raise CheckpointError(
          f"checkpoint_dir {str(self.directory)!r} holds a different run (step {step}); "
          f"differing fields: {'; '.join(diff)}. To train this config, use a new "
          "checkpoint_dir, or restart=True (--restart) to delete these checkpoints and start over")

  def _verify(self, step: int, template: Any) -> Restored:
    """Restore ``step`` and check it; raises ``_Damaged`` with the reason.

    With several processes, each first reads its own part; then the
    processes exchange their verdicts, so that all of them take the same
    step or all skip it (a step one process cannot read is damaged for
    every process). A failure of that exchange, or of the checksum
    computation across processes, is a :class:`CheckpointError`, never
    taken for damage.
    """
    if jax.process_count() == 1:
      meta, state = self._read(step, template)
    else:  # first agree on the files, then read (orbax's restore is itself collective)
      _agree(self._missing_part(step), step)
      try:
        meta, state = self._read(step, template)
      except _Damaged as e:
        raise CheckpointError(
            f"process {jax.process_index()} cannot read checkpoint step {step} in "
            f"{self.directory} although its files are there ({e}); restart all processes "
            "(if it persists, move that step away)") from e
    try:
      checksums, nonfinite = state_digest(state)
    except Exception as e:  # pylint: disable=broad-except
      if jax.process_count() == 1:
        raise _Damaged(f"its checksums cannot be computed ({_first_line(e)})") from e
      raise CheckpointError(f"checkpoint step {step} in {self.directory}: the checksums across "
                            f"processes failed ({_first_line(e)}); restart all processes") from e
    if set(checksums) != set(meta["checksums"]):
      raise _Damaged("its leaves differ from the ones recorded at save time")
    for path, value in checksums.items():
      if value != meta["checksums"][path]:
        raise _Damaged(f"the checksum of {path} differs from the one recorded at save time")
    if nonfinite:
      raise _Damaged(f"{nonfinite[0]} is not finite")
    return Restored(step, state, meta, self._read_data(step))

  def _data_file(self, step: int) -> pathlib.Path:
    """This process's file of the pipeline state (as Grain's handler names it)."""
    return (self.directory / str(step) / "data"
            / f"process_{jax.process_index()}-of-{jax.process_count()}.json")

  def _read_data(self, step: int):
    """The input pipeline's iterator restored from ``step`` (``None`` without a pipeline)."""
    if self._pipeline is None:
      return None
    own = self._data_file(step)
    if not own.is_file():
      others = sorted(p.name for p in own.parent.glob("process_*-of-*.json"))
      if others:
        raise CheckpointError(
            f"checkpoint step {step} in {self.directory} holds the input pipeline state of "
            f"another number of processes ({', '.join(others)}); resume with as many processes "
            f"as wrote it, not {jax.process_count()}")
      raise _Damaged("it holds no input pipeline state (data/)")
    import grain  # pylint: disable=g-import-not-at-top
    try:
      iterator = self._manager.restore(step, args=ocp.args.Composite(
          data=grain.checkpoint.CheckpointRestore(self._pipeline.restore_item()))).data
    except Exception as e:  # pylint: disable=broad-except
      raise _Damaged(f"its input pipeline state cannot be restored ({_first_line(e)})") from e
    at = iterator.get_state().get("next_index")
    if at != step:
      iterator.close()
      raise _Damaged(f"its input pipeline state is at step {at}, not {step}")
    return iterator

  def _missing_part(self, step: int) -> "_Damaged | None":
    """What of ``step`` this process needs and cannot find (multi-process runs)."""
    path = self.directory / str(step)
    for needed in (path / "meta" / "metadata", path / "state" / "_METADATA"):
      if not needed.is_file():
        return _Damaged(f"{needed.relative_to(path)} is missing")
    if self._pipeline is not None and not self._data_file(step).is_file():
      return _Damaged(f"{self._data_file(step).relative_to(path)} is missing")
    own = path / "state" / f"ocdbt.process_{jax.process_index()}"
    if any((path / "state").glob("ocdbt.process_*")) and not (own.is_dir() and any(own.iterdir())):
      return _Damaged(f"this process's part, {own.relative_to(path)}, is missing")
    return None

  def _read(self, step: int, template: Any):
    """This process's reading of ``step``: ``(meta, state)``, or ``_Damaged``."""
    try:
      meta = self._manager.restore(step, args=ocp.args.Composite(
          meta=ocp.args.JsonRestore())).meta
    except Exception as e:  # pylint: disable=broad-except
      if not (self.directory / str(step) / "meta").exists():
        raise _Damaged("it has no dadjax record (an older format, or not written by dadjax)") from e
      raise _Damaged(f"its metadata cannot be read ({_first_line(e)})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or "checksums" not in meta:
      raise _Damaged("its metadata is not a dadjax checkpoint record")
    self._check_fingerprint(step, meta)
    try:
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(template))).state
    except Exception as e:  # pylint: disable=broad-except
      raise _Damaged(f"the state cannot be restored ({_first_line(e)})") from e
    return meta, state

  def restore(self, template: Any) -> Restored | None:
    """The newest intact checkpoint, restored into ``template``'s structure and placement.

    Damaged checkpoints (unreadable, failing their checksums) are reported,
    deleted, and the next older one is tried.

    Args:
      template: a state with the structure, shapes, dtypes and shardings to
        restore into (e.g. the freshly initialized one).

    Returns:
      A :class:`Restored`, or ``None`` if the directory holds no checkpoint.

    Raises:
      CheckpointError: a checkpoint was written by a different configuration
        (the message names the fields), or none of the checkpoints is intact.
    """
    steps = sorted(self._manager.all_steps(), reverse=True)
    foreign = _foreign_steps(self.directory)
    if foreign and not steps and not self._restarted:
      reasons = "; ".join(f"step {name}: it has no dadjax record (an older format, or not "
                          "written by dadjax)" for name in foreign)
      raise CheckpointError(
          f"no intact checkpoint in checkpoint_dir {str(self.directory)!r} ({reasons}). "
          "Use a new checkpoint_dir, or move them away: dadjax deletes only its own checkpoints")
    if foreign:
      self._say(f"{', '.join(foreign)} in {self.directory}: not dadjax checkpoints (no dadjax "
                "record, or a link); left untouched")
    damaged: list[tuple[int, str]] = []
    for step in steps:
      try:
        restored = self._verify(step, template)
      except _Damaged as e:
        damaged.append((step, str(e)))
        self._say(f"checkpoint step {step} in {self.directory} is damaged ({e}); skipped")
        continue
      for bad, _ in damaged:
        self._manager.delete(bad)
      if self._pipeline is not None:  # the pipeline continues from the restored iterator
        self._pipeline.adopt(restored.data, step)
      self._say(f"resuming from checkpoint step {step} in {self.directory}"
                + (f"; deleted the damaged step(s) {[s for s, _ in damaged]}" if damaged else ""))
      return restored
    if damaged:
      reasons = "; ".join(f"step {s}: {why}" for s, why in damaged)
      raise CheckpointError(
          f"no intact checkpoint in checkpoint_dir {str(self.directory)!r} ({reasons}). "
          "Use a new checkpoint_dir, or restart=True (--restart) to delete them and start over")
    return None


class _Damaged(Exception):
  pass


def _agree(local: _Damaged | None, step: int) -> None:
  """Every process's verdict on ``step``: raise ``_Damaged`` on all if any found damage."""
  if jax.process_count() == 1:
    if local is not None:
      raise local
    return
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  try:
    flags = np.asarray(multihost_utils.process_allgather(
        np.array([0 if local is None else 1], np.int32))).ravel()
  except Exception as e:  # pylint: disable=broad-except
    raise CheckpointError(f"the processes could not exchange their verdicts on checkpoint step "
                          f"{step} ({_first_line(e)}); restart all processes") from e
  if local is not None:
    raise _Damaged(f"{local} (process {jax.process_index()})") from local
  if flags.any():
    bad = [int(i) for i in np.flatnonzero(flags)]
    raise _Damaged(f"process(es) {bad} cannot read their part of it")


def _is_enospc(error: BaseException) -> bool:
  while error is not None:
    if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
      return True
    error = error.__cause__ or error.__context__
  return False


def _file_id(st: os.stat_result) -> tuple[int, int]:
  return st.st_dev, st.st_ino


def _first_line(e: BaseException) -> str:
  text = str(e).strip().split(" See full TensorStore details")[0].splitlines()
  return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def truncate_metrics(path: str | os.PathLike, step: int) -> None:
  """Keep only the rows of a ``metrics.jsonl`` logged at or before ``step``.

  Rows after a resumed checkpoint would otherwise appear twice; a row cut
  short by a killed process is dropped too. A missing file is left missing.
  """
  path = pathlib.Path(path)
  if not path.exists():
    return
  kept = []
  for line in path.read_text().splitlines():
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
      kept.append(line)
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text("".join(line + "\n" for line in kept))
  os.replace(tmp, path)
