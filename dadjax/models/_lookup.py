"""Models by name: ``register_model``, ``model_class``, ``model_names``, ``get_model``.

A name is a registered one (``"mlp"``, ``"cnn"``, ...; any case) or an
import path ``"package.module:Class"`` naming a Flax linen module class of
the user's own. Registered names may carry default fields (``"vit"`` is a
``Transformer`` with ``patch_size=4``).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

import flax.linen as nn

_MODELS: dict[str, tuple[type, dict]] = {}


def register_model(name: str, cls: Callable[..., nn.Module], **defaults: Any) -> None:
  """Make ``cls`` a model by name (``config.model = name``).

  Args:
    name: the name, lower case; an existing name is replaced.
    cls: a Flax module class (or any callable returning a module) taking
      its fields as keywords; ``num_classes`` and ``dense`` are passed when
      it takes them.
    **defaults: fields set unless the config's ``model_kwargs`` give them.
  """
  if not name or name != name.lower() or ":" in name:
    raise ValueError(f"register_model: name must be lower case without ':', got {name!r}")
  _MODELS[name] = (cls, dict(defaults))


def model_names() -> list[str]:
  """The registered model names, sorted."""
  return sorted(_MODELS)


def _import_path(path: str) -> Any:
  module, _, attr = path.partition(":")
  try:
    obj = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"model {path!r}: cannot import module {module!r} ({e})") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"model {path!r}: module {module!r} has no {attr!r}")
    obj = getattr(obj, part)
  return obj


def model_class(name: str) -> tuple[Callable[..., nn.Module], dict]:
  """``(class, default fields)`` of a model name or an import path ``"pkg.mod:Class"``.

  Raises:
    ValueError: an unknown name (listing the registered ones) or an import
      path that does not name a class.
  """
  if ":" in name:
    cls = _import_path(name)
    if not callable(cls):
      raise ValueError(f"model {name!r} is not a class")
    return cls, {}
  key = name.lower()
  if key not in _MODELS:
    raise ValueError(f"unknown model {name!r}; valid names: {model_names()} or an import path "
                     "'package.module:Class'")
  cls, defaults = _MODELS[key]
  return cls, dict(defaults)


def model_fields(cls: Callable[..., Any]) -> list[str] | None:
  """The fields a model class takes (``None`` when they cannot be read)."""
  if dataclasses.is_dataclass(cls):
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]
  return None


def get_model(name: str, num_classes: int, dense=nn.Dense, **kwargs) -> nn.Module:
  """Build a model by name or import path.

  Registered names: see :func:`model_names` ("mlp", "cnn", "resnet18" /
  "resnet", "gru", "transformer", "vit": a ``Transformer`` with
  ``patch_size=4`` unless given); ``"package.module:Class"`` imports a
  class of your own. ``num_classes`` is passed when the class takes it,
  ``dense`` when it takes it (a ``dense`` other than ``nn.Dense`` for a
  class that does not take one is an error: the method needs it).
  ``kwargs`` are passed to the class.

  Raises:
    ValueError: an unknown name, or a dense factory the class cannot take.
  """
  cls, defaults = model_class(name)
  kwargs = {**defaults, **kwargs}
  fields = model_fields(cls)
  if fields is None or "num_classes" in fields:
    kwargs["num_classes"] = num_classes
  if fields is None or "dense" in fields:
    kwargs["dense"] = dense
  elif dense is not nn.Dense:
    raise ValueError(f"model {name!r} has no `dense` field, but the method builds its dense "
                     "layers (dAD): give the model a `dense` factory field")
  return cls(**kwargs)
