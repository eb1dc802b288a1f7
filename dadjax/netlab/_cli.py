"""``dadjax netlab --sites N --rate R --delay D train [--config F] key=value ...``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys


def add_parser(sub, debug_flag) -> None:
  """Add the ``netlab`` subcommand to the ``dadjax`` command's subparsers ``sub``."""
  p = sub.add_parser("netlab", help="train with one process per site behind real, shaped links "
                     "(network namespaces; needs root and iproute2)")
  p.add_argument("--sites", type=int, default=4, help="sites (processes, namespaces); default 4")
  p.add_argument("--rate", default=None, help="each site's link rate, e.g. 100mbit (default: "
                 "unshaped)")
  p.add_argument("--delay", default="0", help="added one-way delay, e.g. 10ms (default 0)")
  p.add_argument("--jitter", default="0", help="uniform +- jitter on the delay, e.g. 1ms")
  p.add_argument("--loss", type=float, default=0.0, help="frame loss probability in the switch")
  p.add_argument("--compute-steps", type=int, default=5,
                 help="steps of the compute-only replica timed after the run (default 5)")
  p.add_argument("--timeout", type=float, default=3600, help="seconds before the run is killed")
  p.add_argument("--out", help="also write the measurements (JSON) to this file")
  debug_flag(p)
  what = p.add_subparsers(dest="netlab_command", required=True)
  t = what.add_parser("train", help="train a config (as `dadjax train`) in the lab")
  t.add_argument("--config", help="TOML or JSON config file")
  t.add_argument("overrides", nargs="*", help="key=value, e.g. method=topk:0.01 steps=50")
  debug_flag(t)
  p.set_defaults(handler=_netlab)


def _netlab(args: argparse.Namespace) -> int:
  from dadjax.run import load_config  # pylint: disable=g-import-not-at-top
  from dadjax.errors import DadjaxError  # pylint: disable=g-import-not-at-top
  from dadjax.netlab._lab import Lab  # pylint: disable=g-import-not-at-top
  from dadjax.netlab._run import run_in_lab  # pylint: disable=g-import-not-at-top
  config = load_config(args.config, args.overrides).replace(num_sites=args.sites)
  if config.per_site != 1:
    raise DadjaxError("netlab runs one device per site: per_site must be 1")
  fields = dataclasses.asdict(config)
  try:
    lab = Lab(args.sites, args.rate, args.delay, args.jitter, args.loss)
  except ValueError as e:
    raise DadjaxError(str(e)) from None
  # Ctrl-C (even where a launcher ignored it) and SIGTERM unwind through the lab's
  # `finally`, which deletes what it made.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  try:
    with lab:
      print(f"dadjax netlab: {args.sites} sites {', '.join(lab.addresses)}, rate "
            f"{args.rate or 'unshaped'}, delay {lab.delay * 1e3:g} ms", file=sys.stderr,
            flush=True)
      run = run_in_lab(lab, fields, compute_steps=args.compute_steps,
                       eval_every=config.eval_every, timeout=args.timeout)
  except KeyboardInterrupt:
    print(f"dadjax netlab: interrupted; the lab ({lab.tag}...) is torn down", file=sys.stderr,
          flush=True)
    return 130
  for i, t in enumerate(run.step_s):
    print(json.dumps({"step": i + 1, "step_s": t}))
  for row in run.evals:
    print(json.dumps(row))
  summary = run.summary()
  print(json.dumps(summary))
  if args.out:
    with open(args.out, "w") as f:
      json.dump({**summary, "step_times": run.step_s, "compute_times": run.compute_s,
                 "evals": run.evals}, f, indent=1)
  return 0
