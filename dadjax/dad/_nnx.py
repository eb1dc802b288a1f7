"""dAD for Flax NNX layers: :class:`NnxDotGeneral`, :func:`inject`, :func:`inject_method`.

``nnx.Linear(d_in, d_out, dot_general=NnxDotGeneral(mode="rank", rank=2),
rngs=...)``, ``nnx.LinearGeneral(..., dot_general=...)``,
``nnx.Einsum(..., einsum_op=NnxDotGeneral())`` (each layer its own
instance: it holds that layer's state). :func:`inject` gives every such
layer of a model (attention's projections included) its own instance with
the right state shapes and a per-layer seed.

The layer runs the one layer route of :mod:`dadjax.dad._layer` (the same
state, refusals, bucket and booked bits as the linen layers) with its
variables as NNX Variables (:class:`NnxHost`): its state is a dict of
:class:`DadState` (the ``"dad_state"`` collection), a bucketing layer holds
a :class:`DadBucket` marker (``"dad_bucket"``). The collection names are
registered with Flax's own name registry (``nnx.register_variable_name``),
so a generic NNX wrapper (:class:`dadjax.nnx.Model`) finds them by name.
What the backward pass sends and the bucket's rows and slots are *sown*
(``Module.sow`` / ``Module.perturb``) into the ``"comm"`` and
``"dad_bucket"`` collections; they are collected where the caller runs the
model under ``nnx.capture`` with those collections (the train step's
wrapper does), and dropped otherwise, as linen drops what is sown into an
immutable collection.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import nnx

from dadjax._core.keys import layer_seed
from dadjax._core.vma import vary_like
from dadjax.comm import STATE_COLLECTION
from dadjax.dad._bucket import BUCKET_COLLECTION, MARKER
from dadjax.dad._config import CONFIG_FIELDS, DadConfig, config_from
from dadjax.dad._dot_general import (KERNEL_PARAM, Contraction, contraction,
                                     einsum_contraction, einsum_dot, init_kernel_state,
                                     with_precision)
from dadjax.dad._layer import Host, layer_output


class DadState(nnx.Variable):
  """A dAD layer's state (the ``"dad_state"`` collection of the train step)."""


class DadBucket(nnx.Variable):
  """A bucketing dAD layer's marker, slots and sown rows (the ``"dad_bucket"`` collection)."""


# Flax's registry of collection names <-> Variable types (one type per name).
nnx.register_variable_name(STATE_COLLECTION, DadState, overwrite=True)
nnx.register_variable_name(BUCKET_COLLECTION, DadBucket, overwrite=True)


def _capturing(module: nnx.Module) -> bool:
  # Inside nnx.capture, Module.sow keeps a value only for the captured
  # collections and says whether it did; outside, Flax (deprecated) stores it
  # on the module itself, which would grow a layer's attributes on every
  # eager call. A layer sows only under capture: where nothing collects,
  # nothing is kept (linen's sow into an immutable collection). A Flax that
  # stops marking captured modules this way leaves the NNX layers' bits
  # unbooked, which the train step's ledger check refuses loudly.
  return hasattr(module, "__captures__")


class NnxHost(Host):
  """An NNX dAD layer's Variables and ``nnx.capture`` as the route's
  :class:`~dadjax.dad._layer.Host`."""

  def __init__(self, module: NnxDotGeneral):
    self.module = module

  def state(self, config: DadConfig, c: Contraction):
    del config
    m = self.module
    if c.batch != max(m.batch, 1) or (m.batch and not c.batch_shape):
      raise ValueError(f"dimension_numbers: this NnxDotGeneral was built for batch={m.batch}, "
                       f"called with batch axes {c.batch_shape}")
    if m.dad_kernel is None:
      return None
    # (nnx.capture marks every module, the nnx.Dict too: read the Variables only)
    return {k: v.get_value() for k, v in m.dad_kernel.items() if isinstance(v, nnx.Variable)}

  def sow(self, collection, name, value):
    if not _capturing(self.module):
      return None
    before = []

    def append(old, new):
      before.append(len(old))
      return old + (new,)

    kept = self.module.sow(nnx.variable_type_from_name(collection, allow_register=True), name,
                           value, reduce_fn=append)
    return before[0] if kept else None

  def slot(self, collection, name, like):
    zeros = vary_like(jnp.zeros(like.shape, like.dtype), like)
    # perturb returns the slot the caller passed (or zeros, then kept) plus ``zeros``
    return self.module.perturb(name, zeros, nnx.variable_type_from_name(collection))

  def joins_bucket(self):
    return _capturing(self.module)


class NnxDotGeneral(nnx.Module):
  """dAD as an NNX ``dot_general`` / ``einsum_op``: synchronizes the calling layer's kernel.

  ``nnx.Linear(d_in, d_out, dot_general=NnxDotGeneral(mode="rank", rank=2),
  rngs=...)``; called like ``lax.dot_general(lhs, rhs, dimension_numbers,
  precision=..., preferred_element_type=...)`` or like ``jnp.einsum(equation,
  input, kernel)``, with the routes of :class:`~dadjax.dad.DotGeneral`
  (module docstring). The state is the attribute ``dad_kernel``, a dict of
  :class:`DadState` (``"dad_state"`` in the step;
  :func:`~dadjax.dad.layer_mask` marks the layer's ``kernel``).

  Args:
    config: a :class:`~dadjax.dad.DadConfig` (default: its defaults); its
      fields are also keyword ``options`` (``mode="rank"``, ``rank=2``, ...).
      Layers built directly share the seed; :func:`inject` derives one per
      layer from its path.
    shape: ``(d_in, d_out)`` of the canonical view
      (:func:`~dadjax.dad._dot_general.contraction`; for ``nnx.Linear`` its
      ``(in_features, out_features)``), with a leading ``batch`` for batch
      axes. Needed only for state whose size depends on it (``warm_start``,
      ``error_feedback``); otherwise the state is built now. :func:`inject`
      passes it.
    batch: number of batch entries (one kernel each), default 0 (none).
    **options: :class:`~dadjax.dad.DadConfig` fields.

  Raises:
    ValueError: for bad options, or state options without ``shape``.
  """

  def __init__(self, config: DadConfig | None = None, *, shape: tuple[int, int] | None = None,
               batch: int = 0, **options: Any):
    self.config = config_from(config, **options)
    self.batch = int(batch)
    needs_shape = self.config.warm_start or self.config.error_feedback
    if self.config.mode == "local" or self.config.bucket:
      self.dad_kernel = nnx.data(None)
    elif shape is None and needs_shape:
      raise ValueError("shape: warm_start and error_feedback keep (d_in, d_out)-sized state; "
                       "pass shape=(d_in, d_out) or build the layers with dadjax.dad.inject")
    else:
      d_in, d_out = shape if shape is not None else (1, 1)
      lead = (self.batch,) if self.batch else ()
      c = contraction(lead + (1, d_in), lead + (d_in, d_out),
                      (((1 + bool(self.batch),), (bool(self.batch),)),
                       (((0,), (0,)) if self.batch else ((), ()))))
      self.dad_kernel = nnx.Dict({k: DadState(v) for k, v in
                                  init_kernel_state(self.config, c).items()})
    if self.config.bucket:  # the model state holds "dad_bucket" iff a layer buckets
      setattr(self, MARKER, DadBucket(jnp.zeros((), jnp.int8)))

  def __call__(self, lhs, rhs, dimension_numbers=None, precision=None,
               preferred_element_type=None, out_sharding=None, **kwargs):
    if out_sharding is not None:
      raise ValueError("out_sharding: dadjax.dad.NnxDotGeneral runs inside the site program; "
                       "pass out_sharding=None")
    if isinstance(lhs, str):  # einsum_op(equation, input, kernel, ...)
      return einsum_dot(self._dot, lhs, rhs, dimension_numbers, precision,
                        preferred_element_type)
    if kwargs:
      raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    return self._dot(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type)

  def _dot(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return layer_output(NnxHost(self), lhs, rhs, dimension_numbers,
                        with_precision(self.config, precision),
                        preferred_element_type=preferred_element_type)


def inject(model: nnx.Module, config: DadConfig | None = None, **options: Any) -> nnx.Module:
  """Give every ``nnx.Linear``, ``nnx.LinearGeneral`` and ``nnx.Einsum`` of ``model`` dAD.

  Each layer gets its own :class:`NnxDotGeneral` (``dot_general`` /
  ``einsum_op``) with ``config`` (or its fields as ``options``), the state
  shapes of its kernel, and the seed combined with the layer's path (as
  linen dAD layers). ``nnx.MultiHeadAttention``'s projections are
  ``LinearGeneral`` layers, so they are covered. Modifies ``model`` in
  place and returns it.
  """
  _inject(model, config_from(config, **options))
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
  config = config_from(factory.options.get("config"),
                       **{k: v for k, v in factory.options.items() if k in CONFIG_FIELDS})
  paths = _inject(model, config)
  if config.mode != "local":
    factory.record_kernels([path + (KERNEL_PARAM,) for path in paths])
  return model


def _view(layer) -> tuple[tuple[int, int], int] | None:
  """``((d_in, d_out), batch)`` of an NNX layer's kernel view, or ``None`` for other modules."""
  if isinstance(layer, nnx.Linear):
    return (layer.in_features, layer.out_features), 0
  if isinstance(layer, nnx.LinearGeneral):
    batch = int(jnp.prod(jnp.array(list(layer.batch_axis.values()) or [0])))
    return ((int(jnp.prod(jnp.array(layer.in_features))),
             int(jnp.prod(jnp.array(layer.out_features)))),
            batch if layer.batch_axis else 0)
  if isinstance(layer, nnx.Einsum):
    k = layer.kernel.get_value()
    eq = layer.einsum_str
    # A stand-in input (size 1 for the letters the kernel lacks) gives the kernel's view.
    letters = eq.replace(" ", "").split("->")[0].split(",")
    sizes = {ch: k.shape[letters[1].index(ch)] if ch in letters[1] else 1 for ch in letters[0]}
    lhs_sum, rhs_sum, dims, _ = einsum_contraction(eq, (1,) * len(letters[0]), k.shape)
    lhs_shape = tuple(sizes[ch] for i, ch in enumerate(letters[0]) if i not in lhs_sum)
    rhs_shape = tuple(s for i, s in enumerate(k.shape) if i not in rhs_sum)
    c = contraction(lhs_shape, rhs_shape, dims)
    return (c.d_in, c.d_out), (c.batch if c.batch_shape else 0)
  return None


def _inject(model: nnx.Module, config: DadConfig) -> list[tuple[str, ...]]:
  """:func:`inject`; returns the paths of the layers it gave dAD."""
  done = []
  for path, layer in nnx.iter_modules(model):
    view = _view(layer)
    if view is None:
      continue
    names = tuple(str(p) for p in path)
    op = NnxDotGeneral(config_from(config, seed=layer_seed(config.seed, names)),
                       shape=view[0], batch=view[1])
    if isinstance(layer, nnx.Einsum):
      layer.einsum_op = nnx.data(op)
    else:
      layer.dot_general = nnx.data(op)
      if hasattr(layer, "dot_general_cls"):
        layer.dot_general_cls = None
    done.append(names)
  return done
