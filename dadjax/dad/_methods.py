"""dAD methods by name ("dad", "rank_dad:2", "auto_dad"), registered in :mod:`dadjax.registry`.

A method is a dense-layer factory for the model and the optimizer-side
:func:`~dadjax.dad.synchronize` that goes with it. The synchronizer must know
which parameters belong to dAD layers; here the factory records the path of
every layer it builds (when the model is initialized, before the optimizer),
so the pair works without the caller computing :func:`layer_mask`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from dadjax import registry
from dadjax.dad._config import CONFIG_FIELDS, DadConfig, config_from
from dadjax.dad._dot_general import KERNEL_PARAM
from dadjax.dad._module import Dense, DotGeneral
from dadjax._core.trees import path_names
from dadjax.dad._sync import synchronize
from dadjax.registry import Arg, ArgumentError, BuildContext, Method, register_method


def _module_paths(tree: Any) -> frozenset[tuple[str, ...]]:
  """The module paths of a nested-dict parameter tree (the parents of its leaves)."""
  out = set()

  def walk(node, path):
    if hasattr(node, "items"):
      for k, v in node.items():
        walk(v, (*path, str(k)))
    else:
      out.add(path[:-1])

  walk(tree, ())
  return frozenset(out)


class _Model(NamedTuple):
  """What one trace of a model recorded: its dAD layers, the kernels its dAD dot_generals
  contract, and all its parameters' modules."""

  dad: frozenset
  kernels: frozenset
  modules: frozenset | None  # None: not known (every dAD layer sat in a lifted transform)

  def fits(self, modules: frozenset) -> bool:
    return self.dad <= modules and {k[:-1] for k in self.kernels} <= modules


class DenseFactory:
  """Builds :class:`~dadjax.dad.Dense` layers and remembers where it put them, per model.

  Pass it as a model's ``dense`` factory; each call
  ``factory(features, use_bias=..., name=...)`` returns a ``Dense`` with the
  factory's options (call keywords win), and the module path of every
  synchronizing layer (not ``mode="local"``) built inside a model is
  recorded for that model (one trace of ``model.init`` / ``model.apply``).
  :attr:`dot_general_cls` does the same for a user's own Flax layers
  (``nn.Dense``, ``nn.DenseGeneral``, attention projections), by
  :class:`~dadjax.dad.DotGeneral`, remembering their kernels.
  :meth:`mask` marks the layers of the model whose parameters it is given
  (the model with that parameter structure; among several, the one traced
  last), so one factory reused for a second model never merges the two
  models' layers.

  Args:
    **options: :class:`~dadjax.dad.Dense` fields and keyword options
      (``config``, or its fields ``mode``, ``rank``, ...).
  """

  def __init__(self, **options: Any):
    config_from(options.get("config"),  # validate now, naming the bad argument
                **{k: v for k, v in options.items() if k in CONFIG_FIELDS})
    self.options = dict(options)
    self.built = 0  # layers built inside a model, including "local" ones
    self._models: list[_Model] = []  # one per distinct trace record, oldest first
    self._paths: set[tuple[str, ...]] = set()  # of the trace being recorded
    self._kernels: set[tuple[str, ...]] = set()
    self._root: Any = None  # the root scope of the trace being recorded (until it is closed)

  @property
  def paths(self) -> frozenset[tuple[str, ...]]:
    """The synchronizing ``Dense`` layers' module paths of the model traced last."""
    return self._last().dad

  @property
  def kernels(self) -> frozenset[tuple[str, ...]]:
    """The kernels of the synchronizing dot_generals of the model traced last."""
    return self._last().kernels

  def _last(self) -> _Model:
    if self._paths or self._kernels or not self._models:
      return _Model(frozenset(self._paths), frozenset(self._kernels), None)
    return self._models[-1]

  def _close(self) -> None:
    """File the trace being recorded (its parameters' structure is complete once it ended)."""
    if self._root is None and not self._paths and not self._kernels:
      return
    modules = None
    if self._root is not None:
      modules = _module_paths(getattr(self._root, "_variables", {}).get("params", {}))
    record = _Model(frozenset(self._paths), frozenset(self._kernels), modules)
    if record in self._models:
      self._models.remove(record)
    self._models.append(record)  # most recent last
    self._root, self._paths, self._kernels = None, set(), set()

  def _record(self, scope: Any) -> None:
    """Count a layer built in ``scope``; start a new record when a new trace begins."""
    self.built += 1
    root = scope.root
    # A root scope at path () is a new trace of a model; a lifted transform's
    # (nn.scan, nn.remat) inner root sits at the lifted module's path and
    # belongs to the trace around it.
    if not root.path and root is not self._root:
      self._close()
      self._root = root

  def __call__(self, features: int, **kwargs: Any) -> Dense:
    layer = Dense(features, **{**self.options, **kwargs})
    if layer.scope is not None:
      self._record(layer.scope)
      if layer.config.mode != "local":
        self._paths.add(tuple(layer.scope.path))
    return layer

  @property
  def dot_general_cls(self):
    """A ``dot_general_cls`` with the factory's options, for a user's own layers.

    ``nn.Dense(64, dot_general_cls=factory.dot_general_cls)``,
    ``nn.MultiHeadDotProductAttention(..., qkv_dot_general_cls=...,
    out_dot_general_cls=...)``: each builds a :class:`~dadjax.dad.DotGeneral`
    and the factory remembers the parent layer's ``kernel`` for :meth:`mask`.
    """
    options = {k: v for k, v in self.options.items() if k in CONFIG_FIELDS or k == "config"}

    def build(**kwargs: Any) -> DotGeneral:
      op = DotGeneral(**{**options, **kwargs})
      if op.scope is not None:
        self._record(op.scope)
        if op.config.mode != "local":
          self._kernels.add(tuple(op.scope.path)[:-1] + (KERNEL_PARAM,))
      return op

    return build

  def record_kernels(self, kernels: Any) -> None:
    """Remember a model whose dAD layers were given outside a linen trace.

    For a model this factory does not build (an NNX model given dAD by
    :func:`dadjax.dad.inject_method`): ``kernels`` are the parameter paths
    (tuples of names) of its synchronizing layers' kernels, and :meth:`mask`
    then marks them for that model's parameters.
    """
    kernels = frozenset(tuple(str(k) for k in path) for path in kernels)
    self._close()
    self.built += len(kernels)
    record = _Model(frozenset(), kernels, None)
    if record in self._models:
      self._models.remove(record)
    self._models.append(record)

  def mask(self, params: Any) -> Any:
    """``True`` for the parameters of the dAD layers this factory built in ``params``' model.

    Raises:
      ValueError: if no layer was built yet (initialize the model first),
        or none of the models it built has these parameters.
    """
    if not self.built:
      raise ValueError("mask: this DenseFactory has not built any dAD layer yet; "
                       "initialize the model (model.init) before the optimizer")
    self._close()
    modules = _module_paths(params)
    same = [m for m in self._models if m.modules == modules]
    fits = same or [m for m in self._models if m.fits(modules)]
    if not fits:
      raise ValueError("mask: these parameters belong to none of the models this DenseFactory "
                       "built (build the model with the method's dense factory and initialize "
                       "it before the optimizer)")
    model = fits[-1]
    return jax.tree_util.tree_map_with_path(
        lambda p, _: path_names(p)[:-1] in model.dad or path_names(p) in model.kernels, params)

  def __repr__(self) -> str:
    return f"DenseFactory({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def _method(ctx: BuildContext, other, **options) -> Method:
  dense = DenseFactory(axis_name=ctx.axis_name, seed=ctx.seed, **options)
  return Method(tx=synchronize(dense.mask, other, axis_name=ctx.axis_name), dense=dense)


def _power(block: bool) -> dict:
  """The ``:block`` flag as layer options (none for the default iteration)."""
  return {"power": "block"} if block else {}


@register_method(
    "dad",
    Arg("bucket", bool, doc="one all-gather of every layer's A and D per backward pass "
        "(not one per layer)"),
)
def _exact(ctx: BuildContext, bucket: bool = False, *, other=None) -> Method:
  """Exact dAD: every dense layer all-gathers its inputs A and deltas D."""
  return _method(ctx, other, mode="exact", **({"bucket": True} if bucket else {}))


@register_method("auto_dad")
def _auto(ctx: BuildContext, *, other=None) -> Method:
  """Exact dAD, per layer the cheaper route: gather (A, D) or all-reduce A^T D."""
  return _method(ctx, other, mode="auto")


@register_method("local_dad")
def _local(ctx: BuildContext, *, other=None) -> Method:
  """dAD layers that do not synchronize: every parameter goes to ``other`` (all-reduce)."""
  return _method(ctx, other, mode="local")


@register_method(
    "qdad",
    Arg("bits", int, within="[1, 8]", doc="bits per number of the gathered A and D"),
)
def _quantized(ctx: BuildContext, bits: int = 4, *, other=None) -> Method:
  """Quantized dAD: every dense layer all-gathers A and D stochastically rounded to b bits."""
  return _method(ctx, other, mode="exact", quantize_bits=bits)


@register_method(
    "rank_dad",
    Arg("rank", int, within="[1, inf)", doc="components per site"),
    Arg("two_way", bool, doc="two-way aggregation (global rank-r result) instead of one-way"),
    Arg("warm", bool, doc="warm-start the power iteration from the last step's factors"),
    Arg("ef", bool, doc="error feedback: keep each site's compression residual"),
    Arg("block", bool, doc="block power iteration: all components at once (fewer passes over A and D)"),
    Arg("iters", int, within="[1, inf)", positional=False, doc="power iterations per component"),
    Arg("tol", float, within="[0, inf)", positional=False, doc="power-iteration tolerance"),
)
def _rank(
    ctx: BuildContext,
    rank: int = DadConfig.rank,
    two_way: bool = False,
    warm: bool = False,
    ef: bool = False,
    block: bool = False,
    iters: int = DadConfig.iters,
    tol: float = DadConfig.tol,
    *,
    other=None,
) -> Method:
  """rank-dAD: sites share rank-r factors of their local A^T D (structured power iteration)."""
  extra = {k: v for k, v in (("iters", iters), ("tol", tol)) if v != getattr(DadConfig, k)}
  return _method(ctx, other, mode="rank", rank=rank,
                 aggregation="two_way" if two_way else "one_way", warm_start=warm,
                 error_feedback=ef, **extra, **_power(block))


@register_method(
    "accordion_rank_dad",
    Arg("high", int, within="[2, inf)", doc="rank in critical regimes"),
    Arg("low", int, within="[1, inf)", doc="rank otherwise (< high)"),
    Arg("warm", bool, doc="warm-start the power iteration from the last step's factors"),
    Arg("ef", bool, doc="error feedback: keep each site's compression residual"),
    Arg("block", bool, doc="block power iteration: all components at once (fewer passes over A and D)"),
    Arg("window", int, within="[1, inf)", positional=False,
        doc="steps per detector window (none: the run's steps per epoch)"),
    Arg("interval", int, within="[1, inf)", positional=False, doc="windows between checks"),
    Arg("eta", float, within="(0, inf)", positional=False, doc="critical threshold"),
)
def _accordion_rank(
    ctx: BuildContext,
    high: int,
    low: int,
    warm: bool = False,
    ef: bool = False,
    block: bool = False,
    window: int | None = None,
    interval: int = 1,
    eta: float = 0.5,
    *,
    other=None,
) -> Method:
  """rank-dAD under Accordion: each layer's rank is HIGH in critical regimes, else LOW."""
  if low >= high:
    raise ArgumentError(f"low must be an int < high={high} (the rank outside critical "
                        f"regimes is the smaller one), got {low}")
  return _method(ctx, other, mode="rank", rank=high, rank_low=low,
                 warm_start=warm, error_feedback=ef, **_power(block),
                 accordion_window=ctx.epoch_window(window),
                 accordion_interval=interval, accordion_eta=eta, lr_schedule=ctx.lr_schedule)


def is_method(spec: str) -> bool:
  """Whether ``spec`` names a dAD method (``dad``, ``auto_dad``, ``rank_dad:R``, ...)."""
  try:
    entry = registry.lookup("method", registry.parse_spec(spec).name)
  except ValueError:
    return False
  return entry is not None and entry.family == "dad"


def get_method(
    spec: str,
    axis_name: str | None = "data",
    seed: int = 0,
    other: optax.GradientTransformation | None = None,
) -> tuple[optax.GradientTransformationExtraArgs, DenseFactory]:
  """The optimizer-side transformation and the model's dense factory for a dAD spec.

  Specs: ``"dad"`` (exact), ``"qdad:B"`` (exact route, A and D sent at B
  bits, unbiased), ``"auto_dad"`` (cheapest exact route per layer),
  ``"local_dad"`` (no dAD: every parameter goes to ``other``),
  ``"rank_dad:R"`` (rank-dAD, rank R, one-way) with optional flags
  ``:two_way``, ``:warm`` (warm start), ``:ef`` (error feedback), ``:block``
  (block power iteration) and
  keywords ``iters=``, ``tol=``, e.g. ``"rank_dad:4:two_way:ef"``.

  Args:
    spec: the method spec.
    axis_name: the sites' axis.
    seed: seed of the layers' shared random starts.
    other: transformation for the non-dAD parameters (default
      ``dadjax.allreduce(axis_name)``).

  Returns:
    ``(tx, dense)``: put ``tx`` first in the optimizer chain and build the
    model with ``dense=dense``; initialize the model before ``tx``.

  Raises:
    SpecError: (a ``ValueError``) for an unknown spec or invalid options.
  """
  entry, kwargs = registry.resolve("method", spec)
  if entry.family != "dad":
    raise registry.SpecError(spec, f"unknown dAD method {entry.name!r} (not a dAD spec)")
  try:
    method = entry.fn(BuildContext(axis_name=axis_name, seed=seed), **kwargs, other=other)
  except ArgumentError as e:
    raise registry.SpecError(spec, f"{entry.name}: {e}") from e
  return method.tx, method.dense
