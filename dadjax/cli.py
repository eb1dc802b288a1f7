"""A stable import path for the command line (``python -m dadjax.cli``): :mod:`dadjax.run`."""

import sys

from dadjax.run import describe_methods, main

__all__ = ["main", "describe_methods"]

if __name__ == "__main__":
  sys.exit(main())
