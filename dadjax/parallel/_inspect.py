"""Inspection of a compiled step: its collective ops and the links they use."""

from __future__ import annotations

import numpy as np

from dadjax.comm import hlo_collectives


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
