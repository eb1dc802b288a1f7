"""One SPMD training step for every method and every backend.

The step is written once, as the program of a single site: compute the
local gradient, hand it to the optax transformation (which performs the
collective over ``axis_name``), apply the update. Three backends run that
site program:

* ``"shard_map"``: ``jax.shard_map`` over a mesh (one or many hosts),
* ``"pmap"``: ``jax.pmap`` over local devices,
* ``"vmap"``: ``jax.vmap(..., axis_name=...)``: all sites simulated on one
  device (collectives work under vmap), for studying 16 or 64 sites on a
  laptop or a single GPU.

Layout: every array of the :class:`TrainState` carries a leading site axis
of size ``num_sites`` (the layout ``pmap`` uses). Parameters are replicated,
one identical copy per site; optimizer state may differ per site (error
feedback memories, local accumulators), and needs no special case. Under
``shard_map`` the site axis is sharded over the mesh, so each device holds
exactly its own site's copy. The batch is global, site-major: rows
``[i * b, (i + 1) * b)`` belong to site ``i``.

Models that communicate inside their own backward pass (dAD layers) report
the bits they sent by sowing :class:`~dadjax.comm.Bits` into the
``"comm"`` collection; the step forwards that collection to the optimizer
as the ``model_comm`` extra argument so it lands in the same ledger. Variables in
the ``"dad_state"`` collection are differentiated and *overwritten* with
their gradient (the pattern Flax uses for fp8 scales), which is how a layer
keeps state (warm starts, error feedback) across steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from dadjax.comm import COMM_COLLECTION, STATE_COLLECTION, host_array, mean_over_sites
from dadjax.parallel._mesh import make_mesh

BACKENDS = ("shard_map", "pmap", "vmap")


class TrainState(NamedTuple):
  """Training state, every leaf stacked along a leading site axis."""

  step: jax.Array
  params: Any
  opt_state: Any
  model_state: Any  # non-parameter collections, e.g. {"dad_state": ...}


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
  """Mean cross-entropy of integer ``labels`` (batch,) under ``logits`` (batch, classes)."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def stack_sites(tree: Any, num_sites: int) -> Any:
  """Copy every leaf ``num_sites`` times along a new leading axis."""
  return jax.tree.map(lambda x: np.broadcast_to(np.asarray(x), (num_sites,) + np.shape(x)).copy(), tree)


def unstack_site(tree: Any, site: int = 0) -> Any:
  """The copy held by one site (host numpy), e.g. the trained parameters."""
  return jax.tree.map(lambda x: host_array(x)[site], tree)


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A compiled SPMD training step and the placement that goes with it.

  Build it with :func:`make_train_step`. ``init`` makes a placed
  :class:`TrainState`; calling the object runs one step on a global batch
  ``{"x": (num_sites * b, ...), "y": (num_sites * b,)}`` and returns
  ``(state, metrics)`` with metrics averaged over sites.
  """

  model: Any
  tx: optax.GradientTransformation
  loss: Callable[[jax.Array, jax.Array], jax.Array]
  num_sites: int
  axis_name: str
  backend: str
  mesh: Any
  _run: Callable

  def init(self, key: jax.Array, sample_x: Any) -> TrainState:
    """Initialize parameters from ``key`` and replicate them over the sites."""
    variables = self.model.init(key, sample_x)
    variables = dict(variables)
    params = variables.pop("params")
    variables.pop(COMM_COLLECTION, None)
    state = TrainState(np.zeros((), np.int32), params, self.tx.init(params), variables)
    return self.place(stack_sites(state, self.num_sites))

  def place(self, tree: Any) -> Any:
    """Put a site-stacked pytree where this backend expects it."""
    if self.backend == "shard_map":
      sharding = NamedSharding(self.mesh, P(self.axis_name))
      return jax.tree.map(
          lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx, x=x: np.asarray(x)[idx]),
          tree)
    return jax.tree.map(jnp.asarray, tree)  # pmap shards its inputs itself

  def check_batch(self, batch: Any) -> None:
    """Raise a clear error if the global batch does not split over the sites."""
    for leaf in jax.tree.leaves(batch):
      rows = np.shape(leaf)[0] if np.ndim(leaf) else None
      if rows is None or rows % self.num_sites or rows == 0:
        raise ValueError(
            f"batch: the global batch of {rows} rows does not divide over "
            f"num_sites={self.num_sites}; use a multiple of {self.num_sites}")

  def __call__(self, state: TrainState, batch: Any):
    return self._run(state, self.place_batch(batch))

  def run(self, state: TrainState, placed_batch: Any):
    """One step on a batch already placed by :meth:`place_batch` (timing loops)."""
    return self._run(state, placed_batch)

  def place_batch(self, batch: Any) -> Any:
    """Check a global host batch and put it where this backend expects it."""
    self.check_batch(batch)
    if self.backend == "shard_map":
      sharding = NamedSharding(self.mesh, P(self.axis_name))
      return jax.tree.map(
          lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx, x=x: np.asarray(x)[idx]),
          batch)
    split = jax.tree.map(lambda x: np.reshape(np.asarray(x), (self.num_sites, -1) + np.shape(x)[1:]), batch)
    return split if self.backend == "pmap" else jax.tree.map(jnp.asarray, split)

  def collectives(self, state: TrainState, batch: Any):
    """The collective ops the compiled step runs, read from its optimized HLO.

    Lowers and compiles the step once for these shapes and returns
    a :class:`~dadjax.comm.CollectiveOps`: per kind, the op count and
    operand bytes per site. Pass it to ``NetworkModel.step_time(summary,
    ops=...)`` to charge latency per compiled op. The count includes the
    step's own metric all-reduces, and ops under ``lax.cond`` (both branches
    are compiled; see ``conditional_count``). ``backend="vmap"`` simulates
    the sites on one device: its program has no collective ops.
    """
    from dadjax.comm import hlo_collectives  # pylint: disable=g-import-not-at-top
    return hlo_collectives(self._run.lower(state, self.place_batch(batch)).compile().as_text())

  def params(self, state: TrainState, site: int = 0) -> Any:
    """One site's parameters as host arrays (all sites hold the same)."""
    return unstack_site(state.params, site)


class LocalGradients(NamedTuple):
  """One site's backward pass, before the optimizer sees it."""

  loss: jax.Array
  logits: jax.Array
  grads: Any  # gradients of the "params" collection
  model_state: Any  # non-parameter collections after the step (overwritten state)
  extra_args: dict  # optax extra arguments: {"model_comm": sown bits} when a layer communicated


def local_gradients(model, loss, params, model_state, batch) -> LocalGradients:
  """Loss, logits and gradients of one site's rows, as the train step computes them.

  Layers that communicate in their backward pass (dAD) have already done so
  when this returns; their sown bits come back in ``extra_args`` for
  ``tx.update(..., **extra_args)``, and their ``"dad_state"`` variables are
  replaced by their gradient (the new state).
  """
  x, y = batch["x"], batch["y"]
  overwrite = {k: v for k, v in model_state.items() if k == STATE_COLLECTION}
  fixed = {k: v for k, v in model_state.items() if k != STATE_COLLECTION}

  def loss_fn(diff_vars):
    logits, sown = model.apply({**fixed, **diff_vars}, x, mutable=[COMM_COLLECTION])
    return loss(logits, y), (logits, sown)

  (value, (logits, sown)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
      {"params": params, **overwrite})
  extra = {}
  if jax.tree.leaves(sown.get(COMM_COLLECTION, {})):
    extra["model_comm"] = sown[COMM_COLLECTION]
  new_model_state = {**fixed, **{k: grads[k] for k in overwrite}}
  return LocalGradients(value, logits, grads["params"], new_model_state, extra)


def _site_program(model, tx, loss, axis_name):
  """The step as one site runs it; collectives name ``axis_name``."""
  tx = optax.with_extra_args_support(tx)

  def site_step(state: TrainState, batch):
    local = local_gradients(model, loss, state.params, state.model_state, batch)
    updates, opt_state = tx.update(local.grads, state.opt_state, state.params, **local.extra_args)
    params = optax.apply_updates(state.params, updates)
    metrics = {
        "loss": local.loss,
        "accuracy": jnp.mean((jnp.argmax(local.logits, -1) == batch["y"]).astype(jnp.float32)),
    }
    metrics = mean_over_sites(metrics, axis_name)
    return TrainState(state.step + 1, params, opt_state, local.model_state), metrics

  return site_step


def make_train_step(
    model,
    tx: optax.GradientTransformation,
    *,
    loss: Callable[[jax.Array, jax.Array], jax.Array] = softmax_cross_entropy,
    num_sites: int | None = None,
    axis_name: str = "data",
    backend: str = "shard_map",
    mesh=None,
    donate: bool = False,
) -> TrainStep:
  """Build the jitted SPMD training step.

  Args:
    model: a Flax linen module; ``model.apply(variables, x)`` returns logits.
    tx: any optax transformation; a dadjax communicating transformation in
      it (``dadjax.allreduce(axis_name)``, a compressor, dAD's sync) does the
      collective. A plain optax optimizer alone leaves sites unsynchronized.
    loss: ``loss(logits, labels) -> scalar`` mean over the site's rows.
    num_sites: number of sites; default: the mesh size (shard_map), the
      local device count (pmap), required for vmap.
    axis_name: the axis the collectives name; default ``"data"``.
    backend: ``"shard_map"``, ``"pmap"`` or ``"vmap"``.
    mesh: a 1-D mesh for shard_map (default: :func:`make_mesh`).
    donate: donate the input state's buffers to the output (saves memory;
      the input state must not be used afterwards).

  Returns:
    A :class:`TrainStep`.
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  site_step = _site_program(model, tx, loss, axis_name)
  donate_argnums = (0,) if donate else ()

  if backend == "shard_map":
    if mesh is None:
      mesh = make_mesh(num_sites, axis_name)
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    num_sites = mesh.shape[axis_name]

    def blocked(state, batch):
      state = jax.tree.map(lambda x: x[0], state)
      new_state, metrics = site_step(state, batch)
      return jax.tree.map(lambda x: x[None], (new_state, metrics))

    run = jax.jit(
        jax.shard_map(blocked, mesh=mesh, in_specs=(P(axis_name), P(axis_name)),
                      out_specs=P(axis_name)),
        donate_argnums=donate_argnums)
  elif backend == "pmap":
    num_sites = num_sites or jax.local_device_count()
    if num_sites > jax.local_device_count():
      raise ValueError(f"num_sites must be <= {jax.local_device_count()} local devices "
                       f"for backend='pmap', got {num_sites}")
    run = jax.pmap(site_step, axis_name=axis_name, donate_argnums=donate_argnums)
  else:
    if not (isinstance(num_sites, int) and num_sites >= 1):
      raise ValueError(f"num_sites must be an int >= 1 for backend='vmap', got {num_sites}")
    run = jax.jit(jax.vmap(site_step, axis_name=axis_name), donate_argnums=donate_argnums)

  return TrainStep(model, tx, loss, num_sites, axis_name, backend, mesh, run)
