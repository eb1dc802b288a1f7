"""The compiled train step: placing state and batches, running, inspecting, evaluating.

Built by :func:`~dadjax.parallel.make_train_step` (:mod:`dadjax.parallel._make`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
import optax

from dadjax._core import protocols
from dadjax._core.protocols import CollectionRule
from dadjax.comm import COMM_COLLECTION, host_array, ledger_init
from dadjax.parallel._inspect import (booked_bits as _booked_bits, check_ledger as _check_ledger,
                                      collectives as _collectives, link_of as _link_of,
                                      program_bits as _program_bits,
                                      traffic_by_axis as _traffic_by_axis)
from dadjax.parallel._checks import check_opt_state
from dadjax.parallel._losses import LossFn, MetricsFn
from dadjax.parallel._rows import check_sites as _check_sites, local_sites as _local_sites
from dadjax._core.layers import stacked_layers
from dadjax.parallel._layout import unbox
from dadjax.parallel._scan_axes import layer_axes_of
from dadjax.parallel._state import TAG_BASE, TrainState, key_data, stack_sites, unstack_site
from dadjax._core.protocols import BatchStage

DEFAULT_MUTABLE = ("batch_stats",)


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
  placement: Any
  rules: Mapping[str, CollectionRule]
  batch_stage: BatchStage | None
  _run: Callable
  _eval: Callable
  mutable: tuple[str, ...] = ()
  average: tuple[str, ...] = ()
  allow_local: bool = False
  check_ledger: bool = True
  _checked: set = dataclasses.field(default_factory=set, repr=False, compare=False)
  # {leaf path: layer axis} of the parameters stacked by nn.scan (read at init, or given)
  layer_axes: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)
  fixed_layer_axes: bool = False

  num_sites = property(lambda self: self.placement.num_sites)
  axis_name = property(lambda self: self.placement.axis_name)
  backend = property(lambda self: self.placement.backend)
  mesh = property(lambda self: self.placement.mesh)
  per_site = property(lambda self: self.placement.per_site)
  shard_params = property(lambda self: self.placement.shard_params)
  inner_axes = property(lambda self: self.placement.inner)

  def init(self, key: jax.Array, sample_x: Any, **init_kwargs) -> TrainState:
    """The placed, site-stacked :class:`TrainState`: ``model.init(key, sample_x,
    **init_kwargs)`` (``sample_x``: one site's rows) copied to every site; ``key`` folded with
    a tag is the base key of the step's rngs."""
    return self.place(stack_sites(self._site_state(key, sample_x, **init_kwargs),
                                  self.num_sites))

  def lower(self, state: TrainState, placed_batch: Any):
    """The step lowered for a state and a placed batch, or for their ``ShapeDtypeStruct``
    (:func:`~dadjax.parallel.abstract_state`): ``.compile()`` is XLA's program."""
    return self._run.lower(state, placed_batch)

  def _site_state(self, key: jax.Array, sample_x: Any, base=None, **init_kwargs) -> TrainState:
    """One site's initial state (not placed); ``base``: the rngs' base key data, if known."""
    variables = dict(self.model.init(key, sample_x, **init_kwargs))
    if self.backend == "shard_map":  # the in-site layout the model's metadata declares
      self.placement.record(variables["params"])
    if not self.fixed_layer_axes:  # the leaves nn.scan stacked, by their "layers" names
      self.layer_axes.clear()
      self.layer_axes.update(layer_axes_of(variables["params"]))
    variables = unbox(variables)
    params = variables.pop("params")
    variables.pop(COMM_COLLECTION, None)
    missing = [c for c in self.mutable if c not in variables and c not in DEFAULT_MUTABLE]
    if missing:
      raise ValueError(f"mutable: the model has no collection(s) {missing} after init; "
                       f"it has {sorted(variables)}")
    base = key_data(jax.random.fold_in(key, TAG_BASE)) if base is None else base
    stage_state = self.batch_stage.init(params) if self.batch_stage is not None else None
    with stacked_layers(self.layer_axes):
      opt_state = self.tx.init(params)
    check_opt_state(opt_state, num_sites=self.num_sites, axis_name=self.axis_name,
                    stage=self.batch_stage is not None, allow_local=self.allow_local)
    return TrainState(np.zeros((), np.int32), params, opt_state, variables, base,
                      ledger_init(), stage_state, None)

  def place(self, tree: Any) -> Any:
    """Put a site-stacked pytree where this placement expects it.

    On a mesh a :class:`TrainState` is placed by :meth:`state_specs`
    (parameters and the optimizer state that mirrors them keep their in-site
    sharding); any other tree by site.
    """
    if self.backend != "shard_map":
      return self.placement.place(tree)
    specs = self.state_specs(tree) if isinstance(tree, TrainState) else None
    return self.placement.place(tree, specs)

  def state_specs(self, state: TrainState) -> Any:
    """The ``PartitionSpec`` of every leaf of a site-stacked state (shard_map backend).

    Every leaf is split over the sites on its leading axis. A parameter keeps
    its in-site spec (model metadata, ``param_specs`` or ``shard_params``:
    :mod:`dadjax.parallel._layout`), as does each optimizer-state leaf of its
    path and shape; other leaves of >= 4,096 entries (PowerSGD's memories)
    are split over the site (:meth:`dadjax.parallel.Mesh.spread_spec`), and
    the rest (counters, ledgers) are whole on every device of a site.
    """
    return self.placement.state_specs(state)

  @property
  def local_sites(self) -> tuple[int, ...]:
    """The sites whose rows this process feeds, ascending (every site in a
    one-process run; on many processes, the sites of this process's devices).

    A process may pass only their rows: ``step(state, batch, sites=step.local_sites)``.
    """
    return _local_sites(self.placement)

  def check_batch(self, batch: Any, sites: Sequence[int] | None = None) -> tuple[int, ...]:
    """Raise a clear error if the batch does not split over its sites.

    Every leaf is split along its leading axis into ``len(sites)`` equal
    site-major blocks (and each block into equal blocks over the devices of
    the mesh's ``batch_axes``), so each needs a positive multiple of ``len(sites) *`` those devices
    rows. ``sites`` (default: every site) must hold :attr:`local_sites`.

    Returns:
      ``sites`` as a tuple.
    """
    sites = _check_sites(sites, self.num_sites, self.local_sites)
    leaves = jax.tree.leaves(batch)
    if not leaves:
      raise ValueError("batch: the batch pytree has no arrays")
    unit = self.placement.rows_per_site_unit
    units = len(sites) * unit
    for leaf in leaves:
      rows = np.shape(leaf)[0] if np.ndim(leaf) else None
      if rows is None or rows % units or rows == 0:
        whole = len(sites) == self.num_sites
        where = f"num_sites={len(sites)}" if whole else f"{len(sites)} site(s)"
        if unit > 1:
          where += f" x {unit} devices per site"
        kind = "global batch" if whole else f"batch of sites {list(sites)}"
        raise ValueError(
            f"batch: the {kind} of {rows} rows does not divide over "
            f"{where}; use a multiple of {units}")
    return sites

  def __call__(self, state: TrainState, batch: Any, sites: Sequence[int] | None = None):
    """One step on a host batch: the global one, or the rows of ``sites`` only
    (site-major in that order; they must include :attr:`local_sites`)."""
    return self.run(state, self.place_batch(batch, sites))

  def run(self, state: TrainState, placed_batch: Any):
    """One step on a batch already placed by :meth:`place_batch` (timing loops).

    The first step of each state and batch layout is checked against the
    program (``check_ledger``; :meth:`ledger_check`).
    """
    if not self.check_ledger or self.backend == "vmap":
      return self._run(state, placed_batch)
    key = jax.tree.structure((state, placed_batch)), tuple(
        np.shape(x) for x in jax.tree.leaves((state, placed_batch)))
    if key in self._checked:
      return self._run(state, placed_batch)
    program = _program_bits(self._run, state, placed_batch, self.placement)
    before = _booked_bits(state)
    out = self._run(state, placed_batch)
    _check_ledger(program, before, _booked_bits(out[0]))
    self._checked.add(key)
    return out

  def ledger_check(self, state: TrainState, batch: Any) -> dict:
    """Run one step and compare the program's collective bits with what its ledgers booked.

    The check ``run`` does on the first step of each layout (off with
    ``make_train_step(check_ledger=False)``; ``vmap`` has no collective ops):
    the operand bits of the lowered program's collectives outside
    ``lax.cond`` must not exceed the bits every ledger booked in that step.
    The ledger may book more (a loop body's ops appear once in the text).

    Returns:
      A dict with ``"program_bits"`` (unconditional), ``"program_bits_all"``
      (with conditional branches) and ``"booked_bits"`` (booked in the step).

    Raises:
      ValueError: the program moves more than was booked (both figures named).
    """
    placed = self.place_batch(batch)
    program = _program_bits(self._run, state, placed, self.placement)
    before = _booked_bits(state)
    new_state, _ = self._run(state, placed)
    booked = _check_ledger(program, before, _booked_bits(new_state))
    return {"program_bits": program[0], "program_bits_all": program[1], "booked_bits": booked}

  def place_batch(self, batch: Any, sites: Sequence[int] | None = None) -> Any:
    """Check a host batch and put it where this placement expects it.

    Args:
      batch: the global batch, or with ``sites`` the rows of those sites only.
      sites: the sites of ``batch``'s blocks, in order (default: every site,
        ascending); they must include :attr:`local_sites`. On many processes
        each process passes only its own sites' rows; each device reads its
        block from them.
    """
    sites = self.check_batch(batch, sites)
    return self.placement.place_batch(batch, sites)

  def collectives(self, state: TrainState, batch: Any, link: str | None = None,
                  sites: Sequence[int] | None = None):
    """The collective ops the compiled step runs, read from its optimized HLO.

    Compiles the step once and returns a :class:`~dadjax.comm.CollectiveOps`
    (per kind: op count and operand bytes per site; pass it to
    ``NetworkModel.step_time(summary, ops=...)``), including the step's
    metric all-reduces and both branches of a ``lax.cond``
    (``conditional_count``). ``link``: ``None`` for every op, ``"inter"`` /
    ``"intra"`` for the ops along the site axis / within a site
    (:meth:`link_of`). ``vmap`` programs have no collective ops.
    """
    return _collectives(self._run, self.placement, state, self.place_batch(batch, sites), link)

  def traffic_by_axis(self, state: TrainState, batch: Any,
                      sites: Sequence[int] | None = None) -> dict[str, int]:
    """Operand bits per device and step of the compiled collectives, by the mesh axes they span.

    On a mesh whose sites are groups of devices, the in-site collectives
    (GSPMD's: FSDP's gathers and reduce-scatters, tensor parallelism's
    all-reduces) are keyed by their in-site axes (``"model"``,
    ``"fsdp+model"``) and the methods' by the site axis; ops in both
    branches of a ``lax.cond`` are counted. Compiles the step once.
    """
    return _traffic_by_axis(self._run, self.placement, state, self.place_batch(batch, sites))

  def link_of(self, groups) -> str:
    """Which links a collective with these replica groups uses (shard_map backend).

    ``groups`` is a :attr:`~dadjax.comm.CollectiveOp.groups`. Returns
    ``"intra"`` if every group lies within one site, ``"inter"`` if every
    group varies along the site axis only (always, on a 1-D mesh), else
    ``"mixed"``.
    """
    return _link_of(self.placement, groups)

  def params(self, state: TrainState, site: int = 0) -> Any:
    """One site's parameters to evaluate, as host arrays.

    The site's own parameters, unless a node of its optimizer state defines
    ``evaluation_params`` (:func:`dadjax._core.protocols.evaluation_params`,
    e.g. a synchronized anchor of a local-update method).
    """
    params = unstack_site(state.params, site)
    if not protocols.has_evaluation_params(state.opt_state):
      return params
    opt_state = jax.tree.map(lambda x: host_array(x)[site], state.opt_state)
    return protocols.evaluation_params(opt_state, params)

  def metrics_row(self, state: TrainState) -> dict:
    """The rows of every reporting node of the optimizer and batch-stage states and of every
    collection whose rule has a ``metrics_row`` (:func:`dadjax._core.protocols.collect_rows`)."""
    with stacked_layers(self.layer_axes):  # per-layer rows (Accordion's decisions) by layer
      opt_row = protocols.collect_rows(state.opt_state, unstack_site(state.params, 0))
    named = [("the optimizer state", opt_row),
             ("the batch stage's state", protocols.collect_rows(state.stage_state))]
    named += [(f"the {name!r} collection's rule", self.rules[name].metrics_row(value))
              for name, value in dict(state.model_state or {}).items()
              if getattr(self.rules.get(name), "metrics_row", None) is not None]
    return protocols.merge_rows(*named)

  def evaluate(self, state: TrainState, batch: Any, site: int = 0) -> dict:
    """Loss and metrics of one site's model on ``batch`` with ``train=False``.

    No communication: the site's parameters (:meth:`params`) and model state
    are applied to the whole ``batch`` on one device. Returns host floats
    (``"loss"`` plus the metrics function's).
    """
    out = self._eval(self.params(state, site), unstack_site(state.model_state, site), batch)
    return {k: float(v) for k, v in out.items()}
