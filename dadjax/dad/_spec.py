"""dAD methods from spec strings ("dad", "rank_dad:2", "auto_dad").

A spec names a dense-layer factory for the model and the optimizer-side
:func:`~dadjax.dad.synchronize` that goes with it. The synchronizer must know
which parameters belong to dAD layers; here the factory records the path of
every layer it builds (when the model is initialized, before the optimizer),
so the pair works without the caller computing :func:`layer_mask`.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from dadjax.dad._config import DadConfig
from dadjax.dad._module import Dense
from dadjax._tree_utils import path_names
from dadjax.dad._sync import synchronize

_FLAGS = {"two_way": ("aggregation", "two_way"), "warm": ("warm_start", True),
          "ef": ("error_feedback", True)}
VALID_SPECS = ("dad", "auto_dad", "local_dad", "rank_dad:RANK[:two_way][:warm][:ef]")


class DenseFactory:
  """Builds :class:`~dadjax.dad.Dense` layers and remembers where it put them.

  Pass it as a model's ``dense`` factory; each call
  ``factory(features, use_bias=..., name=...)`` returns a ``Dense`` with the
  factory's options (call keywords win), and the module path of every
  synchronizing layer (not ``mode="local"``) built inside a model is added
  to :attr:`paths`. :meth:`mask` turns those paths into the parameter mask
  :func:`~dadjax.dad.synchronize` needs.

  Args:
    **options: :class:`~dadjax.dad.Dense` fields (``mode``, ``rank``, ...).
  """

  def __init__(self, **options: Any):
    config_fields = {k: v for k, v in options.items() if k in DadConfig.__dataclass_fields__}
    DadConfig(**config_fields)  # validate now, naming the bad argument
    self.options = dict(options)
    self.paths: set[tuple[str, ...]] = set()
    self.built = 0  # layers built inside a model, including "local" ones

  def __call__(self, features: int, **kwargs: Any) -> Dense:
    layer = Dense(features, **{**self.options, **kwargs})
    if layer.scope is not None:
      self.built += 1
      if layer.mode != "local":
        self.paths.add(tuple(layer.scope.path))
    return layer

  def mask(self, params: Any) -> Any:
    """``True`` for the parameters of the dAD layers this factory built.

    Raises:
      ValueError: if no layer was built yet (initialize the model first).
    """
    if not self.built:
      raise ValueError("mask: this DenseFactory has not built any dAD layer yet; "
                       "initialize the model (model.init) before the optimizer")
    return jax.tree_util.tree_map_with_path(lambda p, _: path_names(p)[:-1] in self.paths, params)

  def __repr__(self) -> str:
    return f"DenseFactory({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"


def _parse(spec: str) -> dict[str, Any]:
  name, *args = spec.split(":")
  if name == "dad" and not args:
    return {"mode": "exact"}
  if name == "auto_dad" and not args:
    return {"mode": "auto"}
  if name == "local_dad" and not args:
    return {"mode": "local"}
  if name == "rank_dad":
    options: dict[str, Any] = {"mode": "rank"}
    if args:
      try:
        options["rank"] = int(args[0])
      except ValueError:
        raise ValueError(f"spec {spec!r}: RANK must be an int, got {args[0]!r}") from None
    for flag in args[1:]:
      if flag not in _FLAGS:
        raise ValueError(f"spec {spec!r}: unknown flag {flag!r}; valid: {sorted(_FLAGS)}")
      key, value = _FLAGS[flag]
      options[key] = value
    return options
  raise ValueError(f"unknown dAD spec {spec!r}; valid forms: {', '.join(VALID_SPECS)}")


def is_method(spec: str) -> bool:
  """Whether ``spec`` names a dAD method (``dad``, ``auto_dad``, ``rank_dad:R``, ...)."""
  return spec.split(":")[0] in ("dad", "auto_dad", "local_dad", "rank_dad")


def get_method(
    spec: str,
    axis_name: str | None = "data",
    seed: int = 0,
    other: optax.GradientTransformation | None = None,
) -> tuple[optax.GradientTransformationExtraArgs, DenseFactory]:
  """The optimizer-side transformation and the model's dense factory for a spec.

  Specs: ``"dad"`` (exact), ``"auto_dad"`` (cheapest exact route per
  layer), ``"local_dad"`` (no dAD: every parameter goes to ``other``),
  ``"rank_dad:R"`` (rank-dAD, rank R, one-way) with optional flags
  ``:two_way``, ``:warm`` (warm start), ``:ef`` (error feedback), e.g.
  ``"rank_dad:4:two_way:ef"``.

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
    ValueError: for an unknown spec or invalid options.
  """
  options = _parse(spec)
  dense = DenseFactory(axis_name=axis_name, seed=seed, **options)
  return synchronize(dense.mask, other, axis_name=axis_name), dense
