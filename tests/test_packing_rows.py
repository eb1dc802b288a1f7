"""Shape-keeping packing (pack_rows / pack_leaf) and the ring all-gather over sites.

Both exist so that a leaf sharded inside a site stays sharded through a compressor's packing
and its gather over the sites (tests/test_pod.py compiles them for a TPU topology)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from dadjax import extend
from dadjax._core.packing import pack_leaf, unpack_leaf
from dadjax.comm._sites import ring_gather


@pytest.mark.parametrize("bits", [1, 2, 3, 5, 6, 7, 8, 11, 16, 31, 32])
@pytest.mark.parametrize("shape", [(70,), (3, 70), (2, 3, 64), (4, 32)])
def test_pack_rows_round_trips_and_keeps_the_leading_axes(bits, shape):
  codes = np.random.default_rng(bits).integers(0, 2 ** bits, shape, dtype=np.uint64)
  codes = codes.astype(np.uint32)
  words = extend.pack_rows(jnp.asarray(codes), bits)
  assert words.shape == shape[:-1] + (extend.packed_words(shape[-1], bits),)
  np.testing.assert_array_equal(np.asarray(extend.unpack_rows(words, bits, shape[-1])), codes)
  if 32 % bits == 0:  # the words of each row are pack_bits's
    rows = codes.reshape(-1, shape[-1])
    expect = np.stack([np.asarray(extend.pack_bits(jnp.asarray(r), bits)) for r in rows])
    np.testing.assert_array_equal(np.asarray(words).reshape(expect.shape), expect)


@pytest.mark.parametrize("shape", [(10, 16), (16, 64), (3, 3, 4, 32), (7,), ()])
def test_pack_leaf_uses_the_flat_word_count_and_unpacks_gathered_sites(shape):
  codes = np.random.default_rng(0).integers(0, 8, shape).astype(np.uint32)
  words = pack_leaf(jnp.asarray(codes), 3)
  assert words.size == extend.packed_words(max(1, codes.size), 3)
  gathered = jnp.stack([words, words + 0])
  np.testing.assert_array_equal(np.asarray(unpack_leaf(gathered, 3, shape)),
                                np.stack([codes, codes]))


def test_unpack_rows_names_a_wrong_word_count():
  with pytest.raises(ValueError, match="expected 3 words per row"):
    extend.unpack_rows(jnp.zeros((2, 4), jnp.uint32), 3, 32)


@pytest.mark.parametrize("sites", [2, 4])
def test_ring_gather_equals_all_gather_in_site_order(sites):
  mesh = jax.make_mesh((sites, 8 // sites), ("data", "fsdp"))
  x = jnp.arange(8 * 6 * 4, dtype=jnp.float32).reshape(8 * 6 // 6, 6, 4)[:sites * 2]

  def both(v):
    return ring_gather(v, "data")[None], jax.lax.all_gather(v, "data")[None]

  ring, plain = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P("data"),
                                      out_specs=P("data"), axis_names={"data"}))(x)
  np.testing.assert_array_equal(np.asarray(ring), np.asarray(plain))


def test_a_ring_gathers_forwarding_permutes_are_echoes_the_ledger_check_counts_once():
  from dadjax.comm import collective_ops  # pylint: disable=g-import-not-at-top
  mesh = jax.make_mesh((4, 2), ("data", "fsdp"))
  fn = jax.jit(jax.shard_map(lambda v: ring_gather(v, "data")[None], mesh=mesh,
                             in_specs=P("data"), out_specs=P("data"), axis_names={"data"}))
  x = jnp.zeros((4, 6, 4), jnp.float32)
  for text in (fn.lower(x).as_text(dialect="hlo"), fn.lower(x).compile().as_text()):
    permutes = [op for op in collective_ops(text) if op.kind == "permute"]
    assert len(permutes) == 3  # N - 1 ring steps
    assert [op.echo for op in permutes].count(False) == 1  # one new payload, two forwarded
