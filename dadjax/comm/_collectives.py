"""The plain fp32 all-reduce strategy (the baseline every method is measured against)."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from dadjax._core.trees import SpecMemo, check_axis_name
from dadjax.comm._ledger import CommStats, ledger_init, ledger_record, tree_dense_bits
from dadjax.comm._metered import metered_pmean


class AllReduceState(NamedTuple):
  comm: CommStats


def allreduce(axis_name: str | None = "data") -> optax.GradientTransformation:
  """Plain data-parallel averaging: fp32 mean of the gradients via ``psum``.

  The baseline every compressor is measured against. Gradients of a narrower
  float type (fp16, bf16) are reduced in fp32 and cast back. It also fills the
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
    # The mean in fp32 (as documented), cast back: fp16 gradients that each fit fp16
    # may sum past its range. Wider leaves (fp64) keep their type.
    wide = jax.tree.map(lambda g: g.astype(jnp.promote_types(g.dtype, jnp.float32))
                        if jnp.issubdtype(g.dtype, jnp.floating) else g, updates)
    mean, traffic = metered_pmean(wide, axis_name)
    updates = jax.tree.map(lambda m, g: m.astype(g.dtype), mean, updates)
    comm = ledger_record(state.comm, reduce=traffic.reduce, dense=dense,
                         reduce_calls=traffic.reduce_calls)
    return updates, AllReduceState(comm)

  return optax.GradientTransformation(init_fn, update_fn)
