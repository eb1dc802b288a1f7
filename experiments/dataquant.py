"""Quantizing data instead of gradients, against gradient compressors and dAD (issue 11).

The regime the method targets: model dimension much larger than data
dimension. A wide MLP and a small CNN on the embedded 8x8 digits (64
features per row), 8 sites, iid split, SGD with momentum, the same
initialization and batches for every method. Every method is trained with
``--seeds`` seeds; reported (mean +- std over seeds):

* the final test accuracy and the wire bits each site puts on a ring per
  step (an all-reduce payload of B bits costs 2 (N-1)/N B, an all-gather
  payload (N-1) B: data quantization and dAD all-gather, the gradient
  compressors all-reduce), and the modeled communication time per step
  (:class:`dadjax.NetworkModel`, ``--bandwidth`` bit/s, ``--latency`` s per
  message);
* the wire bits per site and the modeled communication seconds until the
  test accuracy first reaches ``--target`` (evaluated every
  ``--eval-every`` steps);
* the compute cost: rows through a backward pass per site per step
  (data quantization runs the shared backward pass on all ``N R`` rows).

A width sweep then reads the bits per step of one step of the MLP at
growing hidden widths: data quantization's payload depends on the data, not
the model, so it stays flat while the gradient compressors' grows.

Usage (from the repository root)::

  .venv/bin/python experiments/dataquant.py                      # the full run (~15 min, 2 cores)
  .venv/bin/python experiments/dataquant.py --steps 4 --seeds 0 --models mlp \
      --methods allreduce,dataquant:2:classes=10 --widths 16,32  # a smoke run

Writes ``<out>/dataquant.md`` (tables + the command) and ``<out>/dataquant.png``.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

harness.host_devices(8)
from dadjax import registry  # noqa: E402  pylint: disable=g-import-not-at-top
from dadjax.run import Config, to_target, train  # noqa: E402  pylint: disable=g-import-not-at-top

import workloads  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

QUICK = False  # --quick: the workloads at their quick sizes
PARTITION: dict = {}  # --partition non_iid: the workload's non-IID split
SITES, ROWS = 8, 16
BANDWIDTH, LATENCY = 1e9, 50e-6  # the modeled link: --bandwidth (bit/s), --latency (s/message)

MODELS = {
    "mlp": ("mlp", {"hidden": [512, 512]}),  # 300k parameters on 64 features
    "cnn": ("cnn", {"features": [16, 32], "hidden": 256}),
}

# spec -> learning rate (SGD, momentum 0.9)
METHODS = {
    "allreduce": 0.1,
    "qsgd:4": 0.1,
    "ef_topk:0.01": 0.1,
    "powersgd:2": 0.1,
    "rank_dad:2": 0.1,
    "qdad:4": 0.1,
    "dataquant:1:classes=10": 0.1,
    "dataquant:2:classes=10": 0.1,
    "dataquant:4:classes=10": 0.1,
    "dataquant:1:correct=ef_scaled_sign:classes=10": 0.1,
    "dataquant:2:gate=0.5:gate_mode=sample:classes=10": 0.1,
    "dataquant:2:correct=ef_scaled_sign:gate=0.5:gate_mode=sample:classes=10": 0.1,
}
GRADIENT_COMPRESSORS = ("qsgd:4", "ef_topk:0.01", "powersgd:2")
SWEEP_METHODS = ("allreduce", "qsgd:4", "ef_topk:0.01", "powersgd:2", "rank_dad:2",
                 "dataquant:2:classes=10")


def available(spec: str) -> bool:
  try:
    registry.resolve("method", spec)
    return True
  except registry.SpecError:
    return False


def config_for(model: str, spec: str, seed: int, steps: int, eval_every: int,
               width: int | None = None) -> Config:
  if model in workloads.WORKLOADS:  # a real workload (Fashion-MNIST), --workload
    wl = workloads.get(model)
    return wl.config(QUICK, method=spec, seed=seed, steps=steps, eval_every=eval_every,
                     bandwidth=BANDWIDTH, latency=LATENCY, **PARTITION)
  name, kwargs = MODELS[model]
  if width is not None:
    kwargs = {"hidden": [width, width]}
  return Config(model=name, model_kwargs=kwargs, method=spec, num_sites=SITES, backend="vmap",
                batch_per_site=ROWS, steps=steps, eval_every=eval_every, seed=seed,
                lr=METHODS.get(spec, 0.1), bandwidth=BANDWIDTH, latency=LATENCY)


def run_one(model, spec, seed, steps, eval_every):
  """``(run, wall seconds)`` of one :func:`dadjax.run.train` run."""
  print(f"{model}: {spec} seed {seed}", flush=True)
  t0 = time.perf_counter()
  run = train(config_for(model, spec, seed, steps, eval_every), progress=False)
  return run, time.perf_counter() - t0


def task_table(model, results, target) -> tuple[str, dict]:
  if model in workloads.WORKLOADS:
    cfg = config_for(model, "allreduce", 0, 1, 1)
    what = (f"{workloads.get(model).describe(QUICK)} ({cfg.partition}), {cfg.num_sites} sites x "
            f"{cfg.batch_per_site} rows, lr {cfg.lr:g}")
  else:
    what = f"{MODELS[model][1]}, {SITES} sites x {ROWS} rows"
  rows, bits_to_target = [], {}
  for spec, runs in results.items():
    finals = [r.final for r, _ in runs]
    per_step = [f["total_wire_bits"] / f["step"] for f in finals]
    ms_per_step = [1e3 * f["modeled_comm_s"] / f["step"] for f in finals]
    reached = [to_target(r.history, "test_accuracy", target) for r, _ in runs]
    bits_to_target[spec] = [r.bits if r else float("nan") for r in reached]
    _, bits_to, seconds_to = harness.to_target_cells([r.history for r, _ in runs],
                                                     "test_accuracy", target)
    backward = [f.get("backward_rows_per_step", ROWS) for f in finals]
    rows.append([spec, harness.mean_std([f["test_accuracy"] for f in finals], "{:.3f}", "{:.3f}"),
                 f"{np.mean(per_step):,.0f}", f"{np.mean(ms_per_step):.3g}", bits_to, seconds_to,
                 int(np.max(backward)), f"{np.mean([t for _, t in runs]):.1f}"])
  return (f"### {model}: {what}, target test accuracy {target}\n\n" + harness.table(
      ["method", "test acc", "wire bits/step/site", "modeled comm ms/step", "wire bits to target",
       "modeled comm s to target", "backward rows/step/site", "wall s/run"], rows),
          bits_to_target)


def verdict(model, bits_to_target) -> str:
  def best(specs):
    scored = [(np.nanmean(bits_to_target[s]), s) for s in specs if s in bits_to_target
              and not np.all(np.isnan(bits_to_target[s]))]
    return min(scored) if scored else None

  grad = best([s for s in GRADIENT_COMPRESSORS])
  data = best([s for s in bits_to_target if s.startswith("dataquant")])
  if grad is None or data is None:
    return f"- {model}: target not reached by " + (
        "any gradient compressor" if grad is None else "any data quantization") + "."
  ratio = grad[0] / data[0]
  ok = "met" if ratio >= 10 else "NOT met"
  return (f"- {model}: best data quantization `{data[1]}` reaches the target with "
          f"{data[0]:.3g} wire bits/site, the best gradient compressor `{grad[1]}` with "
          f"{grad[0]:.3g}: {ratio:.1f}x fewer ({ok}: target >= 10x).")


def width_sweep(widths, steps=1) -> tuple[str, dict]:
  lines = ["### Width sweep: MLP hidden (w, w), wire bits/step/site", "",
           "| method | " + " | ".join(f"w={w}" for w in widths) + " |",
           "|---|" + "---|" * len(widths)]
  sweep = {}
  for spec in [s for s in SWEEP_METHODS if available(s)]:
    bits = []
    for w in widths:
      run = train(config_for("mlp", spec, 0, steps, steps, width=w), progress=False)
      bits.append(run.final["total_wire_bits"] / run.final["step"])
    sweep[spec] = bits
    lines.append(f"| {spec} | " + " | ".join(f"{b:,.0f}" for b in bits) + " |")
  return "\n".join(lines), sweep


def plot(curves, sweep, widths, path) -> None:
  plt = harness.pyplot()
  fig, axes = plt.subplots(1, len(curves) + 1, figsize=(5.5 * (len(curves) + 1), 4.5))
  for i, (ax, (model, results)) in enumerate(zip(axes, curves.items())):
    lines = {spec: ([row["total_wire_bits"] for row in runs[0][0].history],
                    np.mean([[row["test_accuracy"] for row in r.history] for r, _ in runs], 0))
             for spec, runs in results.items()}
    harness.plot_curves(ax, lines, xlabel="cumulative wire bits per site (ring)",
                        ylabel="test accuracy (mean over seeds)", title=f"{model}, {SITES} sites",
                        legend=6 if i == 0 else None)
  ax = axes[-1]
  harness.plot_curves(ax, {spec: (widths, bits) for spec, bits in sweep.items()}, logx=False,
                      xlabel="MLP hidden width", ylabel="wire bits per step per site",
                      title="bits/step vs model width", legend=6)
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  harness.save(fig, path)


def main(argv=None) -> int:
  global QUICK, PARTITION, BANDWIDTH, LATENCY  # pylint: disable=global-statement
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--models", default="mlp,cnn")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--steps", type=int, default=None,
                      help="default 120 (a workload: its own, 300)")
  parser.add_argument("--eval-every", type=int, default=None,
                      help="default 10 (a workload: its own, 50)")
  parser.add_argument("--target", type=float, default=None,
                      help="test accuracy to reach (default 0.92; a workload: its own)")
  parser.add_argument("--widths", default="64,256,1024")
  harness.common_args(parser, "dataquant", "comma-separated real workloads (fashion_mlp, "
                      "fashion_cnn) instead of --models")
  parser.add_argument("--partition", default="iid", help="workload partition: iid or non_iid")
  parser.add_argument("--bandwidth", type=float, default=BANDWIDTH,
                      help="modeled link bandwidth, bit/s (default 1e9)")
  parser.add_argument("--latency", type=float, default=LATENCY,
                      help="modeled latency per message, s (default 50e-6)")
  args = parser.parse_args(argv)
  QUICK = args.quick
  BANDWIDTH, LATENCY = args.bandwidth, args.latency
  if args.workload:
    for name in args.workload.split(","):
      wl = workloads.get(name)
      if wl.available():
        parser.error(f"--workload {name}: {wl.available()}")
      PARTITION = workloads.partition_fields(wl, args.partition)
    args.models = args.workload
    first = workloads.get(args.workload.split(",")[0])
    first_config = first.config(QUICK)
    args.steps = args.steps or first_config.steps
    args.eval_every = args.eval_every or first_config.eval_every
    if args.target is None:
      args.target = first.target_for(QUICK)
  args.steps = args.steps or 120
  args.eval_every = args.eval_every or 10
  args.target = 0.92 if args.target is None else args.target
  seeds = harness.seeds(args.seeds)
  widths = [int(w) for w in args.widths.split(",")] if args.widths != "none" else []
  methods = registry.split_specs(args.methods)
  skipped = [m for m in methods if not available(m)]
  methods = [m for m in methods if available(m)]
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  t0 = time.perf_counter()
  sections, curves, verdicts = [], {}, []
  models = args.models.split(",")
  runs = harness.grid(methods, seeds, lambda model, spec, seed: run_one(
      model, spec, seed, args.steps, args.eval_every), settings=models)
  for model in models:
    results = {spec: runs[(model, spec)] for spec in methods}
    table, bits_to_target = task_table(model, results, args.target)
    print(table, flush=True)
    sections.append(table)
    curves[model] = results
    verdicts.append(verdict(model, bits_to_target))
  sweep_table, sweep = width_sweep(widths) if widths else ("(Width sweep not run.)", {})
  print(sweep_table, flush=True)
  plot(curves, sweep, widths, out / f"{args.name}.png")
  command = harness.command_line("dataquant.py", sys.argv[1:] if argv is None else argv)
  lr_text = "lr 0.1" if not args.workload else (
      f"lr {config_for(args.models.split(',')[0], 'allreduce', 0, 1, 1).lr:g}"
      + (", quick sizes" if QUICK else ""))
  harness.write_results(
      out / f"{args.name}.md", "Data quantization against gradient compressors and dAD", command,
      *sections,
      "### Against the target (>= 10x fewer wire bits than the best gradient compressor)",
      "\n".join(verdicts),
      sweep_table,
      NOTES.format(bandwidth=BANDWIDTH, latency=LATENCY, latency_per=latency_per(curves))
      + (f"\n- Not run (not registered in this build): {', '.join(skipped)}."
               if skipped else ""),
      note=f" ({time.perf_counter() - t0:.0f} s on the CPU, vmap backend, seeds {seeds}, "
      f"{args.steps} steps, SGD momentum 0.9, {lr_text}).")
  print(f"wrote {out / f'{args.name}.md'} and {out / f'{args.name}.png'}")
  return 0


def latency_per(curves) -> str:
  """How the runs' reports charged latency: per compiled op or per recorded call."""
  kinds = {r.final["latency_per"] for results in curves.values()
           for runs in results.values() for r, _ in runs}
  return " / ".join(sorted(kinds))


NOTES = """Notes.
- Wire bits are the train state's ledgers (`dadjax.comm_stats`) on a ring of N sites
  (`dadjax.comm.report`): per site, all-reduce payloads cost 2 (N-1)/N B and all-gather
  payloads (N-1) B. Data quantization and dAD all-gather, so each of
  their payload bits costs N/2 = 4 times more on the wire than an all-reduced bit. For a gated
  stage the ledger holds the padded payload the compiled all-gather moves; the rows actually sent
  (`useful_bits_per_step` in the metrics rows) are fewer.
- Every ledger also holds the metrics' `pmean` (2 fp32 scalars per step), the same for all.
- Compute: data quantization runs the shared backward pass on all N R = 128 rows on every site
  (8x the rows of the other methods), plus 2 R for a correction step; that is the price of its
  bits. `backward rows/step/site` is the last step's count.
- Modeled comm time: `dadjax.NetworkModel` at {bandwidth:g} bit/s and {latency:g} s per message
  (ring; latency per {latency_per}), communication only: data quantization's 8x compute is not
  in it.
- Wire bits (modeled comm s) to target: the cumulative wire bits per site (modeled seconds) at
  the first evaluation (every `--eval-every` steps) whose test accuracy reaches the target; the
  mean is over the seeds that reached it."""


if __name__ == "__main__":
  sys.exit(main())
