"""Compile time, compiled collective ops and train-state bytes of Accordion and dAD.

Per model and method: builds the shard_map step over ``--sites`` CPU devices,
times ``lower(...).compile()`` of the step once (a single run on shared cores:
noisy; "trace" is the ``lower`` part: Python tracing and lowering, the rest is
XLA's compilation), reads the optimized HLO's collective ops with
:func:`dadjax.comm.hlo_collectives` (``conditional`` counts the ops inside a
``lax.cond`` branch: compiled, run only when taken) and sums the bytes of one
site's train state. Every ratio is against the fp32 all-reduce step of the
same model. A warm-up compile (the MLP's fp32 step) runs first and is not reported.

Models: a 6-layer ``TransformerLM`` (d_model 256, 4 heads, MLP 1024, 256
bytes, 32 tokens) and the MLP 784-1024-1024-10.

    python experiments/bench_accordion.py --label after --out experiments/results/bench_accordion.md

Run once on the code before a change (``--label before``) and once after; the
rows are appended to ``--out`` under a heading with the label, the commit and
``uptime``'s load.

Not :func:`dadjax.run.train`: it compiles the raw step on a synthetic batch
and reads the compiled program; nothing is trained.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dadjax  # noqa: E402
from dadjax.comm import hlo_collectives  # noqa: E402
from dadjax.models import MLP, TransformerLM  # noqa: E402

METHODS = {
    "lm": ["allreduce", "accordion(powersgd:4,powersgd:1)", "dad", "rank_dad:4"],
    "mlp": ["allreduce", "accordion(powersgd:4,powersgd:1)"],
}


def _model(name: str, dense):
  kw = {} if dense is None else {"dense": dense}
  if name == "lm":
    return TransformerLM(num_layers=6, d_model=256, num_heads=4, mlp_dim=1024, vocab_size=256,
                         max_len=32, **kw)
  return MLP(hidden=(1024, 1024), num_classes=10, **kw)


def _batch(name: str, sites: int, rows: int):
  rng = np.random.default_rng(0)
  if name == "lm":
    tokens = rng.integers(0, 256, (sites * rows, 33)).astype(np.int32)
    return {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  return {"x": rng.normal(size=(sites * rows, 784)).astype(np.float32),
          "y": rng.integers(0, 10, sites * rows).astype(np.int32)}


def measure(model_name: str, spec: str, sites: int, rows: int) -> dict:
  """One row: compile seconds, collective ops (all, under cond) and state bytes per site."""
  method = dadjax.build_method(spec, axis_name="data", seed=0, steps_per_epoch=10,
                               lr_schedule=optax.constant_schedule(0.1))
  model = _model(model_name, method.dense)
  tx = method.optimizer(optax.sgd(0.1, momentum=0.9))
  step = dadjax.make_train_step(model, tx, num_sites=sites, backend="shard_map",
                                collections=getattr(method, "collections", None))
  batch = _batch(model_name, sites, rows)
  state = step.init(jax.random.key(0), batch["x"][:1])
  placed = step.place_batch(batch)
  t0 = time.perf_counter()
  lowered = step._run.lower(state, placed)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  seconds, trace = time.perf_counter() - t0, t1 - t0
  ops = hlo_collectives(compiled.as_text())
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(state)) // sites
  state, _ = compiled(state, placed)  # it runs
  jax.block_until_ready(state)
  return {"model": model_name, "method": spec, "compile_s": seconds, "trace_s": trace,
          "ops": dict(ops.count), "cond_ops": dict(ops.conditional_count),
          "state_bytes": state_bytes}


def profile(spec: str, layers: int = 2) -> str:
  """One line: trace / compile seconds and the optimized HLO's size on a small 2-layer LM.

  Op counts are deterministic (unlike times on shared cores): instructions, ``while`` loops,
  ``conditional`` ops and computations of the compiled module.
  """
  method = dadjax.build_method(spec, axis_name="data", seed=0, steps_per_epoch=10,
                               lr_schedule=optax.constant_schedule(0.1))
  kw = {} if method.dense is None else {"dense": method.dense}
  model = TransformerLM(num_layers=layers, d_model=64, num_heads=4, mlp_dim=128, vocab_size=64,
                        max_len=16, **kw)
  step = dadjax.make_train_step(model, method.optimizer(optax.sgd(0.1)), num_sites=2,
                                backend="shard_map",
                                collections=getattr(method, "collections", None))
  tokens = np.random.default_rng(0).integers(0, 64, (8, 17)).astype(np.int32)
  batch = {"x": tokens[:, :-1], "y": tokens[:, 1:]}
  state = step.init(jax.random.key(0), batch["x"][:1])
  placed = step.place_batch(batch)
  t0 = time.perf_counter()
  lowered = step._run.lower(state, placed)
  t1 = time.perf_counter()
  text = lowered.compile().as_text()
  t2 = time.perf_counter()
  lines = text.splitlines()
  ops = sum(1 for line in lines if " = " in line)
  computations = sum(1 for line in lines if line and not line.startswith(" ")
                     and line.rstrip().endswith("{"))
  return (f"| {spec} | {t1 - t0:.1f} | {t2 - t1:.1f} | {ops} | {text.count(' while(')} | "
          f"{text.count(' conditional(')} | {computations} |")


def _ops_text(row) -> str:
  parts = []
  for kind in sorted(row["ops"]):
    n, c = row["ops"][kind], row["cond_ops"].get(kind, 0)
    if not n:
      continue
    parts.append(f"{n} {kind.replace('_', '-')}" + (f" ({c} under cond)" if c else ""))
  return ", ".join(parts) or "0"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--label", required=True)
  parser.add_argument("--out", default=None)
  parser.add_argument("--models", default="lm,mlp")
  parser.add_argument("--methods", default=None, help="specs separated by ';' (default: all)")
  parser.add_argument("--sites", type=int, default=2)
  parser.add_argument("--rows", type=int, default=4, help="rows per site")
  parser.add_argument("--profile", action="store_true",
                      help="instead: HLO size per method on a 2-layer d_model 64 LM")
  args = parser.parse_args(argv)
  if args.profile:
    lines = [f"\n### HLO profile, {args.label}\n",
             "| method | trace (s) | compile (s) | HLO instructions | while | conditional | "
             "computations |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for spec in (args.methods or "allreduce;dad;rank_dad:4").split(";"):
      lines.append(profile(spec))
      print(lines[-1], flush=True)
    if args.out:
      with open(args.out, "a") as f:
        f.write("\n".join(lines) + "\n")
    return 0
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=os.path.dirname(dadjax.__file__)).stdout.strip()
  load = os.getloadavg()
  lines = [f"\n### {args.label} (dadjax at commit {commit}, load average "
           f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at the start)\n",
           "| model | method | compile (s) | of which trace (s) | vs fp32 | compiled collective ops | "
           "train state (MB/site) | vs fp32 |", "|---|---|---|---|---|---|---|---|"]
  print("\n".join(lines), flush=True)
  measure("mlp", "allreduce", args.sites, args.rows)  # warm-up: the first compile pays once-only costs
  for model_name in args.models.split(","):
    specs = METHODS[model_name] if args.methods is None else args.methods.split(";")
    if "allreduce" not in specs:
      specs = ["allreduce"] + specs
    base = None
    for spec in specs:
      row = measure(model_name, spec, args.sites, args.rows)
      base = base or row
      line = (f"| {model_name} | {spec} | {row['compile_s']:.1f} | {row['trace_s']:.1f} | "
              f"{row['compile_s'] / base['compile_s']:.1f} | {_ops_text(row)} | "
              f"{row['state_bytes'] / 1e6:.1f} | {row['state_bytes'] / base['state_bytes']:.2f} |")
      lines.append(line)
      print(line, flush=True)
  if args.out:
    with open(args.out, "a") as f:
      f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
  sys.exit(main())
