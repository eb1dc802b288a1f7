"""Sharded against replicated parameters within a site, measured side by side.

For each method and 2-D mesh, the same training run twice on 8 simulated
CPU devices: ``shard_params=False`` (every device of a site holds the
site's whole parameters and optimizer state) and ``shard_params=True``
(FSDP-style slices). Printed per layout, all measured from the run:

* ``state_bytes/device``: bytes of parameters + optimizer state held by
  one device (its addressable shard of every leaf);
* ``inter bits/device``: the ledger's bits per step a device sends over the
  site axis (the site sends ``per_site`` times this, one per device link);
* ``intra bits/device``: the ledger's in-site payload per step;
* ``intra ring wire``: what a device sends inside the site on a ring
  (all-reduce 2(n-1)/n B, all-gather (n-1) B, n = per_site);
* ``max |param diff|``: largest difference between the layouts' parameters
  after the run (the layouts compute the same update).

Run:

    python experiments/fsdp.py --steps 5 --out experiments/results
"""

from __future__ import annotations

import argparse
import os
import pathlib

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")  # 8 simulated CPU devices
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import dadjax  # noqa: E402
from dadjax.comm import comm_stats, wire_bits  # noqa: E402
from dadjax.methods import build_method  # noqa: E402
from dadjax.models import MLP  # noqa: E402

METHODS = ("allreduce", "bf16", "ef(sign)", "ef_scaled_sign", "terngrad", "dad")


def _device_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def _run(spec, sites, per_site, shard, hidden, steps, rows):
  method = build_method(spec)
  model = MLP(hidden=hidden, num_classes=10, **({"dense": method.dense} if method.dense else {}))
  step = dadjax.make_train_step(model, optax.chain(method.tx, optax.adam(1e-3)),
                                mesh=dadjax.make_mesh(sites=sites, per_site=per_site),
                                shard_params=shard)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(rows, 64)).astype(np.float32),
              "y": rng.integers(0, 10, rows).astype(np.int32)} for _ in range(steps)]
  state = step.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches:
    state, _ = step(state, batch)
  return step, state


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=5)
  parser.add_argument("--hidden", default="256,256", help="hidden widths")
  parser.add_argument("--rows", type=int, default=64, help="global batch rows")
  parser.add_argument("--out", default=None, help="directory for fsdp.md")
  args = parser.parse_args()
  hidden = tuple(int(w) for w in args.hidden.split(","))
  header = ("| method | mesh | layout | state bytes/device | inter bits/device | "
            "intra bits/device | intra ring wire/device | max abs param diff |")
  lines = [f"MLP 64-{'-'.join(map(str, hidden))}-10, Adam, {args.steps} steps, "
           f"{args.rows} rows per step; `python experiments/fsdp.py --steps {args.steps} "
           f"--hidden {args.hidden}`", "", header, "|" + "---|" * 8]
  for spec in METHODS:
    for sites, per_site in ((2, 4), (4, 2)):
      runs = {shard: _run(spec, sites, per_site, shard, hidden, args.steps, args.rows)
              for shard in (False, True)}
      ref_step, ref_state = runs[False]
      for shard, (step, state) in runs.items():
        summary = comm_stats(state)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(
            jax.tree.leaves(step.params(state)), jax.tree.leaves(ref_step.params(ref_state))))
        intra_wire = (wire_bits("reduce", max(summary.intra_reduce_bits), per_site)
                      + wire_bits("gather", max(summary.intra_gather_bits), per_site))
        lines.append(
            f"| {spec} | {sites}x{per_site} | {'sharded' if shard else 'replicated'} | "
            f"{_device_bytes((state.params, state.opt_state)):,} | {summary.bits_per_step:,} | "
            f"{summary.intra_bits_per_step:,} | {int(intra_wire):,} | {diff:.1e} |")
        print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  if args.out:
    path = pathlib.Path(args.out) / "fsdp.md"
    path.write_text(text)
    print("wrote", path)


if __name__ == "__main__":
  main()
