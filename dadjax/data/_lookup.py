"""Data sets by name: ``register_dataset``, ``get_dataset``, ``dataset_names``, ``load``.

A name is one of:

- a registered name (``"digits"``, ``"synthetic"``, ``"synthetic_seq"``,
  ``"fashion_mnist"``, and whatever :func:`register_dataset` added), or a
  registered prefix with its argument (``"text:GLOB"``, ``"idx:DIR"``);
- a ``.npz`` file holding ``x_train``, ``y_train``, ``x_test``, ``y_test``
  (optionally ``num_classes``, ``vocab_size``);
- an import path ``"package.module:function"`` to a function of your own
  that returns a :class:`Dataset`, a dict with those keys, or a tuple
  ``(x_train, y_train, x_test, y_test[, num_classes])``;
- anything else: a tensorflow-datasets name, read by :func:`load_tfds`.
"""

from __future__ import annotations

import functools
import pathlib
import re
from typing import Any, Callable

import numpy as np

from dadjax._core.imports import import_path
from dadjax.data._checks import check_form
from dadjax.data._embedded import Dataset
from dadjax.data._tfds import load_tfds

_DATASETS: dict[str, Callable[..., Dataset]] = {}
_PREFIXED: dict[str, Callable[..., Dataset]] = {}  # "name:ARG": the loader takes ARG first
_IMPORT_PATH = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*\Z")
_KEYS = ("x_train", "y_train", "x_test", "y_test")


def register_dataset(name: str, loader: Callable[..., Dataset], *,
                     takes_argument: bool = False) -> None:
  """Make ``loader`` a data set by name (``config.dataset = name``).

  Args:
    name: the name; an existing name is replaced.
    loader: ``(**dataset_kwargs) -> Dataset``; the config's
      ``dataset_kwargs`` are checked against its signature.
    takes_argument: the name is a prefix: ``"name:ARG"`` calls
      ``loader(ARG, **dataset_kwargs)`` (``"text:GLOB"``, ``"idx:DIR"``).
  """
  if not name or ":" in name or name.endswith(".npz"):
    raise ValueError(f"register_dataset: name must be non-empty, without ':' and not a .npz "
                     f"file, got {name!r}")
  (_PREFIXED if takes_argument else _DATASETS)[name] = loader


def dataset_names() -> list[str]:
  """The registered data set names, sorted (prefixes as ``"name:ARG"``)."""
  return sorted([*_DATASETS, *(f"{p}:ARG" for p in _PREFIXED)])


def _prefixed(name: str) -> Callable[..., Dataset] | None:
  prefix, sep, arg = name.partition(":")
  if sep and arg and prefix in _PREFIXED:
    return functools.partial(_PREFIXED[prefix], arg)
  return None


def as_dataset(value: Any, name: str) -> Dataset:
  """A :class:`Dataset` from what a user's loader returned.

  Accepts a ``Dataset``, a mapping with ``x_train``, ``y_train``,
  ``x_test``, ``y_test`` (optionally ``num_classes``, ``vocab_size``), or a
  tuple ``(x_train, y_train, x_test, y_test[, num_classes])``. Labels become
  int32 (``(rows,)`` labels or ``(rows, T)`` targets); ``num_classes`` defaults to the largest label + 1.

  Raises:
    ValueError: for anything else, naming what is missing.
    DataError: labels that are not integers, or x and y of different lengths (a
      ``ValueError`` too), naming the split and the first bad row.
  """
  if isinstance(value, Dataset):
    return value
  if isinstance(value, (tuple, list)) and len(value) in (4, 5):
    value = dict(zip((*_KEYS, "num_classes"), value))
  if not hasattr(value, "keys"):
    raise ValueError(f"data set {name!r}: expected a Dataset, a dict with keys {list(_KEYS)} or a "
                     f"tuple (x_train, y_train, x_test, y_test[, num_classes]), got "
                     f"{type(value).__name__}")
  missing = [k for k in _KEYS if k not in value.keys()]
  if missing:
    raise ValueError(f"data set {name!r}: missing {missing} (it needs {list(_KEYS)})")
  x_train, x_test = np.asarray(value["x_train"]), np.asarray(value["x_test"])
  y_train, y_test = np.asarray(value["y_train"]), np.asarray(value["y_test"])
  for split, x, y in (("train", x_train, y_train), ("test", x_test, y_test)):
    check_form(name, split, x, y)  # a DataError naming the split and the first bad row
  num_classes = value["num_classes"] if "num_classes" in value.keys() else None
  if num_classes is None:
    num_classes = int(max(y_train.max(initial=0), y_test.max(initial=0))) + 1
  vocab = value["vocab_size"] if "vocab_size" in value.keys() else None
  if not np.issubdtype(x_train.dtype, np.integer):
    x_train, x_test = x_train.astype(np.float32), x_test.astype(np.float32)
  return Dataset(x_train, y_train.astype(np.int32), x_test, y_test.astype(np.int32),
                 num_classes=int(num_classes), name=name,
                 vocab_size=None if vocab is None else int(vocab))


def load_npz(path: str) -> Dataset:
  """A data set from a ``.npz`` file (see :func:`as_dataset` for the keys).

  Raises:
    FileNotFoundError: no such file.
    ValueError: keys or labels that do not fit.
  """
  with np.load(pathlib.Path(path), allow_pickle=False) as f:
    values = {k: f[k] for k in f.files}
  for k in ("num_classes", "vocab_size"):
    if k in values:
      values[k] = int(values[k])
  return as_dataset(values, pathlib.Path(path).stem)


def _imported(path: str) -> Callable[..., Any]:
  obj = import_path(path, "data set")
  if not callable(obj):
    raise ValueError(f"data set {path!r} is not a function")

  @functools.wraps(obj)
  def loader(*args, **kwargs):
    return as_dataset(obj(*args, **kwargs), path.partition(":")[2])

  return loader


def get_dataset(name: str) -> Callable[..., Dataset]:
  """The loader of a data set name: ``(**dataset_kwargs) -> Dataset``.

  Registered names give their loader (a prefix ``"name:ARG"`` the loader
  with ``ARG`` bound first); a ``.npz`` path, an import path
  ``"pkg.mod:function"`` and a tensorflow-datasets name give a loader for
  it (``load_tfds`` with the name bound). Nothing is read yet.

  Raises:
    ValueError: an import path that cannot be imported.
  """
  if name in _DATASETS:
    return _DATASETS[name]
  if _prefixed(name) is not None:
    return _prefixed(name)
  if name.endswith(".npz"):
    return functools.partial(load_npz, name)
  if _IMPORT_PATH.match(name):
    return _imported(name)
  return functools.partial(load_tfds, name)


def load(name: str, **kwargs) -> Dataset:
  """Loads a data set by name (see :func:`get_dataset`); ``kwargs`` go to its loader.

  Raises ``ValueError`` for names that are neither registered nor loadable.
  """
  return get_dataset(name)(**kwargs)
