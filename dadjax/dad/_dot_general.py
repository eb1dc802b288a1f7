"""dAD as a ``dot_general`` function: any contraction of an input with a kernel.

Flax's layers take the contraction as an argument: ``nn.Dense`` and
``nn.DenseGeneral`` take ``dot_general_cls``, ``nn.MultiHeadDotProductAttention``
takes ``qkv_dot_general_cls`` and ``out_dot_general_cls``, ``nnx.Linear`` and
``nnx.LinearGeneral`` take ``dot_general`` and ``nnx.Einsum`` takes
``einsum_op`` (the injection point Flax's fp8 training uses). The layers
:class:`~dadjax.dad.DotGeneral` (linen) and :class:`~dadjax.dad.NnxDotGeneral`
plug dAD in there through :func:`dot_general` (here) and the one layer route
(:mod:`dadjax.dad._layer`): the backward pass synchronizes the layer's *kernel*
gradient over the sites by the route of its :class:`~dadjax.dad.DadConfig`
(exact gather, rank-dAD one-/two-way with warm start and error feedback,
quantized, auto), and keeps the route's state in the ``"dad_state"``
collection, next to the layer (entry ``"dad_kernel"``).

Any contraction ``lax.dot_general(lhs, rhs, ((lc, rc), (lb, rb)))`` of an
input ``lhs`` with a kernel ``rhs`` is a dense layer on a canonical view
(:class:`Contraction`): rows ``A`` = ``lhs``'s free axes flattened (n), the
contracted axes flattened (d_in), the kernel's free axes flattened (d_out):
``y = A K`` with ``K`` (d_in, d_out). Batch axes (``lb``, ``rb``: one kernel
per batch entry, e.g. ``DenseGeneral(batch_dims=...)``) are mapped with
``vmap``: each entry is its own layer, with its own state entry (the state
carries the batch axes in front) and its own payload, all sent by one
collective. The output keeps ``dot_general``'s layout (batch, lhs free, rhs
free), so the layer's bias and reshapes are untouched.

The bias of a Flax layer is added *outside* the dot_general, so its
gradient is not part of the route: :func:`~dadjax.dad.layer_mask` marks the
kernel only, and :func:`~dadjax.dad.synchronize` all-reduces the bias with
the other parameters (d_out numbers per layer). :class:`~dadjax.dad.Dense`
keeps the bias inside the route (exact, from ``D``'s column sums, no extra
collective).

Only contractions of an input with a *parameter* belong here: the
operand's gradient is the local one, the kernel's the synchronized one.
Attention's ``q k^T`` and ``p v`` have no parameter (Flax does not route
them through ``qkv_dot_general_cls``).

References:
  Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
  Differentiation" (https://arxiv.org/abs/2102.09631).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from dadjax.dad._config import DadConfig
from dadjax.dad._state import init_state
from dadjax.dad._vjp import _dense

# The "dad_state" entry of a dot_general: the state of its parent's ``kernel``.
KERNEL_STATE_NAME = "dad_kernel"
KERNEL_PARAM = "kernel"


def _axes(axes: Sequence[int], ndim: int, name: str) -> tuple[int, ...]:
  out = tuple(int(a) % ndim if -ndim <= int(a) < ndim else None for a in axes)
  if None in out or len(set(out)) != len(out):
    raise ValueError(f"dimension_numbers: {name} axes {tuple(axes)} must be distinct axes of an "
                     f"array of rank {ndim}")
  return out


class Contraction(NamedTuple):
  """The dense-layer view of ``lax.dot_general(lhs, rhs, dimension_numbers)``.

  ``lhs`` -> rows ``(*batch, rows, d_in)``, ``rhs`` -> kernel
  ``(*batch, d_in, d_out)`` (``batch`` empty without batch axes), output
  ``(*batch, rows, d_out)`` reshaped to ``out_shape`` (dot_general's layout).
  """

  lhs_perm: tuple[int, ...]
  rhs_perm: tuple[int, ...]
  batch_shape: tuple[int, ...]
  rows: int
  d_in: int
  d_out: int
  out_shape: tuple[int, ...]

  @property
  def batch(self) -> int:
    return math.prod(self.batch_shape)

  def operands(self, lhs, rhs):
    """``(A, K)`` in the canonical layout (a leading batch axis when there is one)."""
    lead = (self.batch,) if self.batch_shape else ()
    a = jnp.transpose(lhs, self.lhs_perm).reshape(lead + (self.rows, self.d_in))
    k = jnp.transpose(rhs, self.rhs_perm).reshape(lead + (self.d_in, self.d_out))
    return a, k

  def structs(self, lhs_dtype, rhs_dtype):
    """Abstract ``(A, K)`` of one batch entry (what one vmapped layer sees)."""
    dtype = jnp.result_type(lhs_dtype, rhs_dtype)
    return (jax.ShapeDtypeStruct((self.rows, self.d_in), dtype),
            jax.ShapeDtypeStruct((self.d_in, self.d_out), dtype))


def contraction(lhs_shape, rhs_shape, dimension_numbers) -> Contraction:
  """The canonical :class:`Contraction` of a ``dot_general`` on these shapes.

  Raises:
    ValueError: for malformed ``dimension_numbers`` or mismatched sizes.
  """
  try:
    (lc, rc), (lb, rb) = dimension_numbers
  except (TypeError, ValueError) as e:
    raise ValueError("dimension_numbers must be ((lhs_contracting, rhs_contracting), "
                     f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}") from e
  ln, rn = len(lhs_shape), len(rhs_shape)
  lc, rc = _axes(lc, ln, "lhs contracting"), _axes(rc, rn, "rhs contracting")
  lb, rb = _axes(lb, ln, "lhs batch"), _axes(rb, rn, "rhs batch")
  if len(lc) != len(rc) or len(lb) != len(rb) or set(lc) & set(lb) or set(rc) & set(rb):
    raise ValueError(f"dimension_numbers {dimension_numbers!r} do not pair the axes of lhs "
                     f"{tuple(lhs_shape)} and rhs {tuple(rhs_shape)}")
  for (i, j) in list(zip(lc, rc)) + list(zip(lb, rb)):
    if lhs_shape[i] != rhs_shape[j]:
      raise ValueError(f"dimension_numbers pair lhs axis {i} (size {lhs_shape[i]}) with rhs "
                       f"axis {j} (size {rhs_shape[j]})")
  lf = tuple(i for i in range(ln) if i not in lc and i not in lb)
  rf = tuple(i for i in range(rn) if i not in rc and i not in rb)
  batch_shape = tuple(lhs_shape[i] for i in lb)
  lf_shape = tuple(lhs_shape[i] for i in lf)
  rf_shape = tuple(rhs_shape[i] for i in rf)
  return Contraction(lb + lf + lc, rb + rc + rf, batch_shape, math.prod(lf_shape),
                     math.prod(lhs_shape[i] for i in lc), math.prod(rf_shape),
                     batch_shape + lf_shape + rf_shape)


def init_kernel_state(config: DadConfig, c: Contraction) -> dict[str, jax.Array] | None:
  """The ``"dad_kernel"`` entry of a contraction: :func:`~dadjax.dad.init_state` of
  the canonical layer, with the batch axes in front when there are any."""
  state = init_state(config, c.d_in, c.d_out)
  if state is None or not c.batch_shape:
    return state
  return jax.tree.map(lambda v: jnp.broadcast_to(v, (c.batch,) + v.shape), state)


def with_precision(config: DadConfig, precision: Any) -> DadConfig:
  """``config`` with the call's ``precision`` (``None``: the config's own)."""
  if precision is not None and precision != config.precision:
    config = dataclasses.replace(config, precision=precision)
  return config


def _config(config, options, precision) -> DadConfig:
  if config is None:
    config = DadConfig(**options)
  elif options:
    raise ValueError(f"pass either config or options, not both: {sorted(options)}")
  return with_precision(config, precision)


def dot_general(
    lhs: jax.Array,
    rhs: jax.Array,
    dimension_numbers,
    precision: Any = None,
    preferred_element_type: Any = None,
    *,
    state: dict[str, jax.Array] | None = None,
    config: DadConfig | None = None,
    **options,
) -> jax.Array:
  """``lax.dot_general(lhs, rhs, dimension_numbers)`` whose backward pass synchronizes ``rhs``.

  ``lhs`` is the input (its gradient stays local), ``rhs`` the kernel (its
  gradient is synchronized over ``axis_name`` by the configured route, as
  :func:`~dadjax.dad.dense` does for ``x @ kernel``). The functional form
  of :class:`DotGeneral`, with the state passed explicitly.

  Args:
    lhs: the input; its free axes are rows, its contracting axes features.
    rhs: the kernel.
    dimension_numbers: ``((lhs_contracting, rhs_contracting), (lhs_batch,
      rhs_batch))`` as for ``lax.dot_general``.
    precision: matmul precision (overrides the config's).
    preferred_element_type: output dtype (the output is cast to it).
    state: the kernel's state, :func:`init_kernel_state` of the
      :func:`contraction` (leading batch axes when there are batch axes), or
      ``None`` (no warm start, error feedback or Accordion; step 0).
    config: a :class:`~dadjax.dad.DadConfig`, or its fields as ``options``.

  Returns:
    The contraction, in ``lax.dot_general``'s output layout.

  Raises:
    ValueError: for bad options or dimension numbers, or state options
      without a state.
  """
  config = _config(config, options, precision)
  if state is None and (config.warm_start or config.error_feedback
                        or config.rank_low is not None):
    raise ValueError("state: warm_start, error_feedback and rank_low need the kernel state "
                     "(init_kernel_state(config, contraction(...)))")
  c = contraction(jnp.shape(lhs), jnp.shape(rhs), dimension_numbers)
  y = contract(c, lhs, rhs, None, state, config)
  return y if preferred_element_type is None else y.astype(preferred_element_type)


def contract(c: Contraction, lhs, rhs, bias, state, config: DadConfig) -> jax.Array:
  """The dAD contraction of ``lhs`` and ``rhs`` in ``c``'s view, plus ``bias`` (d_out,).

  The kernel's gradient (and the bias's, exact from ``D``'s column sums)
  is synchronized by the config's route; batch axes are mapped with
  ``vmap`` (each entry its own layer; no bias then). Output in
  ``lax.dot_general``'s layout.
  """
  a, k = c.operands(lhs, rhs)
  if c.batch_shape:
    if bias is not None:
      raise ValueError("bias: a dAD contraction with batch axes adds no bias in its route")
    run = jax.vmap(lambda a, k, s: _dense(a, k, None, s, config),
                   in_axes=(0, 0, None if state is None else 0))
    y = run(a, k, state)
  else:
    y = _dense(a, k, bias, state, config)
  return y.reshape(c.out_shape)


def einsum_contraction(equation: str, lhs_shape, rhs_shape):
  """A two-operand einsum ``input, kernel -> out`` as a ``dot_general``.

  Returns ``(lhs_sum, rhs_sum, dimension_numbers, out_perm)``: axes each
  operand sums out first (letters found in it only, and not in the output),
  the dot_general's dimension numbers on the summed operands, and the
  permutation from the dot_general's layout (batch, lhs free, rhs free) to
  the equation's output.

  Raises:
    ValueError: for anything but an explicit two-operand equation without
      ellipses or repeated letters within an operand.
  """
  eq = equation.replace(" ", "")
  if "->" not in eq or eq.count(",") != 1 or "." in eq:
    raise ValueError(f"einsum: the equation must be explicit ('...->...') with exactly two "
                     f"operands (input, kernel) and no ellipsis, got {equation!r}")
  ins, out = eq.split("->")
  a, b = ins.split(",")
  if (len(set(a)) != len(a) or len(set(b)) != len(b) or len(set(out)) != len(out)
      or set(out) - set(a + b)):
    raise ValueError(f"einsum: repeated letters within an operand or output letters found in no "
                     f"operand are not supported, got {equation!r}")
  if len(a) != len(lhs_shape) or len(b) != len(rhs_shape):
    raise ValueError(f"einsum: {equation!r} does not match operands of rank {len(lhs_shape)} "
                     f"and {len(rhs_shape)}")
  lhs_sum = tuple(i for i, ch in enumerate(a) if ch not in b and ch not in out)
  rhs_sum = tuple(i for i, ch in enumerate(b) if ch not in a and ch not in out)
  a2 = "".join(ch for i, ch in enumerate(a) if i not in lhs_sum)
  b2 = "".join(ch for i, ch in enumerate(b) if i not in rhs_sum)
  batch = [ch for ch in a2 if ch in b2 and ch in out]
  contract = [ch for ch in a2 if ch in b2 and ch not in out]
  dims = ((tuple(a2.index(ch) for ch in contract), tuple(b2.index(ch) for ch in contract)),
          (tuple(a2.index(ch) for ch in batch), tuple(b2.index(ch) for ch in batch)))
  result = batch + [ch for ch in a2 if ch not in b2] + [ch for ch in b2 if ch not in a2]
  return lhs_sum, rhs_sum, dims, tuple(result.index(ch) for ch in out)


def einsum_dot(dot, equation, lhs, rhs, precision=None, preferred_element_type=None):
  """``jnp.einsum(equation, lhs, rhs)`` computed by ``dot`` (a ``dot_general``):
  what an einsum-calling layer (``nnx.Einsum``, a module of one's own) hands a dAD layer."""
  lhs_sum, rhs_sum, dims, perm = einsum_contraction(equation, jnp.shape(lhs), jnp.shape(rhs))
  if lhs_sum:
    lhs = jnp.sum(lhs, axis=lhs_sum)
  if rhs_sum:
    rhs = jnp.sum(rhs, axis=rhs_sum)
  y = dot(lhs, rhs, dims, precision=precision, preferred_element_type=preferred_element_type)
  return jnp.transpose(y, perm)
