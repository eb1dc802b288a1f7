"""Compile time, collective ops, step time and memory of every method at sizes users train.

For each model (ResNet-18 width 64, a ViT with d_model 512 and 6 layers, the
wide MLP 784-1024-1024-10) and each method, the full jitted SPMD train step
(forward, backward, the method's communication, SGD with momentum 0.9) is
built with :func:`dadjax.make_train_step` from the method's catalog spec, then:

* **compile s**: CPU seconds of ``lower(...).compile()`` (this process, all
  threads: on shared cores the wall time mostly measures the other jobs;
  the wall time is printed too), single run;
* **ops**: the compiled collective ops (:func:`dadjax.comm.hlo_collectives`
  of the optimized HLO), all-reduces + all-gathers; the fp32 step has one
  all-reduce of the gradients plus the metrics' (XLA combines them);
* **step ratio**: the method's step and the fp32 all-reduce step run
  alternately (fp32, method, fp32, method, ...), each call timed to
  ``block_until_ready``; the median and quartiles of the per-pair ratios;
* **state**: bytes of one site's train state (parameters, optimizer and
  method state), and its ratio to the fp32 step's;
* **peak**: ``compiled.memory_analysis()`` of one device's program
  (arguments + outputs + temporaries - aliased), MB.

The fp32 reference is ``allreduce``. CPU runs simulate ``--sites`` XLA host
devices (shard_map); ``--device gpu`` runs on the accelerator with the sites
simulated by vmap on its one device (no collective ops to read there) and
writes into ``experiments/results/device/``. ``--ablate`` adds kernel timings
on each model's parameter shapes (noise, packing, top-k selection,
orthogonalization; see :func:`ablations`). On the MLP, when ``torch`` is importable
(it is not a dependency), PyTorch DDP rows follow: the plain step and DDP with the PowerSGD
hook (rank 4, error feedback, warm start) over ``--sites`` gloo processes (``--torch``);
``--processes`` adds dadjax's MLP rows in that layout (each site its own process, one device
and one XLA thread, gloo over 127.0.0.1), where the shard_map rows run every site's kernels
in one process, one after the other.

Not :func:`dadjax.run.train`: it compiles and times the raw step on a
synthetic batch, placed once, with nothing else in the loop.

Examples:
  python experiments/bench_scale.py --quick                 # small sizes, a smoke run
  python experiments/bench_scale.py --models vit --methods allreduce,qsgd:16 --pairs 5
  python experiments/bench_scale.py --device gpu            # on an accelerator
  python experiments/bench_scale.py --models mlp --methods allreduce,powersgd:4 --processes
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DEFAULT_METHODS = ("allreduce,bf16,topk:0.01,ef_topk:0.01,qsgd:16,terngrad,sign,ef_sign,"
                   "powersgd:4,dad,rank_dad:4,rank_dad:4:block,accordion(powersgd:4,powersgd:1),"
                   "dataquant:4")

# name -> (registered model, full-size kwargs, quick kwargs, input shape, batch per site)
MODELS = {
    "resnet18": ("resnet18", {"width": 64}, {"width": 8}, (32, 32, 3), 16),
    "vit": ("vit", {"num_layers": 6, "d_model": 512, "num_heads": 8, "mlp_dim": 2048},
            {"num_layers": 2, "d_model": 64, "num_heads": 4, "mlp_dim": 128}, (32, 32, 3), 8),
    "mlp": ("mlp", {"hidden": (1024, 1024)}, {"hidden": (128, 128)}, (784,), 64),
}
LABELS = {"resnet18": "ResNet-18", "vit": "ViT", "mlp": "MLP 784-1024-1024-10"}


def split_specs(text: str) -> list[str]:
  """Comma-separated specs; commas inside parentheses belong to a spec (``accordion(a,b)``)."""
  out, depth, cur = [], 0, ""
  for ch in text:
    depth += (ch == "(") - (ch == ")")
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  out.append(cur.strip())
  return [s for s in out if s]


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--models", default="resnet18,vit,mlp", help=f"of {','.join(MODELS)}")
  p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated method specs")
  p.add_argument("--sites", type=int, default=None, help="sites (default: 2 on CPU, 8 on GPU)")
  p.add_argument("--pairs", type=int, default=10, help="timed (fp32, method) pairs per method")
  p.add_argument("--batch", type=int, default=None, help="examples per site (default per model)")
  p.add_argument("--quick", action="store_true",
                 help="small models, batch 4, 3 pairs: a smoke run of every column")
  p.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
  p.add_argument("--ablate", action="store_true", help="also time the compressor kernels")
  p.add_argument("--per-leaf", action="store_true",
                 help="leafwise compressors one leaf at a time (the reference form), not one "
                      "vmap per group of same-shape leaves")
  p.add_argument("--torch", default="auto", choices=("auto", "on", "off"),
                 help="PyTorch DDP rows on the MLP (plain step and the PowerSGD hook) when torch "
                      "is importable (auto), required (on) or never (off)")
  p.add_argument("--processes", action="store_true",
                 help="also run the MLP rows with each site in its own process (one device and "
                      "one thread each, gloo over 127.0.0.1): the torch rows' layout")
  p.add_argument("--out", default=None, help="results file (default experiments/results/"
                 "bench_scale.md, or device/bench_scale.md with --device gpu)")
  args = p.parse_args(argv)
  args.models = split_specs(args.models)
  for m in args.models:
    if m not in MODELS:
      p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
  args.methods = split_specs(args.methods)
  if "allreduce" not in args.methods:
    args.methods.insert(0, "allreduce")
  if args.sites is None:
    args.sites = 8 if args.device == "gpu" else 2
  if args.quick:
    args.pairs = min(args.pairs, 3)
  for name in ("sites", "pairs"):
    if getattr(args, name) < 1:
      p.error(f"--{name} must be >= 1")
  if args.out is None:
    sub = "device/" if args.device == "gpu" else ""
    args.out = f"experiments/results/{sub}bench_scale{'_quick' if args.quick else ''}.md"
  return args


class Job:
  """One compiled step of a method on a model, ready to be timed."""

  def __init__(self, args, model_name, spec):
    import jax  # pylint: disable=g-import-not-at-top
    import numpy as np  # pylint: disable=g-import-not-at-top
    import optax  # pylint: disable=g-import-not-at-top
    from dadjax import make_train_step, methods, models  # pylint: disable=g-import-not-at-top
    from dadjax.comm import hlo_collectives  # pylint: disable=g-import-not-at-top

    name, full, small, shape, batch = MODELS[model_name]
    kwargs = small if args.quick else full
    batch = args.batch or (4 if args.quick else batch)
    method = methods.build_method(spec, axis_name="data", seed=0, steps_per_epoch=10)
    dense = {"dense": method.dense} if method.dense is not None else {}
    model = models.get_model(name, 10, **dense, **kwargs)
    step = make_train_step(
        model, method.optimizer(optax.sgd(0.01, momentum=0.9)), num_sites=args.sites,
        backend="vmap" if args.device == "gpu" else "shard_map", batch_stage=method.batch_stage,
        collections=method.collections or None, check_ledger=False)
    rng = np.random.default_rng(0)
    n = args.sites * batch
    host = {"x": rng.normal(size=(n, *shape)).astype(np.float32),
            "y": rng.integers(0, 10, size=(n,)).astype(np.int32)}
    self.state = step.init(jax.random.key(0), host["x"][:batch])
    self.batch = step.place_batch(host)
    t0, c0 = time.perf_counter(), time.process_time()
    self.compiled = step._run.lower(self.state, self.batch).compile()  # pylint: disable=protected-access
    self.compile_wall = time.perf_counter() - t0
    self.compile_s = time.process_time() - c0  # CPU seconds: less sensitive to shared cores
    self.ops = None if args.device == "gpu" else hlo_collectives(self.compiled.as_text())
    self.state_bytes = sum(x.nbytes for x in jax.tree.leaves(self.state)) / args.sites
    self.peak = peak_bytes(self.compiled)
    self.params = sum(x.size for x in jax.tree.leaves(self.state.params)) // args.sites
    for _ in range(2):  # warm-up
      self.step()

  def step(self) -> float:
    import jax  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    self.state, metrics = self.compiled(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))
    return time.perf_counter() - t0


def peak_bytes(compiled) -> float | None:
  """Peak bytes of one device's program from ``memory_analysis()`` (None if unavailable)."""
  try:
    mem = compiled.memory_analysis()
  except Exception:  # pylint: disable=broad-except
    return None
  if mem is None:
    return None
  peak = getattr(mem, "peak_memory_in_bytes", 0) or 0
  if peak:
    return float(peak)
  return float(mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
               - mem.alias_size_in_bytes)


def quartiles(xs):
  if len(xs) < 2:
    return xs[0], xs[0], xs[0]
  q = statistics.quantiles(xs, n=4, method="inclusive")
  return q[0], statistics.median(xs), q[2]


def bench_model(args, model_name) -> list[dict]:
  """Every method on one model against its fp32 all-reduce step."""
  base = Job(args, model_name, "allreduce")
  print(f"# {model_name}: {base.params:,} parameters; fp32 step compiled in "
        f"{base.compile_s:.1f} CPU s", flush=True)
  rows = []
  for spec in args.methods:
    try:
      job = base if spec == "allreduce" else Job(args, model_name, spec)
    except Exception as e:  # pylint: disable=broad-except
      msg = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
      print(f"{spec:>36}: FAILED {type(e).__name__}: {msg}", flush=True)
      rows.append({"method": spec, "error": f"{type(e).__name__}: {msg}"})
      continue
    ratios, t_base, t_job = [], [], []
    for _ in range(args.pairs):
      b = base.step()
      m = b if job is base else job.step()
      t_base.append(b)
      t_job.append(m)
      ratios.append(m / b)
    q1, med, q3 = quartiles(ratios)
    row = {"method": spec, "compile_s": job.compile_s, "compile_ratio": job.compile_s / base.compile_s,
           "ops": job.ops, "ratio": (q1, med, q3), "ms": 1e3 * statistics.median(t_job),
           "base_ms": 1e3 * statistics.median(t_base), "state": job.state_bytes,
           "state_ratio": job.state_bytes / base.state_bytes, "peak": job.peak}
    rows.append(row)
    print(f"{spec:>36}: compile {row['compile_s']:6.1f} CPU s ({row['compile_ratio']:.1f}x; "
          f"wall {job.compile_wall:.0f} s)  "
          f"ops {ops_text(job.ops)}  step x{med:.2f} [{q1:.2f}, {q3:.2f}] "
          f"({row['ms']:.0f} vs {row['base_ms']:.0f} ms)  state {row['state'] / 1e6:.1f} MB "
          f"({row['state_ratio']:.2f}x)  peak {mb(job.peak)}", flush=True)
    if job is not base:
      del job
  return rows


def ops_text(ops) -> str:
  if ops is None:
    return "-"
  text = f"{ops.count['reduce']} AR"
  if ops.count["gather"]:
    text += f" + {ops.count['gather']} AG"
  others = sum(ops.count[k] for k in ("reduce_scatter", "all_to_all", "permute"))
  return text + (f" + {others} other" if others else "")


def mb(x) -> str:
  return "-" if x is None else f"{x / 1e6:.0f}"


def table(model_name, rows) -> list[str]:
  lines = [f"### {LABELS[model_name]}", "",
           "| method | compile (CPU s) | vs fp32 | compiled collective ops | step vs fp32: median "
           "[q1, q3] | step (ms) | train state (MB) | vs fp32 | peak (MB) |",
           "|---|---:|---:|---|---|---:|---:|---:|---:|"]
  for r in rows:
    if "error" in r:
      lines.append(f"| `{r['method']}` | failed: {r['error']} | | | | | | | |")
      continue
    q1, med, q3 = r["ratio"]
    lines.append(f"| `{r['method']}` | {r['compile_s']:.1f} | {r['compile_ratio']:.2f} | "
                 f"{ops_text(r['ops'])} | {med:.2f} [{q1:.2f}, {q3:.2f}] | {r['ms']:.0f} | "
                 f"{r['state'] / 1e6:.1f} | {r['state_ratio']:.2f} | {mb(r['peak'])} |")
  return lines + [""]


def _time(fn, *xs, reps=5):
  """(compile s, median run ms) of ``jax.jit(fn)`` on ``xs``."""
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  compiled = jax.jit(fn).lower(*xs).compile()
  compile_s = time.perf_counter() - t0
  jax.block_until_ready(compiled(*xs))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(*xs))
    ts.append(time.perf_counter() - t0)
  return compile_s, 1e3 * statistics.median(ts)


def ablations(args, model_name, base_ms) -> list[str]:
  """Kernel timings on the model's parameter shapes (one site, no collective), each jitted alone.

  Long because it is one table: each row times one kernel variant on the same gradients.

  Rows: a compressor's compress + decompress in its one-buffer form and in its
  per-leaf form (``dadjax.compress._segments.FUSED``); the noise alone (one
  threefry call vs one per leaf); packing + unpacking every entry at QSGD:16's
  6 bits (codes straddle words) vs 4 bits (they do not); TopK's exact and
  approximate selection (and the approximate one's recall); PowerSGD's
  orthogonalization per shape group vs one padded batch.
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from dadjax import compress, models  # pylint: disable=g-import-not-at-top
  from dadjax._core.linalg import orthogonalize  # pylint: disable=g-import-not-at-top
  from dadjax._core.packing import pack_bits, unpack_bits  # pylint: disable=g-import-not-at-top
  from dadjax.compress import _powersgd, _segments  # pylint: disable=g-import-not-at-top

  name, full, small, shape, _ = MODELS[model_name]
  model = models.get_model(name, 10, **(small if args.quick else full))
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, *shape))))["params"]
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(shapes))))
  grads = jax.tree.map(lambda s: jax.random.normal(next(keys), s.shape, s.dtype), shapes)
  key = compress.step_keys(0, jnp.int32(0), None)
  rows = []

  def add(what, compile_s, ms, note=""):
    rows.append(f"| {what} | {compile_s:.1f} | {ms:.1f} | {ms / base_ms:.2f} | {note} |")

  for spec in ("qsgd:16", "terngrad", "topk:0.01"):
    c = compress.get_compressor(spec)
    for fused in (True, False):
      _segments.FUSED = fused
      roundtrip = lambda g, c=c: c.decompress(c.compress(g, c.init(g), key)[0], g, key)  # a new
      add(f"`{spec}` compress + decompress, {'one buffer' if fused else 'per leaf'}",  # function:
          *_time(roundtrip, grads))  # no trace cache across FUSED
    _segments.FUSED = True
  leaves = jax.tree.leaves(grads)
  paths = [str(i) for i in range(len(leaves))]
  lay = _segments.layout([x.size for x in leaves])
  add("noise, one threefry call", *_time(lambda k: _segments.segment_uniform(
      _segments.leaf_site_keys(k, "qsgd", paths), lay), key.site))
  add("noise, one call per leaf", *_time(lambda k: [jax.random.uniform(
      jax.random.fold_in(k, i), (x.size,)) for i, x in enumerate(leaves)], key.site))
  n = lay.size
  codes = jnp.asarray(np.random.default_rng(0).integers(0, 16, n), jnp.uint32)
  for bits in (6, 4):
    add(f"pack + unpack of all {n:,} entries, {bits} bits",
        *_time(lambda c, b=bits: unpack_bits(pack_bits(c, b), b, n), codes))
  big = max(leaves, key=lambda x: x.size).reshape(-1)
  k = max(1, round(0.01 * big.size))
  exact = jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k)[1])
  approx = jax.jit(lambda x: jax.lax.approx_max_k(jnp.abs(x), k, recall_target=0.95)[1])
  recall = len(np.intersect1d(np.asarray(exact(big)), np.asarray(approx(big)))) / k
  add(f"top-k of the largest leaf ({big.size:,} entries, k={k:,}), exact", *_time(exact, big))
  add("the same, approx_max_k", *_time(approx, big), f"recall {recall:.3f}")
  plan = _powersgd._make_plan([x.shape for x in leaves], 4, 1.0)  # pylint: disable=protected-access
  ps = [jax.random.normal(jax.random.key(g.m), (len(g.leaves), g.m, g.r)) for g in plan.groups]
  add(f"PowerSGD orthogonalization, per shape group ({len(ps)} groups)",
      *_time(lambda ps: [orthogonalize(p) for p in ps], ps))
  add("the same, one padded batch", *_time(_powersgd._orthogonalize_all, ps))  # pylint: disable=protected-access
  return [f"#### Kernel ablations, {LABELS[model_name]} (one site, fp32 step {base_ms:.0f} ms)", "",
          "| kernel | compile (s) | run (ms) | run / fp32 step | |", "|---|---:|---:|---:|---|",
          *rows, ""]


def torch_available() -> bool:
  try:
    import torch  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
    import torch.distributed  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    return False
  return True


def _torch_worker(rank, sites, hidden, batch, pairs, port, out_path):
  """One DDP rank: the plain step and the PowerSGD-hook step, alternately; rank 0 writes ms."""
  import torch  # pylint: disable=g-import-not-at-top
  import torch.distributed as dist  # pylint: disable=g-import-not-at-top
  from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd  # pylint: disable=g-import-not-at-top
  from torch.nn.parallel import DistributedDataParallel as DDP  # pylint: disable=g-import-not-at-top

  torch.set_num_threads(1)  # one core per rank, as the XLA host devices share the cores
  dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                          world_size=sites)
  torch.manual_seed(0)

  def mlp():
    layers, width = [], 784
    for h in hidden:
      layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
      width = h
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))

  # a process group per model: the two models' collectives never meet on one group
  groups = (dist.new_group(list(range(sites))), dist.new_group(list(range(sites))))
  # one bucket each (the MLP is 7.5 MB), so no bucket rebuild after the first step
  plain, hooked = (DDP(mlp(), process_group=g, bucket_cap_mb=64) for g in groups)
  # rank 4, error feedback, warm start (the hook's defaults), compressing from step 3
  state = psgd.PowerSGDState(process_group=groups[1], matrix_approximation_rank=4,
                             start_powerSGD_iter=3, min_compression_rate=1.0,
                             use_error_feedback=True, warm_start=True)
  hooked.register_comm_hook(state, psgd.powerSGD_hook)
  opts = {id(m): torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (plain, hooked)}
  gen = torch.Generator().manual_seed(rank)
  x = torch.randn(batch, 784, generator=gen)
  y = torch.randint(0, 10, (batch,), generator=gen)

  def step(model):
    t0 = time.perf_counter()
    opt = opts[id(model)]
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0

  for _ in range(5):  # warm-up; the hook compresses from its step 3 on
    step(plain), step(hooked)
  times = {"plain": [], "powersgd": []}
  for _ in range(pairs):
    dist.barrier()
    times["plain"].append(step(plain))
    dist.barrier()
    times["powersgd"].append(step(hooked))
  if rank == 0:
    with open(out_path, "w") as f:
      f.write(repr(times))
  dist.destroy_process_group()


def _free_port() -> int:
  import socket  # pylint: disable=g-import-not-at-top
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


# One XLA:CPU thread per process: the layout of the torch rows (``torch.set_num_threads(1)``).
ONE_THREAD_FLAGS = ("--xla_force_host_platform_device_count=1 --xla_cpu_multi_thread_eigen=false "
                    "intra_op_parallelism_threads=1")


def _jax_worker(rank, args, port, out_path):
  """One process of the ``--processes`` rows: one CPU device, one thread, gloo collectives.

  Compiles every method's MLP step over the ``--sites`` processes' devices and runs them in
  turn ``--pairs`` times (fp32, method 1, method 2, ..., fp32, ...); rank 0 writes the seconds.
  """
  os.environ["JAX_PLATFORMS"] = "cpu"
  os.environ["XLA_FLAGS"] = ONE_THREAD_FLAGS
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
  import dadjax  # pylint: disable=g-import-not-at-top
  from dadjax.compress import _base  # pylint: disable=g-import-not-at-top

  _base.GROUP_SAME_SHAPES = not args.per_leaf
  dadjax.initialize(f"127.0.0.1:{port}", num_processes=args.sites, process_id=rank)
  jobs = {spec: Job(args, "mlp", spec) for spec in args.methods}
  times = {spec: [] for spec in jobs}
  for _ in range(args.pairs):
    for spec, job in jobs.items():
      times[spec].append(job.step())
  if rank == 0:
    with open(out_path, "w") as f:
      f.write(repr(times))
  jax.distributed.shutdown()


def process_rows(args) -> list[str]:
  """dadjax's MLP rows in the torch rows' layout: ``--sites`` processes, one device and thread each.

  The shard_map rows run every simulated site in one process, so a step pays all sites'
  kernels one after the other; here each site is its own process (``dadjax.initialize``, gloo
  over 127.0.0.1), as each DDP rank is, and the step time is rank 0's.
  """
  import ast  # pylint: disable=g-import-not-at-top
  import multiprocessing  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top

  port = _free_port()
  ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: XLA_FLAGS before jax
  with tempfile.TemporaryDirectory() as tmpdir:
    out_path = os.path.join(tmpdir, "times")
    procs = [ctx.Process(target=_jax_worker, args=(rank, args, port, out_path))
             for rank in range(args.sites)]
    for proc in procs:
      proc.start()
    for proc in procs:
      proc.join()
    if any(proc.exitcode for proc in procs):
      raise SystemExit(f"--processes: a worker failed (exit codes {[p.exitcode for p in procs]})")
    with open(out_path) as f:
      times = ast.literal_eval(f.read())
  base = 1e3 * statistics.median(times["allreduce"])
  batch = args.batch or (4 if args.quick else MODELS["mlp"][4])
  out = [f"#### dadjax on the MLP in the same layout ({args.sites} processes, 1 device and 1 "
         f"thread each, gloo, batch {batch} per site, {args.pairs} interleaved rounds)", "",
         "| method | step (ms) | vs fp32 all-reduce: median [q1, q3] | added (ms) |",
         "|---|---:|---|---:|"]
  for spec, ts in times.items():
    q1, med, q3 = quartiles([t / b for b, t in zip(times["allreduce"], ts)])
    ms = 1e3 * statistics.median(ts)
    out.append(f"| `{spec}` | {ms:.0f} | {med:.2f} [{q1:.2f}, {q3:.2f}] | {ms - base:.0f} |")
    print(f"dadjax {args.sites} processes: {spec} {ms:.0f} ms (x{med:.2f})", flush=True)
  return out + [""]


def torch_rows(args) -> list[str]:
  """PyTorch DDP (gloo, ``--sites`` processes) on the MLP: the plain step and the PowerSGD hook.

  The same model, batch per rank and optimizer (SGD with momentum 0.9) as the MLP rows; the
  two steps run alternately ``--pairs`` times after 5 warm-up steps, each rank on one thread.
  """
  import ast  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import torch  # pylint: disable=g-import-not-at-top
  import torch.multiprocessing as tmp  # pylint: disable=g-import-not-at-top

  batch = args.batch or (4 if args.quick else MODELS["mlp"][4])
  hidden = tuple(MODELS["mlp"][2 if args.quick else 1]["hidden"])
  port = _free_port()
  with tempfile.TemporaryDirectory() as tmpdir:
    out_path = os.path.join(tmpdir, "times")
    tmp.spawn(_torch_worker, args=(args.sites, hidden, batch, args.pairs, port, out_path),
              nprocs=args.sites, join=True)
    with open(out_path) as f:
      times = ast.literal_eval(f.read())
  ratios = [h / p for p, h in zip(times["plain"], times["powersgd"])]
  q1, med, q3 = quartiles(ratios)
  plain, hooked = (1e3 * statistics.median(times[k]) for k in ("plain", "powersgd"))
  print(f"torch DDP: plain {plain:.0f} ms, PowerSGD hook {hooked:.0f} ms (x{med:.2f})", flush=True)
  return [f"#### PyTorch DDP on the same MLP {hidden} (torch {torch.__version__}, gloo, {args.sites} "
          f"processes, 1 thread each, batch {batch} per rank, {args.pairs} interleaved pairs)", "",
          "| step | step (ms) | vs plain: median [q1, q3] | added (ms) |", "|---|---:|---|---:|",
          f"| DDP plain | {plain:.0f} | 1.00 | 0 |",
          f"| DDP + PowerSGD hook (rank 4, error feedback, warm start) | {hooked:.0f} | "
          f"{med:.2f} [{q1:.2f}, {q3:.2f}] | {hooked - plain:.0f} |", ""]


def main(argv=None):
  args = parse_args(argv)
  if args.device == "cpu":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.sites}")
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from harness import uptime  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top  (after XLA_FLAGS)
  from dadjax.compress import _base  # pylint: disable=g-import-not-at-top

  _base.GROUP_SAME_SHAPES = not args.per_leaf
  command = "python " + " ".join(["experiments/bench_scale.py"] + list(
      sys.argv[1:] if argv is None else argv))
  dev = jax.devices()[0]
  load_before = uptime()
  t0 = time.perf_counter()
  out = []
  for model_name in args.models:
    rows = bench_model(args, model_name)
    out += table(model_name, rows)
    if args.ablate:
      out += ablations(args, model_name, next(r["ms"] for r in rows if r["method"] == "allreduce"))
    if model_name == "mlp" and args.device == "cpu" and args.processes:
      out += process_rows(args)
    if model_name == "mlp" and args.device == "cpu" and args.torch != "off":
      if torch_available():
        out += torch_rows(args)
      elif args.torch == "on":
        raise SystemExit("--torch on: torch is not importable")
      else:
        out += ["(PyTorch DDP rows skipped: torch is not importable.)", ""]
  head = [f"Command: `{command}`", "",
          f"Devices: {len(jax.devices())} x {dev.platform} ({dev.device_kind}); jax "
          f"{jax.__version__}; {args.sites} sites ({'vmap' if args.device == 'gpu' else 'shard_map'}"
          f"); {args.pairs} interleaved pairs per method; {'quick sizes' if args.quick else 'full sizes'}"
          f"; {time.perf_counter() - t0:.0f} s wall.", "",
          f"Load before: `{load_before}`", "", f"Load after: `{uptime()}`", ""]
  text = "\n".join(head + out)
  print(text)
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    f.write(text + "\n")
  return text


if __name__ == "__main__":
  main()
