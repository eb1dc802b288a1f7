"""Objects named by an import path ``"package.module:attr.sub"`` (user models, data sets)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_path"]


def import_path(path: str, what: str) -> Any:
  """The object at ``path`` (``"pkg.mod:Name"`` or ``"pkg.mod:Outer.inner"``).

  Args:
    path: module, ``:``, then a dotted attribute path.
    what: how errors name the object (``"model"``, ``"data set"``).

  Raises:
    ValueError: naming ``what`` and ``path`` when the module cannot be
      imported or lacks the attribute.
  """
  module, _, attr = path.partition(":")
  try:
    obj = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"{what} {path!r}: cannot import module {module!r} ({e})") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{what} {path!r}: module {module!r} has no {attr!r}")
    obj = getattr(obj, part)
  return obj
