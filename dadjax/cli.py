"""The ``dadjax`` command: ``dadjax train`` and ``dadjax demo``."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _simulate_devices(n: int) -> None:
  # XLA reads this when the backend starts (first device use), so setting it
  # here, before any computation, gives n CPU devices to shard_map over.
  flag = f"--xla_force_host_platform_device_count={n}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="dadjax", description=__doc__)
  sub = parser.add_subparsers(dest="command", required=True)
  p_train = sub.add_parser("train", help="train from a config file and key=value overrides")
  p_train.add_argument("--config", help="TOML or JSON config file")
  p_train.add_argument("overrides", nargs="*", help="key=value, e.g. method=topk:0.01 steps=500")
  p_train.add_argument("--no-progress", action="store_true")
  p_demo = sub.add_parser("demo", help="every method on the embedded digits over 8 sites")
  p_demo.add_argument("--steps", type=int, default=300)
  p_demo.add_argument("--methods", help="comma-separated method specs (default: all)")
  p_demo.add_argument("--out", default="demo_out")
  p_demo.add_argument("--no-progress", action="store_true")
  sub.add_parser("methods", help="every method spec with its arguments, defaults and docs")
  args = parser.parse_args(argv)
  if args.command == "methods":
    from dadjax.registry import describe  # pylint: disable=g-import-not-at-top
    print(describe())
    return 0

  _simulate_devices(8)
  from dadjax.config import load_config  # pylint: disable=g-import-not-at-top

  if args.command == "train":
    from dadjax.train import train  # pylint: disable=g-import-not-at-top
    try:
      config = load_config(args.config, args.overrides)
    except ValueError as e:
      parser.error(str(e))
    run = train(config, progress=not args.no_progress,
                log=lambda row: print(json.dumps(row), flush=True))
    print(json.dumps(run.final))
    return 0
  from dadjax.demo import DEFAULT_METHODS, run_demo  # pylint: disable=g-import-not-at-top
  from dadjax.registry import split_specs  # pylint: disable=g-import-not-at-top
  methods = split_specs(args.methods) if args.methods else tuple(DEFAULT_METHODS)
  run_demo(methods, steps=args.steps, out_dir=args.out, progress=not args.no_progress)
  return 0


if __name__ == "__main__":
  sys.exit(main())
