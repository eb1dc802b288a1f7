"""Which sites' rows a process feeds, and a batch of some sites' rows put in place.

A global batch is site-major: rows ``[i * b, (i + 1) * b)`` belong to site
``i``. Under ``shard_map`` on many processes each process's devices hold
only some sites' rows, so a process needs to sample and hold only those
(:func:`local_sites`); :func:`put_site_rows` builds the global array from
them, each device taking its block from the rows of its own site.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def local_sites(placement: Any) -> tuple[int, ...]:
  """The sites whose rows this process's devices hold, ascending.

  Every site under ``vmap`` and ``pmap`` (one process); under
  ``shard_map``, the sites of this process's devices on the mesh (all of
  them in a one-process run).
  """
  if placement.backend != "shard_map":
    return tuple(range(placement.num_sites))
  per_site = placement.rows_per_site_unit
  index = placement.batch_sharding.addressable_devices_indices_map((placement.num_sites * per_site,))
  return tuple(sorted({(rows[0].start or 0) // per_site for rows in index.values()}))


def check_sites(sites: Sequence[int] | None, num_sites: int, local: Sequence[int]
                ) -> tuple[int, ...]:
  """``sites`` as a tuple (default: every site), checked to cover ``local``.

  Raises:
    ValueError: ``sites`` are not distinct ids in ``[0, num_sites)`` or leave
      out a site this process feeds (both named).
  """
  if sites is None:
    return tuple(range(num_sites))
  if isinstance(sites, (str, bytes)) or not hasattr(sites, "__len__"):
    raise ValueError(f"sites must be a sequence of site ids, got {sites!r}")
  out = tuple(int(s) for s in sites)
  if not out or len(set(out)) != len(out) or not all(0 <= s < num_sites for s in out):
    raise ValueError(f"sites must be distinct site ids in [0, {num_sites}), got {list(sites)}")
  missing = sorted(set(local) - set(out))
  if missing:
    raise ValueError(f"sites {list(out)} leave out site(s) {missing} whose rows this process "
                     f"feeds; give the rows of step.local_sites = {list(local)}")
  return out


def global_order(x: Any, sites: tuple[int, ...]) -> np.ndarray:
  """The rows of ``sites`` (every site, in any order) as the site-major global batch."""
  x = np.asarray(x)
  if sites == tuple(range(len(sites))):
    return x
  b = len(x) // len(sites)
  return np.concatenate([x[j * b:(j + 1) * b] for j in np.argsort(sites)])


def put_site_rows(x: Any, sites: tuple[int, ...], num_sites: int,
                  sharding: NamedSharding) -> jax.Array:
  """The global batch leaf of ``num_sites`` sites from the rows of ``sites``.

  Args:
    x: ``len(sites) * b`` rows, site-major in the order of ``sites``.
    sites: the sites of ``x``'s blocks (every site this process's devices
      hold among them).
    num_sites: sites of the global batch.
    sharding: the batch's sharding (rows split site-major over the devices).

  Returns:
    A ``(num_sites * b, ...)`` array; each addressable device's block is
    copied from the rows of its site (no other rows are read).
  """
  x = np.asarray(x)
  b = len(x) // len(sites)
  where = {s: i for i, s in enumerate(sites)}
  shape = (num_sites * b,) + x.shape[1:]

  def block(index):
    rows = index[0]
    start = rows.start or 0
    stop = shape[0] if rows.stop is None else rows.stop
    site, offset = divmod(start, b)
    first = where[site] * b + offset
    return x[(slice(first, first + stop - start),) + tuple(index[1:])]

  return jax.make_array_from_callback(shape, sharding, block)
