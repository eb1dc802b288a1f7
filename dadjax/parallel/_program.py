"""The step as one site runs it: a short pipeline of small functions.

``local gradient -> in-site reduction -> tx.update -> collection sync ->
metrics -> ledger``. Collectives name the site axis; the in-site reduction
(:class:`~dadjax.parallel._insite.InSite`) is the identity on a 1-D layout.

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
from dadjax.parallel._insite import InSite
from dadjax.parallel._losses import LossFn, MetricsFn
from dadjax.parallel._state import TrainState, site_keys
from dadjax.stage import BatchStage, GradResult, StageContext


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


class Local(NamedTuple):
  """The site's gradient before the optimizer, and the traffic spent on it."""

  result: GradResult
  stage_state: Any
  traffic: Traffic  # over the site axis (a batch stage's collectives)
  intra: Traffic  # within the site (gathering sharded parameters)


def local_gradient(r: Recipe, in_site: InSite, state: TrainState, batch) -> Local:
  """The plain backward pass of the site's rows, or the batch stage's gradient."""
  model_key, shared_key, stage_key = site_keys(state.rng, state.step, site_index(r.axis_name))
  model_key = in_site.device_key(model_key)
  params, model_state, intra = in_site.local(state.params, state.model_state)

  def grad_fn(p, b, rng=None):
    return grad_result(r.loss_fn, (), p, model_state, b, model_key if rng is None else rng, True,
                       collections=r.rules)

  if r.batch_stage is None:
    return Local(grad_fn(params, batch), state.stage_state, NO_TRAFFIC, intra)

  def loss_fn(p, b, rng=None):
    value, aux = r.loss_fn(p, model_state, b, model_key if rng is None else rng, True)
    return value, _split_aux(aux)[0]

  ctx = StageContext(grad_fn, loss_fn, r.axis_name, stage_key, shared_key, state.step)
  out = r.batch_stage.apply(ctx, params, batch, state.stage_state)
  return Local(out.result, out.state, out.traffic, intra)


def reduce_in_site(in_site: InSite, state: TrainState, local: Local, rules: Mapping):
  """``(grads, model_state, stage_state, intra traffic)``, equal on every device of a site."""
  grads, t1 = in_site.mean_grads(local.result.grads)
  model_state, t2 = in_site.sync(state.model_state, local.result.model_state, rules)
  stage_state = in_site.check_stage_state(local.stage_state)
  return grads, model_state, stage_state, traffic_add(local.intra, t1, t2)


def apply_tx(tx, in_site: InSite, state: TrainState, grads, extra_args: dict):
  """``(params, opt_state)`` after the optimizer (which does the method's collectives)."""
  with in_site.optimizer_scope(state.params):
    updates, opt_state = tx.update(grads, state.opt_state, state.params, **extra_args)
  return optax.apply_updates(state.params, updates), opt_state


def sync_collections(r: Recipe, model_state: dict) -> tuple[dict, Traffic]:
  """The collections whose rule averages them, averaged over the sites (one metered ``pmean``)."""
  synced = {k: model_state[k] for k, rule in r.rules.items() if rule.average and k in model_state}
  if not jax.tree.leaves(synced):
    return model_state, NO_TRAFFIC
  synced, traffic = metered_pmean(synced, r.axis_name)
  return {**model_state, **synced}, traffic


def site_metrics(r: Recipe, in_site: InSite, result: GradResult, batch):
  """``(metrics, site-axis traffic, in-site traffic)``: averaged over the devices, then the sites."""
  metrics = {"loss": result.loss, **r.metrics_fn(result.aux, batch)}
  metrics = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), metrics)
  metrics, intra = in_site.mean(metrics)
  metrics, traffic = metered_pmean(metrics, r.axis_name)
  return metrics, traffic, intra


def ledgers(r: Recipe, in_site: InSite, state: TrainState, result: GradResult, traffic: Traffic,
            intra: Traffic):
  """``(comm, intra_comm)``: the step's own ledgers after this step."""
  # a batch stage replaces the gradient all-reduce: its fp32 size is the dense reference
  dense = tree_dense_bits(result.grads) if r.batch_stage is not None else 0
  comm = ledger_record(state.comm, reduce=traffic.reduce, gather=traffic.gather, dense=dense,
                       reduce_calls=traffic.reduce_calls, gather_calls=traffic.gather_calls)
  return comm, in_site.record(state.intra_comm, intra)


def site_program(r: Recipe) -> Callable[[InSite], Callable]:
  """The site program's factory: ``in_site -> site_step(state, batch) -> (state, metrics)``."""
  r = r._replace(tx=optax.with_extra_args_support(r.tx))

  def build(in_site: InSite):

    def site_step(state: TrainState, batch):
      check_opt_state(state.opt_state, num_sites=r.num_sites, axis_name=r.axis_name,
                      stage=r.batch_stage is not None, allow_local=r.allow_local)
      try:
        return _site_step(r, in_site, state, batch)
      except NameError as e:
        if "unbound axis" not in str(e):
          raise
        raise unbound_axis(e, r.axis_name) from e

    return site_step

  return build


def _site_step(r: Recipe, in_site: InSite, state: TrainState, batch):
  """One step of one site (:func:`site_program`)."""
  local = local_gradient(r, in_site, state, batch)
  grads, model_state, stage_state, intra = reduce_in_site(in_site, state, local, r.rules)
  params, opt_state = apply_tx(r.tx, in_site, state, grads, local.result.extra_args)
  check_model_comm(local.result.extra_args, state.opt_state)  # after a family's own refusal
  model_state, sync_traffic = sync_collections(r, model_state)
  metrics, metrics_traffic, metrics_intra = site_metrics(r, in_site, local.result, batch)
  traffic = traffic_add(local.traffic, sync_traffic, metrics_traffic)
  comm, intra_comm = ledgers(r, in_site, state, local.result, traffic,
                             traffic_add(intra, metrics_intra))
  return TrainState(state.step + 1, params, opt_state, model_state, state.rng, comm,
                    stage_state, intra_comm), metrics
