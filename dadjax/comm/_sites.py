"""Collectives over a named axis: the sites' size and index, sums, means and gathers.

They work under ``jax.shard_map``, ``jax.pmap`` and
``jax.vmap(..., axis_name=...)`` alike, so one site function serves every
backend. With ``axis_name=None`` they are the single-site identity, which is
how transformations run in tests and notebooks without a mesh. These are
unmetered: methods use the metered wrappers of :mod:`dadjax.comm._metered`.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp

# The platform of the devices the program being traced is for (innermost last): set by the
# placements while they trace, since jax.default_backend() is the host's when compiling
# for a TPU topology on a CPU machine.
_TARGETS: list[str] = []


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
  """Within this context, :func:`target_platform` is ``platform`` (``"cpu"``, ``"tpu"``, ...)."""
  _TARGETS.append(platform)
  try:
    yield
  finally:
    _TARGETS.pop()


def target_platform() -> str:
  """The platform the traced program is compiled for (default: ``jax.default_backend()``)."""
  return _TARGETS[-1] if _TARGETS else jax.default_backend()


def sites_of_devices() -> bool:
  """Whether the code being traced runs manual over the sites and automatic inside them."""
  mesh = jax.sharding.get_abstract_mesh()
  return bool(getattr(mesh, "auto_axes", ())) and bool(getattr(mesh, "manual_axes", ()))


def in_site_axes() -> tuple[str, ...]:
  """The mesh axes GSPMD splits a site's tensors over, when sites are groups of devices.

  ``()`` outside the sites' partially manual ``shard_map`` or when the automatic axes hold
  one device. Code that must not let the SPMD partitioner gather a split tensor whole (a
  scatter, a selection) runs a nested ``shard_map`` over these axes.
  """
  if not sites_of_devices():
    return ()
  axes = tuple(jax.sharding.get_abstract_mesh().auto_axes)
  return axes if in_site_devices(axes) > 1 else ()


def in_site_devices(axes: tuple[str, ...]) -> int:
  """The devices along ``axes`` of the mesh of the program being traced (a site's devices
  for :func:`in_site_axes`)."""
  mesh = jax.sharding.get_abstract_mesh()
  return math.prod(mesh.shape[a] for a in axes)


def axis_size(axis_name: str | None) -> int:
  """Number of sites along ``axis_name`` (1 without an axis)."""
  return 1 if axis_name is None else jax.lax.axis_size(axis_name)


def site_index(axis_name: str | None) -> jax.Array | int:
  """This site's position along ``axis_name`` (0 without an axis)."""
  return 0 if axis_name is None else jax.lax.axis_index(axis_name)


def mean_over_sites(tree: Any, axis_name: str | None) -> Any:
  """All-reduce mean (psum / N) of every leaf."""
  return tree if axis_name is None else jax.lax.pmean(tree, axis_name)


def sum_over_sites(tree: Any, axis_name: str | None) -> Any:
  return tree if axis_name is None else jax.lax.psum(tree, axis_name)


def gather_sites(tree: Any, axis_name: str | None, *, invariant: bool = False) -> Any:
  """All-gather every leaf along a new leading site axis.

  Args:
    tree: pytree of per-site arrays.
    axis_name: mesh / pmap / vmap axis name, or ``None`` (adds an axis of 1).
    invariant: type the result as invariant across sites. Under
      ``shard_map(check_vma=True)`` a custom_vjp backward that returns a
      gathered cotangent for a *replicated* parameter needs this; a plain
      gather is typed varying and is rejected.

  On a TPU whose sites are groups of chips (slices), a ring of
  ``collective-permute`` s replaces the all-gather (:func:`ring_gather`).

  Returns:
    The gathered tree, each leaf with shape ``(num_sites, *leaf.shape)``.
  """
  if axis_name is None:
    return jax.tree.map(lambda x: x[None], tree)
  if not invariant:
    if target_platform() == "tpu" and sites_of_devices():
      return jax.tree.map(lambda x: ring_gather(x, axis_name), tree)
    return jax.lax.all_gather(tree, axis_name)
  return jax.tree.map(lambda x: _all_gather_invariant(x, axis_name), tree)


def ring_gather(x: jax.Array, axis_name: str) -> jax.Array:
  """``all_gather(x, axis_name)`` as ``N - 1`` ring steps of ``ppermute``: ``(N, *x.shape)``.

  Why: inside a partially manual ``shard_map`` (manual over the sites, GSPMD
  within), the TPU compiler lowers an all-gather over the sites to an
  all-gather of the whole operand within the slice followed by a cross-slice
  (DCN) gather of that whole copy from every chip: a sharded payload
  arrives whole on every chip (``N`` whole copies of temporary memory) and
  the DCN carries the site's payload once per chip. A ``collective-permute``
  keeps the operand's in-site sharding: each chip sends its own shard to the
  same chip of the next site, ``(N - 1) / N`` of the payload per site, as a
  ring all-gather sends. The blocks arrive in ring order and are rotated
  into site order by a dynamic slice (no gather).
  """
  n = jax.lax.axis_size(axis_name)
  ring = [(j, (j + 1) % n) for j in range(n)]
  blocks, current = [x], x
  for _ in range(n - 1):  # after k steps: the block of site (i - k) mod n
    current = jax.lax.ppermute(current, axis_name, ring)
    blocks.append(current)
  backwards = jnp.stack(blocks[::-1])  # position p: site (i + 1 + p) mod n
  doubled = jnp.concatenate([backwards, backwards])
  start = (n - 1 - jax.lax.axis_index(axis_name)) % n  # site s sits at (s - i - 1) mod n
  return jax.lax.dynamic_slice_in_dim(doubled, start, n, axis=0)


def _all_gather_invariant(x, axis_name):
  # Newest JAX: all_gather(..., to="invarying"); some 0.10/0.11 builds only
  # have the private all_gather_invariant. One helper hides the difference.
  try:
    return jax.lax.all_gather(x, axis_name, to="invarying")
  except TypeError:
    from jax._src.lax.parallel import all_gather_invariant  # pylint: disable=g-import-not-at-top
    return all_gather_invariant(x, axis_name)
