"""``accordion(low, high)``: per tensor, switch between two compressor settings.

Each update: the detector's current decision picks, per tensor with ndim >= 2,
the ``low``-compression setting (critical regime) or the ``high`` one. The
decisions are equal on every site, so every site issues the same collectives.
The tensors are batched by shape (:mod:`dadjax.adaptive._switch`): a group
of ``B`` equal-shape tensors is cut into ``floor(log2 B) + 1`` static chunks,
the members are placed by their decisions so that each chunk holds one
setting's members, and each chunk runs one vmapped exchange of its setting
under one ``lax.cond``: every tensor sends its own setting's payload once. The
setting a tensor did not
choose keeps its state (PowerSGD's warm-start ``Q``) untouched, so after an
excursion to the other setting it resumes where it stopped; the residual
(error-feedback) memory is one per tensor, shared by both settings (see
:func:`accordion`, ``share_memory``). Tensors with ndim <= 1 are all-reduced
uncompressed in fp32, in one buffer with the detector's window-end norms.
Then the detector takes this step's uncompressed local gradient (see
:mod:`dadjax.adaptive._detector`).
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.layers import per_layer, unstack
from dadjax._core.critical import lr_decreased as _lr_decreased
from dadjax._core.shards import require_whole_leaves
from dadjax._core.trees import path_names
from dadjax.adaptive._detector import (
    DetectorState,
    check_window,
    detector_init,
    detector_lr_decrease,
    detector_update_with,
    norm_bits,
)
from dadjax.adaptive._switch import compressed, split_memory, switch
from dadjax.comm import (
    Bits,
    CommStats,
    bits_add,
    bits_const,
    bits_from_count,
    host_array,
    ledger_init,
    ledger_record,
    tree_dense_bits,
)
from dadjax.compress import Compressor, shardable_compressors, step_keys


class AccordionState(NamedTuple):
  """State of :func:`accordion`.

  Attributes:
    count: int32 step counter (drives the keys and the LR schedule).
    detector: the :class:`DetectorState` (per-tensor ``critical`` decisions
      and window ``norms``, one entry per leaf of the parameters).
    low: one state of the ``low`` setting per leaf (``()`` for ndim <= 1).
    high: one state of the ``high`` setting per leaf (``()`` for ndim <= 1).
    memory: per leaf, the error-feedback memory both settings share (then
      their states in ``low`` / ``high`` hold ``memory=()``), or ``()``.
    compressed: (T,) bool, per leaf: ndim >= 2 (sent through a compressor).
    sent_low: (T,) bool, per leaf: sent with ``low`` in the last step (False
      for uncompressed leaves).
    lr: fp32 learning rate of the last step (``-1`` without ``lr_schedule``).
    comm: the ledger: the chosen settings' payloads, the uncompressed
      tensors and, at window ends, the detector's norms.
  """

  count: jax.Array
  detector: DetectorState
  low: tuple
  high: tuple
  memory: tuple
  compressed: jax.Array
  sent_low: jax.Array
  lr: jax.Array
  comm: CommStats

  def metrics_row(self, params: Any = None) -> dict:
    """:func:`accordion_row` of this state (the train loop merges it into its rows)."""
    return accordion_row(self, params)


def accordion(
    low: Compressor,
    high: Compressor,
    *,
    window: int,
    interval: int = 1,
    eta: float = 0.5,
    lr_schedule: Callable[[jax.Array], jax.Array] | None = None,
    axis_name: str | None = "data",
    seed: int = 0,
    share_memory: bool = True,
) -> optax.GradientTransformationExtraArgs:
  """Accordion: compress with ``low`` in critical regimes and ``high`` elsewhere.

  Per tensor with ndim >= 2 (a one-leaf tree given to
  :func:`dadjax.compress.exchange`, with the tensor's own keys and state):
  ``low`` when the detector marks it critical, else ``high``. Tensors with
  ndim <= 1 go through one fp32 all-reduce, together with the detector's
  norms at window ends. The decision used at step ``t`` is the one of the
  last check (all tensors critical until the first checks, and all critical
  after a learning-rate decrease until the next check); the step's
  uncompressed local gradient then enters the detector.

  Collectives (module docstring): ``2 (floor(log2 B) + 1)`` exchanges per
  group of ``B`` equal-shape tensors; each tensor sends exactly its chosen
  setting's payload, and the ledger records what was sent.

  Memory (``share_memory=True``): when both settings keep a residual memory
  of the same shape (both ``error_feedback(...)`` of some compressor, or both
  PowerSGD with its own error feedback) the tensor keeps *one* memory, which
  the setting that runs reads and rewrites; each setting keeps only its own
  remaining state (PowerSGD's warm-start ``Q``). The memory holds what this
  site's gradient has not yet delivered, whatever the compression level, so
  a switch hands it on instead of freezing it. This is the direct reading of
  the paper's Algorithm 1, which per layer only switches the compression
  level it calls (``l_low`` or ``l_high``) and keeps no per-level memory; it
  also keeps the train state at one memory per tensor instead of two.
  ``share_memory=False`` keeps a memory per
  setting (each resumes its own after an excursion). The ledger records
  what was sent that step.

  A learning-rate decrease is read from ``lr_schedule`` (``schedule(t) <
  schedule(t - 1)``) or signalled by the caller with the extra argument
  ``tx.update(..., lr_decreased=True)``.

  Args:
    low: the low-compression :class:`~dadjax.compress.Compressor` (critical
      regime), e.g. ``powersgd(rank=2)`` or ``error_feedback(topk(0.99))``.
    high: the high-compression one, e.g. ``powersgd(rank=1)`` or
      ``error_feedback(topk(0.1))``.
    window: steps per detector window, int >= 1 (steps per epoch in the
      paper).
    interval: windows between checks, int >= 1 (10 for CIFAR in the paper).
    eta: threshold on the relative change of the norm, finite > 0 (0.5).
    lr_schedule: the optimizer's ``optax`` schedule (step -> learning rate),
      or ``None``.
    axis_name: the sites' axis; ``None`` runs as one site.
    seed: seed of the compressors' keys (step ``t``, tensor ``i``:
      ``fold_in(fold_in(key(seed), t), i)``).
    share_memory: one error-feedback memory per tensor for both settings
      (default ``True``, see above); ``False``: one per setting.

  Returns:
    An optax transformation with state :class:`AccordionState`.

  Raises:
    ValueError: if ``low`` / ``high`` are not compressors or a
      hyperparameter is out of range.

  References:
    Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive
    Gradient Communication via Critical Learning Regime Identification",
    MLSys 2021 (https://arxiv.org/abs/2010.16248).
  """
  opts = _check_options(low, high, window, interval, eta, lr_schedule, axis_name, seed,
                        share_memory)
  # a leaf stacked by nn.scan is L tensors: L detectors, L decisions, L exchanges
  return per_layer(optax.GradientTransformationExtraArgs(functools.partial(_init, opts),
                                                         functools.partial(_update, opts)))


class _Options(NamedTuple):
  """The options of :func:`accordion`, checked."""

  low: Compressor
  high: Compressor
  window: int
  interval: int
  eta: float
  lr_schedule: Callable[[jax.Array], jax.Array] | None
  axis_name: str | None
  seed: int
  share_memory: bool


def _check_options(low, high, window, interval, eta, lr_schedule, axis_name, seed,
                   share_memory) -> _Options:
  for name, c in (("low", low), ("high", high)):
    if not isinstance(c, Compressor):
      raise ValueError(f"{name} must be a dadjax.compress.Compressor, got {type(c).__name__}")
  window, interval, eta = check_window(window, interval, eta)
  if lr_schedule is not None and not callable(lr_schedule):
    raise ValueError(f"lr_schedule must be callable (step -> lr) or None, got {lr_schedule!r}")
  if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
    raise ValueError(f"seed must be an int, got {seed!r}")
  if not isinstance(share_memory, bool):
    raise ValueError(f"share_memory must be a bool, got {share_memory!r}")
  return _Options(low, high, window, interval, eta, lr_schedule, axis_name, seed, share_memory)


def _init(opts: _Options, params) -> AccordionState:
  """Every decision critical; per compressed leaf a state of each setting (and one shared memory)."""
  leaves = jax.tree.leaves(params)
  lows, highs, memory = [], [], []
  for x in leaves:
    if not compressed(x):
      lows.append(()), highs.append(()), memory.append(())
      continue
    a, b = opts.low.init((x,)), opts.high.init((x,))
    if opts.share_memory:
      a, b, m = split_memory(a, b)
    else:
      m = ()
    lows.append(a), highs.append(b), memory.append(m)
  flags = jnp.asarray([compressed(x) for x in leaves], bool)
  return AccordionState(jnp.zeros([], jnp.int32), detector_init(params), tuple(lows),
                        tuple(highs), tuple(memory), flags, jnp.zeros([len(leaves)], bool),
                        jnp.float32(-1.0), ledger_init())


def _learning_rate(opts: _Options, state: AccordionState, lr_decreased) -> tuple:
  """The detector told of a learning-rate decrease (schedule or caller), and the step's lr."""
  detector = state.detector
  if opts.lr_schedule is not None:
    detector = detector_lr_decrease(detector, _lr_decreased(opts.lr_schedule, state.count))
    lr = jnp.asarray(opts.lr_schedule(state.count), jnp.float32)
  else:
    lr = state.lr
  if lr_decreased is not None:
    detector = detector_lr_decrease(detector, lr_decreased)
  return detector, lr


def _update(opts: _Options, updates, state: AccordionState, params=None, *, lr_decreased=None,
            **extra):
  """Exchange each tensor with its decision's setting; the rest and the norms in one all-reduce."""
  require_whole_leaves("accordion", shardable_compressors)  # its decisions read per-tensor gradient norms
  del params, extra
  leaves, treedef = jax.tree.flatten(updates)
  detector, lr = _learning_rate(opts, state, lr_decreased)
  keys = step_keys(opts.seed, state.count, opts.axis_name)

  means, lows, highs, memory, reduce, gather, reduce_calls, gather_calls = switch(
      opts.low, opts.high, leaves, detector.critical, state.low, state.high, state.memory, keys,
      opts.axis_name)
  # The uncompressed tensors ride in the detector's all-reduce (one buffer with the norms).
  raw = [i for i, x in enumerate(leaves) if not compressed(x)]
  sent_low = state.compressed & detector.critical
  detector, exchanged, averaged = detector_update_with(
      detector, updates, tuple(leaves[i].astype(jnp.float32) for i in raw), window=opts.window,
      interval=opts.interval, eta=opts.eta, axis_name=opts.axis_name)
  for i, v in zip(raw, averaged):
    means[i] = v.astype(leaves[i].dtype)
  raw_bits = tree_dense_bits(averaged)
  reduce = bits_add(reduce, bits_add(bits_const(raw_bits),
                                     bits_from_count(exchanged, norm_bits(detector))))
  reduce_calls = reduce_calls + jnp.where(exchanged | bool(raw), 1, 0).astype(jnp.int32)
  comm = ledger_record(state.comm, reduce=reduce, gather=gather,
                       dense=tree_dense_bits(updates), reduce_calls=reduce_calls,
                       gather_calls=gather_calls)
  new_state = AccordionState(state.count + 1, detector, lows, highs, memory,
                             state.compressed, sent_low, lr, comm)
  return jax.tree.unflatten(treedef, means), new_state


def _is_accordion(x) -> bool:
  return isinstance(x, AccordionState)


def find_accordion_state(state: Any) -> AccordionState:
  """The (first) :class:`AccordionState` inside any optax / train state.

  Raises:
    ValueError: if there is none.
  """
  found = [x for x in jax.tree.leaves(state, is_leaf=_is_accordion) if _is_accordion(x)]
  if not found:
    raise ValueError("the state holds no AccordionState; is dadjax.adaptive.accordion part of "
                     "the optimizer?")
  return found[0]


def tensor_names(params: Any) -> list[str]:
  """Names of the leaves of ``params`` (``"Dense_0/kernel"``), in leaf order; inside
  :func:`dadjax.stacked_layers`, each layer of a stacked leaf (``"blocks/kernel/0"``)."""
  flat, _ = jax.tree_util.tree_flatten_with_path(unstack(params))
  return ["/".join(path_names(path)) for path, _ in flat]


def accordion_row(state: Any, params: Any = None, *, site: int = 0) -> dict:
  """One metrics row (host Python values) of the Accordion decisions and norms.

  Args:
    state: any state holding an :class:`AccordionState` (an optax state, or
      a train state whose leaves are stacked per site: ``site`` is read;
      the decisions are equal on every site).
    params: the parameters, for tensor names (default ``t0``, ``t1``, ...).
    site: the site to read when the state is stacked.

  Returns:
    A dict of host values: ``"accordion/step"`` (int), ``"accordion/window"``
    (int), ``"accordion/lr"`` (float, only with a schedule),
    ``"accordion/low/<name>"`` (0 | 1, sent with ``low`` in the last step;
    ndim <= 1 tensors are absent), ``"accordion/critical/<name>"`` (0 | 1,
    decision for the next step), ``"accordion/norm/<name>"`` (float, last
    window's all-reduced norm).
  """
  acc = find_accordion_state(state)
  count = host_array(acc.count)
  stacked = count.ndim > 0

  def get(x):
    x = host_array(x)
    return x[site] if stacked else x

  critical, norms, sent_low = get(acc.detector.critical), get(acc.detector.norms), get(acc.sent_low)
  names = tensor_names(params) if params is not None else [f"t{i}" for i in range(len(critical))]
  if len(names) != len(critical):
    raise ValueError(f"params has {len(names)} tensors, the state tracks {len(critical)}")
  compressed = get(acc.compressed)
  row: dict = {"accordion/step": int(get(acc.count)),
               "accordion/window": int(get(acc.detector.windows))}
  lr = float(get(acc.lr))
  if lr >= 0:
    row["accordion/lr"] = lr
  for name, c, n, s, comp in zip(names, critical, norms, sent_low, compressed):
    if comp:
      row[f"accordion/low/{name}"] = int(s)
    row[f"accordion/critical/{name}"] = int(c)
    row[f"accordion/norm/{name}"] = float(n)
  return row
