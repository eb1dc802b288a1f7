"""dAD and rank-dAD against pooled, fp32 all-reduce, PowerSGD and TopK (issue 4).

For each task in the config(s) (MLP on the embedded digits split by class
over 8 sites, a GRU and a small transformer on synthetic counting
sequences), every method trains from the same initialization on the same
site-major batches. Reported per method, per site and optimizer step:
final test accuracy; payload bits (the ledger: what a site hands to
collectives); wire bits on a ring of the task's N sites (an all-gather of
B bits sends (N-1) B per site, an all-reduce 2 (N-1)/N B: about N/2 times
less per payload bit); the wire ratio against an fp32 and a bf16
all-reduce of the same tensors (> 1: fewer bits on the wire); the modeled
communication time on a 1 Gbit/s ring with 50 us latency per message,
charged per collective op of the compiled step (read from the HLO of the
same step under shard_map); the steps, wire bits and modeled time to the
task's target test accuracy; the mean effective rank of the rank-dAD
factorizations; and the relative error of the synchronized gradient
against the exact (pooled) gradient, measured with the method's live
state (warm starts, error-feedback memories) on the training batch every
``eval_every`` steps.

Usage (from the repository root)::

  .venv/bin/python experiments/dad.py                        # the three default configs
  .venv/bin/python experiments/dad.py --config experiments/configs/dad_mlp.json
  .venv/bin/python experiments/dad.py --steps 50 --methods allreduce,dad,rank_dad:2
  .venv/bin/python experiments/dad.py --workload fashion_mlp   # 60 runs, ~40 min on 2 cores (from 28-41 s per run)

With ``--workload``, the IID partition runs :data:`WORKLOAD_METHODS` and the
non-IID one :data:`NON_IID_METHODS` unless ``--methods`` names them; on the
transformer LM (``text_lm``, ~100 s per run) pass a shorter ``--methods``.

Writes ``<out>/dad.md`` (tables + the command) and ``<out>/dad_<task>.png``.

Not :func:`dadjax.run.train`: each run keeps its own loop to probe the
synchronized gradient against the exact one with the method's live state
before every evaluated step (and, for ``pooled``, to train one site on every
site's rows); its rows carry the same report columns (cumulative wire bits,
modeled seconds), and the cost to target is :func:`dadjax.run.to_target` on
them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

harness.host_devices(8)
# pylint: disable=g-import-not-at-top,wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from dadjax import dad  # noqa: E402
from dadjax.comm import NetworkModel, comm_stats, report  # noqa: E402
from dadjax.methods import build_method  # noqa: E402
from dadjax.parallel import local_gradients, make_train_step, softmax_cross_entropy  # noqa: E402
from dadjax.run import Config, build, evaluate, make_optimizer, to_target  # noqa: E402

import workloads  # noqa: E402
from harness import mean_std  # noqa: E402
from workloads import metric_of  # noqa: E402
# pylint: enable=g-import-not-at-top,wrong-import-position

ROOT = harness.ROOT
NOTES = """\
Notes.
- payload = the ledger: the bits each site hands to collectives per step.
  wire = what a ring of N sites makes each site send for them: dAD and
  rank-dAD all-gather, so a payload bit costs them N-1 = 7 wire bits, an
  all-reduced bit (PowerSGD, fp32 all-reduce) 2 (N-1)/N = 1.75. The wire
  ratios divide an fp32 (resp. bf16) all-reduce's wire bits of the same
  tensors by the method's: below 1x the method puts *more* bits on the
  wire than that baseline. `auto_dad` picks, per layer, the route with
  fewer ring wire bits at the real N.
- modeled comm/step: `dadjax.NetworkModel(1e9, 50e-6, N, "ring")`,
  bandwidth term from the ledger, latency 2(N-1) (all-reduce) or N-1
  (all-gather) messages per collective op of the compiled step (the same
  step built with `backend="shard_map"` on 8 CPU devices,
  `TrainStep.collectives`; the step's metric all-reduce included). Ops
  inside a loop body (the GRU's scan) appear once in the HLO but run per
  iteration: when a kind's compiled operand bits are below the ledger's,
  its op count is scaled by their ratio (rounded up). At these sizes the
  latency term dominates: fewer, larger collectives win.
- to target: the first evaluation (every `eval_every` steps) at or above
  the task's target test accuracy (`dadjax.run.to_target`); wire bits and
  modeled time are the cumulative ones at that evaluation. "not reached"
  in the run.
- GRU: the hidden-to-hidden layer runs inside `nn.scan`, so it is captured
  per time step (T = 8 collectives, and rank-dAD sends T r (d_in + d_out)
  numbers for it); `auto_dad` decides per call, i.e. per time step.
- grad rel. error: ||synchronized update - exact gradient|| / ||exact||,
  with the method's live state on the training batch, mean over the
  evaluation points. Error feedback (PowerSGD, TopK) re-sends past residuals,
  so its per-step error is large by design. One-way rank-dAD's aggregate
  has rank up to N r.
"""
ONE_SEED_NOTE = """\
- One seed (the config tasks): test-accuracy differences of a few points,
  and so the steps to target, are noise at this scale.
"""
DEFAULT_CONFIGS = ("configs/dad_mlp.json", "configs/dad_gru.json", "configs/dad_transformer.json")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: a ``dadjax.config.Config`` (data, model, training), a name and the methods.

  ``methods``: ``"pooled"`` (fp32 all-reduce on one site holding every
  site's rows), or any ``dadjax.methods.build_method`` spec (``"allreduce"``,
  ``"dad"``, ``"auto_dad"``, ``"rank_dad:R"``, ``"powersgd:R"``, ...).
  ``target``: the test accuracy the "to target" columns measure up to.
  """

  name: str
  config: Config
  methods: tuple[str, ...]
  target: float = 0.9
  metric: str = "accuracy"  # or "bits_per_byte" (lower is better)

  @property
  def key(self) -> str:
    """The metric's column in the runs' rows."""
    return f"test_{self.metric}"


def load_task(path: str | pathlib.Path, steps: int | None = None) -> Task:
  """A task JSON: ``name``, ``methods``, ``target`` and any ``Config`` fields but ``method``."""
  raw = json.loads(pathlib.Path(path).read_text())
  name = raw.pop("name", pathlib.Path(path).stem)
  target = float(raw.pop("target", 0.9))
  if not 0 < target <= 1:
    raise ValueError(f"{path}: target must be a test accuracy in (0, 1], got {target}")
  methods = tuple(raw.pop("methods", ("pooled", "allreduce", "dad")))
  if "method" in raw:
    raise ValueError(f"{path}: list the methods to compare under 'methods', not 'method'")
  if steps is not None:
    raw["steps"] = steps
  return Task(name, Config(backend="vmap").replace(**raw), methods,
              target)  # Config.replace checks keys and values


def _probe(model, base_model, comm_tx):
  """Relative error of the synchronized gradient vs the exact one, per site.

  Runs the method's communicating transformation on this step's local
  gradients with its live state (without keeping the new state) and
  compares with the mean of the plain models' site gradients at the same
  parameters (every site's rows weigh equally: the pooled gradient).
  """
  comm_tx = optax.with_extra_args_support(comm_tx)

  def site(params, comm_state, model_state, batch):
    local = local_gradients(model, softmax_cross_entropy, params, model_state, batch)
    synced, _ = comm_tx.update(local.grads, comm_state, params, **local.extra_args)
    exact = local_gradients(base_model, softmax_cross_entropy, params, {}, batch).grads
    exact = jax.lax.pmean(exact, "data")
    num = sum(jnp.sum((a - b) ** 2) for a, b in zip(jax.tree.leaves(synced), jax.tree.leaves(exact)))
    den = sum(jnp.sum(b ** 2) for b in jax.tree.leaves(exact))
    return jnp.sqrt(num / den)

  return jax.jit(jax.vmap(site, axis_name="data"))


LATENCY_S = 50e-6  # per message; NetworkModel's default
BANDWIDTH = 1e9  # bits/s


def compiled_ops(task: Task, model, optimizer, dataset, summary) -> tuple[dict, str]:
  """Collective ops per kind the step runs, read from its compiled HLO under shard_map.

  The experiment trains under ``vmap`` (one device, no collective ops in
  its program), so the same step is built once more with
  ``backend="shard_map"`` over the task's sites and only compiled. Ops in a
  loop body (``nn.scan``) appear once in the HLO but run per iteration:
  when a kind's compiled operand bits fall short of the ledger's payload,
  its count is scaled by their ratio, rounded up.

  Returns:
    ``({"reduce": n, "gather": m}, source)``; ``source`` says where the
    counts come from (``"ledger calls"`` if the step cannot be compiled on
    this host, e.g. fewer devices than sites).
  """
  cfg = task.config
  fallback = {"reduce": summary.reduce_calls, "gather": summary.gather_calls}
  if jax.device_count() < cfg.num_sites:
    return fallback, "ledger calls"
  step = make_train_step(model, optimizer, num_sites=cfg.num_sites, backend="shard_map")
  state = step.init(jax.random.key(cfg.seed), dataset.x_train[:cfg.batch_per_site])
  rows = cfg.num_sites * cfg.batch_per_site
  found = step.collectives(state, {"x": dataset.x_train[:rows], "y": dataset.y_train[:rows]})
  ops = {}
  payload = {"reduce": max(summary.reduce_bits), "gather": max(summary.gather_bits)}
  for kind in ("reduce", "gather"):
    count, bits = found.count.get(kind, 0), found.bits(kind)
    if count and bits < payload[kind]:
      count *= -(-payload[kind] // bits)
    ops[kind] = count
  return ops, "compiled HLO"


def run_method(task: Task, spec: str, dataset, batcher, base_model, ops_cache=None) -> dict:
  """Train one method; returns its history and summary row.

  ``ops_cache``: a dict shared by runs that differ only in the seed (the
  compiled step's collective ops do not depend on it).
  """
  cfg = task.config
  pooled = spec == "pooled"
  sites = 1 if pooled else cfg.num_sites
  method = build_method("allreduce" if pooled else spec, "data", cfg.seed)
  model = base_model.clone(dense=method.dense) if method.dense is not None else base_model
  optimizer = make_optimizer(cfg, method.tx)
  step = make_train_step(model, optimizer, num_sites=sites, backend=cfg.backend)
  state = step.init(jax.random.key(cfg.seed), dataset.x_train[:cfg.batch_per_site])
  probe = None if pooled else _probe(model, base_model, method.tx)
  history, summaries, errors, ranks = [], [], [], []
  t0 = time.perf_counter()
  for t in range(cfg.steps):
    x, y = batcher.batch_at(t)
    batch = {"x": x, "y": y}
    if probe is not None and (t % cfg.eval_every == 0 or t == cfg.steps - 1):
      split = jax.tree.map(lambda v: v.reshape((sites, -1) + v.shape[1:]), batch)
      err = probe(state.params, state.opt_state[0], state.model_state, split)
      errors.append(float(np.mean(np.asarray(err))))
    state, _ = step(state, batch)
    if (t + 1) % cfg.eval_every == 0 or t + 1 == cfg.steps:
      found = dad.effective_ranks(state.model_state)
      if found:
        ranks.append(float(np.mean([np.mean(v) for v in found.values()])))
      metrics = evaluate(step, state, dataset.x_test, dataset.y_test)
      history.append({"step": t + 1, "test_accuracy": metrics["accuracy"],
                      "test_metric": metric_of(metrics, task.metric),
                      task.key: metric_of(metrics, task.metric)})
      summaries.append(None if pooled else comm_stats(state.opt_state))
  wall = time.perf_counter() - t0
  row = {
      "method": spec,
      "history": history,
      "test_accuracy": history[-1]["test_accuracy"],
      "test_metric": history[-1]["test_metric"],
      "grad_error": float(np.mean(errors)) if errors else 0.0,
      "effective_rank": float(np.mean(ranks)) if ranks else None,
      "wall_s": wall,
      "report": None,
  }
  for h in history:  # pooled: one site, nothing on the wire
    h.update(total_wire_bits=0.0, modeled_comm_s=0.0)
  if not pooled:
    summary = comm_stats(state.opt_state)
    if ops_cache is not None and spec in ops_cache:
      ops, source = ops_cache[spec]
    else:
      ops, source = compiled_ops(task, model, optimizer, dataset, summary)
      if ops_cache is not None:
        ops_cache[spec] = (ops, source)
    network = NetworkModel(BANDWIDTH, LATENCY_S, cfg.num_sites, "ring")
    for h, at in zip(history, summaries):  # each evaluation's cumulative bits and time
      at_eval = report(at, network, ops=ops)
      h.update(total_wire_bits=at_eval.total_wire_bits, modeled_comm_s=at_eval.modeled_comm_s)
    rep = report(summary, network, ops=ops)._asdict()
    rep["fp32_time_s"] = network.baseline_time(summary, 32, ops["reduce"] or 1)
    rep["bf16_time_s"] = network.baseline_time(summary, 16, ops["reduce"] or 1)
    row["report"] = rep
    row["ops"], row["ops_source"] = ops, source
  row["reached"] = to_target(history, task.key, task.target)
  return row


def run_task(task: Task, methods=None, log=print, ops_cache=None) -> list[dict]:
  # dadjax.train.build loads and partitions the data and builds the plain
  # (nn.Dense) model; each method swaps in its dense factory.
  dataset, _, batcher, plain = build(task.config.replace(method="allreduce"))
  rows = []
  for spec in methods or task.methods:
    row = run_method(task, spec, dataset, batcher, plain.model, ops_cache)
    rep = row["report"]
    comm = (f"payload {rep['payload_bits_per_step']:>9,}  wire {rep['wire_bits_per_step']:>11,.0f}  "
            f"vs fp32 {rep['wire_ratio_fp32']:.2f}x  ops {row['ops']}" if rep else "no communication")
    value = (f"acc {row['test_accuracy']:.3f}" if task.metric == "accuracy"
             else f"bpb {row['test_metric']:.3f}")
    log(f"  {task.name:12s} {spec:14s} {value}  {comm}  "
        f"grad err {row['grad_error']:.2e}  ({row['wall_s']:.1f}s)")
    rows.append(row)
  return rows


def _ratio(x: float) -> str:
  return f"{x:.2f}x" + (" (more)" if x < 1 else "")


def format_table(task: Task, rows: list[dict]) -> str:
  """The task's markdown table: per site and optimizer step, then to the target accuracy."""
  cfg = task.config
  n = cfg.num_sites
  target = f"{task.target:g}"
  lines = [f"### {task.name}: {cfg.model} on {cfg.dataset}, {n} sites "
           f"({cfg.partition}), {cfg.batch_per_site} rows/site, {cfg.steps} steps; "
           f"target test accuracy {target}",
           "",
           f"| method | test acc | payload bits/step/site | wire bits/step/site (ring, N={n}) "
           f"| wire ratio vs fp32 | vs bf16 | collective ops/step (reduce, gather) "
           f"| modeled comm/step (ms) | steps to {target} | wire bits to {target} "
           f"| modeled comm to {target} (ms) | grad rel. error | eff. rank |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  more_fp32, more_bf16, sources = [], [], set()
  base_row = next((r for r in rows if r["method"] == "allreduce"),
                  next((r for r in rows if r["report"] is not None), None))
  base = base_row["report"] if base_row else None
  for r in rows:
    rank = f"{r['effective_rank']:.2f}" if r["effective_rank"] is not None else "-"
    reached = r["reached"]
    steps_to = f"{reached.step}" if reached else "not reached"
    rep = r["report"]
    if rep is None:  # pooled: one site, nothing on the wire
      lines.append(f"| {r['method']} | {r['test_accuracy']:.3f} | 0 | 0 | - | - | - | 0 | "
                   f"{steps_to} | 0 | 0 | 0 (reference) | {rank} |")
      continue
    sources.add(r["ops_source"])
    if rep["wire_ratio_fp32"] < 1:
      more_fp32.append(r["method"])
    if rep["wire_ratio_bf16"] < 1:
      more_bf16.append(r["method"])
    ops = f"{r['ops']['reduce']}, {r['ops']['gather']}"
    bits_to = f"{reached.bits:.3g}" if reached else "-"
    time_to = f"{1e3 * reached.seconds:.1f}" if reached else "-"
    lines.append(f"| {r['method']} | {r['test_accuracy']:.3f} | {rep['payload_bits_per_step']:,} | "
                 f"{rep['wire_bits_per_step']:,.0f} | {_ratio(rep['wire_ratio_fp32'])} | "
                 f"{_ratio(rep['wire_ratio_bf16'])} | {ops} | {1e3 * rep['modeled_comm_s_per_step']:.3f} | "
                 f"{steps_to} | {bits_to} | {time_to} | {r['grad_error']:.1e} | {rank} |")
  lines.append("")
  if base is not None:
    lines.append(
        f"Baselines for these tensors (ring, N={n}, {BANDWIDTH / 1e9:g} Gbit/s, "
        f"{LATENCY_S * 1e6:g} us per message): an fp32 all-reduce puts "
        f"{base['fp32_wire_bits_per_step']:,.0f} wire bits/site on the ring per step, a bf16 "
        f"all-reduce {base['bf16_wire_bits_per_step']:,.0f}; with the all-reduce op count of `{base_row['method']}` "
        f"they "
        f"would take {1e3 * base['fp32_time_s']:.3f} ms and {1e3 * base['bf16_time_s']:.3f} ms "
        f"per step. \"(more)\": the method puts more bits on the wire than that baseline.")
    lines.append("")
    lines.append("More wire bits than an fp32 all-reduce: "
                 + (", ".join(f"`{m}`" for m in more_fp32) or "none") + ". More than a bf16 "
                 "all-reduce: " + (", ".join(f"`{m}`" for m in more_bf16) or "none") + ".")
    lines.append(f"Collective ops from: {', '.join(sorted(sources))}.")
  return "\n".join(lines)


def plot(task: Task, rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
  colors = plt.cm.tab20(np.linspace(0, 1, 20))
  for i, r in enumerate(rows):
    color = colors[(2 * i) % 20 if i < 10 else (2 * i + 1) % 20]
    if r["method"] == "pooled":
      left.axhline(r["test_metric"], color="k", ls=":", lw=1, label="pooled (final)")
      continue
    style = "-" if ("dad" in r["method"]) else "--"
    wire = r["report"]["wire_bits_per_step"]
    left.plot([h["total_wire_bits"] for h in r["history"]], [h["test_metric"] for h in r["history"]],
              style, marker="o", ms=3, label=r["method"], color=color)
    right.scatter(wire, max(r["grad_error"], 1e-8), label=r["method"],
                  marker="o" if "dad" in r["method"] else "s", color=color)
  left.axhline(task.target, color="grey", ls="--", lw=0.8, label=f"target {task.target:g}")
  left.set_xscale("log")
  left.set_xlabel(f"cumulative wire bits per site (ring, N={task.config.num_sites})")
  left.set_ylabel("test " + task.metric.replace("_", " "))
  left.legend(fontsize=7, ncol=2)
  right.set_xscale("log")
  right.set_yscale("log")
  right.set_xlabel(f"wire bits per step per site (ring, N={task.config.num_sites})")
  right.set_ylabel("relative gradient error vs exact")
  right.legend(fontsize=7, ncol=2)
  fig.suptitle(f"{task.name}: {task.config.model}, {task.config.num_sites} sites")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


WORKLOAD_METHODS = ("pooled", "allreduce", "bf16", "dad", "rank_dad:1", "rank_dad:2", "rank_dad:4",
                    "rank_dad:8", "rank_dad:1:two_way", "rank_dad:2:two_way",
                    "rank_dad:4:two_way", "rank_dad:8:two_way", "powersgd:1", "powersgd:4",
                    "ef_topk:0.01")
# The non-IID partition's default grid: one of each family, so that the default
# ``--workload fashion_mlp`` run (15 + 5 methods x 3 seeds, 30-40 s per run on 2
# free cores) stays within about 45 minutes.
NON_IID_METHODS = ("allreduce", "dad", "rank_dad:4", "powersgd:4", "ef_topk:0.01")


def default_methods(partition: str) -> tuple[str, ...]:
  return WORKLOAD_METHODS if partition == "iid" else NON_IID_METHODS


def workload_table(task: Task, by_method: dict, seeds) -> tuple[str, dict]:
  """Mean +- std over seeds, per method: the metric, wire bits and modeled time to target."""
  cfg, n = task.config, task.config.num_sites
  better = "higher" if task.metric == "accuracy" else "lower"
  lines = [f"### {task.name}: {cfg.model} on `{cfg.dataset.split(':')[0]}`, {n} sites "
           f"({cfg.partition}{f', alpha {cfg.alpha:g}' if cfg.partition == 'dirichlet' else ''}),"
           f" {cfg.batch_per_site} rows/site, {cfg.steps} steps, seeds {','.join(map(str, seeds))}"
           f"; target test {task.metric} {task.target:g} ({better} is better)",
           "",
           f"| method | test {task.metric} | payload bits/step/site | wire bits/step/site (ring, "
           f"N={n}) | wire ratio vs fp32 | vs bf16 | modeled comm/step (ms) | seeds at target "
           f"| steps to target | wire bits to target | modeled comm to target (ms) "
           f"| grad rel. error | eff. rank |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  summary = {}
  for spec, runs in by_method.items():
    values = [r["test_metric"] for r in runs]
    hits = [r["reached"] for r in runs if r["reached"]]
    steps = [h.step for h in hits]
    rep = runs[0]["report"]
    ranks = [r["effective_rank"] for r in runs if r["effective_rank"] is not None]
    rank = mean_std(ranks, "{:.2f}", "{:.2f}") if ranks else "-"
    err = mean_std([r["grad_error"] for r in runs], "{:.2e}", "{:.2e}")
    reached = f"{len(hits)}/{len(runs)}"
    metric = mean_std(values, "{:.3f}", "{:.3f}")
    steps_to, bits_to, time_to = harness.to_target_cells(
        [r["history"] for r in runs], task.key, task.target, seconds_scale=1e3,
        fmts=("{:.0f}", "{:.3g}", "{:.1f}"))
    if rep is None:
      lines.append(f"| {spec} | {metric} | 0 | 0 | - | - | 0 | {reached} | {steps_to} "
                   f"| 0 | 0 | 0 (reference) | {rank} |")
      summary[spec] = {"metric": float(np.mean(values)), "wire": 0.0, "steps": steps,
                       "bits_to": 0.0 if steps else None}
      continue
    wire = rep["wire_bits_per_step"]
    lines.append(f"| {spec} | {metric} | {rep['payload_bits_per_step']:,} | "
                 f"{wire:,.0f} | {_ratio(rep['wire_ratio_fp32'])} | "
                 f"{_ratio(rep['wire_ratio_bf16'])} | "
                 f"{1e3 * rep['modeled_comm_s_per_step']:.3f} | {reached} | {steps_to} | "
                 f"{bits_to if steps else '-'} | {time_to if steps else '-'} | {err} | {rank} |")
    summary[spec] = {"metric": float(np.mean(values)), "wire": wire, "steps": steps,
                     "bits_to": float(np.mean([h.bits for h in hits]))
                     if len(hits) == len(runs) else None,
                     "std": float(np.std(values))}
  base = next((r[0]["report"] for s, r in by_method.items() if r[0]["report"]), None)
  if base is not None:
    lines += ["", f"Baselines for these tensors (ring, N={n}): an fp32 all-reduce puts "
              f"{base['fp32_wire_bits_per_step']:,.0f} wire bits/site on the ring per step, a "
              f"bf16 all-reduce {base['bf16_wire_bits_per_step']:,.0f}. \"seeds at target\": runs whose test "
              "metric reached the target at an evaluation; the to-target columns average "
              "over those runs only; comm time is `NetworkModel(1e9, 50e-6, N, 'ring')` "
              "charged per compiled collective op (compute time excluded)."]
  return "\n".join(lines), summary


def rank_dad_verdict(task: Task, summary: dict) -> str:
  """The dAD paper's transformer claim, as measured: rank-dAD vs PowerSGD / TopK."""
  def best(prefix):
    cands = {m: v for m, v in summary.items() if m.startswith(prefix)}
    full = {m: v for m, v in cands.items() if v["bits_to"] is not None}
    if full:
      m = min(full, key=lambda k: full[k]["bits_to"])
      return m, full[m]
    if cands:
      key = (lambda k: -cands[k]["metric"]) if task.metric == "accuracy" else (
          lambda k: cands[k]["metric"])
      m = min(cands, key=key)
      return m, cands[m]
    return None, None
  rd, rv = best("rank_dad")
  others = [best("powersgd"), best("ef_topk")]
  others = [(m, v) for m, v in others if m]
  if rd is None or not others:
    return "(rank-dAD or its comparison methods were not run.)"
  parts = []
  for m, v in others:
    if rv["bits_to"] is not None and v["bits_to"] is not None:
      ratio = v["bits_to"] / max(rv["bits_to"], 1.0)
      factor, word = (ratio, "more") if ratio >= 1 else (1 / max(ratio, 1e-30), "fewer")
      parts.append(f"`{rd}` reached the target with {rv['bits_to']:.3g} wire bits/site, `{m}` "
                   f"with {v['bits_to']:.3g} ({factor:.2f}x {word} for `{m}`)")
    else:
      parts.append(f"final test {task.metric}: `{rd}` {rv['metric']:.3f} at {rv['wire']:,.0f} "
                   f"wire bits/step, `{m}` {v['metric']:.3f} at {v['wire']:,.0f} (not every "
                   f"seed of both reached the target)")
  return "Measured: " + "; ".join(parts) + "."


def run_workloads(args, methods, out: pathlib.Path) -> list[str]:
  seeds = harness.seeds(args.seeds)
  sections = []
  for name in args.workload.split(","):
    wl = workloads.get(name)
    missing = wl.available()
    if missing:
      raise SystemExit(f"workload {name}: {missing}")
    for partition in args.partitions.split(","):
      ops_cache, by_method, task = {}, {}, None
      for seed in seeds:
        overrides = {"seed": seed, **workloads.partition_fields(wl, partition)}
        if args.steps:
          overrides["steps"] = args.steps
        cfg = wl.config(args.quick, **overrides)
        task = Task(f"{name}_{partition}", cfg, tuple(methods or default_methods(partition)),
                    wl.target_for(args.quick), wl.metric)
        print(f"[{task.name}] seed {seed}", flush=True)
        rows = run_task(task, None, ops_cache=ops_cache)
        for r in rows:
          by_method.setdefault(r["method"], []).append(r)
        if seed == seeds[0]:  # named after the output file too: runs of one task do not clash
          plot(task, rows, out / f"{args.name}_{task.name}.png")
      table, summary = workload_table(task, by_method, seeds)
      print(table, flush=True)
      sections.append(f"{table}\n\n{rank_dad_verdict(task, summary)}\n\n"
                      f"![{task.name}]({args.name}_{task.name}.png)\n")
  return sections


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", action="append",
                      help="task config JSON (repeatable); default: the three dad_*.json")
  parser.add_argument("--steps", type=int, default=None, help="override steps")
  parser.add_argument("--methods", default=None, help="comma-separated methods override")
  harness.common_args(parser, "dad", f"comma-separated real workloads "
                      f"({', '.join(workloads.WORKLOADS)}) instead of the configs; several seeds "
                      "and partitions, mean ± std")
  parser.add_argument("--partitions", default="iid,non_iid", help="workload partitions")
  args = parser.parse_args(argv)
  configs = args.config or [str(ROOT / c) for c in DEFAULT_CONFIGS]
  methods = args.methods.split(",") if args.methods else None
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = harness.command_line("dad.py", argv if argv is not None else sys.argv[1:])
  sections = [f"# dAD / rank-dAD experiment\n\nCommand: `{command}`\n\n"
              f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices "
              f"(sites run under `vmap`).\n"]
  t0 = time.perf_counter()
  if args.workload:
    sections += run_workloads(args, methods, out)
    configs = []
  for path in configs:
    task = load_task(path, steps=args.steps)
    print(f"[{task.name}] {path}", flush=True)
    rows = run_task(task, methods)
    table = format_table(task, rows)
    print(table, flush=True)
    plot(task, rows, out / f"dad_{task.name}.png")
    sections.append(table + f"\n\n![{task.name}](dad_{task.name}.png)\n")
  sections.append(NOTES + (ONE_SEED_NOTE if configs else ""))
  sections.append(f"Total wall time: {time.perf_counter() - t0:.0f} s (2 CPU cores).\n")
  (out / f"{args.name}.md").write_text("\n".join(sections))
  print(f"wrote {out / f'{args.name}.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
