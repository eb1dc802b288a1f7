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
  per-site transformations in a chain (it averages parameters or
  pseudo-gradients, not the raw gradients, e.g. a local-update method);
  every other communicating transformation must come first.

Declare them as plain class attributes of the ``NamedTuple`` state::

  class MyState(NamedTuple):
    BOOKS_MODEL_COMM = True
    comm: CommStats
"""

from __future__ import annotations

from typing import Any

import jax

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
