"""A heat map of Accordion's decisions, with the learning rate on the same time axis."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

_LOW = "accordion/low/"
_CRITICAL = "accordion/critical/"


def decision_matrix(rows: Sequence[dict], *, step_key: str = "accordion/step"
                    ) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray | None]:
  """Which compressed tensor was sent with the ``low`` setting at each logged step.

  Args:
    rows: metrics rows as made by :func:`accordion_row` (other keys are
      ignored; rows without Accordion keys are skipped). Rows of rank-dAD
      layers under Accordion (:func:`dadjax.dad.accordion_rows`) carry no
      ``low`` keys: their ``accordion/critical/<layer>`` decisions (1: the
      high rank next) are drawn instead.
    step_key: the key of the time axis.

  Returns:
    ``(steps (S,), names (T,), low (T, S) int8, lr (S,) or None)``; ``low``
    is 1 where the tensor went with ``low`` (critical), 0 with ``high``, -1
    where a row does not name the tensor. ``lr`` is present when every row
    has ``"accordion/lr"``.

  Raises:
    ValueError: if no row holds Accordion decisions.
  """
  prefix = _LOW if any(k.startswith(_LOW) for r in rows for k in r) else _CRITICAL
  rows = [r for r in rows if any(k.startswith(prefix) for k in r)]
  if not rows:
    raise ValueError("rows: no row holds Accordion decisions ('accordion/low/...' or "
                     "'accordion/critical/...' keys)")
  names: list[str] = []
  for r in rows:
    for k in r:
      if k.startswith(prefix) and k[len(prefix):] not in names:
        names.append(k[len(prefix):])
  steps = np.asarray([r.get(step_key, r.get("step", i)) for i, r in enumerate(rows)])
  low = np.full((len(names), len(rows)), -1, np.int8)
  for j, r in enumerate(rows):
    for i, n in enumerate(names):
      if prefix + n in r:
        low[i, j] = int(r[prefix + n])
  lr = None
  if all("accordion/lr" in r for r in rows):
    lr = np.asarray([r["accordion/lr"] for r in rows], np.float64)
  return steps, names, low, lr


def plot_decisions(rows: Sequence[dict], path: Any = None, *, title: str = "Accordion"):
  """Draw the decisions heat map (tensors x steps) above the learning rate.

  Args:
    rows: metrics rows (see :func:`decision_matrix`).
    path: where to save the figure (PNG, ...); ``None`` only returns it.
    title: the figure title.

  Returns:
    The matplotlib ``Figure`` (pyplot's backend: Agg without a display).
  """
  # pyplot's own backend choice: Agg without a display, inline in a notebook.
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  from matplotlib.colors import ListedColormap  # pylint: disable=g-import-not-at-top

  steps, names, low, lr = decision_matrix(rows)
  fig, axes = plt.subplots(2, 1, sharex=True, figsize=(9, 2 + 0.3 * len(names)),
                           gridspec_kw={"height_ratios": [max(2, len(names) * 0.3), 1]})
  cmap = ListedColormap(["#dddddd", "#d95f02", "#1b9e77"])  # missing, high, low
  edges = np.append(steps, steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1))
  axes[0].pcolormesh(edges, np.arange(len(names) + 1), low.astype(float), cmap=cmap,
                     vmin=-1.5, vmax=1.5, shading="flat")
  axes[0].set_yticks(np.arange(len(names)) + 0.5, names, fontsize=7)
  axes[0].set_title(f"{title}: green = low compression (critical), orange = high")
  if lr is not None:
    axes[1].step(steps, lr, where="post")
  else:
    axes[1].text(0.5, 0.5, "no learning-rate schedule logged", ha="center",
                 transform=axes[1].transAxes)
  axes[1].set_ylabel("learning rate")
  axes[1].set_xlabel("step")
  fig.tight_layout()
  if path is not None:
    fig.savefig(path)
  return fig
