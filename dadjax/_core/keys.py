"""How every random key in dadjax is derived: one scheme, domain-tagged folds of a root key.

Every key is a root key folded (``jax.random.fold_in``) with a sequence of
*domain tags* and counters. A tag is a 31-bit constant named by text, so two
purposes never share a key by accident. Two tag functions exist:

* :func:`tag` ``(text)``: ``crc32(text) mod 2**31``, for one fixed word;
* :func:`derive_key` ``(key, *parts)``: folds in the two 31-bit halves of a
  64-bit ``blake2b`` hash of ``parts`` (strings / ints: a method name, a leaf
  path), for structured, open-ended names where collisions must stay below
  2^-64.

Counters (the step ``t``, the site index ``s``, a component ``k``) are folded
in as themselves. Who derives what, from which root (all bit-stable across
versions; changing one changes results and checkpoints' meaning):

============================ ==================================================================
train step (per run)          ``base = fold(init_key, step_tag("base"))`` (checkpointed);
                              model key ``fold(base, step_tag("model"), t, s)``; a batch
                              stage's shared key ``fold(base, step_tag("stage"), t)`` and site
                              key ``fold(shared, step_tag("site"), s)``. ``step_tag(n) =
                              tag("dadjax.step/" + n)``.
rng streams of a loss         :func:`stream_key` ``(model_key, "dropout") = fold(key, tag(name))``.
compressors                   shared ``fold(derive_key(key(seed), "shared"), t)``, site
                              ``fold(derive_key(key(seed), "site"), t, s)``; each leaf
                              ``derive_key(k, method, "leaf", path)`` (``dadjax.compress``).
dAD layers                    layer seed :func:`layer_seed` ``(seed, path)``; the step's key
                              :func:`seed_step_key` ``(layer_seed, t)``; rank-dAD splits it and
                              starts component ``k`` from :func:`hash_uniform` ``(key, k)`` with ``key =``
                              :func:`start_key` ``(layer_seed, t, "rank_dad/local" | "/global")``; quantized dAD's
                              rounding keys ``fold(seed_step_key(seed, t), s, 0 | 1)``.
data quantization             ``fold(stage_key, i)`` for its ``i``-th use (quantize, gate, fit,
                              correction).
============================ ==================================================================
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "tag", "step_tag", "fold", "derive_key", "derive_keys", "stream_key", "layer_seed",
    "seed_step_key", "start_key", "hash_uniform", "hash_unit"
]

_MASK = 0x7FFFFFFF


def tag(text: str) -> int:
  """The domain tag named ``text``: ``crc32(text) mod 2**31``."""
  return zlib.crc32(text.encode()) & _MASK


def step_tag(name: str) -> int:
  """The train step's tag of one key purpose: ``tag("dadjax.step/" + name)``."""
  return tag(f"dadjax.step/{name}")


def fold(key: jax.Array, *parts: int | str | jax.Array) -> jax.Array:
  """``key`` folded with each part in turn; a ``str`` part folds in :func:`tag` of it."""
  for part in parts:
    key = jax.random.fold_in(key, tag(part) if isinstance(part, str) else part)
  return key


def derive_key(key: jax.Array, *parts: object) -> jax.Array:
  """``key`` folded with a 64-bit ``blake2b`` hash of ``parts`` (domain separation).

  ``parts`` are strings or ints naming a purpose, a method, a leaf path or
  a site; different parts give (up to a 2^-64 collision) independent keys.
  """
  for half in _halves(parts):
    key = jax.random.fold_in(key, half)
  return key


def _halves(parts) -> tuple[int, int]:
  """The two 31-bit halves of the 64-bit ``blake2b`` hash of ``parts`` that :func:`derive_key` folds in."""
  digest = hashlib.blake2b("\x1f".join(map(repr, parts)).encode(), digest_size=8).digest()
  return tuple(int.from_bytes(digest[i:i + 4], "little") & _MASK for i in (0, 4))


def derive_keys(key: jax.Array, parts_list) -> jax.Array:
  """``[derive_key(key, *parts) for parts in parts_list]`` as one batched key array (L,).

  The same keys, bit for bit (a fold-in is elementwise), from one batched op
  instead of two per entry: for per-leaf keys of many leaves.
  """
  halves = np.array([_halves(parts) for parts in parts_list], np.uint32).reshape(-1, 2)
  fold2 = lambda a, b: jax.random.fold_in(jax.random.fold_in(key, a), b)
  return jax.vmap(fold2)(halves[:, 0], halves[:, 1])


def stream_key(rng: jax.Array, name: str) -> jax.Array:
  """The key of one named rng stream (``"dropout"``, ...): ``fold(rng, tag(name))``."""
  return fold(rng, name)


def layer_seed(seed: int, path: Iterable) -> int:
  """A layer's own seed: ``(seed + crc32("/".join(path))) mod 2**31``.

  The path is the same on every site, so a key drawn from it stays shared.
  """
  return (seed + zlib.crc32("/".join(map(str, path)).encode())) % (1 << 31)


def seed_step_key(seed: int, step) -> jax.Array:
  """``fold(key(seed), step)`` with the step as int32: a layer's key of one step."""
  return jax.random.fold_in(jax.random.key(seed), jnp.asarray(step, jnp.int32))


def start_key(seed: int, step, purpose: str) -> jax.Array:
  """A threefry key whose raw words are ``(seed xor tag(purpose), step)``, unhashed.

  Only for :func:`hash_uniform` (which mixes the words itself): it costs no
  threefry call, where :func:`seed_step_key` costs one per layer and step.
  """
  words = jnp.stack([jnp.uint32((seed ^ tag(purpose)) & 0xFFFFFFFF),
                     jnp.asarray(step).astype(jnp.uint32)])
  return jax.random.wrap_key_data(words, impl="threefry2x32")


def hash_uniform(key: jax.Array, counter, n: int, dtype=jnp.float32) -> jax.Array:
  """``n`` numbers in (-1, 1) from ``(key, counter)`` by an integer hash (murmur3's mix).

  For power-iteration start vectors, which need only be generic (not
  orthogonal to the subspace sought) and equal wherever ``key`` is: a few
  elementwise integer ops, where ``jax.random.normal`` compiles threefry's
  rounds and an inverse error function into every layer that draws (on a
  small ViT that draw was 40% of rank-dAD's extra compile time). Not for
  anything whose statistics matter (rounding noise, dropout, sampling).

  Args:
    key: a typed PRNG key (its raw words seed the hash).
    counter: int or int32 scalar (a component index), traced or not.
    n: entries (static).
    dtype: a float dtype.

  Returns:
    (n,) array, entries ``(2 h + 1) / 2^24 - 1`` for 23-bit hashes ``h``.
  """
  seed = jnp.uint32(0x9E3779B9)
  for word in jax.random.key_data(key).reshape(-1):  # 2 words for threefry keys
    seed = _mix32(seed ^ word.astype(jnp.uint32))
  seed = _mix32(seed ^ (jnp.asarray(counter).astype(jnp.uint32) * jnp.uint32(0x85EBCA6B)))
  h = _mix32(jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1) + seed)
  return ((h >> 9).astype(dtype) * 2 + 1) * (2.0 ** -23) - 1


def hash_unit(key: jax.Array, n: int) -> jax.Array:
  """``n`` uniform [0, 1) float32 numbers from ``key`` by a counter-based integer hash.

  Entry ``i`` is ``mix(mix(i * phi + s1) ^ s2)`` (``mix``: murmur3's 32-bit
  finalizer; ``s1``, ``s2``: the key's words hashed), whose 23 top bits make
  the mantissa of a number in [1, 2), minus 1: the same grid as
  ``jax.random.uniform``'s float32 draws, so rounding against it is unbiased
  to within 2^-24. The stochastic rounding noise of ``qsgd(noise="hash")``
  and ``terngrad(noise="hash")``: a few elementwise integer ops per entry
  where threefry runs 20 rounds (on 2 CPU cores, 19.2M entries: about 9x
  faster). Its statistics are tested (uniformity, independence across keys,
  the compressors' unbiasedness and variance); it is not a cryptographic
  generator.

  Args:
    key: a typed PRNG key (any implementation; its raw words seed the hash).
    n: entries (static).

  Returns:
    (n,) float32.
  """
  words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
  s1 = jnp.uint32(0x9E3779B9)
  for word in words:
    s1 = _mix32(s1 ^ word)
  s2 = _mix32(s1 ^ jnp.uint32(0x6A09E667))
  h = _mix32(_mix32(jnp.arange(n, dtype=jnp.uint32) * jnp.uint32(0x9E3779B1) + s1) ^ s2)
  one = np.array(1.0, np.float32).view(np.uint32)
  return jax.lax.bitcast_convert_type((h >> np.uint32(9)) | one, jnp.float32) - 1.0


def _mix32(h: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer (a bijection of uint32 with full avalanche)."""
  h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
  h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)
