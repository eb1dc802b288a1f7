"""Local updates against all-reduce and gradient compression at equal sample budgets (issue 22).

Every method trains the same MLP from the same initialization on the same
site batches (8 sites x 16 rows per step, iid split, SGD with momentum 0.9,
lr 0.1 as the local / inner optimizer), for the same number of steps, so
every method sees the same samples. Methods:

* synchronous baselines: fp32 all-reduce, bf16 all-reduce, PowerSGD (rank 2);
* DiLoCo (:func:`dadjax.local.diloco`, outer Nesterov SGD lr 0.7, momentum
  0.9) at ``H`` in ``--every`` with fp32, bf16, 4-bit QSGD (``qsgd(7)``: 1
  sign + 3 level bits per entry) and PowerSGD (rank 2) outer gradients;
* Streaming DiLoCo (3 fragments, ``tau = 5``, ``alpha = 0.5``) with fp32 and
  4-bit outer gradients at the middle ``H``;
* with ``--methods``: any spec, e.g. SparseLoCo (``sparseloco:10``), DeMo
  (``demo:lr=0.001|momentum=0``: a method may carry Config overrides after
  ``|``) or DiLoCo with an error-fed 4-bit outer gradient
  (``diloco:10:compress=ef(qsgd(7))``).

Each run is :func:`dadjax.run.train`: every ``--eval-every`` steps the
*synchronized* parameters (the anchor, ``LocalState.evaluation_params``)
are evaluated on the test set, and the row holds :func:`dadjax.comm.report`
for a ring of ``N = 8`` sites (``--bandwidth``, ``--latency``): wire bits
per site (mean per step, cumulative), the busiest step's modeled time (a
synchronization step) and the modeled communication time; with
vmap-simulated sites latency is charged per recorded collective call.
Reported over ``--seeds`` (mean ± std): final test accuracy, and the steps,
cumulative wire bits per site and modeled time at the first evaluation
reaching ``--target`` (:func:`dadjax.run.to_target`), the time also at each
of ``--also-bandwidths`` (default 10 Gbit/s: :func:`at_bandwidths`).

Every run's rows are kept in ``<out>/<name>.json``; ``--from-json`` renders
the table again from them (another ``--target``) without training, with the
saved run's own options (its workload and metric) under this invocation's.

Usage (from the repository root)::

  .venv/bin/python experiments/local.py            # the default run (about 15 min on 2 cores)
  .venv/bin/python experiments/local.py --quick    # a smoke run (about 1 min)
  .venv/bin/python experiments/local.py --workload fashion_mlp   # a real workload (its model,
      # data, optimizer, steps and target; DiLoCo H in 10,50; --partition non_iid)

Writes ``<out>/local.md`` (tables + the exact command), ``<out>/local.png`` and
``<out>/local.json`` (every run's metrics rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shlex
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

harness.host_devices(8)
from dadjax.comm import report  # noqa: E402  pylint: disable=g-import-not-at-top
from dadjax.run import Config, network_model, train  # noqa: E402  pylint: disable=g-import-not-at-top

import workloads  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

SITES, ROWS = 8, 16
OUTER = ("fp32", None), ("bf16", "bf16"), ("4-bit QSGD", "qsgd(7)"), ("PowerSGD r2", "powersgd(2)")


def methods_for(every: list[int]) -> list[tuple[str, str]]:
  """``(label, spec)`` of every compared method."""
  out = [("fp32 all-reduce", "allreduce"), ("bf16 all-reduce", "bf16"),
         ("PowerSGD r2 (every step)", "powersgd:2")]
  for h in every:
    for label, comp in OUTER:
      spec = f"diloco:{h}" + (f":compress={comp}" if comp else "")
      out.append((f"DiLoCo H={h}, {label}", spec))
  mid = every[len(every) // 2]
  tau = max(0, min(5, mid // 4))
  frag = max(1, min(3, mid))
  for label, comp in OUTER[:1] + OUTER[2:3]:
    spec = f"streaming_diloco:{mid}:fragments={frag}:delay={tau}" + (
        f":compress={comp}" if comp else "")
    out.append((f"Streaming DiLoCo H={mid}, P={frag}, tau={tau}, {label}", spec))
  return out


def split_entry(entry: str) -> tuple[str, dict]:
  """``SPEC[|FIELD=VALUE...]`` of ``--methods``: the method spec and its Config overrides.

  DeMo's paper feeds its momentum with plain SGD steps: ``demo:lr=0.001|momentum=0``.
  """
  spec, *fields = entry.split("|")
  overrides = {}
  for field in fields:
    key, _, value = field.partition("=")
    try:
      overrides[key] = json.loads(value)
    except json.JSONDecodeError:
      overrides[key] = value
  return spec, overrides


def config_for(args, spec: str, seed: int) -> Config:
  """The run's Config: the MLP (64, 64) on ``--dataset``, or a ``--workload``'s; the ring of
  ``--bandwidth`` / ``--latency`` its rows report on."""
  spec, overrides = split_entry(spec)
  link = {"bandwidth": args.bandwidth, "latency": args.latency, "topology": "ring",
          "eval_every": args.eval_every, "out_dir": None}
  if args.workload:
    wl = workloads.get(args.workload)
    return wl.config(args.quick, method=spec, seed=seed, steps=args.steps,
                     **{**workloads.partition_fields(wl, args.partition), **link, **overrides})
  return Config(**{**dict(dataset=args.dataset, model="mlp", model_kwargs={"hidden": [64, 64]},
                          method=spec, num_sites=SITES, backend="vmap", batch_per_site=ROWS,
                          steps=args.steps, seed=seed, lr=0.1, momentum=0.9), **link,
                   **overrides})


def seconds_column(bandwidth: float) -> str:
  return f"modeled_comm_s_at_{bandwidth:g}"


def at_bandwidths(run, bandwidths) -> list[dict]:
  """``run.history`` with a ``modeled_comm_s_at_<bandwidth>`` column per extra bandwidth.

  The run's rows hold the modeled time at its Config's bandwidth only. The
  final state's ledger, read out at both bandwidths (:func:`dadjax.comm.report`,
  latency per recorded call as the vmap rows are), gives the ratio of the
  two mean step times; each row's cumulative time is scaled by it. Exact
  while a method's traffic per step does not change over the run (every
  method here; a local-update method's evaluations fall on synchronizations).
  """
  config = run.config
  base = report(run.state, network_model(config)).modeled_comm_s_per_step
  ratios = {b: report(run.state, network_model(dataclasses.replace(config, bandwidth=b)))
            .modeled_comm_s_per_step / base if base else 1.0 for b in bandwidths}
  return [{**row, **{seconds_column(b): row["modeled_comm_s"] * r for b, r in ratios.items()}}
          for row in run.history]


def run_one(args, spec: str, seed: int) -> dict:
  """One :func:`dadjax.run.train` run: its rows (the workload's metric and the times at
  ``--also-bandwidths`` added) and wall time."""
  t0 = time.perf_counter()
  run = train(config_for(args, spec, seed), progress=False)
  rows = at_bandwidths(run, args.also_bandwidths)
  return {"rows": workloads.with_metric(rows, args.metric), "wall_s": time.perf_counter() - t0}


def table(results, args) -> str:
  metric = f"test_{args.metric}"
  name = "test acc" if args.metric == "accuracy" else "test bits/byte"
  t = args.target
  rows = []
  for (label, spec), runs in results.items():
    finals = [r["rows"][-1] for r in runs]
    histories = [r["rows"] for r in runs]
    mean = lambda key, fmt="{:.3g}": fmt.format(np.mean([f[key] for f in finals]))  # noqa: E731
    also = [harness.to_target_cells(histories, metric, t, seconds=seconds_column(b))[2]
            if seconds_column(b) in finals[0] else "not measured" for b in args.also_bandwidths]
    rows.append([label, f"`{spec}`", harness.mean_std([f[metric] for f in finals], "{:.3f}",
                                                      "{:.3f}"),
                 mean("wire_bits_per_step", "{:,.0f}"), mean("peak_comm_s_per_step"),
                 mean("total_wire_bits"), mean("modeled_comm_s"),
                 *harness.to_target_cells(histories, metric, t), *also,
                 f"{np.mean([r['wall_s'] for r in runs]):.1f}"])
  return harness.table(["method", "spec", name, "wire bits/step/site", "peak comm s/step",
                        "total wire bits/site", "modeled comm s", f"steps to {t}",
                        f"wire bits to {t}", f"modeled s to {t}",
                        *(f"modeled s to {t} at {b:g} bit/s" for b in args.also_bandwidths),
                        "wall s/run"], rows)


def plot(results, path, metric: str = "accuracy") -> None:
  plt = harness.pyplot()
  fig, ax = plt.subplots(figsize=(9, 5.5))
  curves = {label: (np.mean([[max(r["total_wire_bits"], 1.0) for r in run["rows"]]
                             for run in runs], axis=0),
                    np.mean([[r[f"test_{metric}"] for r in run["rows"]] for run in runs], axis=0))
            for (label, _), runs in results.items()}
  harness.plot_curves(ax, curves, xlabel="cumulative wire bits per site (ring, N=8)",
                      ylabel=f"test {metric.replace('_', ' ')} of the synchronized parameters "
                      "(mean over seeds)", legend=6)
  harness.save(fig, path, dpi=120)


def setting(args) -> str:
  """The data, model, sites and inner optimizer, in words."""
  if not args.workload:
    return (f"Data set `{args.dataset}`, MLP (64, 64), {SITES} sites x {ROWS} rows per step, "
            "iid, local / inner optimizer SGD lr 0.1 momentum 0.9,")
  wl = workloads.get(args.workload)
  cfg = wl.config(args.quick, **workloads.partition_fields(wl, args.partition))
  return (f"Workload `{args.workload}` ({wl.describe(args.quick)}), {cfg.num_sites} sites x "
          f"{cfg.batch_per_site} rows per step, partition {args.partition}, local / inner "
          f"optimizer {cfg.optimizer} lr {cfg.lr:g}, target {args.target:g},")


def resolve_defaults(args, parser) -> None:
  """Fills ``--steps``, ``--eval-every``, ``--every``, ``--target`` and the metric."""
  args.metric = "accuracy"
  if args.workload:
    wl = workloads.get(args.workload)
    if wl.available():
      parser.error(f"--workload {args.workload}: {wl.available()}")
    cfg = wl.config(args.quick)
    args.metric = wl.metric
    args.steps = args.steps or cfg.steps
    args.eval_every = args.eval_every or cfg.eval_every
    args.target = args.target if args.target is not None else wl.target_for(args.quick)
    args.every = args.every or ("10,50" if not args.quick else "4")
    return
  if args.quick:
    args.steps, args.eval_every, args.seeds, args.every = 20, 10, "0", "4"
  args.steps = args.steps or 600
  args.eval_every = args.eval_every or 50
  args.every = args.every or "10,50,200"
  args.target = 0.9 if args.target is None else args.target


def report_text(args, results, seeds, command: str, seconds: float, planned: int) -> str:
  """The results file: the command, the setting and the table of the ``planned`` runs done so far."""
  done = sum(len(runs) for runs in results.values())
  status = "" if planned == done else f" (partial: {done} of {planned} runs so far)"
  return "\n".join([
      "# Local updates vs all-reduce and gradient compression",
      "",
      f"Command: `{command}` ({seconds:.0f} s on this machine){status}.",
      "",
      setting(args),
      f"{args.steps} steps for every method (equal samples), seeds {seeds} (each seed: its "
      f"own initialization, site batches and method key seed; `dadjax.run.train`). Wire bits "
      f"per site for a ring of N = {SITES} "
      f"(`dadjax.comm.report`); modeled time at {args.bandwidth:g} bit/s and "
      f"{args.latency:g} s per message (latency per recorded call: vmap-simulated sites). "
      f"Accuracy is that of the synchronized parameters (DiLoCo's anchor), evaluated every "
      f"{args.eval_every} steps.",
      "",
      table(results, args),
      "",
  ])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--dataset", default="digits",
                      help="a built-in data set (digits; fashion_mnist where its files exist)")
  parser.add_argument("--partition", default="iid", help="workload partition: iid or non_iid")
  parser.add_argument("--steps", type=int, default=None, help="default 600 (a workload's own)")
  parser.add_argument("--eval-every", type=int, default=None,
                      help="default 50 (a workload's own)")
  parser.add_argument("--every", default=None, help="DiLoCo's H values (default 10,50,200; "
                      "with a workload 10,50)")
  parser.add_argument("--target", type=float, default=None,
                      help="default 0.9 (a workload's own)")
  parser.add_argument("--bandwidth", type=float, default=1e9, help="bits/s between sites")
  parser.add_argument("--latency", type=float, default=1e-3, help="seconds per message")
  parser.add_argument("--also-bandwidths", default="1e10",
                      help="comma-separated further bandwidths (bits/s) of the modeled time to "
                      "the target ('' for none)")
  parser.add_argument("--from-json", default=None,
                      help="render the table from a previous run's <name>.json instead of "
                      "training (its command and wall time are kept)")
  parser.add_argument("--methods", default=None,
                      help="';'-separated method specs to run instead of the default list, "
                      "each SPEC[|FIELD=VALUE...] with Config overrides (demo:lr=0.001|momentum=0)")
  harness.common_args(parser, "local", f"a real workload ({', '.join(workloads.WORKLOADS)}) "
                      "instead of --dataset: its model, data, sites, optimizer, steps and target",
                      quick="a smoke run (seconds per method)")
  argv = sys.argv[1:] if argv is None else list(argv)
  args = parser.parse_args(argv)
  if args.from_json:  # the saved run's settings (workload, metric, steps), then this invocation's
    saved_argv = shlex.split(json.loads(pathlib.Path(args.from_json).read_text())["command"])[2:]
    args = parser.parse_args(saved_argv + argv)
  args.also_bandwidths = [float(b) for b in args.also_bandwidths.split(",") if b.strip()]
  resolve_defaults(args, parser)
  command = harness.command_line("local.py", argv)
  if args.from_json:
    return render_saved(args, command)
  seeds = harness.seeds(args.seeds)
  every = [int(h) for h in args.every.split(",")]
  methods = methods_for(every)
  if args.quick:
    methods = [m for m in methods if m[1] in ("allreduce", "diloco:4",
                                              "diloco:4:compress=qsgd(7)")
               or m[1].startswith("streaming_diloco")][:4]
  if args.methods:
    known = dict((spec, label) for label, spec in methods)
    methods = [(known.get(spec, spec), spec) for spec in args.methods.split(";")]
  t0 = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  planned = len(methods) * len(seeds)
  written = {}

  def done(results):  # written after every run, so a long grid keeps what it has measured
    by_method = {method: runs for (_, method), runs in results.items()}
    seconds = time.perf_counter() - t0
    written["text"] = report_text(args, by_method, seeds, command, seconds, planned)
    (out / f"{args.name}.md").write_text(written["text"])
    save_runs(out / f"{args.name}.json", by_method, seeds, command, seconds, planned)
    (label, _), runs = list(by_method.items())[-1]
    if len(runs) == len(seeds):
      acc = np.mean([r["rows"][-1][f"test_{args.metric}"] for r in runs])
      print(f"{label:48s} {args.metric} {acc:.3f}  ({time.perf_counter() - t0:.0f} s)",
            flush=True)

  results = harness.grid(methods, seeds, lambda _, method, seed: run_one(args, method[1], seed),
                         done=done)
  plot({method: runs for (_, method), runs in results.items()}, out / f"{args.name}.png",
       args.metric)
  print(written["text"])
  return 0


def save_runs(path, by_method: dict, seeds: list[int], command: str, seconds: float,
              planned: int) -> None:
  """Every run's rows and wall time, by ``(label, spec)``, for ``--from-json``."""
  path.write_text(json.dumps({
      "command": command, "seconds": seconds, "planned": planned, "seeds": seeds,
      "methods": [{"label": label, "spec": spec, "runs": runs}
                  for (label, spec), runs in by_method.items()]}, default=float))


def render_saved(args, command: str) -> int:
  """``--from-json``: the table of a saved run at this invocation's ``--target``; ``command``
  (this invocation) is named under the table."""
  saved = json.loads(pathlib.Path(args.from_json).read_text())
  by_method = {(m["label"], m["spec"]): m["runs"] for m in saved["methods"]}
  seeds = saved.get("seeds", harness.seeds(args.seeds))
  text = report_text(args, by_method, seeds, saved["command"], saved["seconds"],
                     saved["planned"])
  text += f"\nRendered again from the saved runs, without training: `{command}`.\n"
  out = pathlib.Path(args.out)
  (out / f"{args.name}.md").write_text(text)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
