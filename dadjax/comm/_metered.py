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
import jax.numpy as jnp

from dadjax._core.bits import Bits, as_bits, bits_add
from dadjax._core.vma import vma
from dadjax._core.trees import tree_nbits
from dadjax.comm._sites import gather_sites, sites_of_devices, target_platform


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

# Whether metered_psum / metered_all_gather bucket their leaves by default (read at trace time).
BUCKET = True


def _add(a, b):
  if isinstance(a, int) and isinstance(b, int):
    return a + b
  return bits_add(as_bits(a), as_bits(b))


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


def bucketed(collective, tree: Any, *, stacked: bool) -> Any:
  """``collective`` applied once per dtype to all of ``tree``'s leaves of that dtype (and type).

  The leaves of each dtype are flattened into one contiguous buffer (in leaf
  order), the collective runs on the buffer and the result is cut back into
  the leaves' shapes, so a payload of many leaves costs one collective op per
  dtype instead of one per leaf (the bits moved are the same; on a site of
  several devices, one op per leaf: :func:`sites_of_devices`). ``stacked``:
  the collective adds a leading site axis (an all-gather).
  """
  leaves, treedef = jax.tree.flatten(tree)
  # Inside a site of several devices the leaves are sharded differently (GSPMD's layout):
  # one buffer would make XLA reshard every leaf, and its SPMD partitioner aborts on some
  # such buffers, so each leaf travels on its own there.
  if len(leaves) < 2 or sites_of_devices():
    return jax.tree.unflatten(treedef, [collective(x) for x in leaves])
  groups: dict = {}
  for i, x in enumerate(leaves):
    # One buffer per dtype and variance type: a leaf replicated within the site must not
    # become varying by sharing a buffer with a sliced one (shard_map type checks).
    groups.setdefault((jnp.result_type(x), vma(x)), []).append(i)
  out = [None] * len(leaves)
  for idx in groups.values():
    buffer = collective(jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]))
    start = 0
    for i in idx:
      size, shape = leaves[i].size, jnp.shape(leaves[i])
      part = buffer[..., start:start + size]
      out[i] = part.reshape(buffer.shape[:1] + shape if stacked else shape)
      start += size
  return jax.tree.unflatten(treedef, out)


def _psum(x: jax.Array, axis_name) -> jax.Array:
  """``psum``, except a bf16 one inside a site of several devices on XLA:CPU.

  There XLA:CPU's all-reduce promotion (which widens every 16-bit
  all-reduce to fp32) aborts the compiler ("Invalid binary instruction
  opcode copy", ``AllReducePromotion`` -> ``CloneAllReduce``; seen with
  ``jax.lax.psum(x.astype(jnp.bfloat16), "data")`` under
  ``jax.shard_map(..., axis_names={"data"})`` on a mesh with a second,
  automatic axis). The same bf16 payload is then all-gathered and summed in
  fp32, as the promotion would sum it: the same bits leave the site, the
  same numbers up to the order of the sum.
  """
  if x.dtype == jnp.bfloat16 and sites_of_devices() and target_platform() == "cpu":
    gathered = jax.lax.all_gather(x, axis_name)
    return jnp.sum(gathered.astype(jnp.float32), axis=0).astype(jnp.bfloat16)
  return jax.lax.psum(x, axis_name)


def metered_psum(tree: Any, axis_name: str | None, *,
                 bucket: bool | None = None) -> tuple[Any, Traffic]:
  """``psum`` of every leaf over ``axis_name`` and this site's traffic.

  With ``axis_name=None`` (one site) the tree is returned unchanged and the
  payload is still recorded (its wire cost is zero for one site). With
  ``bucket`` (default :data:`BUCKET`) the leaves of each dtype travel in one
  buffer (:func:`bucketed`): one all-reduce op per dtype.
  """
  if axis_name is None:
    out = tree
  elif BUCKET if bucket is None else bucket:
    out = bucketed(lambda x: _psum(x, axis_name), tree, stacked=False)
  else:
    out = jax.tree.map(lambda x: _psum(x, axis_name), tree)
  return out, Traffic(reduce=tree_nbits(tree), reduce_calls=_calls(tree))


def metered_pmean(tree: Any, axis_name: str | None) -> tuple[Any, Traffic]:
  """``pmean`` (psum / N) of every leaf and this site's traffic."""
  out = tree if axis_name is None else jax.lax.pmean(tree, axis_name)
  return out, Traffic(reduce=tree_nbits(tree), reduce_calls=_calls(tree))


def metered_all_gather(tree: Any, axis_name: str | None, *, invariant: bool = False,
                       bucket: bool | None = None) -> tuple[Any, Traffic]:
  """All-gather every leaf along a new leading site axis, and this site's traffic.

  With ``bucket`` (default :data:`BUCKET`) the leaves of each dtype travel in
  one buffer (:func:`bucketed`): one all-gather op per dtype, not one per leaf.
  """
  if (BUCKET if bucket is None else bucket) and axis_name is not None:
    out = bucketed(lambda x: gather_sites(x, axis_name, invariant=invariant), tree, stacked=True)
  else:
    out = gather_sites(tree, axis_name, invariant=invariant)
  return out, Traffic(gather=tree_nbits(tree), gather_calls=_calls(tree))



def metered_all_to_all(x: jax.Array, axis_name: str | None) -> tuple[jax.Array, Traffic]:
  """All-to-all of ``x``'s leading axis (one row per site), and this site's traffic.

  Site ``i`` sends row ``j`` of its ``x`` to site ``j`` and receives, as row
  ``j`` of the result, row ``i`` of site ``j``'s ``x`` (the first phase of a
  reduce-scatter: :mod:`dadjax.compress._two_phase`).

  The ledger has two kinds, all-reduce and all-gather traffic. An all-to-all
  of a buffer of ``B`` bits is booked as all-gather traffic of one row,
  ``B / N`` bits: a site sends ``N - 1`` rows of ``B / N`` bits, which is
  exactly what an all-gather of ``B / N`` bits sends (ring: ``(N-1)/N * B``
  wire bits, :func:`dadjax.comm._wire.all_to_all_factor`, in ``N - 1``
  messages). The compiled program's ``all-to-all`` ops are charged the
  all-gather's latency (:meth:`dadjax.comm.NetworkModel.step_time`). Under
  the parameter-server topology the model charges ``B`` where a
  server-routed all-to-all carries ``2 (N-1)/N * B`` through a worker's
  link (less than twice that).

  Args:
    x: an array whose leading axis has one row per site (``N`` rows).
    axis_name: the sites' axis; ``None`` is one site (``x`` is returned).

  Returns:
    ``(received, traffic)``; ``received`` has ``x``'s shape.

  Raises:
    ValueError: if ``x``'s leading axis is not the number of sites.
  """
  n = 1 if axis_name is None else jax.lax.axis_size(axis_name)
  if jnp.ndim(x) < 1 or jnp.shape(x)[0] != n:
    raise ValueError(f"metered_all_to_all: x needs a leading axis of {n} rows (one per site), "
                     f"got shape {jnp.shape(x)}")
  out = x if axis_name is None else jax.lax.all_to_all(x, axis_name, 0, 0, tiled=False)
  return out, Traffic(gather=tree_nbits(x) // n, gather_calls=1)
