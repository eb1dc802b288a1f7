"""What checkpoints need of orbax that orbax offers no public route for, in one place.

A save that fails in the background (no space left, a read-only or vanished
directory) must end the run with one line and let the process exit
(:meth:`~dadjax.run.CheckpointDir.save`). Two of orbax's internals stand in
the way, and nothing public reaches them:

- **Writer threads that wait for ever.** orbax runs each part of an
  asynchronous save in a (non-daemon) ``_SignalingThread`` that waits for a
  signal from the part before it; when that part fails, the others wait for
  the coordination timeout (minutes) and keep the process from exiting.
  :func:`stop_writer_threads` cancels and wakes them.
- **Event loops closed over pending writes.** orbax runs each synchronous part
  of a save in a fresh event loop (``asyncio_utils._run_sync_via_new_loop``:
  ``run_until_complete``, then ``close``). When one TensorStore write fails,
  the gathering coroutine raises at once and the loop is closed while the
  other writes' tasks still await their TensorStore futures; each of those
  later completes on a TensorStore thread whose callback posts to the closed
  loop and prints "Exception ignored ... Event loop is closed" (and "Task was
  destroyed but it is pending"). :func:`settle_failed_loops` replaces that
  function with one that, when its coroutine raised, first runs the loop until
  those tasks are done (at most 30 s, then cancels them), then closes it; a
  success is untouched.

Nothing here runs on import: :class:`~dadjax.run.CheckpointDir` applies
:func:`settle_failed_loops` when it is created and calls
:func:`stop_writer_threads` after a failed save. Where this orbax lacks an
internal both do nothing (a failed save may then print orbax's own report, or
wait for its timeout); :func:`check` raises :class:`OrbaxInternalsMoved`
naming the orbax version and the missing attribute, and the test suite calls
it, so an orbax release that moves them fails loudly there.
"""

from __future__ import annotations

import asyncio
import importlib
import threading

__all__ = ["OrbaxInternalsMoved", "check", "missing", "settle_failed_loops",
           "stop_writer_threads"]

_LOOP_MODULE, _LOOP_FN = "orbax.checkpoint._src.asyncio_utils", "_run_sync_via_new_loop"
_FUTURE_MODULE = "orbax.checkpoint._src.futures.future"
# The writer thread's class, the function that wakes its waiters, and what each thread holds.
_THREAD_CLASS, _SET_SIGNALS = "_SignalingThread", "set_signals"
_THREAD_FIELDS = ("_cancelled", "_receive_signals", "_operation_id")


class OrbaxInternalsMoved(RuntimeError):
  """The installed orbax lacks an internal that :mod:`dadjax.run._orbax_internals` uses."""


def _version() -> str:
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
    return str(getattr(ocp, "__version__", "unknown"))
  except ImportError:
    return "not installed"


def _attr(module: str, name: str):
  try:
    return getattr(importlib.import_module(module), name, None)
  except ImportError:
    return None


def missing() -> list[str]:
  """The internals this orbax lacks, as ``module.attribute`` (empty: all present)."""
  gone = [f"{m}.{n}" for m, n in ((_LOOP_MODULE, _LOOP_FN), (_FUTURE_MODULE, _THREAD_CLASS),
                                  (_FUTURE_MODULE, _SET_SIGNALS)) if _attr(m, n) is None]
  thread_class = _attr(_FUTURE_MODULE, _THREAD_CLASS)
  if thread_class is not None:
    try:  # an unstarted thread: what its constructor sets
      probe = thread_class(target=lambda: None, send_signals=[], receive_signals=[],
                           timeout_secs=1)
      gone += [f"{_FUTURE_MODULE}.{_THREAD_CLASS}().{f}" for f in _THREAD_FIELDS
               if not hasattr(probe, f)]
    except Exception as e:  # pylint: disable=broad-except
      gone.append(f"{_FUTURE_MODULE}.{_THREAD_CLASS}(...) ({type(e).__name__}: {e})")
  return gone


def check() -> None:
  """Raise :class:`OrbaxInternalsMoved` unless every internal used here is present."""
  gone = missing()
  if gone:
    raise OrbaxInternalsMoved(
        f"orbax-checkpoint {_version()} lacks {', '.join(gone)}, which "
        "dadjax.run._orbax_internals uses to end a failed background save with one line; "
        "adapt that module to this orbax (a failed save may otherwise print orbax's report or "
        "wait for its timeout)")


def stop_writer_threads(timeout_s: float = 5.0) -> list[str]:
  """Cancel and wake orbax's writer threads that wait for a failed save's signals.

  Each cancelled thread's never-run coroutine is released here (so that the
  caller's warning filters see its "never awaited" report).

  Returns:
    The names of the threads still alive after ``timeout_s``.
  """
  thread_class = _attr(_FUTURE_MODULE, _THREAD_CLASS)
  set_signals = _attr(_FUTURE_MODULE, _SET_SIGNALS)
  if thread_class is None or set_signals is None:
    return []
  # pylint: disable=protected-access
  threads = [t for t in threading.enumerate() if isinstance(t, thread_class) and t.is_alive()]
  for t in threads:
    try:
      t._cancelled = True  # cancel() needs a live loop
      set_signals(t._receive_signals, operation_id=t._operation_id)
    except Exception:  # pylint: disable=broad-except
      pass
  for t in threads:
    threading.Thread.join(t, timeout_s / max(1, len(threads)))  # orbax's join re-raises
  for t in threads:
    if not t.is_alive():
      t._target = None  # what Thread.run drops when it runs: here it never ran
  return [t.name for t in threads if t.is_alive()]


def _settle(loop, timeout_s: float = 30.0) -> None:
  """Run ``loop`` until the tasks still pending on it are done (at most ``timeout_s``, then
  cancel the rest), and read their exceptions so that none is reported as unread."""
  pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
  if pending:
    loop.run_until_complete(asyncio.wait(pending, timeout=timeout_s))
    rest = [t for t in pending if not t.done()]
    for t in rest:
      t.cancel()
    if rest:
      loop.run_until_complete(asyncio.wait(rest, timeout=1.0))
  for t in pending:
    if t.done() and not t.cancelled():
      t.exception()


def settle_failed_loops() -> bool:
  """Have orbax's fresh event loops settle their pending writes before closing on an error.

  Idempotent. Returns whether it is in place (``False``: this orbax has no
  such function).
  """
  try:
    module = importlib.import_module(_LOOP_MODULE)
  except ImportError:
    return False
  original = getattr(module, _LOOP_FN, None)
  if original is None:
    return False
  if getattr(original, "_dadjax_settles", False):
    return True

  def run(coro):
    loop = asyncio.new_event_loop()
    try:
      asyncio.set_event_loop(loop)
      try:
        return loop.run_until_complete(coro)
      except BaseException:
        _settle(loop)
        raise
    finally:
      asyncio.set_event_loop(None)
      loop.close()

  run._dadjax_settles = True  # pylint: disable=protected-access
  run.__doc__ = original.__doc__
  setattr(module, _LOOP_FN, run)
  return True
