"""Methods by name: one registry, one spec parser, one error.

Every family declares its methods where it defines them, with a decorator
that names the method, types its arguments (defaults, allowed ranges) and
documents it::

    @register_compressor("topk", Arg("ratio", float, within="(0, 1]", doc="fraction kept"))
    def topk(ratio: float = 0.01) -> Compressor: ...

A method builder also takes the build context (``axis_name``, ``seed``) as
keywords and returns a :class:`Method` (or an optax transformation, which
becomes ``Method(tx=...)``); arguments typed :data:`COMPRESSOR` arrive
built::

    @register_method("accordion", Arg("low", COMPRESSOR), Arg("high", COMPRESSOR),
                     Arg("eta", float, within="(0, inf)", doc="critical threshold"),
                     doc="Accordion: low in critical regimes, high otherwise")
    def _accordion(low, high, eta=0.5, *, axis_name="data", seed=0):
      return accordion(low, high, eta=eta, axis_name=axis_name, seed=seed)

Two kinds live here. A *compressor* spec builds a
:class:`~dadjax.compress.Compressor`; a *method* spec builds a
:class:`Method` (what the train step needs). Every compressor spec is
also a method spec: the compressor, communicated by
:func:`dadjax.compress.compressed`.

Spec syntax (case-insensitive)::

    name                               topk, dad, allreduce
    name:arg:arg:key=value             topk:0.01, rank_dad:2:two_way:warm, qsgd:4:bucket_size=512
    name(arg, arg, key=value)          qsgd(4, bucket_size=512)
    nested specs as arguments          ef(topk:0.01), accordion(powersgd:2, powersgd:1),
                                       dataquant:2:correct=topk(0.1):gate=0.5

Positional arguments fill the non-flag arguments in order; a flag (a
``bool`` argument) is set by its bare name (``rank_dad:2:two_way``) or by
``name=true``. A nested spec with arguments of its own needs the
parenthesized form inside a colon spec (``correct=topk(0.1)``); inside
parentheses either form works. ``ef_<compressor>`` means
``ef(<compressor>)`` (a prefix alias).

This module imports nothing from ``dadjax`` but its error types; the built-in families
(``dadjax.compress``, ``dadjax.dad``, ``dadjax.methods`` and, when
present, ``dadjax.adaptive`` and ``dadjax.dataquant``) register themselves
when they are imported, and are imported on the first lookup.
"""

from __future__ import annotations

import importlib
import inspect
import math
import re
from typing import Any, Callable, NamedTuple

import optax

from dadjax.errors import DadjaxError

__all__ = [
    "Arg",
    "COMPRESSOR",
    "Entry",
    "METHOD",
    "Method",
    "Spec",
    "SpecError",
    "build",
    "describe",
    "entries",
    "format_spec",
    "get_compressor",
    "lift_compressors",
    "lookup",
    "parse_spec",
    "register",
    "register_compressor",
    "register_method",
    "resolve",
    "split_specs",
    "valid_forms",
]

KINDS = ("compressor", "method")

# Imported on the first lookup; optional ones may be absent.
_BUILTIN_FAMILIES = ("dadjax.compress", "dadjax.dad", "dadjax.methods")
_OPTIONAL_FAMILIES = ("dadjax.adaptive", "dadjax.dataquant", "dadjax.local")


class Method(NamedTuple):
  """What a communication method gives the train step (any field may be ``None``).

  Attributes:
    name: the spec it was built from.
    tx: the communicating optax transformation; put it first in the
      optimizer chain.
    dense: a dense-layer factory the model must be built with (dAD).
    batch_stage: a :class:`~dadjax.stage.BatchStage` that runs on the site's
      batch instead of the plain backward pass (data-side methods).
    wrap: ``optimizer -> optimizer`` applied to the whole chain (``tx``, then
      the local optimizer) for methods that decide *when* an update happens
      (Accordion's batch-size mode accumulates micro-steps and runs the
      chain once per cycle); ``None`` leaves the chain as it is.
  """

  name: str
  tx: optax.GradientTransformation | None = None
  dense: Callable[..., Any] | None = None
  batch_stage: Any = None
  wrap: Callable[[optax.GradientTransformation], optax.GradientTransformation] | None = None

  def optimizer(self, local: optax.GradientTransformation) -> optax.GradientTransformation:
    """The optimizer a run uses: ``tx`` first, then ``local``, under ``wrap``.

    Args:
      local: the local optimizer, e.g. ``optax.sgd(0.1, momentum=0.9)``.
    """
    chain = optax.chain(self.tx if self.tx is not None else optax.identity(), local)
    return self.wrap(chain) if self.wrap is not None else chain


# -- the parse tree -----------------------------------------------------------------------


class Spec(NamedTuple):
  """A parsed spec: ``name``, positional ``args`` and ``kwargs`` (``(key, value)`` pairs).

  A value is a ``str`` (an atom such as ``"0.01"``, ``"two_way"`` or a bare
  name like ``"sign"``) or a nested :class:`Spec` (a name with arguments).
  ``str(spec)`` is the canonical text; ``parse_spec(str(spec)) == spec``.
  """

  name: str
  args: tuple = ()
  kwargs: tuple = ()

  def __str__(self) -> str:
    return format_spec(self)


_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_TOKEN = re.compile(r"\s*(?:([():,=])|([^():,=\s]+))")


class _ParseError(Exception):
  pass


def _tokenize(text: str) -> list[str]:
  tokens, pos = [], 0
  text = text.rstrip()
  while pos < len(text):
    m = _TOKEN.match(text, pos)
    if m is None:  # only whitespace can fail to match, and rstrip removed the tail
      raise _ParseError(f"unexpected character at position {pos}")
    tokens.append(m.group(1) or m.group(2))
    pos = m.end()
  return tokens


class _Parser:
  """Recursive descent over the tokens of one spec."""

  def __init__(self, text: str):
    self.tokens = _tokenize(text)
    self.i = 0

  def peek(self) -> str | None:
    return self.tokens[self.i] if self.i < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise _ParseError("unexpected end of spec")
    self.i += 1
    return tok

  def atom(self, what: str) -> str:
    tok = self.take()
    if tok in "():,=":
      raise _ParseError(f"expected {what}, got {tok!r}")
    return tok

  def name(self) -> str:
    tok = self.atom("a name")
    if not _NAME.match(tok):
      raise _ParseError(f"{tok!r} is not a name (letters, digits and '_', starting with a letter)")
    return tok

  def spec(self, colon_args: bool = True) -> Spec | str:
    """``name``, ``name(items)`` or (if ``colon_args``) ``name:item:item``."""
    name = self.name()
    args: list = []
    kwargs: list = []
    if self.peek() == "(":
      self.take()
      if self.peek() == ")":
        self.take()
      else:
        while True:
          self.item(args, kwargs, nested_colons=True)
          tok = self.take()
          if tok == ")":
            break
          if tok != ",":
            raise _ParseError(f"expected ',' or ')', got {tok!r}")
    elif colon_args:
      while self.peek() == ":":
        self.take()
        self.item(args, kwargs, nested_colons=False)
    if not args and not kwargs:
      return name
    return Spec(name, tuple(args), tuple(kwargs))

  def item(self, args: list, kwargs: list, nested_colons: bool) -> None:
    key = None
    if self.i + 1 < len(self.tokens) and self.tokens[self.i + 1] == "=":
      key = self.name()
      self.take()
      if key in {k for k, _ in kwargs}:
        raise _ParseError(f"argument {key!r} given twice")
    elif kwargs:
      raise _ParseError("a positional argument follows a keyword argument")
    value = self.value(nested_colons)
    if key is None:
      args.append(value)
    else:
      kwargs.append((key, value))

  def value(self, nested_colons: bool) -> Spec | str:
    tok = self.peek()
    nxt = self.tokens[self.i + 1] if self.i + 1 < len(self.tokens) else None
    if tok is not None and _NAME.match(tok) and (nxt == "(" or (nested_colons and nxt == ":")):
      return self.spec(colon_args=nested_colons)
    return self.atom("a value")


def _parse(text: str) -> Spec:
  parser = _Parser(text.strip().lower())
  if not parser.tokens:
    raise _ParseError("empty spec")
  tree = parser.spec()
  if parser.peek() is not None:
    raise _ParseError(f"unexpected {parser.peek()!r} after the spec")
  return tree if isinstance(tree, Spec) else Spec(tree)


def parse_spec(text: str, kind: str = "method") -> Spec:
  """Parse a spec string into its tree (no lookup, no conversion).

  Args:
    text: e.g. ``"accordion(powersgd:2, powersgd:1)"``.
    kind: the kind whose valid forms the error lists.

  Returns:
    A :class:`Spec`.

  Raises:
    SpecError: for malformed text.
  """
  if not isinstance(text, str):
    raise SpecError(repr(text), "not a string", kind)
  try:
    return _parse(text)
  except _ParseError as e:
    raise SpecError(text, f"malformed: {e}", kind) from None


def split_specs(text: str) -> list[str]:
  """Split a comma-separated list of specs at the commas outside parentheses.

  ``"topk:0.01, accordion(powersgd:2,powersgd:1)"`` ->
  ``["topk:0.01", "accordion(powersgd:2,powersgd:1)"]``.
  """
  parts, depth, start = [], 0, 0
  for i, ch in enumerate(text):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if ch == "," and depth == 0:
      parts.append(text[start:i])
      start = i + 1
  parts.append(text[start:])
  return [p.strip() for p in parts if p.strip()]


def _format_value(value: Spec | str, inside_parens: bool) -> str:
  if isinstance(value, Spec):
    return format_spec(value, _nested=not inside_parens)
  return value


def format_spec(spec: Spec | str, _nested: bool = False) -> str:
  """The canonical text of a spec tree (the inverse of :func:`parse_spec`).

  The colon form when every value is an atom, the parenthesized form
  otherwise (and for a nested spec inside a colon form).
  """
  if isinstance(spec, str):
    return spec
  if not spec.args and not spec.kwargs:
    return spec.name
  flat = all(isinstance(v, str) for v in (*spec.args, *(v for _, v in spec.kwargs)))
  if flat and not _nested:
    parts = [*spec.args, *(f"{k}={v}" for k, v in spec.kwargs)]
    return ":".join([spec.name, *parts])
  parts = [_format_value(v, True) for v in spec.args]
  parts += [f"{k}={_format_value(v, True)}" for k, v in spec.kwargs]
  return f"{spec.name}({', '.join(parts)})"


# -- arguments and entries -----------------------------------------------------------------

COMPRESSOR = "compressor"  # an argument that is a nested compressor spec
METHOD = "method"  # an argument that is a nested method spec (built with the same axis and seed)

_TYPES = (int, float, bool, str, COMPRESSOR, METHOD)
_FROM_SIGNATURE = object()
_REQUIRED = inspect.Parameter.empty
_INTERVAL = re.compile(r"([\[(])\s*([^,\s]+)\s*,\s*([^,\s]+)\s*([\])])\Z")
_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class Arg(NamedTuple):
  """One typed argument of a registered method.

  Attributes:
    name: the builder's keyword (also the key in ``name=value``).
    type: ``int``, ``float``, ``bool`` (a flag), ``str``, :data:`COMPRESSOR`
      or :data:`METHOD`.
    default: the default; by default read from the builder's signature
      (a parameter without a default makes the argument required).
    within: allowed interval of an ``int`` / ``float``, e.g. ``"(0, 1]"``,
      ``"[1, inf)"``.
    choices: allowed values of a ``str``.
    doc: one line.
    positional: whether it may be given without its key (flags never take
      a position: they are set by their bare name).
  """

  name: str
  type: Any
  default: Any = _FROM_SIGNATURE
  within: str | None = None
  choices: tuple | None = None
  doc: str = ""
  positional: bool = True

  @property
  def required(self) -> bool:
    return self.default is _REQUIRED

  @property
  def is_flag(self) -> bool:
    return self.type is bool

  @property
  def type_name(self) -> str:
    return self.type if isinstance(self.type, str) else self.type.__name__

  def describe(self) -> str:
    """``name: float in (0, 1], default 0.01 -- doc``."""
    text = f"{self.name}: {self.type_name}"
    if self.within:
      text += f" in {self.within}"
    if self.choices:
      text += f" in {{{', '.join(self.choices)}}}"
    if self.default is None:
      text += " or none"
    text += ", required" if self.required else f", default {_show(self.default)}"
    return text + (f" -- {self.doc}" if self.doc else "")


def _show(value: Any) -> str:
  if isinstance(value, bool):
    return "true" if value else "false"
  if value is None:
    return "none"
  return str(value)


class Entry(NamedTuple):
  """A registered method: its kind, name, typed arguments, builder and docs.

  ``family`` is the package that registered it; ``aliases`` are other names
  for it; a spec named ``prefix + X`` means ``name(X)`` (``ef_topk`` ->
  ``ef(topk)``).
  """

  kind: str
  name: str
  args: tuple[Arg, ...]
  fn: Callable[..., Any]
  doc: str
  family: str
  aliases: tuple[str, ...] = ()
  prefix: str | None = None

  def form(self) -> str:
    """The spec's shape: ``topk[:RATIO]``, ``rank_dad[:RANK][:two_way]``, ``ef(COMPRESSOR)``."""
    if any(a.type in (COMPRESSOR, METHOD) for a in self.args):
      required = [a.name.upper() for a in self.args if a.required]
      optional = [f"{a.name}=.." for a in self.args if not a.required]
      tail = f"[{', ' if required else ''}{', '.join(optional)}]" if optional else ""
      text = f"{self.name}({', '.join(required)}{tail})"
      if self.prefix:
        text += f" or {self.prefix}{'_'.join(required) or 'X'}"
      return text
    text = self.name
    for a in self.args:
      if a.is_flag:
        text += f"[:{a.name}]"
      elif a.positional:
        text += f":{a.name.upper()}" if a.required else f"[:{a.name.upper()}]"
    return text


_ENTRIES: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
_ALIASES: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
_LIFT: list[Callable[..., Method]] = []
_loaded = False


def _parse_interval(within: str) -> tuple[float, float, bool, bool]:
  m = _INTERVAL.match(within.strip())
  if m is None:
    raise ValueError(f"within must look like '(0, 1]' or '[1, inf)', got {within!r}")
  lo, hi = float(m.group(2)), float(m.group(3))
  return lo, hi, m.group(1) == "[", m.group(4) == "]"


def _in_interval(value: float, within: str) -> bool:
  lo, hi, lo_closed, hi_closed = _parse_interval(within)
  if math.isnan(value):
    return False
  above = value >= lo if lo_closed else value > lo
  below = value <= hi if hi_closed else value < hi
  return above and below


def register(
    kind: str,
    name: str,
    *args: Arg,
    doc: str | None = None,
    family: str | None = None,
    aliases: tuple[str, ...] = (),
    prefix: str | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
  """Decorator: register ``fn`` as the builder of spec ``name``.

  The builder is called with the converted arguments as keywords; method
  builders also receive the build context (``axis_name``, ``seed``) as
  keywords and return a :class:`Method` or an optax transformation (then
  it becomes ``Method(tx=...)``); compressor builders return a
  ``Compressor``. The decorated function is returned unchanged.

  Args:
    kind: ``"compressor"`` or ``"method"``.
    name: the spec name (lower case, ``[a-z][a-z0-9_]*``).
    *args: its :class:`Arg` s, in positional order.
    doc: one line (required); default: the first line of the builder's docstring.
    family: the registering package; default: from the builder's module.
    aliases: other names for the same entry.
    prefix: ``prefix + X`` means ``name(X)``, for one-argument wrappers.

  Returns:
    The decorator.

  Raises:
    ValueError: for a bad name, a duplicate, a missing doc, or an argument
      the builder does not take.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  for n in (name, *aliases):
    if not _NAME.match(n):
      raise ValueError(f"name must match [a-z][a-z0-9_]*, got {n!r}")
    if n in _ENTRIES[kind] or n in _ALIASES[kind]:
      raise ValueError(f"a {kind} named {n!r} is already registered")

  def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
    params = inspect.signature(fn).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    resolved = []
    for a in args:
      if a.name not in params and not takes_kwargs:
        raise ValueError(f"{name}: the builder has no parameter {a.name!r}")
      if a.type not in _TYPES:
        raise ValueError(f"{name}: {a.name}: type must be one of int, float, bool, str, "
                         f"COMPRESSOR, METHOD, got {a.type!r}")
      if a.within is not None:
        if a.type not in (int, float):
          raise ValueError(f"{name}: {a.name}: within applies to int and float arguments")
        _parse_interval(a.within)
      if a.choices is not None and a.type is not str:
        raise ValueError(f"{name}: {a.name}: choices apply to str arguments")
      if a.default is _FROM_SIGNATURE:
        p = params.get(a.name)
        a = a._replace(default=p.default if p is not None else _REQUIRED)
      resolved.append(a)
    text = doc if doc is not None else (inspect.getdoc(fn) or "").split("\n")[0]
    if not text.strip():
      raise ValueError(f"{name}: give a one-line doc (doc=... or a docstring)")
    module = fn.__module__ or ""
    fam = family or (module.split(".")[1] if module.startswith("dadjax.") else module)
    entry = Entry(kind, name, tuple(resolved), fn, text, fam, tuple(aliases), prefix)
    _ENTRIES[kind][name] = entry
    for alias in aliases:
      _ALIASES[kind][alias] = name
    return fn

  return decorator


def register_compressor(name: str, *args: Arg, **options: Any):
  """``register("compressor", ...)``."""
  return register("compressor", name, *args, **options)


def register_method(name: str, *args: Arg, **options: Any):
  """``register("method", ...)``."""
  return register("method", name, *args, **options)


def lift_compressors(fn: Callable[..., Method]) -> Callable[..., Method]:
  """Register how a compressor becomes a method: ``fn(compressor, *, axis_name, seed)``."""
  _LIFT[:] = [fn]
  return fn


def _unregister(kind: str, name: str) -> None:
  """Remove an entry (for tests)."""
  entry = _ENTRIES[kind].pop(name)
  for alias in entry.aliases:
    _ALIASES[kind].pop(alias, None)


def _load() -> None:
  global _loaded
  if _loaded:
    return
  _loaded = True  # before importing: a family may look things up while it loads
  try:
    for module in _BUILTIN_FAMILIES:
      importlib.import_module(module)
    for module in _OPTIONAL_FAMILIES:
      try:
        importlib.import_module(module)
      except ModuleNotFoundError as e:
        if e.name != module:
          raise
  except BaseException:
    _loaded = False
    raise


def entries(kind: str = "method") -> list[Entry]:
  """Every registered entry of ``kind``, in registration order.

  ``entries("method")`` lists the explicit methods only; every compressor
  (``entries("compressor")``) is a method too.
  """
  _load()
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  return list(_ENTRIES[kind].values())


def valid_forms(kind: str = "method") -> list[str]:
  """The form of every spec of ``kind`` (methods include the compressors)."""
  forms = []
  kinds = ("method", "compressor") if kind == "method" else (kind,)
  taken: set[str] = set()
  for k in kinds:
    for e in entries(k):
      aliases = [a for a in e.aliases if a not in taken]
      if e.name not in taken:
        forms.append(" | ".join([e.form(), *aliases]))
      taken.update((e.name, *e.aliases))
  return forms


class SpecError(DadjaxError):
  """A spec that does not parse, names no registered method, or has bad arguments.

  The message says what is wrong and lists every valid form of the kind
  (``listed``: of the nested argument's kind when that argument is wrong).
  """

  def __init__(self, spec: str, why: str, kind: str = "method", unknown: bool = False,
               listed: str | None = None):
    self.spec, self.why, self.kind, self.listed = spec, why, kind, listed or kind
    try:
      forms = valid_forms(self.listed)
    except Exception:  # pylint: disable=broad-except
      forms = []
    listing = ", ".join(forms)
    head = f"unknown {kind} {spec!r}" if unknown else f"bad {kind} spec {spec!r}"
    super().__init__(f"{head}: {why}; valid forms: {listing}. Arguments go "
                     "as NAME:A:B:KEY=V or NAME(A, B, KEY=V); `dadjax methods` lists their types, "
                     "ranges and defaults")


# -- lookup, conversion, build ------------------------------------------------------------------


def lookup(kind: str, name: str) -> Entry | None:
  """The entry a spec name refers to (aliases resolved), or ``None``."""
  _load()
  name = _ALIASES[kind].get(name, name)
  return _ENTRIES[kind].get(name)


def _find(kind: str, tree: Spec, text: str) -> tuple[Entry, Spec]:
  """The entry for ``tree`` and the tree rewritten for it (prefix aliases expanded)."""
  entry = lookup(kind, tree.name)
  if entry is not None:
    return entry, tree
  for candidate in entries(kind):
    p = candidate.prefix
    if p and tree.name.startswith(p):
      rest = tree.name[len(p):]
      if not _NAME.match(rest):
        why = f"{p!r} must be followed by a {candidate.args[0].type_name} name"
        raise SpecError(text, why, kind)
      inner = Spec(rest, tree.args, tree.kwargs) if (tree.args or tree.kwargs) else rest
      return candidate, Spec(candidate.name, (inner,))
  raise SpecError(text, f"no {kind} named {tree.name!r}", kind, unknown=True)


def _convert(arg: Arg, value: Spec | str, entry: Entry, text: str, context: dict,
             kind: str) -> Any:

  def bad(expected: str) -> SpecError:
    shown = format_spec(value)
    return SpecError(text, f"{entry.name}: {arg.name} must be {expected}, got {shown!r}", kind)

  if value == "none" and arg.default is None:
    return None
  if arg.type in (COMPRESSOR, METHOD):
    tree = value if isinstance(value, Spec) else Spec(value)
    sub = "compressor" if arg.type == COMPRESSOR else "method"
    try:
      return _build(sub, tree, format_spec(tree), context if sub == "method" else {})
    except SpecError as e:  # name the outer spec and the argument; list the nested kind's forms
      raise SpecError(text, f"{entry.name}: {arg.name}: {e.why}", kind, listed=e.listed) from None
  if isinstance(value, Spec):
    raise bad(f"a {arg.type_name}, not a spec")
  if arg.type is bool:
    if value in _TRUE:
      return True
    if value in _FALSE:
      return False
    raise bad("true or false")
  if arg.type is int:
    try:
      out = int(value)
    except ValueError:
      raise bad(f"an int{' in ' + arg.within if arg.within else ''}") from None
  elif arg.type is float:
    try:
      out = float(value)
    except ValueError:
      raise bad(f"a float{' in ' + arg.within if arg.within else ''}") from None
  elif arg.type is str:
    out = value
    if arg.choices and out not in arg.choices:
      raise bad(f"one of {', '.join(arg.choices)}")
  else:
    raise TypeError(f"{entry.name}: unsupported argument type {arg.type!r}")
  if arg.within and not _in_interval(out, arg.within):
    raise bad(f"{'an' if arg.type is int else 'a'} {arg.type_name} in {arg.within}")
  return out


def _bind(entry: Entry, tree: Spec, text: str, context: dict, kind: str) -> dict[str, Any]:
  by_name = {a.name: a for a in entry.args}
  flags = [a.name for a in entry.args if a.is_flag]
  slots = [a for a in entry.args if a.positional and not a.is_flag]
  raw: dict[str, Spec | str] = {}
  for value in tree.args:
    if isinstance(value, str) and value in flags:
      if value in raw:
        raise SpecError(text, f"{entry.name}: flag {value!r} given twice", kind)
      raw[value] = "true"
      continue
    slots = [a for a in slots if a.name not in raw]
    if not slots:
      hint = f" (flags: {', '.join(flags)})" if flags else ""
      why = (f"{entry.name}: unexpected argument {format_spec(value)!r}; it takes "
             f"{len([a for a in entry.args if a.positional and not a.is_flag])} positional "
             f"argument(s){hint}")
      raise SpecError(text, why, kind)
    raw[slots[0].name] = value
    slots = slots[1:]
  for key, value in tree.kwargs:
    if key not in by_name:
      valid = ", ".join(by_name) or "none"
      raise SpecError(text, f"{entry.name}: unknown argument {key!r} (arguments: {valid})",
                      kind)
    if key in raw:
      raise SpecError(text, f"{entry.name}: argument {key!r} given twice", kind)
    raw[key] = value
  values = {}
  for a in entry.args:
    if a.name in raw:
      values[a.name] = _convert(a, raw[a.name], entry, text, context, kind)
    elif a.required:
      raise SpecError(text, f"{entry.name}: missing required argument {a.name!r}", kind)
  return values


def resolve(kind: str, spec: str | Spec) -> tuple[Entry, dict[str, Any]]:
  """Parse ``spec``, find its entry and convert its arguments (without building it).

  Nested compressor arguments are built (they are values). Returns
  ``(entry, kwargs)``; for a method spec naming a compressor, the entry
  is the compressor's.
  """
  if not isinstance(spec, (str, Spec)):
    raise SpecError(repr(spec), "not a string", kind)
  text = spec.strip() if isinstance(spec, str) else format_spec(spec)
  tree = parse_spec(spec, kind) if isinstance(spec, str) else spec
  entry, tree = _find_any(kind, tree, text)
  return entry, _bind(entry, tree, text, {}, kind)


def _find_any(kind: str, tree: Spec, text: str) -> tuple[Entry, Spec]:
  try:
    return _find(kind, tree, text)
  except SpecError:
    if kind != "method":
      raise
  try:
    return _find("compressor", tree, text)
  except SpecError:
    raise SpecError(text, f"no method named {tree.name!r}", kind, unknown=True) from None


def _accepted(fn: Callable[..., Any], context: dict) -> dict:
  """The build-context keywords ``fn`` takes (all of them if it takes ``**kwargs``).

  The context may carry run facts some builders use and others ignore
  (``steps_per_epoch``, ``lr_schedule``).
  """
  params = inspect.signature(fn).parameters
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
    return context
  return {k: v for k, v in context.items() if k in params}


def _build(kind: str, tree: Spec, text: str, context: dict) -> Any:
  entry, tree = _find_any(kind, tree, text)
  values = _bind(entry, tree, text, context, kind)
  try:
    if entry.kind == "compressor":
      out = entry.fn(**values)
    else:
      out = entry.fn(**values, **_accepted(entry.fn, context))
  except SpecError:
    raise
  except ValueError as e:  # the builder's own check, naming the argument
    raise SpecError(text, f"{entry.name}: {e}", kind) from e
  if kind == "compressor":
    return out
  if entry.kind == "compressor":
    if not _LIFT:
      raise RuntimeError("no compressor -> method lift registered (dadjax.methods not loaded)")
    out = _LIFT[0](out, **_accepted(_LIFT[0], context))
  return out._replace(name=text) if isinstance(out, Method) else Method(text, tx=out)


def build(kind: str, spec: str | Spec, **context: Any) -> Any:
  """Build a spec of ``kind``.

  Args:
    kind: ``"compressor"`` or ``"method"``.
    spec: the spec text or a parsed :class:`Spec`.
    **context: for methods, the builders' context (``axis_name``, ``seed``;
      optionally run facts such as ``steps_per_epoch`` and ``lr_schedule``);
      each builder receives the keywords it takes.

  Returns:
    A ``Compressor`` or a :class:`Method` (named ``spec``).

  Raises:
    SpecError: for a malformed spec, an unknown name or bad arguments,
      listing every valid form.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  if not isinstance(spec, (str, Spec)):
    raise SpecError(repr(spec), "not a string", kind)
  text = spec.strip() if isinstance(spec, str) else format_spec(spec)
  tree = parse_spec(spec, kind) if isinstance(spec, str) else spec
  return _build(kind, tree, text, context)


def get_compressor(spec: str | Spec) -> Any:
  """Build a compressor from its spec (``"topk:0.01"``, ``"ef(topk:0.01)"``, ``"ef_scaled_sign"``).

  Args:
    spec: a compressor spec; ``dadjax methods`` (or :func:`describe`) lists
      them with their arguments.

  Returns:
    A :class:`~dadjax.compress.Compressor`.

  Raises:
    SpecError: (a ``ValueError``) for a malformed spec, an unknown name or a
      bad argument, listing every valid form.
  """
  return build("compressor", spec)


def describe() -> str:
  """Every method and compressor spec with its arguments, defaults and docs (``dadjax methods``)."""
  lines = [
      "Method specs (dadjax train method=SPEC). Write arguments as NAME:A:B:KEY=V or",
      "NAME(A, B, KEY=V); specs nest: ef(topk:0.01), accordion(powersgd:2, powersgd:1).",
  ]

  def block(title: str, group: list[Entry]) -> None:
    lines.append("")
    lines.append(title)
    for e in group:
      head = e.form() + (f"  (also: {', '.join(e.aliases)})" if e.aliases else "")
      lines.append(f"  {head}")
      lines.append(f"      {e.doc}")
      for a in e.args:
        lines.append(f"      {a.describe()}")

  families: dict[str, list[Entry]] = {"baseline": []}
  for e in entries("method"):
    families.setdefault(e.family, []).append(e)
  for family, group in families.items():
    block(f"[{family}] methods", group)
  block("[compress] compressors (each is also a method: compressed all-reduce of the gradient)",
        entries("compressor"))
  return "\n".join(lines)
