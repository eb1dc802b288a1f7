"""The lighthouse: the small service that forms a quorum of sites at each outer synchronization.

JAX's multi-process runtime fixes its process set when it starts
(``experiments/results/elastic_runtime.md``: a restarted or an extra process
cannot join, a lost one ends every collective), so sites that come and go
are separate JAX programs, one per site, and their outer synchronization
goes through this service instead of a JAX collective, as torchft's
Lighthouse forms quorums over process groups.

One round per outer step. Each live site sends its pseudo-gradient and a
weight (the examples it trained on since the last round). The round closes
when every member has sent, or ``quorum_timeout_s`` after its first
contribution: the sites that sent are the quorum, the others are dropped,
and every sender gets back the weighted mean over the quorum. A site that
joins (a restart, or a site never seen) waits until a round closes; the
lowest-numbered site of that quorum (the donor) then sends its whole state
(anchor, outer and inner optimizer state), which the lighthouse relays, and
the joiner is a member from the next round on. The lighthouse keeps no model
state of its own: a joiner's state always comes from a live site, or, when
no site is live, from the joiner's own checkpoint.

The mean is a star exchange (every site sends its payload to the lighthouse
and receives the mean), accumulated in float64. A compressed payload (a
dadjax compressor's codes) is gathered instead: every site receives the
quorum's payloads and weights and decodes them itself.
"""

from __future__ import annotations

import dataclasses
import socketserver
import threading
import time
import numpy as np

from dadjax.elastic._wire import WireError, recv, send


@dataclasses.dataclass
class _Round:
  """The round being formed: who sent what."""
  index: int
  arrivals: dict[int, tuple[float, list[np.ndarray]]] = dataclasses.field(default_factory=dict)
  first_at: float | None = None
  gather: bool | None = None  # set by the first contribution: every site's, or the mean


@dataclasses.dataclass
class _Closed:
  """A closed round's outcome, kept until its senders have read it."""
  index: int
  quorum: list[int]
  dropped: list[int]
  mean: list[np.ndarray]  # the weighted mean; in a gathering round, every payload in order
  weights: list[float]
  donor: int | None
  joiners: list[int]


class Lighthouse:
  """The quorum service of an elastic run, in a thread of the process that starts it.

  Args:
    host: the address to listen on (default ``"127.0.0.1"``).
    port: the port (default 0: a free one; read :attr:`address`).
    expected_sites: sites the first round waits for (int >= 1, default 1):
      the run's starting size. Later rounds wait for the current members.
    quorum_timeout_s: seconds a round waits after its first contribution
      for the remaining members before it drops them (float > 0, default
      10). Keep it above the spread of the sites' interval times.
    start_timeout_s: the same for the first round, which also waits for the
      sites to start (float > 0, default 120).
    join_timeout_s: seconds a joiner waits for a donor's state before it
      gets an error (float > 0, default 300).

  Use as a context manager, or :meth:`start` / :meth:`close`.
  ``python -m dadjax.elastic --port 5555 --expected-sites 4`` runs one on its own.

  Raises:
    ValueError: an argument outside its range.
  """

  def __init__(self, host: str = "127.0.0.1", port: int = 0, *, expected_sites: int = 1,
               quorum_timeout_s: float = 10.0, start_timeout_s: float = 120.0,
               join_timeout_s: float = 300.0):
    if not (isinstance(expected_sites, int) and expected_sites >= 1):
      raise ValueError(f"expected_sites must be an int >= 1, got {expected_sites!r}")
    for name, value in (("quorum_timeout_s", quorum_timeout_s),
                        ("start_timeout_s", start_timeout_s), ("join_timeout_s", join_timeout_s)):
      if not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    self.expected_sites = expected_sites
    self.quorum_timeout_s = float(quorum_timeout_s)
    self.start_timeout_s = float(start_timeout_s)
    self.join_timeout_s = float(join_timeout_s)
    self._cond = threading.Condition()
    self._members: set[int] = set()
    self._round = _Round(0)
    self._closed: dict[int, _Closed] = {}  # the last two rounds' outcomes, by index
    # a run forms (at its start, or when every site was lost and one starts alone) until its
    # first round closes: a site whose own state is of the forming round starts from it
    self._forming = True
    self._joiners: dict[int, int] = {}  # site -> the round it could start at alone
    self._alone: set[int] = set()  # joiners told to start from their own state
    self._last_heard = time.monotonic()
    self._interval_s = self.quorum_timeout_s  # the last time between two rounds' closes
    self._closed_at: float | None = None
    self._relayed: dict[int, tuple[dict, list[np.ndarray]]] = {}
    self.events: list[str] = []  # one line per quorum change, as the sites print them
    handler = type("Handler", (_Handler,), {"lighthouse": self})
    self._server = socketserver.ThreadingTCPServer((host, port), handler, bind_and_activate=True)
    self._server.daemon_threads = True
    self._thread: threading.Thread | None = None

  @property
  def address(self) -> str:
    """``"host:port"`` the sites connect to."""
    host, port = self._server.server_address[:2]
    return f"{host}:{port}"

  def start(self) -> "Lighthouse":
    self._thread = threading.Thread(target=self._server.serve_forever, name="dadjax-lighthouse",
                                    daemon=True)
    self._thread.start()
    return self

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()

  def __enter__(self) -> "Lighthouse":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.close()

  @property
  def members(self) -> list[int]:
    with self._cond:
      return sorted(self._members)

  # -- requests (each runs on the handler thread of its connection) --------------------------

  def join(self, site: int, alone_round: int) -> tuple[dict, list[np.ndarray]]:
    """A site starts or restarts. ``alone_round``: the round it would start at with no peer (0,
    or its checkpoint's)."""
    with self._cond:
      if site in self._members:  # a new incarnation of a site not yet dropped
        self._members.discard(site)
        self._round.arrivals.pop(site, None)
        self._note(f"site {site} restarted: it rejoins")
      if self._forming and alone_round == self._round.index:
        self._members.add(site)  # the same state as every other site's: the same init or round
        self._heard()
        return {"start": "own", "round": alone_round}, []
      self._joiners[site] = alone_round
      self._heard()
      deadline = time.monotonic() + self.join_timeout_s
      while True:
        if site in self._relayed:
          header, arrays = self._relayed.pop(site)
          self._note(f"site {site} joined at round {header['round']} with site "
                     f"{header['donor']}'s state")
          return dict(header, start="peer"), arrays
        if site in self._alone:
          self._alone.discard(site)
          return {"start": "alone", "round": self._round.index}, []
        if self._forming and self._members and alone_round == self._round.index:
          del self._joiners[site]  # the run re-forms at the round of this site's own state
          self._members.add(site)
          self._heard()
          return {"start": "own", "round": alone_round}, []
        if not self._members or self._members_silent():
          self._start_from_a_joiner()
          continue
        left = deadline - time.monotonic()
        if left <= 0:
          self._joiners.pop(site, None)
          return {"error": f"no live site sent its state within join_timeout_s = "
                           f"{self.join_timeout_s:g} s"}, []
        self._cond.wait(timeout=min(left, 0.25))

  def _members_silent(self) -> bool:
    """No member has been heard from for longer than a round can take: they are all gone."""
    silence = self.quorum_timeout_s + 2 * self._interval_s
    return not self._round.arrivals and time.monotonic() - self._last_heard > silence

  def _start_from_a_joiner(self) -> None:
    """No live member: the joiner with the newest state (its checkpoint's round) starts alone;
    the others join from it at its first round."""
    if self._members:
      self._note(f"sites {sorted(self._members)} dropped (nothing heard for "
                 f"{time.monotonic() - self._last_heard:.0f} s)")
    site, index = max(self._joiners.items(), key=lambda kv: (kv[1], -kv[0]))
    del self._joiners[site]
    self._members = {site}
    self._round = _Round(index)
    self._alone.add(site)
    self._forming = True
    self._note(f"site {site} starts alone at round {index} (no live site)")
    self._heard()

  def _heard(self) -> None:
    self._last_heard = time.monotonic()
    self._cond.notify_all()

  def sync(self, site: int, index: int, weight: float, arrays: list[np.ndarray],
           gather: bool = False) -> tuple[dict, list[np.ndarray]]:
    """A member's contribution to round ``index``; returns that round's outcome: the weighted
    mean of the quorum's arrays, or with ``gather`` (a compressed payload, which only the
    sites can decode) every quorum member's arrays in site order and their weights."""
    if not (np.isfinite(weight) and weight > 0):
      return {"error": f"weight must be a finite number > 0, got {weight!r}"}, []
    with self._cond:
      if site not in self._members or index != self._round.index:
        return {"status": "dropped", "round": self._round.index}, []
      current = self._round
      if current.gather is None:
        current.gather = bool(gather)
      if current.gather != bool(gather):
        return {"error": f"site {site} sends {'a compressed' if gather else 'a mean'} payload "
                         f"to a round whose first site sent "
                         f"{'a compressed' if current.gather else 'a mean'} one"}, []
      if current.arrivals:
        _, first = next(iter(current.arrivals.values()))
        shapes = [(a.shape, a.dtype.name) for a in arrays]
        if shapes != [(a.shape, a.dtype.name) for a in first]:
          return {"error": f"site {site}'s pseudo-gradient has leaves {shapes}, the round's "
                           f"{[(a.shape, a.dtype.name) for a in first]}"}, []
      current.arrivals[site] = (float(weight), arrays)
      if current.first_at is None:
        current.first_at = time.monotonic()
      self._heard()
      wait_s = self.start_timeout_s if self._forming else self.quorum_timeout_s
      while self._round is current:
        everyone = set(current.arrivals) >= self._members and (
            not self._forming or len(current.arrivals) >= self.expected_sites)
        left = current.first_at + wait_s - time.monotonic()
        if everyone or left <= 0:
          self._close(current)
          break
        self._cond.wait(timeout=left)
      closed = self._closed.get(index)
      if closed is None or site not in closed.quorum:
        return {"status": "dropped", "round": self._round.index}, []
      reply = {"status": "ok", "round": index, "quorum": closed.quorum,
               "dropped": closed.dropped, "donor": closed.donor == site,
               "joiners": closed.joiners}
      if current.gather:
        reply["weights"] = closed.weights
      return reply, closed.mean

  def relay(self, site: int, header: dict, arrays: list[np.ndarray]) -> dict:
    """The donor's state after round ``header['round'] - 1``, for every waiting joiner."""
    with self._cond:
      if header["round"] != self._round.index or site not in self._members:
        return {"status": "stale"}
      for joiner in self._joiners:
        self._relayed[joiner] = ({"round": header["round"], "step": header["step"],
                                  "donor": site}, arrays)
        self._members.add(joiner)
      self._joiners.clear()
      self._heard()
      return {"status": "ok"}

  def leave(self, site: int) -> dict:
    """A site that has finished its steps: later rounds do not wait for it."""
    with self._cond:
      self._members.discard(site)
      self._round.arrivals.pop(site, None)
      self._heard()
      return {"status": "ok"}

  def _close(self, current: _Round) -> None:
    quorum = sorted(current.arrivals)
    dropped = sorted(self._members - set(quorum))
    # in site order, not arrival order: the same quorum gives the same mean, bit for bit
    arrivals = [current.arrivals[s] for s in quorum]
    total = sum(w for w, _ in arrivals)
    if current.gather:
      mean = [a for _, arrs in arrivals for a in arrs]
    else:
      mean = [np.asarray(sum(np.asarray(arrs[i], np.float64) * (w / total)
                             for w, arrs in arrivals), arrivals[0][1][i].dtype)
              for i in range(len(arrivals[0][1]))]
    self._members = set(quorum)
    donor = quorum[0] if self._joiners else None
    self._closed = {i: c for i, c in self._closed.items() if i == current.index - 1}
    self._closed[current.index] = _Closed(current.index, quorum, dropped, mean,
                                          [w for w, _ in arrivals], donor, sorted(self._joiners))
    now = time.monotonic()
    if self._closed_at is not None:
      self._interval_s = now - self._closed_at
    self._closed_at = now
    if dropped:
      self._note(f"round {current.index}: sites {quorum} (dropped {dropped}: no contribution "
                 f"within {self.quorum_timeout_s:g} s)")
    self._forming = False
    self._round = _Round(current.index + 1)
    self._heard()

  def _note(self, line: str) -> None:
    self.events.append(line)


class _Handler(socketserver.BaseRequestHandler):
  lighthouse: Lighthouse

  def handle(self) -> None:
    try:
      header, arrays = recv(self.request)
      kind = header.get("kind")
      if kind == "join":
        reply, out = self.lighthouse.join(int(header["site"]), int(header["alone_round"]))
      elif kind == "sync":
        reply, out = self.lighthouse.sync(int(header["site"]), int(header["round"]),
                                          float(header["weight"]), arrays,
                                          bool(header.get("gather", False)))
      elif kind == "leave":
        reply, out = self.lighthouse.leave(int(header["site"])), []
      elif kind == "state":
        reply, out = self.lighthouse.relay(int(header["site"]), header, arrays), []
      else:
        reply, out = {"error": f"unknown request {kind!r}"}, []
      send(self.request, reply, out)
    except (OSError, WireError):
      pass  # the site is gone mid-request: the quorum handles its absence
