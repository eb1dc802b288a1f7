"""Time gloo's all-reduce and all-gather in a :class:`~dadjax.netlab.Lab`, over message size.

``measure_collectives(lab, sizes, links)`` starts one process per site
(``python -m dadjax.netlab._bench SPEC`` in each namespace) and, for every
link setting ``(rate, delay)`` in ``links`` (the lab changes them between
phases while the processes wait), times a jitted ``psum`` and an
``all_gather`` (tiled) of ``size`` bytes of float32 per site over a 1-D
mesh of the sites, and a ``psum`` of a tuple of ``k`` small operands (XLA
combines them into one all-reduce op; gloo runs one call per operand).
Repetitions are fixed from the textbook model (every process must run the
same number of calls), ``reps = clip(budget / modeled, 2, max_reps)`` after
one warm-up call.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time



def _reps(seconds: float, budget: float, max_reps: int) -> int:
  return int(min(max_reps, max(2, math.ceil(budget / max(seconds, 1e-4)))))


def textbook_seconds(kind: str, nbytes: int, n: int, rate: float, delay: float) -> float:
  """The textbook ring: ``2(N-1)/N B/bw + 2(N-1) D`` (reduce), ``(N-1) B/bw + (N-1) D`` (gather)."""
  bits = 8 * nbytes
  if kind == "reduce":
    return 2 * (n - 1) / n * bits / rate + 2 * (n - 1) * delay
  return (n - 1) * bits / rate + (n - 1) * delay


def measure_collectives(lab, sizes, links, *, operands=(1, 2, 4, 8), operand_bytes=1024,
                        budget: float = 1.0, max_reps: int = 8, max_seconds: float = 5.0,
                        timeout: float = 1800, workdir: str | None = None) -> list[dict]:
  """One row per (link, kind, size): measured seconds (median, min, max) and the point.

  Args:
    lab: an entered :class:`~dadjax.netlab.Lab` (with the relay, for ``delay`` changes).
    sizes: bytes per site per message.
    links: ``[(rate_bits_per_s, delay_s), ...]``.
    operands: operand counts of the combined all-reduce (``kind="reduce_k"``).
    operand_bytes: bytes per operand there.
    budget: seconds of repetitions per point (from the textbook model).
    max_reps: at most this many repetitions per point.
    max_seconds: skip points the textbook model puts above this.
    timeout, workdir: as for :func:`~dadjax.netlab.run_in_lab`.
  """
  from dadjax.netlab._run import launch  # pylint: disable=g-import-not-at-top
  tmp = tempfile.mkdtemp(prefix="dadjax-netlab-bench-") if workdir is None else workdir
  links = [(float(r), float(d)) for r, d in links]
  spec = {"sizes": [int(s) for s in sizes], "links": links, "operands": list(operands),
          "operand_bytes": int(operand_bytes), "budget": budget, "max_reps": max_reps,
          "max_seconds": max_seconds}

  def before(k):
    rate, delay = links[k]
    lab.set_rate(rate)
    if delay != lab.delay:
      lab.set_delay(delay)

  results = launch(lab, "dadjax.netlab._bench", spec, len(links), before, timeout, tmp)
  if workdir is None:
    shutil.rmtree(tmp, ignore_errors=True)
  return results[0]


def _worker(spec: dict) -> list[dict]:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax.netlab._run import wait_phase  # pylint: disable=g-import-not-at-top
  n, rank = spec["num_processes"], spec["process_id"]
  dadjax.initialize(spec["coordinator"], num_processes=n, process_id=rank,
                    collectives_hostname=spec["address"], initialization_timeout=120)
  mesh = dadjax.make_mesh(n, "d")
  sharding = NamedSharding(mesh, P("d"))

  def array(elements):
    return jax.make_array_from_callback(
        (n, elements), sharding, lambda idx: np.ones((1, elements), np.float32))

  def program(kind, k=1):
    def body(*xs):
      if kind == "gather":
        return jax.lax.all_gather(xs[0], "d", tiled=True)
      return jax.lax.psum(xs, "d")
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"),) * k,
                                 out_specs=P() if kind == "gather" else (P("d"),) * k,
                                 check_vma=False))

  def timed(fn, args, reps):
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(reps):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*args))
      times.append(time.perf_counter() - t0)
    return times

  here = os.path.dirname(spec["out"])
  rows = []
  for phase, (rate, delay) in enumerate(spec["links"]):
    if phase:
      wait_phase(here, phase, rank)
    for kind in ("reduce", "gather"):
      fn = program(kind)
      for size in spec["sizes"]:
        model = textbook_seconds(kind, size, n, rate, delay)
        if model > spec["max_seconds"]:
          continue
        reps = _reps(model, spec["budget"], spec["max_reps"])
        times = timed(fn, (array(max(1, size // 4)),), reps)
        rows.append({"n": n, "rate": rate, "delay": delay, "kind": kind, "bytes": size,
                     "operands": 1, "reps": reps, "median": statistics.median(times),
                     "min": min(times), "max": max(times)})
    for k in spec["operands"]:
      fn = program("reduce", k)
      size = spec["operand_bytes"]
      model = k * textbook_seconds("reduce", size, n, rate, delay)
      reps = _reps(model, spec["budget"], spec["max_reps"])
      times = timed(fn, tuple(array(max(1, size // 4)) for _ in range(k)), reps)
      rows.append({"n": n, "rate": rate, "delay": delay, "kind": "reduce_k", "bytes": size,
                   "operands": k, "reps": reps, "median": statistics.median(times),
                   "min": min(times), "max": max(times)})
  return rows


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  spec = json.loads(open(argv[0]).read())
  import jax  # pylint: disable=g-import-not-at-top
  rows = _worker(spec)
  with open(spec["out"], "w") as f:
    json.dump(rows, f)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  sys.exit(main())
