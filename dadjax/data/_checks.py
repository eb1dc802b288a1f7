"""Checks of a loaded data set before training: bad data is a data error.

A wrong label (``-1``, ``num_classes``), a NaN pixel or a float label would
otherwise train silently on garbage or end later as a misleading
``DivergenceError``. :func:`check_dataset` looks at the arrays once, on the
host, before the first step, and raises :class:`~dadjax.errors.DataError`
naming the split, how many rows are bad, and the first one.
"""

from __future__ import annotations

import numpy as np

from dadjax.errors import DataError


def _first(bad: np.ndarray) -> int:
  """Row index of the first True in a per-row mask."""
  return int(np.argmax(bad))


def _rows(mask: np.ndarray) -> np.ndarray:
  """A per-element mask reduced to one flag per row (axis 0)."""
  return mask.reshape(len(mask), -1).any(axis=1) if mask.ndim > 1 else mask


def check_form(name: str, split: str, x, y) -> None:
  """Raise DataError unless ``y`` holds integer labels, one row per row of ``x``.

  The checks a loader runs before it converts the arrays (``as_dataset``
  turns labels into int32, so float labels must be refused while they are
  still floats). An empty split passes here (:func:`check_split` refuses it).

  Args:
    name: the data set's name (for the message).
    split: ``"train"`` or ``"test"``.
    x: inputs, shape ``(n, ...)``.
    y: labels, shape ``(n,)``, or next-token targets ``(n, T)``.

  Raises:
    DataError: labels that are not integers (naming the first row that is
      not a whole number, or row 0 when every value is one), labels of another
      rank, or ``len(x) != len(y)``.
  """
  x, y = np.asarray(x), np.asarray(y)
  where = f"data set {name!r}, {split} split"
  if y.ndim not in (1, 2):
    raise DataError(f"{where}: labels must be class ids (rows,) or next-token targets "
                    f"(rows, T), got shape {y.shape}")
  if len(x) != len(y):
    raise DataError(f"{where}: {len(x)} inputs but {len(y)} labels; x and y must have one "
                    "row each per example")
  if len(y) and not np.issubdtype(y.dtype, np.integer):
    if np.issubdtype(y.dtype, np.number) or y.dtype == np.bool_:
      values = y.astype(np.float64)
      bad = _rows(~np.isfinite(values) | (values != np.round(values)))
    else:  # strings, objects: no row is a class id
      bad = np.ones(len(y), bool)
    if bad.any():
      i = _first(bad)
      what = (f"{int(bad.sum())} of {len(y)} rows hold values that are not whole numbers; "
              f"the first is row {i}: {y.reshape(len(y), -1)[i][0].item()!r}")
    else:
      what = (f"every value is a whole number (the first is row 0: "
              f"{y.reshape(len(y), -1)[0][0].item()!r}): store them as integers, e.g. "
              "y.astype(np.int32)")
    raise DataError(f"{where}: labels must be integers (class ids) for a classification loss, "
                    f"got dtype {y.dtype}; {what}")


def check_split(name: str, split: str, x: np.ndarray, y: np.ndarray, num_classes: int,
                vocab_size: int | None = None) -> None:
  """Raise DataError if one split cannot be trained or evaluated on.

  Args:
    name: the data set's name (for the message).
    split: ``"train"`` or ``"test"``.
    x: inputs, shape ``(n, ...)``.
    y: integer class labels, shape ``(n,)`` (or ``(n, T)``).
    num_classes: labels must lie in ``[0, num_classes)``.
    vocab_size: integer inputs must lie in ``[0, vocab_size)`` (token ids), if given.

  Raises:
    DataError: an empty split, ``len(x) != len(y)``, non-finite features,
      non-integer labels, labels or token ids out of range. The message
      names the data set, the split, the number of bad rows and the first.
  """
  x, y = np.asarray(x), np.asarray(y)
  where = f"data set {name!r}, {split} split"
  if len(x) == 0 or len(y) == 0:
    raise DataError(f"{where}: it is empty ({len(x)} inputs, {len(y)} labels); every split "
                    "needs at least one row")
  check_form(name, split, x, y)
  if np.issubdtype(x.dtype, np.inexact):
    bad = _rows(~np.isfinite(x))
    if bad.any():
      raise DataError(f"{where}: {int(bad.sum())} of {len(x)} rows hold non-finite features "
                      f"(NaN or inf); the first is row {_first(bad)}")
  elif vocab_size is not None and np.issubdtype(x.dtype, np.integer):
    bad = _rows((x < 0) | (x >= vocab_size))
    if bad.any():
      i = _first(bad)
      raise DataError(f"{where}: {int(bad.sum())} of {len(x)} rows hold token ids outside "
                      f"[0, {vocab_size}); the first is row {i}")
  bad = _rows((y < 0) | (y >= num_classes))
  if bad.any():
    i = _first(bad)
    value = y.reshape(len(y), -1)[i]
    value = value[(value < 0) | (value >= num_classes)][0]
    raise DataError(f"{where}: {int(bad.sum())} of {len(y)} labels are outside "
                    f"[0, {num_classes}) (num_classes={num_classes}); the first is row {i}: "
                    f"{int(value)}")


def check_dataset(dataset) -> None:
  """:func:`check_split` on both splits of a :class:`~dadjax.data.Dataset`."""
  for split in ("train", "test"):
    check_split(dataset.name, split, getattr(dataset, f"x_{split}"),
                getattr(dataset, f"y_{split}"), dataset.num_classes,
                getattr(dataset, "vocab_size", None))
