"""Where the added step time of ``topk:0.01`` and ``powersgd:4`` goes, against the fp32 step.

On the MLP 784-1024-1024-10 (batch 64 per site) over ``--sites`` forced CPU devices
(shard_map), times, alternately and to ``block_until_ready``:

* the full train steps of ``allreduce``, ``topk:0.01`` and ``powersgd:4`` (catalog specs,
  SGD with momentum 0.9, as ``experiments/bench_scale.py`` builds them);
* the pieces of each exchange on random gradients of the MLP's shapes, each in its own
  shard_map program over the same sites: TopK's selection (``top_k`` of ``|x|``), the
  selection plus the value gather, plus the all-gather of (values, indices), plus the
  scatter of the gathered pairs (the whole exchange); PowerSGD's ``M Q`` and ``M^T P``
  products, the orthogonalizations, the psums, and the whole exchange.

Every row is the median over ``--reps`` interleaved calls (each row's program runs once per
round, in turn, so a burst of load hits every row alike), in wall milliseconds and in CPU
milliseconds of this process (all threads: the work, less sensitive to other jobs on shared
cores than the wall time); ``uptime`` before and after.

    python experiments/bench_peer.py --reps 15 --label after --out experiments/results/bench_peer.md

PyTorch DDP on the same model (plain step and the PowerSGD hook) is a part of
``experiments/bench_scale.py --models mlp`` when torch is importable.

Not :func:`dadjax.run.train`: it times the raw compiled step and exchange
kernels on synthetic data, with nothing else in the loop.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from harness import uptime  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--sites", type=int, default=2)
  p.add_argument("--batch", type=int, default=64, help="examples per site")
  p.add_argument("--reps", type=int, default=15, help="interleaved rounds")
  p.add_argument("--label", default="run")
  p.add_argument("--parts", default="steps,topk,powersgd",
                 help="comma-separated of: steps, topk, powersgd")
  p.add_argument("--out", default=None, help="append the table to this markdown file")
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + f" --xla_force_host_platform_device_count={args.sites}")
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from jax.sharding import Mesh, PartitionSpec as P  # pylint: disable=g-import-not-at-top

  from dadjax import compress as C, make_train_step, methods, models  # pylint: disable=g-import-not-at-top
  from dadjax._core.linalg import orthogonalize  # pylint: disable=g-import-not-at-top
  from dadjax.compress._sparse import largest_magnitude_indices, _scatter  # pylint: disable=g-import-not-at-top

  parts = set(args.parts.split(","))
  n = args.sites
  mesh = Mesh(np.array(jax.devices()[:n]), ("data",))
  shapes = [(784, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)]
  rng = np.random.default_rng(0)
  grads = [jnp.asarray(rng.normal(size=(n, *s)).astype(np.float32)) for s in shapes]
  grads = [jax.device_put(g, jax.NamedSharding(mesh, P("data"))) for g in grads]
  rows = {}  # name -> callable returning something to block on

  def spmd(fn):
    """``fn`` on each site's slice of the leaves, jitted over the mesh."""
    f = jax.jit(jax.shard_map(lambda *xs: fn([x[0] for x in xs]), mesh=mesh,
                              in_specs=P("data"), out_specs=P(), check_vma=False))
    return lambda: f(*grads)

  if "steps" in parts:
    for spec in ("allreduce", "topk:0.01", "powersgd:4"):
      method = methods.build_method(spec, axis_name="data", seed=0, steps_per_epoch=10)
      model = models.get_model("mlp", 10, hidden=(1024, 1024))
      step = make_train_step(model, method.optimizer(optax.sgd(0.01, momentum=0.9)),
                             num_sites=n, backend="shard_map", check_ledger=False)
      host = {"x": rng.normal(size=(n * args.batch, 784)).astype(np.float32),
              "y": rng.integers(0, 10, size=(n * args.batch,)).astype(np.int32)}
      holder = {"state": step.init(jax.random.key(0), host["x"][:args.batch])}
      batch = step.place_batch(host)
      compiled = step._run.lower(holder["state"], batch).compile()  # pylint: disable=protected-access

      def run(compiled=compiled, holder=holder, batch=batch):
        holder["state"], metrics = compiled(holder["state"], batch)
        return holder["state"], metrics
      rows[f"step `{spec}`"] = run

  mats = [i for i, s in enumerate(shapes) if len(s) == 2]
  if "topk" in parts:
    ks = {i: max(1, round(0.01 * np.prod(shapes[i]))) for i in mats}

    def select(xs):
      return [largest_magnitude_indices(xs[i].reshape(-1), ks[i]) for i in mats]

    def pick(xs):
      out = []
      for i, idx in zip(mats, select(xs)):
        out.append((xs[i].reshape(-1)[idx], idx))
      return out

    def gathered(xs):
      return jax.lax.all_gather(pick(xs), "data")

    def exchange_part(xs):
      out = []
      for i, (v, idx) in zip(mats, gathered(xs)):
        out.append(_scatter(v.reshape(-1), idx.reshape(-1), xs[i], jnp.float32) / n)
      return out

    comp = C.get_compressor("topk:0.01")
    key = lambda: C.step_keys(0, jnp.int32(0), "data")  # noqa: E731  (inside the shard_map)
    rows["topk: selection (top_k of |x|)"] = spmd(select)
    rows["topk: + value gather"] = spmd(pick)
    rows["topk: + all-gather"] = spmd(gathered)
    rows["topk: + scatter (whole exchange, by hand)"] = spmd(exchange_part)
    rows["topk: C.exchange"] = spmd(  # comp and key bound now: they are traced at first call
        lambda xs, comp=comp, key=key: C.exchange(comp, tuple(xs), comp.init(tuple(xs)), key(),
                                                  "data").mean)

  if "powersgd" in parts:
    comp = C.get_compressor("powersgd:4")
    key = lambda: C.step_keys(0, jnp.int32(0), "data")  # noqa: E731  (inside the shard_map)
    qs = [jnp.asarray(rng.normal(size=(1, shapes[i][1], 4)).astype(np.float32)) for i in mats]

    def mq(xs):
      return [jnp.einsum("bmn,bnr->bmr", xs[i][None], q) for i, q in zip(mats, qs)]

    def mq_orth(xs):
      return [orthogonalize(p) for p in jax.lax.psum(mq(xs), "data")]

    def mtp(xs):
      ps = mq_orth(xs)
      return jax.lax.psum([jnp.einsum("bmn,bmr->bnr", xs[i][None], p)
                           for i, p in zip(mats, ps)], "data")

    ps = [jnp.asarray(rng.normal(size=(1, shapes[i][0], 4)).astype(np.float32)) for i in mats]
    rows["powersgd: M^T P as einsum('bmn,bmr->bnr') (before)"] = spmd(
        lambda xs: [jnp.einsum("bmn,bmr->bnr", xs[i][None], p) for i, p in zip(mats, ps)])
    rows["powersgd: M^T P as (P^T M)^T (after)"] = spmd(
        lambda xs: [jnp.swapaxes(jnp.einsum("bmr,bmn->brn", p, xs[i][None]), 1, 2)
                    for i, p in zip(mats, ps)])
    rows["powersgd: M Q"] = spmd(mq)
    rows["powersgd: + psum P, orthogonalize"] = spmd(mq_orth)
    rows["powersgd: + M^T P, psum Q"] = spmd(mtp)
    state = comp.init(tuple(x[0] for x in grads))
    rows["powersgd: C.exchange (with memory, warm start)"] = spmd(
        lambda xs, comp=comp, key=key: C.exchange(comp, tuple(xs), state, key(), "data").mean)

  load_before = uptime()
  for fn in rows.values():  # compile and warm up
    for _ in range(2):
      jax.block_until_ready(fn())
  times = {name: [] for name in rows}
  cpu = {name: [] for name in rows}
  for _ in range(args.reps):
    for name, fn in rows.items():
      t0, c0 = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn())
      times[name].append(1e3 * (time.perf_counter() - t0))
      cpu[name].append(1e3 * (time.process_time() - c0))
  load_after = uptime()
  command = "python " + " ".join(["experiments/bench_peer.py"] + list(
      sys.argv[1:] if argv is None else argv))
  lines = [f"### {args.label}", "", f"Command: `{command}`", "",
           f"Load before: `{load_before}`", "", f"Load after: `{load_after}`", "",
           "| what | wall median (ms) | q1 | q3 | CPU median (ms, all threads) |",
           "|---|---:|---:|---:|---:|"]
  for name, ts in times.items():
    q = statistics.quantiles(ts, n=4, method="inclusive") if len(ts) > 1 else [ts[0]] * 3
    lines.append(f"| {name} | {statistics.median(ts):.1f} | {q[0]:.1f} | {q[2]:.1f} | "
                 f"{statistics.median(cpu[name]):.1f} |")
  text = "\n".join(lines) + "\n"
  print(text)
  if args.out:
    with open(args.out, "a") as f:
      f.write(text + "\n")


if __name__ == "__main__":
  main()
