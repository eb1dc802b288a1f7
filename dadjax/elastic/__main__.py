"""``python -m dadjax.elastic``: a lighthouse on its own, until interrupted."""

import argparse
import signal
import sys
import threading

from dadjax.elastic import Lighthouse


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m dadjax.elastic",
                              description="the quorum service of an elastic DiLoCo run")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=0, help="0: a free port (printed)")
  p.add_argument("--expected-sites", type=int, default=1)
  p.add_argument("--quorum-timeout-s", type=float, default=10.0)
  p.add_argument("--start-timeout-s", type=float, default=120.0)
  p.add_argument("--join-timeout-s", type=float, default=300.0)
  args = p.parse_args(argv)
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


if __name__ == "__main__":
  sys.exit(main())
