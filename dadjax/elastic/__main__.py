"""``python -m dadjax.elastic`` (or ``dadjax lighthouse``): a lighthouse on its own, until interrupted."""

import argparse
import sys

from dadjax.elastic import add_lighthouse_arguments, serve_lighthouse


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m dadjax.elastic",
                              description="the quorum service of an elastic run")
  add_lighthouse_arguments(p)
  return serve_lighthouse(p.parse_args(argv))


if __name__ == "__main__":
  sys.exit(main())
