"""Stopping a run on SIGTERM / SIGINT at a step boundary, with a checkpoint.

Schedulers end jobs with SIGTERM (SLURM, Kubernetes, cloud and TPU
preemption) and then, after a grace period, SIGKILL; a user presses Ctrl-C
(SIGINT). :class:`StopOnSignal` turns the first of these signals into a
request the training loop sees after the current step: it saves that step,
waits for the checkpoint writes, releases the lock and raises
:class:`dadjax.errors.Stopped` (exit code ``128 + signal``: 143 for SIGTERM,
130 for SIGINT). A second signal, or a stop that takes longer than the grace
time, ends the process at once (the last finished checkpoint stays intact).

With several processes, JAX's preemption service owns SIGTERM (it is
installed by ``jax.distributed.initialize`` and tells every process); the
loop asks :func:`jax.experimental.multihost_utils.reached_preemption_sync_point`
after each step, so that every process stops at, and saves, the same step.
That step, JAX's sync point, is chosen by the processes through the
coordination service after the signal: one past the furthest step any of
them has reached by then, typically 1-3 s after the signal. A sync point
that would fall after the last step is never reached, so after the last
step the processes agree once more (:meth:`StopOnSignal.stop_at_end`): if any
of them received a signal (JAX's preemption notice, or SIGINT), every one
stops there, with that last step saved, and exits ``128 + signal`` like any
other stop; a signal is never absorbed into a normal exit.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# The key under which JAX's preemption notifier records a notice in the coordination
# service (XLA's preemption_notifier); read once, after the last step.
_NOTICE_KEY = "RECEIVED_PREEMPTION_NOTICE"
_END_PREFIX = "dadjax/stop_at_end"
_END_TIMEOUT_MS = 3_600_000  # a slow peer still writing its last checkpoint is waited for;
# a lost one ends the run through the peer watch (dadjax/_peers.py) long before this


def _say(message: str) -> None:
  print(f"dadjax: {message}", file=sys.stderr, flush=True)


def exit_code(signum: int) -> int:
  """The shell's convention for a process ended by a signal: ``128 + signum``."""
  return 128 + int(signum)


class StopOnSignal:
  """Install SIGTERM / SIGINT handlers that request a stop (a context manager).

  Args:
    grace_s: after the first signal, end the process (``os._exit(128 +
      signum)``) if the stop has not finished within this many seconds.
    enabled: ``False`` leaves the handlers as they are (signals act as usual).
    multi_process: with several processes SIGTERM is left to JAX's
      preemption service (:meth:`stop_at` asks it) and SIGINT is forwarded to
      it as a SIGTERM, so that every process stops at the same step.
    last_checkpoint: called for the message of an immediate stop (the
      newest finished checkpoint step, or ``None``).

  Outside the main thread (where Python cannot install handlers) it does
  nothing.
  """

  _runs = 0  # train() calls so far (the same sequence in every process)

  def __init__(self, grace_s: float, *, enabled: bool = True, multi_process: bool = False,
               last_checkpoint: Callable[[], int | None] = lambda: None):
    StopOnSignal._runs += 1
    self._run = StopOnSignal._runs
    self.grace_s = grace_s
    self.enabled = enabled
    self.multi_process = multi_process
    self.last_checkpoint = last_checkpoint
    self.signum: int | None = None
    self.step = 0  # the last step the loop ran (set by the loop and by stop_at)
    self._previous: dict[int, object] = {}
    self._timer: threading.Timer | None = None

  @property
  def name(self) -> str:
    return signal.Signals(self.signum).name if self.signum else "signal"

  def __enter__(self) -> "StopOnSignal":
    if self.enabled and threading.current_thread() is threading.main_thread():
      for signum in SIGNALS:
        if signum == signal.SIGTERM and self.multi_process:
          continue  # JAX's preemption notifier handles it
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    self._previous.clear()
    if self._timer is not None:
      self._timer.cancel()
      self._timer = None

  def _handle(self, signum, frame) -> None:
    del frame
    if self.multi_process and signum != signal.SIGTERM:
      if self.signum is None:
        self.signum = signum
        self._start_timer(signum)
        os.kill(os.getpid(), signal.SIGTERM)  # the preemption service tells every process
        return
    if self.signum is not None:
      self._abort(signum, f"second {signal.Signals(signum).name}: stopping at once")
    self.signum = signum
    self._start_timer(signum)
    _say(f"{signal.Signals(signum).name} received: stopping after the current step "
         f"(again to stop at once)")

  def _start_timer(self, signum: int) -> None:
    self._timer = threading.Timer(
        self.grace_s, self._abort,
        (signum, f"the stop after {signal.Signals(signum).name} took longer than "
                 f"signal_grace_s={self.grace_s:g}"))
    self._timer.daemon = True
    self._timer.start()

  def _abort(self, signum: int, why: str) -> None:
    try:
      kept = self.last_checkpoint()
    except Exception:  # pylint: disable=broad-except
      kept = None
    _say(f"{why}, without a new checkpoint; "
         + (f"the last checkpoint, step {kept}, is intact" if kept is not None
            else "no checkpoint was finished"))
    os._exit(exit_code(signum))  # pylint: disable=protected-access

  def stop_at(self, step: int) -> bool:
    """Whether the loop should stop after ``step`` (called once per step)."""
    self.step = step
    if self.multi_process and self.enabled:
      from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
      try:
        if multihost_utils.reached_preemption_sync_point(step):
          self.signum = self.signum or signal.SIGTERM
          return True
      except RuntimeError:  # the preemption service is disabled
        pass
      return False
    return self.signum is not None

  def stop_at_end(self, step: int) -> bool:
    """After the last step: whether a signal came that the run did not stop for yet.

    With one process, whether a signal arrived during the last step. With
    several, every process says whether it received one (JAX's preemption
    notice in the coordination service, or its own SIGINT), they meet at a
    barrier and all read the same answers: every process stops, or none.
    """
    self.step = step
    if not self.enabled:
      return False
    if not self.multi_process:
      return self.signum is not None
    from jax._src import distributed  # pylint: disable=g-import-not-at-top
    client = distributed.global_state.client
    if client is None:
      return self.signum is not None
    import jax  # pylint: disable=g-import-not-at-top
    mine = self.signum is not None or _has_key(client, _NOTICE_KEY)
    prefix = f"{_END_PREFIX}/{self._run}"
    client.key_value_set(f"{prefix}/{jax.process_index()}", "1" if mine else "0",
                         allow_overwrite=True)
    client.wait_at_barrier(prefix, _END_TIMEOUT_MS)
    stop = any(client.blocking_key_value_get(f"{prefix}/{p}", _END_TIMEOUT_MS) == "1"
               for p in range(jax.process_count()))
    if stop:
      self.signum = self.signum or signal.SIGTERM
    return stop


def _has_key(client, key: str) -> bool:
  try:
    return client.key_value_try_get(key) is not None
  except Exception:  # pylint: disable=broad-except  (NOT_FOUND: no notice)
    return False
