"""Metered collectives: every collective returns its result *and* its traffic.

The one place where dadjax calls ``psum`` / ``all_gather``. Each wrapper
computes the payload bits this site hands to the collective from the
operands it was actually given (``size * itemsize * 8`` per leaf, known at
trace time), so no method writes a bits formula of its own.

A :class:`Traffic` is what one site handed to collectives in one step:
payload bits per collective kind and the number of collective calls issued
in the program (XLA may combine independent calls into fewer ops; the
compiled count is read by the train step, see ``TrainStep.collectives``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from dadjax._tree_utils import tree_nbits
from dadjax.comm._bits import Bits, bits_add, bits_const


class Traffic(NamedTuple):
  """Payload one site handed to collectives.

  Attributes:
    reduce: bits handed to all-reduce (psum) collectives (int or traced Bits).
    gather: bits handed to all-gather collectives (int or traced Bits).
    reduce_calls: all-reduce calls issued (static int).
    gather_calls: all-gather calls issued (static int).
  """

  reduce: int | Bits = 0
  gather: int | Bits = 0
  reduce_calls: int = 0
  gather_calls: int = 0


NO_TRAFFIC = Traffic()


def _add(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return a + b
  a = a if isinstance(a, Bits) else bits_const(a)
  b = b if isinstance(b, Bits) else bits_const(b)
  return bits_add(a, b)


def traffic_add(*terms: Traffic) -> Traffic:
  """Sum of several :class:`Traffic` records."""
  total = NO_TRAFFIC
  for t in terms:
    total = Traffic(_add(total.reduce, t.reduce), _add(total.gather, t.gather),
                    total.reduce_calls + t.reduce_calls, total.gather_calls + t.gather_calls)
  return total


def _calls(tree: Any) -> int:
  # One call per wrapper call: a tuple of leaves is one collective in the
  # program (XLA may still split or merge it; the compiled op count is read
  # by ``hlo_collectives``).
  return 1 if jax.tree.leaves(tree) else 0


def metered_psum(tree: Any, axis_name: str | None) -> tuple[Any, Traffic]:
  """``psum`` of every leaf over ``axis_name`` and this site's traffic.

  With ``axis_name=None`` (one site) the tree is returned unchanged and the
  payload is still recorded (its wire cost is zero for one site).
  """
  out = tree if axis_name is None else jax.lax.psum(tree, axis_name)
  return out, Traffic(reduce=tree_nbits(tree), reduce_calls=_calls(tree))


def metered_pmean(tree: Any, axis_name: str | None) -> tuple[Any, Traffic]:
  """``pmean`` (psum / N) of every leaf and this site's traffic."""
  out = tree if axis_name is None else jax.lax.pmean(tree, axis_name)
  return out, Traffic(reduce=tree_nbits(tree), reduce_calls=_calls(tree))


def metered_all_gather(tree: Any, axis_name: str | None, *,
                       invariant: bool = False) -> tuple[Any, Traffic]:
  """All-gather every leaf along a new leading site axis, and this site's traffic."""
  from dadjax.comm._collectives import gather_sites  # pylint: disable=g-import-not-at-top
  out = gather_sites(tree, axis_name, invariant=invariant)
  return out, Traffic(gather=tree_nbits(tree), gather_calls=_calls(tree))
