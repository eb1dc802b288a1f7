"""Gradient accumulation that communicates once per optimizer step.

``optax.MultiSteps`` evaluates its inner transformation on every
micro-step and keeps the result only on the k-th, so a collective inside
it runs k times per optimizer step while its ledger books it once: the
train step refuses ``MultiSteps`` around a dadjax communicating
transformation with an error pointing here. Use :func:`accumulate`
instead: it sums the local gradients over the
micro-steps and runs the inner transformation, collective included, only
on the k-th, under ``lax.cond``.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.accumulate import accumulate_step
from dadjax._core.validate import check_int


class AccumulateState(NamedTuple):
  """Micro-steps since the last optimizer step, the running sum, the inner state."""

  micro_step: jax.Array
  grads: Any
  inner: Any


def accumulate(tx: optax.GradientTransformation, every_k: int | jax.Array
               ) -> optax.GradientTransformationExtraArgs:
  """Run ``tx`` (and its collective) once every ``every_k`` micro-steps on the mean gradient.

  Micro-steps 1..k-1 add the local gradient to a running sum and return
  zero updates; micro-step k calls ``tx.update`` on ``sum / k`` and returns
  its updates. ``tx`` therefore communicates once per optimizer step, its
  state (error-feedback memories, PowerSGD's warm start, step counters,
  ledgers) advances once per optimizer step, and the result equals one
  step of ``tx`` on the concatenated micro-batches (for a loss that is a
  mean over equal-sized micro-batches).

  The k-th step is chosen with ``lax.cond`` on a predicate every site
  computes alike (the micro-step counter), so all sites take the same
  branch. Under ``shard_map`` and ``pmap`` the collective sits in the
  conditional's branch of the compiled program and runs only when taken;
  under ``vmap`` the sites are one program and ``cond`` on a per-site
  predicate runs both branches (there is no collective op to skip). Both
  branches' outputs are typed alike under ``shard_map(check_vma=True)``.

  Extra arguments (e.g. ``model_comm``) are passed to ``tx`` on the k-th
  micro-step only. Layers that communicate in every backward pass (dAD)
  do so on every micro-step: record them outside the accumulator with
  :func:`dadjax.dad.model_ledger`; :func:`~dadjax.comm_stats` combines the
  two rates into bits per optimizer step.

  Args:
    tx: the transformation to run every k-th micro-step, communicating one
      first (``optax.chain(dadjax.allreduce("data"), optax.sgd(0.1))``).
    every_k: micro-steps per optimizer step: an int >= 1, or a traced int
      (e.g. chosen per step by an adaptive method; the counter then fires
      when it reaches the current value).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state
    :class:`AccumulateState`.

  Raises:
    ValueError: if ``every_k`` is a Python number that is not an int >= 1.
  """
  if isinstance(every_k, (bool, numbers.Number)):
    every_k = check_int("every_k", every_k, 1)
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return AccumulateState(jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params),
                           tx.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    step = accumulate_step(lambda mean, inner: tx.update(mean, inner, params, **extra_args),
                           updates, state.grads, state.micro_step, state.inner, every_k,
                           refs=params)
    return step.updates, AccumulateState(step.pending, step.acc, step.inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)
