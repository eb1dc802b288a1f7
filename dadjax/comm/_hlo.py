"""Collective ops of a compiled program, read from its HLO text.

The ledger records what each collective *call* hands over; XLA may combine
independent calls into one op (or split one), and latency is paid per op.
:func:`hlo_collectives` reads the optimized HLO module (``compiled.as_text()``)
and returns, per kind, the number of collective ops and the bytes of their
operands (per site: each site runs the same program on its own operands).

Kinds: ``"reduce"`` (all-reduce), ``"gather"`` (all-gather),
``"reduce_scatter"``, ``"all_to_all"``, ``"permute"`` (collective-permute).
Asynchronous pairs count once (the ``-start`` op; ``-done`` is skipped).

Ops under ``lax.cond`` sit in a branch computation of a ``conditional``:
XLA compiles every branch, so they appear in the text although at most one
branch runs per execution. They are counted in the totals *and* separately
in ``conditional``, so a caller can tell "runs every step" from "runs when
the branch is taken" (e.g. the k-th micro-step of gradient accumulation).
Ops inside a ``while`` body are counted once, not per iteration.
"""

from __future__ import annotations

import dataclasses
import math
import re

_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
          "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|c64|c128)\[([\d,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*[({]")
_CALLED = re.compile(r"(?:branch_computations=\{([^}]*)\}|true_computation=%?([\w.\-]+)|"
                     r"false_computation=%?([\w.\-]+)|body=%?([\w.\-]+)|condition=%?([\w.\-]+)|"
                     r"to_apply=%?([\w.\-]+)|calls=%?([\w.\-]+))")
OPCODES = {"all-reduce": "reduce", "all-reduce-start": "reduce",
           "all-gather": "gather", "all-gather-start": "gather",
           "reduce-scatter": "reduce_scatter", "all-to-all": "all_to_all",
           "collective-permute": "permute", "collective-permute-start": "permute"}
KINDS = ("reduce", "gather", "reduce_scatter", "all_to_all", "permute")


@dataclasses.dataclass(frozen=True)
class CollectiveOps:
  """Collective ops of one compiled program (per site).

  Attributes:
    count: ops per kind.
    nbytes: operand bytes per kind.
    conditional_count: of ``count``, the ops inside a ``conditional`` branch.
    conditional_nbytes: of ``nbytes``, the bytes of those ops.
  """

  count: dict
  nbytes: dict
  conditional_count: dict
  conditional_nbytes: dict

  @property
  def ops(self) -> int:
    """Collective ops of every kind."""
    return sum(self.count.values())

  def bits(self, kind: str) -> int:
    """Operand bits of ``kind`` (comparable with the ledger's payload bits)."""
    return 8 * self.nbytes[kind]


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    total += math.prod(int(d) for d in dims.split(",") if d) * _BYTES[dtype]
  return total


def _matching(text: str, start: int) -> int:
  depth = 0
  for i in range(start, len(text)):
    depth += text[i] == "("
    depth -= text[i] == ")"
    if depth == 0:
      return i
  return len(text)


def _split_instruction(line: str):
  """(name, result type text, opcode, operand text, attributes) of one instruction line."""
  m = _INSTR.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # tuple type: up to the matching paren
    end = _matching(rest, 0)
    type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  start = op.end() - 1
  end = _matching(rest, start)
  return m.group(1), type_text, op.group(1), rest[start + 1:end], rest[end + 1:]


def hlo_collectives(hlo_text: str) -> CollectiveOps:
  """Count the collective ops of an HLO module and the bytes of their operands.

  Args:
    hlo_text: ``jitted.lower(...).compile().as_text()`` (optimized HLO).

  Returns:
    A :class:`CollectiveOps`.
  """
  types: dict[str, str] = {}
  found = []  # (computation, kind, operand text)
  calls: dict[str, set] = {}
  branches: set = set()
  current = None
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)  # /*index=5*/ markers in long operand lists
    parts = _split_instruction(line)
    if parts is None:
      head = _COMPUTATION.match(line)  # a computation starts at column 0
      if head and line.rstrip().endswith("{"):
        current = head.group(1)
      continue
    name, type_text, opcode, operands, attrs = parts
    types[name] = type_text
    for groups in _CALLED.findall(attrs):
      names = [n.strip().lstrip("%") for g in groups for n in g.split(",") if n.strip()]
      calls.setdefault(current, set()).update(names)
      if opcode == "conditional":
        branches.update(names)
    if opcode in OPCODES:
      found.append((current, OPCODES[opcode], operands))
  # Computations reachable from a conditional branch run only when it is taken.
  under_cond, todo = set(), list(branches)
  while todo:
    c = todo.pop()
    if c not in under_cond:
      under_cond.add(c)
      todo.extend(calls.get(c, ()))
  count = dict.fromkeys(KINDS, 0)
  nbytes = dict.fromkeys(KINDS, 0)
  c_count = dict.fromkeys(KINDS, 0)
  c_nbytes = dict.fromkeys(KINDS, 0)
  for comp, kind, operands in found:
    size = 0
    for operand in _split_operands(operands):
      if _SHAPE.search(operand):  # operand printed with its type
        size += _shape_bytes(operand)
      else:  # operand printed by name only: look its type up
        size += _shape_bytes(types.get(operand.lstrip("%"), ""))
    count[kind] += 1
    nbytes[kind] += size
    if comp in under_cond:
      c_count[kind] += 1
      c_nbytes[kind] += size
  return CollectiveOps(count, nbytes, c_count, c_nbytes)


def _split_operands(text: str) -> list[str]:
  """Top-level comma-separated operands (tuple types may contain commas)."""
  out, depth, cur = [], 0, ""
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      out.append(cur.strip())
      cur = ""
    else:
      cur += ch
  if cur.strip():
    out.append(cur.strip())
  return out


def compiled_collectives(compiled) -> CollectiveOps:
  """:func:`hlo_collectives` of a ``jax.stages.Compiled`` (``jit(f).lower(...).compile()``)."""
  return hlo_collectives(compiled.as_text())
