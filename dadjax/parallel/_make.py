"""One SPMD training step for every method and every placement.

The step is written once, as the program of a single site
(:mod:`dadjax.parallel._program`): compute the local gradient (or let a
batch stage compute it), hand it to the optax transformation (which performs
the collective over ``axis_name``), apply the update. A placement
(:mod:`dadjax.parallel._placement`: ``Vmap(n)``, ``Pmap(n)``,
``Mesh(mesh, shard_params=...)``, or the backend strings ``"vmap"``,
``"pmap"``, ``"shard_map"``) runs that program on every site. Keys:
:mod:`dadjax.parallel._state`; collections: :mod:`dadjax.parallel._gradient`.

Sites of several devices (a mesh with axes besides ``axis_name``, e.g.
``make_mesh(sites=2, per_site=4)`` or ``make_mesh(sites=2, inner={"fsdp": 2,
"model": 2})``): the program is manual over ``axis_name`` only and every
other axis is GSPMD's (:class:`~dadjax.parallel.Mesh`). The global batch is
split site-major over ``axis_name`` and each site's rows again over
``batch_axes`` (default: every in-site axis). Parameters keep the sharding
the model declares (``nn.with_partitioning``, ``nn.with_logical_partitioning``
with ``rules``, NNX sharding metadata), or ``param_specs``, or FSDP with
``shard_params=True`` (:mod:`dadjax.parallel._layout`); optimizer-state
leaves that mirror a parameter follow it. The site program sees the site's
whole (logical) arrays, so every method trains a sharded model exactly as
it trains the replicated one on a 1-D mesh of the same sites (up to float
reduction order), and the ledger books per site what crosses the site axis.
The in-site collectives XLA inserts are read from the compiled program
(:meth:`TrainStep.collectives` with ``link="intra"``; ``comm.report`` with
``step=`` and ``batch=`` reports them as ``intra_*``).
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import optax

from dadjax._core.protocols import CollectionRule, resolve_rules
from dadjax._core.layers import stacked_layers
from dadjax.comm import COMM_COLLECTION
from dadjax.parallel._gradient import _split_aux
from dadjax.parallel._losses import (LossFn, MetricsFn, classification_loss, compute_in,
                                     default_metrics)
from dadjax.parallel._placement import placement_of
from dadjax.parallel._program import Recipe, site_program
from dadjax.parallel._step import DEFAULT_MUTABLE, TrainStep
from dadjax._core.protocols import BatchStage


def _check_names(name: str, names, reserved, allowed=None) -> tuple[str, ...]:
  if isinstance(names, str):
    raise ValueError(f"{name} must be a sequence of collection names, got the string {names!r}")
  names = tuple(names)
  bad = [n for n in names if not isinstance(n, str) or n in reserved]
  if bad:
    raise ValueError(f"{name}: {bad} cannot be listed; the step handles {reserved} itself")
  if allowed is not None and not set(names) <= set(allowed):
    raise ValueError(f"{name} must be a subset of mutable={allowed}, got {names}")
  return names


def _collection_names(mutable, average, collections) -> tuple[tuple[str, ...], tuple[str, ...]]:
  """``mutable`` and ``average`` checked: no ``"params"``, ``"comm"`` or differentiated collection."""
  registered = resolve_rules((), (), collections)
  reserved = ("params", COMM_COLLECTION, *(k for k, r in registered.items() if r.differentiate))
  mutable = _check_names("mutable", mutable, reserved)
  return mutable, _check_names("average", average, reserved, mutable)


def _step_loss(model, loss_fn: LossFn | None, compute_dtype) -> LossFn:
  """The loss the step differentiates: the given one or the model's, computed in ``compute_dtype``."""
  loss_fn = classification_loss(model) if loss_fn is None else loss_fn
  if compute_dtype is None:
    return loss_fn
  if not jnp.issubdtype(jnp.dtype(compute_dtype), jnp.floating):
    raise ValueError(f"compute_dtype must be a floating dtype (e.g. jnp.bfloat16), got "
                     f"{compute_dtype!r}")
  return compute_in(loss_fn, compute_dtype)


def _nnx_model(model, collections: Sequence[str]):
  """An ``nnx.Module`` wrapped by :class:`dadjax.nnx.Model` (which knows no family: its
  collections are the registered rules' and ``collections``); any other model as it is."""
  nnx = sys.modules.get("flax.nnx")  # an NNX module exists only once flax.nnx is imported
  if nnx is None or not isinstance(model, nnx.Module):
    return model
  from dadjax.nnx import Model  # pylint: disable=g-import-not-at-top
  return Model(model, collections)


def _eval_fn(loss_fn, metrics_fn):

  @jax.jit
  def eval_fn(params, model_state, batch):
    value, aux = loss_fn(params, model_state, batch, jax.random.key(0), False)
    return {"loss": value, **metrics_fn(_split_aux(aux)[0], batch)}

  return eval_fn


def make_train_step(
    model,
    tx: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    metrics_fn: MetricsFn | None = None,
    mutable: Sequence[str] = DEFAULT_MUTABLE,
    average: Sequence[str] = DEFAULT_MUTABLE,
    batch_stage: BatchStage | None = None,
    num_sites: int | None = None,
    axis_name: str = "data",
    backend: Any = "shard_map",
    mesh=None,
    shard_params: bool = False,
    param_specs: Any = None,
    rules: Any = None,
    batch_axes: Sequence[str] | None = None,
    layer_axes: Mapping[str, int] | None = None,
    compute_dtype: Any = None,
    donate: bool = False,
    collections: Mapping[str, CollectionRule] | None = None,
    allow_local: bool = False,
    check_ledger: bool = True,
) -> TrainStep:
  """Build the jitted SPMD training step.

  Long because of its docstring (every argument); the checks are module-level functions.

  Args:
    model: a Flax linen module (``init`` and the default loss use it), or
      an ``nnx.Module``, wrapped by :class:`dadjax.nnx.Model` (its
      ``nnx.Param`` are the parameters, ``nnx.BatchStat`` the
      ``"batch_stats"``; the module is not modified).
    tx: any optax transformation; a dadjax communicating transformation in
      it (``dadjax.allreduce(axis_name)``, a compressor, dAD's sync) does the
      collective. A plain optax optimizer alone leaves sites unsynchronized.
    loss_fn: ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)``
      (:mod:`dadjax.parallel._losses`); default ``classification_loss(model)``.
    metrics_fn: ``metrics_fn(aux, batch) -> dict`` of scalars, averaged over
      sites with ``"loss"``; default :func:`default_metrics`.
    mutable: collections the model updates in training, replaced by what the
      loss returns (default ``("batch_stats",)``; absent ones are ignored).
      Each must exist after ``model.init``, except the default's.
    average: of ``mutable``, the collections averaged over the sites after
      every step (one metered ``pmean``, booked in ``TrainState.comm``);
      default ``("batch_stats",)``; ``()`` keeps them per site. BatchNorm
      normalizes with the site's own batch statistics in training and with
      the running averages in evaluation.
    batch_stage: a :class:`~dadjax.stage.BatchStage` that computes the
      gradient from the site's batch (data-side methods); ``None``: the plain
      backward pass on the site's rows.
    num_sites: number of sites; default: the mesh size (shard_map), the
      local device count (pmap), required for vmap.
    axis_name: the axis the collectives name; default ``"data"``.
    backend: ``"shard_map"``, ``"pmap"``, ``"vmap"``, or a placement
      (``Vmap(n)``, ``Pmap(n)``, ``Mesh(mesh, shard_params=...)``).
    mesh: the shard_map mesh (default: :func:`make_mesh`, 1-D); a mesh with
      more axes than ``axis_name`` makes each site a group of devices (module
      docstring). ``pmap`` and ``vmap`` run one device per site.
    shard_params: on a mesh with in-site axes, FSDP for the parameters
      that declare no sharding (module docstring).
    param_specs: in-site ``PartitionSpec`` of each parameter (a tree, a
      prefix of one, or ``params -> specs``); ``None``: the model's metadata.
    rules: logical axis rules (``(name, mesh axes)`` pairs) for logically
      partitioned parameters and activations; ``None``: the active
      ``nn.logical_axis_rules``.
    batch_axes: the in-site axes a site's rows are split over (default:
      all of them).
    layer_axes: ``{leaf path: axis}`` of parameters that stack layers (a
      scanned block's kernels); ``None``: read at ``init`` from the model's
      partitioning names (``"layers"``, as ``nn.scan(...,
      metadata_params={nn.PARTITION_NAME: "layers"})`` records it); ``{}``:
      none. Communicating transformations treat each layer as a tensor
      (:func:`dadjax.stacked_layers`).
    compute_dtype: e.g. ``jnp.bfloat16``: the model computes in it from fp32
      master weights, gradients arrive in fp32 and every method averages
      them in fp32 (:func:`~dadjax.parallel._losses.compute_in`); ``None``:
      the parameters' dtype.
    donate: donate the input state's buffers to the output.
    collections: ``{name: CollectionRule}`` adding to or overriding the
      registered rules (:mod:`dadjax._core.protocols`) for this step.
    allow_local: train without a communicating transformation while
      ``num_sites > 1`` (the sites train apart, on purpose); default
      ``False`` refuses it.
    check_ledger: on the first step of each state layout, compare the
      program's collective bits with what the ledgers booked and raise if
      traffic went unbooked (:meth:`TrainStep.ledger_check`; one lowering of
      the program, no second compilation; skipped under ``vmap``, whose
      program has no collective ops).

  Refused setups (:mod:`dadjax.parallel._checks`, each error names the fix):
  ``optax.MultiSteps`` around a communicating transformation (use
  :func:`dadjax.accumulate`), no communicating transformation with several
  sites, a communicating transformation after a per-site stateful one, a
  model that communicates in its backward pass (dAD layers) without a
  transformation booking it, a collective on an axis the step does not
  have.

  Returns:
    A :class:`TrainStep`.

  Raises:
    ValueError: for an unknown backend, a bad ``num_sites``, an axis not in
      the mesh, a mesh with ``pmap`` / ``vmap``, ``shard_params`` without
      in-site axes, ``batch_axes`` not in-site axes, or ``mutable`` / ``average`` naming
      ``"params"``, ``"comm"`` or a differentiated collection (``average``
      must be a subset of ``mutable``).
  """
  mutable, average = _collection_names(mutable, average, collections)
  # an nnx.Module: through dadjax.nnx.Model (nnx.split / merge), with the step's collections
  model = _nnx_model(model, (*mutable, *(collections or {})))
  if batch_stage is not None and not isinstance(batch_stage, BatchStage):
    raise ValueError(f"batch_stage must be a dadjax.stage.BatchStage or None, got {batch_stage!r}")
  placement = placement_of(backend, num_sites, mesh, shard_params, axis_name,
                           param_specs=param_specs, rules=rules,
                           batch_axes=None if batch_axes is None else tuple(batch_axes))
  for name, flag in (("allow_local", allow_local), ("check_ledger", check_ledger)):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}")
  rules = resolve_rules(mutable, average, collections)
  loss_fn = _step_loss(model, loss_fn, compute_dtype)
  metrics_fn = default_metrics if metrics_fn is None else metrics_fn
  layers = {} if layer_axes is None else dict(layer_axes)
  with stacked_layers(layers):  # checks the map
    pass
  recipe = Recipe(tx, loss_fn, metrics_fn, rules, batch_stage, axis_name, placement.num_sites,
                  allow_local, layers)
  run = placement.compile(site_program(recipe), donate)
  return TrainStep(model, tx, loss_fn, metrics_fn, placement, rules, batch_stage, run,
                   _eval_fn(loss_fn, metrics_fn), mutable, average, allow_local, check_ledger,
                   layer_axes=layers, fixed_layer_axes=layer_axes is not None)
