"""Gradient correction: what the quantized (and gated) data miss, sent compressed.

The batch stage's losses are weighted means, ``sum(w_i l_i) / sum(w_i)``.
To combine passes over different rows exactly, every pass is rescaled to a
fixed denominator: ``rescale(result, sum(w), n)`` turns the weighted mean
into ``sum(w_i l_i) / n`` (and its gradient likewise). The correction of a
site with ``R`` rows is then

  ``c = (1/R) sum_i w_i g(w; x_i) - (1/R) sum_{i sent} (w_i / p_i) g(w; Q(x_i))``

(two backward passes of ``R`` rows each: the true batch and the site's own
quantized, gated rows). The receivers' gradient at the gathered ``Q(x)`` is
``(1/(N R)) sum_{sites, sent} (w_i / p_i) g(w; Q(x_i))``; adding the mean of
the corrections over the ``N`` sites gives back the exact mean gradient
``(1/N) sum_sites (1/R) sum_i w_i g(w; x_i)`` when the corrections travel
uncompressed, and an estimate whose error is the compressor's otherwise.

References:
  Hanna et al., "Quantizing data for distributed learning"
  (https://arxiv.org/abs/2012.07913), the correction ``g(x) - g(Q(x))``.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from dadjax._tree_utils import tree_sub
from dadjax.stage import GradResult


def rescale(result: GradResult, total_weight: jax.Array,
            denominator: int | jax.Array) -> GradResult:
  """A weighted-mean pass as ``sum(w_i l_i) / denominator``; zero when ``total_weight == 0``.

  Args:
    result: the pass, computed with weights summing to ``total_weight``.
    total_weight: ``sum(w_i)`` of that pass (fp32 scalar).
    denominator: the fixed denominator (e.g. the rows of every site).

  Returns:
    ``result`` with ``loss`` and ``grads`` multiplied by
    ``total_weight / denominator`` (0 where nothing was weighted: the 0 / 0
    mean of an empty pass never leaks a NaN).
  """
  factor = total_weight / denominator
  nonempty = total_weight > 0

  def scale(x):
    return jnp.where(nonempty, x * factor, 0.0).astype(x.dtype)

  return result._replace(loss=scale(result.loss), grads=jax.tree.map(scale, result.grads))


def correction_term(grad_fn: Callable[[Any, Any], GradResult], params: Any, batch: dict,
                    quantized: dict, rows: int) -> tuple[Any, GradResult]:
  """This site's correction ``c`` (module docstring) and its true-data pass.

  Args:
    grad_fn: the step's ``(params, batch) -> GradResult``.
    params: the parameters.
    batch: the site's true rows with ``"weight"`` summing to ``rows``.
    quantized: the rows as the site sent them (decoded ``Q(x)``, labels and
      ``"weight"`` ``w_i / p_i``, 0 for rows not sent).
    rows: ``R``, this site's rows.

  Returns:
    ``(c, true_pass)``: the correction (a gradient pytree) and the pass on
    the true rows (its loss and aux are the site's exact ones).
  """
  true = rescale(grad_fn(params, batch), jnp.sum(batch["weight"]), rows)
  sent = rescale(grad_fn(params, quantized), jnp.sum(quantized["weight"]), rows)
  return tree_sub(true.grads, sent.grads), true
