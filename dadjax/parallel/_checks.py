"""Setups the train step refuses, because they would train silently with wrong numbers or semantics.

Each refusal is a ``ValueError`` whose message names the fix. Communication
is recognized generically (:mod:`dadjax._core.protocols`): a transformation
communicates when its state holds a bit ledger or declares ``COMMUNICATES``.

* ``optax.MultiSteps`` around a communicating transformation: its inner
  update (and so the collective) runs on every micro-step while the inner
  state, ledger included, advances every k-th; the ledger would report k
  times too little. Use :func:`dadjax.accumulate`, which communicates and
  books once per optimizer step.
* No communicating transformation (and no batch stage) while
  ``num_sites > 1``: the sites would drift apart while the step presents
  site 0 as the model. ``allow_local=True`` trains them apart on purpose.
* A communicating transformation after a per-site stateful one in a chain
  (``chain(adam, compressed(...))``: per-site Adam moments, and the method
  compresses Adam's updates). State classes declaring ``ANY_POSITION``
  (methods that average parameters, or a transformation wrapped in
  :func:`dadjax.after_local_state` to say the order is the method) may follow.
* A model that communicates in its backward pass (sows ``"comm"`` bits:
  dAD layers) with no transformation booking that traffic (no state
  declaring ``BOOKS_MODEL_COMM``): its traffic would be missed and the
  gradients synchronized twice.
* A collective naming an axis the step does not have (JAX's unbound-axis
  ``NameError`` at trace, re-raised naming the step's axis).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from dadjax._core.protocols import ANY_POSITION, BOOKS_MODEL_COMM, COMMUNICATES, find_declared
from dadjax.comm import find_comm_stats

def communicates(tree: Any) -> bool:
  """Whether a state tree holds a ledger or a node declaring ``COMMUNICATES``."""
  return bool(find_comm_stats(tree)) or bool(find_declared(tree, COMMUNICATES))


def _is_chain(node: Any) -> bool:
  return isinstance(node, tuple) and not hasattr(node, "_fields")


def _stateful(node: Any) -> list[str]:
  """Names of the per-site float state classes in ``node`` (moments, traces)."""
  if _is_chain(node):
    return [k for part in node for k in _stateful(part)]
  floats = [x for x in jax.tree.leaves(node) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return [type(node).__name__] if floats else []


def _check_multisteps(opt_state: Any) -> None:
  found = [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(
      x, optax.MultiStepsState)) if isinstance(x, optax.MultiStepsState)]
  if any(communicates(s.inner_opt_state) for s in found):
    raise ValueError(
        "optax.MultiSteps wraps a dadjax communicating transformation: its collectives run on "
        "every micro-step while its state and ledger advance once per optimizer step, so the "
        "ledger would book k times too little. Use dadjax.accumulate(tx, every_k) instead "
        "(it communicates and books once per optimizer step), e.g. dadjax.accumulate("
        "optax.chain(dadjax.allreduce('data'), optax.adamw(1e-3)), 4)")


def _check_first(node: Any) -> None:
  if not _is_chain(node):
    return
  for i, part in enumerate(node):
    if not communicates(part):
      continue
    if find_declared(part, ANY_POSITION):
      return
    before = _stateful(node[:i])
    if before:
      raise ValueError(
          f"the optimizer chain runs per-site stateful transformation(s) {before} before its "
          f"communicating transformation (chain position {i}): they see each site's own "
          "gradients (per-site moments; the method would compress their updates). Put the "
          "communicating transformation first: optax.chain(<communicating tx>, <local "
          "optimizer>), as Method.optimizer(local) does")
    _check_first(part)
    return


def check_opt_state(opt_state: Any, *, num_sites: int, axis_name: str, stage: bool,
                    allow_local: bool) -> None:
  """Refuse an optimizer state whose transformation would mislead (module docstring)."""
  _check_multisteps(opt_state)
  if num_sites > 1 and not stage and not allow_local and not communicates(opt_state):
    raise ValueError(
        f"the optimizer has no dadjax communicating transformation, so the {num_sites} sites "
        "would train apart while the step reports site 0 as the model. Put one first, e.g. "
        f"optax.chain(dadjax.allreduce({axis_name!r}), optax.adamw(1e-3)) or "
        "dadjax.build_method(spec).optimizer(local); or pass make_train_step(..., "
        "allow_local=True) to train the sites independently on purpose")
  _check_first(opt_state)


def check_model_comm(extra_args: dict, opt_state: Any) -> None:
  """Refuse a model that communicates in its backward pass without a transformation booking it."""
  if "model_comm" in extra_args and not find_declared(opt_state, BOOKS_MODEL_COMM):
    raise ValueError(
        "the model communicates in its own backward pass (dAD layers sow 'comm' bits) but no "
        "transformation of the optimizer books that traffic or leaves those gradients alone: "
        "it would be missed by the ledger and the gradients synchronized twice. Train it with "
        "the dAD method's transformation, e.g. method = dadjax.build_method('dad'); "
        "tx = method.optimizer(local) with the model built from method.dense, or "
        "optax.chain(dadjax.dad.synchronize(dadjax.dad.layer_mask(model, x)), ...)")


def unbound_axis(error: NameError, axis_name: str) -> ValueError:
  """JAX's unbound-axis ``NameError``, as an error naming the step's axis."""
  return ValueError(
      f"a collective names an axis the train step does not have ({error}); the step's site "
      f"axis is {axis_name!r}: build the transformation with axis_name={axis_name!r} (e.g. "
      f"dadjax.allreduce({axis_name!r}), compressed(c, axis_name={axis_name!r})) or pass "
      "make_train_step(..., axis_name=<the transformation's axis>)")
