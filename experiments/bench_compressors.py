"""Step time and bits of every compressor against the fp32 all-reduce step.

Times the full jitted SPMD train step (forward, backward, compressed
collective, SGD with momentum 0.9) of a CIFAR-10-shaped ResNet-18 with each
compressor, against the same step with ``dadjax.allreduce`` (fp32 psum).
Both steps are compiled and warmed up first; then the two are run
alternately (fp32, method, fp32, method, ...), each call timed to
``block_until_ready``, and the median of the per-pair time ratios is
reported next to the bits: payload bits each site hands to collectives per
step (the ledger), wire bits per site under ``--topology`` at ``--wire-sites``
N (default: the run's sites; an all-gather of B bits sends (N-1) B per site
on a ring, an all-reduce 2 (N-1)/N B), and the wire ratio against an fp32
and a bf16 all-reduce of the same tensors (> 1: fewer bits on the wire).
Bits do not depend on the timing, so they can be stated for a larger N
than the run simulates; they are :func:`dadjax.comm.report` of the
optimizer's ledger at that N.

Not :func:`dadjax.run.train`: it times the raw jitted step on a synthetic
batch, placed once, with nothing else in the loop.

Examples:
  # one GPU (default: one site)
  python experiments/bench_compressors.py
  # 8 GPUs, 8 sites over shard_map
  python experiments/bench_compressors.py --sites 8
  # small CPU run with two simulated devices
  python experiments/bench_compressors.py --host-devices 2 --sites 2 \\
      --batch 16 --width 16 --steps 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_METHODS = ("identity,bf16,topk:0.01,ef_topk:0.01,randomk:0.01,qsgd:16,terngrad,"
                   "sign,ef_scaled_sign,powersgd:1,powersgd:4")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--steps", type=int, default=20, help="timed (fp32, method) pairs per method")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps after compiling")
  p.add_argument("--sites", type=int, default=1, help="number of data-parallel sites")
  p.add_argument("--batch", type=int, default=128, help="examples per site")
  p.add_argument("--width", type=int, default=64, help="ResNet-18 base width (64 = standard)")
  p.add_argument("--lr", type=float, default=0.1)
  p.add_argument("--methods", default=DEFAULT_METHODS,
                 help="comma-separated compressor specs (see dadjax.compress.get_compressor)")
  p.add_argument("--backend", default="auto", choices=("auto", "shard_map", "vmap"),
                 help="auto: shard_map when there are enough devices, else vmap")
  p.add_argument("--host-devices", type=int, default=None,
                 help="simulate this many CPU devices (sets XLA_FLAGS; CPU runs only)")
  p.add_argument("--wire-sites", type=int, default=None,
                 help="N the wire bits and ratios are stated for (default: --sites)")
  p.add_argument("--topology", default="ring", choices=("ring", "ps"),
                 help="topology of the wire bits (ring, or parameter server)")
  p.add_argument("--markdown", default=None, help="also write the table to this file")
  args = p.parse_args(argv)
  if args.wire_sites is None:
    args.wire_sites = args.sites
  for name in ("steps", "sites", "batch", "width", "wire_sites"):
    if getattr(args, name) < 1:
      p.error(f"--{name.replace('_', '-')} must be >= 1")
  return args


def main(argv=None):
  args = parse_args(argv)
  if args.host_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.host_devices}")
  # jax is imported after XLA_FLAGS is final.
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax import compress  # pylint: disable=g-import-not-at-top
  from dadjax.comm import NetworkModel, report  # pylint: disable=g-import-not-at-top
  from dadjax.models import ResNet18  # pylint: disable=g-import-not-at-top

  backend = args.backend
  if backend == "auto":
    backend = "shard_map" if args.sites <= len(jax.devices()) else "vmap"
  methods = [m.strip() for m in args.methods.split(",") if m.strip()]
  for m in methods:
    compress.get_compressor(m)  # fail fast on a bad spec

  model = ResNet18(num_classes=10, width=args.width)
  rng = np.random.default_rng(0)
  n = args.sites * args.batch
  batch = {"x": rng.normal(size=(n, 32, 32, 3)).astype(np.float32),
           "y": rng.integers(0, 10, size=(n,)).astype(np.int32)}

  def build(comm):
    tx = optax.chain(comm, optax.sgd(args.lr, momentum=0.9))
    ts = dadjax.make_train_step(model, tx, num_sites=args.sites, backend=backend)
    state = ts.init(jax.random.key(0), batch["x"][:2])
    # Place the batch once so host-side placement is not part of the timed step.
    placed = ts.place_batch(batch)
    run = ts.run
    t0 = time.perf_counter()
    state, metrics = run(state, placed)
    jax.block_until_ready((state, metrics))
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
      state, metrics = run(state, placed)
    jax.block_until_ready(state)
    return {"run": run, "state": state, "batch": placed, "compile_s": compile_s}

  def timed(job):
    t0 = time.perf_counter()
    state, metrics = job["run"](job["state"], job["batch"])
    jax.block_until_ready((state, metrics))
    job["state"], job["metrics"] = state, metrics
    return time.perf_counter() - t0

  dev = jax.devices()[0]
  print(f"# devices: {len(jax.devices())} x {dev.platform} ({dev.device_kind}); backend={backend}, "
        f"sites={args.sites}, batch/site={args.batch}, width={args.width}, steps={args.steps}",
        flush=True)
  base = build(dadjax.allreduce("data"))
  num_params = sum(x.size for x in jax.tree.leaves(base["state"].params)) // args.sites
  print(f"# ResNet-18 parameters: {num_params:,}; fp32 step compiled in "
        f"{base['compile_s']:.1f}s", flush=True)

  network = NetworkModel(num_sites=args.wire_sites, topology=args.topology)
  rows = []
  for spec in methods:
    job = build(compress.compressed(compress.get_compressor(spec), "data"))
    ratios, t_base, t_method = [], [], []
    for _ in range(args.steps):
      b = timed(base)
      m = timed(job)
      t_base.append(b)
      t_method.append(m)
      ratios.append(m / b)
    # the optimizer's ledger only (the step's metrics pmean is not the compressor's)
    rep = report(job["state"].opt_state, network)
    loss = float(np.mean(np.asarray(job["metrics"]["loss"])))
    row = {
        "method": spec,
        "ms": 1e3 * statistics.median(t_method),
        "base_ms": 1e3 * statistics.median(t_base),
        "ratio": statistics.median(ratios),
        "bits": rep.payload_bits_per_step,
        "wire": rep.wire_bits_per_step,
        "fp32_wire": rep.fp32_wire_bits_per_step,
        "bf16_wire": rep.bf16_wire_bits_per_step,
        "vs_fp32": rep.wire_ratio_fp32,
        "vs_bf16": rep.wire_ratio_bf16,
        "compile_s": job["compile_s"],
        "loss": loss,
    }
    rows.append(row)
    print(f"{spec:>16}: {row['ms']:9.2f} ms vs fp32 {row['base_ms']:9.2f} ms -> "
          f"x{row['ratio']:.3f}  payload {row['bits']:,}  wire {row['wire']:,.0f} "
          f"(vs fp32 {row['vs_fp32']:.2f}x, vs bf16 {row['vs_bf16']:.2f}x)"
          f"  compile {row['compile_s']:.1f}s  loss {loss:.3f}", flush=True)

  wn, topo = args.wire_sites, args.topology
  table = [f"| method | step (ms) | fp32 step (ms) | median time ratio | payload bits/step/site | "
           f"wire bits/step/site ({topo}, N={wn}) | wire ratio vs fp32 | vs bf16 | compile (s) |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  fp32 = report(base["state"].opt_state, network)  # an fp32 all-reduce of these tensors
  fp32_bits, fp32_wire, bf16_wire = (fp32.payload_bits_per_step, fp32.fp32_wire_bits_per_step,
                                     fp32.bf16_wire_bits_per_step)

  def ratio(x):
    return f"{x:.2f}x" + (" (more)" if x < 1 else "")

  table.append(f"| fp32 psum (`dadjax.allreduce`) | {statistics.median(r['base_ms'] for r in rows):.2f}"
               f" | - | 1.000 | {fp32_bits:,} | {fp32_wire:,.0f} | 1.00x | "
               f"{ratio(bf16_wire / fp32_wire) if fp32_wire else '-'} | "
               f"{base['compile_s']:.1f} |")
  for r in rows:
    table.append(f"| `{r['method']}` | {r['ms']:.2f} | {r['base_ms']:.2f} | {r['ratio']:.3f} | "
                 f"{r['bits']:,} | {r['wire']:,.0f} | {ratio(r['vs_fp32'])} | "
                 f"{ratio(r['vs_bf16'])} | {r['compile_s']:.1f} |")
  more = [r["method"] for r in rows if r["vs_fp32"] < 1]
  table.append("")
  table.append(f"Wire bits per site and step, {topo} of N={wn} sites: an fp32 all-reduce of these "
               f"tensors {fp32_wire:,.0f}, a bf16 all-reduce {bf16_wire:,.0f}. \"(more)\": more "
               f"wire bits than that baseline. More than fp32: "
               + (", ".join(f"`{m}`" for m in more) or "none") + ".")
  text = "\n".join(table)
  print()
  print(text)
  if args.markdown:
    with open(args.markdown, "w") as f:
      f.write("Command: `python " + " ".join([sys.argv[0]] + list(argv or sys.argv[1:])) + "`\n\n")
      f.write(f"Devices: {len(jax.devices())} x {dev.platform} ({dev.device_kind}), "
              f"backend {backend}\n\n{text}\n")
  return rows


if __name__ == "__main__":
  main()
