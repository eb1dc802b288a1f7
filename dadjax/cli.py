"""The ``dadjax`` command: ``dadjax train``, ``demo``, ``methods``, ``plot`` and ``netlab``.

A mistake in the command line, the config or the checkpoint directory is
reported as one line, ``dadjax: error: ...``, with exit code 2; ``--debug``
shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from dadjax.errors import DadjaxError, Stopped

DEFAULT_DEVICES = 8


def _simulate_devices(n: int) -> None:
  # XLA reads this when the backend starts (first device use), so setting it
  # here, before any computation, gives n CPU devices to shard_map over.
  flag = f"--xla_force_host_platform_device_count={n}"
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _debug_flag(parser: argparse.ArgumentParser) -> None:
  """``--debug`` after the subcommand too (SUPPRESS keeps one given before it)."""
  parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                      help="show the Python traceback of an error instead of one line")


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="dadjax", description=__doc__.splitlines()[0])
  parser.add_argument("--debug", action="store_true",
                      help="show the Python traceback of an error instead of one line")
  sub = parser.add_subparsers(dest="command", required=True)
  p_train = sub.add_parser("train", help="train from a config file and key=value overrides")
  p_train.add_argument("--config", help="TOML or JSON config file")
  p_train.add_argument("overrides", nargs="*", help="key=value, e.g. method=topk:0.01 steps=500")
  p_train.add_argument("--no-progress", action="store_true")
  p_train.add_argument("--restart", action="store_true",
                       help="delete the checkpoints in checkpoint_dir and start from step 0")
  p_train.set_defaults(handler=_train)
  _debug_flag(p_train)
  p_demo = sub.add_parser("demo", help="every method on the embedded digits over 8 sites")
  p_demo.add_argument("--steps", type=int, default=300)
  p_demo.add_argument("--methods", help="comma-separated method specs (default: all)")
  p_demo.add_argument("--out", default="demo_out")
  p_demo.add_argument("--no-progress", action="store_true")
  p_demo.set_defaults(handler=_demo)
  _debug_flag(p_demo)
  p_plot = sub.add_parser("plot", help="heat map of a run's Accordion decisions with its learning "
                          "rate, from RUN_DIR/metrics.jsonl")
  p_plot.add_argument("run_dir", help="a run's out_dir (holds metrics.jsonl)")
  p_plot.add_argument("--out", help="image to write (default: RUN_DIR/decisions.png)")
  p_plot.set_defaults(handler=_plot)
  _debug_flag(p_plot)
  p_methods = sub.add_parser("methods", help="every method spec with its arguments, defaults and docs")
  p_methods.set_defaults(handler=_methods)
  _debug_flag(p_methods)
  from dadjax.netlab._cli import add_parser as add_netlab  # pylint: disable=g-import-not-at-top
  add_netlab(sub, _debug_flag)
  return parser


def _methods(args: argparse.Namespace) -> int:
  del args
  from dadjax.registry import describe  # pylint: disable=g-import-not-at-top
  print(describe())
  return 0


def _plot(args: argparse.Namespace) -> int:
  import pathlib  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(args.run_dir) / "metrics.jsonl"
  try:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  except OSError as e:
    raise DadjaxError(f"cannot read {str(path)!r}: {e.strerror or e}; RUN_DIR must be a run's "
                      "out_dir") from None
  except json.JSONDecodeError as e:
    raise DadjaxError(f"{str(path)!r} is not JSON lines: {e}") from None
  from dadjax.adaptive import plot_decisions  # pylint: disable=g-import-not-at-top
  out = args.out or str(pathlib.Path(args.run_dir) / "decisions.png")
  try:
    plot_decisions(rows, out, title=rows[-1].get("method", "Accordion") if rows else "Accordion")
  except ValueError as e:
    raise DadjaxError(f"{str(path)!r}: {e} (train with an accordion(...) method)") from None
  print(f"wrote {out}")
  return 0


def _train(args: argparse.Namespace) -> int:
  from dadjax.config import load_config  # pylint: disable=g-import-not-at-top
  config = load_config(args.config, args.overrides)
  # Read the config first: shard_map over num_sites sites needs that many devices.
  _simulate_devices(max(DEFAULT_DEVICES, config.num_sites * config.per_site))
  from dadjax._io import json_row  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  run = train(config, progress=not args.no_progress, restart=args.restart,
              log=lambda row: print(json_row(row), flush=True))
  if run.history:
    print(json_row(run.final))
  return 0


def _demo(args: argparse.Namespace) -> int:
  _simulate_devices(DEFAULT_DEVICES)
  from dadjax.demo import DEFAULT_METHODS, run_demo  # pylint: disable=g-import-not-at-top
  from dadjax.registry import split_specs  # pylint: disable=g-import-not-at-top
  methods = split_specs(args.methods) if args.methods else tuple(DEFAULT_METHODS)
  run_demo(methods, steps=args.steps, out_dir=args.out, progress=not args.no_progress)
  return 0


def _run(args: argparse.Namespace) -> int:
  """Run a parsed command; the library's own errors become one line and exit code 2.

  A run stopped by SIGTERM / SIGINT (its step saved) prints ``dadjax: stopped
  by SIGTERM at step N; ...`` and exits with ``128 + signal`` (143 / 130).
  """
  try:
    return args.handler(args)
  except Stopped as e:  # a signal: the step was saved (see dadjax/_signals.py)
    print(f"dadjax: {e}", file=sys.stderr, flush=True)
    return e.exit_code
  except DadjaxError as e:
    if args.debug:
      traceback.print_exc()
    print(f"dadjax: error: {e}", file=sys.stderr, flush=True)
    return 2


def main(argv=None) -> int:
  return _run(_parser().parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
