"""One site's backward pass: the gradient, and the collections updated by their rules.

Model state (the non-parameter collections, ``TrainState.model_state``) is
updated by :class:`~dadjax._core.protocols.CollectionRule` s looked up by
collection name (:func:`~dadjax._core.protocols.resolve_rules`): a family
registers the rules of the collections its layers create (the dAD family:
``"dad_state"``, differentiated and overwritten with its gradient), the
step's ``mutable`` names are replaced by what the loss function's
``aux["model_state"]`` returns, and ``make_train_step(collections=...)``
adds or overrides rules. Every other collection is read-only.

Ledger: models that communicate inside their own backward pass (dAD layers)
sow :class:`~dadjax.comm.Bits` into the ``"comm"`` collection; they come back
as the optimizer's ``model_comm`` extra argument.
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from dadjax._core.protocols import get_rule, resolve_rules
from dadjax.comm import COMM_COLLECTION
from dadjax.parallel._losses import MODEL_STATE, LossFn, _accepts_train
from dadjax._core.protocols import GradResult


class LocalGradients(NamedTuple):
  """One site's backward pass, before the optimizer sees it."""

  loss: jax.Array
  logits: jax.Array
  grads: Any  # gradients of the "params" collection
  model_state: Any  # non-parameter collections after the step (overwritten state)
  extra_args: dict  # optax extra arguments: {"model_comm": sown bits} when a layer communicated


def _is_float(v) -> bool:
  return jnp.issubdtype(jnp.result_type(v), jnp.inexact)


def _split_aux(aux: Any) -> tuple[Any, dict]:
  """``(aux without "model_state", the returned collections)``."""
  if isinstance(aux, Mapping) and MODEL_STATE in aux:
    aux = dict(aux)
    return aux, dict(aux.pop(MODEL_STATE) or {})
  return aux, {}


def grad_result(loss_fn: LossFn, mutable: Sequence[str], params, model_state, batch, rng,
                train: bool = True, *, collections: Mapping | None = None) -> GradResult:
  """One backward pass as the train step computes it.

  Differentiates ``loss_fn`` with respect to ``params`` and the float
  leaves of every collection whose rule differentiates (``"dad_state"``;
  integer leaves such as step counters pass through undifferentiated).
  Layers that communicate in their backward pass (dAD) have already done so
  when this returns; their sown bits come back in ``extra_args``
  (``{"model_comm": ...}``) for ``tx.update(..., **extra_args)``. Each
  collection with a rule is replaced by ``rule.update(old, new)``: ``new``
  is its cotangent (differentiated rules) or the loss function's
  ``aux["model_state"]`` entry (the ``mutable`` names and other rules).

  Args:
    loss_fn: ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)``.
    mutable: collections replaced by what the loss returns.
    params, model_state, batch, rng, train: the loss function's inputs.
    collections: extra or overriding rules, by collection name.

  Returns:
    A :class:`~dadjax.stage.GradResult` (``aux`` without ``"model_state"``).
  """
  rules = resolve_rules(mutable, (), collections)
  model_state = dict(model_state or {})
  diff = {k: v for k, v in model_state.items() if k in rules and rules[k].differentiate}
  fixed = {k: v for k, v in model_state.items() if k not in diff}
  leaves, treedef = jax.tree.flatten(diff)
  is_float = [_is_float(v) for v in leaves]

  def objective(p, d, overrides=None):
    d = treedef.unflatten([x if f else v for x, v, f in zip(d, leaves, is_float)])
    return loss_fn(p, {**fixed, **d, **(overrides or {})}, batch, rng, train)

  start = [v if f else None for v, f in zip(leaves, is_float)]
  # A collection whose rule forms gradients after the backward pass (dAD's
  # one gather per pass) takes over the differentiation.
  takeover = [rules[k].gradient for k in model_state if k in rules and rules[k].gradient]
  if len(takeover) > 1:
    raise ValueError("the model state holds several collections whose rules take over the "
                     "differentiation (CollectionRule.gradient); at most one can")
  if takeover:
    value, aux, grads, dleaves = takeover[0](objective, params, start)
  else:
    (value, aux), (grads, dleaves) = jax.value_and_grad(
        objective, argnums=(0, 1), has_aux=True)(params, start)
  cotangents = treedef.unflatten([g if f else None for g, f in zip(dleaves, is_float)])
  aux, returned = _split_aux(aux)
  extra = {}
  if jax.tree.leaves(returned.get(COMM_COLLECTION, {})):
    extra["model_comm"] = returned[COMM_COLLECTION]
  new_state = dict(model_state)
  for name, old in model_state.items():
    rule = rules.get(name)
    if rule is None:
      continue
    if rule.differentiate:
      new_state[name] = rule.apply(old, cotangents[name])
    elif name in returned:
      new_state[name] = rule.apply(old, returned[name])
  return GradResult(value, aux, grads, new_state, extra)


def keep_unused_state(new: Any, old: Any) -> Any:
  """The ``"dad_state"`` after a step: its registered rule's ``update(old, new)``.

  ``new`` is the collection's cotangent; the dAD family's rule is
  :func:`dadjax.dad.next_state` ``(old, new)``: where the cotangent has
  ``uses > 0`` a layer takes its float fields and advances its int32
  ``step`` by one; where ``uses == 0`` (the layer was not on the path of the
  loss this step) the whole layer state keeps ``old``.
  """
  from dadjax.comm import STATE_COLLECTION  # pylint: disable=g-import-not-at-top
  rule = get_rule(STATE_COLLECTION)
  if rule is None:
    raise ValueError(f"no collection rule is registered for {STATE_COLLECTION!r}; "
                     "import dadjax (its dAD family registers it)")
  return rule.apply(old, new)


def local_gradients(model, loss, params, model_state, batch) -> LocalGradients:
  """Loss, logits and gradients of one site's rows with a classification criterion.

  A convenience over :func:`grad_result`: ``loss(logits, labels) -> scalar``
  on ``batch["x"]`` / ``batch["y"]``, no rng, ``train=True``; the default
  ``mutable`` collections (``"batch_stats"``) are replaced.
  """
  differentiated = {k for k, r in resolve_rules().items() if r.differentiate}

  def loss_fn(p, variables, b, rng, train):
    del rng
    variables = dict(variables)
    mutable = [COMM_COLLECTION] + [k for k in variables
                                   if k not in ("params", COMM_COLLECTION) and k not in differentiated]
    kwargs = {"train": train} if _accepts_train(model) else {}
    logits, updates = model.apply({"params": p, **variables}, b["x"], mutable=mutable, **kwargs)
    return loss(logits, b["y"]), {"logits": logits, MODEL_STATE: dict(updates)}

  r = grad_result(loss_fn, ("batch_stats",), params, model_state, batch, None)
  return LocalGradients(r.loss, r.aux["logits"], r.grads, r.model_state, r.extra_args)
