"""Run a dadjax config across a :class:`~dadjax.netlab.Lab`: one process per site, real links."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from dadjax.errors import DadjaxError
from dadjax.netlab._lab import Lab, parse_rate, parse_time

COORDINATOR_PORT = 47611
LEDGER_KEYS = ("reduce_bits", "gather_bits", "reduce_ops", "gather_ops", "reduce_operands",
               "gather_operands", "reduce_op_bytes", "gather_op_bytes", "ops", "taken",
               "taken_error", "exchange_rate", "peak_share", "peak_reduce_bits",
               "peak_gather_bits")


@dataclasses.dataclass
class LabRun:
  """What one lab run measured (per step, seconds; site 0's view unless said).

  Attributes:
    sites: number of sites (processes).
    rate: link rate in bits/s (``None``: unshaped), ``delay``: added one-way delay, s.
    step_s: wall time of every step, site 0 (the first one compiles).
    compute_s: the compute-only replica's step times, every site's, pooled.
    evals: ``[{"step", "train_s", "accuracy", "loss", ...}]`` (site 0).
    params: the final parameters (site 0) as a list of arrays, in
      ``jax.tree.leaves`` order.
    ledger: per-site payload bits and compiled collective ops of the step
      (``reduce_bits``, ``gather_bits``, ``reduce_ops``, ``gather_ops``, ...).
    sites_results: every site's raw result.
  """

  sites: int
  rate: float | None
  delay: float
  step_s: list
  compute_s: list
  evals: list
  params: list
  ledger: dict
  sites_results: list

  @property
  def step_time(self) -> float:
    """Seconds per optimizer step after the first (compiling) step (:meth:`period_step_time`).

    The median step; for a method that communicates on some steps only (a
    local-update ledger, ``ledger["exchange_rate"] = 1 / H``) the mean per
    optimizer step over a period (too few steps to sample every step of the
    period: the mean of the steps after the first).
    """
    try:
      return self.period_step_time(self.period)
    except DadjaxError:
      return statistics.fmean(self.step_s[1:] or self.step_s)

  def period_step_time(self, period: int) -> float:
    """Seconds per optimizer step when the steps repeat every ``period`` steps.

    ``period = 1``: the median step after the first. Otherwise the steps
    after the first are grouped by their position in the period (step ``t``
    counted from 1, ``t % period``), each group gives its median and the
    groups are averaged: a sync step weighs ``1 / period`` however many of
    them the run sampled.

    Raises:
      DadjaxError: the run did not sample every position of the period.
    """
    steps = self.step_s[1:] or self.step_s
    if period <= 1:
      return statistics.median(steps)
    groups: dict = {}
    for t, s in enumerate(self.step_s[1:], start=2):
      groups.setdefault(t % period, []).append(s)
    if len(groups) < period:
      raise DadjaxError(f"LabRun.period_step_time: {len(self.step_s)} steps do not sample every "
                        f"step of a period of {period} after the compiling one; run at least "
                        f"{period + 1} steps")
    return statistics.fmean(statistics.median(g) for g in groups.values())

  @property
  def period(self) -> int:
    """``H``: optimizer steps per period of a local-update method (1: every step communicates)."""
    rate = self.ledger.get("exchange_rate")
    return max(1, round(1 / rate)) if rate else 1

  @property
  def compute_time(self) -> float:
    """Median compute-only step time over every site's replica."""
    return statistics.median(self.compute_s) if self.compute_s else 0.0

  @property
  def comm_time(self) -> float:
    """:attr:`step_time` minus the median compute time: the step's communication."""
    return self.step_time - self.compute_time

  def summary(self) -> dict:
    return {"sites": self.sites, "rate_bits": self.rate, "delay_s": self.delay,
            "step_s": self.step_time, "compute_s": self.compute_time, "comm_s": self.comm_time,
            "steps": len(self.step_s), "final": self.evals[-1] if self.evals else None,
            **self.ledger}


def _worker_env() -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("XLA_FLAGS", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
  import dadjax  # pylint: disable=g-import-not-at-top
  root = str(pathlib.Path(dadjax.__file__).resolve().parent.parent)
  env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                  else []))
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONUNBUFFERED"] = "1"
  return env


def launch(lab: Lab, module: str, spec: dict, phases: int, before, timeout: float,
           workdir: str) -> list:
  """Start ``python -m module SPEC`` in every site; return each site's JSON result.

  Every site's ``SPEC`` is ``spec`` plus ``coordinator``, ``num_processes``,
  ``process_id``, ``address`` and ``out``. Before phase ``k`` (``0 <= k <
  phases``) ``before(k)`` runs; for ``k > 0`` the sites wait for it
  (``ready<k>.<rank>`` / ``go<k>`` files in ``workdir``).
  """
  env = _worker_env()
  coordinator = f"{lab.addresses[0]}:{COORDINATOR_PORT}"
  before(0)
  procs, logs = [], []
  for i in range(lab.sites):
    site_spec = {**spec, "coordinator": coordinator, "num_processes": lab.sites,
                 "process_id": i, "address": lab.addresses[i],
                 "out": os.path.join(workdir, f"site{i}.json")}
    path = os.path.join(workdir, f"spec{i}.json")
    pathlib.Path(path).write_text(json.dumps(site_spec))
    log = open(os.path.join(workdir, f"site{i}.log"), "w")
    logs.append(log)
    procs.append(lab.popen(i, [sys.executable, "-m", module, path], env=env, stdout=log,
                           stderr=subprocess.STDOUT))
  deadline = time.monotonic() + timeout
  failed = None
  next_phase = 1
  try:
    while any(p.poll() is None for p in procs):
      if next_phase < phases and all(os.path.exists(os.path.join(workdir, f"ready{next_phase}.{i}"))
                                     for i in range(lab.sites)):
        before(next_phase)
        pathlib.Path(workdir, f"go{next_phase}").touch()
        next_phase += 1
      bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
      if bad:
        failed = bad[0]
        break
      if time.monotonic() > deadline:
        failed = -1
        break
      time.sleep(0.05)
    if failed is None:
      failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
    for log in logs:
      log.close()
  if failed is not None:
    site = 0 if failed < 0 else failed
    tail = pathlib.Path(workdir, f"site{site}.log").read_text()[-3000:]
    what = f"timed out after {timeout:.0f} s" if failed < 0 else f"site {site} failed"
    raise DadjaxError(f"netlab: the run {what}; its log ({workdir}/site{site}.log) "
                      f"ends:\n{tail}")
  return [json.loads(pathlib.Path(workdir, f"site{i}.json").read_text())
          for i in range(lab.sites)]


def wait_phase(workdir: str, k: int, rank: int) -> None:
  """In a site: before phase ``k > 0``, say ready and wait for the lab's go."""
  open(os.path.join(workdir, f"ready{k}.{rank}"), "w").close()
  while not os.path.exists(os.path.join(workdir, f"go{k}")):
    time.sleep(0.02)


def run_in_lab(lab: Lab, config, *, compute_steps: int = 5, eval_every: int = 0,
               target: float | None = None, timeout: float = 600,
               workdir: str | None = None, rates=None, delays=None, ledger=True,
               evaluate: bool = True):
  """Train ``config`` with one process per site of ``lab`` (entered); measure every step.

  Args:
    lab: an entered :class:`Lab`; ``config["num_sites"]`` becomes ``lab.sites``.
    config: :class:`~dadjax.config.Config` fields (``method``, ``steps``, ...),
      or a list of them: trained one after the other by the same processes
      (one start-up for all).
    compute_steps: steps of the compute-only replica to time (0: none); a
      list gives one count per config.
    eval_every: evaluate (test set) every this many steps, and at the end.
    target: stop once the test accuracy reaches this (at an evaluation).
    timeout: seconds for the whole run before the processes are killed.
    workdir: where the sites write their results and logs (default: a
      temporary directory, deleted after a successful run and kept, named in
      the error, after a failed one).
    rates: with a list of configs, the link rate for each (``None``: keep);
      the lab changes it between runs, while the processes wait.
    delays: the same for the relay's one-way delay (a lab with the relay).
    ledger: read each run's payload bits and compiled collective ops (one
      more compile per run) into ``LabRun.ledger``; a list: one flag per config.
    evaluate: evaluate on the test set (every ``eval_every`` steps and at the end).
    Consecutive configs that are equal reuse the compiled step (one compile).

  Returns:
    A :class:`LabRun` (a list of them for a list of configs).

  Raises:
    DadjaxError: a site failed or timed out (its output's tail is in the message).
  """
  configs = [config] if isinstance(config, dict) else list(config)
  if not configs or not all(isinstance(c, dict) for c in configs):
    raise ValueError(f"config must be a dict of Config fields or a list of them, got {config!r}")
  per_run = {}
  for name, given in (("rates", rates), ("delays", delays), ("compute_steps", compute_steps),
                      ("ledger", ledger)):
    values = ([given] * len(configs) if given is None or isinstance(given, (int, float, str))
              else list(given))
    if len(values) != len(configs):
      raise ValueError(f"{name} must give one value per config ({len(configs)}), got "
                       f"{len(values)}")
    per_run[name] = values
  rates, delays = per_run["rates"], per_run["delays"]
  tmp = tempfile.mkdtemp(prefix="dadjax-netlab-") if workdir is None else workdir
  runs = [{"config": dict(c), "compute_steps": steps, "eval_every": eval_every,
           "target": target, "ledger": bool(book), "evaluate": evaluate}
          for c, steps, book in zip(configs, per_run["compute_steps"], per_run["ledger"])]
  initial, initial_delay = lab.rate, lab.delay

  def before(k):
    if rates[k] is not None:
      lab.set_rate(rates[k])
    if delays[k] is not None and parse_time(delays[k]) != lab.delay:
      lab.set_delay(delays[k])

  per_site = launch(lab, "dadjax.netlab._worker", {"runs": runs}, len(runs), before, timeout, tmp)
  out = []
  for k in range(len(configs)):
    results = [site[k] for site in per_site]
    with np.load(os.path.join(tmp, f"params{k}.npz")) as f:
      params = [f[f"p{i}"] for i in range(len(f.files))]
    first = results[0]
    book = {key: first[key] for key in LEDGER_KEYS if key in first}
    compute = [t for r in results for t in r.get("compute_s", [])]
    rate = next((r for r in rates[k::-1] if r is not None), None)
    rate = initial if rate is None else parse_rate(rate)
    delay = next((d for d in delays[k::-1] if d is not None), None)
    delay = initial_delay if delay is None else parse_time(delay)
    out.append(LabRun(lab.sites, rate, delay, first["step_s"], compute, first["evals"],
                      params, book, results))
  if workdir is None:
    shutil.rmtree(tmp, ignore_errors=True)
  return out[0] if isinstance(config, dict) else out
