"""Local updates: sites step on their own, then synchronize a pseudo-gradient.

One transformation serves local SGD, DiLoCo, Streaming DiLoCo, SparseLoCo
and DeMo. Every optimizer step it runs the inner (local) optimizer on the
site's gradient; on a synchronization step of a fragment of the parameters
(inside ``lax.cond``, so the collective runs only there) it computes the
pseudo-gradient ``Delta = anchor - local`` (the change since the last
synchronization), averages it over the sites (the *communicate* step),
lets the *merge* step update the anchor with it and moves the site's
parameters to the merged result (:mod:`dadjax.local._steps`). The update
it returns is ``new params - params``, so the train step's
``apply_updates`` lands every site on the new parameters.

The factory binds its options into a :class:`_Local` tuple; the work is
done by module-level functions of it (:func:`local_init`,
:func:`local_update`, :func:`sync_fragment`).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.bits import as_bits
from dadjax._core.vma import branch_matched_cond as typed_cond
from dadjax.comm import (AccumulateState, PeriodicStats, bits_add, bits_zero, find_comm_stats,
                         periodic_init, periodic_record, tree_dense_bits)
from dadjax.compress import Compressor
from dadjax.local._plan import SyncPlan, check_schedule, leaves_of, put_leaves, sync_plan
from dadjax.local._steps import Communicate, Merge, averaging, outer_step, pseudo_gradient


class LocalState(NamedTuple):
  """State of a local-update method (every leaf per site under the train step).

  Attributes:
    count: optimizer steps taken (int32).
    anchor: the synchronized parameters (``theta_global``), like ``params``;
      between synchronizations every site's own parameters differ from it.
    inner: the inner optimizer's state, kept across synchronizations.
    outer: one merge state per fragment (a tuple; the outer optimizer's).
    codec: one communicate state per fragment (error-feedback memories:
      SparseLoCo's accumulator, DeMo's momentum; PowerSGD warm starts;
      ``EmptyState`` for the fp32 all-reduce).
    pending: Streaming DiLoCo with ``delay > 0``: the averaged
      pseudo-gradient of each fragment, received and not merged yet (like
      ``params``); ``None`` otherwise.
    ledger: the :class:`~dadjax.comm.PeriodicStats` of the exchanges.
  """

  count: jax.Array
  anchor: Any
  inner: Any
  outer: tuple
  codec: tuple
  pending: Any
  ledger: PeriodicStats

  def evaluation_params(self, params: Any) -> Any:
    """The parameters to evaluate: the synchronized ``anchor``, not a site's local copy."""
    del params
    return self.anchor


def check_compressor(compressor: Any, name: str = "diloco") -> Compressor | None:
  """``None`` (fp32 all-reduce), a :class:`~dadjax.compress.Compressor`, or a spec that builds one.

  Raises:
    ValueError: naming ``compressor``, for anything else or a spec that does not parse.
  """
  if compressor is None or isinstance(compressor, Compressor):
    return compressor
  if isinstance(compressor, str):
    from dadjax.registry import get_compressor  # pylint: disable=g-import-not-at-top
    try:
      return get_compressor(compressor)
    except ValueError as e:
      why = getattr(e, "why", str(e))
      raise ValueError(f"{name}: compressor must be None (fp32 all-reduce), a dadjax Compressor or a "
                       f"compressor spec (`dadjax methods` lists them); {compressor!r} does not "
                       f"parse: {why}") from None
  if isinstance(compressor, optax.GradientTransformation):
    raise ValueError(f"{name}: compressor must be a dadjax Compressor (e.g. dadjax.qsgd(4)) or a spec, "
                     "not an optax transformation: a communicating transformation such as "
                     "compressed(...) would communicate every step; pass its compressor")
  raise ValueError(f"{name}: compressor must be None, a dadjax Compressor or a compressor spec, got "
                   f"{type(compressor).__name__}: {compressor!r}")


def _check_inner(name: str, inner: Any) -> optax.GradientTransformation:
  if not isinstance(inner, optax.GradientTransformation):
    raise ValueError(f"{name}: inner must be an optax GradientTransformation (the local "
                     f"optimizer, e.g. optax.adamw(1e-3)), got {type(inner).__name__}")
  return inner


def _refuse_inner_state(name: str, state: Any) -> None:
  """The inner optimizer must be local: no ledger, no accumulator inside."""
  is_acc = lambda x: isinstance(x, AccumulateState)
  if any(is_acc(x) for x in jax.tree.leaves(state, is_leaf=is_acc)):
    raise ValueError(
        f"{name}: dadjax.accumulate inside the inner optimizer is not supported (its "
        f"micro-steps would count as inner steps); put the accumulator around the local-update "
        f"method instead: dadjax.accumulate({name}(inner, every=H), k)")
  if find_comm_stats(state):
    raise ValueError(
        f"{name}: the inner optimizer communicates (it holds a dadjax ledger: an allreduce, a "
        f"compressor, Accordion or dAD's synchronize would run on every inner step); local "
        f"updates need a local optimizer such as optax.sgd or optax.adamw, and send the "
        f"pseudo-gradient through their own compressor= argument")


class _Local(NamedTuple):
  """The options of :func:`local_updates`, checked."""

  inner: optax.GradientTransformationExtraArgs
  every: int
  fragments: int
  delay: int
  communicate: Communicate
  merge: Merge
  name: str

  def plan(self, params: Any) -> SyncPlan:
    return sync_plan(params, self.every, self.fragments, self.delay, self.name)


class _Fragment(NamedTuple):
  """One fragment's share of the step: the site's and the anchor's leaves and its states."""

  local: Any
  anchor: Any
  outer: Any
  codec: Any
  pending: Any


class _Sent(NamedTuple):
  """Bits and collective calls one step put on the wire (reduce and gather routes)."""

  reduce: Any
  gather: Any
  reduce_calls: jax.Array
  gather_calls: jax.Array

  @classmethod
  def zero(cls) -> "_Sent":
    return cls(bits_zero(), bits_zero(), jnp.int32(0), jnp.int32(0))

  def add(self, other: "_Sent") -> "_Sent":
    return _Sent(bits_add(self.reduce, other.reduce), bits_add(self.gather, other.gather),
                 self.reduce_calls + other.reduce_calls, self.gather_calls + other.gather_calls)


def local_init(config: _Local, params: Any) -> LocalState:
  """The :class:`LocalState` at step 0: the anchor is ``params``, one merge / communicate state per fragment."""
  plan = config.plan(params)
  inner_state = config.inner.init(params)
  _refuse_inner_state(config.name, inner_state)
  parts = [leaves_of(params, plan.leaves, p) for p in range(plan.fragments)]
  codec = tuple(config.communicate.init(part) for part in parts)
  pending = jax.tree.map(jnp.zeros_like, params) if config.delay else None
  return LocalState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.asarray, params), inner_state,
                    tuple(config.merge.init(part) for part in parts), codec, pending,
                    periodic_init(config.every, plan.fragments))


def _send(config: _Local, count: jax.Array, frag: _Fragment) -> tuple[_Fragment, _Sent]:
  """Communicate the fragment's pseudo-gradient; merge it now, or keep it pending (``delay``)."""
  mean, codec, t = config.communicate.run(pseudo_gradient(frag.anchor, frag.local), frag.codec,
                                          count)
  sent = _Sent(as_bits(t.reduce), as_bits(t.gather), jnp.int32(t.reduce_calls),
               jnp.int32(t.gather_calls))
  if config.delay:
    return frag._replace(codec=codec, pending=mean), sent
  local, anchor, outer = config.merge.run(frag.local, frag.anchor, mean, frag.outer)
  return _Fragment(local, anchor, outer, codec, frag.pending), sent


def _merge_pending(config: _Local, frag: _Fragment) -> _Fragment:
  """Merge the average received ``delay`` steps ago."""
  local, anchor, outer = config.merge.run(frag.local, frag.anchor, frag.pending, frag.outer)
  return frag._replace(local=local, anchor=anchor, outer=outer)


def sync_fragment(config: _Local, plan: SyncPlan, p: int, count: jax.Array, frag: _Fragment
                  ) -> tuple[_Fragment, _Sent]:
  """Fragment ``p`` at optimizer step ``count + 1``: send if it is its turn, merge if its average arrives.

  Both run inside ``lax.cond``, so the collective runs only on the steps
  that send.
  """
  step = count + 1
  phase = step % config.every
  send = (phase == plan.send[p]) & (step >= plan.first[p])
  frag, sent = typed_cond(send, functools.partial(_send, config, count),
                          lambda f: (f, _Sent.zero()), frag)
  if config.delay:
    arrive = (phase == plan.merge[p]) & (step - config.delay >= plan.first[p])
    frag = typed_cond(arrive, functools.partial(_merge_pending, config), lambda f: f, frag)
  return frag, sent


def local_update(config: _Local, updates: Any, state: LocalState, params: Any = None,
                 **extra_args) -> tuple[Any, LocalState]:
  """One optimizer step: the inner step on every site, then every fragment's :func:`sync_fragment`."""
  name = config.name
  if params is None:
    raise ValueError(f"{name}: update needs params (tx.update(grads, state, params))")
  if jax.tree.leaves(extra_args.get("model_comm", {})):
    raise ValueError(
        f"{name}: dAD layers communicate in every backward pass, so their gradients are "
        f"already averaged over the sites; local updates and dAD layers do not combine "
        f"(build the model with plain dense layers)")
  plan = config.plan(params)
  inner_updates, inner_state = config.inner.update(updates, state.inner, params)
  local = optax.apply_updates(params, inner_updates)
  anchor, pending = state.anchor, state.pending
  outers, codecs = list(state.outer), list(state.codec)
  sent = _Sent.zero()
  for p in range(plan.fragments):
    part = lambda tree, p=p: leaves_of(tree, plan.leaves, p) if tree is not None else None
    frag = _Fragment(part(local), part(anchor), outers[p], codecs[p], part(pending))
    frag, traffic = sync_fragment(config, plan, p, state.count, frag)
    sent = sent.add(traffic)
    outers[p], codecs[p] = frag.outer, frag.codec
    local = put_leaves(local, frag.local, plan.leaves, p)
    anchor = put_leaves(anchor, frag.anchor, plan.leaves, p)
    if config.delay:
      pending = put_leaves(pending, frag.pending, plan.leaves, p)
  ledger = periodic_record(state.ledger, reduce=sent.reduce, gather=sent.gather,
                           dense=tree_dense_bits(params), reduce_calls=sent.reduce_calls,
                           gather_calls=sent.gather_calls)
  new_updates = jax.tree.map(lambda n, o: (n - o).astype(o.dtype), local, params)
  return new_updates, LocalState(state.count + 1, anchor, inner_state, tuple(outers),
                                 tuple(codecs), pending, ledger)


def local_updates(
    inner: optax.GradientTransformation,
    every: int,
    communicate: Communicate | None = None,
    merge: Merge | None = None,
    *,
    fragments: int = 1,
    delay: int = 0,
    name: str = "local_updates",
) -> optax.GradientTransformationExtraArgs:
  """The general local-update transformation: inner steps, then ``communicate`` and ``merge``.

  Every step runs ``inner`` on the site's gradient. On a fragment's
  synchronization step (:func:`~dadjax.local.sync_plan`) the site's
  pseudo-gradient ``Delta = anchor - local`` goes through
  ``communicate.run`` (the sites' average) and ``merge.run`` (the new
  anchor and site parameters). :func:`local_sgd`, :func:`diloco`,
  :func:`streaming_diloco`, :func:`~dadjax.local.sparseloco` and
  :func:`~dadjax.local.demo` are this function with their own pair.

  Args:
    inner: the local optimizer (an optax transformation that does not communicate).
    every: ``H``, steps between two synchronizations of a fragment (int >= 1).
    communicate: a :class:`~dadjax.local.Communicate` (default
      :func:`~dadjax.local.averaging`: fp32 all-reduce over ``"data"``).
    merge: a :class:`~dadjax.local.Merge` (default
      :func:`~dadjax.local.outer_step`: DiLoCo's outer Nesterov SGD).
    fragments: ``P``, fragments synchronized at staggered steps (default 1).
    delay: ``tau``, steps between a fragment's send and its merge (default 0).
    name: the method's name in error messages.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalState`.

  Raises:
    ValueError: naming the argument and its range; at ``init``, for an
      inner optimizer that communicates or accumulates; at ``update``, for
      dAD layers (their gradients are already averaged).
  """
  inner = _check_inner(name, inner)
  every, fragments, delay = check_schedule(every, fragments, delay, name)
  if communicate is None:
    communicate = averaging()
  elif not isinstance(communicate, Communicate):
    raise ValueError(f"{name}: communicate must be a dadjax.local.Communicate (e.g. "
                     f"dadjax.local.averaging(dadjax.qsgd(4))), got {type(communicate).__name__}")
  if merge is None:
    merge = outer_step()
  elif not isinstance(merge, Merge):
    raise ValueError(f"{name}: merge must be a dadjax.local.Merge (e.g. dadjax.local.outer_step("
                     f"optax.sgd(1.0))), got {type(merge).__name__}")
  config = _Local(optax.with_extra_args_support(inner), every, fragments, delay, communicate,
                  merge, name)
  return optax.GradientTransformationExtraArgs(functools.partial(local_init, config),
                                               functools.partial(local_update, config))
