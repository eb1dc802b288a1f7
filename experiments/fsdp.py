"""Sites of several devices: in-site layouts of one model, measured side by side.

The GPT decoder ``gpt_tiny`` (scanned blocks, logical axis names) trained on
2 sites of 4 simulated CPU devices, each in-site layout against the same
sites with one device each (replicated parameters). Printed per method and
layout, all measured from the run:

* ``params+opt bytes/device``: bytes of parameters and Adam's state one
  device holds (its addressable shards);
* ``vs replicated``: that against the 1-device-per-site run;
* ``site-axis bits/step``: what the ledger booked for a site over the site
  axis (the same for every layout: the methods see the site's whole tensors);
* ``in-site bits/device/step``: operand bits of the collectives GSPMD put
  inside the site, read from the compiled program, by the axes they span;
* ``max |param diff|``: largest difference from the replicated run's
  parameters after the run (float order only).

Run:

    python experiments/fsdp.py --steps 3 --out experiments/results

Not :func:`dadjax.run.train`: it builds each layout's step directly
(:func:`dadjax.make_train_step` with the layout's mesh, rules and
``shard_params``) on synthetic tokens, to read the shards one device holds
and the in-site traffic by mesh axis; the site-axis bits are
:func:`dadjax.comm.report`'s.
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
from dadjax import models  # noqa: E402
from dadjax.comm import NetworkModel, report  # noqa: E402
from dadjax.methods import build_method  # noqa: E402

METHODS = ("allreduce", "ef(topk:0.01)", "powersgd:2", "dad")
LAYOUTS = {  # name -> (in-site axes, rules, FSDP of what the rules leave whole)
    "replicated (1 device/site)": (None, None, False),
    "FSDP 4": ({"fsdp": 4}, "fsdp", False),
    "TP 4": ({"model": 4}, "tp", False),
    "FSDP 2 x TP 2": ({"fsdp": 2, "model": 2}, "fsdp_tp", False),
    "ZeRO-3 4 (shard_params)": ({"fsdp": 4}, "replicated", True),
}


def _device_bytes(tree) -> int:
  device = jax.devices()[0]
  return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
             if s.device == device)


def _run(spec, inner, rules, shard, steps, rows):
  method = build_method(spec)
  dense = {"dense": method.dense} if method.dense else {}
  model = models.get_model("gpt_tiny", 256, **dense)
  placement = (dict(mesh=dadjax.make_mesh(2)) if inner is None else
               dict(mesh=dadjax.make_mesh(sites=2, inner=inner), shard_params=shard,
                    rules=models.gpt_rules(rules)))
  step = dadjax.make_train_step(model, method.optimizer(optax.adam(1e-3)),
                                collections=dict(method.collections), **placement)
  rng = np.random.default_rng(0)
  batches = [{"x": (x := rng.integers(0, 256, (rows, 32)).astype(np.int32)), "y": x}
             for _ in range(steps)]
  state = step.init(jax.random.key(0), batches[0]["x"][:2])
  for batch in batches:
    state, _ = step(state, batch)
  by_axis = {} if inner is None else step.traffic_by_axis(state, batches[0])
  return step, state, by_axis


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=3)
  parser.add_argument("--rows", type=int, default=16, help="global batch rows (8 per site)")
  parser.add_argument("--methods", default=",".join(METHODS))
  parser.add_argument("--out", default=None, help="write fsdp.md into this directory")
  args = parser.parse_args(argv)
  lines = ["| method | layout | params+opt bytes/device | vs replicated | site-axis bits/step | "
           "in-site bits/device/step | max abs param diff |", "|---" * 7 + "|"]
  for spec in args.methods.split(","):
    ref = None
    for name, (inner, rules, shard) in LAYOUTS.items():
      step, state, by_axis = _run(spec, inner, rules, shard, args.steps, args.rows)
      held = _device_bytes((state.params, state.opt_state))
      params = step.params(state)
      if ref is None:
        ref = (held, params)
      diff = max(float(np.max(np.abs(a - b))) for a, b in
                 zip(jax.tree.leaves(params), jax.tree.leaves(ref[1])))
      intra = ", ".join(f"{k}: {v:,}" for k, v in sorted(by_axis.items()) if k != "data") or "-"
      lines.append(f"| {spec} | {name} | {held:,} | {ref[0] / held:.2f}x less | "
                   f"{report(state, NetworkModel(num_sites=2)).payload_bits_per_step:,} | "
                   f"{intra} | {diff:.1e} |")
      print(lines[-1], flush=True)
  text = "\n".join(lines) + "\n"
  if args.out:
    out = pathlib.Path(args.out) / "fsdp.md"
    out.write_text(f"# In-site layouts (`python experiments/fsdp.py --steps {args.steps}`)\n\n"
                   f"gpt_tiny, Adam, 2 sites x 4 CPU devices, {args.rows} rows per step.\n\n"
                   + text)
    print(f"wrote {out}")


if __name__ == "__main__":
  main()
