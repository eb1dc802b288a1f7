"""dAD and rank-dAD against pooled, fp32 all-reduce, PowerSGD and TopK (issue 4).

For each task in the config(s) (MLP on the embedded digits split by class
over 8 sites, a GRU and a small transformer on synthetic counting
sequences), every method trains from the same initialization on the same
site-major batches. Reported per method: final test accuracy, bits each
site sends per step (the ledger), compression versus fp32, modeled
transfer time per step on a 1 Gbit/s ring, bandwidth term only (an
all-gather payload costs (N-1) B / bw there, an all-reduce payload
2 (N-1)/N B / bw: about N/2 times less per bit), the mean
effective rank of the rank-dAD factorizations, and the relative error of the
synchronized gradient against the exact (pooled) gradient, measured with
the method's live state (warm starts, error-feedback memories) on the
training batch every ``eval_every`` steps.

Usage (from the repository root)::

  .venv/bin/python experiments/dad.py                        # the three default configs
  .venv/bin/python experiments/dad.py --config experiments/configs/dad_mlp.json
  .venv/bin/python experiments/dad.py --steps 50 --methods allreduce,dad,rank_dad:2

Writes ``<out>/dad.md`` (tables + the command) and ``<out>/dad_<task>.png``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import sys
import time

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp
import numpy as np
import optax

from dadjax import dad
from dadjax.comm import NetworkModel, comm_stats
from dadjax.config import Config
from dadjax.methods import build_method
from dadjax.parallel import local_gradients, make_train_step, softmax_cross_entropy
from dadjax.train import build, evaluate, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parent
NOTES = """\
Notes.
- bits/step/site is the ledger: the payload each site hands to collectives.
  The ring column is the bandwidth term of `dadjax.NetworkModel` at 1 Gbit/s:
  dAD and rank-dAD all-gather, so a bit costs them about N/2 = 4 times more
  wire time than an all-reduced bit (PowerSGD, fp32 all-reduce). The train
  step hands the optimizer the tree of bits the dAD layers sow, so
  `auto_dad`'s all-reduce route is priced as all-reduce.
- GRU: the hidden-to-hidden layer runs inside `nn.scan`, so it is captured
  per time step (T = 8 collectives, and rank-dAD sends T r (d_in + d_out)
  numbers for it); `auto_dad` decides per call, i.e. per time step.
- grad rel. error: ||synchronized update - exact gradient|| / ||exact||,
  with the method's live state on the training batch, mean over the
  evaluation points. Error feedback (PowerSGD, TopK) re-sends past residuals,
  so its per-step error is large by design. One-way rank-dAD's aggregate
  has rank up to N r.
- One seed, 150 steps: test-accuracy differences of a few points are noise.
"""
DEFAULT_CONFIGS = ("configs/dad_mlp.json", "configs/dad_gru.json", "configs/dad_transformer.json")


@dataclasses.dataclass(frozen=True)
class Task:
  """One task: a ``dadjax.config.Config`` (data, model, training), a name and the methods.

  ``methods``: ``"pooled"`` (fp32 all-reduce on one site holding every
  site's rows), or any ``dadjax.methods.build_method`` spec (``"allreduce"``,
  ``"dad"``, ``"auto_dad"``, ``"rank_dad:R"``, ``"powersgd:R"``, ...).
  """

  name: str
  config: Config
  methods: tuple[str, ...]


def load_task(path: str | pathlib.Path, steps: int | None = None) -> Task:
  """A task JSON: ``name``, ``methods`` and any ``Config`` fields but ``method``."""
  raw = json.loads(pathlib.Path(path).read_text())
  name = raw.pop("name", pathlib.Path(path).stem)
  methods = tuple(raw.pop("methods", ("pooled", "allreduce", "dad")))
  if "method" in raw:
    raise ValueError(f"{path}: list the methods to compare under 'methods', not 'method'")
  if steps is not None:
    raw["steps"] = steps
  return Task(name, Config(backend="vmap").replace(**raw), methods)  # checks keys and values


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


def run_method(task: Task, spec: str, dataset, batcher, base_model) -> dict:
  """Train one method; returns its history and summary row."""
  cfg = task.config
  pooled = spec == "pooled"
  sites = 1 if pooled else cfg.num_sites
  method = build_method("allreduce" if pooled else spec, "data", cfg.seed)
  model = base_model.clone(dense=method.dense) if method.dense is not None else base_model
  step = make_train_step(model, make_optimizer(cfg, method.tx), num_sites=sites,
                         backend=cfg.backend)
  state = step.init(jax.random.key(cfg.seed), dataset.x_train[:cfg.batch_per_site])
  probe = None if pooled else _probe(model, base_model, method.tx)
  # Bandwidth term only: at these tiny sizes latency would dominate, and it
  # depends on how many collectives XLA fuses, which the ledger cannot see.
  network = NetworkModel(1e9, 0.0, cfg.num_sites, "ring")
  history, errors, ranks = [], [], []
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
      history.append({
          "step": t + 1,
          "test_accuracy": evaluate(step, state, dataset.x_test, dataset.y_test)["accuracy"],
          "total_bits": 0 if pooled else comm_stats(state.opt_state).total,
      })
  summary = None if pooled else comm_stats(state.opt_state)
  return {
      "method": spec,
      "history": history,
      "test_accuracy": history[-1]["test_accuracy"],
      "bits_per_step": summary.bits_per_step if summary else 0,
      "dense_bits_per_step": summary.dense_bits_per_step if summary else 0,
      "comm_s": network.step_time(summary) if summary else 0.0,
      "grad_error": float(np.mean(errors)) if errors else 0.0,
      "effective_rank": float(np.mean(ranks)) if ranks else None,
      "wall_s": time.perf_counter() - t0,
  }


def run_task(task: Task, methods=None, log=print) -> list[dict]:
  # dadjax.train.build loads and partitions the data and builds the plain
  # (nn.Dense) model; each method swaps in its dense factory.
  dataset, _, batcher, plain = build(task.config.replace(method="allreduce"))
  rows = []
  for spec in methods or task.methods:
    row = run_method(task, spec, dataset, batcher, plain.model)
    log(f"  {task.name:12s} {spec:14s} acc {row['test_accuracy']:.3f}  "
        f"bits/step {row['bits_per_step']:>9,}  grad err {row['grad_error']:.2e}  "
        f"({row['wall_s']:.1f}s)")
    rows.append(row)
  return rows


def format_table(task: Task, rows: list[dict]) -> str:
  cfg = task.config
  lines = [f"### {task.name}: {cfg.model} on {cfg.dataset}, {cfg.num_sites} sites "
           f"({cfg.partition}), {cfg.batch_per_site} rows/site, {cfg.steps} steps",
           "",
           "| method | test acc | bits/step/site | vs fp32 | ring transfer/step @1Gb/s (ms) "
           "| grad rel. error | eff. rank |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    ratio = (f"{r['dense_bits_per_step'] / r['bits_per_step']:.2f}x" if r["bits_per_step"]
             else "-")
    rank = f"{r['effective_rank']:.2f}" if r["effective_rank"] is not None else "-"
    err = "0 (reference)" if r["method"] == "pooled" else f"{r['grad_error']:.1e}"
    lines.append(f"| {r['method']} | {r['test_accuracy']:.3f} | {r['bits_per_step']:,} | {ratio} | "
                 f"{1e3 * r['comm_s']:.3f} | {err} | {rank} |")
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
      left.axhline(r["test_accuracy"], color="k", ls=":", lw=1, label="pooled (final)")
      continue
    style = "-" if ("dad" in r["method"]) else "--"
    left.plot([h["total_bits"] for h in r["history"]], [h["test_accuracy"] for h in r["history"]],
              style, marker="o", ms=3, label=r["method"], color=color)
    right.scatter(r["bits_per_step"], max(r["grad_error"], 1e-8), label=r["method"],
                  marker="o" if "dad" in r["method"] else "s", color=color)
  left.set_xscale("log")
  left.set_xlabel("cumulative bits sent per site")
  left.set_ylabel("test accuracy")
  left.legend(fontsize=7, ncol=2)
  right.set_xscale("log")
  right.set_yscale("log")
  right.set_xlabel("bits per step per site")
  right.set_ylabel("relative gradient error vs exact")
  right.legend(fontsize=7, ncol=2)
  fig.suptitle(f"{task.name}: {task.config.model}, {task.config.num_sites} sites")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--config", action="append",
                      help="task config JSON (repeatable); default: the three dad_*.json")
  parser.add_argument("--steps", type=int, default=None, help="override steps")
  parser.add_argument("--methods", default=None, help="comma-separated methods override")
  parser.add_argument("--out", default=str(ROOT / "results"), help="output directory")
  args = parser.parse_args(argv)
  configs = args.config or [str(ROOT / c) for c in DEFAULT_CONFIGS]
  methods = args.methods.split(",") if args.methods else None
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  command = "python experiments/dad.py " + " ".join(argv if argv is not None else sys.argv[1:])
  sections = [f"# dAD / rank-dAD experiment\n\nCommand: `{command.strip()}`\n\n"
              f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices "
              f"(sites run under `vmap`).\n"]
  t0 = time.perf_counter()
  for path in configs:
    task = load_task(path, steps=args.steps)
    print(f"[{task.name}] {path}", flush=True)
    rows = run_task(task, methods)
    table = format_table(task, rows)
    print(table, flush=True)
    plot(task, rows, out / f"dad_{task.name}.png")
    sections.append(table + f"\n\n![{task.name}](dad_{task.name}.png)\n")
  sections.append(NOTES)
  sections.append(f"Total wall time: {time.perf_counter() - t0:.0f} s (2 CPU cores).\n")
  (out / "dad.md").write_text("\n".join(sections))
  print(f"wrote {out / 'dad.md'}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
