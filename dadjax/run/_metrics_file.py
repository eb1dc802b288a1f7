"""Writes a run cannot lose silently: ``metrics.jsonl`` rows as strict JSON.

Each row is appended with one ``write`` to a file the run opened itself.
Before each write the run checks that ``out_dir`` and ``metrics.jsonl`` are
still the directory and file it opened (not deleted, moved or replaced by
something else); a failed write (no space left, an I/O error) is cut off
again, so the file never ends in half a row, and the run stops with one
message. Non-finite values (a test loss of NaN) are written as ``null``
and their keys listed under ``"nonfinite"``, so every line is strict JSON.
"""

from __future__ import annotations

import errno
import json
import math
import os
import pathlib
from typing import Callable

from dadjax.errors import DadjaxError


def json_row(row: dict) -> str:
  """``row`` as one line of strict JSON.

  Floats that are NaN or infinite become ``null``, and their keys are listed
  (in row order) under ``"nonfinite"``; JSON has no literal for them.
  """
  out, nonfinite = {}, []
  for key, value in row.items():
    if isinstance(value, float) and not math.isfinite(value):
      out[key] = None
      nonfinite.append(key)
    else:
      out[key] = value
  if nonfinite:
    out["nonfinite"] = nonfinite
  return json.dumps(out, allow_nan=False, default=_default)


def _default(value):
  if hasattr(value, "item"):  # numpy scalars
    value = value.item()
    return None if isinstance(value, float) and not math.isfinite(value) else value
  raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _id(st: os.stat_result) -> tuple[int, int]:
  return st.st_dev, st.st_ino


class MetricsFile:
  """``out_dir/metrics.jsonl``, opened for appending and guarded.

  Args:
    out_dir: the run's ``out_dir`` (must exist).
    kept: called for the message of a failed write: the newest intact
      checkpoint step, or ``None``.
  """

  def __init__(self, out_dir: str | os.PathLike, kept: Callable[[], int | None] = lambda: None):
    self.out_dir = pathlib.Path(out_dir)
    self.path = self.out_dir / "metrics.jsonl"
    self._kept = kept
    self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    self._dir_id = _id(os.stat(self.out_dir))
    self._file_id = _id(os.fstat(self._fd))

  def _kept_text(self) -> str:
    kept = self._kept()
    return (f"the last checkpoint, step {kept}, is intact" if kept is not None
            else "no checkpoint was written")

  def check(self) -> None:
    """Raise DadjaxError if ``out_dir`` or ``metrics.jsonl`` is no longer what was opened."""
    try:
      same_dir = _id(os.stat(self.out_dir)) == self._dir_id
    except OSError:
      same_dir = False
    if not same_dir:
      raise DadjaxError(f"out_dir {str(self.out_dir)!r} was deleted or replaced while the run "
                        f"wrote to it; its metrics rows would be lost; {self._kept_text()}")
    try:
      same_file = _id(os.lstat(self.path)) == self._file_id
    except OSError:
      same_file = False
    if not same_file:
      raise DadjaxError(f"{str(self.path)!r} was deleted or replaced while the run wrote to "
                        f"it; its rows would be lost; {self._kept_text()}")

  def write(self, row: dict) -> None:
    """Append ``row`` as one strict-JSON line (all of it, or nothing).

    Raises:
      DadjaxError: the directory or file vanished or was replaced, or the
        write failed (``no space left on device writing ...``); a partly
        written line is removed first.
    """
    self.check()
    data = (json_row(row) + "\n").encode()
    start = os.fstat(self._fd).st_size
    try:
      view = memoryview(data)
      while view:
        view = view[os.write(self._fd, view):]
    except OSError as e:
      try:
        os.ftruncate(self._fd, start)
      except OSError:
        pass
      if e.errno == errno.ENOSPC:
        what = f"no space left on device writing {self.path} ({e.strerror})"
      else:
        what = f"cannot write {self.path} ({e.strerror or e})"
      raise DadjaxError(f"{what}; {self._kept_text()}") from None

  def close(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None
