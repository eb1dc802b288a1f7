"""Model-state collections with their own update rule.

A Flax model keeps non-parameter state in named collections. The train step
(:mod:`dadjax.parallel`) updates a collection only when a
:class:`CollectionRule` says how; every other collection is read-only.
Two kinds of rule cover what models need:

* ``differentiate=True``: the step differentiates the collection's float
  leaves and hands ``update(old, cotangent)`` the cotangent (the pattern
  Flax uses for its fp8 "overwrite with gradient" collection); a dAD layer
  keeps its warm starts and error-feedback memories this way.
* ``differentiate=False``: the loss function returns the new value (its
  ``aux["model_state"]``, what ``model.apply(..., mutable=...)`` gave back)
  and the step stores ``update(old, new)`` (``new`` when ``update`` is
  ``None``); BatchNorm's ``"batch_stats"`` is such a collection.

A method family declares the rules of the collections its layers create
with :func:`register_rule` when it is imported (the dAD family registers
``"dad_state"``); ``make_train_step(..., collections={name: rule})`` adds or
overrides rules for one step, and the step's ``mutable`` / ``average``
arguments are shorthands for replace-with-new rules. The step looks rules
up by name and knows no family.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple


class CollectionRule(NamedTuple):
  """How the train step updates one model-state collection.

  Attributes:
    differentiate: the step differentiates the collection's float leaves
      (integer leaves enter as constants) and ``new`` is their cotangent;
      otherwise ``new`` is what the loss function returned for it.
    update: ``(old, new) -> value``, the collection after the step; ``None``
      stores ``new`` (a collection the loss did not return keeps ``old``).
    average: after the step, average the collection over the sites with one
      metered ``pmean`` (booked in ``TrainState.comm``), so every site holds
      the same value; ``False`` keeps it per site.
    metrics_row: ``value -> {name: float}``, host values for the train
      loop's metrics rows from the collection (stacked per site; read site
      0), or ``None``.
    gradient: takes over the step's differentiation when the model state
      holds the collection: ``gradient(objective, params, diff) -> (loss,
      aux, grads, diff_grads)``, where ``objective(params, diff,
      overrides) -> (loss, aux)`` is the loss with ``overrides`` (a dict of
      collections) replacing the model state's; for a family that forms
      some gradients after the backward pass (dAD's one gather per pass,
      :mod:`dadjax.dad._bucket`). ``None``: ``jax.value_and_grad``.
  """

  differentiate: bool = False
  update: Callable[[Any, Any], Any] | None = None
  average: bool = False
  metrics_row: Callable[[Any], dict] | None = None
  gradient: Callable[..., tuple] | None = None

  def apply(self, old: Any, new: Any) -> Any:
    """The collection after a step (``update(old, new)`` or ``new``)."""
    return new if self.update is None else self.update(old, new)


REPLACE = CollectionRule()
AVERAGE = CollectionRule(average=True)

_RULES: dict[str, CollectionRule] = {}


def _check(name: Any, rule: Any) -> None:
  if not isinstance(name, str) or not name or name in ("params",):
    raise ValueError(f"a collection rule needs a collection name other than 'params', got {name!r}")
  if not isinstance(rule, CollectionRule):
    raise ValueError(f"collections[{name!r}] must be a dadjax CollectionRule, got {rule!r}")


def register_rule(name: str, rule: CollectionRule) -> CollectionRule:
  """Declare the update rule of the collection ``name`` for every train step.

  Called by a family at import; registering the same name again replaces
  the rule (a reloaded module). Returns ``rule``.
  """
  _check(name, rule)
  _RULES[name] = rule
  return rule


def get_rule(name: str) -> CollectionRule | None:
  """The registered rule of ``name`` (``None`` if none is registered)."""
  return _RULES.get(name)


def registered_rules() -> dict[str, CollectionRule]:
  """Every registered rule, by collection name (a copy)."""
  return dict(_RULES)


def differentiated(rules: Mapping[str, CollectionRule] | None = None) -> tuple[str, ...]:
  """Names of the collections whose rule differentiates (default: the registered rules)."""
  rules = _RULES if rules is None else rules
  return tuple(name for name, rule in rules.items() if rule.differentiate)


def resolve_rules(mutable=(), average=(), collections: Mapping | None = None) -> dict:
  """The rules a step uses: registered ones, then ``mutable`` / ``average``, then ``collections``.

  ``mutable`` names become replace-with-new rules (averaged over the sites
  when also in ``average``); explicit ``collections`` entries win.
  """
  rules = dict(_RULES)
  for name in mutable:
    rules[name] = AVERAGE if name in average else REPLACE
  for name, rule in dict(collections or {}).items():
    _check(name, rule)
    rules[name] = rule
  return rules
