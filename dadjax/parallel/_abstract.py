"""A train step's state and batch as ``jax.ShapeDtypeStruct`` with their shardings.

What :meth:`TrainStep.init` and :meth:`TrainStep.place_batch` would make,
without allocating: ``step.lower(abstract_state(step, key, x),
abstract_batch(step, batch)).compile()`` compiles the step for its mesh's
devices, real ones or a TPU topology's abstract ones
(:func:`dadjax.pod.compile_step`), as MaxText's ``train_compile`` does.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from dadjax.parallel._state import TAG_BASE, key_data


def abstract_state(step, key: jax.Array, sample_x: Any, **init_kwargs) -> Any:
  """The site-stacked :class:`~dadjax.parallel.TrainState` of ``step.init(key, sample_x)`` as
  ``ShapeDtypeStruct`` leaves (``jax.eval_shape`` of the initialization: nothing allocated).

  On the ``shard_map`` backend each leaf carries the ``NamedSharding`` of
  :meth:`~dadjax.parallel.TrainStep.state_specs`. ``sample_x`` (one site's
  rows) may itself be a ``ShapeDtypeStruct``.
  """
  base = key_data(jax.random.fold_in(key, TAG_BASE))  # host data: computed outside the trace
  one_site = jax.eval_shape(
      lambda x: step._site_state(key, x, base, **init_kwargs), sample_x)  # pylint: disable=protected-access
  stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct((step.num_sites, *s.shape), s.dtype),
                         one_site)
  if step.backend != "shard_map":
    return stacked
  shardings = step.placement.shardings(step.state_specs(stacked))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                      stacked, shardings)


def abstract_batch(step, batch: Any) -> Any:
  """A global batch (arrays or ``ShapeDtypeStruct``: only shapes and dtypes are read) as
  ``ShapeDtypeStruct`` with the step's batch sharding (``shard_map`` backend); checked as
  :meth:`~dadjax.parallel.TrainStep.check_batch` checks a host batch."""
  step.check_batch(batch)
  sharding = step.placement.batch_sharding if step.backend == "shard_map" else None
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding),
                      batch)
