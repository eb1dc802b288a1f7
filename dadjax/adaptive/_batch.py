"""Accordion's batch-size mode: the detector switches the global batch size.

Every call of ``update`` is one *micro-step* on one micro-batch (the global
batch the train step was given). Gradients are accumulated locally for ``k``
micro-steps and only then averaged, handed to the wrapped (communicating)
transformation and applied; ``k`` is ``small`` in a critical regime and
``large`` otherwise, a traced number, so switching does not recompile. The
effective global batch is ``k`` micro-batches. The detector sees every
micro-step's uncompressed local gradient and tracks one whole-model norm;
its window is counted in micro-steps (a fixed number of samples, e.g. an
epoch). ``k`` changes only between cycles: the next cycle is small when the
detector was critical after any micro-step of the cycle that just ended (so a
short critical period, such as a learning-rate decrease cleared by a check in
the middle of a cycle, still gives at least one small-batch cycle), else large.

Learning-rate scaling: as the reference, the learning rate follows the linear
scaling rule (Goyal et al. 2017): an update made from ``k`` micro-batches is
multiplied by ``k / small``, so the large batch steps with ``large / small``
times the learning rate of the small one. With ``scale_lr=False`` updates are
left as the wrapped transformation returns them.

The accumulation is local and communicates once per cycle: the wrapped
transformation runs under ``lax.cond`` on a predicate that is equal on every
site (micro-step counters and detector decisions are), so all sites issue the
same collectives in the same micro-step.

References:
  Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive
  Gradient Communication via Critical Learning Regime Identification",
  MLSys 2021 (https://arxiv.org/abs/2010.16248), section 4 (batch size);
  Goyal et al., "Accurate, Large Minibatch SGD: Training ImageNet in 1
  Hour", 2017 (https://arxiv.org/abs/1706.02677).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.critical import lr_decreased as _lr_decreased
from dadjax._core.shards import require_whole_leaves
from dadjax._core.validate import check_int
from dadjax._core.accumulate import accumulate_step
from dadjax._core.trees import tree_zeros_like
from dadjax.adaptive._detector import (
    DetectorState,
    check_window,
    detector_init,
    detector_lr_decrease,
    detector_update,
    norm_bits,
)
from dadjax.comm import CommStats, bits_from_count, host_array, ledger_init, ledger_record
from dadjax.compress import shardable_compressors


class AccordionBatchState(NamedTuple):
  """State of :func:`accordion_batch`.

  Attributes:
    micro: int32 micro-steps taken.
    pending: int32 micro-steps accumulated in the current cycle.
    k: int32 micro-steps of the current cycle (``small`` or ``large``).
    last_k: int32 micro-steps behind the last applied update (0 before one).
    updates: int32 updates applied (cycles completed).
    critical_seen: bool, the detector was critical after some micro-step of
      the current cycle.
    acc: this site's gradients summed over the current cycle.
    detector: the whole-model :class:`DetectorState` (T = 1).
    inner: the wrapped transformation's state.
    lr: fp32 learning rate at the last micro-step (``-1`` without schedule).
    comm: ledger of the detector's norm all-reduces (the wrapped
      transformation keeps its own ledger).
  """

  micro: jax.Array
  pending: jax.Array
  k: jax.Array
  last_k: jax.Array
  updates: jax.Array
  critical_seen: jax.Array
  acc: Any
  detector: DetectorState
  inner: Any
  lr: jax.Array
  comm: CommStats

  def metrics_row(self, params: Any = None) -> dict:
    """:func:`batch_row` of this state (the train loop merges it into its rows)."""
    del params
    return batch_row(self)


def accordion_batch(
    tx: optax.GradientTransformation,
    small: int = 1,
    large: int = 8,
    *,
    window: int,
    interval: int = 1,
    eta: float = 0.5,
    lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
    scale_lr: bool = True,
    axis_name: str | None = "data",
) -> optax.GradientTransformationExtraArgs:
  """Switch the global batch between ``small`` and ``large`` micro-batches.

  Long because of its docstring; the code is an optax factory with init/update closures.

  Args:
    tx: the transformation applied once per cycle to the mean of the
      accumulated gradients; it communicates (e.g. ``optax.chain(
      dadjax.allreduce("data"), optax.sgd(0.1))`` or a compressor chain).
    small: micro-batches per update in a critical regime, int >= 1.
    large: micro-batches per update otherwise, int >= ``small``.
    window: micro-steps per detector window, int >= 1 (an epoch).
    interval: windows between checks, int >= 1.
    eta: threshold on the relative change of the whole-model norm, > 0.
    lr_schedule: schedule of the micro-step count (micro-step -> learning
      rate), read only to detect decreases; or ``None``. A caller may also
      pass ``update(..., lr_decreased=True)``.
    scale_lr: multiply each update by ``k / small`` (linear scaling rule).
    axis_name: the sites' axis; ``None`` runs as one site.

  Returns:
    An optax transformation with state :class:`AccordionBatchState`; it
    returns zero updates on micro-steps that only accumulate.

  Raises:
    ValueError: for out-of-range hyperparameters.
  """
  small = check_int("small", small)
  large = check_int("large", large)
  if large < small:
    raise ValueError(f"large must be an int >= small={small}, got {large}")
  window, interval, eta = check_window(window, interval, eta)
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable (step -> lr) or None, got {lr_schedule!r}")
  if not isinstance(scale_lr, bool):
    raise ValueError(f"scale_lr must be a bool, got {scale_lr!r}")
  inner_tx = optax.with_extra_args_support(tx)

  def init_fn(params):
    zero = jnp.zeros([], jnp.int32)
    return AccordionBatchState(zero, zero, jnp.int32(small), zero, zero, jnp.zeros([], bool),
                               tree_zeros_like(params),
                               detector_init(params, whole_model=True), inner_tx.init(params),
                               jnp.float32(-1.0), ledger_init())

  def update_fn(updates, state, params=None, *, lr_decreased=None, **extra):
    require_whole_leaves("accordion_batch", shardable_compressors)  # its decisions read per-tensor gradient norms
    detector = state.detector
    lr = state.lr
    if lr_schedule is not None:
      detector = detector_lr_decrease(detector, _lr_decreased(lr_schedule, state.micro))
      lr = jnp.asarray(lr_schedule(state.micro), jnp.float32)
    if lr_decreased is not None:
      detector = detector_lr_decrease(detector, lr_decreased)
    detector, exchanged = detector_update(detector, updates, window=window, interval=interval,
                                          eta=eta, axis_name=axis_name, whole_model=True)
    comm = ledger_record(state.comm, reduce=bits_from_count(exchanged, norm_bits(detector)),
                         reduce_calls=exchanged.astype(jnp.int32))
    # Accumulation with a traced number of micro-steps ``state.k``: local sums, one
    # call of the wrapped transformation (its collectives) per cycle.
    seen = state.critical_seen | detector.critical[0]
    next_k = jnp.where(seen, small, large).astype(jnp.int32)

    def apply(mean, inner):
      out, inner = inner_tx.update(mean, inner, params, **extra)
      if scale_lr:
        factor = state.k.astype(jnp.float32) / small
        out = jax.tree.map(lambda u: (u * factor).astype(u.dtype), out)
      return out, inner

    step = accumulate_step(apply, updates, state.acc, state.pending, state.inner, state.k,
                           refs=params)
    out, acc, inner, pending, fired = step
    k = jnp.where(fired, next_k, state.k)
    last_k = jnp.where(fired, state.k, state.last_k)
    count = state.updates + fired.astype(jnp.int32)
    seen = seen & ~fired
    new_state = AccordionBatchState(state.micro + 1, pending, k, last_k, count, seen, acc,
                                    detector, inner, lr, comm)
    return out, new_state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def batch_row(state: Any, *, site: int = 0) -> dict:
  """One metrics row (host values) of the batch-size mode.

  Args:
    state: any state holding an :class:`AccordionBatchState` (stacked per
      site or not).
    site: the site to read when stacked (all sites agree).

  Returns:
    A dict of host values: ``"accordion_batch/micro"`` (int),
    ``"accordion_batch/k"`` (int, current cycle), ``"accordion_batch/last_k"``
    (int), ``"accordion_batch/updates"`` (int), ``"accordion_batch/critical"``
    (0 | 1), ``"accordion_batch/norm"`` (float), and ``"accordion_batch/lr"``
    with a schedule.
  """
  found = [x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, AccordionBatchState))
           if isinstance(x, AccordionBatchState)]
  if not found:
    raise ValueError("the state holds no AccordionBatchState")
  s = found[0]
  stacked = host_array(s.micro).ndim > 0

  def get(x):
    x = host_array(x)
    return x[site] if stacked else x

  row = {"accordion_batch/micro": int(get(s.micro)), "accordion_batch/k": int(get(s.k)),
         "accordion_batch/last_k": int(get(s.last_k)),
         "accordion_batch/updates": int(get(s.updates)),
         "accordion_batch/critical": int(get(s.detector.critical)[0]),
         "accordion_batch/norm": float(get(s.detector.norms)[0])}
  lr = float(get(s.lr))
  if lr >= 0:
    row["accordion_batch/lr"] = lr
  return row
