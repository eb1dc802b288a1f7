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

Local-update methods (DiLoCo, local SGD) communicate on one step in H: they
train --local-steps steps (a whole number of periods, so the ledger's mean
per step is exact and every position of the period is sampled); their
measured step is the mean per optimizer step over a period
(LabRun.period_step_time) and the model charges the sync branch's compiled
ops once per H steps (NetworkModel.step_time with the PeriodicStats ledger).
Accordion's prediction counts the lax.cond branches its steps took
(dadjax.comm.match_branches on the ledger's bits).

  python experiments/netlab.py              # the committed table
  python experiments/netlab.py --quick      # smoke run
  python experiments/netlab.py --methods diloco:10,local_sgd:10   # add rows, keep the others
  python experiments/netlab.py --repredict  # recompute the model columns of the stored rows

The accuracy part trains with :func:`dadjax.run.train`; the lab part runs the
same Config in the lab's processes (:func:`dadjax.netlab.run_in_lab`), which
time every step behind the shaped links. Steps to target:
:func:`dadjax.run.to_target`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")  # the accuracy part

from dadjax.netlab import Lab, LabRun, predicted_comm, run_in_lab  # noqa: E402
from dadjax.run import to_target  # noqa: E402
from harness import uptime  # noqa: E402  pylint: disable=g-import-not-at-top

METHODS = ["allreduce", "bf16", "powersgd:2", "ef_topk:0.01", "dad", "rank_dad:2",
           "dataquant(bits=4)", "accordion(powersgd:4, powersgd:1)", "diloco:10", "local_sgd:10"]
LINKS = [(10e6, 0.0), (10e6, 0.02), (100e6, 0.0), (100e6, 0.02)]
BASE = dict(model="mlp", model_kwargs={"hidden": [256]}, batch_per_site=16, lr=0.1)
SITES = 4


def is_local(method: str) -> bool:
  """Whether ``method`` is a local-update method (communicates on some steps only)."""
  import dadjax.methods  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  from dadjax.registry import lookup, parse_spec  # pylint: disable=g-import-not-at-top
  entry = lookup("method", parse_spec(method).name)
  return entry is not None and entry.family == "local"


def lab_part(methods, links, steps, local_steps, timeout):
  configs, rates, delays, first = [], [], [], []
  for m in methods:  # method-major: one compile per method, its links one after the other
    for li, (rate, delay) in enumerate(links):
      configs.append(dict(BASE, method=m, steps=local_steps if is_local(m) else steps))
      rates.append(rate)
      delays.append(delay)
      first.append(li == 0)
  with Lab(SITES, rate=links[0][0], delay=links[0][1], relay=True) as lab:
    runs = run_in_lab(lab, configs, rates=rates, delays=delays,
                      compute_steps=[5 if f else 0 for f in first], ledger=first,
                      evaluate=False, timeout=timeout)
  compute_of, ledger_of = {}, {}
  for cfg, run in zip(configs, runs):
    if run.compute_s:
      compute_of[cfg["method"]] = run.compute_time
    if run.ledger:
      ledger_of[cfg["method"]] = run.ledger
  rows = []
  for cfg, run in zip(configs, runs):
    ledger = ledger_of[cfg["method"]]
    row = {"method": cfg["method"], "rate": run.rate, "delay": run.delay, "steps": cfg["steps"],
           "step_times": run.step_s, "compute_s": compute_of[cfg["method"]], "ledger": ledger}
    rate = ledger.get("exchange_rate")
    if rate is not None and cfg["steps"] * rate != int(cfg["steps"] * rate):
      raise SystemExit(f"{cfg['method']}: {cfg['steps']} steps are not a whole number of periods "
                       f"of {1 / rate:g}; pass --local-steps as a multiple of H")
    rows.append(measure(row))
  return [predict(r) for r in rows]


def measure(row):
  """The measured columns of a row from its step times (the first step compiles)."""
  rate = row["ledger"].get("exchange_rate")
  period = max(1, round(1 / rate)) if rate else 1
  run = LabRun(SITES, row["rate"], row["delay"], row["step_times"], [], [], [], {}, [])
  row["step_s"] = run.period_step_time(period)
  row["step_spread"] = _spread(row["step_times"][1:])
  if period > 1:  # steps t (from 1) with t % H == 0 synchronize (one fragment)
    times = list(enumerate(row["step_times"], start=1))[1:]
    sync = [s for t, s in times if t % period == 0]
    other = [s for t, s in times if t % period]
    row["sync_step_s"], row["local_step_s"] = statistics.median(sync), statistics.median(other)
    # the spread within each kind of step (the kinds differ by design)
    row["step_spread"], row["sync_spread"] = _spread(other), _spread(sync)
  return row


def predict(row):
  """The model columns of a row: measured compute + modeled communication (both models)."""
  pred = predicted_comm(row["ledger"], row["rate"], row["delay"], SITES)
  row["textbook_s"] = row["compute_s"] + pred["textbook"]
  row["calibrated_s"] = row["compute_s"] + pred["calibrated"]
  if "calibrated_peak" in pred:  # the sync step
    row["textbook_sync_s"] = row["compute_s"] + pred["textbook_peak"]
    row["calibrated_sync_s"] = row["compute_s"] + pred["calibrated_peak"]
  return row


def repredict(rows, methods):
  """Recompute the model columns of stored rows with branch-aware op counts.

  The rows stored before the lab read the branches a step took lack
  ``ledger["ops"]``. The same step is compiled here for 4 simulated sites
  (one process). A step without conditional collectives keeps the lab's
  counts (one process may combine operands differently: bf16's 6 are 3
  there). One with them must have the lab's op and operand counts and
  bytes; then :func:`dadjax.comm.match_branches` finds the branches whose
  collectives carry the stored ledger's bits (the last timed step's).
  """
  import jax  # pylint: disable=g-import-not-at-top
  from dadjax.comm import hlo_collectives, match_branches, taken_collectives  # pylint: disable=g-import-not-at-top
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import build  # pylint: disable=g-import-not-at-top
  texts = {}
  for row in rows:
    if row["method"] not in methods:
      continue
    if "step_times" in row:  # a row that kept its step times: measured again, same rule
      measure(row)
    if "ops" in row["ledger"]:
      predict(row)
      continue
    m, book = row["method"], row["ledger"]
    if m not in texts:
      dataset, _, batcher, step_fn = build(Config(**BASE, method=m, num_sites=SITES, steps=12))
      state = step_fn.init(jax.random.key(0), dataset.x_train[:BASE["batch_per_site"]])
      x, y = batcher.batch_at(0)
      texts[m] = step_fn._run.lower(state, step_fn.place_batch(  # pylint: disable=protected-access
          {"x": x, "y": y})).compile().as_text()
    text = texts[m]
    every = hlo_collectives(text)
    here = (every.count["reduce"], every.count["gather"], every.operands["reduce"],
            every.operands["gather"], every.nbytes["reduce"], every.nbytes["gather"])
    lab = tuple(book[k] for k in ("reduce_ops", "gather_ops", "reduce_operands",
                                  "gather_operands", "reduce_op_bytes", "gather_op_bytes"))
    if not any(every.conditional_count.values()):  # nothing to choose: the lab's counts stand
      row["ops_from"] = "the lab's (no conditional collectives)"
      continue
    if here != lab:  # (XLA may combine differently in one process: bf16's 6 operands are 3 here)
      raise SystemExit(f"{m}: the recompiled step's collectives {here} differ from the lab's {lab}")
    book["taken"] = match_branches(text, book["reduce_bits"], book["gather_bits"])
    ops = taken_collectives(text, book["taken"])
    book["ops"] = {k: dict(v) for k, v in dataclasses.asdict(ops).items()}
    row["ops_from"] = "recompiled for 4 simulated sites; totals equal the lab's"
    predict(row)
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
  """First evaluated step with test accuracy >= target (None: never); ``curve``: the stored
  ``(step, test accuracy)`` pairs."""
  reached = to_target([{"step": step, "test_accuracy": acc} for step, acc in curve],
                      "test_accuracy", target)
  return reached.step if reached else None


def _charged(book):
  """(reduce ops, reduce operands, gather ops, gather operands) the model charges per step."""
  ops = book.get("ops")
  if ops is None:
    return (book.get("reduce_ops"), book.get("reduce_operands"), book.get("gather_ops"),
            book.get("gather_operands"))
  rate = book.get("exchange_rate") or 1.0
  pick = lambda field, kind: (ops[field].get(kind, 0) - ops["conditional_" + field].get(kind, 0)
                              + rate * ops["conditional_" + field].get(kind, 0))
  return tuple(f"{pick(f, k):g}" for k in ("reduce", "gather") for f in ("count", "operands"))


def write(rows, to_target, target, runs, out):
  """The generated part of ``out``; a hand-written part from ``## Reading it`` on is kept.

  Long because it is one page: the command list, four tables, and the kept hand-written part.
  """
  keep = ""
  if out.exists() and "\n## Reading it" in out.read_text():
    keep = out.read_text()[out.read_text().index("\n## Reading it"):]
  lines = ["# Time to accuracy on real links (dadjax.netlab)", "",
           "Commands (root; 2 CPU cores shared with other jobs: every time here is noisy; the "
           "spread column is (max - min) / median over the measured steps, for a local-update "
           "method over its steps without a sync):", ""]
  for run in runs:
    load = f"; `uptime` before: {run['load_before']}" if run.get("load_before") else ""
    load += f"; after: {run['load_after']}" if run.get("load_after") else ""
    lines.append(f"- `{run['command']}` ({run['wall_s'] / 60:.1f} min{load})")
  lines += [
      "",
      f"Workload: digits, MLP hidden [256] (19k parameters), {SITES} sites x 16 rows per step, "
      f"sgd 0.1 with momentum 0.9. Target: test accuracy >= {target}. Steps to target: 3 seeds in "
      "one process (the lab's processes train the same parameters bit for bit), time to target "
      "= steps to target (median of the seeds) x measured step time. Local-update methods "
      "(DiLoCo, local SGD) are evaluated on the synchronized parameters (DiLoCo's anchor).", "",
      "Modeled step = measured compute (the one-site replica) + modeled communication "
      "(`NetworkModel.step_time`, as `dadjax.comm.report`): textbook = ring with latency = D per "
      "compiled op; calibrated = `NetworkModel.calibrated` (dadjax.comm.GLOO_TCP) per operand "
      "(gloo call). Ops in `lax.cond` branches: Accordion's are those of the branches its steps "
      "took (`dadjax.comm.match_branches` on the ledger's bits); a local-update method's sync "
      "branch is charged once per H steps. The measured step of a local-update method is the "
      "mean per optimizer step over a period (`LabRun.period_step_time`: the median of each "
      "position in the period, averaged), the others' the median step.", "",
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
  lines += ["", "Measured / modeled per method (min - max over the 4 links; the 20 ms links apart):",
            "", "| method | measured / textbook | measured / calibrated | measured / calibrated "
            "at 20 ms |", "|---|---|---|---|"]
  for m in dict.fromkeys(r["method"] for r in rows):
    mine = [r for r in rows if r["method"] == m]
    span = lambda rs, k: (f"{min(r['step_s'] / r[k] for r in rs):.2f} - "
                          f"{max(r['step_s'] / r[k] for r in rs):.2f}")
    lines.append(f"| {m} | {span(mine, 'textbook_s')} | {span(mine, 'calibrated_s')} | "
                 f"{span([r for r in mine if r['delay'] > 0], 'calibrated_s')} |")
  local = [r for r in rows if "sync_step_s" in r]
  if local:
    lines += ["", "Local-update methods, the two kinds of step (medians; modeled = compute + "
              "the model's communication of that step):", "",
              "| link | method | sync step ms | spread | modeled sync, textbook / calibrated ms | "
              "other steps ms | spread | modeled other, textbook / calibrated ms |",
              "|---|---|---|---|---|---|---|---|"]
    for r in local:
      h = round(1 / r["ledger"]["exchange_rate"])
      other = [(h * r[f"{m}_s"] - r[f"{m}_sync_s"]) / (h - 1) for m in ("textbook", "calibrated")]
      lines.append(
          f"| {r['rate'] / 1e6:g} Mbit/s, {r['delay'] * 1e3:g} ms | {r['method']} | "
          f"{r['sync_step_s'] * 1e3:.0f} | {100 * r['sync_spread']:.0f}% | "
          f"{r['textbook_sync_s'] * 1e3:.0f} / {r['calibrated_sync_s'] * 1e3:.0f} | "
          f"{r['local_step_s'] * 1e3:.0f} | {100 * r['step_spread']:.0f}% | "
          f"{other[0] * 1e3:.0f} / {other[1] * 1e3:.0f} |")
  lines += ["", "Ledger of each method's step (per site): payload bits per optimizer step, the "
            "compiled ops / operands (gloo calls) of every branch, and the ops / operands the "
            "model charges per step (the branches taken; a sync branch once per H).", "",
            "| method | reduce bits | gather bits | reduce ops / operands | gather ops / operands "
            "| charged reduce ops / operands | charged gather ops / operands | branches taken |",
            "|---|---|---|---|---|---|---|---|"]
  seen = set()
  for r in rows:
    if r["method"] in seen:
      continue
    seen.add(r["method"])
    b = r["ledger"]
    ro, rp, go, gp = _charged(b)
    taken = ", ".join(f"{k}: {v}" for k, v in sorted(b.get("taken", {}).items())) or "-"
    lines.append(f"| {r['method']} | {b.get('reduce_bits')} | {b.get('gather_bits')} | "
                 f"{b.get('reduce_ops')} / {b.get('reduce_operands')} | {b.get('gather_ops')} / "
                 f"{b.get('gather_operands')} | {ro} / {rp} | {go} / {gp} | {taken} |")
  out.write_text("\n".join(lines) + "\n" + keep)


def _merge(old_rows, new_rows):
  """``old_rows`` with the rows of the same (method, rate, delay) replaced, the others appended."""
  key = lambda r: (r["method"], r["rate"], r["delay"])
  new = {key(r): r for r in new_rows}
  out = [new.pop(key(r), r) for r in old_rows]
  return out + [r for r in new_rows if key(r) in new]


def main(argv=None) -> int:
  from dadjax.registry import split_specs  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="one link, 4 steps, one seed (written next to netlab_quick.md)")
  parser.add_argument("--steps", type=int, default=12, help="timed steps per method and link")
  parser.add_argument("--local-steps", type=int, default=30,
                      help="steps of a local-update method per link: a multiple of its H (3 "
                      "periods of H = 10)")
  parser.add_argument("--target", type=float, default=0.95)
  parser.add_argument("--max-steps", type=int, default=300)
  parser.add_argument("--methods", help="comma-separated specs (default: all); their rows "
                      "replace the stored ones, the other rows are kept")
  parser.add_argument("--part", choices=["lab", "accuracy", "all"], default="all",
                      help="run one part (results are kept next to --out; the table is written "
                      "once both exist)")
  parser.add_argument("--repredict", action="store_true",
                      help="run nothing: recompute the model columns of the stored rows (of "
                      "--methods) with the branches their steps took")
  parser.add_argument("--out", default=None, help="the table (default: experiments/results/"
                      "netlab.md, netlab_quick.md with --quick)")
  args = parser.parse_args(argv)
  methods = split_specs(args.methods) if args.methods else METHODS
  links = LINKS[:1] if args.quick else LINKS
  seeds = [0] if args.quick else [0, 1, 2]
  out = pathlib.Path(args.out or ROOT / "experiments" / "results" /
                     ("netlab_quick.md" if args.quick else "netlab.md"))
  out.parent.mkdir(parents=True, exist_ok=True)
  lab_file, acc_file = out.with_suffix(".json"), out.with_name(out.stem + "_accuracy.json")
  lab = json.loads(lab_file.read_text()) if lab_file.exists() else {"rows": [], "wall_s": 0.0}
  acc = json.loads(acc_file.read_text()) if acc_file.exists() else {"steps": {}, "wall_s": 0.0}
  runs = lab.setdefault("runs", [{"command": "python experiments/netlab.py", "methods": "all",
                                  "wall_s": lab["wall_s"] + acc["wall_s"]}] if lab["rows"] else [])
  command = "python " + " ".join(["experiments/netlab.py"] + [
      f"'{a}'" if " " in a else a for a in sys.argv[1:]])
  record = {"command": command, "methods": methods, "load_before": uptime()}
  t0 = time.time()
  if args.repredict:
    lab["rows"] = repredict(lab["rows"], methods)
  if args.part in ("lab", "all") and not args.repredict:
    rows = lab_part(methods, links, 4 if args.quick else args.steps,
                    args.local_steps, timeout=3600)
    lab["rows"] = _merge(lab["rows"], rows)
    lab["wall_s"] += time.time() - t0
    print(f"lab part: {time.time() - t0:.0f} s", flush=True)
  if args.part in ("accuracy", "all") and not args.repredict:
    t1 = time.time()
    acc["steps"].update(accuracy_part(methods, seeds, args.target,
                                      60 if args.quick else args.max_steps))
    acc["wall_s"] += time.time() - t1
    acc_file.write_text(json.dumps(acc))
  record.update(wall_s=time.time() - t0, load_after=uptime())
  runs.append(record)
  lab_file.write_text(json.dumps(lab, indent=0))
  if lab["rows"] and acc["steps"]:
    write(lab["rows"], acc["steps"], args.target, runs, out)
    print(out.read_text())
  return 0


if __name__ == "__main__":
  sys.exit(main())
