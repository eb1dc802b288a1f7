"""Network namespaces, shaped links and a switch on one host: the lab's network.

``Lab(sites=4, rate="100mbit", delay="10ms")`` builds, when entered:

* one namespace per site, ``<prefix><pid>s<i>``, with one interface
  ``<prefix><pid>a<i>`` at ``198.18.0.<i+1>/24`` (the benchmarking range of
  RFC 2544; it exists only inside the lab: no default route, no other
  address, IPv6 off);
* a switch namespace ``<prefix><pid>sw`` holding the other end of every
  site's link (``<prefix><pid>b<i>``) and either a kernel bridge
  ``<prefix><pid>br`` (no added delay, jitter or loss) or the lab's delay relay
  (:mod:`dadjax.netlab._relay`; this kernel family often has no netem);
* HTB on both ends of each link: the site's upload on its interface, its
  download on the switch's port, both at ``rate``.

Leaving the ``with`` block (normally, on an exception or Ctrl-C) kills the
processes started in the lab's namespaces and deletes every namespace,
link, bridge and qdisc it created, by name. Entering first sweeps what dead
labs of the same prefix left behind (their owner pid no longer runs).
Only names that start with the prefix are ever touched.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from dadjax.errors import DadjaxError
from dadjax._core.procs import pid_alive

PREFIX = "dxl"
SUBNET = ipaddress.ip_network("198.18.0.0/24")
MAX_SITES = 64

_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
          "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


class LabUnavailable(DadjaxError):
  """The lab cannot run here: not root, ``ip`` / ``tc`` missing, or no namespaces."""


def parse_rate(rate) -> float | None:
  """Bits per second from ``"100mbit"``, ``"1gbit"``, ``"10mbps"`` (bytes/s) or a number.

  ``None`` (an unshaped link) stays ``None``.
  """
  if rate is None:
    return None
  if isinstance(rate, (int, float)) and not isinstance(rate, bool):
    value = float(rate)
  else:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*", str(rate).lower())
    if not m or (m.group(2) or "bit") not in _UNITS:
      raise ValueError(f"rate must be a number of bits/s or like '100mbit' / '1gbit' "
                       f"(units {sorted(_UNITS)}), got {rate!r}")
    value = float(m.group(1)) * _UNITS[m.group(2) or "bit"]
  if not 8e3 <= value <= 1e11:
    raise ValueError(f"rate must be in [8kbit, 100gbit], got {rate!r}")
  return value


def parse_time(value, name: str = "delay") -> float:
  """Seconds from ``"10ms"``, ``"1.5s"``, ``"200us"`` or a number of seconds."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    seconds = float(value)
  else:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", str(value).lower())
    if not m:
      raise ValueError(f"{name} must be seconds or like '10ms' / '200us', got {value!r}")
    seconds = float(m.group(1)) * {"s": 1, "ms": 1e-3, "us": 1e-6, None: 1}[m.group(2)]
  if not 0 <= seconds <= 10:
    raise ValueError(f"{name} must be in [0, 10] s, got {value!r}")
  return seconds


def _run(*argv, check=True) -> subprocess.CompletedProcess:
  out = subprocess.run(argv, capture_output=True, text=True)
  if check and out.returncode:
    raise DadjaxError(f"netlab: `{' '.join(argv)}` failed: {out.stderr.strip()}")
  return out


def check_available() -> None:
  """Raise :class:`LabUnavailable` with the reason when the lab cannot run here."""
  if sys.platform != "linux":
    raise LabUnavailable(f"the network lab needs Linux network namespaces (this is {sys.platform})")
  missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
  if missing:
    raise LabUnavailable(f"the network lab needs iproute2: {' and '.join(missing)} not found "
                         "(install iproute2)")
  if os.geteuid() != 0:
    raise LabUnavailable("the network lab creates network namespaces and shapes links: it must "
                         "run as root")


def _exit_on_term(signum, frame):
  del frame
  raise SystemExit(128 + signum)


def _die_with_parent() -> None:
  """In a child before exec: SIGKILL it if the lab's process dies (Linux prctl)."""
  try:
    import ctypes  # pylint: disable=g-import-not-at-top
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except OSError:
    pass


def lab_namespaces(prefix: str = PREFIX) -> list[str]:
  """The namespaces on this host whose names look like a lab's of ``prefix``."""
  out = _run("ip", "netns", "list", check=False).stdout.split()
  pattern = re.compile(rf"{re.escape(prefix)}\d+(s\d+|sw)$")
  return [name for name in out if pattern.match(name)]


def lab_links(prefix: str = PREFIX) -> list[str]:
  """Links in this (the root) namespace named like a lab's of ``prefix``."""
  out = _run("ip", "-j", "link", "show", check=False).stdout
  names = [link["ifname"] for link in json.loads(out or "[]")]
  pattern = re.compile(rf"{re.escape(prefix)}\d+(a\d+|b\d+|br)$")
  return [name for name in names if pattern.match(name)]


def _owner(name: str, prefix: str) -> int:
  return int(re.match(rf"{re.escape(prefix)}(\d+)", name).group(1))


def _kill_namespace_pids(ns: str) -> None:
  pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
  for pid in pids:
    try:
      os.kill(int(pid), signal.SIGKILL)
    except (ProcessLookupError, ValueError):
      pass


def sweep(prefix: str = PREFIX, include_alive: bool = False) -> list[str]:
  """Delete what labs of ``prefix`` whose owner died left behind; the names deleted.

  ``include_alive``: also labs whose owner still runs (never the caller's own).
  """
  gone = []
  for ns in lab_namespaces(prefix):
    owner = _owner(ns, prefix)
    if owner == os.getpid() or (pid_alive(owner) and not include_alive):
      continue
    _kill_namespace_pids(ns)
    if _run("ip", "netns", "delete", ns, check=False).returncode == 0:
      gone.append(ns)
  for link in lab_links(prefix):
    owner = _owner(link, prefix)
    if owner == os.getpid() or (pid_alive(owner) and not include_alive):
      continue
    if _run("ip", "link", "delete", link, check=False).returncode == 0:
      gone.append(link)
  return gone


class Lab:
  """N sites behind shaped links to one switch, each site its own network namespace.

  Args:
    sites: number of sites (namespaces), in ``[1, 64]``.
    rate: each site's link rate, both directions (``"100mbit"``, bits/s, or
      ``None`` for an unshaped link).
    delay: added one-way delay per link crossing, site to switch to site
      (``"10ms"``, seconds); a message between two sites is held once, in
      the switch. ``0``: a kernel bridge, no relay.
    jitter: uniform +- jitter on the delay (never reorders frames).
    loss: probability a frame is dropped in the switch, in ``[0, 0.5]``.
    relay: use the delay relay as the switch (``None``: when ``delay`` or
      ``jitter`` or ``loss`` is set); with it :meth:`set_delay` works.
    prefix: what every name the lab creates starts with (letters, <= 4).

  Attributes (after entering): ``namespaces`` (site namespaces), ``switch``
  (the switch namespace), ``addresses`` (each site's address), ``interfaces``
  (each site's interface name), ``created`` (every namespace, link, bridge
  and qdisc, as ``(kind, namespace, name)``).
  """

  def __init__(self, sites: int, rate=None, delay=0.0, jitter=0.0, loss=0.0, *,
               relay: bool | None = None, prefix: str = PREFIX):
    if isinstance(sites, bool) or not (isinstance(sites, int) and 1 <= sites <= MAX_SITES):
      raise ValueError(f"sites must be an int in [1, {MAX_SITES}], got {sites!r}")
    if not re.fullmatch(r"[a-z]{1,4}", prefix):
      raise ValueError(f"prefix must be 1-4 lowercase letters, got {prefix!r}")
    self.sites = sites
    self.rate = parse_rate(rate)
    self.delay = parse_time(delay)
    self.jitter = parse_time(jitter, "jitter")
    if self.jitter > self.delay:
      raise ValueError(f"jitter must be <= delay ({self.delay} s), got {jitter!r}")
    if not (isinstance(loss, (int, float)) and 0 <= loss <= 0.5):
      raise ValueError(f"loss must be a probability in [0, 0.5], got {loss!r}")
    self.loss = float(loss)
    self.use_relay = bool(self.delay or self.jitter or self.loss) if relay is None else bool(relay)
    if not self.use_relay and (self.delay or self.loss):
      raise ValueError("relay=False: a kernel bridge adds no delay, jitter or loss")
    self.prefix = prefix
    self.owner = os.getpid()
    tag = f"{prefix}{self.owner}"
    self.tag = tag
    self.switch = f"{tag}sw"
    self.namespaces = [f"{tag}s{i}" for i in range(sites)]
    self.interfaces = [f"{tag}a{i}" for i in range(sites)]
    self.ports = [f"{tag}b{i}" for i in range(sites)]
    self.bridge = f"{tag}br"
    self.addresses = [str(SUBNET[i + 1]) for i in range(sites)]
    self.macs = [f"02:d1:{(os.getpid() >> 8) & 255:02x}:{os.getpid() & 255:02x}:00:{i + 1:02x}"
                 for i in range(sites)]
    self.created: list[tuple[str, str, str]] = []
    self.relay: subprocess.Popen | None = None
    self._procs: list[subprocess.Popen] = []
    self._entered = False

  # -- building ----------------------------------------------------------------------------

  def __enter__(self) -> "Lab":
    check_available()
    if self._entered:
      raise DadjaxError("a Lab can be entered once")
    self._entered = True
    sweep(self.prefix)
    # SIGTERM's default ends the process without `finally`: make it unwind like Ctrl-C.
    self._old_term = None
    if (threading.current_thread() is threading.main_thread()
        and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL):
      self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
    if any(ns in lab_namespaces(self.prefix) for ns in [self.switch, *self.namespaces]):
      raise DadjaxError(f"netlab: namespaces of {self.tag} already exist (one lab per process)")
    try:
      self._build()
    except BaseException:
      self.close()
      raise
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def _ns(self, ns: str, *argv, check=True):
    return _run("ip", "netns", "exec", ns, *argv, check=check)

  def _add_ns(self, ns: str) -> None:
    _run("ip", "netns", "add", ns)
    self.created.append(("netns", "", ns))
    _run("ip", "-n", ns, "link", "set", "lo", "up")
    for key in ("all", "default"):  # nothing but the lab's IPv4 subnet
      self._ns(ns, "sysctl", "-qw", f"net.ipv6.conf.{key}.disable_ipv6=1", check=False)

  def _shape(self, ns: str, dev: str) -> None:
    if self.rate is None:
      return
    bits = f"{int(self.rate)}bit"
    _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:",
         "htb", "default", "1")
    self.created.append(("qdisc", ns, f"{dev} root htb"))
    _run("ip", "netns", "exec", ns, "tc", "class", "add", "dev", dev, "parent", "1:",
         "classid", "1:1", "htb", "rate", bits, "ceil", bits)

  def _build(self) -> None:
    self._add_ns(self.switch)
    for ns in self.namespaces:
      self._add_ns(ns)
    if not self.use_relay:
      _run("ip", "-n", self.switch, "link", "add", self.bridge, "type", "bridge")
      self.created.append(("bridge", self.switch, self.bridge))
      _run("ip", "-n", self.switch, "link", "set", self.bridge, "up")
    for i, (ns, a, b) in enumerate(zip(self.namespaces, self.interfaces, self.ports)):
      _run("ip", "-n", ns, "link", "add", a, "address", self.macs[i], "type", "veth",
           "peer", "name", b, "netns", self.switch)
      self.created.append(("veth", ns, a))
      self.created.append(("veth", self.switch, b))
      _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/{SUBNET.prefixlen}", "dev", a)
      _run("ip", "-n", ns, "link", "set", a, "up")
      if not self.use_relay:
        _run("ip", "-n", self.switch, "link", "set", b, "master", self.bridge)
      _run("ip", "-n", self.switch, "link", "set", b, "up")
      self._shape(ns, a)
      self._shape(self.switch, b)
    if self.use_relay:
      self._start_relay()
    self.check_isolated()

  def _start_relay(self) -> None:
    # The relay is stdlib only: run as a file, it starts without importing JAX.
    relay = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_relay.py")
    argv = ["ip", "netns", "exec", self.switch, sys.executable, relay,
            "--delay", repr(self.delay), "--jitter", repr(self.jitter), "--loss", repr(self.loss),
            *(f"{b}={mac}" for b, mac in zip(self.ports, self.macs))]
    self.relay = subprocess.Popen(argv, preexec_fn=_die_with_parent, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = self.relay.stdout.readline().strip()
    if line != "ready":
      err = self.relay.stderr.read() if self.relay.poll() is not None else ""
      raise DadjaxError(f"netlab: the delay relay did not start: {line} {err}".strip())

  # -- using -------------------------------------------------------------------------------

  def set_rate(self, rate) -> None:
    """Change every link's rate (both directions) in place; ``rate`` as in the constructor."""
    new = parse_rate(rate)
    if new is None or self.rate is None:
      raise ValueError("set_rate changes a shaped lab's rate: build the Lab with a rate")
    self.rate = new
    bits = f"{int(new)}bit"
    for ns, dev in [*zip(self.namespaces, self.interfaces),
                    *((self.switch, b) for b in self.ports)]:
      _run("ip", "netns", "exec", ns, "tc", "class", "change", "dev", dev, "parent", "1:",
           "classid", "1:1", "htb", "rate", bits, "ceil", bits)

  def set_delay(self, delay, jitter=0.0, loss=0.0) -> None:
    """Change the relay's delay, jitter and loss in place (a lab built with the relay)."""
    if self.relay is None or self.relay.poll() is not None:
      raise ValueError("set_delay needs the delay relay: build the Lab with a delay or relay=True")
    delay, jitter = parse_time(delay), parse_time(jitter, "jitter")
    if jitter > delay:
      raise ValueError(f"jitter must be <= delay ({delay} s), got {jitter}")
    if not (isinstance(loss, (int, float)) and 0 <= loss <= 0.5):
      raise ValueError(f"loss must be a probability in [0, 0.5], got {loss!r}")
    self.relay.stdin.write(f"{delay!r} {jitter!r} {float(loss)!r}\n")
    self.relay.stdin.flush()
    answer = self.relay.stdout.readline().strip()
    if answer != "ok":
      raise DadjaxError(f"netlab: the relay refused the new delay: {answer}")
    self.delay, self.jitter, self.loss = delay, jitter, float(loss)

  def command(self, site: int, argv) -> list[str]:
    """``argv`` run inside site ``site``'s namespace."""
    return ["ip", "netns", "exec", self.namespaces[site], *argv]

  def popen(self, site: int, argv, **kwargs) -> subprocess.Popen:
    """Start ``argv`` in site ``site``'s namespace; the lab kills it on exit."""
    proc = subprocess.Popen(self.command(site, argv), preexec_fn=_die_with_parent, **kwargs)
    self._procs.append(proc)
    return proc

  def routes(self, ns: str) -> list[dict]:
    """Every IPv4 and IPv6 route of namespace ``ns`` (all tables), as ``ip -j`` gives them."""
    out = []
    for family in ("-4", "-6"):
      text = _run("ip", "-n", ns, "-j", family, "route", "show", "table", "all").stdout
      out += [dict(r, family=family) for r in json.loads(text or "[]")]
    return out

  def check_isolated(self) -> None:
    """Raise unless every lab namespace routes only to the lab's subnet and loopback."""
    loopback = ipaddress.ip_network("127.0.0.0/8")
    for ns in [self.switch, *self.namespaces]:
      for r in self.routes(ns):
        dst = r.get("dst", "")
        if r["family"] == "-6" or dst == "default":
          raise DadjaxError(f"netlab: namespace {ns} has a route out of the lab: {r}")
        net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
        if not (net.subnet_of(SUBNET) or net.subnet_of(loopback)
                or net == ipaddress.ip_network(f"{SUBNET.broadcast_address}/32")):
          raise DadjaxError(f"netlab: namespace {ns} has a route outside {SUBNET}: {r}")

  def qdisc_stats(self) -> dict[str, int]:
    """Bytes each shaped interface has sent so far (``tc -s``), by interface name."""
    out = {}
    for ns, dev in [*zip(self.namespaces, self.interfaces),
                    *((self.switch, b) for b in self.ports)]:
      text = _run("ip", "netns", "exec", ns, "tc", "-j", "-s", "qdisc", "show", "dev", dev,
                  check=False).stdout
      for q in json.loads(text or "[]"):
        if q.get("root"):
          out[dev] = int(q.get("bytes", 0))
    return out

  # -- tearing down ------------------------------------------------------------------------

  def close(self) -> None:
    """Kill the lab's processes and delete everything it created, by name (idempotent)."""
    for proc in [*self._procs, *([self.relay] if self.relay else [])]:
      if proc.poll() is None:
        proc.kill()
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    self._procs.clear()
    for ns in [*self.namespaces, self.switch]:
      if ns in lab_namespaces(self.prefix):
        _kill_namespace_pids(ns)
        _run("ip", "netns", "delete", ns, check=False)
    for link in lab_links(self.prefix):
      if _owner(link, self.prefix) == self.owner:
        _run("ip", "link", "delete", link, check=False)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and self.leftovers():
      time.sleep(0.05)
    if getattr(self, "_old_term", None) is not None:
      signal.signal(signal.SIGTERM, self._old_term)
      self._old_term = None

  def leftovers(self) -> list[str]:
    """What of this lab still exists (empty after :meth:`close`)."""
    mine = [ns for ns in lab_namespaces(self.prefix) if _owner(ns, self.prefix) == self.owner]
    return mine + [link for link in lab_links(self.prefix)
                   if _owner(link, self.prefix) == self.owner]

