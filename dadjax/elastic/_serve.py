"""The lighthouse as a command: its flags and a loop that serves until SIGINT / SIGTERM."""

import argparse
import signal
import sys
import threading

from dadjax.elastic._lighthouse import Lighthouse


def add_lighthouse_arguments(p: argparse.ArgumentParser) -> None:
  """Add the lighthouse's flags to ``p`` (``python -m dadjax.elastic``, ``dadjax lighthouse``)."""
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
  p.add_argument("--expected-sites", type=int, default=1,
                 help="sites the first round waits for (up to --start-timeout-s)")
  p.add_argument("--quorum-timeout-s", type=float, default=10.0,
                 help="a round waits this long for a missing site, then drops it")
  p.add_argument("--start-timeout-s", type=float, default=120.0)
  p.add_argument("--join-timeout-s", type=float, default=300.0)


def serve_lighthouse(args: argparse.Namespace) -> int:
  """Run a lighthouse with ``args``' settings until SIGINT / SIGTERM; the exit code."""
  try:
    lighthouse = Lighthouse(args.host, args.port, expected_sites=args.expected_sites,
                            quorum_timeout_s=args.quorum_timeout_s,
                            start_timeout_s=args.start_timeout_s,
                            join_timeout_s=args.join_timeout_s)
  except (ValueError, OSError) as e:
    print(f"dadjax: error: {e}", file=sys.stderr)
    return 2
  done = threading.Event()
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, lambda *_: done.set())
  with lighthouse:
    print(f"dadjax: elastic: lighthouse at {lighthouse.address}", flush=True)
    done.wait()
  return 0
