"""Gradient correction: what the quantized (and gated) data miss, sent compressed.

Losses follow the contract of :mod:`dadjax.stage`: a pass over ``n`` rows
with weights ``w_i`` computes ``sum(w_i l_i) / n``. The correction of a
site with ``R`` rows is then

  ``c = (1/R) sum_i w_i g(w; x_i) - (1/R) sum_{i sent} (w_i / p_i) g(w; Q(x_i))``

(two backward passes of ``R`` rows each: the true batch and the site's own
quantized, gated rows, padded to ``R`` with weight 0). The receivers'
gradient at the gathered ``Q(x)`` is
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

from dadjax._core.trees import tree_sub
from dadjax._core.protocols import GradResult


def correction_term(grad_fn: Callable[[Any, Any], GradResult], params: Any, batch: dict,
                    quantized: dict) -> tuple[Any, GradResult]:
  """This site's correction ``c`` (module docstring) and its true-data pass.

  Args:
    grad_fn: the step's ``(params, batch) -> GradResult``.
    params: the parameters.
    batch: the site's true rows (``R`` rows, ``"weight"`` ``w_i``).
    quantized: the rows as the site sent them (``R`` rows: decoded ``Q(x)``,
      labels and ``"weight"`` ``w_i / p_i``, 0 for rows not sent).

  Returns:
    ``(c, true_pass)``: the correction (a gradient pytree) and the pass on
    the true rows (its loss and aux are the site's exact ones).
  """
  true = grad_fn(params, batch)
  sent = grad_fn(params, quantized)
  return tree_sub(true.grads, sent.grads), true
