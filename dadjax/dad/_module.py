"""The Flax linen faces of dAD: :class:`DotGeneral` (a ``dot_general_cls``) and :class:`Dense`.

Both take a ``config: DadConfig`` (or its fields as keyword options, read
from :data:`~dadjax.dad._config.CONFIG_FIELDS`) and run the one layer route
of :mod:`dadjax.dad._layer` with their variables in the linen collections
(:class:`LinenHost`): the state entry in ``"dad_state"``, the bits in
``"comm"``, the bucket's slots and rows in ``"dad_bucket"``.
:class:`Dense` is ``flax.linen.Dense`` whose contraction and bias take the
route (the bias's exact gradient from ``D``'s column sums, no separate
all-reduce), with its state under ``"dad"`` at the layer's own path.

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from dadjax._core.keys import layer_seed
from dadjax._core.validate import check_int
from dadjax._core.vma import vary_like
from dadjax.comm import STATE_COLLECTION
from dadjax.dad._bucket import BUCKET_COLLECTION, MARKER
from dadjax.dad._config import CONFIG_FIELDS, DadConfig, config_from
from dadjax.dad._dot_general import (KERNEL_STATE_NAME, Contraction, einsum_dot,
                                     init_kernel_state, with_precision)
from dadjax.dad._layer import Host, layer_output
from dadjax.dad._state import STATE_NAME


def module_state(module: nn.Module, name: str, init_fn, *init_args):
  """A layer's ``"dad_state"`` entry: the collection's variable where the
  collection is mutable or present, else a fresh transient state (e.g.
  evaluation with params only)."""
  if (module.is_mutable_collection(STATE_COLLECTION)
      or module.has_variable(STATE_COLLECTION, name)):
    return module.variable(STATE_COLLECTION, name, init_fn, *init_args).value
  return init_fn(*init_args)


class LinenHost(Host):
  """A linen module's collections as the layer route's :class:`~dadjax.dad._layer.Host`."""

  def __init__(self, module: nn.Module, state_name: str):
    self.module, self.state_name = module, state_name
    self.path = tuple(module.path)

  def state(self, config: DadConfig, c: Contraction):
    return module_state(self.module, self.state_name, init_kernel_state, config, c)

  def sow(self, collection, name, value):
    before = len(self.module.get_variable(collection, name, ()))
    return before if self.module.sow(collection, name, value) else None

  def slot(self, collection, name, like):
    return self.module.variable(collection, name,
                                lambda: vary_like(jnp.zeros(like.shape, like.dtype), like)).value

  def joins_bucket(self):
    if not self.module.is_mutable_collection(BUCKET_COLLECTION):
      return False
    if self.module.is_initializing():  # the model state holds the collection iff a layer buckets
      self.module.variable(BUCKET_COLLECTION, MARKER, lambda: jnp.zeros((), jnp.int8))
      return False
    return True


def takes_config_options(cls):
  """Let ``cls(..., mode="rank", rank=2)`` stand for ``cls(..., config=DadConfig(mode="rank",
  rank=2))``: :class:`DadConfig`'s fields that are not the module's own fields are
  keyword options (:func:`~dadjax.dad._config.config_from`), so they are written once."""
  init = cls.__init__
  own = {f.name for f in dataclasses.fields(cls)}
  options = tuple(name for name in CONFIG_FIELDS if name not in own)

  @functools.wraps(init)
  def __init__(self, *args, **kwargs):
    given = {name: kwargs.pop(name) for name in options if name in kwargs}
    if given or kwargs.get("config") is None:
      kwargs["config"] = config_from(kwargs.get("config"), **given)
    init(self, *args, **kwargs)

  cls.__init__ = __init__
  cls.CONFIG_OPTIONS = options
  return cls


@takes_config_options
class DotGeneral(nn.Module):
  """dAD as a ``dot_general_cls``: synchronizes the kernel of the layer that calls it.

  Pass it (or a ``functools.partial`` with a config or options) where Flax
  takes a dot_general class::

      dg = functools.partial(dadjax.dad.DotGeneral, mode="rank", rank=2)
      nn.Dense(64, dot_general_cls=dg)
      nn.DenseGeneral((4, 16), axis=-1, dot_general_cls=dg)
      nn.MultiHeadDotProductAttention(4, qkv_dot_general_cls=dg, out_dot_general_cls=dg)

  Called as ``dot_general(lhs, rhs, dimension_numbers, precision=None,
  preferred_element_type=None)`` (lhs: the input, rhs: the kernel; see
  :func:`~dadjax.dad.dot_general`), or as an einsum ``dot_general(equation,
  input, kernel)`` for a module of one's own (``jnp.einsum``'s equations
  with two operands, no ellipsis). The module keeps the kernel's state in
  ``"dad_state"`` under ``"dad_kernel"`` (none for ``mode="local"``) and
  sows the bits its backward pass sends into ``"comm"`` (as
  :class:`~dadjax.dad.Dense` does). :func:`~dadjax.dad.layer_mask` marks the
  parent's ``kernel`` parameter; the bias, added by the parent outside the
  dot_general, goes to :func:`~dadjax.dad.synchronize`'s ``other``.

  Attributes:
    config: the :class:`~dadjax.dad.DadConfig` (default: its defaults); its
      fields are also keyword options (``DotGeneral(mode="rank", rank=2)``).
      The seed is combined with the module's path; a call's ``precision``
      overrides the config's.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """

  config: DadConfig = DadConfig()

  @nn.compact
  def __call__(self, lhs, rhs, dimension_numbers=None, precision=None,
               preferred_element_type=None, out_sharding=None):
    if out_sharding is not None:
      raise ValueError("out_sharding: dadjax.dad.DotGeneral runs inside the site program "
                       "(shard_map); pass out_sharding=None")
    if isinstance(lhs, str):  # einsum(equation, input, kernel)
      return einsum_dot(self._dot, lhs, rhs, dimension_numbers, precision,
                        preferred_element_type)
    if dimension_numbers is None:
      raise ValueError("dimension_numbers: required, ((lhs_contracting, rhs_contracting), "
                       "(lhs_batch, rhs_batch))")
    return self._dot(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type)

  def layer_config(self, precision=None) -> DadConfig:
    """The config this layer runs: its seed combined with its path, the call's precision."""
    seeded = dataclasses.replace(self.config, seed=layer_seed(self.config.seed, self.path))
    return with_precision(seeded, precision)

  def _dot(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    return layer_output(LinenHost(self, KERNEL_STATE_NAME), lhs, rhs, dimension_numbers,
                        self.layer_config(precision),
                        preferred_element_type=preferred_element_type)


@takes_config_options
class Dense(nn.Dense):
  """``flax.linen.Dense`` that synchronizes itself in the backward pass (kernel and bias).

  Same parameters (``kernel`` (d_in, features), ``bias`` (features,)), same
  fields, default initializers and call ``Dense(features, use_bias=True,
  kernel_init=..., name=...)(x)`` on ``x`` (..., d_in); its contraction and
  bias take dAD's route (:mod:`dadjax.dad._layer`), configured by ``config``
  (or its fields as keyword options: ``Dense(64, mode="rank", rank=2)``).
  The layer keeps its state in the ``"dad_state"`` collection (none for
  ``mode="local"``) and sows the bits it sends as
  :class:`~dadjax.comm.Bits` into ``"comm"`` (``gather_bits`` /
  ``reduce_bits``, with ``gather_calls`` / ``reduce_calls``: int8 zeros
  whose size is the number of collective calls), which the train step
  forwards to the optimizer. Applied without a ``dad_state`` (e.g.
  evaluation with params only) the layer uses a fresh, transient state. The
  state's ``step`` is an int32 counter the layer only reads; whoever
  differentiates ``"dad_state"`` (the train step does) uses
  ``allow_int=True`` and stores :func:`~dadjax.dad.next_state` of the old
  state and the cotangent.

  With ``capture=True`` the layer exposes its rows for research: the input
  ``A`` is sown into ``"intermediates"`` as ``inputs``, and the output is
  passed through ``self.perturb("outputs", y)``, so the gradient with
  respect to the ``"perturbations"`` collection is ``D`` (same shape as
  ``y``). Outside ``nn.scan`` only (scan would need those collections in
  its ``variable_axes``).

  Attributes:
    features, use_bias, dtype, param_dtype, precision, kernel_init,
    bias_init, promote_dtype: ``flax.linen.Dense``'s (``precision`` is also
      the route's matmul precision). ``dot_general`` / ``dot_general_cls``
      are the route's own and must stay ``None``.
    config: the :class:`~dadjax.dad.DadConfig` (default: its defaults). The
      seed is combined with the layer's path, so layers draw different
      starts (and rounding noise); under Accordion (``rank_low``) the bits
      the layer reports follow the rank it runs at this step.
    capture: expose ``A`` and ``D`` (above). Default False.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """

  config: DadConfig = DadConfig()
  capture: bool = False

  def __post_init__(self):
    check_int("features", self.features, 1)
    if self.dot_general is not None or self.dot_general_cls is not None:
      raise ValueError("dot_general / dot_general_cls: dadjax.dad.Dense contracts by dAD's "
                       "route; use flax.linen.Dense(dot_general_cls=dadjax.dad.DotGeneral) "
                       "for a bias outside the route")
    super().__post_init__()

  def layer_config(self) -> DadConfig:
    """The config this layer runs: its seed combined with its path, its precision."""
    seeded = dataclasses.replace(self.config, seed=layer_seed(self.config.seed, self.path))
    return with_precision(seeded, self.precision)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], self.features),
                        self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    inputs, kernel, bias = self.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    if self.capture:
      self.sow("intermediates", "inputs", inputs)
    y = layer_output(LinenHost(self, STATE_NAME), inputs, kernel,
                     (((inputs.ndim - 1,), (0,)), ((), ())), self.layer_config(), bias=bias)
    if self.capture:
      y = self.perturb("outputs", y)
    return y
