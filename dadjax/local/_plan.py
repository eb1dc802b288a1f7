"""The fragment plan of a local-update method: which leaves form each fragment, and when it syncs.

Streaming DiLoCo cuts the parameters into fragments that synchronize at
staggered steps; DiLoCo, SparseLoCo and DeMo are the one-fragment case.
:func:`sync_plan` computes the plan from the parameters' shapes alone
(trace time, Python ints); :func:`leaves_of` / :func:`put_leaves` cut one
fragment out of a parameter-shaped tree and put it back.
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import numpy as np


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
  every, fragments, delay = check_schedule(every, fragments, delay, name)
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


def check_schedule(every, fragments, delay, name: str = "sync_plan") -> tuple[int, int, int]:
  """``(every, fragments, delay)`` as ints, or a ``ValueError`` naming the argument and its range."""
  every = _check_int(f"{name}: every", every, 1)
  fragments = _check_int(f"{name}: fragments", fragments, 1, every,
                         f" (at most every={every}: one fragment synchronizes per step)")
  delay = _check_int(f"{name}: delay", delay, 0, every - 1,
                     f" (less than every={every}: a fragment merges before it sends again)")
  return every, fragments, delay


def leaves_of(tree: Any, plan_leaves: tuple[int, ...], p: int) -> Any:
  """``tree`` with the leaves outside fragment ``p`` replaced by ``None`` (paths kept)."""
  leaves, treedef = jax.tree.flatten(tree)
  return jax.tree.unflatten(treedef, [x if f == p else None for x, f in zip(leaves, plan_leaves)])


def put_leaves(tree: Any, part: Any, plan_leaves: tuple[int, ...], p: int) -> Any:
  """``tree`` with fragment ``p``'s leaves taken from ``part`` (a :func:`leaves_of` tree)."""
  leaves, treedef = jax.tree.flatten(tree)
  new = iter(jax.tree.leaves(part))
  return jax.tree.unflatten(treedef, [next(new) if f == p else x
                                      for x, f in zip(leaves, plan_leaves)])
