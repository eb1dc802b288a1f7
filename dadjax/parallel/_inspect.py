"""Inspection of a compiled step: its collective ops and the links they use."""

from __future__ import annotations

import numpy as np

from dadjax.comm import collective_ops, comm_stats, hlo_collectives


def compiled_text(run, state, placed_batch) -> str:
  """The optimized HLO text of the compiled step for these shapes."""
  return run.lower(state, placed_batch).compile().as_text()


def collectives(run, placement, state, placed_batch, link: str | None = None):
  """The :class:`~dadjax.comm.CollectiveOps` of the compiled step (``TrainStep.collectives``)."""
  if link not in (None, "inter", "intra"):
    raise ValueError(f"link must be None, 'inter' or 'intra', got {link!r}")
  text = compiled_text(run, state, placed_batch)
  keep = None if link is None else (lambda groups: link_of(placement, groups) == link)
  return hlo_collectives(text, groups=keep)


def link_of(placement, groups) -> str:
  """Which links a collective with these replica groups uses (``TrainStep.link_of``)."""
  if placement.backend != "shard_map":
    raise ValueError("link_of needs backend='shard_map' (a mesh)")
  mesh = placement.mesh
  shape = mesh.devices.shape
  site_dim = mesh.axis_names.index(placement.axis_name)
  groups = groups or (tuple(range(int(np.prod(shape)))),)
  coords = [np.array(np.unravel_index(np.asarray(g), shape)) for g in groups]
  others = [d for d in range(len(shape)) if d != site_dim]
  if all(len(set(c[site_dim])) == 1 for c in coords):
    return "intra"
  if all(all(len(set(c[d])) == 1 for d in others) for c in coords):
    return "inter"
  return "mixed"


def axes_of(placement, groups) -> tuple[str, ...]:
  """The mesh axes along which the devices of a collective's replica groups differ."""
  mesh = placement.mesh
  shape = mesh.devices.shape
  groups = groups or (tuple(range(int(np.prod(shape)))),)
  coords = [np.array(np.unravel_index(np.asarray(g), shape)) for g in groups]
  return tuple(a for d, a in enumerate(mesh.axis_names)
               if any(len(set(c[d])) > 1 for c in coords))


def traffic_by_axis(run, placement, state, placed_batch) -> dict[str, int]:
  """Operand bits per device of the compiled step's collectives, by the mesh axes they span.

  Keys are axis names joined by ``"+"`` (``"model"``, ``"fsdp+model"``,
  ``"data"``): the in-site collectives GSPMD inserted appear under the in-site
  axes, the methods' under the site axis.
  """
  if placement.backend != "shard_map":
    raise ValueError("traffic_by_axis needs backend='shard_map' (a mesh)")
  out: dict[str, int] = {}
  for op in collective_ops(compiled_text(run, state, placed_batch)):
    key = "+".join(axes_of(placement, op.groups)) or "none"
    out[key] = out.get(key, 0) + 8 * op.nbytes
  return out


def program_bits(run, state, placed_batch, placement=None) -> tuple[int, int]:
  """``(unconditional, all)`` operand bits of the step program's collectives, per device.

  With a ``placement`` whose sites are groups of devices (in-site axes beside the site
  axis), a collective whose replica groups stay inside a site is left out: it is in-site
  traffic a method runs in a manual region of its own over those axes (TopK's selection on
  each chip's shard), as the collectives GSPMD inserts there are, which the lowered program
  does not show either.

  Read from the lowered, not yet optimized program (``lower(...).as_text("hlo")``):
  one lowering, no compilation, and the operands as traced (before XLA widens
  16-bit all-reduces on CPU or combines ops). Ops under ``lax.cond`` are in
  ``all`` only.
  """
  ops = collective_ops(run.lower(state, placed_batch).as_text(dialect="hlo"))
  if getattr(placement, "inner", ()):
    ops = [op for op in ops if placement.axis_name in axes_of(placement, op.groups)]
  # reduce-scatters (sharded parameters' in-site gradient mean) are left out: their
  # operand is the whole tensor while the ledger books the slice each device keeps.
  # An all-to-all is booked as one row of its operand (dadjax.comm.metered_all_to_all); a ring
  # all-gather's forwarding permutes pass on the payload its first permute sent (one gather).
  bits = [(8 * op.nbytes // (len(op.groups[0]) if op.kind == "all_to_all" and op.groups else 1),
           op.conditional) for op in ops if op.kind != "reduce_scatter" and not op.echo]
  total = sum(b for b, _ in bits)
  return total - sum(b for b, cond in bits if cond), total


def booked_bits(state) -> tuple[tuple[int, ...], int]:
  """``(total bits per site since the start, in-site bits of the last step)`` of every ledger."""
  summary = comm_stats(state)
  return summary.total_bits, summary.intra_bits_per_step


def booked_in_step(before, after) -> int:
  """Bits the ledgers booked between two :func:`booked_bits` read-outs (largest site)."""
  (totals_0, _), (totals_1, intra) = before, after
  width = max(len(totals_0), len(totals_1))
  pick = lambda t, i: t[i] if len(t) > 1 else t[0]
  return max(pick(totals_1, i) - pick(totals_0, i) for i in range(width)) + intra


def check_ledger(program: tuple[int, int], before, after) -> int:
  """Raise if the program's unconditional collectives move more than the ledgers booked.

  ``before`` / ``after``: :func:`booked_bits` of the state before and after
  the first step. The ledger may book more than the program text shows
  (collectives in a loop body appear once, taken ``lax.cond`` branches are
  not counted as unconditional), never less: every collective the step
  runs unconditionally must be booked. Returns the booked bits.
  """
  booked = booked_in_step(before, after)
  unconditional, _ = program
  if unconditional > booked:
    raise ValueError(
        f"the step's collectives move {unconditional} bits per device per step, but its ledgers "
        f"booked {booked} bits for the first step: {unconditional - booked} bits of traffic are "
        "not booked (a transformation or a model that communicates without recording it). "
        "Record it with dadjax.comm's metered collectives and ledger_record; "
        "make_train_step(..., check_ledger=False) skips this check")
  return booked
