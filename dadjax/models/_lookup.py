"""Models by name: ``register_model``, ``model_class``, ``model_names``, ``get_model``.

A name is a registered one (``"mlp"``, ``"cnn"``, ...; any case) or an
import path ``"package.module:Class"`` naming a Flax module class of the
user's own: a linen module, or an ``nnx.Module`` (built eagerly as
``Class(**model_kwargs, rngs=nnx.Rngs(seed, dropout=seed))``, plus
``num_classes=`` when its ``__init__`` takes it; the train step wraps it with
:class:`dadjax.nnx.Model`). Registered names may carry default fields
(``"vit"`` is a ``Transformer`` with ``patch_size=4``).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Callable

import flax.linen as nn

from dadjax._core.imports import import_path

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


def model_class(name: str) -> tuple[Callable[..., nn.Module], dict]:
  """``(class, default fields)`` of a model name or an import path ``"pkg.mod:Class"``.

  Raises:
    ValueError: an unknown name (listing the registered ones) or an import
      path that does not name a class.
  """
  if ":" in name:
    cls = import_path(name, "model")
    if not callable(cls):
      raise ValueError(f"model {name!r} is not a class")
    return cls, {}
  key = name.lower()
  if key not in _MODELS:
    raise ValueError(f"unknown model {name!r}; valid names: {model_names()} or an import path "
                     "'package.module:Class'")
  cls, defaults = _MODELS[key]
  return cls, dict(defaults)


def is_nnx_class(cls: Any) -> bool:
  """Whether ``cls`` is a Flax NNX module class (``nnx.Module`` subclass)."""
  nnx = sys.modules.get("flax.nnx")  # an NNX class was defined, so flax.nnx is imported
  return nnx is not None and isinstance(cls, type) and issubclass(cls, nnx.Module)


def model_fields(cls: Callable[..., Any]) -> list[str] | None:
  """The fields a model class takes (``None`` when they cannot be read).

  A linen module's dataclass fields; an NNX module's ``__init__`` keywords
  but ``rngs`` (``None`` when it takes ``**kwargs``).
  """
  if is_nnx_class(cls):
    try:
      params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
      return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
      return None
    return [p.name for p in params if p.name != "rngs"
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
  if dataclasses.is_dataclass(cls):
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in ("parent", "name")]
  return None


def _nnx_model(name: str, cls, num_classes: int, dense, seed: int, kwargs: dict):
  """An NNX class built with the convention of the module docstring; a dAD method's
  factory (``dense``) gives its layers dAD (:func:`dadjax.dad.inject_method`)."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  if dense is not nn.Dense and not hasattr(dense, "record_kernels"):
    raise ValueError(f"model {name!r} is an NNX module: its layers get dAD from a dAD "
                     f"method's factory (dadjax.dad.DenseFactory), not from {dense!r}")
  fields = model_fields(cls)
  if fields is None or "num_classes" in fields:
    kwargs["num_classes"] = num_classes
  module = cls(**kwargs, rngs=nnx.Rngs(seed, dropout=seed))
  if dense is not nn.Dense:
    from dadjax.dad import inject_method  # pylint: disable=g-import-not-at-top
    inject_method(module, dense)
  return module


def get_model(name: str, num_classes: int, dense=nn.Dense, *, nnx_seed: int = 0,
              **kwargs) -> Any:
  """Build a model by name or import path.

  Registered names: see :func:`model_names` ("mlp", "cnn", "resnet18" /
  "resnet", "gru", "transformer", "vit": a ``Transformer`` with
  ``patch_size=4`` unless given); ``"package.module:Class"`` imports a
  class of your own. ``num_classes`` is passed when the class takes it,
  ``dense`` when it takes it (a ``dense`` other than ``nn.Dense`` for a
  class that does not take one is an error: the method needs it).
  ``kwargs`` are passed to the class. An NNX class is constructed (its
  parameters drawn) with ``rngs=nnx.Rngs(nnx_seed, dropout=nnx_seed)``
  and no ``dense`` argument: a dAD method's factory gives its
  ``nnx.Linear`` / ``LinearGeneral`` / ``Einsum`` layers dAD
  (:func:`dadjax.dad.inject_method`). The returned ``nnx.Module`` goes to
  ``make_train_step`` as it is.

  Raises:
    ValueError: an unknown name, or a dense factory the class cannot take.
  """
  cls, defaults = model_class(name)
  kwargs = {**defaults, **kwargs}
  if is_nnx_class(cls):
    return _nnx_model(name, cls, num_classes, dense, nnx_seed, kwargs)
  fields = model_fields(cls)
  if fields is None or "num_classes" in fields:
    kwargs["num_classes"] = num_classes
  if fields is None or "dense" in fields:
    kwargs["dense"] = dense
  elif dense is not nn.Dense:
    raise ValueError(f"model {name!r} has no `dense` field, but the method builds its dense "
                     "layers (dAD): give the model a `dense` factory field")
  return cls(**kwargs)
