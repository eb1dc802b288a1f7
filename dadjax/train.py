"""A stable import path: :func:`train` and :func:`build` of the run layer (:mod:`dadjax.run`)."""

from dadjax.run import (Run, build, compiled_ops, evaluate, local_optimizer, make_optimizer,
                              make_schedule, state_rows, train)

__all__ = ["train", "build", "evaluate", "Run", "state_rows", "compiled_ops", "make_optimizer",
           "local_optimizer", "make_schedule"]
