"""Local updates: sites step on their own, then synchronize a pseudo-gradient.

One transformation serves local SGD, DiLoCo, Streaming DiLoCo, SparseLoCo
and DeMo. Every optimizer step it runs the inner (local) optimizer on the
site's gradient; on a synchronization step of a fragment of the parameters
(inside ``lax.cond``, so the collective runs only there) it computes the
pseudo-gradient ``Delta = anchor - local`` (the change since the last
synchronization), averages it over the sites (the *communicate* step: an
fp32 all-reduce, any dadjax compressor, or a decaying error-feedback
memory), lets the *merge* step (an outer optimizer) update the anchor with
it and moves the site's parameters to the merged result
(:mod:`dadjax.local._steps`). The update it returns is
``new params - params``, so the train step's ``apply_updates`` lands every
site on the new parameters.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dadjax._core.bits import as_bits
from dadjax._core.vma import branch_matched_cond as typed_cond
from dadjax._core.trees import check_axis_name
from dadjax.comm import (AccumulateState, PeriodicStats, bits_add, bits_zero, find_comm_stats,
                         periodic_init, periodic_record, tree_dense_bits)
from dadjax.compress import Compressor
from dadjax.local._steps import Communicate, Merge, averaging, outer_step


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


class SyncPlan(NamedTuple):
  """Which leaves form each fragment and when each fragment synchronizes.

  Steps are counted from 1 (the first optimizer step is step 1). Fragment
  ``p`` sends its pseudo-gradient on the steps ``t`` with ``t % every ==
  send[p]`` (from step ``first[p]`` on) and merges the averaged result
  ``delay`` steps later, on ``t % every == merge[p]``.

  Attributes:
    every: ``H``, steps between two synchronizations of a fragment.
    delay: ``tau``, steps between a fragment's send and its merge.
    leaves: the fragment of each parameter leaf (flattening order).
    send: per fragment, ``t % every`` of its sends.
    merge: per fragment, ``t % every`` of its merges.
    first: per fragment, the step of its first send.
  """

  every: int
  delay: int
  leaves: tuple[int, ...]
  send: tuple[int, ...]
  merge: tuple[int, ...]
  first: tuple[int, ...]

  @property
  def fragments(self) -> int:
    return len(self.send)

  def sends(self, step: int) -> tuple[int, ...]:
    """The fragments that send on (1-based) ``step``."""
    return tuple(p for p in range(self.fragments)
                 if step >= self.first[p] and step % self.every == self.send[p])

  def merges(self, step: int) -> tuple[int, ...]:
    """The fragments whose averaged pseudo-gradient is merged on ``step``."""
    return tuple(p for p in range(self.fragments)
                 if step - self.delay >= self.first[p] and step % self.every == self.merge[p])


def _split_leaves(sizes: list[int], fragments: int) -> tuple[int, ...]:
  """Contiguous runs of leaves, at least one leaf each, whose largest run is smallest."""
  n = len(sizes)
  prefix = np.concatenate([[0], np.cumsum(sizes)])
  inf = float("inf")
  # best[p][i]: the smallest largest run cutting the first i leaves into p runs
  best = [[inf] * (n + 1) for _ in range(fragments + 1)]
  cut = [[0] * (n + 1) for _ in range(fragments + 1)]
  best[0][0] = 0
  for p in range(1, fragments + 1):
    for i in range(p, n + 1):
      for j in range(p - 1, i):
        value = max(best[p - 1][j], prefix[i] - prefix[j])
        if value < best[p][i]:
          best[p][i], cut[p][i] = value, j
  out, i = [0] * n, n
  for p in range(fragments, 0, -1):
    j = cut[p][i]
    out[j:i] = [p - 1] * (i - j)
    i = j
  return tuple(out)


def sync_plan(params: Any, every: int, fragments: int = 1, delay: int = 0,
              name: str = "sync_plan") -> SyncPlan:
  """The fragments of ``params`` and their synchronization steps.

  The leaves (in flattening order) are cut into ``fragments`` contiguous
  runs whose largest is as small as possible (consecutive layers stay
  together, as in Streaming DiLoCo's sequential fragments; the largest run
  sets the peak per-step traffic). Fragment ``p`` sends on the
  steps ``t`` with ``t % every == ((p + 1) * every // fragments) % every``:
  the sends are staggered evenly over each period and the last fragment
  sends on the multiples of ``every`` (with one fragment: DiLoCo's schedule).

  Args:
    params: the parameters (arrays or shapes).
    every: ``H >= 1``.
    fragments: ``P``, from 1 to the number of leaves and at most ``H``.
    delay: ``tau``, from 0 to ``H - 1``.

  Returns:
    A :class:`SyncPlan`.

  Raises:
    ValueError: naming the argument and its allowed range.
  """
  every, fragments, delay = _check_schedule(every, fragments, delay, name)
  sizes = [int(np.prod(np.shape(x))) for x in jax.tree.leaves(params)]
  if fragments > len(sizes):
    raise ValueError(f"{name}: fragments must be in [1, {len(sizes)}] (the number of parameter leaves), "
                     f"got {fragments}")
  send = tuple(((p + 1) * every // fragments) % every for p in range(fragments))
  merge = tuple((s + delay) % every for s in send)
  first = tuple(s if s else every for s in send)
  return SyncPlan(every, delay, _split_leaves(sizes, fragments), send, merge, first)


def _check_int(name: str, value, low: int, high: int | None = None, why: str = "") -> int:
  ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
  ok = ok and value >= low and (high is None or value <= high)
  if not ok:
    allowed = f"an int >= {low}" if high is None else f"an int in [{low}, {high}]"
    raise ValueError(f"{name} must be {allowed}{why}, got {value!r}")
  return int(value)


def _check_schedule(every, fragments, delay, name: str = "sync_plan") -> tuple[int, int, int]:
  every = _check_int(f"{name}: every", every, 1)
  fragments = _check_int(f"{name}: fragments", fragments, 1, every,
                         f" (at most every={every}: one fragment synchronizes per step)")
  delay = _check_int(f"{name}: delay", delay, 0, every - 1,
                     f" (less than every={every}: a fragment merges before it sends again)")
  return every, fragments, delay


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


def _leaves_of(tree: Any, plan_leaves: tuple[int, ...], p: int) -> Any:
  """``tree`` with the leaves outside fragment ``p`` replaced by ``None`` (paths kept)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [x if f == p else None for x, f in zip(leaves, plan_leaves)])


def _put_leaves(tree: Any, part: Any, plan_leaves: tuple[int, ...], p: int) -> Any:
  """``tree`` with fragment ``p``'s leaves taken from ``part`` (a :func:`_leaves_of` tree)."""
  leaves, treedef = jax.tree.flatten(tree)
  new = iter(jax.tree.leaves(part))
  return jax.tree.unflatten(treedef, [next(new) if f == p else x
                                      for x, f in zip(leaves, plan_leaves)])


def local_updates(
    inner: optax.GradientTransformation,
    every: int,
    *,
    outer: optax.GradientTransformation | None = None,
    compressor: Compressor | str | None = None,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    axis_name: str | None = "data",
    seed: int = 0,
    name: str = "local_updates",
    communicate: Communicate | None = None,
    merge: Merge | None = None,
) -> optax.GradientTransformationExtraArgs:
  """The general local-update transformation behind :func:`local_sgd`, :func:`diloco`,
  :func:`streaming_diloco`, :func:`~dadjax.local.sparseloco` and :func:`~dadjax.local.demo`
  (see those for the arguments).

  The two steps of a synchronization are parameters (:mod:`dadjax.local._steps`):
  ``communicate`` averages a fragment's pseudo-gradient (default
  :func:`~dadjax.local.averaging` of ``compressor``), ``merge`` applies the average
  (default :func:`~dadjax.local.outer_step` of ``outer`` and ``alpha``). Give either
  ``compressor`` or ``communicate``, and either ``outer`` (with ``alpha``) or ``merge``.

  Long because it is one optax factory: init/update closures share the inner
  optimizer, the fragment plan and the two steps.
  """
  inner = _check_inner(name, inner)
  every, fragments, delay = _check_schedule(every, fragments, delay, name)
  if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0 <= alpha <= 1:
    raise ValueError(f"{name}: alpha must be a float in [0, 1] (the weight of the local parameters in "
                     f"the merge), got {alpha!r}")
  alpha = float(alpha)
  axis_name = check_axis_name(axis_name)
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"{name}: seed must be an int, got {seed!r}")
  if merge is None:
    if not isinstance(outer, optax.GradientTransformation):
      raise ValueError(f"{name}: outer must be an optax GradientTransformation (e.g. optax.sgd(0.7, "
                       f"momentum=0.9, nesterov=True)), got {type(outer).__name__}")
    merge = outer_step(outer, alpha)
  elif outer is not None or alpha:
    raise ValueError(f"{name}: give merge or outer / alpha, not both (merge replaces the outer step)")
  elif not isinstance(merge, Merge):
    raise ValueError(f"{name}: merge must be a dadjax.local.Merge (e.g. dadjax.local.outer_step("
                     f"optax.sgd(1.0))), got {type(merge).__name__}")
  if communicate is None:
    communicate = averaging(check_compressor(compressor, name), axis_name=axis_name, seed=seed)
  elif compressor is not None:
    raise ValueError(f"{name}: give communicate or compressor, not both (communicate replaces the "
                     "averaging of the pseudo-gradient)")
  elif not isinstance(communicate, Communicate):
    raise ValueError(f"{name}: communicate must be a dadjax.local.Communicate (e.g. "
                     f"dadjax.local.averaging(dadjax.qsgd(4))), got {type(communicate).__name__}")
  inner = optax.with_extra_args_support(inner)
  plans: dict = {}

  def plan_for(params) -> SyncPlan:
    key = jax.tree.structure(params), tuple(np.shape(x) for x in jax.tree.leaves(params))
    if key not in plans:
      plans[key] = sync_plan(params, every, fragments, delay, name)
    return plans[key]

  def init_fn(params):
    plan = plan_for(params)
    inner_state = inner.init(params)
    _refuse_inner_state(name, inner_state)
    parts = [_leaves_of(params, plan.leaves, p) for p in range(plan.fragments)]
    codec = tuple(communicate.init(part) for part in parts)
    pending = jax.tree.map(jnp.zeros_like, params) if delay else None
    return LocalState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.asarray, params), inner_state,
                      tuple(merge.init(part) for part in parts), codec, pending,
                      periodic_init(every, plan.fragments))

  def update_fn(updates, state, params=None, **extra_args):
    if params is None:
      raise ValueError(f"{name}: update needs params (tx.update(grads, state, params))")
    if jax.tree.leaves(extra_args.get("model_comm", {})):
      raise ValueError(
          f"{name}: dAD layers communicate in every backward pass, so their gradients are "
          f"already averaged over the sites; local updates and dAD layers do not combine "
          f"(build the model with plain dense layers)")
    plan = plan_for(params)
    inner_updates, inner_state = inner.update(updates, state.inner, params)
    local = optax.apply_updates(params, inner_updates)
    step = state.count + 1
    phase = step % every
    anchor, pending = state.anchor, state.pending
    outers, codecs = list(state.outer), list(state.codec)
    zero = (bits_zero(), bits_zero(), jnp.int32(0), jnp.int32(0))
    sent = zero
    for p in range(plan.fragments):
      loc_p, anc_p = _leaves_of(local, plan.leaves, p), _leaves_of(anchor, plan.leaves, p)
      send = (phase == plan.send[p]) & (step >= plan.first[p])

      def do_send(ops, p=p):
        loc_p, anc_p, outer_state, codec_state, pend_p = ops
        delta = jax.tree.map(lambda a, l: a - l, anc_p, loc_p)
        mean, codec_state, t = communicate.run(delta, codec_state, state.count)
        traffic = (as_bits(t.reduce), as_bits(t.gather), jnp.int32(t.reduce_calls),
                   jnp.int32(t.gather_calls))
        if delay:
          pend_p = mean
        else:
          loc_p, anc_p, outer_state = merge.run(loc_p, anc_p, mean, outer_state)
        return (loc_p, anc_p, outer_state, codec_state, pend_p), traffic

      def no_send(ops):
        return ops, zero

      pend_p = _leaves_of(pending, plan.leaves, p) if delay else None
      (loc_p, anc_p, outers[p], codecs[p], pend_p), traffic = typed_cond(
          send, do_send, no_send, (loc_p, anc_p, outers[p], codecs[p], pend_p))
      sent = (bits_add(sent[0], traffic[0]), bits_add(sent[1], traffic[1]),
              sent[2] + traffic[2], sent[3] + traffic[3])
      if delay:
        arrive = (phase == plan.merge[p]) & (step - delay >= plan.first[p])

        def do_merge(ops):
          loc_p, anc_p, outer_state, pend_p = ops
          loc_p, anc_p, outer_state = merge.run(loc_p, anc_p, pend_p, outer_state)
          return loc_p, anc_p, outer_state, pend_p

        loc_p, anc_p, outers[p], pend_p = typed_cond(arrive, do_merge, lambda ops: ops,
                                                     (loc_p, anc_p, outers[p], pend_p))
        pending = _put_leaves(pending, pend_p, plan.leaves, p)
      local = _put_leaves(local, loc_p, plan.leaves, p)
      anchor = _put_leaves(anchor, anc_p, plan.leaves, p)
    ledger = periodic_record(state.ledger, reduce=sent[0], gather=sent[1],
                             dense=tree_dense_bits(params), reduce_calls=sent[2],
                             gather_calls=sent[3])
    new_updates = jax.tree.map(lambda n, o: (n - o).astype(o.dtype), local, params)
    return new_updates, LocalState(step, anchor, inner_state, tuple(outers), tuple(codecs),
                                   pending, ledger)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def local_sgd(inner: optax.GradientTransformation, every: int, *,
              axis_name: str | None = "data") -> optax.GradientTransformationExtraArgs:
  """Local SGD: ``every`` local steps, then the sites average their parameters (fp32).

  Each site runs ``inner`` on its own gradients; on every ``every``-th step
  the sites average their parameters exactly (one fp32 all-reduce of the
  pseudo-gradient, the outer step ``sgd(1.0)``) and continue from the mean.
  With ``every=1`` and ``inner=optax.sgd(lr)`` it is fp32 all-reduce
  training. The inner optimizer's state (momentum) stays per site.

  Args:
    inner: the local optimizer (any optax transformation that does not
      communicate), e.g. ``optax.sgd(0.1, momentum=0.9)``.
    every: ``H``, steps between synchronizations (an int >= 1).
    axis_name: the sites' axis (``None``: one site).

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalState`.

  References:
    S. U. Stich, "Local SGD Converges Fast and Communicates Little", ICLR
    2019 (https://arxiv.org/abs/1805.09767).
  """
  return local_updates(inner, every, outer=optax.sgd(1.0), axis_name=axis_name,
                       name="local_sgd")


def default_outer() -> optax.GradientTransformation:
  """DiLoCo's outer optimizer: SGD with Nesterov momentum, lr 0.7, momentum 0.9."""
  return optax.sgd(0.7, momentum=0.9, nesterov=True)


def diloco(
    inner: optax.GradientTransformation,
    every: int,
    outer: optax.GradientTransformation | None = None,
    compressor: Compressor | str | None = None,
    *,
    axis_name: str | None = "data",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """DiLoCo: ``every`` inner steps per site, then an outer step on the averaged pseudo-gradient.

  Every step runs ``inner`` on the site's gradient (its state is kept
  across synchronizations). On the steps ``t`` with ``t % every == 0`` each
  site computes its pseudo-gradient ``Delta = anchor - params`` (the change
  since the last synchronization, same shapes as the parameters), the sites
  average it through ``compressor`` (``None``: an fp32 all-reduce), the
  outer optimizer updates the anchor (``theta_global``) with it, and every
  site restarts from the new anchor. The collective runs only in that
  ``lax.cond`` branch. Evaluation should read the anchor
  (:meth:`LocalState.evaluation_params`), not a site's local copy.

  With ``every=1``, ``outer=optax.sgd(1.0)`` and no compressor it is the
  mean of each site's own inner step (``chain(inner, allreduce)`` for a
  linear inner optimizer such as SGD).

  Args:
    inner: the local optimizer, e.g. ``optax.adamw(1e-3)`` (the paper's).
    every: ``H``, inner steps per outer step (int >= 1; the paper: 500).
    outer: the outer optimizer; default :func:`default_outer`.
    compressor: how the pseudo-gradient is averaged: ``None`` (fp32
      all-reduce), a :class:`~dadjax.compress.Compressor` (``bf16``,
      ``qsgd(4)``, ``powersgd(2)``, ``error_feedback(topk(0.01))``, a
      shared-seed ``randomk``) or its spec (``"qsgd:4"``); its state (error
      feedback, warm starts) persists across synchronizations.
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalState`
    (ledger: :class:`~dadjax.comm.PeriodicStats`; per optimizer step it
    reports ``payload / every`` bits, and the exchange as the peak step).

  Raises:
    ValueError: naming the argument and its range (``every < 1``, a
      compressor spec that does not parse, ...); at ``init``, for an inner
      optimizer that communicates or accumulates; at ``update``, for dAD
      layers (their gradients are already averaged).

  References:
    A. Douillard et al., "DiLoCo: Distributed Low-Communication Training of
    Language Models", 2023 (https://arxiv.org/abs/2311.08105).
  """
  return local_updates(inner, every, outer=default_outer() if outer is None else outer,
                       compressor=compressor, axis_name=axis_name, seed=seed, name="diloco")


def streaming_diloco(
    inner: optax.GradientTransformation,
    every: int,
    fragments: int = 2,
    delay: int = 1,
    alpha: float = 0.5,
    outer: optax.GradientTransformation | None = None,
    compressor: Compressor | str | None = None,
    *,
    axis_name: str | None = "data",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
  """Streaming DiLoCo: DiLoCo in staggered fragments, overlapped with ``delay`` inner steps.

  The parameter leaves are cut into ``fragments`` contiguous runs
  (:func:`sync_plan`); fragment ``p`` sends its pseudo-gradient every
  ``every`` steps at its own offset, so a step sends at most one fragment
  (the peak bandwidth is about ``1 / fragments`` of DiLoCo's). The averaged
  result is merged ``delay`` steps later, while the sites keep stepping:
  the outer optimizer updates the fragment's anchor with it and the site's
  fragment becomes ``alpha * local + (1 - alpha) * anchor``. The outer
  state is kept per fragment. With ``fragments=1``, ``delay=0`` and
  ``alpha=0`` it is :func:`diloco`.

  Args:
    inner: the local optimizer.
    every: ``H``, steps between two synchronizations of a fragment (int >= 1).
    fragments: ``P``, an int in [1, min(every, number of parameter leaves)].
    delay: ``tau``, steps of overlap, an int in [0, every - 1].
    alpha: weight of the local parameters in the merge, in [0, 1].
    outer: the outer optimizer; default :func:`default_outer`.
    compressor: as for :func:`diloco` (the paper sends 4 bits: ``"qsgd:4"``).
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`LocalState`.

  Raises:
    ValueError: as for :func:`diloco`, and for ``fragments`` / ``delay`` /
      ``alpha`` outside their ranges (``fragments`` above the number of
      leaves at ``init``).

  References:
    A. Douillard et al., "Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512).
  """
  return local_updates(inner, every, outer=default_outer() if outer is None else outer,
                       compressor=compressor, fragments=fragments, delay=delay, alpha=alpha,
                       axis_name=axis_name, seed=seed, name="streaming_diloco")
