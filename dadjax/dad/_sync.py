"""Optimizer side of dAD: synchronize the other parameters, keep the ledger.

dAD layers synchronize their own gradients inside the backward pass; every
other parameter (LayerNorm, embeddings, convolutions, positional
embeddings, ``mode="local"`` dense layers) still has to be synchronized, by
an all-reduce or a compressor. :func:`synchronize` does both halves of the
bookkeeping: it passes the dAD leaves through, hands the rest to ``other``,
and records the bits the layers reported (the ``model_comm`` extra argument
the train step forwards from the ``"comm"`` collection) in its ledger.

Which leaves are dAD layers is read from the variables, not guessed from
names: a layer owns a ``"dad_state"`` entry exactly when its backward pass
synchronizes its gradient (:func:`layer_mask`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from dadjax.comm import (Bits, CommStats, allreduce, bits_add, bits_reduce, bits_zero, host_array,
                         ledger_init, ledger_record, tree_dense_bits)
from dadjax.comm import STATE_COLLECTION
from dadjax.dad._cost import choose_route, route_traffic
from dadjax.dad._dot_general import (KERNEL_PARAM, KERNEL_STATE_NAME, contraction,
                                     einsum_contraction)
from dadjax.dad._module import Dense, DotGeneral
from dadjax.dad._state import STATE_NAME, init_state
from dadjax._core.trees import SpecMemo, check_axis_name, path_names

MaskLike = Any | Callable[[Any], Any]


def _init_shapes(model: nn.Module, args, kwargs):
  return jax.eval_shape(lambda: model.init(jax.random.key(0), *args, **kwargs))


def layer_mask(model_or_variables: nn.Module | dict, *sample_args, **sample_kwargs) -> Any:
  """Which parameters belong to dAD layers that synchronize themselves.

  A parameter is marked when its module owns a ``"dad"`` entry in
  ``"dad_state"`` (every :class:`~dadjax.dad.Dense` except
  ``mode="local"``), and a layer's ``kernel`` when the layer's
  :class:`~dadjax.dad.DotGeneral` owns a ``"dad_kernel"`` entry (its bias
  is not marked: the route carries the kernel only). Nothing is
  run: the variables' shapes come from ``jax.eval_shape(model.init, ...)``.

  Args:
    model_or_variables: a Flax module (then ``sample_args`` are its inputs),
      or a variables dict ``{"params": ..., "dad_state": ...}`` (e.g.
      ``{"params": state.params, **state.model_state}``).
    *sample_args: example inputs for ``model.init``.
    **sample_kwargs: keyword inputs for ``model.init``.

  Returns:
    A pytree of Python bools with the structure of ``params``.
  """
  if isinstance(model_or_variables, nn.Module):
    variables = _init_shapes(model_or_variables, sample_args, sample_kwargs)
  else:
    variables = model_or_variables
  owners, kernels = state_owners(variables.get(STATE_COLLECTION, {}))
  return jax.tree_util.tree_map_with_path(
      lambda path, _: _marked(path_names(path), owners, kernels), variables["params"])


def state_owners(dad_state: Any) -> tuple[set, set]:
  """``(layers, kernels)`` synchronized by their backward pass, read from ``"dad_state"``.

  ``layers``: paths of modules owning a ``"dad"`` entry (:class:`Dense`:
  all their parameters); ``kernels``: paths of the ``kernel`` parameters
  whose dot_general owns a ``"dad_kernel"`` entry (the dot_general's parent
  holds the kernel).
  """
  owners, kernels = set(), set()
  for path, _ in jax.tree_util.tree_flatten_with_path(dad_state)[0]:
    names = path_names(path)
    if STATE_NAME in names:
      owners.add(names[:names.index(STATE_NAME)])
    elif KERNEL_STATE_NAME in names:
      kernels.add(names[:names.index(KERNEL_STATE_NAME)][:-1] + (KERNEL_PARAM,))
  return owners, kernels


def _marked(names, owners, kernels) -> bool:
  return names[:-1] in owners or names in kernels


class LayerPlan(NamedTuple):
  """One dAD layer call as planned at trace time (per site, per use)."""

  path: str
  mode: str
  route: str
  rows: int
  d_in: int
  d_out: int
  gather_bits: int
  reduce_bits: int
  dense_bits: int


def layer_plan(model: nn.Module, *sample_args, num_sites: int | None = None,
               **sample_kwargs) -> list[LayerPlan]:
  """The route and bits of every dAD layer call for these inputs.

  Covers :class:`~dadjax.dad.Dense` layers and every layer that calls a
  :class:`~dadjax.dad.DotGeneral` (``nn.Dense`` / ``nn.DenseGeneral`` /
  attention projections with ``dot_general_cls``, einsums); a dot_general
  is listed under the path of the layer that holds its kernel, with the
  rows, d_in and d_out of its canonical view (one batch entry; the bits
  cover all entries) and ``dense_bits`` of the kernel alone (its bias is
  all-reduced with the other parameters).

  Shows what ``mode="auto"`` picks per layer (``"gather"`` = exact dAD,
  ``"allreduce"``) for a given batch shape and number of sites:
  ``sample_args`` must have the per-site batch shape. Calls inside
  ``nn.scan`` are listed once, with the rows of one time step (they run
  once per step). Nothing is computed: the bits are those of the payloads
  the backward pass builds (:func:`~dadjax.dad.layer_traffic`) on the
  layer's promoted operands, evaluated abstractly.

  Args:
    model: a Flax module built with dAD dense layers.
    *sample_args: per-site inputs (arrays or ``jax.ShapeDtypeStruct``).
    num_sites: ``N`` the routes are chosen for (``"auto"`` compares wire
      bits at ``N``). Default 1 (then ``"auto"`` compares payloads).
    **sample_kwargs: keyword inputs.

  Returns:
    One :class:`LayerPlan` per layer, in call order; ``dense_bits`` is the
    fp32 all-reduce size of the layer's kernel and bias.
  """
  plans: dict[str, LayerPlan] = {}
  n = 1 if num_sites is None else num_sites

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    if isinstance(module, Dense) and context.method_name == "__call__":
      config = module.layer_config()
      shape = jax.ShapeDtypeStruct(np.shape(args[0]), args[0].dtype)
      rows, d_in, d_out = int(np.prod(shape.shape[:-1])), shape.shape[-1], module.features
      pdt = module.param_dtype
      dtype = module.dtype or jnp.result_type(shape.dtype, pdt)  # flax's promote_dtype
      x = jax.ShapeDtypeStruct((rows, d_in), dtype)
      kernel = jax.ShapeDtypeStruct((d_in, d_out), dtype)
      bias = jax.ShapeDtypeStruct((d_out,), dtype) if module.use_bias else None
      state = (None if config.mode == "local" else
               jax.eval_shape(lambda: init_state(config, d_in, d_out)))
      plans.setdefault("/".join(module.path), _plan(
          "/".join(module.path), config, x, kernel, bias, state, n, 1,
          (d_in * d_out + (d_out if module.use_bias else 0)) * 32))
    elif (isinstance(module, DotGeneral) and context.method_name == "__call__"
          and not isinstance(args[0], str)):
      _plan_dot(module, args[0], args[1], args[2] if len(args) > 2 else
                kwargs.get("dimension_numbers"))
    elif isinstance(module, DotGeneral) and context.method_name == "__call__":
      lhs, rhs = args[1], args[2]
      lhs_sum, rhs_sum, dims, _ = einsum_contraction(args[0], np.shape(lhs), np.shape(rhs))
      drop = lambda shape, axes: tuple(s for i, s in enumerate(shape) if i not in axes)
      _plan_dot(module, jax.ShapeDtypeStruct(drop(np.shape(lhs), lhs_sum), lhs.dtype),
                jax.ShapeDtypeStruct(drop(np.shape(rhs), rhs_sum), rhs.dtype), dims)
    return next_fun(*args, **kwargs)

  def _plan_dot(module, lhs, rhs, dims):
    c = contraction(np.shape(lhs), np.shape(rhs), dims)
    config = module.layer_config()
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    x = jax.ShapeDtypeStruct((c.rows, c.d_in), dtype)
    kernel = jax.ShapeDtypeStruct((c.d_in, c.d_out), dtype)
    state = (None if config.mode == "local" else
             jax.eval_shape(lambda: init_state(config, c.d_in, c.d_out)))
    path = "/".join(module.path[:-1])  # the layer that holds the kernel
    plans.setdefault(path, _plan(path, config, x, kernel, None, state, n, c.batch,
                                 c.batch * c.d_in * c.d_out * 32))

  with nn.intercept_methods(interceptor):
    _init_shapes(model, sample_args, sample_kwargs)
  return list(plans.values())


def _plan(path, config, x, kernel, bias, state, n, times, dense_bits) -> LayerPlan:
  route = choose_route(config, x, kernel, bias, state, num_sites=n)
  if config.axis_name is None:
    gather = reduce = 0
  else:
    t = route_traffic(config, route, x, kernel, bias, state, num_sites=n)
    gather, reduce = int(t.gather) * times, int(t.reduce) * times
  return LayerPlan(path, config.mode, route, x.shape[0], x.shape[1], kernel.shape[1], gather,
                   reduce, dense_bits)


def effective_ranks(model_state: Any, *, which: str = "rank") -> dict[str, np.ndarray]:
  """Effective ranks the rank-dAD layers found in their last backward pass.

  Args:
    model_state: ``TrainState.model_state`` (or a ``"dad_state"`` tree, or
      a variables dict); stacked per site or not.
    which: ``"rank"`` (each site's local factorization) or
      ``"rank_global"`` (the two-way global result).

  Returns:
    ``{layer path: ranks}``, one value per site when the state is stacked
    (mean over the layer's uses in the step, e.g. over scanned time steps).
  """
  tree = model_state.get(STATE_COLLECTION, model_state) if isinstance(model_state, dict) else model_state
  out = {}

  def visit(node, path):
    if isinstance(node, dict):
      if "uses" in node and which in node:
        uses = host_array(node["uses"]).astype(np.float64)
        value = host_array(node[which]).astype(np.float64)
        if path and path[-1] == KERNEL_STATE_NAME:
          path = path[:-2]  # the layer that holds the kernel, not its dot_general
        elif path and path[-1] == STATE_NAME:
          path = path[:-1]
        out["/".join(path)] = np.where(
            uses > 0, value / np.where(uses > 0, uses, 1.0), 0.0)
        return
      for k, v in node.items():
        visit(v, path + (str(k),))

  visit(dict(tree), ())
  return out


def accordion_rows(model_state: Any, *, site: int = 0) -> dict:
  """Metrics-row entries of the rank-dAD layers under Accordion (``rank_low`` set).

  Args:
    model_state: ``TrainState.model_state`` (or a ``"dad_state"`` tree),
      stacked per site or not (the decisions are equal on every site).
    site: the site to read when the state is stacked.

  Returns:
    A dict with ``"accordion/critical/<layer>"`` (0 | 1, decision for the
    next step), ``"accordion/rank/<layer>"`` (the rank the last step sent)
    and ``"accordion/norm/<layer>"`` (float, last window's mean norm
    statistic); empty without such layers. ``dadjax plot`` draws the critical decisions.
  """
  row: dict = {}
  for field, key in (("critical", "critical"), ("rank_used", "rank"), ("norm", "norm")):
    for layer, values in effective_ranks(model_state, which=field).items():
      value = float(np.ravel(values)[site if np.ndim(values) else 0])
      row[f"accordion/{key}/{layer}"] = value if field == "norm" else int(round(value))
  return row


def _resolve(mask: MaskLike, tree: Any) -> Any:
  return mask(tree) if callable(mask) else mask


def _model_bits(model_comm: Any) -> tuple[Bits, Bits, int, int | None]:
  """``(gather, reduce, reduce_calls, gather_calls)`` from ``model_comm``.

  A tree of sown values (the ``"comm"`` collection) is split by sow name:
  ``reduce_bits`` / ``gather_bits`` are :class:`Bits`, ``reduce_calls`` /
  ``gather_calls`` arrays whose *size* is the number of collective calls
  behind them (a static count that survives every transformation; stacked
  by ``nn.scan``, one set of calls per step). A sown ``Bits``
  without a calls entry counts as one call. A single summed :class:`Bits`
  counts as gather bits, dAD's main collective, and the number of gather
  calls is unknown (``None``).
  """
  if model_comm is None:
    return bits_zero(), bits_zero(), 0, 0
  if isinstance(model_comm, Bits):
    return bits_reduce(model_comm), bits_zero(), 0, None
  gather, reduce = bits_zero(), bits_zero()
  counted = {"reduce": 0, "gather": 0}
  sown_calls = {"reduce": 0, "gather": 0}
  has_calls = {"reduce": False, "gather": False}
  flat = jax.tree_util.tree_flatten_with_path(model_comm, is_leaf=lambda x: isinstance(x, Bits))[0]
  for path, leaf in flat:
    names = path_names(path)
    if isinstance(leaf, Bits):
      kind = "reduce" if "reduce_bits" in names else "gather"
      if kind == "reduce":
        reduce = bits_add(reduce, bits_reduce(leaf))
      else:
        gather = bits_add(gather, bits_reduce(leaf))
      counted[kind] += int(np.size(leaf.lo))
    else:
      for kind in ("reduce", "gather"):
        if f"{kind}_calls" in names:
          has_calls[kind] = True
          sown_calls[kind] += int(np.size(leaf))
  calls = {k: sown_calls[k] if has_calls[k] else counted[k] for k in counted}
  return gather, reduce, calls["reduce"], calls["gather"]


class SynchronizeState(NamedTuple):
  """State of :func:`synchronize`: the dAD ledger and ``other``'s state."""

  BOOKS_MODEL_COMM = True  # books the dAD layers' own traffic (dadjax._core.protocols)
  comm: CommStats
  other: Any


def synchronize(
    mask: MaskLike,
    other: optax.GradientTransformation | None = None,
    *,
    axis_name: str | None = "data",
    record_model_comm: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Synchronize a dAD model's gradients: dAD leaves pass, the rest go to ``other``.

  Long because of its docstring; the code is an optax factory with init/update closures.

  Put it first in the optimizer chain, where ``dadjax.allreduce`` would go::

      mask = dadjax.dad.layer_mask(model, x_site)
      tx = optax.chain(dadjax.dad.synchronize(mask), optax.adam(1e-3))

  Leaves marked in ``mask`` were already synchronized by their layer's
  backward pass and are returned unchanged; all other leaves are
  transformed by ``other`` (nothing stays local). The ledger records the
  bits the layers reported through the ``model_comm`` extra argument
  (``dense`` = the fp32 size of the dAD leaves); ``other`` keeps its own
  ledger, and :func:`dadjax.comm_stats` sums both.

  Gradient accumulation: dAD layers communicate in every backward pass,
  i.e. on every micro-step, while the other leaves need one collective per
  optimizer step. Put :func:`dadjax.accumulate` inside and count the
  layers' bits outside it; :func:`dadjax.comm_stats` combines the two
  rates into bits per optimizer step::

      optax.chain(dadjax.dad.model_ledger(), dadjax.accumulate(
          optax.chain(synchronize(mask, record_model_comm=False), opt), k))

  (``optax.MultiSteps`` instead runs ``other``'s collective on every
  micro-step and books it once; the train step refuses it.)

  Args:
    mask: pytree of bools over the parameters (:func:`layer_mask`), or a
      callable ``params -> mask``.
    other: transformation for the non-dAD leaves; default
      ``dadjax.allreduce(axis_name)``. Any compressor works.
    axis_name: the sites' axis (used for the default ``other``).
    record_model_comm: record ``model_comm`` in this ledger (default True).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`SynchronizeState`.

  Raises:
    ValueError: at construction for a bad ``axis_name``, ``other`` or
      ``record_model_comm``; at ``update`` if the updates' structure, shapes
      or dtypes differ from the params at ``init``.

  References:
    Baker et al., "Peering Beyond the Gradient Veil with Distributed Auto
    Differentiation" (https://arxiv.org/abs/2102.09631).
  """
  axis_name = check_axis_name(axis_name)
  if other is not None and not isinstance(other, optax.GradientTransformation):
    raise ValueError(f"other must be an optax.GradientTransformation or None, got {other!r}")
  if not isinstance(record_model_comm, bool):
    raise ValueError(f"record_model_comm must be a bool, got {record_model_comm!r}")
  if mask is None:
    raise ValueError("mask must be a pytree of bools over the parameters or a callable "
                     "params -> mask (see dadjax.dad.layer_mask), got None")
  specs = SpecMemo("synchronize")
  other = allreduce(axis_name) if other is None else other
  inner = optax.masked(other, lambda tree: jax.tree.map(lambda b: not b, _resolve(mask, tree)))

  def init_fn(params):
    specs.record(params)
    return SynchronizeState(ledger_init(), inner.init(params))

  def update_fn(updates, state, params=None, *, model_comm=None, **extra_args):
    specs.check(updates)
    out, other_state = inner.update(updates, state.other, params, **extra_args)
    marked = _resolve(mask, updates)
    dad_leaves = jax.tree.leaves(jax.tree.map(lambda u, b: u if b else None, updates, marked))
    gather, reduce, reduce_calls, gather_calls = (
        _model_bits(model_comm) if record_model_comm else (0, 0, 0, 0))
    if gather_calls is None:  # summed bits: assume one collective per dAD layer
      gather_calls = len({path_names(p)[:-1]
                          for p, b in jax.tree_util.tree_flatten_with_path(marked)[0] if b})
    comm = ledger_record(state.comm, gather=gather, reduce=reduce,
                         dense=tree_dense_bits(dad_leaves), reduce_calls=reduce_calls,
                         gather_calls=gather_calls)
    return out, SynchronizeState(comm, other_state)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ModelLedgerState(NamedTuple):
  BOOKS_MODEL_COMM = True  # books the dAD layers' own traffic (dadjax._core.protocols)
  comm: CommStats


def model_ledger() -> optax.GradientTransformationExtraArgs:
  """Identity on the updates; records the ``model_comm`` bits of every call.

  For gradient accumulation, where :func:`synchronize` sits inside
  :func:`dadjax.accumulate` and sees only every k-th call (see there).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with a ledger in its state.
  """

  def init_fn(params):
    del params
    return ModelLedgerState(ledger_init())

  def update_fn(updates, state, params=None, *, model_comm=None, **extra_args):
    del params, extra_args
    gather, reduce, reduce_calls, gather_calls = _model_bits(model_comm)
    return updates, ModelLedgerState(ledger_record(state.comm, gather=gather, reduce=reduce,
                                                   reduce_calls=reduce_calls,
                                                   gather_calls=gather_calls or 0))

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
