"""Flax NNX models in the train step: :class:`Model`.

:class:`Model` wraps an ``nnx.Module`` so that it looks like a linen module
to :func:`dadjax.make_train_step` and the train loop: ``init(key, x)``
returns the model's variables as collections of pure dicts
(``nnx.split`` by variable type), ``apply(variables, x, rngs=...,
mutable=..., train=...)`` merges them back (``nnx.merge``), calls the
module and returns the updated collections. A variable type's collection
is its name in Flax's registry (``nnx.register_variable_name``:
``nnx.Param`` -> ``"params"``, ``nnx.BatchStat`` -> ``"batch_stats"``), and
the wrapper takes the collections the step knows: ``"params"`` (the
gradient's tree), every collection with a registered rule
(:func:`~dadjax._core.protocols.register_rule`; a method family registers
its own at import), and the ``collections`` it is given (the step's
``mutable``, default ``("batch_stats",)``: mutable, averaged over sites).
Other variable types are refused.

RNG streams (``nnx.Rngs`` held by ``nnx.Dropout``, ...) stay inside the
wrapper; each call reseeds them from the step's key for the stream
(``rngs={"dropout": key}``), so sites draw different masks and a resumed
run draws the same ones.

What layers *sow* (``Module.sow`` / ``Module.perturb``) comes back in the
collections ``apply`` is asked to return (``mutable``), collected with
``nnx.capture``: e.g. the ``"comm"`` bits of layers that communicate in
their backward pass. Entries of ``variables`` that the module does not hold
(e.g. zero slots a layer perturbs its output with) are handed to those
layers through ``nnx.capture``'s ``init``.

``train=True`` / ``False`` calls ``module.train()`` / ``module.eval()`` on the
merged copy (``Dropout.deterministic``, ``BatchNorm.use_running_average``).
The module's parameters are those it was constructed with (NNX initializes
eagerly); ``init``'s key is not used for them. dAD for NNX layers is
:class:`dadjax.dad.NnxDotGeneral` and :func:`dadjax.dad.inject`.
"""

from __future__ import annotations

from typing import Sequence

import jax
from flax import nnx
from flax import traverse_util

from dadjax._core.protocols import registered_rules
from dadjax.comm import COMM_COLLECTION

__all__ = ["Model"]

DEFAULT_COLLECTIONS = ("batch_stats",)


def _types(names: Sequence[str]) -> dict[str, type]:
  """The NNX Variable type of each name Flax's registry knows (the others have none)."""
  out = {}
  for name in dict.fromkeys(names):
    try:
      out[name] = nnx.variable_type_from_name(name)
    except ValueError:
      continue
  return out


def _split_known(template: dict, given: dict) -> tuple[dict, dict]:
  """``given`` as (the entries ``template`` holds, the others), both nested pure dicts."""
  known = traverse_util.flatten_dict(template)
  flat = traverse_util.flatten_dict(dict(given))
  return (traverse_util.unflatten_dict({k: v for k, v in flat.items() if k in known}),
          {k: v for k, v in flat.items() if k not in known})


def _merge_pure(a: dict, b: dict) -> dict:
  flat = traverse_util.flatten_dict(a)
  flat.update(traverse_util.flatten_dict(b))
  return traverse_util.unflatten_dict(flat)


class Model:
  """An ``nnx.Module`` as a linen-style model for :func:`dadjax.make_train_step`.

  Args:
    module: the NNX module (constructed, i.e. with its parameters).
    collections: collection names the module may hold besides ``"params"``
      and the registered rules' (module docstring); default
      ``("batch_stats",)``.

  Raises:
    ValueError: if the module holds variables of a type the step has no
      collection for (see the module docstring).
  """

  def __init__(self, module: nnx.Module, collections: Sequence[str] = DEFAULT_COLLECTIONS):
    if not isinstance(module, nnx.Module):
      raise ValueError(f"module must be an nnx.Module, got {type(module).__name__}")
    types = _types(("params", *registered_rules(), *collections))
    graphdef, *states = nnx.split(module, *types.values(), nnx.RngState, ...)
    *held, rngs, rest = states
    if jax.tree.leaves(rest):
      kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
          rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
      raise ValueError(f"module: variables of type {kinds} have no train-step collection; "
                       f"supported: {[t.__name__ for t in types.values()]} and RNG streams "
                       "(a type of one's own: nnx.register_variable_name(name, type) and "
                       "make_train_step(..., mutable=[name]))")
    self.module = module
    self._graphdef = graphdef
    self._types = types
    self._templates = dict(zip(types, held))
    self._rngs = rngs
    self._streams = sorted({str(p[-2]) for p, _ in nnx.to_flat_state(rngs)
                            if len(p) >= 2} if jax.tree.leaves(rngs) else set())

  def init(self, key, *args, **kwargs) -> dict:
    """The module's variables as ``{"params": ..., <collection>: ...}``.

    ``key`` and the sample inputs are not used (NNX modules are initialized
    when constructed); collections without variables are left out. A
    parameter with NNX sharding metadata (``nnx.with_partitioning``: its
    ``out_sharding`` names) comes boxed as ``nn.Partitioned``, so the train
    step lays it out inside a site as declared (:mod:`dadjax.parallel._layout`).
    """
    del key, args, kwargs
    out = {}
    for name, state in self._templates.items():
      if jax.tree.leaves(state) or name == "params":
        out[name] = _boxed(state) if name == "params" else nnx.to_pure_dict(state)
    return out

  def _merge(self, variables) -> tuple[nnx.Module, dict]:
    """The module on ``variables``, and the entries it does not hold (as typed Variables,
    nested by module path, for ``nnx.capture``'s ``init``)."""
    states, extra = [], {}
    for name, template in self._templates.items():
      state = jax.tree.map(lambda x: x, template)
      if name in variables:
        known, rest = _split_known(nnx.to_pure_dict(template), variables[name])
        nnx.replace_by_pure_dict(state, known)
        extra.update({k: self._types[name](v) for k, v in rest.items()})
      states.append(state)
    module = nnx.merge(self._graphdef, *states, jax.tree.map(lambda x: x, self._rngs))
    return module, traverse_util.unflatten_dict(extra)

  def apply(self, variables, *args, rngs=None, mutable=False, train=None, **kwargs):
    """Call the module on ``variables``; linen's ``apply`` contract.

    Args:
      variables: ``{"params": ..., <collection>: ...}`` (pure dicts, as
        :meth:`init` returns).
      *args: the module's positional inputs.
      **kwargs: the module's keyword inputs.
      rngs: ``{stream: key}``; each stream the module holds is reseeded.
      mutable: collection names (or ``True``) to return updated; with any,
        the result is ``(outputs, updates)``: each collection's variables
        and what the layers sowed into it (``updates["comm"]``: the bits
        layers send in their backward pass).
      train: ``True`` / ``False`` calls ``module.train()`` / ``module.eval()``.
    """
    module, extra = self._merge(variables)
    if rngs:
      keys = {k: v for k, v in rngs.items() if k in self._streams}
      if keys:
        nnx.reseed(module, **keys)
    if train is True:
      module.train()
    elif train is False:
      module.eval()
    if mutable is True:
      names = [*self._templates, COMM_COLLECTION]
    else:
      names = list(mutable or ())
    sown = [n for n in dict.fromkeys(names) if n != "params"]
    types = [nnx.variable_type_from_name(n, allow_register=True) for n in sown]
    out = nnx.capture(module, *types, init=extra or None)(*args, **kwargs)
    if not mutable:
      return out
    captured = dict(zip(sown, [out[1]] if len(types) == 1 else out[1:]))
    out = out[0] if types else out
    updates = {}
    for name in sown:
      value = {}
      if name in self._templates:
        value = nnx.to_pure_dict(nnx.state(module, self._types[name]))
      value = _merge_pure(value, nnx.to_pure_dict(captured[name]))
      if jax.tree.leaves(value):
        updates[name] = value
    return out, updates

  def __call__(self, *args, train: bool | None = None, **kwargs):
    """Eager call of the wrapped module (its own variables)."""
    if train is True:
      self.module.train()
    elif train is False:
      self.module.eval()
    return self.module(*args, **kwargs)

  def __repr__(self) -> str:
    return f"dadjax.nnx.Model({type(self.module).__name__})"


def _boxed(state) -> dict:
  """``nnx.to_pure_dict(state)`` with each sharded ``nnx.Param`` as an ``nn.Partitioned`` box."""
  import flax.linen as nn  # pylint: disable=g-import-not-at-top
  pure = nnx.to_pure_dict(state)
  for path, var in nnx.to_flat_state(state):
    names = var.get_metadata().get("out_sharding") or var.get_metadata().get("sharding")
    if not names:
      continue
    node = pure
    for key in path[:-1]:
      node = node[key]
    node[path[-1]] = nn.Partitioned(node[path[-1]], tuple(names))
  return pure



# The NNX dAD names lived here before the layer joined its family (dadjax.dad). They still
# resolve, with a DeprecationWarning, without this adapter importing any family.
_MOVED = {"DotGeneral": "NnxDotGeneral", "inject": "inject", "inject_method": "inject_method",
          "DadState": "DadState"}


def __getattr__(name: str):
  if name in _MOVED:
    import importlib  # pylint: disable=g-import-not-at-top
    import warnings  # pylint: disable=g-import-not-at-top
    warnings.warn(f"dadjax.nnx.{name} moved to dadjax.dad.{_MOVED[name]}", DeprecationWarning,
                  stacklevel=2)
    return getattr(importlib.import_module("dadjax.dad"), _MOVED[name])
  raise AttributeError(f"module 'dadjax.nnx' has no attribute {name!r}")
