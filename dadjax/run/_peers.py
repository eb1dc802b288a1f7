"""Noticing a lost or failed process in a multi-process run, within a bounded time.

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

A process whose run ends with an error (any exception but a signal's
:class:`~dadjax.errors.Stopped`) publishes ``failed STEP ERROR`` instead, and
the others end at their next look (within ``peer_timeout_s / 10``), not after
``peer_timeout_s``, with::

  dadjax: error: process K failed at step N: RuntimeError: <the first line of
  its error>; the last checkpoint is step M; restart all processes to resume

(exit code 2). The order of leaving is arranged so that every process says
what it has to say before JAX tears it down (JAX aborts a process at once
when the coordination service, hosted by process 0, goes away): the failed
process lets its error propagate (the caller prints it) and, at interpreter
exit, publishes ``exited`` and waits until every peer has read its error;
each peer waits for ``exited`` (at most ``3 * period + 1`` s), prints its
line, acknowledges and leaves; process 0 leaves last. The failed process then
leaves without JAX's shutdown barrier, which its peers never reach: exit code
1 when the error was not caught (Python's code), else 2 (the command line's
code for a dadjax error).

A collective that fails because a peer is gone (gloo's "Connection closed by
peer" / "Connection reset by peer", a coordination-service RPC that cannot be
sent: :func:`is_transport_error`) is that peer's loss, not this process's
error: :meth:`PeerWatch.confirm` holds the failing thread until the watch has
found which process stopped (within ``peer_timeout_s`` plus two looks) and
ended this one with the line above. Only when every peer is still alive after
that does the error propagate as itself.

Under ``dadjax train``'s supervisor (see :mod:`dadjax.cli`) the watch also
writes ``STEP LAST_CHECKPOINT`` lines to the file descriptor named by
``DADJAX_STATUS_FD``, so that the supervisor can name the step when JAX
aborts this process (the coordination service of process 0 is gone).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Callable

_PREFIX = "dadjax/peer_watch"
STATUS_FD_ENV = "DADJAX_STATUS_FD"  # set by the supervisor of ``dadjax train``

# What a collective or coordination call says when the other end is gone (gloo's TCP pairs,
# gRPC to the coordination service, MPI); matched case-insensitively in the error's chain.
_TRANSPORT_MARKERS = ("gloo", "connection closed", "connection reset", "reset by peer",
                      "broken pipe", "socket closed", "connection refused",
                      "failed to send rpc to coordination service", "coordination service",
                      "unavailable:", "deadline_exceeded", "barrier timed out", "mpi_")


def is_transport_error(exc: BaseException) -> bool:
  """Whether ``exc`` (or an error in its chain) is a failed exchange with another process.

  A ``jax.errors.JaxRuntimeError`` (or an error raised from one) whose text
  names the transport: gloo, a closed or reset connection, the coordination
  service. A bug in this process (a shape error, a full disk) is not one.
  """
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    runtime = type(exc).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
    text = str(exc).lower()
    if runtime and any(m in text for m in _TRANSPORT_MARKERS):
      return True
    exc = exc.__cause__ or exc.__context__
  return False


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
    self._status_fd = _status_fd() if self.client is not None else None

  def __enter__(self) -> "PeerWatch":
    if self.client is not None:
      self._thread = threading.Thread(target=self._run, name="dadjax_peer_watch", daemon=True)
      self._thread.start()
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    self._stop.set()
    if self._thread is None:
      return
    self._thread.join(2)
    from dadjax.errors import Stopped  # pylint: disable=g-import-not-at-top
    if exc_type is None:
      self._publish(self.process, "done")
    elif issubclass(exc_type, Exception) and not issubclass(exc_type, Stopped):
      self._publish(self.process, f"failed {self.step()} {one_line(exc)}")
      atexit.register(self._exiting, exc)  # runs before JAX's exit handler (registered earlier)

  def confirm(self, error: BaseException) -> None:
    """Hold this thread while the watch finds the peer a failed exchange (``error``) lost.

    A transport error (:func:`is_transport_error`) in a multi-process run
    waits until the watch ends the process (``process K stopped responding``
    or ``process K failed``, exit code 2): at most ``timeout_s`` plus two
    looks. It returns (the caller re-raises ``error``) for any other error,
    with one process, or when every peer is still alive after that time.
    """
    if self._thread is None or not self._thread.is_alive() or not is_transport_error(error):
      return
    self._thread.join(self.timeout_s + 2 * self.period + 1)  # it ends the process with os._exit

  @property
  def period(self) -> float:
    """Seconds between two beats (and two looks at the peers)."""
    return max(0.05, self.timeout_s / 10)

  def _key(self, *parts) -> str:
    return "/".join([self.prefix, *map(str, parts)])

  def _publish(self, *key_and_value) -> None:
    *key, value = key_and_value
    try:
      self.client.key_value_set(self._key(*key), value, allow_overwrite=True)
    except Exception:  # pylint: disable=broad-except  (the service is gone: nobody to tell)
      pass

  def _get(self, *key) -> str | None:
    try:
      return self.client.key_value_try_get(self._key(*key))
    except Exception:  # pylint: disable=broad-except  (not set, or the service is gone)
      return None

  def _wait(self, ready: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not ready() and time.monotonic() < deadline:
      time.sleep(0.02)

  def _peers(self) -> list[int]:
    return [p for p in range(self.processes) if p != self.process]

  def _leave(self, code: int, without: tuple[int, ...] = ()) -> None:
    """Publish ``left``; process 0 (the coordination service) first waits (at most 2 s)
    for every other peer but ``without`` to have left."""
    for stream in (sys.stdout, sys.stderr):
      try:
        stream.flush()
      except Exception:  # pylint: disable=broad-except
        pass
    self._publish("left", self.process, "1")
    if self.process == 0:
      rest = [p for p in self._peers() if p not in without]
      self._wait(lambda: all(self._get("left", p) is not None for p in rest), 2)
    os._exit(code)  # pylint: disable=protected-access

  def _exiting(self, error: BaseException) -> None:
    """At exit after a failure (its error printed): say so, wait (at most ``3 * period + 1``
    s) until every peer has read it or has ended itself, and leave (see the module doc)."""
    self._publish("exited", self.process, "1")

    def read(peer):
      state = self._get(peer)
      return (self._get("read", peer, self.process) is not None or state == "done"
              or str(state).startswith("failed "))

    self._wait(lambda: all(read(p) for p in self._peers()), 3 * self.period + 1)
    self._leave(1 if getattr(sys, "last_value", None) is error else 2)

  def _run(self) -> None:
    period = self.period
    beat = 0
    seen: dict[int, tuple[str | None, float]] = {}
    started = time.monotonic()
    said = None
    while not self._stop.wait(period if beat else 0):
      beat += 1
      now = time.monotonic()
      if self._status_fd is not None and self.step() != said:
        said = self.step()
        self._tell_supervisor(said)
      try:
        self.client.key_value_set(self._key(self.process), str(beat), allow_overwrite=True)
      except Exception as e:  # pylint: disable=broad-except
        text = str(e).strip()
        self._lost(0, "the coordination service of process 0 does not answer: "
                      + (text.splitlines()[0][:120] if text else type(e).__name__))
      for peer in self._peers():
        value = self._get(peer)
        if value == "done":
          seen[peer] = (value, now)
          continue
        if value is not None and value.startswith("failed "):
          self._failed(peer, value)
        last_value, since = seen.get(peer, (None, started))
        if value != last_value:
          seen[peer] = (value, now)
        elif now - since > self.timeout_s and last_value != "done":
          self._lost(peer, f"no sign of life for {self.timeout_s:g} s")

  def _tell_supervisor(self, step: int) -> None:
    """``STEP LAST_CHECKPOINT`` (``-`` for none) to the supervisor's status pipe."""
    try:
      kept = self.last_checkpoint()
    except Exception:  # pylint: disable=broad-except
      kept = None
    try:
      os.write(self._status_fd, f"{step} {'-' if kept is None else kept}\n".encode())
    except OSError:  # the supervisor is gone, or not reading: it is only for its message
      self._status_fd = None

  def _failed(self, peer: int, value: str) -> None:
    """``peer`` published ``failed STEP ERROR``: wait until it printed its error, then end."""
    if self._stop.is_set():
      return
    _, step, error = value.split(" ", 2)
    self._wait(lambda: self._get("exited", peer) is not None, 3 * self.period + 1)
    self._end(f"process {peer} failed at step {step}: {error}",
              then=lambda: self._publish("read", self.process, peer, "1"))

  def _lost(self, peer: int, why: str) -> None:
    self._end(f"process {peer} stopped responding at step {self.step()} ({why})",
              without=(peer,))

  def _end(self, what: str, then: Callable[[], None] = lambda: None,
           without: tuple[int, ...] = ()) -> None:
    if self._stop.is_set():
      return
    try:
      kept = self.last_checkpoint()
    except Exception:  # pylint: disable=broad-except
      kept = None
    print(f"dadjax: error: {what}; "
          + (f"the last checkpoint is step {kept}" if kept is not None
             else "no checkpoint was finished")
          + "; restart all processes to resume", file=sys.stderr, flush=True)
    then()
    self._leave(2, without)  # the main thread is stuck in a collective


def _status_fd() -> int | None:
  """The supervisor's status pipe (non-blocking), or ``None`` without a supervisor."""
  value = os.environ.get(STATUS_FD_ENV, "")
  if not value.isdigit():
    return None
  fd = int(value)
  try:
    os.set_blocking(fd, False)
  except OSError:
    return None
  return fd


def one_line(exc: BaseException, limit: int = 300) -> str:
  """``TypeName: first line of the message`` (at most ``limit`` characters)."""
  text = str(exc).strip()
  line = f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__
  return line if len(line) <= limit else line[:limit - 3] + "..."
