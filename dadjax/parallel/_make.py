"""One SPMD training step for every method and every placement.

The step is written once, as the program of a single site
(:mod:`dadjax.parallel._program`): compute the local gradient (or let a
batch stage compute it), hand it to the optax transformation (which performs
the collective over ``axis_name``), apply the update. A placement
(:mod:`dadjax.parallel._placement`: ``Vmap(n)``, ``Pmap(n)``,
``Mesh(mesh, shard_params=...)``, or the backend strings ``"vmap"``,
``"pmap"``, ``"shard_map"``) runs that program on every site. Keys:
:mod:`dadjax.parallel._state`; collections: :mod:`dadjax.parallel._gradient`.

Sites of several devices (2-D mesh, e.g. axes ``("data", "replica")``): the
global batch is split site-major over ``axis_name`` and each site's rows
again over the in-site axes (rows ``[i b, (i+1) b)`` are site ``i``'s; each
of its ``per_site`` devices takes ``b / per_site`` of them). The state keeps
one copy per site, replicated over the in-site axes. Each device computes
the gradient of its rows; the gradients, the collections updated by a rule
(``mutable`` ones, ``"dad_state"``) and the metrics are averaged exactly over
the in-site axes with one metered ``pmean`` each (booked in
``TrainState.intra_comm``, an :class:`~dadjax.comm.IntraSiteStats`, reported
as ``intra_*`` by :func:`~dadjax.comm_stats`); then the method runs over
``axis_name`` only, identically on every device of the site. Optimizer-side
methods (allreduce, every compressor) therefore see exactly the site's
averaged gradient and train like a 1-D mesh with the same sites and the same
ledger. dAD layers gather ``A`` and ``D`` over ``axis_name`` only, per
device, and the in-site ``pmean`` of the resulting gradients then sums all
rows exactly, so exact dAD equals pooled training; its inter-site payload
per device is ``b / per_site`` rows. rank-dAD factorizes each device's rows
(not the site's), so it is not the 1-D run's factorization. A batch stage
whose state depends on the device's rows is refused.

Sharded parameters (``shard_params=True``, 2-D mesh): each parameter is
split along :func:`~dadjax.parallel.shard_dims`'s dimension over the in-site
axes (:meth:`TrainStep.state_specs`), and so are the optimizer-state leaves
that mirror it. Each step all-gathers the slices within the site for the
forward pass and reduce-scatters the gradients back (both booked in
``TrainState.intra_comm``), so every device holds a slice of the site's
exact mean gradient, and the method then exchanges *its slice* over the site
axis. Supported, and equal to the replicated layout: ``allreduce``,
``identity`` / ``cast`` / ``bf16`` / ``fp16``, ``sign``, ``scaled_sign``,
``terngrad``, ``qsgd`` without ``bucket_size``, ``ef(...)`` of these, dAD and
rank-dAD layers, and elementwise optax optimizers (sgd, momentum, adam,
adamw). Methods that need a whole tensor (TopK's and RandomK's selections,
QSGD's buckets, PowerSGD's matrices, Accordion) raise a ``ValueError``
naming the method when the step is first traced; a batch stage is refused.
Optax transformations that reduce over a whole tensor or tree
(``clip_by_global_norm``, LAMB's trust ratio, Adafactor's factored moments)
would see only the device's slice: the step refuses those optax exposes
(:data:`~dadjax.parallel._checks.WHOLE_TENSOR`, found by the names of their
update functions); leave out any other such transformation.
"""

from __future__ import annotations

import sys
from typing import Any, Mapping, Sequence

import jax
import optax

from dadjax._core.collections import CollectionRule, resolve_rules
from dadjax.comm import COMM_COLLECTION
from dadjax.parallel._checks import check_sharded_tx
from dadjax.parallel._gradient import _split_aux
from dadjax.parallel._losses import LossFn, MetricsFn, classification_loss, default_metrics
from dadjax.parallel._placement import placement_of
from dadjax.parallel._program import Recipe, site_program
from dadjax.parallel._step import DEFAULT_MUTABLE, TrainStep
from dadjax.stage import BatchStage


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


def _nnx_model(model):
  """An ``nnx.Module`` wrapped by :class:`dadjax.nnx.Model`; any other model as it is."""
  nnx = sys.modules.get("flax.nnx")  # an NNX module exists only once flax.nnx is imported
  if nnx is None or not isinstance(model, nnx.Module):
    return model
  from dadjax.nnx import Model  # pylint: disable=g-import-not-at-top
  return Model(model)


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
    donate: bool = False,
    collections: Mapping[str, CollectionRule] | None = None,
    allow_local: bool = False,
    check_ledger: bool = True,
) -> TrainStep:
  """Build the jitted SPMD training step.

  Long because of its docstring (every argument and layout); the code only validates and assembles.

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
    shard_params: on a 2-D mesh, split each site's parameters and their
      optimizer state over the site's devices (module docstring).
    donate: donate the input state's buffers to the output.
    collections: ``{name: CollectionRule}`` adding to or overriding the
      registered rules (:mod:`dadjax._core.collections`) for this step.
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
  have, and ``shard_params=True`` with optax transformations that reduce
  over whole tensors (``clip_by_global_norm``, LAMB's trust ratio,
  Adafactor).

  Returns:
    A :class:`TrainStep`.

  Raises:
    ValueError: for an unknown backend, a bad ``num_sites``, an axis not in
      the mesh, a mesh with ``pmap`` / ``vmap``, ``shard_params`` without a
      2-D mesh or with a batch stage, or ``mutable`` / ``average`` naming
      ``"params"``, ``"comm"`` or a differentiated collection (``average``
      must be a subset of ``mutable``).
  """
  model = _nnx_model(model)  # an nnx.Module: through dadjax.nnx.Model (nnx.split / merge)
  registered = resolve_rules((), (), collections)
  reserved = ("params", COMM_COLLECTION, *(k for k, r in registered.items() if r.differentiate))
  mutable = _check_names("mutable", mutable, reserved)
  average = _check_names("average", average, reserved, mutable)
  if batch_stage is not None and not isinstance(batch_stage, BatchStage):
    raise ValueError(f"batch_stage must be a dadjax.stage.BatchStage or None, got {batch_stage!r}")
  placement = placement_of(backend, num_sites, mesh, shard_params, axis_name)
  if placement.shard_params and batch_stage is not None:
    raise ValueError("shard_params=True does not support a batch_stage (its gradient "
                     "correction and gate need whole gradients); use shard_params=False")
  if placement.shard_params:
    check_sharded_tx(tx)
  for name, flag in (("allow_local", allow_local), ("check_ledger", check_ledger)):
    if not isinstance(flag, bool):
      raise ValueError(f"{name} must be a bool, got {flag!r}")
  rules = resolve_rules(mutable, average, collections)
  loss_fn = classification_loss(model) if loss_fn is None else loss_fn
  metrics_fn = default_metrics if metrics_fn is None else metrics_fn
  recipe = Recipe(tx, loss_fn, metrics_fn, rules, batch_stage, axis_name, placement.num_sites,
                  allow_local)
  run = placement.compile(site_program(recipe), donate)
  return TrainStep(model, tx, loss_fn, metrics_fn, placement, rules, batch_stage, run,
                   _eval_fn(loss_fn, metrics_fn), mutable, average, allow_local, check_ledger)
