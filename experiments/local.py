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

Every ``--eval-every`` steps the *synchronized* parameters (the anchor,
``LocalState.evaluation_params``) are evaluated on the test set. The
ledger goes through :func:`dadjax.comm.report` for a ring of ``N = 8``
sites (``--bandwidth``, ``--latency``): wire bits per site (mean per step,
cumulative), the busiest step's modeled time (a synchronization step) and
the modeled communication time; with vmap-simulated sites latency is
charged per recorded collective call. Reported over ``--seeds`` (mean ±
std): final test accuracy, wire bits per site and modeled time until the
test accuracy first reaches ``--target``.

Usage (from the repository root)::

  .venv/bin/python experiments/local.py            # the default run (about 15 min on 2 cores)
  .venv/bin/python experiments/local.py --quick    # a smoke run (about 1 min)
  .venv/bin/python experiments/local.py --workload fashion_mlp   # a real workload (its model,
      # data, optimizer, steps and target; DiLoCo H in 10,50; --partition non_iid)

Writes ``<out>/local.md`` (tables + the exact command) and ``<out>/local.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from dadjax.comm import NetworkModel, report  # pylint: disable=g-import-not-at-top
from dadjax.config import Config  # pylint: disable=g-import-not-at-top
from dadjax.train import build, evaluate  # pylint: disable=g-import-not-at-top

ROOT = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
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


def _eval_state(state):
  """The state with the parameters evaluation should read (a local method's anchor)."""
  has = lambda x: callable(getattr(type(x), "evaluation_params", None))
  for node in jax.tree.leaves(state.opt_state, is_leaf=has):
    if has(node):
      return state._replace(params=node.evaluation_params(state.params))
  return state


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
  """The run's Config: the MLP (64, 64) on ``--dataset``, or a ``--workload``'s."""
  spec, overrides = split_entry(spec)
  if args.workload:
    wl = workloads.get(args.workload)
    return wl.config(args.quick, method=spec, seed=seed, steps=args.steps,
                     **{**workloads.partition_fields(wl, args.partition), **overrides})
  return Config(**{**dict(dataset=args.dataset, model="mlp", model_kwargs={"hidden": [64, 64]},
                          method=spec, num_sites=SITES, backend="vmap", batch_per_site=ROWS,
                          steps=args.steps, seed=seed, lr=0.1, momentum=0.9), **overrides})


def run_one(args, spec: str, seed: int, network: NetworkModel, steps_cache: dict) -> dict:
  config = config_for(args, spec, seed)
  dataset, _, batcher, step_fn = build(config)
  # One compiled step per method: the seeds change the initialization and the
  # site batches; the method's own key seed (stochastic rounding) stays the first seed's.
  step_fn = steps_cache.setdefault(spec, step_fn)
  state = step_fn.init(jax.random.key(seed), dataset.x_train[:config.batch_per_site])
  curve = []
  t0 = time.perf_counter()
  for step in range(args.steps):
    x, y = batcher.batch_at(step)
    state, _ = step_fn(state, {"x": x, "y": y})
    done = step + 1
    if done % args.eval_every == 0 or done == args.steps:
      test = evaluate(step_fn, _eval_state(state), dataset.x_test, dataset.y_test)
      acc = workloads.metric_of(test, args.metric)
      rep = report(state, network)
      curve.append((done, acc, rep.total_wire_bits, rep.modeled_comm_s))
  rep = report(state, network)
  return {"curve": curve, "report": rep, "wall_s": time.perf_counter() - t0}


def to_target(curve, target: float, metric: str = "accuracy") -> tuple[float, float, float]:
  """(step, cumulative wire bits per site, modeled comm seconds) when the metric first reaches
  ``target`` (accuracy: >=, bits per byte: <=)."""
  for step, acc, bits, secs in curve:
    if (acc >= target) if metric == "accuracy" else (acc <= target):
      return step, bits, secs
  return float("nan"), float("nan"), float("nan")


def _mean(values, fmt="{:.3g}") -> str:
  v = np.asarray(values, float)
  ok = v[~np.isnan(v)]
  if not len(ok):
    return "not reached"
  text = fmt.format(ok.mean()) + (f" ± {ok.std():.2g}" if len(ok) > 1 else "")
  return text if len(ok) == len(v) else f"{text} ({len(ok)}/{len(v)} seeds)"


def cell(text: str) -> str:
  """``text`` for a markdown table cell (a ``|`` of a method's Config overrides escaped)."""
  return text.replace("|", "\\|")


def table(results, args) -> str:
  name = "test acc" if args.metric == "accuracy" else "test bits/byte"
  lines = [f"| method | spec | {name} | wire bits/step/site | peak comm s/step | "
           f"total wire bits/site | modeled comm s | steps to {args.target} | "
           f"wire bits to {args.target} | modeled s to {args.target} | wall s/run |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
  for (label, spec), runs in results.items():
    acc = [r["curve"][-1][1] for r in runs]
    reps = [r["report"] for r in runs]
    reach = [to_target(r["curve"], args.target, args.metric) for r in runs]
    lines.append(
        f"| {cell(label)} | `{cell(spec)}` | {np.mean(acc):.3f} ± {np.std(acc):.3f} | "
        f"{np.mean([p.wire_bits_per_step for p in reps]):,.0f} | "
        f"{np.mean([p.peak_comm_s_per_step for p in reps]):.3g} | "
        f"{np.mean([p.total_wire_bits for p in reps]):.3g} | "
        f"{np.mean([p.modeled_comm_s for p in reps]):.3g} | "
        f"{_mean([s for s, _, _ in reach], '{:.0f}')} | {_mean([b for _, b, _ in reach])} | "
        f"{_mean([t for _, _, t in reach])} | {np.mean([r['wall_s'] for r in runs]):.1f} |")
  return "\n".join(lines)


def plot(results, path, metric: str = "accuracy") -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(9, 5.5))
  colors = plt.cm.tab20.colors
  for i, ((label, _), runs) in enumerate(results.items()):
    acc = np.mean([[a for _, a, _, _ in r["curve"]] for r in runs], axis=0)
    bits = np.mean([[max(b, 1.0) for _, _, b, _ in r["curve"]] for r in runs], axis=0)
    ax.plot(bits, acc, marker="os^vD"[i % 5], ms=3, color=colors[i % len(colors)], label=label)
  ax.set_xscale("log")
  ax.set_xlabel("cumulative wire bits per site (ring, N=8)")
  ax.set_ylabel(f"test {metric.replace('_', ' ')} of the synchronized parameters "
                "(mean over seeds)")
  ax.legend(fontsize=6, ncol=2)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


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
      f"Command: `{command.strip()}` ({seconds:.0f} s on this machine){status}.",
      "",
      setting(args),
      f"{args.steps} steps for every method (equal samples), seeds {seeds} (each seed: its "
      f"own initialization and site "
      f"batches; one compiled step per method, so a compressor's key seed is the first "
      f"seed's). Wire bits per site for a ring of N = {SITES} "
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
  parser.add_argument("--workload", default=None,
                      help=f"a real workload ({', '.join(workloads.WORKLOADS)}) instead of "
                      "--dataset: its model, data, sites, optimizer, steps and target")
  parser.add_argument("--partition", default="iid", help="workload partition: iid or non_iid")
  parser.add_argument("--steps", type=int, default=None, help="default 600 (a workload's own)")
  parser.add_argument("--eval-every", type=int, default=None,
                      help="default 50 (a workload's own)")
  parser.add_argument("--seeds", default="0,1,2")
  parser.add_argument("--every", default=None, help="DiLoCo's H values (default 10,50,200; "
                      "with a workload 10,50)")
  parser.add_argument("--target", type=float, default=None,
                      help="default 0.9 (a workload's own)")
  parser.add_argument("--bandwidth", type=float, default=1e9, help="bits/s between sites")
  parser.add_argument("--latency", type=float, default=1e-3, help="seconds per message")
  parser.add_argument("--methods", default=None,
                      help="';'-separated method specs to run instead of the default list, "
                      "each SPEC[|FIELD=VALUE...] with Config overrides (demo:lr=0.001|momentum=0)")
  parser.add_argument("--quick", action="store_true", help="a smoke run (seconds per method)")
  parser.add_argument("--out", default=str(ROOT / "results"))
  parser.add_argument("--name", default="local", help="stem of the written .md and .png")
  args = parser.parse_args(argv)
  resolve_defaults(args, parser)
  seeds = [int(s) for s in args.seeds.split(",")]
  every = [int(h) for h in args.every.split(",")]
  methods = methods_for(every)
  if args.quick:
    methods = [m for m in methods if m[1] in ("allreduce", "diloco:4",
                                              "diloco:4:compress=qsgd(7)")
               or m[1].startswith("streaming_diloco")][:4]
  if args.methods:
    known = dict((spec, label) for label, spec in methods)
    methods = [(known.get(spec, spec), spec) for spec in args.methods.split(";")]
  network = NetworkModel(bandwidth=args.bandwidth, latency=args.latency, num_sites=SITES)
  results: dict = {}
  t0 = time.perf_counter()
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python experiments/local.py " + " ".join(sys.argv[1:] if argv is None else argv)
  for label, spec in methods:
    cache: dict = {}
    for seed in seeds:
      results.setdefault((label, spec), []).append(run_one(args, spec, seed, network, cache))
      # written after every run, so a long grid keeps what it has measured
      text = report_text(args, results, seeds, command, time.perf_counter() - t0,
                         len(methods) * len(seeds))
      (out / f"{args.name}.md").write_text(text)
    acc = np.mean([r["curve"][-1][1] for r in results[(label, spec)]])
    print(f"{label:48s} {args.metric} {acc:.3f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
  plot(results, out / f"{args.name}.png", args.metric)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
