"""Accordion's critical-regime detector: pure functions on pytrees.

Each site accumulates its *uncompressed* local gradient per parameter tensor
over a window of ``window`` steps (an epoch in the training loop). At the end
of every window the sites all-reduce (mean) the norms of their accumulated
tensors -- one float per tensor per window -- so every later decision is made
from numbers that are equal on every site. Windows are numbered 0, 1, 2, ...;
a *check* happens at the end of each window ``w`` with ``w % interval == 0``
and compares that window's norm with the norm of the previous check window
(``interval`` windows earlier)::

    critical  <=>  |‖g_old‖ − ‖g_now‖| / ‖g_old‖ >= eta   (‖g_old‖ = 0: critical)

Before any check every tensor is critical (the first window), and the first
check (window 0) has no earlier norm, so it is critical too: windows
``0 .. interval`` run in the critical regime. A learning-rate decrease makes
every tensor critical until the next check.

The detector's collectives run only at window ends (under ``lax.cond`` on the
step counter, equal on every site); :func:`detector_update` reports whether
they ran so that the caller's ledger books them only then.

References:
  Agarwal, Wang, Lee, Venkataraman & Papailiopoulos, "Accordion: Adaptive
  Gradient Communication via Critical Learning Regime Identification",
  MLSys 2021 (https://arxiv.org/abs/2010.16248).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from dadjax._core.critical import is_critical
from dadjax._core.linalg import safe_norm
from dadjax._core.validate import check_int, is_real
from dadjax._core.vma import cond
from dadjax.comm import axis_size, metered_psum

NORM_BITS = 32  # one fp32 norm per tensor per window


class DetectorState(NamedTuple):
  """The detector of one site.

  Attributes:
    steps: int32, steps accumulated in the current window.
    windows: int32, windows completed.
    accum: tuple of fp32 arrays, this site's gradient summed over the current
      window, one per tracked tensor (one whole-model vector is not formed:
      with ``whole_model`` the tensors are tracked jointly).
    ref_norms: (T,) fp32, the all-reduced norms of the last check window
      (0 before the first check).
    norms: (T,) fp32, the all-reduced norms of the last completed window.
    critical: (T,) bool, the current decision per tracked tensor (T = number
      of tensors, or 1 with ``whole_model``).
  """

  steps: jax.Array
  windows: jax.Array
  accum: tuple
  ref_norms: jax.Array
  norms: jax.Array
  critical: jax.Array


def check_window(window, interval, eta) -> tuple[int, int, float]:
  """Validate the detector's hyperparameters (``ValueError`` naming the argument)."""
  window, interval = check_int("window", window), check_int("interval", interval)
  if not is_real(eta) or not 0 < eta < float("inf"):
    raise ValueError(f"eta must be a finite number > 0, got {eta!r}")
  return window, interval, float(eta)


def detector_init(params: Any, *, whole_model: bool = False) -> DetectorState:
  """A fresh detector for the tensors of ``params``: every tensor critical.

  Args:
    params: the parameters (or gradients) pytree; leaves in
      ``jax.tree.leaves`` order are the tracked tensors.
    whole_model: track one norm over all tensors (batch-size mode).

  Returns:
    :class:`DetectorState` with ``T = len(leaves)`` (or 1).
  """
  leaves = jax.tree.leaves(params)
  t = 1 if whole_model else len(leaves)
  return DetectorState(
      steps=jnp.zeros([], jnp.int32),
      windows=jnp.zeros([], jnp.int32),
      accum=tuple(jnp.zeros(jnp.shape(x), jnp.float32) for x in leaves),
      ref_norms=jnp.zeros([t], jnp.float32),
      norms=jnp.zeros([t], jnp.float32),
      critical=jnp.ones([t], bool),
  )


def detector_lr_decrease(state: DetectorState, decreased: jax.Array | bool) -> DetectorState:
  """Make every tensor critical (until the next check) when ``decreased`` is true."""
  return state._replace(critical=state.critical | jnp.asarray(decreased, bool))


def _local_norms(accum: tuple, whole_model: bool) -> jax.Array:
  # Scale-safe: 1e30-sized (or 1e-30-sized) gradients neither overflow nor underflow.
  norms = jnp.stack([safe_norm(a.reshape(-1)) for a in accum]) if accum else jnp.zeros([0])
  return safe_norm(norms)[None] if whole_model else norms


def detector_update(
    state: DetectorState,
    grads: Any,
    *,
    window: int,
    interval: int = 1,
    eta: float = 0.5,
    axis_name: str | None = "data",
    whole_model: bool = False,
) -> tuple[DetectorState, jax.Array]:
  """Add one step's uncompressed local gradient; at a window end, all-reduce and decide.

  Args:
    state: the detector.
    grads: this site's gradients (same structure as at init).
    window: steps per window (>= 1).
    interval: windows between checks (>= 1).
    eta: threshold of :func:`is_critical`.
    axis_name: the sites' axis (``None``: one site).
    whole_model: as at :func:`detector_init`.

  Returns:
    ``(state, exchanged)``: the new detector and a bool scalar, true when
    this step ended a window and the norms were all-reduced
    (``T * 32`` bits in one call, see :func:`norm_bits`).
  """
  state, exchanged, _ = detector_update_with(state, grads, (), window=window, interval=interval,
                                             eta=eta, axis_name=axis_name, whole_model=whole_model)
  return state, exchanged


def detector_update_with(
    state: DetectorState,
    grads: Any,
    riders: tuple,
    *,
    window: int,
    interval: int = 1,
    eta: float = 0.5,
    axis_name: str | None = "data",
    whole_model: bool = False,
) -> tuple[DetectorState, jax.Array, tuple]:
  """:func:`detector_update` whose norms share one all-reduce with ``riders``.

  ``riders`` (fp32 arrays this site all-reduces every step, e.g. Accordion's
  uncompressed 1-D tensors) are averaged over the sites in the same buffer
  as the window-end norms (a window end: one all-reduce of riders + norms;
  any other step: one of the riders alone, none without riders).

  Returns:
    ``(state, exchanged, riders_mean)``.
  """
  leaves = jax.tree.leaves(grads)
  accum = tuple(a + x.astype(jnp.float32) for a, x in zip(state.accum, leaves))
  steps = state.steps + 1
  end = steps >= window
  n = axis_size(axis_name)

  def close(ops):
    accum, _, windows, ref, _, critical, riders = ops
    (riders, norms), _ = metered_psum((riders, _local_norms(accum, whole_model)), axis_name)
    riders, norms = tuple(r / n for r in riders), norms / n
    check = windows % interval == 0
    critical = jnp.where(check, is_critical(ref, norms, eta), critical)
    ref = jnp.where(check, norms, ref)
    zeros = tuple(jnp.zeros_like(a) for a in accum)
    return zeros, jnp.zeros([], jnp.int32), windows + 1, ref, norms, critical, riders

  def keep(ops):
    *kept, riders = ops
    riders, _ = metered_psum(riders, axis_name)
    return (*kept, tuple(r / n for r in riders))

  ops = (accum, steps, state.windows, state.ref_norms, state.norms, state.critical, tuple(riders))
  accum, steps, windows, ref, norms, critical, riders = cond(end, close, keep, ops)
  return DetectorState(steps, windows, accum, ref, norms, critical), end, riders


def norm_bits(state: DetectorState) -> int:
  """Bits one site hands to the all-reduce at a window end: 32 per tracked norm."""
  return NORM_BITS * int(state.critical.shape[-1])
