"""Time to accuracy on real, shaped links: measured step time next to the model (dadjax.netlab).

Two parts:

1. In the lab (root): 4 sites, one process each, behind links of 10 and 100
   Mbit/s with 0 and 20 ms added one-way delay (the relay for every link);
   every method trains STEPS steps per link and each step is timed; the
   compute-only replica gives the compute time (first link only: it does
   not depend on the link). The model's prediction for the same step is
   compute + modeled communication, textbook (latency = D per compiled op)
   and calibrated (dadjax.comm.GLOO_TCP, latency per operand).
2. Steps to the target test accuracy, 3 seeds, in one process (4 simulated
   sites): the lab's processes train exactly these parameters (the lab test
   checks parameters equal the unshaped run's bit for bit), so the accuracy
   trajectory does not depend on the link and the time to the target is
   steps to target x measured step time.

  python experiments/netlab.py              # the committed table
  python experiments/netlab.py --quick      # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # the accuracy part

from dadjax.netlab import Lab, predicted_comm, run_in_lab  # noqa: E402

METHODS = ["allreduce", "bf16", "powersgd:2", "ef_topk:0.01", "dad", "rank_dad:2",
           "dataquant(bits=4)", "accordion(powersgd:4, powersgd:1)"]
LINKS = [(10e6, 0.0), (10e6, 0.02), (100e6, 0.0), (100e6, 0.02)]
BASE = dict(model="mlp", model_kwargs={"hidden": [256]}, batch_per_site=16, lr=0.1)
SITES = 4


def lab_part(methods, links, steps, timeout):
  configs, rates, delays, first = [], [], [], []
  for m in methods:  # method-major: one compile per method, its links one after the other
    for li, (rate, delay) in enumerate(links):
      configs.append(dict(BASE, method=m, steps=steps))
      rates.append(rate)
      delays.append(delay)
      first.append(li == 0)
  with Lab(SITES, rate=links[0][0], delay=links[0][1], relay=True) as lab:
    runs = run_in_lab(lab, configs, rates=rates, delays=delays,
                      compute_steps=[5 if f else 0 for f in first], ledger=first,
                      evaluate=False, timeout=timeout)
  compute_of, ledger_of = {}, {}
  rows = []
  for cfg, run in zip(configs, runs):
    if run.compute_s:
      compute_of[cfg["method"]] = run.compute_time
    if run.ledger:
      ledger_of[cfg["method"]] = run.ledger
    rows.append({"method": cfg["method"], "rate": run.rate, "delay": run.delay,
                 "step_s": run.step_time, "step_spread": _spread(run.step_s[1:]),
                 })
  for row in rows:
    row["compute_s"] = compute_of[row["method"]]
    row["ledger"] = ledger_of[row["method"]]
    pred = predicted_comm(row["ledger"], row["rate"], row["delay"], SITES)
    row["textbook_s"] = row["compute_s"] + pred["textbook"]
    row["calibrated_s"] = row["compute_s"] + pred["calibrated"]
  return rows


def _spread(xs):
  if len(xs) < 2:
    return 0.0
  return (max(xs) - min(xs)) / statistics.median(xs)


def accuracy_part(methods, seeds, target, max_steps):
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  out = {}
  for m in methods:
    steps = []
    for seed in seeds:
      run = train(Config(**BASE, method=m, num_sites=SITES, steps=max_steps, eval_every=10,
                         seed=seed), progress=False)
      curve = [(r["step"], r["test_accuracy"]) for r in run.history]
      steps.append(curve)
      print(f"  {m} seed {seed}: target at step {steps_to(curve, target)}, final "
            f"{curve[-1][1]:.3f}", flush=True)
    out[m] = steps
  return out


def steps_to(curve, target):
  """First evaluated step with test accuracy >= target (None: never)."""
  return next((step for step, acc in curve if acc >= target), None)


def write(rows, to_target, target, command, wall, out):
  lines = [
      "# Time to accuracy on real links (dadjax.netlab)", "",
      f"Command: `{command}` (root; {wall / 60:.1f} min on 2 CPU cores shared with other jobs: "
      "every time here is noisy; the spread column is (max - min) / median over the measured "
      "steps).", "",
      f"Workload: digits, MLP hidden [256] (19k parameters), {SITES} sites x 16 rows per step, "
      f"sgd 0.1 with momentum 0.9. Target: test accuracy >= {target}. Steps to target: 3 seeds in "
      "one process (the lab's processes train the same parameters bit for bit), time to target "
      "= steps to target (median of the seeds) x measured step time.", "",
      "Modeled step = measured compute (the one-site replica) + modeled communication: "
      "textbook = ring with latency = D per compiled op; calibrated = "
      "`NetworkModel.calibrated` (dadjax.comm.GLOO_TCP) per operand (gloo call).", "",
      "| link | method | measured step ms | spread | compute ms | textbook ms | calibrated ms | "
      "measured / textbook | measured / calibrated | steps to target (seeds) | "
      "time to target s |",
      "|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    seeds = [steps_to(curve, target) for curve in to_target.get(r["method"], [])]
    hits = [s for s in seeds if s is not None]
    med = statistics.median(hits) if len(hits) == len(seeds) and hits else None
    ttt = f"{med * r['step_s']:.1f}" if med is not None else "not reached"
    lines.append(
        f"| {r['rate'] / 1e6:g} Mbit/s, {r['delay'] * 1e3:g} ms | {r['method']} | "
        f"{r['step_s'] * 1e3:.0f} | {100 * r['step_spread']:.0f}% | {r['compute_s'] * 1e3:.1f} | "
        f"{r['textbook_s'] * 1e3:.0f} | {r['calibrated_s'] * 1e3:.0f} | "
        f"{r['step_s'] / r['textbook_s']:.2f} | {r['step_s'] / r['calibrated_s']:.2f} | "
        f"{', '.join(str(s) for s in seeds)} | {ttt} |")
  lines += ["", "Ledger of each method's step (per site): payload bits and compiled ops / "
            "operands (gloo calls).", "", "| method | reduce bits | gather bits | reduce ops / "
            "operands | gather ops / operands |", "|---|---|---|---|---|"]
  seen = set()
  for r in rows:
    if r["method"] in seen:
      continue
    seen.add(r["method"])
    b = r["ledger"]
    lines.append(f"| {r['method']} | {b.get('reduce_bits')} | {b.get('gather_bits')} | "
                 f"{b.get('reduce_ops')} / {b.get('reduce_operands')} | {b.get('gather_ops')} / "
                 f"{b.get('gather_operands')} |")
  out.write_text("\n".join(lines) + "\n")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--steps", type=int, default=12, help="timed steps per method and link")
  parser.add_argument("--target", type=float, default=0.95)
  parser.add_argument("--max-steps", type=int, default=300)
  parser.add_argument("--methods", help="comma-separated (default: all)")
  parser.add_argument("--part", choices=["lab", "accuracy", "all"], default="all",
                      help="run one part (results are kept next to --out; the table is written "
                      "once both exist)")
  parser.add_argument("--out", default=str(ROOT / "experiments" / "results" / "netlab.md"))
  args = parser.parse_args()
  methods = args.methods.split(",") if args.methods else METHODS
  links = LINKS[:1] if args.quick else LINKS
  seeds = [0] if args.quick else [0, 1, 2]
  out = pathlib.Path(args.out)
  out.parent.mkdir(parents=True, exist_ok=True)
  lab_file, acc_file = out.with_suffix(".json"), out.with_name(out.stem + "_accuracy.json")
  t0 = time.time()
  if args.part in ("lab", "all"):
    rows = lab_part(methods, links, 4 if args.quick else args.steps, timeout=3600)
    lab_file.write_text(json.dumps({"rows": rows, "wall_s": time.time() - t0}, indent=0))
    print(f"lab part: {time.time() - t0:.0f} s", flush=True)
  if args.part in ("accuracy", "all"):
    t1 = time.time()
    to_target = accuracy_part(methods, seeds, args.target, 60 if args.quick else args.max_steps)
    acc_file.write_text(json.dumps({"steps": to_target, "wall_s": time.time() - t1}))
  if lab_file.exists() and acc_file.exists():
    lab, acc = json.loads(lab_file.read_text()), json.loads(acc_file.read_text())
    command = "python experiments/netlab.py" + (" --quick" if args.quick else "")
    write(lab["rows"], acc["steps"], args.target, command, lab["wall_s"] + acc["wall_s"], out)
    print(out.read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
