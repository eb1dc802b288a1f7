"""The config's local optimizer and learning-rate schedule, by name.

``optimizer`` is ``"sgd"`` (with the config's ``momentum``), ``"adam"``, or
any optax alias with keyword arguments, written in the spec grammar:
``"adamw(learning_rate=3e-4, weight_decay=0.1)"``, ``"lion(b1=0.95)"``, or
Muon from ``optax.contrib`` (``"muon"``, ``"muon(beta=0.9)"``: Newton-Schulz
orthogonalized momentum on matrices, AdamW on the other leaves; MuLoCo's
inner optimizer, arXiv 2505.23725).
``learning_rate`` defaults to the config's schedule. ``lr_schedule`` is
``"constant"`` (``config.lr``), a step decay ``"step:FACTOR:S1[:S2...]"``,
or any optax schedule with its arguments:
``"warmup_cosine_decay_schedule(init_value=0, peak_value=0.1, warmup_steps=10,
decay_steps=300)"`` (then ``config.lr`` is not used). Values are numbers,
``true`` / ``false``, ``none`` or words; a value may itself be a call
(``learning_rate=linear_schedule(0.1, 0.01, 100)``).

Each text is parsed once (the parse is cached); building returns fresh
optax objects.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, NamedTuple

from dadjax.errors import ConfigError
from dadjax.registry import SpecError, parse_spec
from dadjax.registry import Spec

SCHEDULE_FORMS = ("'constant', 'step:FACTOR:S1[:S2...]' (e.g. 'step:0.1:150:250') or an optax "
                  "schedule such as 'warmup_cosine_decay_schedule(init_value=0, peak_value=0.1, "
                  "warmup_steps=10, decay_steps=300)'")


class Call(NamedTuple):
  """A parsed call: an optax function and its (converted) arguments."""

  name: str
  fn: Callable[..., Any]
  args: tuple
  kwargs: dict

  def __call__(self, **extra: Any) -> Any:
    args = tuple(a() if isinstance(a, Call) else a for a in self.args)
    kwargs = {k: v() if isinstance(v, Call) else v for k, v in {**extra, **self.kwargs}.items()}
    return self.fn(*args, **kwargs)


def _atom(text: str) -> Any:
  low = text.lower()
  if low in ("true", "false"):
    return low == "true"
  if low == "none":
    return None
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


def _schedules() -> dict[str, Callable[..., Any]]:
  import optax  # pylint: disable=g-import-not-at-top
  return {n: getattr(optax.schedules, n) for n in dir(optax.schedules)
          if not n.startswith("_") and not n.startswith("inject") and
          inspect.isfunction(getattr(optax.schedules, n))}


# optax optimizers whose update needs more than the gradient (the loss value and
# function for a line search), which the train step does not hand them.
_NEEDS_LOSS = ("lbfgs",)


# optax.contrib optimizers offered by name (contrib is optax's staging area; each is added
# on purpose, not every contrib function).
CONTRIB = ("muon",)


def _aliases() -> dict[str, Callable[..., Any]]:
  """optax's optimizers: its functions whose first parameter is ``learning_rate``
  (not the ``scale_by_*`` building blocks, nor those whose update needs the loss),
  and the :data:`CONTRIB` optimizers of ``optax.contrib``."""
  import optax  # pylint: disable=g-import-not-at-top
  import optax.contrib  # pylint: disable=g-import-not-at-top
  out = {}
  for n in dir(optax):
    fn = getattr(optax, n)
    if (n.startswith(("_", "scale_by")) or n in _NEEDS_LOSS or not inspect.isfunction(fn)):
      continue
    params = list(inspect.signature(fn).parameters)
    if params and params[0] == "learning_rate":
      out[n] = fn
  for n in CONTRIB:
    if n not in out and hasattr(optax.contrib, n):
      out[n] = getattr(optax.contrib, n)
  return out


def _call(tree: Spec, field: str, table: dict[str, Callable[..., Any]], what: str) -> Call:
  if tree.name not in table:
    near = ", ".join(sorted(table))
    raise ConfigError(f"config.{field}: {tree.name!r} is not an optax {what}; valid names: {near}")
  fn = table[tree.name]
  calls = {**_schedules(), **_aliases()}

  def value(v):
    if isinstance(v, Spec):
      if v.name not in calls:
        raise ConfigError(f"config.{field}: {v.name!r} in {tree.name}(...) is not an optax "
                          "schedule or optimizer")
      return _call(v, field, calls, "schedule or optimizer")
    return _atom(v)

  args = tuple(value(v) for v in tree.args)
  kwargs = {k: value(v) for k, v in tree.kwargs}
  try:
    inspect.signature(fn).bind_partial(*args, **kwargs)
  except TypeError as e:
    params = ", ".join(inspect.signature(fn).parameters)
    raise ConfigError(f"config.{field}: {tree.name}: {e} (its parameters: {params})") from None
  return Call(tree.name, fn, args, kwargs)


def _tree(text: str, field: str) -> Spec:
  try:
    return parse_spec(text)
  except SpecError as e:
    raise ConfigError(f"config.{field}: cannot read {text!r}: {e.why}") from None


def _step_decay(text: str) -> tuple[float, tuple[int, ...]]:
  forms = f"valid forms: {SCHEDULE_FORMS}"
  parts = text.split(":")
  if len(parts) < 3:
    raise ConfigError(f"config.lr_schedule: unknown schedule {text!r}; {forms}")
  try:
    factor = float(parts[1])
  except ValueError:
    raise ConfigError(f"config.lr_schedule: FACTOR must be a number in (0, 1), got "
                      f"{parts[1]!r} in {text!r}; {forms}") from None
  if not (math.isfinite(factor) and 0 < factor < 1):
    raise ConfigError(f"config.lr_schedule: FACTOR must be a number in (0, 1), got {factor!r} "
                      f"in {text!r}; {forms}")
  try:
    steps = tuple(int(p) for p in parts[2:])
  except ValueError:
    raise ConfigError(f"config.lr_schedule: the decay steps must be ints >= 1, got "
                      f"{parts[2:]} in {text!r}; {forms}") from None
  if max(steps) > 2**31 - 1:
    raise ConfigError(f"config.lr_schedule: the decay steps must be ints <= {2**31 - 1} (the "
                      f"step counter is int32), got {max(steps)} in {text!r}; {forms}")
  if min(steps) < 1 or any(b <= a for a, b in zip(steps, steps[1:])):
    raise ConfigError(f"config.lr_schedule: the decay steps must be increasing ints >= 1, got "
                      f"{list(steps)} in {text!r}; {forms}")
  return factor, steps


@functools.lru_cache(maxsize=256)
def parse_schedule(text: str) -> tuple[float, tuple[int, ...]] | Call:
  """``config.lr_schedule`` parsed: ``(factor, boundaries)`` for ``constant`` / ``step:``
  (``"constant"`` is ``(1.0, ())``), else the optax schedule's :class:`Call`.

  Raises:
    ConfigError: naming ``config.lr_schedule`` and the valid forms.
  """
  if text == "constant":
    return 1.0, ()
  if text.startswith("step:") or text == "step":
    return _step_decay(text)
  if "(" not in text:
    raise ConfigError(f"config.lr_schedule: unknown schedule {text!r}; valid forms: "
                      f"{SCHEDULE_FORMS}")
  return _call(_tree(text, "lr_schedule"), "lr_schedule", _schedules(), "schedule")


@functools.lru_cache(maxsize=256)
def parse_optimizer(text: str) -> Call:
  """``config.optimizer`` parsed into the optax alias's :class:`Call`.

  Raises:
    ConfigError: an unknown alias or an argument it does not take.
  """
  return _call(_tree(text, "optimizer"), "optimizer", _aliases(), "optimizer")


def is_constant(text: str) -> bool:
  return parse_schedule(text) == (1.0, ())


def make_schedule(text: str, lr: float) -> Callable[[Any], Any]:
  """The schedule (step -> learning rate) of ``lr_schedule`` text and ``lr``."""
  import optax  # pylint: disable=g-import-not-at-top
  parsed = parse_schedule(text)
  if isinstance(parsed, Call):
    return parsed()
  factor, steps = parsed
  if not steps:
    return optax.constant_schedule(lr)
  return optax.piecewise_constant_schedule(lr, {s: factor for s in steps})


def make_local_optimizer(optimizer: str, learning_rate: Any, momentum: float,
                         clip_global_norm: float | None = None):
  """The local optimizer (after the communicating transformation).

  Args:
    optimizer: ``config.optimizer`` text.
    learning_rate: a float or a schedule, used unless the text gives one.
    momentum: ``config.momentum``, for ``sgd`` when the text does not set it.
    clip_global_norm: clip the (communicated) gradient to this global norm
      first; ``None``: no clipping.
  """
  import optax  # pylint: disable=g-import-not-at-top
  call = parse_optimizer(optimizer)
  extra: dict[str, Any] = {}
  if "learning_rate" not in call.kwargs and not call.args:
    extra["learning_rate"] = learning_rate
  if call.name == "sgd" and "momentum" not in call.kwargs and len(call.args) < 2:
    extra["momentum"] = momentum or None
  tx = call(**extra)
  if clip_global_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(clip_global_norm), tx)
  return tx
