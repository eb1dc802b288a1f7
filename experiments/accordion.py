"""Accordion against static low and static high compression (issue 10).

On the embedded digits over 8 sites (simulated with the ``vmap`` backend),
an MLP and a CNN, IID and Dirichlet(0.5) partitions, SGD with momentum and a
step learning-rate decay (x0.1 at 50% and 75% of the steps), several seeds:
for each compressor family, static ``low`` (light compression), static
``high`` (heavy compression) and ``accordion(low, high)`` (the detector's
window is the run's epoch, one check per window, eta 0.5; the decay is
handed to it). Reported per method (mean +- std over seeds): final test
accuracy, total wire bits each site sent on a ring (and the ledger's payload bits,
detector norms included), the reduction versus static low, and
modeled communication time at 1 and 10 Gbit/s (ring, 50 us per collective
call; summed step by step, since Accordion's step cost changes over time).

Usage (from the repository root)::

  .venv/bin/python experiments/accordion.py                 # the full grid (~15 min, 2 CPU cores)
  .venv/bin/python experiments/accordion.py --steps 20 --seeds 0 --models mlp \\
      --partitions iid --families powersgd --out /tmp/acc  # a smoke run

On a real workload (``--workload fashion_cnn``, ``text_lstm``, ...) the first
``--examples`` training rows (default 3,200: 25 steps per epoch at 8 sites x
16 rows) make epochs short enough for the detector to check every 25 steps;
the default is 300 steps (12 epochs). ``--families batch`` is the batch-size
mode (1 micro-batch per update when critical, 8 otherwise; the static large
batch steps with 8x the learning rate, the linear scaling rule)::

  .venv/bin/python experiments/accordion.py --workload fashion_cnn --partitions iid \
      --families powersgd21,batch --name accordion_fashion_cnn   # ~45 min, 2 cores

Writes ``<out>/accordion.md`` (tables and the command),
``<out>/accordion_bits.png`` (accuracy against bits) and
``<out>/accordion_decisions.png`` (the decisions heat map of one run).

Not :func:`dadjax.run.train`: a run keeps its own loop to charge each step's
modeled time from the ledgers that recorded in that step (the batch mode's
accumulating micro-steps send nothing; Accordion's step cost changes over
time), and to keep every step's decisions for the heat map. Its totals are
:func:`dadjax.comm.report` of the final state.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

harness.host_devices(8)
# pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # noqa: E402
import numpy as np  # noqa: E402

from dadjax.adaptive import plot_decisions  # noqa: E402
from dadjax.comm import NetworkModel, comm_stats, find_comm_stats, host_array, report  # noqa: E402
from dadjax.run import Config, build, evaluate, state_rows  # noqa: E402

import workloads  # noqa: E402
# pylint: enable=g-import-not-at-top,wrong-import-position

FAMILIES = {
    # family: (static low, static high); Accordion is accordion(low, high).
    "powersgd": ("powersgd:4", "powersgd:1"),
    "topk": ("ef(topk:0.99)", "ef(topk:0.1)"),
    # The paper's settings: PowerSGD rank 2 <-> 1 on the CNN, TopK 99% <-> 2% on the LSTM.
    "powersgd21": ("powersgd:2", "powersgd:1"),
    "topk2": ("ef(topk:0.99)", "ef(topk:0.02)"),
    # Batch-size mode (section 4): 1 micro-batch per update when critical, 8 otherwise.
    "batch": ("allreduce", 1, 8),
}
MODELS = {"mlp": {}, "cnn": {}}
PARTITIONS = {"iid": {"partition": "iid"}, "dirichlet": {"partition": "dirichlet", "alpha": 0.5}}
BANDWIDTHS = (1e9, 10e9)


def methods_of(family: str) -> list[tuple[str, str, float]]:
  """``[(label, spec, lr multiplier)]``: static low, static high, Accordion.

  The batch-size family's static "low" is the small batch and its static
  "high" the large one; the large batch steps with ``large / small`` times
  the learning rate (the linear scaling rule Accordion's large cycles follow).
  """
  if family == "batch":
    method, small, large = FAMILIES[family]
    return [("static low", f"accordion_batch({method},{small},{small})", 1.0),
            ("static high", f"accordion_batch({method},{large},{large})", large / small),
            ("accordion", f"accordion_batch({method},{small},{large})", 1.0)]
  low, high = FAMILIES[family]
  return [("static low", low, 1.0), ("static high", high, 1.0),
          ("accordion", f"accordion({low},{high})", 1.0)]


def ledgers_that_recorded(state, counts):
  """``(ledgers that recorded in the last step, every ledger's update count)``.

  A ledger keeps its last record until it records again, so a step in which
  a transformation did not communicate (the batch mode's accumulating
  micro-steps) must not be charged its last record once more.
  """
  found = find_comm_stats(state)
  now = [int(np.max(host_array(s.updates))) for s in found]
  before = counts or [0] * len(found)
  return tuple(s for s, u, b in zip(found, now, before) if u > b), now


def run_one(config: Config, record_rows: bool = False) -> dict:
  """Train ``config``; per step, add the step's modeled time from its ledgers.

  Returns ``{"accuracy", "bits" (payload), "wire" (wire bits per site on
  the run's topology), "time": {bw: s}, "rows": [...] (with
  ``record_rows``), "wall_s"}``.
  """
  t0 = time.perf_counter()
  dataset, _, batcher, step_fn = build(config)
  state = step_fn.init(jax.random.key(config.seed), dataset.x_train[:config.batch_per_site])
  nets = {bw: NetworkModel(bw, config.latency, config.num_sites, config.topology)
          for bw in BANDWIDTHS}
  seconds = dict.fromkeys(BANDWIDTHS, 0.0)
  counts = None
  rows = []
  for step in range(config.steps):
    x, y = batcher.batch_at(step)
    state, _ = step_fn(state, {"x": x, "y": y})
    sent, counts = ledgers_that_recorded(state, counts)  # the batch mode's cycles skip steps
    if sent:
      summary = comm_stats(sent)  # this step's ledgers: its bits per kind and calls
      for bw, net in nets.items():
        seconds[bw] += report(summary, net).modeled_comm_s_per_step
    if record_rows:
      rows.append({"step": step + 1, **state_rows(state.opt_state, step_fn.params(state))})
  test = evaluate(step_fn, state, dataset.x_test, dataset.y_test)
  # "accuracy" holds the run's metric: test accuracy, or bits per byte for a language model.
  value = workloads.metric_of(test, "bits_per_byte" if np.ndim(dataset.y_test) == 2 else
                              "accuracy")
  total = report(state, nets[BANDWIDTHS[0]])
  return {"accuracy": value, "bits": total.total_payload_bits, "wire": total.total_wire_bits,
          "time": seconds,
          "rows": rows, "wall_s": time.perf_counter() - t0, "spe": batcher.steps_per_epoch}


def format_tables(results: dict, args) -> str:
  """One markdown table per (model, partition): rows = family x method."""
  lines = []
  for (model, part), by_method in results.items():
    lines += [f"### {model.upper()}, {part}", "",
              "| family | method | spec | test acc (mean ± std) | wire Mbit/site | "
              "payload Mbit/site | x fewer wire bits than static low | comm s @1 Gbit/s | "
              "comm s @10 Gbit/s |",
              "|---|---|---|---|---|---|---|---|---|"]
    for family in args.families:
      low_wire = np.mean([r["wire"] for r in by_method[(family, "static low")]["runs"]])
      for label, spec, _ in methods_of(family):
        entry = by_method[(family, label)]
        runs = entry["runs"]
        bits = np.mean([r["bits"] for r in runs])
        wire = np.mean([r["wire"] for r in runs])
        t1 = np.mean([r["time"][1e9] for r in runs])
        t10 = np.mean([r["time"][10e9] for r in runs])
        lines.append(f"| {family} | {label} | `{spec}` | {harness.mean_std([r['accuracy'] for r in runs], '{:.4f}', '{:.4f}')}"
                     f" | {wire / 1e6:.2f} | {bits / 1e6:.2f} | {low_wire / wire:.2f} | {t1:.3f} |"
                     f" {t10:.4f} |")
    lines.append("")
  return "\n".join(lines)


def verdicts(results: dict, args) -> str:
  """The target per (model, partition, family): within 0.5 point of static low
  with at least 3x fewer bits."""
  lines = ["| model | partition | family | acc: accordion − static low (points; LM: bits per "
           "byte, static low − accordion) | "
           "wire bits: static low / accordion | target met |", "|---|---|---|---|---|---|"]
  for (model, part), by_method in results.items():
    for family in args.families:
      low = by_method[(family, "static low")]["runs"]
      acc = by_method[(family, "accordion")]["runs"]
      lm = model in workloads.WORKLOADS and workloads.get(model).metric == "bits_per_byte"
      gap = np.mean([r["accuracy"] for r in acc]) - np.mean([r["accuracy"] for r in low])
      # accuracy: points (higher is better); bits per byte: low - accordion (lower is better)
      gap = -gap if lm else 100 * gap
      ratio = np.mean([r["wire"] for r in low]) / np.mean([r["wire"] for r in acc])
      met = gap >= (-0.05 if lm else -0.5) and ratio >= 3
      lines.append(f"| {model} | {part} | {family} | {gap:+.2f} | {ratio:.2f} | "
                   f"{'yes' if met else 'no'} |")
  return "\n".join(lines)


def plot_bits(results: dict, path: pathlib.Path) -> None:
  """Final accuracy against total bits per site, one panel per (model, partition)."""
  plt = harness.pyplot()
  keys = list(results)
  fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.8), squeeze=False)
  markers = {"static low": "o", "static high": "v", "accordion": "*"}
  colors = {"powersgd": "#1b9e77", "topk": "#d95f02"}
  for ax, key in zip(axes[0], keys):
    for (family, label), entry in results[key].items():
      runs = entry["runs"]
      bits = np.asarray([r["wire"] for r in runs], np.float64)
      acc = np.asarray([r["accuracy"] for r in runs], np.float64)
      ax.errorbar(bits.mean(), acc.mean(), yerr=acc.std(), xerr=bits.std(),
                  marker=markers[label], color=colors.get(family, "k"),
                  markersize=11 if label == "accordion" else 7, linestyle="none",
                  label=f"{family}: {label}")
    ax.set_xscale("log")
    ax.set_xlabel("total wire bits per site (ring)")
    ax.set_title(f"{key[0].upper()}, {key[1]}")
  axes[0][0].set_ylabel("final test accuracy")
  axes[0][-1].legend(fontsize=7)
  harness.save(fig, path)


def _examples(wl, examples: int | None, quick: bool) -> dict:
  """Config overrides that keep the first ``examples`` training rows (a shorter epoch)."""
  if not examples:
    return {}
  kwargs = {**wl.fields.get("dataset_kwargs", {}),
            **(wl.quick.get("dataset_kwargs", {}) if quick else {})}
  key = "max_windows" if wl.metric == "bits_per_byte" else "max_examples"
  return {"dataset_kwargs": {**kwargs, key: examples}}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (default 220: 20 epochs of the digits; a "
                      "workload: 300, 12 epochs of --examples)")
  parser.add_argument("--examples", type=int, default=None,
                      help="a workload's training rows (windows of a text), for epochs short "
                      "enough that the detector checks several times (default 3200: 25 "
                      "steps per epoch at 8 sites x 16 rows)")
  parser.add_argument("--models", default="mlp,cnn")
  parser.add_argument("--partitions", default="iid,dirichlet")
  parser.add_argument("--families", default="powersgd,topk")
  parser.add_argument("--lr", type=float, default=0.1)
  harness.common_args(parser, "accordion", "comma-separated real workloads (fashion_cnn, "
                      "text_lstm, ...) instead of --models; partitions iid / non_iid")
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = 300 if args.workload else 220
  if args.workload and args.examples is None:
    args.examples = 3200
  args.seeds = harness.seeds(args.seeds)
  args.models = args.models.split(",")
  args.partitions = args.partitions.split(",")
  args.families = args.families.split(",")
  models, partitions = MODELS, PARTITIONS
  if args.workload:
    args.models = args.workload.split(",")
    models = {m: workloads.get(m) for m in args.models}
    for m, wl in models.items():
      if wl.available():
        parser.error(f"--workload {m}: {wl.available()}")
    if args.partitions == ["iid", "dirichlet"]:
      args.partitions = ["iid", "non_iid"]
    partitions = {"iid": None, "non_iid": None}
  for name, given, valid in (("models", args.models, models), ("partitions", args.partitions,
                             partitions), ("families", args.families, FAMILIES)):
    bad = [g for g in given if g not in valid]
    if bad:
      parser.error(f"--{name}: unknown {bad}; valid: {sorted(valid)}")
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  decay = f"step:0.1:{max(1, args.steps // 2)}:{max(2, 3 * args.steps // 4)}"
  results: dict = {}
  decisions = None
  t0 = time.perf_counter()
  for model in args.models:
    for part in args.partitions:
      by_method = results.setdefault((model, part), {})
      for family in args.families:
        for label, spec, lr_mult in methods_of(family):
          entry = by_method.setdefault((family, label), {"spec": spec, "runs": []})
          for seed in args.seeds:
            if args.workload:
              wl = models[model]
              config = wl.config(args.quick, method=spec, steps=args.steps, lr_schedule=decay,
                                 seed=seed, **workloads.partition_fields(wl, part),
                                 **_examples(wl, args.examples, args.quick))
              config = config.replace(lr=config.lr * lr_mult)
            else:
              config = Config(dataset="digits", model=model, model_kwargs=MODELS[model],
                              method=spec, num_sites=8, backend="vmap", batch_per_site=16,
                              steps=args.steps, lr=args.lr * lr_mult, momentum=0.9,
                              lr_schedule=decay, seed=seed, **PARTITIONS[part])
            record = decisions is None and label == "accordion" and family != "batch"
            r = run_one(config, record_rows=record)
            if record:
              decisions = (config, r["rows"])
            entry["runs"].append(r)
            print(f"{model} {part} {spec} seed={seed}: acc={r['accuracy']:.4f} "
                  f"bits={r['bits'] / 1e6:.2f}M wall={r['wall_s']:.1f}s "
                  f"[{time.perf_counter() - t0:.0f}s]", flush=True)
  spe = next(iter(next(iter(results.values())).values()))["runs"][0]["spe"]
  command = harness.command_line("accordion.py", sys.argv[1:] if argv is None else argv)
  where = ("embedded digits" if not args.workload else
           ", ".join(models[m].describe(args.quick) for m in args.models))
  metric = ("" if not args.workload else " The \"test acc\" column of a language model holds "
            "its test bits per byte (lower is better; the target then reads: Accordion's bits "
            "per byte at most 0.05 above static low).")
  lr_text = f"{args.lr:g}" if not args.workload else "of the workload"
  text = "\n".join([
      f"# Accordion: static low, static high, adaptive ({where}, 8 sites)", "",
      f"Command: `{command}` ({time.perf_counter() - t0:.0f} s on CPU, vmap backend).", "",
      f"Setting: {args.steps} steps ({args.steps / spe:.0f} epochs of {spe} steps), {config.batch_per_site} rows per site "
      f"per step, lr {lr_text}, `lr_schedule={decay}`, seeds "
      f"{args.seeds}. Accordion: window = 1 epoch, a check every window, eta = 0.5; "
      "every tensor critical after each LR decay until the next check. Wire bits: what each "
      "site sends on a ring over 8 sites (`dadjax.comm.report`: an all-reduce of B payload "
      "bits costs 2(N-1)/N B, an all-gather (N-1) B), summed step by step; payload bits: what "
      "each site hands to collectives (the ledger, the detector's norms included). Modeled time "
      "is `NetworkModel` (ring, 50 us per collective call) summed step by step." + metric, "",
      format_tables(results, args), "",
      "## Target: Accordion within 0.5 point of static low with >= 3x fewer wire bits", "",
      verdicts(results, args), "",
      f"![accuracy vs bits]({args.name}_bits.png)", "",
      f"![decisions]({args.name}_decisions.png)", ""])
  (out / f"{args.name}.md").write_text(text)
  plot_bits(results, out / f"{args.name}_bits.png")
  if decisions is not None:
    config, rows = decisions
    fig = plot_decisions(rows, out / f"{args.name}_decisions.png",
                         title=f"{config.model} {config.partition} {config.method} seed {config.seed}")
    harness.pyplot().close(fig)
  print(text)
  return 0


if __name__ == "__main__":
  sys.exit(main())
