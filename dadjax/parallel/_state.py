"""The train state, its site-stacked layout and the keys of each site and step.

Random numbers: ``TrainState.rng`` holds a base key (raw ``uint32`` key
data, replicated) derived at ``TrainStep.init`` as ``fold_in(init_key,
tag("base"))``. At step ``t`` site ``s`` gets the model key
``fold_in(fold_in(fold_in(base, tag("model")), t), s)``; the default loss
turns it into one key per rng stream (``"dropout"``) with
:func:`~dadjax.parallel.stream_key`. A batch stage gets the shared key
``fold_in(fold_in(base, tag("stage")), t)`` and the site key
``fold_in(fold_in(shared, tag("site")), s)``. ``tag(name)`` is
``crc32("dadjax.step/" + name) mod 2**31``. Keys depend only on the base key
(checkpointed with the state), the step and the site, so a resumed run draws
exactly the keys of an uninterrupted one, and every site draws different
dropout masks.
"""

from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import jax
import numpy as np

from dadjax.comm import CommStats, host_array


def _tag(name: str) -> int:
  """Domain-separation constant of one key purpose: ``crc32("dadjax.step/" + name) mod 2**31``."""
  return zlib.crc32(f"dadjax.step/{name}".encode()) & 0x7FFFFFFF


TAG_BASE, TAG_MODEL, TAG_STAGE, TAG_SITE = (_tag(n) for n in ("base", "model", "stage", "site"))


class TrainState(NamedTuple):
  """Training state, every leaf stacked along a leading site axis.

  Attributes:
    step: int32 step counter (the data position).
    params: the ``"params"`` collection.
    opt_state: the optax state (with its ledgers).
    model_state: the other collections, e.g. ``{"dad_state": ..., "batch_stats": ...}``.
    rng: the base key's raw ``uint32`` data (module docstring: how keys are derived).
    comm: the step's own :class:`~dadjax.comm.CommStats` (communication
      outside the optimizer).
    stage_state: the batch stage's state (``None`` without a stage).
    intra_comm: with a 2-D mesh, the step's in-site ledger
      (:class:`~dadjax.comm.IntraSiteStats`: the exact in-site averaging);
      ``None`` on a 1-D mesh and the other backends.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any
  rng: Any = None
  comm: CommStats | None = None
  stage_state: Any = None
  intra_comm: Any = None


def stack_sites(tree: Any, num_sites: int) -> Any:
  """Copy every leaf ``num_sites`` times along a new leading axis."""
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_sites,) + np.shape(x)).copy(), tree)


def unstack_site(tree: Any, site: int = 0) -> Any:
  """The copy held by one site (host numpy), e.g. the trained parameters."""
  return jax.tree.map(lambda x: host_array(x)[site], tree)


def unstack_shapes(tree: Any) -> Any:
  """``ShapeDtypeStruct`` of one site's copy of a site-stacked tree."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], x.dtype), tree)


def _is_typed_key(key) -> bool:
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def key_data(key) -> np.ndarray:
  """Raw ``uint32`` data of a typed or raw key (what the state stores and checkpoints)."""
  return np.asarray(jax.random.key_data(key if _is_typed_key(key) else jax.random.wrap_key_data(key)))


def site_keys(base, step, site) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The keys of one site and step: ``(model, stage_shared, stage_site)``.

  Args:
    base: the base key (typed key or raw ``uint32`` data, ``TrainState.rng``
      of one site).
    step: the step counter.
    site: the site index.

  Returns:
    The model key (per site), the stage's shared key and the stage's site key.
  """
  if not _is_typed_key(base):
    base = jax.random.wrap_key_data(base)
  model = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, TAG_MODEL), step), site)
  shared = jax.random.fold_in(jax.random.fold_in(base, TAG_STAGE), step)
  return model, shared, jax.random.fold_in(jax.random.fold_in(shared, TAG_SITE), site)
