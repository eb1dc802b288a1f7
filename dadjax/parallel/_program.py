"""The step as one site runs it: a short pipeline of small functions.

``local gradient -> tx.update -> collection sync -> metrics -> ledger``.
Collectives name the site axis. On a mesh whose sites are groups of devices
the program sees the site's whole (logical) arrays: the in-site sharding
and its collectives are GSPMD's (:mod:`dadjax.parallel._placement`).

Ledger: communication the step itself does outside the optimizer (a batch
stage's collectives, the ``pmean`` of averaged collections and of the
metrics) is booked in ``TrainState.comm``, a :class:`~dadjax.comm.CommStats`
the step owns. With a batch stage the step's ledger also books the fp32 size
of the gradient as its dense reference (the all-reduce the stage replaces),
so compression ratios compare like with like.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.layers import stacked_layers
from dadjax.comm import (
    NO_TRAFFIC,
    Traffic,
    ledger_record,
    metered_pmean,
    site_index,
    traffic_add,
    tree_dense_bits,
)
from dadjax.parallel._checks import check_model_comm, check_opt_state, unbound_axis
from dadjax.parallel._gradient import _split_aux, grad_result
from dadjax.parallel._losses import LossFn, MetricsFn
from dadjax.parallel._state import TrainState, site_keys
from dadjax._core.protocols import BatchStage, GradResult, StageContext


class Recipe(NamedTuple):
  """What the site program is made of (everything but the layout)."""

  tx: optax.GradientTransformation
  loss_fn: LossFn
  metrics_fn: MetricsFn
  rules: Mapping  # collection name -> CollectionRule
  batch_stage: BatchStage | None
  axis_name: str
  num_sites: int = 1
  allow_local: bool = False  # no communicating transformation on purpose
  layer_axes: Mapping = {}  # {leaf path: layer axis} of stacked parameters, filled at init


class Local(NamedTuple):
  """The site's gradient before the optimizer, and the traffic spent on it."""

  result: GradResult
  stage_state: Any
  traffic: Traffic  # over the site axis (a batch stage's collectives)


def local_gradient(r: Recipe, state: TrainState, batch) -> Local:
  """The plain backward pass of the site's rows, or the batch stage's gradient."""
  model_key, shared_key, stage_key = site_keys(state.rng, state.step, site_index(r.axis_name))
  params, model_state = state.params, state.model_state

  def grad_fn(p, b, rng=None):
    return grad_result(r.loss_fn, (), p, model_state, b, model_key if rng is None else rng, True,
                       collections=r.rules)

  if r.batch_stage is None:
    return Local(grad_fn(params, batch), state.stage_state, NO_TRAFFIC)

  def loss_fn(p, b, rng=None):
    value, aux = r.loss_fn(p, model_state, b, model_key if rng is None else rng, True)
    return value, _split_aux(aux)[0]

  ctx = StageContext(grad_fn, loss_fn, r.axis_name, stage_key, shared_key, state.step)
  out = r.batch_stage.apply(ctx, params, batch, state.stage_state)
  return Local(out.result, out.state, out.traffic)


def apply_tx(tx, state: TrainState, grads, extra_args: dict, layer_axes: Mapping):
  """``(params, opt_state)`` after the optimizer (which does the method's collectives)."""
  with stacked_layers(layer_axes):
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra_args)
  return optax.apply_updates(state.params, updates), opt_state


def sync_collections(r: Recipe, model_state: dict) -> tuple[dict, Traffic]:
  """The collections whose rule averages them, averaged over the sites (one metered ``pmean``)."""
  synced = {k: model_state[k] for k, rule in r.rules.items() if rule.average and k in model_state}
  if not jax.tree.leaves(synced):
    return model_state, NO_TRAFFIC
  synced, traffic = metered_pmean(synced, r.axis_name)
  return {**model_state, **synced}, traffic


def site_metrics(r: Recipe, result: GradResult, batch):
  """``(metrics, site-axis traffic)``: the site's metrics averaged over the sites."""
  metrics = {"loss": result.loss, **r.metrics_fn(result.aux, batch)}
  metrics = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), metrics)
  return metered_pmean(metrics, r.axis_name)


def ledger(r: Recipe, state: TrainState, result: GradResult, traffic: Traffic):
  """The step's own ledger after this step."""
  # a batch stage replaces the gradient all-reduce: its fp32 size is the dense reference
  dense = tree_dense_bits(result.grads) if r.batch_stage is not None else 0
  return ledger_record(state.comm, reduce=traffic.reduce, gather=traffic.gather, dense=dense,
                       reduce_calls=traffic.reduce_calls, gather_calls=traffic.gather_calls)


def site_program(r: Recipe) -> Callable[[], Callable]:
  """The site program's factory: ``() -> site_step(state, batch) -> (state, metrics)``."""
  r = r._replace(tx=optax.with_extra_args_support(r.tx))

  def build():

    def site_step(state: TrainState, batch):
      check_opt_state(state.opt_state, num_sites=r.num_sites, axis_name=r.axis_name,
                      stage=r.batch_stage is not None, allow_local=r.allow_local)
      try:
        return _site_step(r, state, batch)
      except NameError as e:
        if "unbound axis" not in str(e):
          raise
        raise unbound_axis(e, r.axis_name) from e

    return site_step

  return build


def _site_step(r: Recipe, state: TrainState, batch):
  """One step of one site (:func:`site_program`)."""
  local = local_gradient(r, state, batch)
  model_state = dict(local.result.model_state)
  params, opt_state = apply_tx(r.tx, state, local.result.grads, local.result.extra_args,
                               r.layer_axes)
  check_model_comm(local.result.extra_args, state.opt_state)  # after a family's own refusal
  model_state, sync_traffic = sync_collections(r, model_state)
  metrics, metrics_traffic = site_metrics(r, local.result, batch)
  traffic = traffic_add(local.traffic, sync_traffic, metrics_traffic)
  comm = ledger(r, state, local.result, traffic)
  return TrainState(state.step + 1, params, opt_state, model_state, state.rng, comm,
                    local.stage_state, state.intra_comm), metrics
