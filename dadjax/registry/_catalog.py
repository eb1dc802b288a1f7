"""The catalog: registered entries, lookup by name, resolving specs, building them.

Families register their entries where they define them, at import;
``import dadjax`` imports every family package, so the catalog is complete
once ``dadjax`` is imported. Installed packages add entries through the
entry-point group ``dadjax.methods`` (each entry point names a module that
registers when imported), loaded by :func:`load_plugins` and, once, on the
first name the catalog does not know.

Two steps turn spec text into a built method:

- :func:`resolve` checks everything the user wrote, without building
  anything: the grammar, the names, every argument's type and range
  (nested specs included). Every such problem is a :class:`SpecError`.
- :func:`build` calls the builders, innermost first. A builder that finds
  a problem with the values it was given (one no ``Arg`` range can say,
  such as two arguments that disagree) raises :class:`ArgumentError`,
  which becomes a :class:`SpecError` naming the spec; any other exception
  a builder raises propagates as itself.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
from typing import Any, Callable, NamedTuple

from dadjax.errors import DadjaxError
import dadjax.registry._args as _args
import dadjax.registry._grammar as _grammar
from dadjax.registry._args import COMPRESSOR, METHOD, Arg
from dadjax.registry._grammar import Spec, format_spec
from dadjax.registry._method import ArgumentError, BuildContext, Method

KINDS = ("compressor", "method")
PLUGIN_GROUP = "dadjax.methods"


class Entry(NamedTuple):
  """A registered method: its kind, name, typed arguments, builder and docs.

  A compressor builder is called with the converted arguments as keywords
  and returns a ``Compressor``; a method builder is called with the
  :class:`BuildContext` first, then the arguments as keywords, and returns
  a :class:`Method` (or an optax transformation, which becomes
  ``Method(tx=...)``). ``family`` is the package that registered it;
  ``aliases`` are other names for it; a spec named ``prefix + X`` means
  ``name(X)`` (``ef_topk`` -> ``ef(topk)``).
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
    if any(a.is_spec for a in self.args):
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


class Resolved(NamedTuple):
  """A spec checked against the catalog but not built: the value of a nested-spec argument.

  ``kwargs`` holds the converted arguments (nested specs again as
  ``Resolved``); ``text`` is the spec's canonical text; ``kind`` the kind it
  is built as.
  """

  kind: str
  entry: Entry
  kwargs: dict
  text: str


_ENTRIES: dict[str, dict[str, Entry]] = {kind: {} for kind in KINDS}
_ALIASES: dict[str, dict[str, str]] = {kind: {} for kind in KINDS}
_LIFT: list[Callable[[Any, BuildContext], Method]] = []
_PLUGINS: dict[str, Any] = {"entry_points_loaded": False, "modules": []}


# -- registering ----------------------------------------------------------------------------


def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


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

  A compressor builder takes the arguments as keywords and returns a
  ``Compressor``. A method builder takes the :class:`BuildContext` as its
  first (positional) parameter, then the arguments as keywords, and returns
  a :class:`Method` or an optax transformation. The decorated function is
  returned unchanged.

  Args:
    kind: ``"compressor"`` or ``"method"``.
    name: the spec name (lower case, ``[a-z][a-z0-9_]*``).
    *args: its :class:`Arg` s, in positional order.
    doc: one line (required); default: the first line of the builder's docstring.
    family: the registering package; default: from the builder's module
      (``dadjax.dad._methods`` -> ``dad``, ``its_pkg.methods`` -> ``its_pkg``).
    aliases: other names for the same entry.
    prefix: ``prefix + X`` means ``name(X)``, for one-argument wrappers.

  Returns:
    The decorator.

  Raises:
    ValueError: for a bad name, a duplicate, a missing doc, or an argument
      the builder does not take.
  """
  _check_kind(kind)
  for n in (name, *aliases):
    if not _grammar.NAME.match(n):
      raise ValueError(f"name must match [a-z][a-z0-9_]*, got {n!r}")
    if n in _ENTRIES[kind] or n in _ALIASES[kind]:
      raise ValueError(f"a {kind} named {n!r} is already registered")

  def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
    params = dict(inspect.signature(fn).parameters)
    if kind == "method":
      positional = [p for p in params.values()
                    if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
      if not positional:
        raise ValueError(f"{name}: a method builder takes the BuildContext as its first "
                         "parameter, e.g. def build(ctx, ...)")
      params.pop(positional[0].name)
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    resolved = tuple(_args.declare(name, a, params, takes_kwargs) for a in args)
    text = doc if doc is not None else (inspect.getdoc(fn) or "").split("\n")[0]
    if not text.strip():
      raise ValueError(f"{name}: give a one-line doc (doc=... or a docstring)")
    module = fn.__module__ or ""
    # dadjax's own families by subpackage, anyone else's by top-level package
    fam = family or (module.split(".")[1] if module.startswith("dadjax.") else module.split(".")[0])
    entry = Entry(kind, name, resolved, fn, text, fam, tuple(aliases), prefix)
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


def unregister(kind: str, name: str) -> None:
  """Remove an entry and its aliases (tests that register temporary entries)."""
  entry = _ENTRIES[kind].pop(name)
  for alias in entry.aliases:
    _ALIASES[kind].pop(alias, None)


def lift_compressors(fn: Callable[[Any, BuildContext], Method]) -> Callable[..., Any]:
  """Register how a compressor becomes a method: ``fn(compressor, ctx) -> Method``."""
  _LIFT[:] = [fn]
  return fn


def load_plugins(modules: tuple[str, ...] | list[str] = ()) -> list[str]:
  """Import the installed plugins (entry-point group ``dadjax.methods``) and ``modules``.

  Each entry point names a module (``its_pkg.methods``) or an object in one
  (``its_pkg.methods:register``; a callable is called); importing it
  registers its entries. Entry points are loaded once per process.

  Args:
    modules: more modules to import (``dadjax train --plugin MODULE``).

  Returns:
    The names of everything loaded by this call.

  Raises:
    DadjaxError: a plugin that cannot be imported, naming it.
  """
  loaded = []
  if not _PLUGINS["entry_points_loaded"]:
    _PLUGINS["entry_points_loaded"] = True
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
      try:
        obj = ep.load()
      except Exception as e:  # pylint: disable=broad-except
        raise DadjaxError(f"the {PLUGIN_GROUP} plugin {ep.name!r} ({ep.value}) cannot be "
                          f"loaded: {type(e).__name__}: {e}") from e
      if callable(obj) and not inspect.ismodule(obj):
        obj()
      loaded.append(ep.value)
  for module in modules:
    if module in _PLUGINS["modules"]:
      continue
    try:
      importlib.import_module(module)
    except ImportError as e:
      raise DadjaxError(f"plugin module {module!r} cannot be imported: {e}") from e
    _PLUGINS["modules"].append(module)
    loaded.append(module)
  return loaded


# -- looking up -------------------------------------------------------------------------------


def entries(kind: str = "method") -> list[Entry]:
  """Every registered entry of ``kind``, in registration order.

  ``entries("method")`` lists the explicit methods only; every compressor
  (``entries("compressor")``) is a method too.
  """
  _check_kind(kind)
  return list(_ENTRIES[kind].values())


def lookup(kind: str, name: str) -> Entry | None:
  """The entry a spec name refers to (aliases resolved, any case), or ``None``."""
  name = name.lower()
  name = _ALIASES[kind].get(name, name)
  return _ENTRIES[kind].get(name)


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
    self.unknown = unknown
    listing = ", ".join(valid_forms(self.listed))
    head = f"unknown {kind} {spec!r}" if unknown else f"bad {kind} spec {spec!r}"
    super().__init__(f"{head}: {why}; valid forms: {listing}. Arguments go "
                     "as NAME:A:B:KEY=V or NAME(A, B, KEY=V); `dadjax methods` lists their types, "
                     "ranges and defaults")


def parse_spec(text: str, kind: str = "method") -> Spec:
  """Parse a spec string into its tree (no lookup, no conversion).

  Args:
    text: e.g. ``"accordion(powersgd:2, powersgd:1)"``.
    kind: the kind whose valid forms the error lists.

  Returns:
    A :class:`Spec`; names lower-cased, values as written.

  Raises:
    SpecError: for malformed text.
  """
  if not isinstance(text, str):
    raise SpecError(repr(text), "not a string", kind)
  try:
    return _grammar.parse(text)
  except _grammar.ParseError as e:
    raise SpecError(text, f"malformed: {e}", kind) from None


def _find(kind: str, tree: Spec, text: str) -> tuple[Entry, Spec]:
  """The entry for ``tree`` and the tree rewritten for it (prefix aliases expanded)."""
  entry = lookup(kind, tree.name)
  if entry is not None:
    return entry, tree
  for candidate in entries(kind):
    p = candidate.prefix
    if p and tree.name.startswith(p):
      rest = tree.name[len(p):]
      if not _grammar.NAME.match(rest):
        why = f"{p!r} must be followed by a {candidate.args[0].type_name} name"
        raise SpecError(text, why, kind)
      inner = Spec(rest, tree.args, tree.kwargs) if (tree.args or tree.kwargs) else rest
      return candidate, Spec(candidate.name, (inner,))
  raise SpecError(text, f"no {kind} named {tree.name!r}", kind, unknown=True)


def _find_kind(kind: str, tree: Spec, text: str) -> tuple[Entry, Spec]:
  try:
    return _find(kind, tree, text)
  except SpecError:
    if kind != "method":
      raise
  try:
    return _find("compressor", tree, text)
  except SpecError:
    raise SpecError(text, f"no method named {tree.name!r}", kind, unknown=True) from None


def _find_any(kind: str, tree: Spec, text: str) -> tuple[Entry, Spec]:
  """Find a method (a compressor is a method too); installed plugins are loaded on a miss."""
  try:
    return _find_kind(kind, tree, text)
  except SpecError as e:
    if not e.unknown or not load_plugins():
      raise
  return _find_kind(kind, tree, text)


def _convert(arg: Arg, value: Spec | str, entry: Entry, text: str, kind: str) -> Any:
  if isinstance(value, str) and _args.is_none(arg, value):
    return None
  if arg.is_spec:
    sub = "compressor" if arg.type == COMPRESSOR else "method"
    tree = value if isinstance(value, Spec) else Spec(value.lower())
    try:
      return _resolve(sub, tree, format_spec(tree))
    except SpecError as e:  # name the outer spec and the argument; list the nested kind's forms
      raise SpecError(text, f"{entry.name}: {arg.name}: {e.why}", kind, listed=e.listed) from None
  if isinstance(value, Spec):
    expected = f"a {arg.type_name}, not a spec"
  else:
    try:
      return _args.convert(arg, value)
    except _args.Expected as e:
      expected = str(e)
  raise SpecError(text, f"{entry.name}: {arg.name} must be {expected}, got "
                  f"{format_spec(value)!r}", kind)


def _bind(entry: Entry, tree: Spec, text: str, kind: str) -> dict[str, Any]:
  by_name = {a.name: a for a in entry.args}
  flags = [a.name for a in entry.args if a.is_flag]
  slots = [a for a in entry.args if a.positional and not a.is_flag]
  raw: dict[str, Spec | str] = {}
  for value in tree.args:
    if isinstance(value, str) and value.lower() in flags:
      if value.lower() in raw:
        raise SpecError(text, f"{entry.name}: flag {value.lower()!r} given twice", kind)
      raw[value.lower()] = "true"
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
      values[a.name] = _convert(a, raw[a.name], entry, text, kind)
    elif a.required:
      raise SpecError(text, f"{entry.name}: missing required argument {a.name!r}", kind)
  return values


def _resolve(kind: str, tree: Spec, text: str) -> Resolved:
  entry, tree = _find_any(kind, tree, text)
  return Resolved(kind, entry, _bind(entry, tree, text, kind), text)


def _tree(kind: str, spec: str | Spec) -> tuple[str, Spec]:
  if not isinstance(spec, (str, Spec)):
    raise SpecError(repr(spec), "not a string", kind)
  if isinstance(spec, Spec):
    return format_spec(spec), spec
  return spec.strip(), parse_spec(spec, kind)


def resolve(kind: str, spec: str | Spec) -> tuple[Entry, dict[str, Any]]:
  """Check ``spec`` against the catalog without building anything.

  Parses it, finds its entry and converts its arguments; a nested spec
  argument becomes a :class:`Resolved` (checked the same way, not built).

  Returns:
    ``(entry, kwargs)``; for a method spec naming a compressor, the entry
    is the compressor's.

  Raises:
    SpecError: for a malformed spec, an unknown name or a bad argument.
  """
  _check_kind(kind)
  res = _resolve(kind, *reversed(_tree(kind, spec)))
  return res.entry, res.kwargs


# -- building -----------------------------------------------------------------------------------


def _build(res: Resolved, ctx: BuildContext) -> Any:
  entry, kind = res.entry, res.kind
  values = {}
  for key, value in res.kwargs.items():
    if isinstance(value, Resolved):
      try:
        value = _build(value, ctx)
      except SpecError as e:  # a nested builder's ArgumentError: name the outer spec
        raise SpecError(res.text, f"{entry.name}: {key}: {e.why}", kind, listed=e.listed) from e
    values[key] = value
  try:
    out = entry.fn(**values) if entry.kind == "compressor" else entry.fn(ctx, **values)
  except ArgumentError as e:
    raise SpecError(res.text, f"{entry.name}: {e}", kind) from e
  if kind == "compressor":
    return out
  if entry.kind == "compressor":
    if not _LIFT:
      raise RuntimeError("no compressor -> method lift registered (dadjax.methods not imported)")
    out = _LIFT[0](out, ctx)
  return out._replace(name=res.text) if isinstance(out, Method) else Method(res.text, tx=out)


def build(kind: str, spec: str | Spec, context: BuildContext | None = None, **fields: Any) -> Any:
  """Resolve and build a spec of ``kind``.

  Args:
    kind: ``"compressor"`` or ``"method"``.
    spec: the spec text or a parsed :class:`Spec`.
    context: for methods, the :class:`BuildContext` every builder receives;
      default ``BuildContext(**fields)``.
    **fields: :class:`BuildContext` fields (``axis_name``, ``seed``,
      ``steps_per_epoch``, ``lr_schedule``) when ``context`` is not given.

  Returns:
    A ``Compressor`` or a :class:`Method` (named ``spec``).

  Raises:
    SpecError: for a malformed spec, an unknown name or bad arguments,
      listing every valid form. An exception a builder raises other than
      :class:`ArgumentError` propagates as itself.
  """
  _check_kind(kind)
  if context is None:
    context = BuildContext(**fields)
  elif fields:
    context = context._replace(**fields)
  text, tree = _tree(kind, spec)
  return _build(_resolve(kind, tree, text), context)


def get_compressor(spec: str | Spec) -> Any:
  """Build a compressor from its spec (``"topk:0.01"``, ``"ef(topk:0.01)"``, ``"ef_scaled_sign"``).

  Args:
    spec: a compressor spec; ``dadjax methods`` lists them with their arguments.

  Returns:
    A :class:`~dadjax.compress.Compressor`.

  Raises:
    SpecError: (a ``ValueError``) for a malformed spec, an unknown name or a
      bad argument, listing every valid form.
  """
  return build("compressor", spec)
