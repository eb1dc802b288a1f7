"""The reporting protocol: state nodes that report their own metrics or evaluation parameters.

Metrics rows: any node of a state tree (a ``NamedTuple`` in the optimizer
state or a batch stage's state) that has per-step metrics defines a method
``metrics_row(self, params=None) -> dict[str, float]`` returning host
values of one site (the state is stacked per site; read site 0, where all
sites agree); ``params`` (one site's parameters, optional) names tensors.
:func:`collect_rows` finds every such node and merges their rows; the
training loop only collects. A model-state collection reports through its
:class:`~dadjax._core.collections.CollectionRule`'s ``metrics_row``.

Evaluation parameters: a node of the optimizer state may define
``evaluation_params(self, params) -> params``, the parameters to evaluate
(e.g. a synchronized anchor that local-update methods keep besides the
per-site parameters); :func:`evaluation_params` returns the first such
node's answer, or ``params``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax


def _has(name: str):
  return lambda x: callable(getattr(type(x), name, None))


_has_row = _has("metrics_row")
_has_eval = _has("evaluation_params")


def nodes(tree: Any, method: str) -> list:
  """The nodes of ``tree`` whose class defines ``method``, in tree order (outermost first)."""
  has = _has(method)
  return [x for x in jax.tree.leaves(tree, is_leaf=has) if has(x)]


def _takes_params(fn) -> bool:
  try:
    sig = inspect.signature(fn)
  except (TypeError, ValueError):
    return False
  return any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
             for p in sig.parameters.values())


def collect_rows(tree: Any, params: Any = None) -> dict:
  """The merged ``metrics_row`` of every reporting node of ``tree``.

  Args:
    tree: any state pytree (optimizer state, batch-stage state), stacked
      per site or not.
    params: one site's parameters, handed to the rows that take them.

  Returns:
    A dict of host values (empty when no node reports).
  """
  row: dict = {}
  for node in nodes(tree, "metrics_row"):
    fn = node.metrics_row
    row.update(fn(params) if _takes_params(fn) else fn())
  return row


def has_evaluation_params(opt_state: Any) -> bool:
  """Whether a node of ``opt_state`` defines ``evaluation_params``."""
  return bool(nodes(opt_state, "evaluation_params"))


def evaluation_params(opt_state: Any, params: Any) -> Any:
  """The parameters to evaluate: the first reporting node's ``evaluation_params(params)``.

  Args:
    opt_state: one site's optimizer state.
    params: that site's parameters.

  Returns:
    The node's answer, or ``params`` when no node of ``opt_state`` defines it.
  """
  found = nodes(opt_state, "evaluation_params")
  return found[0].evaluation_params(params) if found else params
