"""Local SGD, DiLoCo and Streaming DiLoCo: :func:`~dadjax.local.local_updates` with averaging and an outer step.

Each is one composition of the family's public steps: the fp32 all-reduce
or a compressor (:func:`~dadjax.local.averaging`) and an outer optimizer
(:func:`~dadjax.local.outer_step`), with staggered fragments for Streaming
DiLoCo.
"""

from __future__ import annotations

import optax

from dadjax.compress import Compressor
from dadjax.local._periodic import check_compressor, local_updates
from dadjax.local._steps import averaging, named, outer_step


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
    An ``optax.GradientTransformationExtraArgs`` with state :class:`~dadjax.local.LocalState`.

  References:
    S. U. Stich, "Local SGD Converges Fast and Communicates Little", ICLR
    2019 (https://arxiv.org/abs/1805.09767).
  """
  name = "local_sgd"
  with named(name):
    communicate = averaging(axis_name=axis_name)
  return local_updates(inner, every, communicate, outer_step(optax.sgd(1.0)), name=name)


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
    outer: the outer optimizer; default :func:`~dadjax.local.default_outer`.
    compressor: how the pseudo-gradient is averaged: ``None`` (fp32
      all-reduce), a :class:`~dadjax.compress.Compressor` (``bf16``,
      ``qsgd(4)``, ``powersgd(2)``, ``error_feedback(topk(0.01))``, a
      shared-seed ``randomk``) or its spec (``"qsgd:4"``); its state (error
      feedback, warm starts) persists across synchronizations.
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`~dadjax.local.LocalState`
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
  name = "diloco"
  compressor = check_compressor(compressor, name)
  with named(name):
    communicate, merge = averaging(compressor, axis_name=axis_name, seed=seed), outer_step(outer)
  return local_updates(inner, every, communicate, merge, name=name)


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
  (:func:`~dadjax.local.sync_plan`); fragment ``p`` sends its pseudo-gradient every
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
    outer: the outer optimizer; default :func:`~dadjax.local.default_outer`.
    compressor: as for :func:`diloco` (the paper sends 4 bits: ``"qsgd:4"``).
    axis_name: the sites' axis (``None``: one site).
    seed: seed of the compressor's keys.

  Returns:
    An ``optax.GradientTransformationExtraArgs`` with state :class:`~dadjax.local.LocalState`.

  Raises:
    ValueError: as for :func:`diloco`, and for ``fragments`` / ``delay`` /
      ``alpha`` outside their ranges (``fragments`` above the number of
      leaves at ``init``).

  References:
    A. Douillard et al., "Streaming DiLoCo with overlapping communication:
    Towards a Distributed Free Lunch", 2025 (https://arxiv.org/abs/2501.18512).
  """
  name = "streaming_diloco"
  compressor = check_compressor(compressor, name)
  with named(name):
    communicate = averaging(compressor, axis_name=axis_name, seed=seed)
    merge = outer_step(outer, alpha)
  return local_updates(inner, every, communicate, merge, fragments=fragments, delay=delay,
                       name=name)
