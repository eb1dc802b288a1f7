"""The usual pieces of a test: random rows, a small MLP, an all-reduce optimizer, a step loop.

Imported by the test modules (``from helpers import ...``: pytest puts
``tests/`` on the path) and behind the fixtures of ``conftest.py``. A test
whose data or loop differs on purpose (a learnable teacher, micro-batches,
a subprocess) keeps its own and says why.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import dad, models
from dadjax.parallel import local_gradients, softmax_cross_entropy, stack_sites


def data(rows: int, features: int | tuple[int, ...] = 6, classes: int = 3,
         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """``(x, y)``: ``rows`` standard-normal float32 inputs of shape ``features`` and int32 labels
  in ``[0, classes)``, from ``np.random.default_rng(seed)`` (inputs drawn first)."""
  features = (features,) if isinstance(features, int) else tuple(features)
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(rows, *features)).astype(np.float32)
  return x, rng.integers(0, classes, rows).astype(np.int32)


def images(rows: int, classes: int = 10, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """:func:`data` of 8 x 8 x 1 images (the embedded digits' shape), 10 classes."""
  return data(rows, (8, 8, 1), classes, seed)


def batch(rows: int, features: int | tuple[int, ...] = 6, classes: int = 3,
          seed: int = 0) -> dict:
  """:func:`data` as a step's batch ``{"x": x, "y": y}``."""
  x, y = data(rows, features, classes, seed)
  return {"x": x, "y": y}


def mlp(hidden: tuple[int, ...] = (8,), classes: int = 3, dense: Any = None) -> models.MLP:
  """The small MLP of the step tests (``dense``: a method's layer, e.g. dAD's)."""
  return models.MLP(hidden=hidden, num_classes=classes, **({"dense": dense} if dense else {}))


def sgd_allreduce(lr: float = 0.1, momentum: float | None = 0.9) -> optax.GradientTransformation:
  """fp32 all-reduce over ``"data"``, then SGD (with momentum)."""
  return optax.chain(dadjax.allreduce("data"), optax.sgd(lr, momentum=momentum))


def run_steps(step, batches: dict | Callable[[int], dict], steps: int, *, init_x=None,
              init_rows: int = 2, seed: int = 0) -> tuple[Any, list[dict]]:
  """Initialize ``step`` and run it ``steps`` times.

  Args:
    step: a :class:`dadjax.parallel.TrainStep`.
    batches: one batch for every step, or ``i -> batch`` of step ``i``.
    steps: how many steps.
    init_x: the rows ``step.init`` sees (default: the first ``init_rows`` rows
      of step 0's batch).
    init_rows: see ``init_x``.
    seed: the initialization key's seed.

  Returns:
    ``(state, [metrics of each step])``.
  """
  batch_at = batches if callable(batches) else (lambda _: batches)
  if init_x is None:
    init_x = batch_at(0)["x"][:init_rows]
  state = step.init(jax.random.key(seed), init_x)
  history = []
  for i in range(steps):
    state, metrics = step(state, batch_at(i))
    history.append(metrics)
  return state, history


def compiled_dad_step(model, x, y, rows: int, sites: int, axis: str = "data"):
  """A hand-written shard_map step of ``model``'s dAD layers (no ``make_train_step``),
  compiled and run once on ``(x, y)``: ``(compiled program, the ledger's CommSummary)``.

  The collectives of the compiled program are what dAD's layers and
  ``dad.synchronize`` put there, nothing else: the tests compare them with the ledger.
  """
  variables = dict(model.init(jax.random.key(0), x[:rows]))
  params = variables.pop("params")
  variables.pop("comm", None)
  tx = dad.synchronize(dad.layer_mask({"params": params, **variables}), axis_name=axis)
  state = stack_sites((params, variables, tx.init(params)), sites)

  def site(state, x, y):
    params, model_state, opt_state = jax.tree.map(lambda v: v[0], state)
    local = local_gradients(model, softmax_cross_entropy, params, model_state, {"x": x, "y": y})
    updates, opt_state = tx.update(local.grads, opt_state, params, **local.extra_args)
    new = (optax.apply_updates(params, updates), local.model_state, opt_state)
    return jax.tree.map(lambda v: v[None], new)

  mesh = dadjax.make_mesh(sites, axis)
  step = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P(axis),) * 3, out_specs=P(axis)))
  compiled = step.lower(state, x, y).compile()
  _, _, opt_state = compiled(state, x, y)
  return compiled, dadjax.comm_stats(opt_state)
