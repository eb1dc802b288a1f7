"""Can JAX's multi-process runtime change its process set inside one program? Measured.

Three probes on 127.0.0.1 (CPU devices, gloo collectives), each with real processes:

1. **restart**: 2 processes start ``jax.distributed`` and sum across processes; process 1
   is SIGKILLed and a new process 1 starts against the same coordinator. What does the new
   one see, and can process 0 run a collective with it?
2. **grow**: a third process (``process_id=2``) asks to join a 2-process run.
3. **again**: one process shuts the runtime down (``jax.distributed.shutdown()``) and
   initializes it again with another process count, in the same program.

Each probe's outcome (the first line of the error, or what the processes printed) and the
seconds it took are written to ``experiments/results/elastic_runtime.md``. Run:

    python experiments/elastic_runtime.py
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parent

_PRELUDE = """
import sys, time, jax, numpy as np
jax.config.update("jax_cpu_collectives_implementation", "gloo")
addr, n, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
try:
  jax.distributed.initialize(addr, num_processes=n, process_id=pid, initialization_timeout=20,
                             heartbeat_timeout_seconds=30)
except Exception as e:  # noqa: BLE001 - the probe reports whatever the runtime raises
  print(f"initialize failed after {time.perf_counter() - t0:.1f} s: "
        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
  sys.exit(3)
print(f"initialized in {time.perf_counter() - t0:.1f} s: process {jax.process_index()} of "
      f"{jax.process_count()}, {jax.device_count()} devices", flush=True)

def total(value):
  from jax.experimental import multihost_utils
  return multihost_utils.process_allgather(np.float32(value)).sum()
"""


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _start(body: str, addr: str, n: int, pid: int) -> subprocess.Popen:
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  return subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(body), addr, str(n),
                           str(pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=env)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
  try:
    out, _ = proc.communicate(timeout=timeout)
    status = f"exit {proc.returncode}"
  except subprocess.TimeoutExpired:
    proc.kill()
    out, _ = proc.communicate()
    status = f"still running after {timeout:.0f} s (killed)"
  lines = [l for l in out.splitlines() if l.strip()]
  said = [l for l in lines if l.startswith(("initialized", "initialize failed", "sum", "collective",
                                           "again"))]
  # an abort's reason: absl's fatal (F) and error (E) lines, before the stack trace
  fatal = [re.sub(r"^[FE]\d{4} [\d:.]+\s+\d+ ", "", l) for l in lines
           if re.match(r"^[FE]\d{4} ", l) and "RAW: Raising signal" not in l][:2]
  return f"{status}; " + " / ".join(l[:450] for l in said + fatal)


_SURVIVOR = """
print("sum", total(1.0), flush=True)
time.sleep(4)  # process 1 is killed and a new one started meanwhile
t = time.perf_counter()
try:
  print("collective with the new process 1:", total(1.0), f"after {time.perf_counter() - t:.1f} s",
        flush=True)
except Exception as e:  # noqa: BLE001
  print(f"collective with the new process 1 failed after {time.perf_counter() - t:.1f} s: "
        f"{type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
"""

_PEER = """
print("sum", total(1.0), flush=True)
time.sleep(60)
"""

_JOINER = """
print("sum", total(1.0), flush=True)
"""


def probe_restart() -> dict:
  addr = f"127.0.0.1:{_free_port()}"
  p0, p1 = _start(_SURVIVOR, addr, 2, 0), _start(_PEER, addr, 2, 1)
  time.sleep(2.5)
  while p1.poll() is None and not _printed_sum(p1):
    time.sleep(0.2)
  os.kill(p1.pid, signal.SIGKILL)
  p1.wait()
  t = time.perf_counter()
  new = _start(_JOINER, addr, 2, 1)
  return {"probe": "restart: a new process 1 after process 1 is SIGKILLed",
          "new process 1": _finish(new, 60), "process 0": _finish(p0, 60),
          "seconds": f"{time.perf_counter() - t:.1f}"}


def _printed_sum(proc) -> bool:
  line = proc.stdout.readline()
  return line.startswith("sum")


def probe_grow() -> dict:
  addr = f"127.0.0.1:{_free_port()}"
  p0, p1 = _start(_PEER, addr, 2, 0), _start(_PEER, addr, 2, 1)
  while not _printed_sum(p0):
    time.sleep(0.2)
  t = time.perf_counter()
  third = _start(_JOINER, addr, 3, 2)
  out = _finish(third, 60)
  for p in (p0, p1):
    p.kill()
    p.wait()
  return {"probe": "grow: a process 2 joins a 2-process run", "process 2": out,
          "seconds": f"{time.perf_counter() - t:.1f}"}


_AGAIN = """
print("sum", total(1.0), flush=True)
jax.distributed.shutdown()
t = time.perf_counter()
try:
  jax.distributed.initialize(addr.rsplit(":", 1)[0] + ":" + sys.argv[4], num_processes=1,
                             process_id=0, initialization_timeout=20)
  print("again: initialized with 1 process;", jax.process_count(), "process(es),",
        jax.device_count(), "devices", flush=True)
except Exception as e:  # noqa: BLE001
  print(f"again: initialize failed after {time.perf_counter() - t:.1f} s: {type(e).__name__}: "
        f"{str(e).splitlines()[0][:200]}", flush=True)
"""


def probe_again() -> dict:
  addr = f"127.0.0.1:{_free_port()}"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  t = time.perf_counter()
  proc = subprocess.Popen([sys.executable, "-c", _PRELUDE + textwrap.dedent(_AGAIN), addr, "1",
                           "0", str(_free_port())], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env)
  return {"probe": "again: shut the runtime down and start it with another process count",
          "process 0": _finish(proc, 60), "seconds": f"{time.perf_counter() - t:.1f}"}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=str(ROOT / "results" / "elastic_runtime.md"))
  args = p.parse_args(argv)
  import jax  # pylint: disable=g-import-not-at-top
  rows = [probe_restart(), probe_grow(), probe_again()]
  lines = [f"What JAX's multi-process runtime does when its process set changes (jax "
           f"{jax.__version__}, CPU, gloo, 127.0.0.1; every outcome is what the processes "
           "printed).", ""]
  for row in rows:
    lines.append(f"- **{row.pop('probe')}** ({row.pop('seconds')} s):")
    lines += [f"  - {who}: {what}" for who, what in row.items()]
  lines += ["", "Command: `python experiments/elastic_runtime.py`", ""]
  pathlib.Path(args.out).write_text("\n".join(lines))
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
