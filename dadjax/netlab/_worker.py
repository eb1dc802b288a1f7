"""One site of a lab run: a dadjax process in its own namespace.

Run as ``python -m dadjax.netlab._worker SPEC``.

``SPEC`` is a JSON file: ``coordinator`` (``"addr:port"`` of site 0),
``num_processes``, ``process_id``, ``address`` (this site's address: gloo's
network identity), ``out`` (where this site writes its JSON results) and ``runs``: the
configs to train one after the other in the same processes, each a dict
with ``config`` (:class:`~dadjax.config.Config` fields), ``compute_steps``
(how many steps of the compute-only replica to time), ``eval_every`` (0:
evaluate at the end only; evaluation time is not training time),
``target`` (stop at that test accuracy), ``ledger`` (read the payload bits
and compiled collective ops) and ``evaluate`` (default true). Before run
``k > 0`` every site writes ``ready<k>.<rank>`` next to ``out`` and waits
for ``go<k>`` (the lab changes the links in between). Site 0 writes run
``k``'s parameters to ``params<k>.npz`` next to ``out``.

Each step is timed to completion (``block_until_ready``). Compute time is
the same step (same model, method and per-site batch) compiled for a
one-site mesh of this process's device, timed after the run in place (the
other sites do the same at the same time, so the CPU contention is the
run's): its collectives span one site and move nothing. Communication time
is step time minus compute time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if "xla_force_host_platform_device_count" not in f]
    + ["--xla_force_host_platform_device_count=1"])

import jax  # noqa: E402
import numpy as np  # noqa: E402


def _local_step(config, dataset, steps_per_epoch):
  """The run's step for one site on this process's own device (no cross-site traffic).

  Built like :func:`dadjax.train.build` builds the run's step, with one site.
  """
  from dadjax import make_mesh, make_train_step  # pylint: disable=g-import-not-at-top
  from dadjax.run import local_optimizer, method_and_model  # pylint: disable=g-import-not-at-top
  one = config.replace(num_sites=1)
  schedule, method, model = method_and_model(one, dataset, steps_per_epoch)
  mesh = make_mesh(1, devices=jax.local_devices()[:1])
  return make_train_step(model, method.optimizer(local_optimizer(one, schedule)), mesh=mesh,
                         backend=one.backend, batch_stage=getattr(method, "batch_stage", None),
                         collections=getattr(method, "collections", None))


def _ledger(step_fn, state, batch) -> dict:
  """Per-site payload bits (the ledger) and the compiled step's collective ops.

  ``ops`` holds :class:`~dadjax.comm.CollectiveOps`' fields. A program with
  conditional collectives and a plain ledger (Accordion: one ``lax.cond``
  per setting and shape group) gets the branches the last step took (``taken``,
  :func:`~dadjax.comm.match_branches` on its bits) and ``ops`` of those
  branches; a local-update ledger (:class:`~dadjax.comm.PeriodicStats`)
  keeps every op, with ``exchange_rate`` (``1 / H``), ``peak_share`` and
  the sync step's bits, so the model charges the sync branch once per ``H``.
  """
  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax.comm import hlo_collectives, match_branches, taken_collectives  # pylint: disable=g-import-not-at-top
  summary = dadjax.comm_stats(state)  # every ledger: the method's and the step's own
  # What TrainStep.collectives reads, kept to count the operands too (one compile).
  program = step_fn._run  # pylint: disable=protected-access
  text = program.lower(state, step_fn.place_batch(batch)).compile().as_text()
  ops = hlo_collectives(text)
  out = dict(reduce_operands=int(ops.operands.get("reduce", 0)),
             gather_operands=int(ops.operands.get("gather", 0)),
             reduce_bits=int(max(summary.reduce_bits)),
             gather_bits=int(max(summary.gather_bits)),
             reduce_ops=int(ops.count.get("reduce", 0)),
             gather_ops=int(ops.count.get("gather", 0)),
             reduce_op_bytes=int(ops.nbytes.get("reduce", 0)),
             gather_op_bytes=int(ops.nbytes.get("gather", 0)))
  if summary.exchange_rate is not None:
    out.update(exchange_rate=summary.exchange_rate, peak_share=summary.peak_share,
               peak_reduce_bits=int(max(summary.peak_reduce_bits)),
               peak_gather_bits=int(max(summary.peak_gather_bits)))
  elif any(ops.conditional_count.values()):
    try:
      out["taken"] = match_branches(text, out["reduce_bits"], out["gather_bits"])
      ops = taken_collectives(text, out["taken"])
    except ValueError as e:  # the ledger does not tell the branches: every one is charged
      out["taken_error"] = str(e)
  out["ops"] = {k: dict(v) for k, v in dataclasses.asdict(ops).items()}
  return out


_BUILT: dict = {}


def _one_run(config, run, rank, params_path):
  """Train one config in the lab; this site's timings (and site 0's parameters).

  A run with the same config as the previous one reuses its compiled step
  (a fresh state: the same training, no second compile).
  """
  from dadjax.run import build, evaluate  # pylint: disable=g-import-not-at-top
  key = json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)
  if key not in _BUILT:
    _BUILT.clear()
    _BUILT[key] = build(config)
  dataset, _, batcher, step_fn = _BUILT[key]
  state = step_fn.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
  jax.block_until_ready(state)
  step_s, evals, train_s = [], [], 0.0
  eval_every = int(run.get("eval_every", 0))
  target = run.get("target")
  for step in range(config.steps):
    x, y = batcher.batch_at(step)
    t0 = time.perf_counter()
    state, metrics = step_fn(state, {"x": x, "y": y})
    jax.block_until_ready((state, metrics))
    dt = time.perf_counter() - t0
    step_s.append(dt)
    train_s += dt
    done = step + 1
    if run.get("evaluate", True) and ((eval_every and done % eval_every == 0)
                                      or done == config.steps):
      row = evaluate(step_fn, state, dataset.x_test, dataset.y_test)
      evals.append({"step": done, "train_s": train_s, **{k: float(v) for k, v in row.items()}})
      if target is not None and row.get("accuracy", 0.0) >= target:
        break
  result = {"step_s": step_s, "evals": evals, "process_id": rank}
  if run.get("ledger", True):
    try:
      result.update(_ledger(step_fn, state, {"x": x, "y": y}))
    except Exception as e:  # pylint: disable=broad-except
      result["ledger_error"] = repr(e)
  if rank == 0:
    leaves = jax.tree.leaves(step_fn.params(state))
    np.savez(params_path, **{f"p{i}": np.asarray(leaf) for i, leaf in enumerate(leaves)})
  # Compute-only replica: the same step on a one-site mesh of this device, same per-site rows.
  compute_steps = int(run.get("compute_steps", 5))
  if compute_steps:
    local = _local_step(config, dataset, batcher.steps_per_epoch)
    lstate = local.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
    rows = slice(rank * config.batch_per_site, (rank + 1) * config.batch_per_site)
    compute = []
    for step in range(compute_steps + 1):  # the first call compiles
      x, y = batcher.batch_at(step)
      t0 = time.perf_counter()
      lstate, m = local(lstate, {"x": x[rows], "y": y[rows]})
      jax.block_until_ready((lstate, m))
      compute.append(time.perf_counter() - t0)
    result["compute_s"] = compute[1:]
  return result


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  spec = json.loads(open(argv[0]).read())
  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax.run import Config  # pylint: disable=g-import-not-at-top
  from dadjax.netlab._run import wait_phase  # pylint: disable=g-import-not-at-top
  n, rank = spec["num_processes"], spec["process_id"]
  dadjax.initialize(spec["coordinator"], num_processes=n, process_id=rank,
                    collectives_hostname=spec["address"], initialization_timeout=120)
  assert jax.process_count() == n and jax.local_device_count() == 1
  here = os.path.dirname(spec["out"])
  results = []
  for k, run in enumerate(spec["runs"]):
    if k:  # the lab changes the links between runs
      wait_phase(here, k, rank)
    results.append(_one_run(Config(**{**run["config"], "num_sites": n}), run, rank,
                            os.path.join(here, f"params{k}.npz")))
  with open(spec["out"], "w") as f:
    json.dump(results, f)
  jax.distributed.shutdown()
  return 0


if __name__ == "__main__":
  sys.exit(main())
