"""The errors dadjax raises for a user's mistake or a damaged run.

Every one of them is a ``ValueError`` (the project's rule for bad input), so
``except ValueError`` keeps working; the ``dadjax`` command catches
:class:`DadjaxError` and prints one line, ``dadjax: error: ...``, with exit
code 2 (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

__all__ = ["DadjaxError", "ConfigError", "CheckpointError", "DataError", "DivergenceError",
           "Stopped"]


class DadjaxError(ValueError):
  """Base class: a problem the user can fix, described in one message."""


class ConfigError(DadjaxError):
  """A config file, override or config value that cannot be used, or a
  dataset, model or method the config names that cannot be built."""


class CheckpointError(DadjaxError):
  """A checkpoint directory that cannot be used for this run: it belongs to
  another configuration, it is in use by another process, it is further
  along than ``steps``, or none of its checkpoints is intact."""


class DivergenceError(DadjaxError, FloatingPointError):
  """Training produced a non-finite loss, parameter or optimizer state.

  Raised before anything non-finite is logged or checkpointed; the message
  says which checkpoint (if any) is kept. Also a ``FloatingPointError``.
  """


class DataError(DadjaxError):
  """A data set that cannot be trained on: non-finite features, labels
  outside ``[0, num_classes)`` or not integers, an empty split, or inputs
  and labels of different lengths. Raised before the first step; the message
  names the split, the number of bad rows and the first one."""


class Stopped(DadjaxError):
  """The run stopped on a signal (SIGTERM, SIGINT) after finishing a step.

  Attributes:
    signal_name: ``"SIGTERM"`` or ``"SIGINT"``.
    step: the step the run stopped at.
    checkpoint_step: the step of the newest checkpoint (``step`` itself when
      it was saved on the signal), or ``None``.
    exit_code: ``128 + signal`` (143 for SIGTERM, 130 for SIGINT), what the
      ``dadjax`` command exits with.
  """

  def __init__(self, message: str, *, signal_name: str, step: int,
               checkpoint_step: int | None, exit_code: int):
    super().__init__(message)
    self.signal_name = signal_name
    self.step = step
    self.checkpoint_step = checkpoint_step
    self.exit_code = exit_code
