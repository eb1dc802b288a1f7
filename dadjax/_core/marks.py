"""What a transformation's state class declares to the train step (class attributes).

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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

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
