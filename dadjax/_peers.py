"""Noticing a lost process in a multi-process run, within a bounded time.

When one process of a run dies (killed, out of memory, its host lost), the
others block in the next collective. JAX's own coordination service notices
only after its heartbeat timeout (``heartbeat_timeout_seconds`` of
``jax.distributed.initialize``, 100 s by default) and then aborts every
process with a generic message. :class:`PeerWatch` notices first: each
process publishes a counter in the coordination service's key-value store
every ``peer_timeout_s / 10`` seconds (from a thread, so a process blocked in
a collective still counts as alive), and watches the others'. A peer whose
counter has not moved for ``peer_timeout_s`` seconds (default 20), or a
coordination service that no longer answers (process 0 is gone), ends this
process with::

  dadjax: error: process K stopped responding at step N (no sign of life for
  20 s); the last checkpoint is step M; restart all processes to resume

and exit code 2. A process that finished its run marks itself done and is
not waited for.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable

_PREFIX = "dadjax/peer_watch"


def _client():
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


class PeerWatch:
  """Watch the run's other processes (a context manager; a no-op with one process).

  Args:
    timeout_s: a peer silent for this long is lost.
    step: the step this process is at (for the message).
    last_checkpoint: the newest finished checkpoint step, or ``None``.
  """

  _runs = 0  # train() calls so far (the same sequence in every process)

  def __init__(self, timeout_s: float, step: Callable[[], int],
               last_checkpoint: Callable[[], int | None]):
    import jax  # pylint: disable=g-import-not-at-top
    PeerWatch._runs += 1
    self.timeout_s = timeout_s
    self.step = step
    self.last_checkpoint = last_checkpoint
    self.process = jax.process_index()
    self.processes = jax.process_count()
    self.client = _client() if self.processes > 1 else None
    self.prefix = f"{_PREFIX}/{PeerWatch._runs}"
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def __enter__(self) -> "PeerWatch":
    if self.client is not None:
      self._thread = threading.Thread(target=self._run, name="dadjax_peer_watch", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, exc_type, *exc) -> None:
    self._stop.set()
    if self._thread is not None:
      self._thread.join(2)
      if exc_type is None:
        try:
          self.client.key_value_set(f"{self.prefix}/{self.process}", "done", allow_overwrite=True)
        except Exception:  # pylint: disable=broad-except
          pass

  def _run(self) -> None:
    period = max(0.05, self.timeout_s / 10)
    beat = 0
    seen: dict[int, tuple[str | None, float]] = {}
    started = time.monotonic()
    while not self._stop.wait(period if beat else 0):
      beat += 1
      now = time.monotonic()
      try:
        self.client.key_value_set(f"{self.prefix}/{self.process}", str(beat),
                                  allow_overwrite=True)
      except Exception as e:  # pylint: disable=broad-except
        text = str(e).strip()
        self._lost(0, "the coordination service of process 0 does not answer: "
                      + (text.splitlines()[0][:120] if text else type(e).__name__))
      for peer in range(self.processes):
        if peer == self.process:
          continue
        try:
          value = self.client.key_value_try_get(f"{self.prefix}/{peer}")
        except Exception:  # pylint: disable=broad-except  (not set yet)
          value = None
        if value == "done":
          seen[peer] = (value, now)
          continue
        last_value, since = seen.get(peer, (None, started))
        if value != last_value:
          seen[peer] = (value, now)
        elif now - since > self.timeout_s and last_value != "done":
          self._lost(peer, f"no sign of life for {self.timeout_s:g} s")

  def _lost(self, peer: int, why: str) -> None:
    if self._stop.is_set():
      return
    try:
      kept = self.last_checkpoint()
    except Exception:  # pylint: disable=broad-except
      kept = None
    print(f"dadjax: error: process {peer} stopped responding at step {self.step()} ({why}); "
          + (f"the last checkpoint is step {kept}" if kept is not None
             else "no checkpoint was finished")
          + "; restart all processes to resume", file=sys.stderr, flush=True)
    os._exit(2)  # pylint: disable=protected-access  (the main thread is stuck in a collective)
