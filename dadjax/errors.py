"""The errors dadjax raises for a user's mistake or a damaged run.

Every one of them is a ``ValueError`` (the project's rule for bad input), so
``except ValueError`` keeps working; the ``dadjax`` command catches
:class:`DadjaxError` and prints one line, ``dadjax: error: ...``, with exit
code 2 (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

__all__ = ["DadjaxError", "ConfigError", "CheckpointError", "DivergenceError"]


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
