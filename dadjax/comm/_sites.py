"""Collectives over a named axis: the sites' size and index, sums, means and gathers.

They work under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)`` alike, so one site function serves every
backend. With ``axis_name=None`` they are the single-site identity, which is
how transformations run in tests and notebooks without a mesh. These are
unmetered: methods use the metered wrappers of :mod:`dadjax.comm._metered`.
"""

from __future__ import annotations

from typing import Any

import jax


def axis_size(axis_name: str | None) -> int:
  """Number of sites along ``axis_name`` (1 without an axis)."""
  return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def site_index(axis_name: str | None) -> jax.Array | int:
  """This site's position along ``axis_name`` (0 without an axis)."""
  return 0 if axis_name is None else jax.lax.axis_index(axis_name)


def mean_over_sites(tree: Any, axis_name: str | None) -> Any:
  """All-reduce mean (psum / N) of every leaf."""
  return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


def sum_over_sites(tree: Any, axis_name: str | None) -> Any:
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def gather_sites(tree: Any, axis_name: str | None, *, invariant: bool = False) -> Any:
  """All-gather every leaf along a new leading site axis.

  Args:
    tree: pytree of per-site arrays.
    axis_name: mesh / pmap / vmap axis name, or ``None`` (adds an axis of 1).
    invariant: type the result as invariant across sites. Under
      ``shard_map(check_vma=True)`` a custom_vjp backward that returns a
      gathered cotangent for a *replicated* parameter needs this; a plain
      gather is typed varying and is rejected.

  Returns:
    The gathered tree, each leaf with shape ``(num_sites, *leaf.shape)``.
  """
  if axis_name is None:
    return jax.tree.map(lambda x: x[None], tree)
  if not invariant:
    return jax.lax.all_gather(tree, axis_name)
  return jax.tree.map(lambda x: _all_gather_invariant(x, axis_name), tree)


def _all_gather_invariant(x, axis_name):
  # Newest JAX: all_gather(..., to="invarying"); some 0.10/0.11 builds only
  # have the private all_gather_invariant. One helper hides the difference.
  try:
    return jax.lax.all_gather(x, axis_name, to="invarying")
  except TypeError:
    from jax._src.lax.parallel import all_gather_invariant  # pylint: disable=g-import-not-at-top
    return all_gather_invariant(x, axis_name)
