"""The batch-stage protocol: methods that act on a site's batch.

A data-side method (data quantization) runs *instead of* the plain
backward pass of the train step: it may transform the site's batch,
communicate (through the metered collectives of :mod:`dadjax.comm`), call
the step's gradient function as often as it needs (e.g. once on the
gathered quantized data and once more for a correction) and hands back
the gradient the optimizer should see. The train step knows such methods
only through this interface; this module imports nothing above ``comm``.

Loss contract: a pass of ``grad_fn`` / ``loss_fn`` over a batch of ``n``
rows with per-row weights ``w`` (the batch's ``"weight"``, 1 when absent)
computes ``sum_i w_i l_i / n``: the mean over the rows, not over the
weights (the default losses of :mod:`dadjax.parallel` do). So a pass over
the ``N R`` rows gathered from ``N`` sites is the all-reduce mean of the
sites' losses, ``1/p`` importance weights keep estimates unbiased, and
weight 0 drops a row (padding). A custom loss function used with a batch
stage must follow it.

Metrics: the step calls ``metrics_fn(result.aux, batch)`` with this site's
batch, so a stage returns the loss and ``aux`` of this site's own rows
(e.g. from ``ctx.loss_fn(params, batch)``), not of rows it gathered.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax

from dadjax.comm._metered import Traffic


class GradResult(NamedTuple):
  """One backward pass as the train step computes it.

  Attributes:
    loss: scalar loss of the rows it was computed on.
    aux: the loss function's auxiliary output (a pytree; e.g. logits).
    grads: gradients of the ``"params"`` collection.
    model_state: non-parameter collections after the pass.
    extra_args: extra keyword arguments for ``tx.update`` (``model_comm``
      when a layer communicated in its backward pass).
  """

  loss: jax.Array
  aux: Any
  grads: Any
  model_state: Any
  extra_args: dict


class StageContext(NamedTuple):
  """What the step gives a batch stage.

  Attributes:
    grad_fn: ``(params, batch, rng=None) -> GradResult`` with the step's
      loss, model state, rng and ``train=True`` bound. ``rng`` replaces the
      site's model key of this step (pass a key derived from ``shared_key``
      where every site must compute the same gradient, e.g. on gathered rows
      of a model with dropout). A batch is a dict; an optional ``"weight"``
      entry (rows,) weights each row's loss (the default losses honour it:
      ``mean(weight * row_loss)`` over the rows, so ``1/p`` importance weights
      stay unbiased and weight 0 drops a row).
    loss_fn: ``(params, batch, rng=None) -> (loss, aux)``, the same binding
      without a gradient (e.g. for per-sample importance scores).
    axis_name: the sites' axis (``None``: one site).
    key: this site's key for the stage in this step (already folded with
      the step and the site index).
    shared_key: the key of this step shared by every site.
    step: the step counter (int32 scalar).
  """

  grad_fn: Callable[[Any, Any], GradResult]
  loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]]
  axis_name: str | None
  key: jax.Array
  shared_key: jax.Array
  step: jax.Array


class StageOutput(NamedTuple):
  """What a batch stage returns: the gradient result, its new state, its traffic."""

  result: GradResult
  state: Any
  traffic: Traffic


class BatchStage(NamedTuple):
  """A data-side method.

  Attributes:
    init: ``params -> state`` (per site).
    apply: ``(ctx: StageContext, params, batch, state) -> StageOutput``.
  """

  init: Callable[[Any], Any]
  apply: Callable[[StageContext, Any, Any, Any], StageOutput]
