"""Collectives over a named axis, and the plain fp32 all-reduce strategy.

The collectives work under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)`` alike, so one site function serves every
backend. With ``axis_name=None`` they are the single-site identity, which is
how transformations run in tests and notebooks without a mesh.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from dadjax._tree_utils import SpecMemo, check_axis_name
from dadjax.comm._ledger import CommStats, ledger_init, ledger_record, tree_dense_bits


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


from dadjax.comm._metered import metered_pmean  # noqa: E402  (the wrappers use gather_sites)


class AllReduceState(NamedTuple):
  comm: CommStats


def allreduce(axis_name: str | None = "data") -> optax.GradientTransformation:
  """Plain data-parallel averaging: fp32 mean of the gradients via ``psum``.

  The baseline every compressor is measured against; it also fills the
  ledger: each site hands ``32 * num_params`` payload bits (fp32 leaves) to
  one all-reduce call per step (XLA may split or merge it into several ops;
  see :func:`~dadjax.comm.hlo_collectives`).

  Args:
    axis_name: the mesh axis the sites live on; ``None`` runs as one site.

  Returns:
    An ``optax.GradientTransformation`` with state :class:`AllReduceState`.

  Raises:
    ValueError: at construction for a bad ``axis_name``; at ``update`` if the
      updates' structure, shapes or dtypes differ from the params at ``init``.

  References:
    Li et al., "PyTorch Distributed: Experiences on Accelerating Data
    Parallel Training", VLDB 2020 (https://arxiv.org/abs/2006.15704).
  """
  axis_name = check_axis_name(axis_name)
  specs = SpecMemo("allreduce")

  def init_fn(params):
    specs.record(params)
    return AllReduceState(ledger_init())

  def update_fn(updates, state, params=None):
    del params
    specs.check(updates)
    dense = tree_dense_bits(updates)
    updates, traffic = metered_pmean(updates, axis_name)
    comm = ledger_record(state.comm, reduce=traffic.reduce, dense=dense,
                         reduce_calls=traffic.reduce_calls)
    return updates, AllReduceState(comm)

  return optax.GradientTransformation(init_fn, update_fn)
