"""One SPMD training step for every method and every backend.

The step is written once, as the program of a single site: compute the
local gradient (or let a batch stage compute it), hand it to the optax
transformation (which performs the collective over ``axis_name``), apply the
update. Three backends run that site program:

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
exactly its own site's copy. The batch is global, site-major: every leaf of
the batch pytree has a leading row axis and rows ``[i * b, (i + 1) * b)``
belong to site ``i``.

Sites of several devices (a 2-D mesh from ``make_mesh(sites=..., per_site=...)``,
shard_map only): each site's copy is replicated over the site's devices,
each device takes ``b / per_site`` of the site's rows, and the devices of a
site average exactly (in-site ``pmean``, booked in ``TrainState.intra_comm``)
before the method communicates over the site axis; see
:func:`make_train_step`.

Loss: ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)`` (see
:mod:`dadjax.parallel._losses`); the default is
:func:`~dadjax.parallel.classification_loss` of the model.

Model state (the non-parameter collections, ``TrainState.model_state``):

* ``"dad_state"``: its float leaves are differentiated and *overwritten*
  with their gradient (the pattern Flax uses for fp8 scales), which is how a
  dAD layer keeps state (warm starts, error feedback) across steps; the
  step owns each layer's int32 ``step`` counter and advances it by one
  (:func:`~dadjax.dad.next_state`). A layer state with a ``"uses"`` entry
  that comes back 0 received no cotangent this step (an unused head, a
  branch not taken): it keeps its previous value, counter included.
* ``mutable`` collections (default ``("batch_stats",)``): replaced by what
  the loss function's ``aux["model_state"]`` returns in training. Those
  named in ``average`` (default ``("batch_stats",)``) are then averaged over
  the sites with one metered ``pmean`` per step, so every site holds the
  same running statistics; the others stay per site. BatchNorm normalizes
  with the site's own batch statistics in training (as data-parallel
  training without SyncBatchNorm does) and with the running averages in
  evaluation. With ``average=()`` each site keeps its own running averages
  and evaluation reads site 0's.
* every other collection is read-only.

Random numbers: ``TrainState.rng`` holds a base key (raw ``uint32`` key
data, replicated) derived at :meth:`TrainStep.init` as
``fold_in(init_key, tag("base"))``. At step ``t`` site ``s`` gets the model
key ``fold_in(fold_in(fold_in(base, tag("model")), t), s)``; the default loss
turns it into one key per rng stream (``"dropout"``) with
:func:`~dadjax.parallel.stream_key`. A batch stage gets the shared key
``fold_in(fold_in(base, tag("stage")), t)`` and the site key
``fold_in(fold_in(shared, tag("site")), s)``. ``tag(name)`` is
``crc32("dadjax.step/" + name) mod 2**31``. Keys depend only on the base key
(checkpointed with the state), the step and the site, so a resumed run draws
exactly the keys of an uninterrupted one, and every site draws different
dropout masks.

Ledger: models that communicate inside their own backward pass (dAD layers)
sow :class:`~dadjax.comm.Bits` into the ``"comm"`` collection; the step
forwards them to the optimizer as the ``model_comm`` extra argument, so they
land in the optimizer's ledger. Communication the step itself does outside
the optimizer (a batch stage's collectives, the ``pmean`` of averaged
collections and of the metrics) is booked in ``TrainState.comm``, a
:class:`~dadjax.comm.CommStats` the step owns. ``dadjax.comm_stats(state)``
on the whole train state sums both; ``comm_stats(state.opt_state)`` still
reads the optimizer's part alone. With a batch stage the step's ledger also
books the fp32 size of the gradient as its dense reference (the all-reduce
the stage replaces), so compression ratios compare like with like.
"""

from __future__ import annotations

import contextlib
import dataclasses
import zlib
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from dadjax._core.shards import sharded_parameters
from dadjax._tree_utils import leaf_path, tree_nbits
from dadjax.comm import (
    CommStats,
    NO_TRAFFIC,
    Traffic,
    host_array,
    intra_ledger_init,
    is_varying,
    ledger_init,
    ledger_record,
    metered_gather_shards,
    metered_mean_scatter,
    metered_pmean,
    metered_psum,
    site_index,
    traffic_add,
    tree_to_varying,
)
from dadjax.dad._state import next_state
from dadjax.parallel._losses import (
    COMM_COLLECTION,
    _accepts_train,
    MODEL_STATE,
    STATE_COLLECTION,
    LossFn,
    MetricsFn,
    classification_loss,
    default_metrics,
    softmax_cross_entropy,
)
from dadjax.parallel._mesh import make_mesh
from dadjax.stage import BatchStage, GradResult, StageContext

BACKENDS = ("shard_map", "pmap", "vmap")
_RESERVED = ("params", COMM_COLLECTION, STATE_COLLECTION)


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


def shard_dims(params: Any, per_site: int) -> Any:
  """Which dimension of each parameter is split over the devices of a site (FSDP).

  A parameter is split along its largest dimension that ``per_site``
  divides (the first of equal ones), so each device holds ``1 / per_site``
  of it; a parameter with no such dimension (a scalar, a bias of odd size)
  stays whole on every device of the site.

  Args:
    params: one site's parameters (arrays or ``ShapeDtypeStruct``).
    per_site: devices per site.

  Returns:
    A tree like ``params`` of ``int`` (the dimension) or ``None`` (whole).
  """

  def dim(x):
    shape = tuple(x.shape)
    fits = [i for i, n in enumerate(shape) if n >= per_site and n % per_site == 0]
    return max(fits, key=lambda i: (shape[i], -i)) if fits and per_site > 1 else None

  return jax.tree.map(dim, params)


def _with_dims(params: Any, dims: Any) -> list[tuple[tuple, Any, int | None]]:
  """``(key path, leaf, sharded dimension or None)`` for every parameter leaf."""
  leaves = jax.tree_util.tree_flatten_with_path(params)[0]
  return [(path, x, d) for (path, x), d in zip(
      leaves, jax.tree.structure(params).flatten_up_to(dims))]


def _dims_by_path(params: Any, dims: Any) -> dict[str, int | None]:
  """:func:`shard_dims` keyed by leaf path (what the compressors look up)."""
  return {leaf_path(path): d for path, _, d in _with_dims(params, dims)}


def _average_in_site(grads: Any, inner, dims: Any):
  """Exact mean over the in-site axes: slices of it for sharded leaves, whole otherwise."""
  if dims is None:
    return metered_pmean(grads, inner)
  grads, scatter = metered_mean_scatter(grads, inner, dims)
  leaves, treedef = jax.tree.flatten(grads)
  whole = [i for i, d in enumerate(treedef.flatten_up_to(dims)) if d is None]
  means, reduce = metered_pmean([leaves[i] for i in whole], inner)
  for i, mean in zip(whole, means):
    leaves[i] = mean
  return jax.tree.unflatten(treedef, leaves), traffic_add(scatter, reduce)


def sharded_layout(state: TrainState, axis_name: str, inner: tuple[str, ...],
                   per_site: int) -> tuple[Any, Any]:
  """``(specs, dims)``: :meth:`TrainStep.state_specs` with sharded parameters, and
  :func:`shard_dims` of one site's parameters."""
  site = P(axis_name)
  inner_spec = inner[0] if len(inner) == 1 else inner
  dims = shard_dims(unstack_shapes(state.params), per_site)

  def spec(d):
    return site if d is None else P(axis_name, *([None] * d), inner_spec)

  params = _with_dims(state.params, dims)
  by_path = {tuple(path): (np.shape(x), spec(d)) for path, x, d in params}

  def opt_spec(path, x):
    for k in range(len(path), 0, -1):  # the longest matching suffix
      hit = by_path.get(tuple(path[-k:]))
      if hit is not None:
        return hit[1] if hit[0] == np.shape(x) else site
    return site

  specs = state._replace(
      params=jax.tree.unflatten(jax.tree.structure(state.params), [spec(d) for _, _, d in params]),
      opt_state=jax.tree_util.tree_map_with_path(opt_spec, state.opt_state),
      **{f: jax.tree.map(lambda _: site, getattr(state, f))
         for f in TrainState._fields if f not in ("params", "opt_state")})
  return specs, dims


def _is_typed_key(key) -> bool:
  return jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)


def _key_data(key) -> np.ndarray:
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


@dataclasses.dataclass(frozen=True)
class TrainStep:
  """A compiled SPMD training step and the placement that goes with it.

  Build it with :func:`make_train_step`. ``init`` makes a placed
  :class:`TrainState`; calling the object runs one step on a global batch
  (a pytree whose leaves have ``num_sites * b`` rows, e.g.
  ``{"x": (num_sites * b, ...), "y": (num_sites * b,)}``) and returns
  ``(state, metrics)`` with metrics averaged over sites (``"loss"`` plus
  what the metrics function returns).
  """

  model: Any
  tx: optax.GradientTransformation
  loss_fn: LossFn
  metrics_fn: MetricsFn
  num_sites: int
  axis_name: str
  backend: str
  mesh: Any
  mutable: tuple[str, ...]
  average: tuple[str, ...]
  batch_stage: BatchStage | None
  _run: Callable
  _eval: Callable
  inner_axes: tuple[str, ...] = ()
  per_site: int = 1
  shard_params: bool = False

  def init(self, key: jax.Array, sample_x: Any, **init_kwargs) -> TrainState:
    """Initialize parameters from ``key`` and replicate them over the sites.

    Args:
      key: a JAX key; it initializes the model (``model.init(key, sample_x,
        **init_kwargs)``) and, folded with a tag, gives the base key of the
        step's rngs.
      sample_x: a sample input of the model (one site's rows).
      **init_kwargs: extra arguments of ``model.init``.

    Returns:
      The placed, site-stacked :class:`TrainState`.
    """
    variables = dict(self.model.init(key, sample_x, **init_kwargs))
    params = variables.pop("params")
    variables.pop(COMM_COLLECTION, None)
    missing = [c for c in self.mutable if c not in variables and c != "batch_stats"]
    if missing:
      raise ValueError(f"mutable: the model has no collection(s) {missing} after init; "
                       f"it has {sorted(variables)}")
    base = _key_data(jax.random.fold_in(key, TAG_BASE))
    stage_state = self.batch_stage.init(params) if self.batch_stage is not None else None
    state = TrainState(np.zeros((), np.int32), params, self.tx.init(params), variables, base,
                       ledger_init(), stage_state,
                       intra_ledger_init() if self.inner_axes else None)
    return self.place(stack_sites(state, self.num_sites))

  def place(self, tree: Any) -> Any:
    """Put a site-stacked pytree where this backend expects it.

    With ``shard_params`` a :class:`TrainState` is placed by
    :meth:`state_specs` (parameters and their optimizer state sharded within
    each site); any other tree, and every tree without it, by site.
    """
    if self.backend != "shard_map":
      return jax.tree.map(jnp.asarray, tree)  # pmap shards its inputs itself
    specs = self.state_specs(tree) if isinstance(tree, TrainState) else P(self.axis_name)
    specs = jax.tree.broadcast(specs, tree, is_leaf=lambda x: isinstance(x, P))
    return jax.tree.map(
        lambda x, spec: jax.make_array_from_callback(
            np.shape(x), NamedSharding(self.mesh, spec), lambda idx, x=x: np.asarray(x)[idx]),
        tree, specs)

  def state_specs(self, state: TrainState) -> Any:
    """The ``PartitionSpec`` of every leaf of a site-stacked state (shard_map backend).

    Every leaf is split over the sites on its leading axis. With
    ``shard_params`` a parameter is also split over the in-site axes along
    :func:`shard_dims`'s dimension, and so is each optimizer-state leaf whose
    key path ends with that parameter's path and whose shape is the
    parameter's (momenta, Adam moments, error-feedback memories,
    accumulators); every other leaf (counters, ledgers) is whole on every
    device of a site.
    """
    if not self.shard_params:
      return jax.tree.map(lambda _: P(self.axis_name), state)
    return sharded_layout(state, self.axis_name, self.inner_axes, self.per_site)[0]

  def check_batch(self, batch: Any) -> None:
    """Raise a clear error if the global batch does not split over the sites.

    Every leaf is split along its leading axis into ``num_sites`` equal
    site-major blocks (and each block into ``per_site`` equal blocks on a
    2-D mesh), so each needs a positive multiple of ``num_sites * per_site``
    rows.
    """
    leaves = jax.tree.leaves(batch)
    if not leaves:
      raise ValueError("batch: the batch pytree has no arrays")
    units = self.num_sites * self.per_site
    for leaf in leaves:
      rows = np.shape(leaf)[0] if np.ndim(leaf) else None
      if rows is None or rows % units or rows == 0:
        where = (f"num_sites={self.num_sites}" if self.per_site == 1 else
                 f"num_sites={self.num_sites} x per_site={self.per_site} devices")
        raise ValueError(
            f"batch: the global batch of {rows} rows does not divide over "
            f"{where}; use a multiple of {units}")

  def __call__(self, state: TrainState, batch: Any):
    return self._run(state, self.place_batch(batch))

  def run(self, state: TrainState, placed_batch: Any):
    """One step on a batch already placed by :meth:`place_batch` (timing loops)."""
    return self._run(state, placed_batch)

  def place_batch(self, batch: Any) -> Any:
    """Check a global host batch and put it where this backend expects it."""
    self.check_batch(batch)
    if self.backend == "shard_map":
      sharding = NamedSharding(self.mesh, P((self.axis_name, *self.inner_axes)))
      return jax.tree.map(
          lambda x: jax.make_array_from_callback(np.shape(x), sharding, lambda idx, x=x: np.asarray(x)[idx]),
          batch)
    split = jax.tree.map(lambda x: np.reshape(np.asarray(x), (self.num_sites, -1) + np.shape(x)[1:]), batch)
    return split if self.backend == "pmap" else jax.tree.map(jnp.asarray, split)

  def collectives(self, state: TrainState, batch: Any, link: str | None = None):
    """The collective ops the compiled step runs, read from its optimized HLO.

    Lowers and compiles the step once for these shapes and returns
    a :class:`~dadjax.comm.CollectiveOps`: per kind, the op count and
    operand bytes per site. Pass it to ``NetworkModel.step_time(summary,
    ops=...)`` to charge latency per compiled op. The count includes the
    step's own metric all-reduces, and ops under ``lax.cond`` (both branches
    are compiled; see ``conditional_count``). ``backend="vmap"`` simulates
    the sites on one device: its program has no collective ops.

    Args:
      state: a train state (shapes only matter).
      batch: a global batch.
      link: ``None`` for every op; on a 2-D mesh ``"inter"`` keeps the ops
        whose replica groups run along the site axis only, ``"intra"``
        those within one site (:meth:`link_of`).
    """
    from dadjax.comm import hlo_collectives  # pylint: disable=g-import-not-at-top
    if link not in (None, "inter", "intra"):
      raise ValueError(f"link must be None, 'inter' or 'intra', got {link!r}")
    text = self._run.lower(state, self.place_batch(batch)).compile().as_text()
    keep = None if link is None else (lambda groups: self.link_of(groups) == link)
    return hlo_collectives(text, groups=keep)

  def link_of(self, groups) -> str:
    """Which links a collective with these replica groups uses (shard_map backend).

    Args:
      groups: a :attr:`~dadjax.comm.CollectiveOp.groups` (logical device
        ids = positions in ``mesh.devices.flat``).

    Returns:
      ``"intra"`` if every group lies within one site, ``"inter"`` if every
      group holds one device per site position (it varies along the site
      axis only), otherwise ``"mixed"``. On a 1-D mesh every collective
      with more than one device is ``"inter"``.
    """
    if self.backend != "shard_map":
      raise ValueError("link_of needs backend='shard_map' (a mesh)")
    shape = self.mesh.devices.shape
    site_dim = self.mesh.axis_names.index(self.axis_name)
    groups = groups or (tuple(range(int(np.prod(shape)))),)
    coords = [np.array(np.unravel_index(np.asarray(g), shape)) for g in groups]
    others = [d for d in range(len(shape)) if d != site_dim]
    if all(len(set(c[site_dim])) == 1 for c in coords):
      return "intra"
    if all(all(len(set(c[d])) == 1 for d in others) for c in coords):
      return "inter"
    return "mixed"

  def params(self, state: TrainState, site: int = 0) -> Any:
    """One site's parameters as host arrays (all sites hold the same)."""
    return unstack_site(state.params, site)

  def evaluate(self, state: TrainState, batch: Any, site: int = 0) -> dict:
    """Loss and metrics of one site's model on ``batch`` with ``train=False``.

    No communication: the site's parameters and model state (BatchNorm
    running averages) are applied to the whole ``batch`` on one device.
    Returns a dict of host floats (``"loss"`` plus the metrics function's).
    """
    out = self._eval(unstack_site(state.params, site), unstack_site(state.model_state, site),
                     batch)
    return {k: float(v) for k, v in out.items()}


class LocalGradients(NamedTuple):
  """One site's backward pass, before the optimizer sees it."""

  loss: jax.Array
  logits: jax.Array
  grads: Any  # gradients of the "params" collection
  model_state: Any  # non-parameter collections after the step (overwritten state)
  extra_args: dict  # optax extra arguments: {"model_comm": sown bits} when a layer communicated


def _in_site_sync(tree: Any, inner) -> tuple[Any, Traffic]:
  """Updated collections made equal on every device of a site; returns ``(tree, traffic)``.

  Float leaves are averaged exactly (``pmean``); integer leaves (step
  counters, equal on every device of a site by construction) are taken from
  the site's first device, exactly and without changing their dtype (one
  ``psum`` of that device's value).
  """
  is_float = lambda v: jnp.issubdtype(jnp.result_type(v), jnp.inexact)
  floats, traffic = metered_pmean(jax.tree.map(lambda v: v if is_float(v) else None, tree), inner)
  ints = jax.tree.map(lambda v: None if is_float(v) else v, tree)
  if jax.tree.leaves(ints):
    first = jax.lax.axis_index(inner) == 0
    ints, t = metered_psum(jax.tree.map(lambda v: jnp.where(first, v, jnp.zeros_like(v)), ints),
                           inner)
    traffic = traffic_add(traffic, t)
  return jax.tree.map(lambda f, i: i if f is None else f, floats, ints,
                      is_leaf=lambda x: x is None), traffic


def keep_unused_state(new: Any, old: Any) -> Any:
  """The ``"dad_state"`` after a step: :func:`dadjax.dad.next_state` ``(old, new)``.

  ``new`` is the collection's cotangent. A layer state is a mapping with a
  ``"uses"`` entry; where the cotangent has ``uses > 0`` the layer takes its
  float fields and advances its int32 ``step`` by one; where ``uses == 0``
  (the layer was not on the path of the loss this step) the whole layer
  state keeps ``old``. ``uses`` may carry leading axes (layers stacked by
  ``nn.scan``); the choice is made per entry of those axes.
  """
  return next_state(old, new)


def grad_result(loss_fn: LossFn, mutable: Sequence[str], params, model_state, batch, rng,
                train: bool = True) -> GradResult:
  """One backward pass as the train step computes it.

  Differentiates ``loss_fn`` with respect to ``params`` and the float
  leaves of the ``"dad_state"`` collection (its int32 step counters are
  passed through undifferentiated). Layers that communicate in their
  backward pass (dAD) have already done so when this returns; their sown
  bits come back in ``extra_args`` (``{"model_comm": ...}``) for
  ``tx.update(..., **extra_args)``, and their ``"dad_state"`` is replaced
  by :func:`dadjax.dad.next_state` of the old state and its gradient (new
  float fields and ``step + 1`` for layers that ran, the old value for
  layers that got no cotangent). The ``mutable`` collections are replaced
  by the loss function's ``aux["model_state"]``.

  Returns:
    A :class:`~dadjax.stage.GradResult` (``aux`` without ``"model_state"``).
  """
  model_state = dict(model_state or {})
  diff = {k: v for k, v in model_state.items() if k == STATE_COLLECTION}
  fixed = {k: v for k, v in model_state.items() if k != STATE_COLLECTION}
  # Only the float leaves of "dad_state" are differentiated; integer leaves
  # (step counters) enter as constants and get a None cotangent.
  leaves, treedef = jax.tree.flatten(diff)
  is_float = [jnp.issubdtype(jnp.result_type(v), jnp.inexact) for v in leaves]

  def objective(p, d):
    d = treedef.unflatten([x if f else v for x, v, f in zip(d, leaves, is_float)])
    return loss_fn(p, {**fixed, **d}, batch, rng, train)

  (value, aux), (grads, dleaves) = jax.value_and_grad(objective, argnums=(0, 1), has_aux=True)(
      params, [v if f else None for v, f in zip(leaves, is_float)])
  dgrads = treedef.unflatten([g if f else None for g, f in zip(dleaves, is_float)])
  updates = {}
  if isinstance(aux, Mapping) and MODEL_STATE in aux:
    aux = dict(aux)
    updates = dict(aux.pop(MODEL_STATE) or {})
  extra = {}
  if jax.tree.leaves(updates.get(COMM_COLLECTION, {})):
    extra["model_comm"] = updates[COMM_COLLECTION]
  new_state = dict(model_state)
  for name in mutable:
    if name in updates and name in model_state:
      new_state[name] = updates[name]
  if diff:
    new_state[STATE_COLLECTION] = keep_unused_state(dgrads[STATE_COLLECTION],
                                                    diff[STATE_COLLECTION])
  return GradResult(value, aux, grads, new_state, extra)


def local_gradients(model, loss, params, model_state, batch) -> LocalGradients:
  """Loss, logits and gradients of one site's rows with a classification criterion.

  A convenience over :func:`grad_result`: ``loss(logits, labels) -> scalar``
  on ``batch["x"]`` / ``batch["y"]``, no rng, ``train=True``.
  """

  def loss_fn(p, variables, b, rng, train):
    del rng
    variables = dict(variables)
    mutable = [COMM_COLLECTION] + [k for k in variables if k not in _RESERVED]
    kwargs = {"train": train} if _accepts_train(model) else {}
    logits, updates = model.apply({"params": p, **variables}, b["x"], mutable=mutable, **kwargs)
    return loss(logits, b["y"]), {"logits": logits, MODEL_STATE: dict(updates)}

  r = grad_result(loss_fn, ("batch_stats",), params, model_state, batch, None)
  return LocalGradients(r.loss, r.aux["logits"], r.grads, r.model_state, r.extra_args)


def _site_program(tx, loss_fn, metrics_fn, mutable, average, batch_stage, axis_name,
                  inner=(), dims=None):
  """The step as one site runs it; collectives name ``axis_name``.

  ``inner``: the in-site mesh axes of a 2-D mesh (module docstring of
  :func:`make_train_step`): each device computes the gradient of its rows
  with the parameters typed varying along ``inner``, the gradients and the
  updated collections are averaged exactly over ``inner`` (booked in the
  in-site ledger), and everything after runs identically on every device
  of the site.

  ``dims``: with sharded parameters, :func:`shard_dims` of the parameters:
  the step holds slices of those leaves, all-gathers them over ``inner``
  for the forward pass, reduce-scatters their gradients back to slices,
  and traces the optimizer under :func:`~dadjax._core.shards.sharded_parameters`
  (methods that need whole tensors refuse there).
  """
  tx = optax.with_extra_args_support(tx)
  synced_names = tuple(mutable) + (STATE_COLLECTION,)

  def site_step(state: TrainState, batch):
    site = site_index(axis_name)
    model_key, shared_key, stage_key = site_keys(state.rng, state.step, site)
    local_params, local_model_state, intra = state.params, state.model_state, NO_TRAFFIC
    if inner:
      if jax.lax.axis_size(inner) > 1:  # each device of a site draws its own dropout masks
        model_key = jax.random.fold_in(model_key, jax.lax.axis_index(inner))
      if dims is not None:
        local_params, intra = metered_gather_shards(local_params, inner, dims)
      local_params = tree_to_varying(local_params, inner)
      local_model_state = tree_to_varying(local_model_state, inner)

    def bound_grad(params, b, rng=None):
      return grad_result(loss_fn, mutable, params, local_model_state, b,
                         model_key if rng is None else rng, True)

    if batch_stage is None:
      result, stage_state, traffic = bound_grad(local_params, batch), state.stage_state, NO_TRAFFIC
    else:

      def bound_loss(params, b, rng=None):
        value, aux = loss_fn(params, local_model_state, b, model_key if rng is None else rng, True)
        if isinstance(aux, Mapping) and MODEL_STATE in aux:
          aux = {k: v for k, v in aux.items() if k != MODEL_STATE}
        return value, aux

      ctx = StageContext(bound_grad, bound_loss, axis_name, stage_key, shared_key, state.step)
      out = batch_stage.apply(ctx, local_params, batch, state.stage_state)
      result, stage_state, traffic = out.result, out.state, out.traffic

    grads, model_state, aux = result.grads, dict(result.model_state), result.aux
    loss = result.loss
    if inner:  # exact in-site average, before any method communicates over the site axis
      grads, t = _average_in_site(grads, inner, dims)
      local = {k: v for k, v in model_state.items() if k in synced_names}
      local = {k: v for k, v in local.items()
               if any(is_varying(x, a) for x in jax.tree.leaves(v) for a in inner)}
      synced_local, t2 = _in_site_sync(local, inner)
      model_state = {**dict(state.model_state), **synced_local}
      intra = traffic_add(intra, t, t2)
      stage_state = _invariant_stage_state(stage_state, inner)
    with (sharded_parameters(inner, _dims_by_path(state.params, dims)) if dims is not None
          else contextlib.nullcontext()):
      updates, opt_state = tx.update(grads, state.opt_state, state.params, **result.extra_args)
    params = optax.apply_updates(state.params, updates)
    synced = {k: model_state[k] for k in average if k in model_state}
    if jax.tree.leaves(synced):
      synced, sync_traffic = metered_pmean(synced, axis_name)
      model_state.update(synced)
      traffic = traffic_add(traffic, sync_traffic)
    metrics = {"loss": loss, **metrics_fn(aux, batch)}
    metrics = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), metrics)
    intra_comm = state.intra_comm
    if inner:
      metrics, t = metered_pmean(metrics, inner)
      intra = traffic_add(intra, t)
      intra_comm = ledger_record(state.intra_comm, reduce=intra.reduce, gather=intra.gather,
                                 reduce_calls=intra.reduce_calls, gather_calls=intra.gather_calls)
    metrics, metrics_traffic = metered_pmean(metrics, axis_name)
    traffic = traffic_add(traffic, metrics_traffic)
    # a batch stage replaces the gradient all-reduce: its fp32 size is the dense reference
    dense = tree_nbits(result.grads) if batch_stage is not None else 0
    comm = ledger_record(state.comm, reduce=traffic.reduce, gather=traffic.gather, dense=dense,
                         reduce_calls=traffic.reduce_calls, gather_calls=traffic.gather_calls)
    new_state = TrainState(state.step + 1, params, opt_state, model_state, state.rng, comm,
                           stage_state, intra_comm)
    return new_state, metrics

  return site_step


def _invariant_stage_state(stage_state, inner):
  """A batch stage's state must be the same on every device of a site."""
  for leaf in jax.tree.leaves(stage_state):
    if any(is_varying(leaf, a) for a in inner):
      raise ValueError("batch_stage: its state differs between the devices of a site (it "
                       "depends on the device's rows); such a stage supports 1-D meshes only")
  return stage_state


def _check_names(name: str, names, allowed=None) -> tuple[str, ...]:
  if isinstance(names, str):
    raise ValueError(f"{name} must be a sequence of collection names, got the string {names!r}")
  names = tuple(names)
  bad = [n for n in names if not isinstance(n, str) or n in _RESERVED]
  if bad:
    raise ValueError(f"{name}: {bad} cannot be listed; the step handles {_RESERVED} itself")
  if allowed is not None and not set(names) <= set(allowed):
    raise ValueError(f"{name} must be a subset of mutable={allowed}, got {names}")
  return names


def make_train_step(
    model,
    tx: optax.GradientTransformation,
    *,
    loss_fn: LossFn | None = None,
    metrics_fn: MetricsFn | None = None,
    mutable: Sequence[str] = ("batch_stats",),
    average: Sequence[str] = ("batch_stats",),
    batch_stage: BatchStage | None = None,
    num_sites: int | None = None,
    axis_name: str = "data",
    backend: str = "shard_map",
    mesh=None,
    shard_params: bool = False,
    donate: bool = False,
) -> TrainStep:
  """Build the jitted SPMD training step.

  Args:
    model: a Flax linen module (``init`` and the default loss use it).
    tx: any optax transformation; a dadjax communicating transformation in
      it (``dadjax.allreduce(axis_name)``, a compressor, dAD's sync) does the
      collective. A plain optax optimizer alone leaves sites unsynchronized.
    loss_fn: ``loss_fn(params, variables, batch, rng, train) -> (loss, aux)``
      (:mod:`dadjax.parallel._losses`); default
      ``classification_loss(model)`` (cross-entropy of ``batch["y"]`` under
      ``model.apply(..., batch["x"])``). ``regression_loss(model)`` is MSE.
    metrics_fn: ``metrics_fn(aux, batch) -> dict`` of scalars, averaged over
      sites with ``"loss"``; default :func:`default_metrics` (accuracy from
      logits, MSE from predictions).
    mutable: collections the model updates in training (default
      ``("batch_stats",)``; absent ones are ignored). Each must exist after
      ``model.init``, except ``"batch_stats"``.
    average: of ``mutable``, the collections averaged over the sites after
      every step (one metered ``pmean``, booked in ``TrainState.comm``);
      default ``("batch_stats",)``; ``()`` keeps them per site.
    batch_stage: a :class:`~dadjax.stage.BatchStage` that computes the
      gradient from the site's batch (data-side methods); ``None``: the plain
      backward pass on the site's rows.
    num_sites: number of sites; default: the mesh size (shard_map), the
      local device count (pmap), required for vmap.
    axis_name: the axis the collectives name; default ``"data"``.
    backend: ``"shard_map"``, ``"pmap"`` or ``"vmap"``.
    mesh: the shard_map mesh (default: :func:`make_mesh`, 1-D). A mesh with
      more axes than ``axis_name`` (``make_mesh(sites=2, per_site=4)``) makes
      each site a group of devices; see "Sites of several devices" below.
      ``pmap`` and ``vmap`` run one device per site (1-D only).
    shard_params: on a 2-D mesh, split each site's parameters and their
      optimizer state over the site's devices (FSDP-style; see "Sharded
      parameters" below). Default ``False``: every device of a site holds
      the site's whole copy.
    donate: donate the input state's buffers to the output (saves memory;
      the input state must not be used afterwards).

  Sites of several devices (2-D mesh, e.g. axes ``("data", "replica")``):
  the global batch is split site-major over ``axis_name`` and each site's
  rows again over the in-site axes (rows ``[i b, (i+1) b)`` are site
  ``i``'s; each of its ``per_site`` devices takes ``b / per_site`` of
  them). The state keeps one copy per site (leading site axis, sharded over
  ``axis_name``), replicated over the in-site axes: every device of a site
  holds the site's whole parameters and optimizer state. Each device
  computes the gradient of its rows; the gradients, the updated ``mutable``
  collections and ``"dad_state"``, and the metrics are averaged exactly over
  the in-site axes with one metered ``pmean`` each (booked in
  ``TrainState.intra_comm``, an :class:`~dadjax.comm.IntraSiteStats`,
  reported as ``intra_*`` by :func:`~dadjax.comm_stats`); then the method
  runs over ``axis_name`` only, identically on every device of the site
  (each device runs the site-axis collectives with the same position in
  the other sites, over its own inter-site link). Optimizer-side methods
  (allreduce, every compressor) therefore see exactly the site's averaged
  gradient and train like a 1-D mesh with the same sites and the same
  ledger. dAD layers gather ``A`` and ``D`` over ``axis_name`` only, per
  device: each device gathers its own rows from the same position in every
  site, and the in-site ``pmean`` of the resulting gradients then sums all
  rows exactly (the weight gradient is linear in the rows), so exact dAD
  equals pooled training; its inter-site payload per device is ``b /
  per_site`` rows, the site's ``b`` rows in all. rank-dAD factorizes each
  device's rows (not the site's), so it is not the 1-D run's factorization.
  A batch stage whose state depends on the device's rows is refused.

  Sharded parameters (``shard_params=True``, 2-D mesh): each parameter is
  split along :func:`shard_dims`'s dimension over the in-site axes and
  placed with a ``NamedSharding`` (:meth:`TrainStep.state_specs`), and so
  are the optimizer-state leaves that mirror it; a device holds ``1 /
  per_site`` of them. Each step all-gathers the slices within the site for
  the forward pass and reduce-scatters the gradients back (both booked in
  ``TrainState.intra_comm``: together they move what the replicated
  layout's in-site all-reduce moves), so every device holds a slice of the
  site's exact mean gradient, and the method then exchanges *its slice*
  over the site axis: a site sends the same bits as with replicated
  parameters, split over its devices' links instead of repeated on each
  (the ledger is per device, as always). Supported, and equal to the
  replicated layout: ``allreduce``, ``identity`` / ``cast`` / ``bf16`` /
  ``fp16``, ``sign``, ``scaled_sign``, ``terngrad``, ``qsgd`` without
  ``bucket_size`` (their norms, maxima and noise are the whole tensor's, via
  :mod:`dadjax._core.shards`; each device's payload carries the tensor's scale),
  ``ef(...)`` of these, dAD and rank-dAD layers (they see whole kernels),
  and elementwise optax optimizers (sgd, momentum, adam, adamw). Methods
  that need a whole tensor (TopK's and RandomK's selections, QSGD's
  buckets, PowerSGD's matrices, Accordion) raise a ``ValueError`` naming
  the method when the step is first traced, before any state changes; a
  batch stage is refused here. Optax transformations that reduce
  over a whole tensor or tree (``clip_by_global_norm``, LAMB's trust ratio,
  Adafactor's factored moments) would see only the device's slice: leave
  them out with sharded parameters.

  Returns:
    A :class:`TrainStep`.

  Raises:
    ValueError: for an unknown backend, a bad ``num_sites``, an axis not in
      the mesh, a mesh with ``pmap`` / ``vmap``, ``shard_params`` without a
      2-D mesh or with a batch stage,
      or ``mutable`` / ``average`` naming ``"params"``, ``"comm"``
      or ``"dad_state"`` (``average`` must be a subset of ``mutable``).
  """
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  mutable = _check_names("mutable", mutable)
  average = _check_names("average", average, mutable)
  if batch_stage is not None and not isinstance(batch_stage, BatchStage):
    raise ValueError(f"batch_stage must be a dadjax.stage.BatchStage or None, got {batch_stage!r}")
  loss_fn = classification_loss(model) if loss_fn is None else loss_fn
  metrics_fn = default_metrics if metrics_fn is None else metrics_fn
  donate_argnums = (0,) if donate else ()
  inner: tuple[str, ...] = ()
  per_site = 1
  if backend != "shard_map" and mesh is not None:
    raise ValueError(f"mesh is for backend='shard_map'; backend={backend!r} runs one device "
                     "per site (1-D) and takes num_sites")
  if backend == "shard_map":
    if mesh is None:
      mesh = make_mesh(num_sites, axis_name)
    if axis_name not in mesh.axis_names:
      raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {mesh.axis_names}")
    if num_sites is not None and num_sites != mesh.shape[axis_name]:
      raise ValueError(f"num_sites={num_sites} differs from the mesh's {axis_name!r} axis of "
                       f"size {mesh.shape[axis_name]}; leave num_sites=None with a mesh")
    num_sites = mesh.shape[axis_name]
    inner = tuple(a for a in mesh.axis_names if a != axis_name)
    per_site = int(np.prod([mesh.shape[a] for a in inner])) if inner else 1
  if not isinstance(shard_params, bool):
    raise ValueError(f"shard_params must be a bool, got {shard_params!r}")
  if shard_params and (backend != "shard_map" or not inner):
    raise ValueError("shard_params=True splits parameters over the devices of a site: it needs "
                     "backend='shard_map' and a 2-D mesh, e.g. mesh=make_mesh(sites=2, "
                     f"per_site=4); got backend={backend!r}, mesh axes "
                     f"{mesh.axis_names if mesh is not None else None}")
  if shard_params and batch_stage is not None:
    raise ValueError("shard_params=True does not support a batch_stage (its gradient "
                     "correction and gate need whole gradients); use shard_params=False")
  site_step = _site_program(tx, loss_fn, metrics_fn, mutable, average, batch_stage, axis_name,
                            inner)

  if backend == "shard_map":

    def compile_for(state_specs, dims):
      program = site_step if dims is None else _site_program(
          tx, loss_fn, metrics_fn, mutable, average, batch_stage, axis_name, inner, dims)

      def blocked(state, batch):
        state = jax.tree.map(lambda x: x[0], state)
        new_state, metrics = program(state, batch)
        return jax.tree.map(lambda x: x[None], (new_state, metrics))

      return jax.jit(
          jax.shard_map(blocked, mesh=mesh, in_specs=(state_specs, P((axis_name, *inner))),
                        out_specs=(state_specs, P(axis_name))),
          donate_argnums=donate_argnums)

    run = (_PerLayoutRun(compile_for, axis_name, inner, per_site) if shard_params
           else compile_for(P(axis_name), None))
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

  @jax.jit
  def eval_fn(params, model_state, batch):
    value, aux = loss_fn(params, model_state, batch, jax.random.key(0), False)
    if isinstance(aux, Mapping) and MODEL_STATE in aux:
      aux = {k: v for k, v in aux.items() if k != MODEL_STATE}
    return {"loss": value, **metrics_fn(aux, batch)}

  return TrainStep(model, tx, loss_fn, metrics_fn, num_sites, axis_name, backend, mesh, mutable,
                   average, batch_stage, run, eval_fn, inner, per_site, shard_params)


class _PerLayoutRun:
  """The jitted step for sharded parameters, built once per state layout.

  ``shard_map`` needs each leaf's spec, which depends on the parameters'
  shapes: the first call (or ``lower``) with a state of new shapes builds
  the program for :meth:`TrainStep.state_specs` of that state.
  """

  def __init__(self, compile_for, axis_name: str, inner: tuple[str, ...], per_site: int):
    self.compile_for, self.axis_name, self.inner, self.per_site = (
        compile_for, axis_name, inner, per_site)
    self.programs: dict = {}

  def program(self, state: TrainState):
    key = (jax.tree.structure(state), tuple(np.shape(x) for x in jax.tree.leaves(state)))
    if key not in self.programs:
      self.programs[key] = self.compile_for(
          *sharded_layout(state, self.axis_name, self.inner, self.per_site))
    return self.programs[key]

  def __call__(self, state: TrainState, batch: Any):
    return self.program(state)(state, batch)

  def lower(self, state: TrainState, batch: Any):
    return self.program(state).lower(state, batch)


__all__ = [
    "BACKENDS",
    "COMM_COLLECTION",
    "STATE_COLLECTION",
    "LocalGradients",
    "TrainState",
    "TrainStep",
    "grad_result",
    "keep_unused_state",
    "local_gradients",
    "make_train_step",
    "shard_dims",
    "site_keys",
    "softmax_cross_entropy",
    "stack_sites",
    "unstack_site",
]
