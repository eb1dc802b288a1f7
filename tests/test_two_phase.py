"""The two-phase route (dadjax.compress._two_phase): wire bits, the lowered program's bytes,
unbiasedness, sign's exact majority vote, error feedback in training, auto, bad options."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import compress as C
from dadjax.comm import hlo_collectives, metered_all_to_all
from dadjax.comm._wire import all_to_all_factor, wire_factor
from dadjax.compress._two_phase import BLOCK as TWO_PHASE_BLOCK
from dadjax.models import MLP
from dadjax.parallel import stack_sites

AXIS = "data"


def _grads(n, seed=0):
  """Per-site gradients (leading axis n): leaves of several sizes, one not a multiple of 32."""
  k = jax.random.split(jax.random.key(seed), 4)
  return {"w": jax.random.normal(k[0], (n, 24, 16)), "b": jax.random.normal(k[1], (n, 16)),
          "conv": jax.random.normal(k[2], (n, 3, 3, 4, 8)), "v": jax.random.normal(k[3], (n, 37))}


# spec, code bits of phase one and phase two, whether a chunk carries fp32 scales (one per
# C.BLOCK entries, each phase), extra words per phase-one chunk (sign: the abstain bits of the
# L = 4 tensors)
ROUTED = {
    "qsgd:7": (4, 4, 1, 0),  # 7 levels: 1 sign bit + 3 level bits
    "terngrad": (2, 2, 1, 0),
    "sign": (1, 2, 0, 1),  # phase two: the vote's sign, +1 / -1 / 0 on a tie
    "fp8": (8, 8, 1, 0),
}


def _site_update(tx):
  def site(g, s):
    return tx.update(g, s)
  return site


def _run(spec, n, backend):
  """One compressed update of ``spec`` on the two-phase route over ``n`` sites; (stats, lowered)."""
  tx = C.compressed(C.get_compressor(f"{spec}:route=two_phase"), axis_name=AXIS)
  grads = _grads(n)
  state = stack_sites(tx.init(jax.tree.map(lambda x: x[0], grads)), n)
  if backend == "vmap":
    run = jax.jit(jax.vmap(_site_update(tx), axis_name=AXIS))
    lowered = None
  else:
    mesh = dadjax.make_mesh(n, AXIS)

    def site(g, s):
      g, s = jax.tree.map(lambda x: x[0], (g, s))
      u, s = tx.update(g, s)
      return jax.tree.map(lambda x: x[None], (u, s))

    run = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS)))
    lowered = run.lower(grads, state)
  mean, state = run(grads, state)
  return dadjax.comm_stats(state), lowered, mean


@pytest.mark.parametrize("spec", list(ROUTED))
@pytest.mark.parametrize("n, backend", [(8, "vmap"), (8, "shard_map"), (64, "vmap")])
def test_two_phase_books_its_wire_bits_and_the_program_moves_them(spec, n, backend):
  b1, b2, scaled, extra = ROUTED[spec]
  stats, lowered, mean = _run(spec, n, backend)
  d = sum(math.prod(x.shape[1:]) for x in jax.tree.leaves(_grads(1)))
  m = 32 * -(-d // (32 * n))  # entries per chunk: whole words
  scales = scaled * -(-m // TWO_PHASE_BLOCK)
  row1 = b1 * m + 32 * (scales + extra)  # one chunk of phase one, the all-to-all's row
  row2 = b2 * m + 32 * scales  # one re-quantized chunk, the all-gather's payload
  # The ledger books the all-to-all as one row of all-gather traffic, and the all-gather.
  assert stats.gather_bits == (row1 + row2,) * n and stats.reduce_bits == (0,) * n
  assert stats.gather_calls == 2
  wire = stats.wire_bits(n)
  assert wire == (n - 1) * (row1 + row2)
  # = (N-1)/N of the all-to-all's whole buffer + (N-1) chunks: the ring's cost of each phase
  assert wire == all_to_all_factor(n) * n * row1 + wire_factor("gather", n) * row2
  # At most 2 (N-1)/N x (b + overhead) per entry, the overhead stated: the padding of the
  # last chunk to whole words, the fp32 scales (and sign's abstain bits) of every chunk.
  b = (b1 + b2) / 2
  overhead = (b * (n * m - d) + 32 * n * (scales + extra / 2)) / d
  assert wire <= 2 * (n - 1) / n * (b + overhead) * d + 1e-6
  if backend == "vmap":
    return
  # The lowered program's collectives move exactly the booked bytes (all uint32 buffers, so
  # XLA:CPU's widening of 8- and 16-bit collectives at compile time does not arise; the
  # compiled program is compared too).
  for text in (lowered.as_text(dialect="hlo"), lowered.compile().as_text()):
    ops = hlo_collectives(text)
    assert ops.count["all_to_all"] == 1 and ops.count["gather"] == 1 and ops.count["reduce"] == 0
    assert 8 * ops.nbytes["all_to_all"] == n * row1 and 8 * ops.nbytes["gather"] == row2
  net = dadjax.NetworkModel(bandwidth=1e9, latency=1e-3, num_sites=n)
  # the all-to-all pays the all-gather's N - 1 messages
  assert net.step_time(stats, ops) == pytest.approx(wire / 1e9 + 1e-3 * 2 * (n - 1))
  assert all(np.allclose(x, x[:1]) for x in jax.tree.leaves(mean))  # every site, one result


def _exchange(c, grads, step=0):
  n = jax.tree.leaves(grads)[0].shape[0]
  state = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape),
                       c.init(jax.tree.map(lambda x: x[0], grads)))

  def site(g, s):
    out = C.exchange(c, g, s, C.step_keys(0, step, AXIS), AXIS)
    return out.mean, out.local, out.state

  return jax.vmap(site, axis_name=AXIS)(grads, state)


@pytest.mark.parametrize("n", [6, 8])
def test_sign_two_phase_equals_the_all_gather_majority_vote(n):
  grads = _grads(n, seed=1)
  grads["b"] = grads["b"].at[1].set(0.0).at[4].set(0.0)  # two sites abstain on one tensor
  grads["v"] = grads["v"].at[:, :5].set(0.0)  # zeros vote +1 (sign(0) = +1)
  grads["w"] = jnp.sign(grads["w"]) * 0.5  # few magnitudes: many ties at even N
  one, _, _ = jax.jit(lambda g: _exchange(C.sign(), g))(grads)
  two, local, _ = jax.jit(lambda g: _exchange(C.sign(route="two_phase"), g))(grads)
  for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(two)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (np.asarray(two["w"]) == 0).any() == (n % 2 == 0)  # ties give 0 at even N only
  np.testing.assert_array_equal(np.asarray(local["b"][1]), 0.0)  # the abstaining site's own
  np.testing.assert_array_equal(np.asarray(local["w"]), np.sign(np.asarray(grads["w"])))


@pytest.mark.parametrize("make", [lambda: C.qsgd(3, route="two_phase"),
                                  lambda: C.terngrad(clip=None, route="two_phase"),
                                  lambda: C.quantize(3, route="two_phase")])
def test_two_phase_is_unbiased(make):
  n, seeds = 4, 2000
  grads = _grads(n, seed=2)
  grads = {"w": grads["w"][:, :4], "v": grads["v"]}  # 64 + 37 entries: 2 chunks of 32 per site
  true = jax.tree.map(lambda x: np.asarray(x, np.float64).mean(0), grads)
  c = make()
  means = jax.jit(jax.vmap(lambda s: _exchange(c, grads, s)[0]))(jnp.arange(seeds))
  for leaf, t in zip(jax.tree.leaves(means), jax.tree.leaves(true)):
    samples = np.asarray(leaf, np.float64)[:, 0]  # site 0's copy (every site has the same)
    assert samples.std(0).max() > 0.05  # both roundings are genuinely random
    err = np.abs(samples.mean(0) - t)
    bound = 5 * samples.std(0) / np.sqrt(seeds) + 1e-6
    assert np.all(err <= bound), np.max(err / bound)


@pytest.mark.parametrize("spec", ["qsgd:7", "terngrad", "quantize:4", "scaled_sign", "fp8"])
def test_a_small_leaf_beside_a_large_one_keeps_its_own_scale(spec):
  # A chunk cuts across leaves: one scale per chunk rounded a 1e-3 bias against a unit-scale
  # matrix's norm (QSGD: diverged on the Fashion-MNIST MLP). One scale per C.BLOCK entries
  # bounds the small leaf's error by its own magnitude.
  n = 2
  k = jax.random.split(jax.random.key(5), 2)
  grads = {"big": jax.random.normal(k[0], (n, 64, 64)),
           "small": 1e-3 * jax.random.normal(k[1], (n, 16384))}
  mean, _, _ = jax.jit(lambda g: _exchange(C.get_compressor(f"{spec}:route=two_phase"), g))(grads)
  true = np.asarray(grads["small"]).mean(0)
  err = np.abs(np.asarray(mean["small"][0]) - true)
  assert err.max() < 0.01 and np.sqrt((err ** 2).mean()) < 3e-3, err.max()


def test_two_phase_books_one_scale_per_block():
  like = {"w": jnp.zeros((96, 100)), "b": jnp.zeros((100,))}  # 9,700 entries
  n, d = 4, 9_700
  m = 32 * -(-d // (32 * n))  # 2,432 entries per chunk: 5 blocks of 512
  blocks = -(-m // TWO_PHASE_BLOCK)
  row = 4 * m + 32 * blocks  # qsgd:7: 4-bit codes, one fp32 norm per block
  wire = C.route_wire_bits(C.get_compressor("qsgd:7:route=two_phase"), like, n)["two_phase"]
  assert blocks == 5 and wire == (n - 1) * 2 * row
  bucketed = C.route_wire_bits(C.get_compressor("qsgd:7:128:route=two_phase"), like, n)
  assert bucketed["two_phase"] == (n - 1) * 2 * (4 * m + 32 * -(-m // 128))


def test_error_feedback_keeps_the_first_quantization_error():
  grads = _grads(8, seed=3)
  c = C.error_feedback(C.qsgd(7, route="two_phase"))
  mean, local, state = jax.jit(lambda g: _exchange(c, g))(grads)
  for g, q, e in zip(jax.tree.leaves(grads), jax.tree.leaves(local), jax.tree.leaves(state.memory)):
    np.testing.assert_allclose(np.asarray(e), np.asarray(g - q), atol=1e-6)
  assert any(float(jnp.abs(e).max()) > 0 for e in jax.tree.leaves(state.memory))


def test_ef_of_the_two_phase_route_trains():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(20, 4))
  x = rng.normal(size=(256, 20)).astype(np.float32)
  batch = {"x": jnp.asarray(x), "y": jnp.asarray(np.argmax(x @ w, axis=1))}
  tx = optax.chain(C.compressed(C.get_compressor("ef(scaled_sign:route=two_phase)")),
                   optax.sgd(0.1, momentum=0.9))
  ts = dadjax.make_train_step(MLP(hidden=(32,), num_classes=4), tx, num_sites=8, backend="vmap")
  state = ts.init(jax.random.key(0), batch["x"][:4])
  losses = []
  for _ in range(30):
    state, metrics = ts(state, batch)
    losses.append(float(np.mean(metrics["loss"])))
  assert losses[-1] < 0.5 * losses[0], losses
  stats = dadjax.comm_stats(state.opt_state)
  assert stats.gather_calls == 2 and stats.reduce_bits == (0,) * 8


def test_auto_route_takes_the_fewer_wire_bits():
  like = jax.tree.map(lambda x: x[0], _grads(1))
  sign = C.sign(route="auto")
  # sign: N - 1 bits per entry gathered against (N-1)/N * (1 + 2): gather at N = 2, two phases
  # from N = 4
  assert C.chosen_route(sign, like, 2) == "one_round"
  assert C.chosen_route(sign, like, 8) == "two_phase"
  assert C.chosen_route(C.get_compressor("bf16:route=auto"), like, 8) == "one_round"
  assert C.chosen_route(C.get_compressor("qsgd:7:route=auto"), like, 8) == "two_phase"
  for n, route in ((2, "one_round"), (8, "two_phase")):
    wire = C.route_wire_bits(sign, like, n)
    assert min(wire, key=wire.get) == route
    auto, _, _ = jax.jit(lambda g: _exchange(sign, g))(_grads(n))
    chosen, _, _ = jax.jit(lambda g: _exchange(C.sign(route=route), g))(_grads(n))
    for a, b in zip(jax.tree.leaves(auto), jax.tree.leaves(chosen)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_casts_on_the_two_phase_route_are_close_to_the_fp32_mean():
  grads = _grads(8, seed=4)
  true = jax.tree.map(lambda x: np.asarray(x).mean(0), grads)
  for spec, tol in (("bf16", 1e-2), ("fp8", 0.1), ("cast:fp8_e5m2", 0.2)):
    mean, _, _ = jax.jit(lambda g: _exchange(C.get_compressor(f"{spec}:route=two_phase"), g))(grads)
    for a, t in zip(jax.tree.leaves(mean), jax.tree.leaves(true)):
      scale = np.abs(t).max()
      assert np.abs(np.asarray(a)[0] - t).max() <= tol * scale, spec


@pytest.mark.parametrize("spec, option", [
    ("qsgd:16:route=gather", "route"), ("sign:route=2", "route"), ("fp8:route=x", "route"),
    ("quantize:1", "bits"), ("quantize:17", "bits")])
def test_bad_options_name_the_option(spec, option):
  with pytest.raises(ValueError, match=option):
    C.get_compressor(spec)


def test_bad_arguments_raise():
  with pytest.raises(ValueError, match="route"):
    C.qsgd(route="ring")
  with pytest.raises(ValueError, match="route"):
    C.cast("fp8_e4m3", route="")
  with pytest.raises(ValueError, match="bits"):
    C.quantize(bits=1)
  with pytest.raises(ValueError, match="leading axis"):
    jax.vmap(lambda x: metered_all_to_all(x, AXIS)[0], axis_name=AXIS)(jnp.zeros((4, 3, 2)))


def test_shard_map_train_step_books_what_its_program_moves():
  # The step's own ledger check counts an all-to-all as the one row the ledger books.
  rng = np.random.default_rng(1)
  batch = {"x": jnp.asarray(rng.normal(size=(64, 12)), jnp.float32),
           "y": jnp.asarray(rng.integers(0, 3, size=64))}
  tx = optax.chain(C.compressed(C.get_compressor("sign:route=two_phase")), optax.sgd(0.01))
  step = dadjax.make_train_step(MLP(hidden=(16,), num_classes=3), tx, num_sites=8,
                                backend="shard_map")
  state = step.init(jax.random.key(0), batch["x"][:2])
  state, _ = step(state, batch)
  check = step.ledger_check(state, batch)
  assert check["program_bits"] == check["booked_bits"]
  assert step.collectives(state, batch).count["all_to_all"] == 1
