"""The bytes the compiled collectives move are the bits the ledger records.

Compiles only the compressor's update (no loss, no metrics) under a
shard_map over 8 devices, parses every all-reduce / all-gather of the
optimized HLO (async ``-start`` forms included, ``-done`` skipped), sums the
bytes of their operands and compares with the ledger of the same update.
Nothing else in the update communicates, so no XLA-added collective (such
as a metrics all-reduce) has to be subtracted; XLA may split or combine the
psum'd tuple into different ops, so bytes are summed over all ops.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import compress as C
from dadjax.parallel import stack_sites

SITES = 8
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_SHAPE = re.compile(r"\b(pred|[suf]\d+|bf16)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COLLECTIVES = {"all-reduce": "reduce", "all-reduce-start": "reduce",
                "all-gather": "gather", "all-gather-start": "gather"}


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(text):
    size = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
    total += size * _BYTES[dtype]
  return total


def _split_instruction(line):
  """(name, result type text, opcode, operand text) of one HLO instruction line."""
  m = _INSTR.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):  # tuple type: up to the matching paren
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    type_text, rest = rest[:i + 1], rest[i + 1:].lstrip()
  else:
    type_text, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  depth, start = 0, op.end() - 1
  for i in range(start, len(rest)):
    depth += rest[i] == "("
    depth -= rest[i] == ")"
    if depth == 0:
      break
  return m.group(1), type_text, op.group(1), rest[start + 1:i]


def collective_bytes(hlo: str) -> dict:
  """Operand bytes of every all-reduce / all-gather in an HLO module, by kind."""
  types, found = {}, []
  for line in hlo.splitlines():
    parts = _split_instruction(line)
    if parts is None:
      continue
    name, type_text, opcode, operands = parts
    types[name] = type_text
    if opcode in _COLLECTIVES:
      found.append((_COLLECTIVES[opcode], operands))
  out = {"reduce": 0, "gather": 0, "ops": len(found)}
  for kind, operands in found:
    for operand in operands.split(","):
      operand = operand.strip()
      if _SHAPE.search(operand):  # operand printed with its type
        out[kind] += _shape_bytes(operand)
      else:  # operand printed by name only: look its type up
        out[kind] += _shape_bytes(types[operand.lstrip("%")])
  return out


def test_parser_on_known_text():
  hlo = """
  %p.1 = f32[4,3]{1,0} parameter(0)
  %w = u32[5]{0} parameter(1)
  %ar = (f32[4,3]{1,0}, f32[2]{0}) all-reduce(%p.1, f32[2]{0} %q), channel_id=1, to_apply=%add
  %ag = u32[8,5]{1,0} all-gather(%w), dimensions={0}
  %ags = (u32[5]{0}, u32[40]{0}) all-gather-start(u32[5]{0} %w), dimensions={0}
  %agd = u32[40]{0} all-gather-done(%ags)
  """
  assert collective_bytes(hlo) == {"reduce": 48 + 8, "gather": 20 + 20, "ops": 3}


def _params():
  k = jax.random.split(jax.random.key(0), 4)
  return {"w": jax.random.normal(k[0], (10, 16)), "b": jax.random.normal(k[1], (16,)),
          "conv": jax.random.normal(k[2], (3, 3, 4, 8)), "v": jax.random.normal(k[3], (40, 6))}


@pytest.mark.parametrize("spec, kind", [
    ("topk:0.1", "gather"), ("ef_topk:0.1", "gather"), ("qsgd:4", "gather"),
    ("sign", "gather"), ("powersgd:2", "reduce"), ("randomk:0.25", "reduce"),
])
def test_compiled_collectives_move_the_ledger_bits(spec, kind):
  params = _params()
  tx = C.compressed(C.get_compressor(spec), axis_name="data")
  mesh = dadjax.make_mesh(SITES, "data")
  grads = jax.tree.map(lambda x: jnp.stack([x + i for i in range(SITES)]), params)
  state = stack_sites(tx.init(params), SITES)

  def site(g, s):
    g, s = jax.tree.map(lambda x: x[0], (g, s))
    u, s = tx.update(g, s)
    return jax.tree.map(lambda x: x[None], (u, s))

  step = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P("data"), P("data")),
                               out_specs=P("data")))
  compiled = step.lower(grads, state).compile()
  moved = collective_bytes(compiled.as_text())
  _, new_state = compiled(grads, state)
  stats = dadjax.comm_stats(new_state)
  ledger = {"reduce": stats.reduce_bits[0], "gather": stats.gather_bits[0]}
  assert moved["ops"] >= 1
  assert moved[kind] > 0
  assert {k: 8 * moved[k] for k in ("reduce", "gather")} == ledger, (moved, ledger)
  assert stats.reduce_bits == (ledger["reduce"],) * SITES  # every site sends the same
