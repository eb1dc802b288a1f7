"""The spec grammar: text <-> :class:`Spec` trees (no lookup, no conversion).

::

    name                               topk, dad, allreduce
    name:arg:arg:key=value             topk:0.01, rank_dad:2:two_way:warm, qsgd:4:bucket_size=512
    name(arg, arg, key=value)          qsgd(4, bucket_size=512)
    nested specs as arguments          ef(topk:0.01), accordion(powersgd:2, powersgd:1),
                                       dataquant:2:correct=topk(0.1):gate=0.5

Names (the spec's, nested specs' and keys) are case-insensitive and come
out lower-cased; atom values keep the case they were written in. A nested
spec with arguments of its own needs the parenthesized form inside a colon
spec (``correct=topk(0.1)``); inside parentheses either form works.
"""

from __future__ import annotations

import re
from typing import NamedTuple

NAME = re.compile(r"[a-z][a-z0-9_]*\Z")
_TOKEN = re.compile(r"\s*(?:([():,=])|([^():,=\s]+))")


class Spec(NamedTuple):
  """A parsed spec: ``name``, positional ``args`` and ``kwargs`` (``(key, value)`` pairs).

  A value is a ``str`` (an atom such as ``"0.01"``, ``"two_way"`` or a bare
  name like ``"sign"``) or a nested :class:`Spec` (a name with arguments).
  ``str(spec)`` is the canonical text; ``parse(str(spec)) == spec``.
  """

  name: str
  args: tuple = ()
  kwargs: tuple = ()

  def __str__(self) -> str:
    return format_spec(self)


class ParseError(Exception):
  """Malformed spec text (the catalog turns it into a ``SpecError``)."""


def _tokenize(text: str) -> list[str]:
  tokens, pos = [], 0
  text = text.rstrip()
  while pos < len(text):
    m = _TOKEN.match(text, pos)
    if m is None:  # only whitespace can fail to match, and rstrip removed the tail
      raise ParseError(f"unexpected character at position {pos}")
    tokens.append(m.group(1) or m.group(2))
    pos = m.end()
  return tokens


def is_name(token: str) -> bool:
  """Whether ``token`` is a name (any case): a letter, then letters, digits and ``_``."""
  return bool(NAME.match(token.lower()))


class _Parser:
  """Recursive descent over the tokens of one spec."""

  def __init__(self, text: str):
    self.tokens = _tokenize(text)
    self.i = 0

  def peek(self, ahead: int = 0) -> str | None:
    j = self.i + ahead
    return self.tokens[j] if j < len(self.tokens) else None

  def take(self) -> str:
    tok = self.peek()
    if tok is None:
      raise ParseError("unexpected end of spec")
    self.i += 1
    return tok

  def atom(self, what: str) -> str:
    tok = self.take()
    if tok in "():,=":
      raise ParseError(f"expected {what}, got {tok!r}")
    return tok

  def name(self) -> str:
    tok = self.atom("a name")
    if not is_name(tok):
      raise ParseError(f"{tok!r} is not a name (letters, digits and '_', starting with a letter)")
    return tok.lower()

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
            raise ParseError(f"expected ',' or ')', got {tok!r}")
    elif colon_args:
      while self.peek() == ":":
        self.take()
        self.item(args, kwargs, nested_colons=False)
    if not args and not kwargs:
      return name
    return Spec(name, tuple(args), tuple(kwargs))

  def item(self, args: list, kwargs: list, nested_colons: bool) -> None:
    key = None
    if self.peek(1) == "=":
      key = self.name()
      self.take()
      if key in {k for k, _ in kwargs}:
        raise ParseError(f"argument {key!r} given twice")
    elif kwargs:
      raise ParseError("a positional argument follows a keyword argument")
    value = self.value(nested_colons)
    if key is None:
      args.append(value)
    else:
      kwargs.append((key, value))

  def value(self, nested_colons: bool) -> Spec | str:
    tok, nxt = self.peek(), self.peek(1)
    if tok is not None and is_name(tok) and (nxt == "(" or (nested_colons and nxt == ":")):
      return self.spec(colon_args=nested_colons)
    return self.atom("a value")


def parse(text: str) -> Spec:
  """Parse spec text into its tree.

  Raises:
    ParseError: for malformed text.
  """
  parser = _Parser(text.strip())
  if not parser.tokens:
    raise ParseError("empty spec")
  tree = parser.spec()
  if parser.peek() is not None:
    raise ParseError(f"unexpected {parser.peek()!r} after the spec")
  return tree if isinstance(tree, Spec) else Spec(tree)


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
  """The canonical text of a spec tree (the inverse of parsing).

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
