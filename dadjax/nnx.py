"""Flax NNX models in the train step, and dAD for NNX layers.

:class:`Model` wraps an ``nnx.Module`` so that it looks like a linen module
to :func:`dadjax.make_train_step` and the train loop: ``init(key, x)``
returns the model's variables as collections of pure dicts
(``nnx.split`` by variable type), ``apply(variables, x, rngs=...,
mutable=..., train=...)`` merges them back (``nnx.merge``), calls the
module and returns the updated collections. Variable types map onto the
step's model state:

* ``nnx.Param`` -> ``"params"`` (the gradient's tree);
* :class:`DadState` -> ``"dad_state"`` (differentiated and overwritten
  with the cotangent, as for linen dAD layers);
* ``nnx.BatchStat`` -> ``"batch_stats"`` (mutable, averaged over sites);
* RNG streams (``nnx.Rngs`` held by ``nnx.Dropout``, ...) stay inside the
  wrapper; each call reseeds them from the step's key for the stream
  (``rngs={"dropout": key}``), so sites draw different masks and a resumed
  run draws the same ones. Other variable types are refused.

``train=True`` / ``False`` calls ``module.train()`` / ``module.eval()`` on the
merged copy (``Dropout.deterministic``, ``BatchNorm.use_running_average``).
The module's parameters are those it was constructed with (NNX initializes
eagerly); ``init``'s key is not used for them.

:class:`DotGeneral` is dAD for NNX layers: ``nnx.Linear(...,
dot_general=DotGeneral())``, ``nnx.LinearGeneral(..., dot_general=...)``,
``nnx.Einsum(..., einsum_op=DotGeneral())`` (each layer its own instance: it
holds that layer's state). :func:`inject` gives every such layer of a model
(attention's projections included) its own instance with the right state
shapes and a per-layer seed.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

import contextvars
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dadjax.comm import COMM_COLLECTION, STATE_COLLECTION
from dadjax.dad import DadConfig
from dadjax.dad._cost import layer_traffic
from dadjax.dad._dot_general import (KERNEL_PARAM, KERNEL_STATE_NAME, _einsum, contraction,
                                     dot_general, einsum_contraction, init_kernel_state,
                                     layer_seed)
from dadjax.dad._rank_accordion import accordion_gather_bits
from dadjax.comm import bits_const

__all__ = ["Model", "DotGeneral", "DadState", "inject", "inject_method", "COLLECTIONS"]


class DadState(nnx.Variable):
  """A dAD layer's state (the ``"dad_state"`` collection of the train step)."""


# Variable type -> the step's collection name.
COLLECTIONS = ((nnx.Param, "params"), (DadState, STATE_COLLECTION),
               (nnx.BatchStat, "batch_stats"))
_RNG_TYPES = (nnx.RngState,)

# The "comm" rows of the layers called inside Model.apply (trace-time list).
_SINK: contextvars.ContextVar[list | None] = contextvars.ContextVar("dadjax_nnx_comm",
                                                                    default=None)


def _options(options: dict) -> DadConfig:
  return DadConfig(**options)


class DotGeneral(nnx.Module):
  """dAD as an NNX ``dot_general`` / ``einsum_op``: synchronizes the calling layer's kernel.

  ``nnx.Linear(d_in, d_out, dot_general=DotGeneral(mode="rank", rank=2),
  rngs=...)``; called like ``lax.dot_general(lhs, rhs, dimension_numbers,
  precision=..., preferred_element_type=...)`` or like ``jnp.einsum(equation,
  input, kernel)``, with the routes of :class:`dadjax.dad.DotGeneral`. The
  state is the attribute ``dad_kernel``, a dict of :class:`DadState` (``"dad_state"`` in the
  step; :func:`dadjax.dad.layer_mask` marks the layer's ``kernel``).

  Args:
    shape: ``(d_in, d_out)`` of the canonical view (:func:`dadjax.dad._dot_general.contraction`;
      for ``nnx.Linear`` its ``(in_features, out_features)``), with a leading
      ``batch`` for batch axes. Needed only for state whose size depends on
      it (``warm_start``, ``error_feedback``); otherwise the state is built
      now. :func:`inject` passes it.
    batch: number of batch entries (one kernel each), default 0 (none).
    **options: :class:`~dadjax.dad.DadConfig` fields (``axis_name="data"``,
      ``mode="exact"``, ``rank``, ...). Layers built directly share the seed;
      :func:`inject` derives one per layer from its path.
  """

  def __init__(self, *, shape: tuple[int, int] | None = None, batch: int = 0, **options: Any):
    self.config = _options(options)
    self.batch = int(batch)
    needs_shape = self.config.warm_start or self.config.error_feedback
    if self.config.mode == "local":
      self.dad_kernel = nnx.data(None)
    elif shape is None and needs_shape:
      raise ValueError("shape: warm_start and error_feedback keep (d_in, d_out)-sized state; "
                       "pass shape=(d_in, d_out) or build the layers with dadjax.nnx.inject")
    else:
      d_in, d_out = shape if shape is not None else (1, 1)
      c = contraction(((self.batch,) if self.batch else ()) + (1, d_in),
                      ((self.batch,) if self.batch else ()) + (d_in, d_out),
                      (((1 + bool(self.batch),), (bool(self.batch),)),
                       (((0,), (0,)) if self.batch else ((), ()))))
      self.dad_kernel = nnx.Dict({k: DadState(v) for k, v in
                                  init_kernel_state(self.config, c).items()})

  def __call__(self, lhs, rhs, dimension_numbers=None, precision=None,
               preferred_element_type=None, out_sharding=None, **kwargs):
    if out_sharding is not None:
      raise ValueError("out_sharding: dadjax.nnx.DotGeneral runs inside the site program; "
                       "pass out_sharding=None")
    if isinstance(lhs, str):  # einsum_op(equation, input, kernel, ...)
      return _einsum(self._dot, lhs, rhs, dimension_numbers, precision, preferred_element_type)
    if kwargs:
      raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    return self._dot(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type)

  def _dot(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    config = self.config
    c = contraction(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
    if c.batch != max(self.batch, 1) or (self.batch and not c.batch_shape):
      raise ValueError(f"dimension_numbers: this DotGeneral was built for batch={self.batch}, "
                       f"called with batch axes {c.batch_shape}")
    state = None
    if self.dad_kernel is not None:
      state = {k: v.get_value() for k, v in self.dad_kernel.items()}
    y = dot_general(lhs, rhs, dimension_numbers, precision=precision,
                    preferred_element_type=preferred_element_type, state=state, config=config)
    sink = _SINK.get()
    if sink is not None and config.axis_name is not None:
      a, k = c.operands(lhs, rhs)
      one = state
      if c.batch_shape:
        a, k = a[0], k[0]
        one = None if state is None else jax.tree.map(lambda v: v[0], state)
      t = layer_traffic(config, a, k, None, one)
      row = {}
      if t.gather_calls:
        row["gather_bits"] = (accordion_gather_bits(config, t.gather, (c.d_in, c.d_out),
                                                    k.dtype, one)
                              if config.rank_low is not None and one is not None
                              else bits_const(t.gather * c.batch))
        row["gather_calls"] = jnp.zeros((t.gather_calls,), jnp.int8)
      if t.reduce_calls:
        row["reduce_bits"] = bits_const(t.reduce * c.batch)
        row["reduce_calls"] = jnp.zeros((t.reduce_calls,), jnp.int8)
      if row:
        sink.append(row)
    return y


def _path_seed(seed: int, path) -> int:
  return layer_seed(seed, tuple(str(p) for p in path))


def inject(model: nnx.Module, **options: Any) -> nnx.Module:
  """Give every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` of ``model`` dAD.

  Each layer gets its own :class:`DotGeneral` (``dot_general`` /
  ``einsum_op``) with ``options`` (:class:`~dadjax.dad.DadConfig` fields),
  the state shapes of its kernel, and the seed combined with the layer's
  path (as linen dAD layers). ``nnx.MultiHeadAttention``'s projections are
  ``LinearGeneral`` layers, so they are covered. Modifies ``model`` in
  place and returns it.
  """
  _inject(model, options)
  return model


def inject_method(model: nnx.Module, factory: Any) -> nnx.Module:
  """Give ``model`` the dAD layers of a method's dense factory (a config's ``method=dad``).

  :func:`inject` with the factory's :class:`~dadjax.dad.DadConfig` options
  and seed, and the kernels recorded in the factory
  (:meth:`~dadjax.dad.DenseFactory.record_kernels`), so the method's
  ``synchronize`` masks them. Modifies ``model`` in place and returns it.

  Args:
    model: an NNX module.
    factory: a :class:`~dadjax.dad.DenseFactory` (``Method.dense`` of a dAD method).
  """
  options = {k: v for k, v in factory.options.items()
             if k in DadConfig.__dataclass_fields__ or k == "seed"}
  paths = _inject(model, options)
  if options.get("mode") != "local":
    factory.record_kernels([path + (KERNEL_PARAM,) for path in paths])
  return model


def _inject(model: nnx.Module, options: dict) -> list[tuple[str, ...]]:
  """:func:`inject`; returns the paths of the layers it gave dAD."""
  options = dict(options)
  seed = options.pop("seed", 0)
  _options(options)  # validate now, naming the bad argument
  done = []
  for path, layer in nnx.iter_modules(model):
    shape, batch = None, 0
    if isinstance(layer, nnx.Linear):
      shape = (layer.in_features, layer.out_features)
    elif isinstance(layer, nnx.LinearGeneral):
      batch = int(jnp.prod(jnp.array(list(layer.batch_axis.values()) or [0])))
      batch = batch if layer.batch_axis else 0
      shape = (int(jnp.prod(jnp.array(layer.in_features))),
               int(jnp.prod(jnp.array(layer.out_features))))
    elif isinstance(layer, nnx.Einsum):
      k = layer.kernel.get_value()
      eq = layer.einsum_str
      # A stand-in input (size 1 for the letters the kernel lacks) gives the kernel's view.
      letters = eq.replace(" ", "").split("->")[0].split(",")
      sizes = {ch: k.shape[letters[1].index(ch)] if ch in letters[1] else 1 for ch in letters[0]}
      lhs_sum, rhs_sum, dims, _ = einsum_contraction(eq, (1,) * len(letters[0]), k.shape)
      lhs_shape = tuple(sizes[ch] for i, ch in enumerate(letters[0]) if i not in lhs_sum)
      rhs_shape = tuple(s for i, s in enumerate(k.shape) if i not in rhs_sum)
      c = contraction(lhs_shape, rhs_shape, dims)
      shape, batch = (c.d_in, c.d_out), (c.batch if c.batch_shape else 0)
      layer.einsum_op = nnx.data(DotGeneral(shape=shape, batch=batch,
                                            seed=_path_seed(seed, path), **options))
      done.append(tuple(str(p) for p in path))
      continue
    else:
      continue
    layer.dot_general = nnx.data(DotGeneral(shape=shape, batch=batch,
                                            seed=_path_seed(seed, path), **options))
    if hasattr(layer, "dot_general_cls"):
      layer.dot_general_cls = None
    done.append(tuple(str(p) for p in path))
  return done


def _collection_of(var_type) -> str | None:
  for t, name in COLLECTIONS:
    if issubclass(var_type, t):
      return name
  return None


class Model:
  """An ``nnx.Module`` as a linen-style model for :func:`dadjax.make_train_step`.

  Args:
    module: the NNX module (constructed, i.e. with its parameters).

  Raises:
    ValueError: if the module holds variables of a type the step has no
      collection for (see the module docstring).
  """

  def __init__(self, module: nnx.Module):
    if not isinstance(module, nnx.Module):
      raise ValueError(f"module must be an nnx.Module, got {type(module).__name__}")
    filters = [t for t, _ in COLLECTIONS] + [nnx.RngState, ...]
    graphdef, *states = nnx.split(module, *filters)
    *collections, rngs, rest = states
    if jax.tree.leaves(rest):
      kinds = sorted({type(v).__name__ for v in jax.tree.leaves(
          rest, is_leaf=lambda v: isinstance(v, nnx.Variable))})
      raise ValueError(f"module: variables of type {kinds} have no train-step collection; "
                       f"supported: {[t.__name__ for t, _ in COLLECTIONS]} and RNG streams")
    self.module = module
    self._graphdef = graphdef
    self._templates = {name: s for (_, name), s in zip(COLLECTIONS, collections)}
    self._rngs = rngs
    self._streams = sorted({str(p[-2]) for p, _ in nnx.to_flat_state(rngs)
                            if len(p) >= 2} if jax.tree.leaves(rngs) else set())

  def init(self, key, *args, **kwargs) -> dict:
    """The module's variables as ``{"params": ..., "dad_state": ..., "batch_stats": ...}``.

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

  def _merge(self, variables):  # noqa: D401 (see init)
    states = []
    for name, template in self._templates.items():
      state = jax.tree.map(lambda x: x, template)
      if name in variables:
        nnx.replace_by_pure_dict(state, variables[name])
      states.append(state)
    return nnx.merge(self._graphdef, *states, jax.tree.map(lambda x: x, self._rngs))

  def apply(self, variables, *args, rngs=None, mutable=False, train=None, **kwargs):
    """Call the module on ``variables``; linen's ``apply`` contract.

    Args:
      variables: ``{"params": ..., "dad_state": ..., "batch_stats": ...}``
        (pure dicts, as :meth:`init` returns).
      *args: the module's positional inputs.
      **kwargs: the module's keyword inputs.
      rngs: ``{stream: key}``; each stream the module holds is reseeded.
      mutable: collection names (or ``True``) to return updated; with any,
        the result is ``(outputs, updates)`` and ``updates["comm"]`` holds
        the bits the dAD layers send.
      train: ``True`` / ``False`` calls ``module.train()`` / ``module.eval()``.
    """
    module = self._merge(variables)
    if rngs:
      keys = {k: v for k, v in rngs.items() if k in self._streams}
      if keys:
        nnx.reseed(module, **keys)
    if train is True:
      module.train()
    elif train is False:
      module.eval()
    sink: list = []
    token = _SINK.set(sink)
    try:
      out = module(*args, **kwargs)
    finally:
      _SINK.reset(token)
    if not mutable:
      return out
    names = {n for _, n in COLLECTIONS} | {COMM_COLLECTION} if mutable is True else set(mutable)
    updates = {}
    for var_type, name in COLLECTIONS:
      if name in names and name != "params":
        state = nnx.state(module, var_type)
        if jax.tree.leaves(state):
          updates[name] = nnx.to_pure_dict(state)
    if COMM_COLLECTION in names and sink:
      updates[COMM_COLLECTION] = {str(i): row for i, row in enumerate(sink)}
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

