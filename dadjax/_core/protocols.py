"""The step's protocols: how a transformation, a collection, a state node or a batch stage
talks to the train step without the step knowing its family.

The step (:mod:`dadjax.parallel`) and the families (``compress``, ``dad``,
``dataquant``, ``local``, ``adaptive``) meet only here; nothing here imports
a family, ``dadjax.parallel`` or the run layer.

Marks: what a transformation's state declares
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~

What a transformation's state class declares to the train step (class attributes).

The train step refuses setups that would train with wrong semantics or
wrong numbers (:mod:`dadjax.parallel._checks`). It recognizes communication
generically, from the optimizer state after ``tx.init``:

* a transformation *communicates* when its state holds a bit ledger (what
  :func:`dadjax.comm.find_comm_stats` finds: every dadjax communicating
  transformation keeps one), or when a node of its state declares
  ``COMMUNICATES = True``;
* a state class that declares ``BOOKS_MODEL_COMM = True`` books the traffic a
  model sows in its own backward pass (the ``"comm"`` collection of dAD
  layers, handed to the optimizer as ``model_comm``): dAD's ``synchronize``
  and ``model_ledger``;
* a state class that declares ``ANY_POSITION = True`` may follow stateful
  per-site transformations in a chain: it averages what they produce on
  purpose (parameters, pseudo-gradients, the sites' Adam updates, DeMo's
  momentum components); every other communicating transformation must
  come first. :func:`after_local_state` declares it for any transformation.

Declare them as plain class attributes of the ``NamedTuple`` state::

  class MyState(NamedTuple):
    BOOKS_MODEL_COMM = True
    comm: CommStats

Collection rules: model-state collections with their own update rule
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~

Model-state collections with their own update rule.

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

Reporting: state nodes that report metrics or evaluation parameters
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~

The reporting protocol: state nodes that report their own metrics or evaluation parameters.

Metrics rows: any node of a state tree (a ``NamedTuple`` in the optimizer
state or a batch stage's state) that has per-step metrics defines a method
``metrics_row(self, params=None) -> dict[str, float]`` returning host
values of one site (the state is stacked per site; read site 0, where all
sites agree); ``params`` (one site's parameters, optional) names tensors.
:func:`collect_rows` finds every such node and merges their rows; the
training loop only collects. A model-state collection reports through its
:class:`~dadjax._core.protocols.CollectionRule`'s ``metrics_row``.

Evaluation parameters: a node of the optimizer state may define
``evaluation_params(self, params) -> params``, the parameters to evaluate
(e.g. a synchronized anchor that local-update methods keep besides the
per-site parameters); :func:`evaluation_params` returns the first such
node's answer, or ``params``.

Batch stages: methods that act on a site's batch
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~

The batch-stage protocol: methods that act on a site's batch.

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

import inspect
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

import jax
import optax

if TYPE_CHECKING:
  from dadjax.comm import Traffic


# -- marks -----------------------------------------------------------------------------------------

COMMUNICATES = "COMMUNICATES"
BOOKS_MODEL_COMM = "BOOKS_MODEL_COMM"
ANY_POSITION = "ANY_POSITION"


def declares(node: Any, mark: str) -> bool:
  """Whether ``node``'s class sets ``mark`` to ``True``."""
  return getattr(type(node), mark, False) is True


def find_declared(tree: Any, mark: str) -> list:
  """Every node of ``tree`` whose class declares ``mark``."""
  has = lambda x: declares(x, mark)
  return [x for x in jax.tree.leaves(tree, is_leaf=has) if has(x)]


class AfterLocalState(NamedTuple):
  """State of :func:`after_local_state`: the wrapped transformation's, declared ``ANY_POSITION``."""

  ANY_POSITION = True
  inner: Any


def after_local_state(tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
  """Declare that ``tx`` communicates what per-site stateful transformations before it produce.

  The train step refuses ``optax.chain(optax.adam(...), <communicating tx>)``:
  usually a mistake (each site's Adam moments see only its own gradients,
  and the method would compress Adam's updates). When that is the method
  (averaging the sites' Adam updates; DeMo's per-site momentum before its
  exchange), wrap the communicating transformation:
  ``optax.chain(optax.adam(1e-3), dadjax.after_local_state(dadjax.allreduce("data")))``.
  Its updates, state (inside :class:`AfterLocalState`) and ledger are the
  wrapped transformation's.

  Args:
    tx: a communicating optax transformation.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` whose state declares
    ``ANY_POSITION``.

  Raises:
    ValueError: if ``tx`` is not an optax transformation.
  """
  if not isinstance(tx, optax.GradientTransformation):
    raise ValueError(f"after_local_state: tx must be an optax GradientTransformation (a "
                     f"communicating one, e.g. dadjax.allreduce('data')), got {type(tx).__name__}")
  tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    return AfterLocalState(tx.init(params))

  def update_fn(updates, state, params=None, **extra_args):
    updates, inner = tx.update(updates, state.inner, params, **extra_args)
    return updates, AfterLocalState(inner)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


# -- collection rules ------------------------------------------------------------------------------

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


# -- reporting -------------------------------------------------------------------------------------

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


def merge_rows(*named_rows: tuple[str, Mapping[str, Any]]) -> dict:
  """One metrics row from the rows of several sources; no source overwrites another.

  Args:
    *named_rows: ``(source, row)`` pairs, ``source`` a name for messages
      (e.g. ``"report"``, ``"AccordionState.metrics_row"``), ``row`` a
      mapping of column to value.

  Returns:
    A new dict with every column, in the order given.

  Raises:
    ValueError: two sources give the same column; the message names the
      column and both sources.
  """
  row: dict = {}
  owner: dict[str, str] = {}
  for source, part in named_rows:
    for key, value in part.items():
      if key in owner:
        raise ValueError(
            f"metrics row column {key!r} comes from both {owner[key]} and {source}; one would "
            "overwrite the other: rename one of them")
      owner[key] = source
      row[key] = value
  return row


def collect_rows(tree: Any, params: Any = None) -> dict:
  """The merged ``metrics_row`` of every reporting node of ``tree`` (:func:`merge_rows`).

  Args:
    tree: any state pytree (optimizer state, batch-stage state), stacked
      per site or not.
    params: one site's parameters, handed to the rows that take them.

  Returns:
    A dict of host values (empty when no node reports).

  Raises:
    ValueError: two nodes report the same column.
  """
  named = []
  for i, node in enumerate(nodes(tree, "metrics_row")):
    fn = node.metrics_row
    named.append((f"{type(node).__name__}.metrics_row (node {i})",
                  fn(params) if _takes_params(fn) else fn()))
  return merge_rows(*named)


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


# -- batch stages ----------------------------------------------------------------------------------

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


__all__ = [
    # marks
    "COMMUNICATES", "BOOKS_MODEL_COMM", "ANY_POSITION", "declares", "find_declared",
    "AfterLocalState", "after_local_state",
    # collection rules
    "CollectionRule", "REPLACE", "AVERAGE", "register_rule", "get_rule", "registered_rules",
    "differentiated", "resolve_rules",
    # reporting
    "nodes", "merge_rows", "collect_rows", "has_evaluation_params", "evaluation_params",
    # batch stages
    "GradResult", "StageContext", "StageOutput", "BatchStage",
]
