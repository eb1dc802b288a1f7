"""Bits on the wire: what a site's payload costs under a network topology.

The ledger records *payload* bits: the size of what a site hands to a
collective. What crosses the network depends on the collective and the
topology. For ``N`` sites and a payload of ``B`` bits per site:

* ``"ring"`` (bandwidth-optimal ring algorithms; what NCCL and XLA use):
  every site sends, and receives, ``2 (N-1)/N * B`` for an all-reduce
  (reduce-scatter then all-gather) and ``(N-1) * B`` for an all-gather.
* ``"ps"`` (parameter server: every worker has one link to a central
  server that aggregates): a worker's link carries ``2 B`` for an
  all-reduce (``B`` up, the reduced ``B`` down) and ``N B`` for an
  all-gather (``B`` up, the other ``N-1`` payloads down). The server's link
  carries ``N`` times a worker's, which sets the time.

Wire bits "per site" are thus the bits a site sends under ``"ring"`` and
the bits through a worker's link under ``"ps"``. For ``N = 1`` nothing moves.
The choice between an all-gather of ``B_g`` and an all-reduce of ``B_r`` is
the same under both: the gather is cheaper iff ``N B_g < 2 B_r``.

References:
  Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication
  Operations in MPICH", IJHPCA 2005.
  Li et al., "Scaling Distributed Machine Learning with the Parameter
  Server", OSDI 2014.
"""

from __future__ import annotations

from fractions import Fraction

TOPOLOGIES = ("ring", "ps")
KINDS = ("reduce", "gather")


def check_topology(topology: str) -> str:
  if topology not in TOPOLOGIES:
    raise ValueError(f"topology must be one of {TOPOLOGIES}, got {topology!r}")
  return topology


def check_sites(num_sites) -> int:
  if isinstance(num_sites, bool) or not isinstance(num_sites, int) or num_sites < 1:
    raise ValueError(f"num_sites must be an int >= 1, got {num_sites!r}")
  return num_sites


def wire_factor(kind: str, num_sites: int, topology: str = "ring") -> Fraction:
  """Wire bits per payload bit of one collective, per site (module docstring).

  Args:
    kind: ``"reduce"`` (all-reduce) or ``"gather"`` (all-gather).
    num_sites: ``N >= 1``.
    topology: ``"ring"`` or ``"ps"``.

  Returns:
    An exact :class:`fractions.Fraction`.
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  n = check_sites(num_sites)
  check_topology(topology)
  if n == 1:
    return Fraction(0)
  if topology == "ring":
    return Fraction(2 * (n - 1), n) if kind == "reduce" else Fraction(n - 1)
  return Fraction(2) if kind == "reduce" else Fraction(n)


def wire_bits(kind: str, payload_bits: int, num_sites: int, topology: str = "ring") -> float:
  """Wire bits per site of a collective of ``payload_bits`` per site."""
  return float(wire_factor(kind, num_sites, topology) * int(payload_bits))


def link_load(num_sites: int, topology: str = "ring") -> int:
  """How many sites' wire bits the busiest link carries (1 ring, N ps)."""
  return check_sites(num_sites) if check_topology(topology) == "ps" else 1


def latency_messages(kind: str, num_sites: int, topology: str = "ring") -> int:
  """Latency terms one collective op pays: ring 2(N-1) / (N-1), ps 2."""
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
  n = check_sites(num_sites)
  if n == 1:
    return 0
  if check_topology(topology) == "ps":
    return 2
  return 2 * (n - 1) if kind == "reduce" else n - 1


def all_to_all_factor(num_sites: int, topology: str = "ring") -> Fraction:
  """Wire bits per payload bit of an all-to-all of a whole buffer, per site.

  A site keeps one of its ``N`` rows and sends the others: ``(N-1)/N`` under
  ``"ring"`` (direct exchange, every link used once per message); under
  ``"ps"`` a worker's link carries them up and the ``N-1`` rows it receives
  down: ``2 (N-1)/N``. The ledger books an all-to-all as an all-gather of
  one row (:func:`dadjax.comm._metered.metered_all_to_all`), which equals
  this factor under ``"ring"``.
  """
  n = check_sites(num_sites)
  check_topology(topology)
  return Fraction(n - 1, n) * (2 if topology == "ps" else 1)
