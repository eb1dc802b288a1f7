"""Where compression stops paying: modeled step time against N and bandwidth.

For each method: one short run on the embedded digits (8 sites, shard_map)
gives the ledger (payload bits per site and optimizer step, per collective
kind) and the compiled step's collective ops; a one-site run of the same
step gives the measured compute time per step on this host. The per-site
payload does not depend on N (every site keeps its own batch), so the
modeled step time at N sites, bandwidth ``bw`` and topology ``topo`` is

    compute + NetworkModel(bw, latency, N, topo).step_time(ledger, compiled ops)

(:mod:`dadjax.comm._wire`: ring all-reduce 2(N-1)/N B, ring all-gather
(N-1) B; parameter server: the server link carries N workers' traffic).
The baseline is a bf16 all-reduce of the same tensors with the compiled
fp32 all-reduce's op count. For each method, bandwidth and topology the
table gives the smallest N in 2..1024 from which the method is slower than
the bf16 all-reduce ("never" if it never is; "always" if it is slower at
N = 2).

A compressor on the two-phase route (``qsgd:16:route=two_phase``,
:mod:`dadjax.compress._two_phase`) is the exception: its all-gather carries
one chunk of ``1/N`` of the gradient, so its payload does depend on N. Its
ledger at each N is the route's exact payload for the run's parameter
shapes (:func:`dadjax.compress._two_phase.two_phase_bits`; at N = 8 it is
checked against the run's own ledger), with the compiled program's ops
(one all-to-all, charged as an all-gather, and one all-gather).

Run (about a minute per method on a laptop CPU):

    python experiments/scaling.py --steps 30 --out experiments/results
    python experiments/scaling.py --steps 20 --hidden 512,512 --name scaling_mlp512
    python experiments/scaling.py --methods bf16,qsgd:16,qsgd:16:route=two_phase,sign,\
sign:route=two_phase --steps 3 --workload fashion_mlp --name scaling_two_phase_fashion_mlp
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # 8 simulated CPU devices
                           + " --xla_force_host_platform_device_count=8").strip()

import dataclasses  # noqa: E402

import jax  # noqa: E402

from dadjax.comm import NetworkModel, comm_stats, report  # noqa: E402
from dadjax.compress import get_compressor  # noqa: E402
from dadjax.compress._two_phase import two_phase_bits  # noqa: E402
from dadjax.config import Config  # noqa: E402
from dadjax.run._demo import DEFAULT_METHODS  # noqa: E402
from dadjax.train import build, train  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position
import workloads  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position

METHODS = ("allreduce", "bf16", "topk:0.01", "qsgd:16", "sign", "powersgd:2", "dad", "rank_dad:2")
SITES = tuple(2**i for i in range(1, 11))
BANDWIDTHS = (1e8, 1e9, 1e10, 1e11)
TOPOLOGIES = ("ring", "ps")


def compute_seconds(method: str, base: Config, repeats: int = 30) -> float:
  """Measured wall time of one step of a one-site run (no collective moves bits).

  The minimum over ``repeats`` timed steps: on a shared host the minimum is
  the estimate least disturbed by other processes.
  """
  config = base.replace(method=method, num_sites=1, backend="vmap", steps=1)
  dataset, _, batcher, step_fn = build(config)
  state = step_fn.init(jax.random.key(0), dataset.x_train[:config.batch_per_site])
  x, y = batcher.batch_at(0)
  placed = step_fn.place_batch({"x": x, "y": y})
  state, metrics = step_fn.run(state, placed)  # compile
  jax.block_until_ready(metrics)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, metrics = step_fn.run(state, placed)
    jax.block_until_ready((state, metrics))
    times.append(time.perf_counter() - t0)
  return min(times)


def measure(methods, steps: int, base: Config, keep_lr: bool = False) -> dict:
  out = {}
  for method in methods:
    config = base.replace(method=method, steps=steps, eval_every=steps,
                          lr=base.lr if keep_lr else DEFAULT_METHODS.get(method, base.lr))
    run = train(config, progress=False)
    rows = config.num_sites * config.batch_per_site
    ops = run.step_fn.collectives(run.state, {"x": run.dataset.x_train[:rows],
                                              "y": run.dataset.y_train[:rows]})
    out[method] = {"summary": comm_stats(run.state.opt_state), "ops": ops,
                   "compute_s": compute_seconds(method, base),
                   "params": sum(x[0].size for x in jax.tree.leaves(run.state.params))}
    codec = _two_phase_codec(method)
    if codec is not None:  # the payload depends on N: the route's exact bits at every N
      like = jax.tree.map(lambda x: x[0], run.state.params)  # one site's (stacked per site)
      out[method]["bits_at"] = {n: sum(_payload(codec, like, n)) for n in SITES}
      booked = out[method]["summary"].gather_bits[0]
      if out[method]["bits_at"][config.num_sites] != booked:
        raise RuntimeError(f"{method}: two_phase_bits gives {out[method]['bits_at'][config.num_sites]} bits at "
                           f"N = {config.num_sites}, the run booked {booked}")
    at_n = report(out[method]["summary"], NetworkModel(num_sites=config.num_sites))
    print(f"{method}: payload {at_n.payload_bits_per_step:,} bits/step/site, "
          f"ops {ops.count['reduce']} reduce + {ops.count['gather']} gather + "
          f"{ops.count['all_to_all']} all-to-all, "
          f"compute {out[method]['compute_s'] * 1e3:.2f} ms", flush=True)
  return out


def _two_phase_codec(method: str):
  """The chunk codec of a compressor spec on the two-phase route, else ``None``."""
  if "route=two_phase" not in method:
    return None
  return getattr(get_compressor(method).exchange, "codec", None)


def _payload(codec, like, n: int) -> tuple[int, int]:
  """A site's booked gather payload at N sites: one all-to-all row, one all-gather chunk."""
  a2a, chunk = two_phase_bits(codec, like, n)
  return a2a // n, chunk


def summary_at(m: dict, n: int):
  """The ledger at N sites: the run's, or the two-phase route's payload at N."""
  if "bits_at" not in m:
    return m["summary"]
  return dataclasses.replace(m["summary"], gather_bits=(m["bits_at"][n],), reduce_bits=(0,))


def step_time(m: dict, n: int, bw: float, topo: str, latency: float) -> float:
  net = NetworkModel(bw, latency, n, topo)
  return m["compute_s"] + report(summary_at(m, n), net, ops=m["ops"]).modeled_comm_s_per_step


def bf16_time(ref: dict, n: int, bw: float, topo: str, latency: float) -> float:
  net = NetworkModel(bw, latency, n, topo)
  return ref["compute_s"] + net.baseline_time(ref["summary"], 16, ops=ref["ops"].count["reduce"])


def crossover(m, ref, bw, topo, latency) -> str:
  slower = [n for n in SITES if step_time(m, n, bw, topo, latency) > bf16_time(ref, n, bw, topo, latency)]
  if not slower:
    return "never"
  first = slower[0]
  if any(step_time(m, n, bw, topo, latency) <= bf16_time(ref, n, bw, topo, latency)
         for n in SITES if n > first):
    return f"{first} (not beyond)" if first != SITES[0] else "always (not beyond)"
  return "always" if first == SITES[0] else str(first)


def table(measured, latency) -> str:
  ref = measured["allreduce"]
  head = "| method | payload bits/step/site (N = 8) | ring wire bits/site (N = 8) | compiled ops | compute (ms) | " + " | ".join(
      f"{topo} {bw / 1e9:g} Gb/s" for topo in TOPOLOGIES for bw in BANDWIDTHS) + " |"
  lines = [head, "|" + "---|" * (5 + len(TOPOLOGIES) * len(BANDWIDTHS))]
  for method, m in measured.items():
    cells = [crossover(m, ref, bw, topo, latency) for topo in TOPOLOGIES for bw in BANDWIDTHS]
    at8 = report(summary_at(m, 8), NetworkModel(num_sites=8))
    lines.append(f"| {method} | {at8.payload_bits_per_step:,} | {at8.wire_bits_per_step:,.0f} | "
                 f"{m['ops'].ops} | "
                 f"{m['compute_s'] * 1e3:.2f} | " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plot(measured, latency, path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
  ref = measured["allreduce"]
  for ax, topo in zip(axes, TOPOLOGIES):
    for method, m in measured.items():
      ax.plot(SITES, [step_time(m, n, 1e9, topo, latency) for n in SITES], marker=".", label=method)
    ax.plot(SITES, [bf16_time(ref, n, 1e9, topo, latency) for n in SITES], "k--", label="bf16 all-reduce")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sites N")
    ax.set_title(f"{topo}, 1 Gbit/s, {latency * 1e6:g} us latency")
  axes[0].set_ylabel("modeled step time (s)")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def m_params(measured) -> int:
  return measured["allreduce"]["params"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=30)
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--latency", type=float, default=50e-6)
  parser.add_argument("--hidden", default="64,64", help="MLP hidden widths, comma-separated")
  harness.common_args(parser, "scaling", f"a real workload ({', '.join(workloads.WORKLOADS)}) "
                      "instead of the digits MLP (--hidden is then ignored)",
                      quick="the workload at its quick sizes", seeds=None)
  args = parser.parse_args(argv)
  methods = args.methods.split(",")
  if "allreduce" not in methods:
    methods = ["allreduce"] + methods
  hidden = tuple(int(h) for h in args.hidden.split(","))
  if args.workload:
    wl = workloads.get(args.workload)
    if wl.available():
      parser.error(f"--workload {args.workload}: {wl.available()}")
    base = wl.config(args.quick, latency=args.latency, backend="shard_map")
    what = f"{wl.describe(args.quick)}"
  else:
    base = Config(latency=args.latency, model_kwargs={"hidden": hidden})
    what = f"digits MLP hidden={hidden}"
  measured = measure(methods, args.steps, base, keep_lr=bool(args.workload))
  text = table(measured, args.latency)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  plot(measured, args.latency, out / f"{args.name}.png")
  command = harness.command_line("scaling.py", argv if argv is not None else sys.argv[1:])
  (out / f"{args.name}.md").write_text(
      "# Where compression stops paying\n\n"
      f"Command: `{command}` ({what}, {base.batch_per_site} rows per site, "
      f"{m_params(measured):,} parameters, ledger from an "
      f"8-site shard_map run of {args.steps} steps; compute time: the fastest of 30 one-site steps on this "
      f"host's CPU, shared with other processes).\n\n"
      "Each cell: the smallest N (of 2, 4, ..., 1024) from which the method's modeled step time "
      "(compute + communication, latency per compiled collective op) exceeds a bf16 all-reduce of "
      "the same tensors. `never`: it stays faster up to N = 1024; `always`: slower already at "
      "N = 2; `(not beyond)`: it becomes faster again at larger N. The `bf16` method moves "
      "exactly the baseline's bits, so its row only compares measured compute (the cast costs a "
      "little); `allreduce` moves twice the bits.\n\n" + text +
      f"\n\n![modeled step time]({args.name}.png)\n")
  print(text)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
