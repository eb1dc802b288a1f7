"""The Flax face of dAD: :class:`Dense`, a drop-in for ``flax.linen.Dense``.

:class:`Dense` is the convenience over the same machinery as
:class:`~dadjax.dad.DotGeneral` (the state entry, the seed, the ledger
report of :mod:`dadjax.dad._dot_general`): a Flax ``Dense`` whose route
also carries the bias (its exact gradient from ``D``'s column sums, no
separate all-reduce), with its state under ``"dad"`` at the layer's own path.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen.dtypes import promote_dtype
from flax.linen.linear import default_kernel_init

from dadjax._core.validate import check_int
from dadjax.dad._bucket import bucketed_output
from dadjax.dad._config import DadConfig
from dadjax.dad._cost import layer_traffic
from dadjax.dad._dot_general import layer_seed, module_state, report
from dadjax.dad._state import STATE_NAME, init_state
from dadjax.dad._vjp import _dense


class Dense(nn.Module):
  """Drop-in for ``flax.linen.Dense`` that synchronizes itself in the backward pass.

  Same parameters (``kernel`` (d_in, features), ``bias`` (features,)), same
  default initializers and call ``Dense(features, use_bias=True,
  kernel_init=..., name=...)(x)`` on ``x`` (..., d_in). The extra fields
  configure distributed auto-differentiation (see :class:`DadConfig`);
  the layer keeps its state in the ``"dad_state"`` collection (none for
  ``mode="local"``) and sows the bits it sends as
  :class:`~dadjax.comm.Bits` into ``"comm"`` (``gather_bits`` /
  ``reduce_bits``, with ``gather_calls`` / ``reduce_calls``: int8 zeros
  whose size is the number of collective calls), which the train step forwards to the optimizer.
  Applied without a ``dad_state`` (e.g. evaluation with params only) the
  layer uses a fresh, transient state. The state's ``step`` is an int32
  counter the layer only reads; whoever differentiates ``"dad_state"``
  (the train step does) uses ``allow_int=True`` and stores
  :func:`~dadjax.dad.next_state` of the old state and the cotangent.

  With ``capture=True`` the layer exposes its rows for research: the input
  ``A`` is sown into ``"intermediates"`` as ``inputs``, and the output is
  passed through ``self.perturb("outputs", y)``, so the gradient with
  respect to the ``"perturbations"`` collection is ``D`` (same shape as
  ``y``). Outside ``nn.scan`` only (scan would need those collections in
  its ``variable_axes``).

  Attributes:
    features: output features.
    use_bias: add a bias. Default True.
    dtype: computation dtype (default: inferred, as in Flax).
    param_dtype: parameter dtype. Default float32.
    precision: matmul precision. Default ``None``.
    kernel_init: default ``lecun_normal()`` (Flax's).
    bias_init: default zeros.
    axis_name, mode, rank, iters, tol, aggregation, warm_start,
    error_feedback, seed, quantize_bits, power, bucket: see :class:`DadConfig` (defaults
      ``"data"``, ``"exact"``, 4, 10, 1e-3, ``"one_way"``, False, False, 0,
      None, ``"deflated"``, False). The seed is combined with the layer's path, so layers draw
      different starts (and rounding noise).
    rank_low, accordion_window, accordion_interval, accordion_eta,
    lr_schedule: rank-dAD under Accordion (see :class:`DadConfig`); the
      bits the layer reports follow the rank it runs at this step.
    capture: expose ``A`` and ``D`` (above). Default False.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  precision: Any = None
  kernel_init: Callable[..., Any] = default_kernel_init
  bias_init: Callable[..., Any] = nn.initializers.zeros_init()
  axis_name: str | None = "data"
  mode: str = "exact"
  rank: int = 4
  iters: int = 10
  tol: float = 1e-3
  aggregation: str = "one_way"
  warm_start: bool = False
  error_feedback: bool = False
  seed: int = 0
  rank_low: int | None = None
  accordion_window: int = 1
  accordion_interval: int = 1
  accordion_eta: float = 0.5
  lr_schedule: Any = None
  quantize_bits: int | None = None
  power: str = "deflated"
  bucket: bool = False
  capture: bool = False

  def __post_init__(self):
    check_int("features", self.features, 1)
    self.config()  # fail at construction, naming the bad argument
    super().__post_init__()

  def config(self, seed: int | None = None) -> DadConfig:
    """This layer's :class:`DadConfig` (``seed`` overrides the field).

    The module repeats DadConfig's fields so that ``Dense(features, rank=2)``
    works like ``nn.Dense``; the config is read from them by name, so a new
    DadConfig field needs only its module field.
    """
    fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(DadConfig)}
    if seed is not None:
      fields["seed"] = seed
    return DadConfig(**fields)

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    d_in = jnp.shape(inputs)[-1]
    kernel = self.param("kernel", self.kernel_init, (d_in, self.features), self.param_dtype)
    bias = (self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias else None)
    inputs, kernel, bias = promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    config = self.config(seed=layer_seed(self.seed, self.path))
    if self.capture:
      self.sow("intermediates", "inputs", inputs)
    y = None
    if config.bucket:  # the train step gathers A and D with every other layer's
      y = bucketed_output(self, inputs.reshape(-1, d_in), kernel, bias, config)
    if y is not None:
      y = y.reshape(inputs.shape[:-1] + (self.features,))
    else:  # the layer's own route
      state = None
      if config.mode != "local" and not config.bucket:
        state = module_state(self, STATE_NAME, init_state, config, d_in, self.features)
      y = _dense(inputs, kernel, bias, state, config)
      if config.axis_name is not None:
        # What the backward pass will hand to collectives, read from its own
        # payloads on these operands (dtype promotion, bias, typing included).
        traffic = layer_traffic(config, inputs, kernel, bias, state)
        report(self, config, traffic, kernel.shape, kernel.dtype, state)
    if self.capture:
      y = self.perturb("outputs", y)
    return y
