"""Splitting a data set across sites, and site-major global batches."""

from typing import Iterator, List, Optional, Sequence, Tuple

import numpy as np

SCHEMES = ("iid", "by_class", "dirichlet")


def partition(
  labels: np.ndarray,
  num_sites: int,
  scheme: str = "iid",
  alpha: float = 0.5,
  seed: int = 0,
) -> List[np.ndarray]:
  """Splits example indices across ``num_sites`` sites.

  Schemes:

  * ``"iid"``: a seeded shuffle cut into ``num_sites`` near-equal parts.
  * ``"by_class"``: the sorted classes are cut into ``num_sites`` contiguous
    groups (near-equal numbers of classes) and site ``i`` holds every example
    of group ``i``; e.g. MNIST over 2 sites gives digits 0-4 / 5-9 (the dAD
    paper's split). Needs ``num_sites <= number of classes``.
  * ``"dirichlet"``: for every class, proportions over sites are drawn from
    ``Dirichlet(alpha)`` and the class's shuffled examples are cut
    accordingly (the usual non-IID benchmark; small ``alpha`` = more skew).
    An empty site then takes one example from the largest site, so every
    site holds at least one example.

  Args:
    labels: int labels, shape ``(n,)``.
    num_sites: number of sites, in ``[1, n]``.
    scheme: one of ``"iid"``, ``"by_class"``, ``"dirichlet"``. Default "iid".
    alpha: Dirichlet concentration, > 0 (dirichlet only). Default 0.5.
    seed: integer seed; the result is deterministic in all arguments.

  Returns:
    A list of ``num_sites`` sorted int64 index arrays, disjoint and together
    covering ``range(n)``.
  """
  labels = np.asarray(labels)
  if labels.ndim != 1:
    raise ValueError(f"labels must be 1-D, got shape {labels.shape}.")
  n = len(labels)
  if not 1 <= num_sites <= n:
    raise ValueError(f"num_sites must be in [1, {n}] (number of examples), got {num_sites}.")
  if scheme not in SCHEMES:
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}.")
  if not alpha > 0:
    raise ValueError(f"alpha must be > 0, got {alpha}.")
  rng = np.random.default_rng(seed)
  classes = np.unique(labels)

  if scheme == "iid":
    parts = np.array_split(rng.permutation(n), num_sites)
  elif scheme == "by_class":
    if num_sites > len(classes):
      raise ValueError(
        f"num_sites must be <= the number of classes ({len(classes)}) for "
        f"scheme='by_class', got {num_sites}."
      )
    parts = [np.flatnonzero(np.isin(labels, g)) for g in np.array_split(classes, num_sites)]
  else:
    chunks = [[] for _ in range(num_sites)]
    for c in classes:
      idx = rng.permutation(np.flatnonzero(labels == c))
      p = np.nan_to_num(rng.dirichlet(np.full(num_sites, float(alpha))))
      if p.sum() <= 0:  # Underflow at tiny alpha: all mass on one site.
        p = np.eye(num_sites)[rng.integers(num_sites)]
      cuts = np.round(np.cumsum(p / p.sum())[:-1] * len(idx)).astype(int)
      for s, chunk in enumerate(np.split(idx, cuts)):
        chunks[s].append(chunk)
    parts = [np.concatenate(ch) for ch in chunks]
    for s in range(num_sites):
      if len(parts[s]) == 0:
        d = int(np.argmax([len(q) for q in parts]))
        parts[s], parts[d] = parts[d][-1:], parts[d][:-1]
  return [np.sort(p).astype(np.int64) for p in parts]


def partition_summary(
  labels: np.ndarray,
  parts: Sequence[np.ndarray],
  num_classes: Optional[int] = None,
) -> str:
  """A text table of examples per site and per class.

  Args:
    labels: int labels, shape ``(n,)``.
    parts: index arrays, one per site (as returned by `partition`).
    num_classes: number of class columns; default ``max(labels) + 1``.

  Returns:
    One header row, one row per site (``site``, ``n``, count per class) and a
    final ``all`` row.
  """
  labels = np.asarray(labels)
  k = int(labels.max()) + 1 if num_classes is None else int(num_classes)
  counts = np.stack([np.bincount(labels[p], minlength=k)[:k] for p in parts])
  w = max(4, len(str(int(counts.sum()))) + 1)
  fmt = lambda name, row: (
    f"{name:>4} {int(row.sum()):>{w}} |" + "".join(f"{int(c):>{w}}" for c in row)
  )
  head = f"{'site':>4} {'n':>{w}} |" + "".join(f"{c:>{w}}" for c in range(k))
  rows = [fmt(str(i), r) for i, r in enumerate(counts)]
  return "\n".join([head] + rows + [fmt("all", counts.sum(0))])


class SiteBatcher:
  """Deterministic site-major global batches, addressable by step.

  The global batch at step ``t`` has ``num_sites * batch_per_site`` rows;
  rows ``[i * b, (i + 1) * b)`` come from site ``i`` -- the layout that a
  batch sharded over the ``data`` mesh axis expects (one block per device).

  Each site reads its own examples as an endless stream of passes, each pass
  a fresh permutation seeded by ``(seed, site, pass)``; step ``t`` takes
  stream positions ``[t * b, (t + 1) * b)``. So batches depend only on
  ``(seed, step)``: training resumes exactly from a saved integer step, and
  small sites simply wrap around (reshuffled) more often than large ones.
  One epoch is defined as ``steps_per_epoch = max(1, total // global_batch)``
  steps, i.e. as many examples as the whole data set.

  Args:
    x: inputs, shape ``(n, ...)``.
    y: labels, shape ``(n,)``.
    parts: non-empty index arrays into ``x``, one per site.
    batch_per_site: rows per site per step, in ``[1, min site size]``.
    seed: integer seed of the per-site shuffles. Default 0.

  Attributes:
    num_sites: number of sites.
    batch_per_site: rows per site per step.
    global_batch: ``num_sites * batch_per_site``.
    steps_per_epoch: steps in one epoch (see above).
  """

  def __init__(self, x, y, parts: Sequence[np.ndarray], batch_per_site: int, seed: int = 0):
    if len(x) != len(y):
      raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}.")
    if len(parts) < 1:
      raise ValueError("parts must hold at least one site.")
    self.parts = [np.asarray(p, np.int64) for p in parts]
    sizes = [len(p) for p in self.parts]
    if min(sizes) < 1:
      raise ValueError(f"every site in parts must be non-empty, got sizes {sizes}.")
    if any(p.min() < 0 or p.max() >= len(x) for p in self.parts):
      raise ValueError(f"parts must index into [0, {len(x)}).")
    if not 1 <= batch_per_site <= min(sizes):
      raise ValueError(
        f"batch_per_site must be in [1, {min(sizes)}] (smallest site), got {batch_per_site}."
      )
    self.x, self.y, self.seed = x, y, seed
    self.num_sites = len(self.parts)
    self.batch_per_site = int(batch_per_site)
    self.global_batch = self.num_sites * self.batch_per_site
    self.steps_per_epoch = max(1, sum(sizes) // self.global_batch)
    self._perms = {}

  def _perm(self, site: int, r: int) -> np.ndarray:
    key = (site, r)
    if key not in self._perms:
      if len(self._perms) > 4 * self.num_sites:
        self._perms.clear()
      rng = np.random.default_rng([self.seed, site, r])
      self._perms[key] = self.parts[site][rng.permutation(len(self.parts[site]))]
    return self._perms[key]

  def _sites(self, sites: Optional[Sequence[int]]) -> list:
    if sites is None:
      return list(range(self.num_sites))
    out = [int(s) for s in sites]
    bad = [s for s in out if not 0 <= s < self.num_sites]
    if bad or len(set(out)) != len(out) or not out:
      raise ValueError(f"sites must be distinct site ids in [0, {self.num_sites}), at least "
                       f"one, got {list(sites)}.")
    return out

  def indices_at(self, step: int, sites: Optional[Sequence[int]] = None) -> np.ndarray:
    """Example indices of the batch at ``step`` (>= 0), site-major.

    Args:
      step: the step, >= 0.
      sites: the sites whose rows to draw, in this order (default: every
        site, ``0 .. num_sites - 1``). Each site's rows depend only on
        ``(seed, site, step)``, so the rows of ``sites`` are exactly those
        sites' blocks of the global batch: a process feeding some sites
        samples only theirs.

    Returns:
      Shape ``(len(sites) * batch_per_site,)``.
    """
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}.")
    b, out = self.batch_per_site, []
    for s in self._sites(sites):
      p = self.parts[s]
      pos = step * b + np.arange(b)
      r, off = np.divmod(pos, len(p))
      out.append(np.concatenate([self._perm(s, int(q))[off[r == q]] for q in np.unique(r)]))
    return np.concatenate(out)

  def batch_at(self, step: int, sites: Optional[Sequence[int]] = None
               ) -> Tuple[np.ndarray, np.ndarray]:
    """The ``(x, y)`` batch at ``step``: the global one (leading dim
    ``global_batch``), or only the rows of ``sites`` (see `indices_at`)."""
    idx = self.indices_at(step, sites)
    return self.x[idx], self.y[idx]

  def iterate(
    self, start_step: int = 0, num_steps: Optional[int] = None
  ) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
    """Yields `batch_at` for ``start_step, start_step + 1, ...``
    (``num_steps`` of them, or forever when None)."""
    step = start_step
    while num_steps is None or step < start_step + num_steps:
      yield self.batch_at(step)
      step += 1


def site_batches(
  x, y, parts: Sequence[np.ndarray], batch_per_site: int, seed: int = 0, epoch: int = 0
) -> Iterator[Tuple[np.ndarray, np.ndarray]]:
  """Yields the site-major ``(x, y)`` global batches of one epoch.

  Shorthand for ``SiteBatcher(x, y, parts, batch_per_site, seed).iterate(
  epoch * spe, spe)`` with ``spe`` its ``steps_per_epoch``; see `SiteBatcher`
  for the layout and determinism.

  Args:
    x: inputs, shape ``(n, ...)``.
    y: labels, shape ``(n,)``.
    parts: index arrays, one per site.
    batch_per_site: rows per site per step, in ``[1, min site size]``.
    seed: integer seed.
    epoch: epoch number, >= 0.

  Returns:
    An iterator of ``steps_per_epoch`` pairs with leading dim
    ``len(parts) * batch_per_site``.
  """
  if epoch < 0:
    raise ValueError(f"epoch must be >= 0, got {epoch}.")
  batcher = SiteBatcher(x, y, parts, batch_per_site, seed)
  spe = batcher.steps_per_epoch
  return batcher.iterate(epoch * spe, spe)
