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
Each op also names the branch it sits in (:attr:`CollectiveOp.branch`), so
:func:`taken_collectives` counts the ops one execution runs when each
conditional takes a given branch, and :func:`match_branches` finds the
branches whose collectives carry exactly the payload a step's ledger
recorded (Accordion: which setting each tensor was sent with).
Ops inside a ``while`` body are counted once, not per iteration.

Every op also counts its operands: a combined all-reduce of ``k`` tensors is
one op but, on XLA:CPU with gloo, ``k`` calls of the transport, one after
another (:attr:`CollectiveOps.operands`).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import NamedTuple

import numpy as np

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
    operands: operands per kind (XLA:CPU makes one gloo call per operand of
      a combined collective; :meth:`NetworkModel.calibrated
      <dadjax.comm.NetworkModel.calibrated>` charges these).
    conditional_operands: of ``operands``, those of the conditional ops.
  """

  count: dict
  nbytes: dict
  conditional_count: dict
  conditional_nbytes: dict
  operands: dict = dataclasses.field(default_factory=dict)
  conditional_operands: dict = dataclasses.field(default_factory=dict)

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


def type_bytes(text: str) -> int:
  """Bytes of every array type printed in ``text`` (``"f32[2,3]"``: 24; a tuple's elements summed)."""
  return _shape_bytes(text)


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


class CollectiveOp(NamedTuple):
  """One collective op of a compiled program.

  Attributes:
    kind: one of :data:`KINDS`.
    nbytes: operand bytes (per participant).
    groups: the op's ``replica_groups`` as a tuple of tuples of logical
      device ids (positions in the program's device assignment, i.e. in
      ``mesh.devices.flat``); ``()`` when the op names none (all devices).
    conditional: whether the op sits under a ``conditional`` branch.
    operands: the op's operands (tensors it combines).
    branch: where it sits: ``((conditional, index), ...)``, outermost first,
      each the name of a ``conditional`` instruction and the index of the
      branch computation (``branch_computations={b0, b1, ...}``; ``lax.cond``
      lowers to ``{false, true}``, so the true branch is index 1, as in the
      ``true_computation=`` form); ``()`` when it runs on every execution.
    echo: a ``collective-permute`` of what another one received (a ring
      all-gather forwarding a block: :func:`dadjax.comm._sites.ring_gather`),
      so its bytes are the same payload passed on, not new payload.
  """

  kind: str
  nbytes: int
  groups: tuple
  conditional: bool
  operands: int = 1
  branch: tuple = ()
  echo: bool = False


_PAIRS = re.compile(r"source_target_pairs=(\{\{[\d,{} ]*\}\})")
_GROUPS = re.compile(r"replica_groups=(\{\{[\d,{} ]*\}\}|\{\}"
                     r"|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)")


def _replica_groups(attrs: str) -> tuple:
  """Parse ``replica_groups=`` (explicit ``{{0,1},{2,3}}`` or iota ``[2,2]<=[4]T(..)`` form), or a
  collective-permute's ``source_target_pairs=`` (each pair a group)."""
  m = _GROUPS.search(attrs)
  if not m:  # a collective-permute: each source -> target pair is a group
    pairs = _PAIRS.search(attrs)
    return () if not pairs else tuple(
        tuple(int(v) for v in g.split(",")) for g in re.findall(r"\{(\d+,\d+)\}", pairs.group(1)))
  if m.group(1) == "{}":
    return ()
  text = m.group(1)
  if text.startswith("{"):
    return tuple(tuple(int(v) for v in g.split(",") if v.strip())
                 for g in re.findall(r"\{([\d, ]*)\}", text[1:-1]))
  iota = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", text)
  shape = [int(v) for v in iota.group(1).split(",")]
  dims = [int(v) for v in iota.group(2).split(",")]
  ids = np.arange(math.prod(dims)).reshape(dims)
  if iota.group(3):
    ids = ids.transpose([int(v) for v in iota.group(3).split(",")])
  return tuple(tuple(int(v) for v in row) for row in ids.reshape(shape))


def collective_ops(hlo_text: str) -> list[CollectiveOp]:
  """Every collective op of an HLO module, with its bytes and replica groups.

  Args:
    hlo_text: ``jitted.lower(...).compile().as_text()`` (optimized HLO).

  Returns:
    A list of :class:`CollectiveOp` in program order.
  """
  return _parse(hlo_text)[0]


def _callees(name: str, opcode: str, attrs: str) -> list:
  """``(computation, tag)`` called by one instruction; tag ``(name, branch index)`` for a branch."""
  out = []
  for branches, true_c, false_c, *others in _CALLED.findall(attrs):
    for i, callee in enumerate(n.strip().lstrip("%") for n in branches.split(",") if n.strip()):
      out.append((callee, (name, i) if opcode == "conditional" else None))
    for callee, index in ((true_c, 1), (false_c, 0)):
      if callee:
        out.append((callee, (name, index) if opcode == "conditional" else None))
    out.extend((callee, None) for callee in others if callee)
  return out


def _parse(hlo_text: str):
  """``(ops, conditionals)``: the collective ops and ``{conditional: (its branch path, branches)}``."""
  types: dict[str, str] = {}
  found = []  # (computation, kind, operand text, attributes)
  calls: dict[str, list] = {}
  conds: dict[str, tuple] = {}  # conditional -> (its computation, number of branches)
  entry, current, seen = None, None, []
  permuted: set = set()  # names holding a block a collective-permute received
  for line in hlo_text.splitlines():
    line = _COMMENT.sub("", line)  # /*index=5*/ markers in long operand lists
    parts = _split_instruction(line)
    if parts is None:
      head = _COMPUTATION.match(line)  # a computation starts at column 0
      if head and line.rstrip().endswith("{"):
        current = head.group(1)
        seen.append(current)
        entry = current if line.startswith("ENTRY") else entry
      continue
    name, type_text, opcode, operands, attrs = parts
    types[name] = type_text
    callees = _callees(name, opcode, attrs)
    calls.setdefault(current, []).extend(callees)
    if opcode == "conditional":
      conds[name] = (current, sum(tag is not None for _, tag in callees))
    if opcode in OPCODES:
      items = [o.split()[-1].lstrip("%") for o in _split_operands(operands)]
      echo = OPCODES[opcode] == "permute" and len(items) == 1 and items[0] in permuted
      found.append((current, OPCODES[opcode], operands, attrs, echo))
      if OPCODES[opcode] == "permute":
        permuted.add(name)
    elif opcode in ("collective-permute-done", "get-tuple-element", "copy", "bitcast") and any(
        o.split()[-1].lstrip("%") in permuted for o in _split_operands(operands)):
      permuted.add(name)  # the received block, unwrapped
  # Each computation's branch path from the entry (a branch adds its (conditional, index)).
  called = {c for targets in calls.values() for c, _ in targets}
  paths: dict = {}
  todo = [(c, ()) for c in ([entry] if entry else [c for c in seen if c not in called])]
  while todo:
    comp, path = todo.pop()
    if comp in paths:
      continue
    paths[comp] = path
    todo.extend((c, path + (tag,) if tag else path) for c, tag in calls.get(comp, ()))
  ops = []
  for comp, kind, operands, attrs, echo in found:
    size, items = 0, _split_operands(operands)
    for operand in items:
      if _SHAPE.search(operand):  # operand printed with its type
        size += _shape_bytes(operand)
      else:  # operand printed by name only: look its type up
        size += _shape_bytes(types.get(operand.lstrip("%"), ""))
    path = paths.get(comp, ())
    ops.append(CollectiveOp(kind, size, _replica_groups(attrs), bool(path), len(items), path,
                            echo))
  return ops, {name: (paths.get(comp, ()), n) for name, (comp, n) in conds.items()}


def _tally(ops, conditional=lambda op: op.conditional) -> CollectiveOps:
  """Count ``ops`` per kind (``conditional(op)``: whether it counts as conditional)."""
  fields = [dict.fromkeys(KINDS, 0) for _ in range(6)]
  count, nbytes, c_count, c_nbytes, operands, c_operands = fields
  for op in ops:
    count[op.kind] += 1
    nbytes[op.kind] += op.nbytes
    operands[op.kind] += op.operands
    if conditional(op):
      c_count[op.kind] += 1
      c_nbytes[op.kind] += op.nbytes
      c_operands[op.kind] += op.operands
  return CollectiveOps(count, nbytes, c_count, c_nbytes, operands, c_operands)


def hlo_collectives(hlo_text: str, groups=None) -> CollectiveOps:
  """Count the collective ops of an HLO module and the bytes of their operands.

  Args:
    hlo_text: ``jitted.lower(...).compile().as_text()`` (optimized HLO).
    groups: optional filter ``groups(replica_groups) -> bool`` on each op's
      :attr:`CollectiveOp.groups` (e.g. keep the ops over one mesh axis).

  Returns:
    A :class:`CollectiveOps` (every branch of every conditional counted).
  """
  return _tally(op for op in collective_ops(hlo_text) if groups is None or groups(op.groups))


def _runs(op: CollectiveOp, taken: dict):
  """True: ``op`` runs given ``taken``; False: it does not; None: a conditional not in ``taken``."""
  for cond, index in op.branch:
    if cond not in taken:
      return None
    if taken[cond] != index:
      return False
  return True


def taken_collectives(hlo_text: str, taken: dict, groups=None) -> CollectiveOps:
  """The collective ops one execution runs when each conditional takes a given branch.

  ``lax.cond`` compiles both branches; :func:`hlo_collectives` counts both.
  For a step whose branches are known (a local-update method's sync step,
  Accordion's setting of each tensor: :func:`match_branches`) this counts
  the branch that runs.

  Args:
    hlo_text: optimized HLO (``compiled.as_text()``).
    taken: ``{conditional instruction name: branch index}`` (the index into
      its ``branch_computations``; ``lax.cond``: 1 = true, 0 = false).
      Ops in a branch not taken are dropped; ops in a taken branch (every
      enclosing conditional named and taken) count as unconditional; ops
      under a conditional not named here stay counted and conditional.
    groups: as for :func:`hlo_collectives`.

  Returns:
    A :class:`CollectiveOps`.

  Raises:
    ValueError: ``taken`` names a conditional the module lacks or an index
      out of its range.
  """
  _, conds = _parse(hlo_text)
  for name, index in taken.items():
    if name not in conds:
      raise ValueError(f"taken: the module has no conditional {name!r} (it has "
                       f"{sorted(conds) or 'none'})")
    if not (isinstance(index, int) and 0 <= index < conds[name][1]):
      raise ValueError(f"taken[{name!r}] must be a branch index in [0, {conds[name][1] - 1}], "
                       f"got {index!r}")
  ops = [op for op in collective_ops(hlo_text) if (groups is None or groups(op.groups))
         and _runs(op, taken) is not False]
  return _tally(ops, lambda op: _runs(op, taken) is None)


def match_branches(hlo_text: str, reduce_bits: int, gather_bits: int = 0, groups=None) -> dict:
  """The branches whose collectives carry exactly a step's recorded payload.

  The ledger records the bits one step handed to collectives (the branch
  that ran); the compiled program lists every branch. This picks, for each
  conditional holding collectives (nested ones inside the chosen branches
  too), the branch such that the unconditional ops plus the chosen branches'
  ops move ``reduce_bits`` to all-reduces and ``gather_bits`` to
  all-gathers, per site. Pass the result to :func:`taken_collectives`.

  Args:
    hlo_text: optimized HLO (``compiled.as_text()``).
    reduce_bits, gather_bits: one step's payload bits per site (the ledger:
      ``comm_stats(state)`` after a step records that step for a
      :class:`~dadjax.comm.CommStats` ledger).
    groups: as for :func:`hlo_collectives`.

  Returns:
    ``{conditional: branch index}``.

  Raises:
    ValueError: no choice of branches moves exactly these bits (the ledger
      and the program disagree, e.g. packed payloads), or several do and
      they differ in the ops or operands they run.
  """
  ops, conds = _parse(hlo_text)
  ops = [op for op in ops if groups is None or groups(op.groups)]
  target = (int(reduce_bits), int(gather_bits))
  base = _sums(op for op in ops if not op.branch)
  top = [c for c, (path, _) in conds.items() if not path]
  found = {}
  for sums, choice in _combine(base, [_options(c, (), ops, conds) for c in top]):
    if (8 * sums[0], 8 * sums[1]) == target:
      found.setdefault(sums[2:], choice)
  if not found:
    raise ValueError(f"match_branches: no choice of branches moves {target[0]} reduce and "
                     f"{target[1]} gather bits per site (unconditional ops: {8 * base[0]} and "
                     f"{8 * base[1]}); the ledger and the compiled program disagree")
  if len(found) > 1:
    raise ValueError(f"match_branches: {len(found)} choices of branches move these bits with "
                     "different ops or operands; the payload does not tell which ran")
  return next(iter(found.values()))


def _sums(ops) -> tuple:
  """(reduce bytes, gather bytes, reduce ops, gather ops, reduce operands, gather operands)."""
  out = [0] * 6
  for op in ops:
    if op.kind in ("reduce", "gather"):
      k = op.kind == "gather"
      out[k] += op.nbytes
      out[2 + k] += 1
      out[4 + k] += op.operands
  return tuple(out)


def _combine(base: tuple, options: list) -> list:
  """Every ``(sums, choice)`` of ``base`` plus one option of each list in ``options``."""
  out = {base: {}}
  for opts in options:
    nxt = {}
    for sums, choice in out.items():
      for o_sums, o_choice in opts:
        key = tuple(a + b for a, b in zip(sums, o_sums))
        nxt.setdefault(key, {**choice, **o_choice})
    out = nxt
  return list(out.items())


def _options(cond: str, path: tuple, ops: list, conds: dict) -> list:
  """``(sums, choice)`` for each branch of ``cond`` (at ``path``) and its nested conditionals."""
  depth = len(path)
  if not any(len(op.branch) > depth and op.branch[:depth] == path and op.branch[depth][0] == cond
             for op in ops):
    return [((0,) * 6, {})]  # no collectives under it: nothing to choose
  out = []
  for i in range(conds[cond][1]):
    inner = path + ((cond, i),)
    direct = _sums(op for op in ops if op.branch == inner)
    nested = [_options(c, inner, ops, conds) for c, (p, _) in conds.items() if p == inner]
    out.extend((sums, {cond: i, **choice}) for sums, choice in _combine(direct, nested))
  return out


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
