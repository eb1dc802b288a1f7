"""The lab's delay switch: a user-space Ethernet switch that holds each frame ``delay`` seconds.

For kernels without netem (no ``tc qdisc ... netem``). It runs inside the
lab's switch namespace and owns the switch side of every site's link: one
``AF_PACKET`` socket per port, with ``PACKET_VNET_HDR`` so segmentation-
offload frames (up to 64 KB) and their pending checksums pass through intact,
as a kernel bridge passes them. A frame for a known MAC goes to that port
only; broadcast and unknown destinations go to every other port. Per output
port the frames leave in arrival order, each no earlier than ``delay``
(plus a uniform ``jitter``) after it arrived; ``loss`` drops a frame with
that probability. The rate shaping stays in the kernel (HTB on both ends of
each link), so a frame leaving the relay still queues behind the site's
shaped download.

Run: ``python dadjax/netlab/_relay.py --delay 0.005 PORT=MAC ...``; it prints
``ready`` once every port is open and runs until SIGTERM or the end of its
standard input. A line ``DELAY JITTER LOSS`` on standard input changes the
three (frames already held keep their times); it answers ``ok``.
"""

from __future__ import annotations

import argparse
import collections
import random
import signal
import socket
import sys
import threading
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
VNET_HDR = 10  # struct virtio_net_hdr
FRAME = 65536 + 256


class _Port:
  """One switch port: its socket and the frames waiting to leave through it."""

  def __init__(self, name: str):
    self.name = name
    self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    self.sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    self.sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16 << 20)
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
    self.sock.bind((name, 0))
    self.queue: collections.deque = collections.deque()
    self.ready = threading.Condition()
    self.last_due = 0.0

  def put(self, due: float, frame: bytes) -> None:
    with self.ready:
      due = max(due, self.last_due)  # jitter never reorders a port's frames
      self.last_due = due
      self.queue.append((due, frame))
      self.ready.notify()


class Relay:
  """The switch: ``ports`` maps an interface name to the MAC of the site behind it."""

  def __init__(self, ports: dict[str, str], delay: float, jitter: float = 0.0,
               loss: float = 0.0, seed: int = 0):
    self.ports = {name: _Port(name) for name in ports}
    self.by_mac = {bytes.fromhex(mac.replace(":", "")): self.ports[name]
                   for name, mac in ports.items()}
    self.delay, self.jitter, self.loss = delay, jitter, loss
    self.rng = random.Random(seed)
    self.frames = 0

  def _receive(self, port: _Port) -> None:
    others = [p for p in self.ports.values() if p is not port]
    while True:
      frame = port.sock.recv(FRAME)
      now = time.monotonic()
      if len(frame) < VNET_HDR + 14:
        continue
      if self.loss and self.rng.random() < self.loss:
        continue
      due = now + self.delay + (self.rng.uniform(-self.jitter, self.jitter) if self.jitter else 0)
      self.frames += 1
      out = self.by_mac.get(frame[VNET_HDR:VNET_HDR + 6])
      for p in ([out] if out is not None else others):
        if p is not port:
          p.put(due, frame)

  def _send(self, port: _Port) -> None:
    while True:
      with port.ready:
        while not port.queue:
          port.ready.wait()
        due, frame = port.queue.popleft()
      wait = due - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      try:
        port.sock.send(frame)
      except OSError:  # a full device queue drops the frame, like a switch would
        pass

  def run(self) -> None:
    threads = [threading.Thread(target=f, args=(p,), daemon=True)
               for p in self.ports.values() for f in (self._receive, self._send)]
    for t in threads:
      t.start()
    print("ready", flush=True)
    for line in sys.stdin:  # control: "DELAY JITTER LOSS"
      try:
        delay, jitter, loss = (float(v) for v in line.split())
      except ValueError:
        print(f"error: expected 'DELAY JITTER LOSS', got {line.strip()!r}", flush=True)
        continue
      self.delay, self.jitter, self.loss = delay, jitter, loss
      print("ok", flush=True)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description="the lab's delay switch")
  parser.add_argument("--delay", type=float, required=True, help="seconds each frame is held")
  parser.add_argument("--jitter", type=float, default=0.0, help="uniform +- seconds")
  parser.add_argument("--loss", type=float, default=0.0, help="drop probability per frame")
  parser.add_argument("ports", nargs="+", help="IFNAME=MAC")
  args = parser.parse_args(argv)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the lab ends it (SIGTERM / SIGKILL)
  relay = Relay(dict(p.split("=", 1) for p in args.ports), args.delay, args.jitter, args.loss)
  relay.run()
  return 0


if __name__ == "__main__":
  sys.exit(main())
