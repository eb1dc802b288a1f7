"""The bit ledger, exact 64-bit counts and the network cost model."""
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import comm


@pytest.mark.parametrize("a,b", [(0, 0), (2**32 - 1, 1), (3 * 2**40 + 7, 2**33 - 5),
                                 (2**63, 2**63 - 1)])
def test_bits_add_is_exact_past_32_bits(a, b):
  got = jax.jit(comm.bits_add)(comm.bits_const(a), comm.bits_const(b))
  assert comm.bits_to_int(got) == a + b


def test_bits_const_rejects_out_of_range():
  with pytest.raises(ValueError, match="bit count"):
    comm.bits_const(-1)
  with pytest.raises(ValueError, match="bit count"):
    comm.bits_const(2**64)


@pytest.mark.parametrize("count,per_item", [(0, 64), (2**32 - 1, 2**16 + 3), (123_456_789, 64),
                                            (65_535, 65_535), (7, 2**31)])
def test_bits_from_traced_count_is_exact(count, per_item):
  got = jax.jit(lambda c: comm.bits_from_count(c, per_item))(jnp.uint32(count))
  assert comm.bits_to_int(got) == count * per_item


def test_bits_reduce_sums_stacked_counts_exactly():
  values = [2**32 - 1, 2**32 - 1, 5, 2**31, 17 * 2**32 + 3]
  stacked = comm.Bits(jnp.array([v >> 32 for v in values], jnp.uint32),
                      jnp.array([v & (2**32 - 1) for v in values], jnp.uint32))
  assert comm.bits_to_int(jax.jit(comm.bits_reduce)(stacked)) == sum(values)


def test_ledger_stays_exact_for_1e10_params_over_1e6_steps():
  # One fp32 step of 10^10 parameters is 3.2e11 bits: far past int32. Add it
  # 10^6 times through the jitted ledger update (a scan) and compare with
  # Python's unbounded ints.
  per_step = 10**10 * 32
  stats = comm.ledger_init()

  def body(s, _):
    return comm.ledger_record(s, reduce=per_step, dense=per_step), None

  stats, _ = jax.jit(lambda s: jax.lax.scan(body, s, None, length=10**6))(stats)
  assert comm.bits_to_int(stats.total_sent) == per_step * 10**6
  assert comm.bits_to_int(stats.total_dense) == per_step * 10**6
  assert comm.bits_to_int(stats.step_reduce) == per_step


def test_allreduce_ledger_equals_hand_computed_fp32_size():
  params = {"w": jnp.ones((3, 5)), "b": jnp.ones((5,)), "nested": [jnp.ones((2, 2, 2))]}
  tx = dadjax.allreduce(axis_name=None)
  state = tx.init(params)
  updates, state = tx.update(params, state)
  chex.assert_trees_all_equal(updates, params)
  summary = dadjax.comm_stats(state)
  assert summary.bits_per_step == (15 + 5 + 8) * 32
  assert summary.dense_bits_per_step == (15 + 5 + 8) * 32
  assert dadjax.comm.report(summary, dadjax.NetworkModel()).payload_ratio == 1.0


def test_comm_stats_reads_through_chain_multisteps_and_partition():
  params = {"w": jnp.ones((4, 4)), "b": jnp.ones((4,))}
  inner = optax.partition({"big": dadjax.allreduce(None), "small": dadjax.allreduce(None)},
                          {"w": "big", "b": "small"})
  tx = optax.MultiSteps(optax.chain(inner, optax.sgd(0.1, momentum=0.9)), every_k_schedule=2)
  state = tx.init(params)
  for _ in range(4):
    _, state = tx.update(params, state, params)
  summary = dadjax.comm_stats(state)
  assert summary.bits_per_step == (16 + 4) * 32
  # MultiSteps runs the inner chain on every second call only.
  assert summary.total == 2 * (16 + 4) * 32
  assert summary.updates == 2


def test_comm_stats_without_ledger_is_a_clear_error():
  state = optax.sgd(0.1).init({"w": jnp.ones(3)})
  with pytest.raises(ValueError, match="no CommStats"):
    dadjax.comm_stats(state)


def test_network_model_ring_formulas():
  net = dadjax.NetworkModel(bandwidth=1e9, latency=1e-4, num_sites=4)
  bits = 8 * 10**6
  assert net.allreduce_time(bits) == pytest.approx(2 * 3 / 4 * bits / 1e9 + 2 * 3 * 1e-4)
  assert net.allgather_time(bits) == pytest.approx(3 * bits / 1e9 + 3 * 1e-4)
  # A single site sends nothing.
  assert dadjax.NetworkModel(num_sites=1).allreduce_time(bits) == 0.0


def test_network_model_parameter_server_is_slower_than_ring_for_many_sites():
  ring = dadjax.NetworkModel(num_sites=16, topology="ring")
  ps = dadjax.NetworkModel(num_sites=16, topology="ps")
  assert ps.allreduce_time(10**8) > ring.allreduce_time(10**8)


def test_network_model_step_time_from_ledger():
  params = {"w": jnp.ones((100, 100))}
  tx = dadjax.allreduce(None)
  _, state = tx.update(params, tx.init(params))
  net = dadjax.NetworkModel(bandwidth=1e9, latency=0.0, num_sites=8)
  expected = 2 * 7 / 8 * 10_000 * 32 / 1e9
  assert net.step_time(dadjax.comm_stats(state)) == pytest.approx(expected)


@pytest.mark.parametrize("kwargs,match", [
    ({"bandwidth": 0}, "bandwidth"), ({"latency": -1}, "latency"),
    ({"num_sites": 0}, "num_sites"), ({"topology": "mesh"}, "topology")])
def test_network_model_bad_arguments(kwargs, match):
  with pytest.raises(ValueError, match=match):
    dadjax.NetworkModel(**kwargs)


def test_step_time_charges_each_kind_its_own_calls():
  params = {"w": jnp.ones((64, 64)), "b": jnp.ones((64,))}
  tx = optax.partition({"topk": dadjax.compressed(dadjax.compress.topk(0.1), axis_name=None),
                        "fp32": dadjax.allreduce(None)}, {"w": "topk", "b": "fp32"})
  _, state = tx.update(params, tx.init(params))
  summary = dadjax.comm_stats(state)
  k = round(0.1 * 64 * 64)
  assert summary.reduce_bits == (64 * 32,) and summary.reduce_calls == 1
  assert summary.gather_bits == (k * 64,) and summary.gather_calls >= 1
  net = dadjax.NetworkModel(bandwidth=1e9, latency=1e-3, num_sites=4)
  expected = (2 * 3 / 4 * 64 * 32 / 1e9 + 2 * 3 * 1e-3
              + 3 * k * 64 / 1e9 + 3 * 1e-3 * summary.gather_calls)
  assert net.step_time(summary) == pytest.approx(expected)


def test_wire_bits_per_topology_hand_computed():
  from dadjax.comm import wire_bits
  b = 1000
  assert wire_bits("reduce", b, 4, "ring") == 1500  # 2 (N-1)/N B
  assert wire_bits("gather", b, 4, "ring") == 3000  # (N-1) B
  assert wire_bits("reduce", b, 4, "ps") == 2000  # a worker's link: B up, B down
  assert wire_bits("gather", b, 4, "ps") == 4000  # B up, (N-1) B down
  assert wire_bits("gather", b, 1, "ring") == wire_bits("reduce", b, 1, "ps") == 0
  with pytest.raises(ValueError, match="topology"):
    wire_bits("reduce", b, 4, "tree")
  with pytest.raises(ValueError, match="num_sites"):
    wire_bits("reduce", b, 0)


def test_network_model_hand_computed_times_per_topology():
  ring = dadjax.NetworkModel(bandwidth=1e6, latency=1e-3, num_sites=4, topology="ring")
  ps = dadjax.NetworkModel(bandwidth=1e6, latency=1e-3, num_sites=4, topology="ps")
  assert ring.allreduce_time(1000) == pytest.approx(1500 / 1e6 + 6e-3)
  assert ring.allgather_time(1000) == pytest.approx(3000 / 1e6 + 3e-3)
  assert ps.allreduce_time(1000) == pytest.approx(4 * 2000 / 1e6 + 2e-3)  # server link: N workers
  assert ps.allgather_time(1000) == pytest.approx(4 * 4000 / 1e6 + 2e-3)


def _summary(reduce=1000, gather=500, dense=3200, reduce_calls=2, gather_calls=1):
  return dadjax.CommSummary((reduce,), (gather,), (dense,), (reduce + gather,), (dense,),
                            reduce_calls, gather_calls, 1, 1)


def test_comm_summary_wire_bits_and_the_report_s_ratios():
  s = _summary()
  assert s.wire_bits(4, "ring") == 1500 + 1500
  assert s.fp32_wire_bits(4, "ring") == 4800 and s.bf16_wire_bits(4, "ring") == 2400
  assert s.wire_bits(4, "ps") == 2000 + 2000
  # the ratios are the report's only (the ledger keeps counts)
  assert not hasattr(s, "wire_ratio") and not hasattr(s, "headline")
  assert not hasattr(s, "compression_ratio")
  at4 = dadjax.comm.report(s, dadjax.NetworkModel(num_sites=4))
  # the payload ratio: an fp32 all-reduce's payload bits over the bits sent, at any N
  assert at4.payload_ratio == pytest.approx(3200 / (1000 + 500))
  assert at4.setting == "ring, N=4" and at4.wire_ratio_fp32 == pytest.approx(1.6)
  assert at4.wire_ratio_bf16 == pytest.approx(0.8)
  assert at4.dense_bits_per_step == 3200 and at4.step_bits_per_step == 0  # not a train state
  # An all-gather's wire bits grow with N: at N = 64 the method sends more than fp32.
  at64 = dadjax.comm.report(s, dadjax.NetworkModel(num_sites=64))
  assert at64.wire_ratio_fp32 < 1 and at64.payload_ratio == at4.payload_ratio


def test_step_time_charges_latency_per_compiled_op():
  s = _summary()
  net = dadjax.NetworkModel(bandwidth=1e6, latency=1e-3, num_sites=4)
  by_calls = 1500 / 1e6 + 2 * 6e-3 + 1500 / 1e6 + 1 * 3e-3
  assert net.step_time(s) == pytest.approx(by_calls)
  by_ops = 1500 / 1e6 + 6e-3 + 1500 / 1e6 + 3e-3  # XLA combined the two reduce calls
  assert net.step_time(s, ops={"reduce": 1, "gather": 1}) == pytest.approx(by_ops)
  report = dadjax.comm.report(s, net, ops={"reduce": 1, "gather": 1})
  assert report.setting == "ring, N=4" and report.wire_bits_per_step == 3000
  assert report.modeled_comm_s_per_step == pytest.approx(by_ops)
  assert report.latency_per == "compiled op"
  assert dadjax.comm.report(s, net).modeled_comm_s_per_step == pytest.approx(by_calls)
  assert report.bf16_comm_s_per_step == pytest.approx(2400 / 1e6 + 6e-3)


def test_comm_stats_scales_ledgers_updated_at_different_rates():
  outer, inner = comm.ledger_init(), comm.ledger_init()
  for _ in range(4):  # every micro-step: a dAD layer's gather
    outer = comm.ledger_record(outer, gather=100, gather_calls=1)
  inner = comm.ledger_record(inner, reduce=50, dense=64, reduce_calls=1)  # k-th micro-step only
  s = dadjax.comm_stats({"outer": outer, "inner": inner})
  assert (s.updates, s.micro_steps) == (1, 4)
  assert s.gather_bits == (400,) and s.reduce_bits == (50,) and s.gather_calls == 4
  assert s.bits_per_step == 450 and s.total == 450
  assert s.bits_per_micro_step == pytest.approx(450 / 4)


def test_cumulative_wire_bits_charge_each_kind_its_factor():
  stats = comm.ledger_init()
  stats = comm.ledger_record(stats, reduce=800, dense=3200, reduce_calls=1)
  stats = comm.ledger_record(stats, gather=100, gather_calls=1)
  s = dadjax.comm_stats(stats)
  assert s.total == 900 and s.total_gather_bits == (100,)
  # ring at N=4: all-reduce 2(N-1)/N = 1.5 per payload bit, all-gather N-1 = 3
  assert s.total_wire_bits(4) == 1.5 * 800 + 3 * 100
  assert dadjax.comm.report(s, dadjax.NetworkModel(num_sites=4)).total_wire_bits == 1500


def test_report_names_the_baseline_of_the_gradient_dtype():
  import jax.numpy as jnp
  stats = comm.ledger_record(comm.ledger_init(), reduce=1600, dense=3200, reduce_calls=1)
  net = dadjax.NetworkModel(num_sites=2)

  class State(NamedTuple):
    params: dict
    ledger: comm.CommStats

  bf16 = dadjax.comm.report(State({"w": jnp.zeros(100, jnp.bfloat16)}, stats), net)
  fp32 = dadjax.comm.report(State({"w": jnp.zeros(100, jnp.float32)}, stats), net)
  assert (bf16.baseline, fp32.baseline) == ("bf16", "fp32")
  # a 16-bit all-reduce of bf16 gradients: 2x vs fp32, but 1x against what the user trains in
  assert bf16.wire_ratio_fp32 == fp32.wire_ratio_fp32 == 2.0
  assert bf16.wire_ratio == 1.0 and fp32.wire_ratio == 2.0
