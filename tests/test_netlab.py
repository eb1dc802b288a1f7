"""The network lab: namespaces, shaped links, one process per site (needs root and iproute2)."""

import ipaddress
import json
import subprocess

import numpy as np
import pytest

from dadjax.errors import DadjaxError
from dadjax.netlab import Lab, LabUnavailable, check_available, parse_rate, parse_time, run_in_lab
from dadjax.netlab import _lab


def _lab_reason():
  """Why a lab cannot be built here (None: it can)."""
  try:
    check_available()
    with Lab(1):
      pass
  except (LabUnavailable, DadjaxError) as e:
    return str(e)
  return None


# -- arguments and refusals (no root needed) ------------------------------------------------

def test_parse_rate_and_time():
  assert parse_rate("100mbit") == 100e6
  assert parse_rate("1gbit") == 1e9
  assert parse_rate("10mbps") == 80e6
  assert parse_rate(5e6) == 5e6
  assert parse_rate(None) is None
  assert parse_time("10ms") == pytest.approx(0.01)
  assert parse_time("200us") == pytest.approx(2e-4)
  assert parse_time(0) == 0.0
  for bad in ("fast", "10 furlongs", "-1mbit", "1kbit"):
    with pytest.raises(ValueError, match="rate"):
      parse_rate(bad)
  with pytest.raises(ValueError, match="delay"):
    parse_time("soon")
  with pytest.raises(ValueError, match="delay"):
    parse_time(11)


def test_lab_arguments_are_checked_before_anything_is_built():
  with pytest.raises(ValueError, match="sites"):
    Lab(0)
  with pytest.raises(ValueError, match="sites"):
    Lab(True)
  with pytest.raises(ValueError, match="jitter"):
    Lab(2, delay="1ms", jitter="2ms")
  with pytest.raises(ValueError, match="loss"):
    Lab(2, loss=0.9)
  with pytest.raises(ValueError, match="prefix"):
    Lab(2, prefix="Bad-1")


def test_refuses_clearly_without_root_or_iproute2(monkeypatch):
  monkeypatch.setattr(_lab.sys, "platform", "linux")
  monkeypatch.setattr(_lab.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
  monkeypatch.setattr(_lab.os, "geteuid", lambda: 1000)
  with pytest.raises(LabUnavailable, match="root"):
    check_available()
  with pytest.raises(LabUnavailable, match="root"):
    Lab(2).__enter__()
  monkeypatch.setattr(_lab.shutil, "which", lambda tool: None if tool == "tc" else "/sbin/ip")
  with pytest.raises(LabUnavailable, match="iproute2: tc not found"):
    check_available()


def test_cli_refusal_is_one_line(monkeypatch, capsys):
  from dadjax import cli  # pylint: disable=g-import-not-at-top
  monkeypatch.setattr(_lab.os, "geteuid", lambda: 1000)
  monkeypatch.setattr(_lab.shutil, "which", lambda tool: f"/usr/sbin/{tool}")
  assert cli.main(["netlab", "--sites", "2", "--rate", "10mbit", "train", "steps=1"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("dadjax: error: the network lab") and "root" in err
  assert cli.main(["netlab", "--rate", "fast", "train"]) == 2
  assert "rate must be" in capsys.readouterr().err


def test_initialize_checks_the_network_identity():
  import dadjax  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match="cpu_collectives='gloo'"):
    dadjax.initialize("198.18.0.1:1", 2, 0, cpu_collectives="mpi", collectives_hostname="h")
  with pytest.raises(ValueError, match="collectives_interface"):
    dadjax.initialize("198.18.0.1:1", 2, 0, collectives_interface="")


# -- the lab itself ---------------------------------------------------------------------------

def _system_names():
  ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
  links = json.loads(subprocess.run(["ip", "-j", "link", "show"], capture_output=True,
                                    text=True).stdout or "[]")
  qdiscs = subprocess.run(["tc", "qdisc", "show"], capture_output=True, text=True).stdout
  return ns, " ".join(link["ifname"] for link in links), qdiscs


@pytest.mark.slow  # 40 s: two processes behind shaped veths; the namespace tests stay default
@pytest.mark.multihost
def test_two_sites_behind_a_shaped_link_train_like_the_unshaped_run():
  reason = _lab_reason()
  if reason:
    pytest.skip(f"cannot build network namespaces here: {reason}")
  # 85k parameters: the 50 Mbit/s link's bandwidth term (~60 ms a step) is visible over latency.
  base = dict(steps=5, batch_per_site=16, model_kwargs={"hidden": [256, 256]}, eval_every=100)
  configs = [dict(base, method="allreduce"), dict(base, method="topk:0.05")]
  with Lab(2) as plain:  # one process per site, kernel bridge, no shaping
    reference = run_in_lab(plain, configs, compute_steps=0, ledger=False, timeout=300)
  with Lab(2, rate="50mbit", delay="5ms") as lab:
    assert lab.relay is not None and lab.relay.poll() is None  # the delay goes through the relay
    subnet = ipaddress.ip_network("198.18.0.0/24")
    for ns in [lab.switch, *lab.namespaces]:
      for route in lab.routes(ns):
        assert route["family"] == "-4" and route["dst"] != "default", (ns, route)
        dst = ipaddress.ip_network(route["dst"] if "/" in route["dst"] else route["dst"] + "/32")
        assert dst.subnet_of(subnet) or dst.subnet_of(ipaddress.ip_network("127.0.0.0/8")), route
    made = list(lab.created)
    shaped = run_in_lab(lab, configs + configs[:1], rates=[None, None, "25mbit"], ledger=False,
                        timeout=300)
  assert {kind for kind, _, _ in made} == {"netns", "veth", "qdisc"}
  assert sum(kind == "qdisc" for kind, _, _ in made) == 4  # both ends of both links
  for ref, run in zip(reference, shaped):
    for a, b in zip(ref.params, run.params):
      np.testing.assert_array_equal(a, b)
    assert run.comm_time > 0 and run.compute_time > 0
  for a, b in zip(reference[0].params, shaped[2].params):
    np.testing.assert_array_equal(a, b)
  assert shaped[2].rate == 25e6 and shaped[0].rate == 50e6
  assert shaped[2].comm_time > shaped[0].comm_time  # half the rate: more time on the wire
  # Everything the labs created is gone.
  assert not lab.leftovers() and not plain.leftovers()
  ns, links, qdiscs = _system_names()
  for name in [plain.switch, *plain.namespaces, lab.switch, *lab.namespaces]:
    assert name not in ns.split()
  for _, _, name in made:
    assert name.split()[0] not in links and name.split()[0] not in qdiscs
  assert plain.tag not in links and lab.tag not in links


@pytest.mark.multihost
def test_lab_is_torn_down_after_a_crash_and_stale_labs_are_swept():
  reason = _lab_reason()
  if reason:
    pytest.skip(f"cannot build network namespaces here: {reason}")
  with pytest.raises(RuntimeError, match="boom"):
    with Lab(2, rate="10mbit", delay="1ms") as lab:
      assert len(lab.leftovers()) == 3
      raise RuntimeError("boom")
  assert not lab.leftovers()
  # A lab whose owner died (here: a finished child's pid) is swept.
  child = subprocess.Popen(["true"])
  child.wait()
  stale = f"dxl{child.pid}sw"
  subprocess.run(["ip", "netns", "add", stale], check=True)
  try:
    assert stale in _lab.lab_namespaces()
    assert stale in _lab.sweep()
    assert stale not in _lab.lab_namespaces()
  finally:
    subprocess.run(["ip", "netns", "delete", stale], capture_output=True)


# -- the calibrated model ---------------------------------------------------------------------

def test_calibrated_model_charges_round_trips_per_call_and_goodput():
  from dadjax import comm  # pylint: disable=g-import-not-at-top
  GLOO_TCP, NetworkModel, TransportFit = comm.GLOO_TCP, comm.NetworkModel, comm.TransportFit
  plain = NetworkModel(100e6, 0.005, 4)
  exact = NetworkModel.calibrated(100e6, 0.005, 4, TransportFit())  # 1 RTT per step, goodput 1
  bits = 8_000_000
  assert plain.allreduce_time(bits, 1) == pytest.approx(1.5 * bits / 100e6 + 6 * 0.005)
  assert exact.allreduce_time(bits, 1) == pytest.approx(1.5 * bits / 100e6 + 6 * 0.010)
  assert exact.allgather_time(bits, 3) == pytest.approx(3 * bits / 100e6 + 3 * 3 * 0.010)
  slow = NetworkModel.calibrated(100e6, 0.0, 4, TransportFit(reduce_goodput=0.5,
                                                             step_overhead=1e-3))
  assert slow.allreduce_time(bits, 2) == pytest.approx(1.5 * bits / 50e6 + 2 * 6 * 1e-3)
  capped = NetworkModel.calibrated(100e6, 0.0, 2, TransportFit(host_rate=25e6))
  assert capped.allreduce_time(bits, 0) == pytest.approx(bits / 25e6)  # the hosts, not the link
  assert NetworkModel.calibrated(1e9, 0.0, 2).fit is GLOO_TCP
  with pytest.raises(ValueError, match="reduce_goodput"):
    TransportFit(reduce_goodput=1.5)
  with pytest.raises(ValueError, match="fit"):
    NetworkModel(fit="gloo")
  with pytest.raises(ValueError, match="ring"):
    NetworkModel(topology="ps", fit=TransportFit())


def test_collective_operands_counts_every_operand_of_a_combined_op():
  import jax  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from dadjax import make_mesh  # pylint: disable=g-import-not-at-top
  from dadjax.comm import hlo_collectives  # pylint: disable=g-import-not-at-top
  from dadjax.netlab import collective_operands  # pylint: disable=g-import-not-at-top
  mesh = make_mesh(4, "d")
  fn = jax.jit(jax.shard_map(lambda a, b, c: jax.lax.psum((a, b, c), "d"), mesh=mesh,
                             in_specs=(P("d"),) * 3, out_specs=(P("d"),) * 3))
  x = jax.numpy.ones((4, 16))
  text = fn.lower(x, x * 2, x[:, :8]).compile().as_text()
  ops = hlo_collectives(text)
  assert collective_operands(text)["reduce"] == 3 >= ops.count["reduce"] >= 1


def _cond_program():
  """A 4-site program: a ``lax.cond`` with 3 all-reduces (true) or 1 (false), then one of 2 operands."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
  from dadjax import make_mesh  # pylint: disable=g-import-not-at-top

  def three(x):  # dependent: XLA cannot combine them
    x = jax.lax.psum(x, "d")
    x = jax.lax.psum(jnp.sin(x), "d")
    return jax.lax.psum(jnp.cos(x), "d")

  def one(x):
    return jax.lax.psum(x[:, :4], "d").sum() + x

  def site(pred, a, b):
    s = jax.lax.psum((a.sum(), b.sum()), "d")  # one op, two operands
    return jax.lax.cond(pred[0], three, one, a) + s[0] + s[1]

  fn = jax.jit(jax.shard_map(site, mesh=make_mesh(4, "d"), in_specs=(P("d"),) * 3,
                             out_specs=P("d"), check_vma=False))
  x = jnp.ones((4, 16))
  return fn.lower(jnp.ones(4, bool), x, x).compile().as_text()


def test_taken_collectives_counts_the_branch_that_runs():
  from dadjax.comm import (hlo_collectives, match_branches,  # pylint: disable=g-import-not-at-top
                           taken_collectives)
  from dadjax.comm._hlo import collective_ops  # pylint: disable=g-import-not-at-top
  text = _cond_program()
  (cond,) = {op.branch[0][0] for op in collective_ops(text) if op.branch}
  every = hlo_collectives(text)
  assert every.count["reduce"] == 5 and every.conditional_count["reduce"] == 4
  assert every.operands["reduce"] == 6 and every.conditional_operands["reduce"] == 4
  row = 16 * 4  # bytes of one site's (1, 16) float32 block
  for index, ops, nbytes in ((1, 3, 3 * row), (0, 1, row // 4)):
    taken = taken_collectives(text, {cond: index})
    assert taken.count["reduce"] == 1 + ops and taken.operands["reduce"] == 2 + ops
    assert taken.conditional_count["reduce"] == 0 and taken.conditional_operands["reduce"] == 0
    assert taken.nbytes["reduce"] == 8 + nbytes
    # The ledger's bits of a step tell which branch ran.
    assert match_branches(text, 8 * (8 + nbytes)) == {cond: index}
  with pytest.raises(ValueError, match="no choice of branches"):
    match_branches(text, 8 * (8 + row))
  with pytest.raises(ValueError, match="no conditional"):
    taken_collectives(text, {"nope": 0})
  with pytest.raises(ValueError, match=r"branch index in \[0, 1\]"):
    taken_collectives(text, {cond: 2})


def test_calibrated_model_charges_operands_and_the_sync_branch_once_per_period():
  from dadjax.comm import CommSummary, NetworkModel, TransportFit  # pylint: disable=g-import-not-at-top
  from dadjax.comm import hlo_collectives, taken_collectives  # pylint: disable=g-import-not-at-top
  from dadjax.comm._hlo import collective_ops  # pylint: disable=g-import-not-at-top
  from dadjax.netlab import predicted_comm  # pylint: disable=g-import-not-at-top
  text = _cond_program()
  every = hlo_collectives(text)
  (cond,) = {op.branch[0][0] for op in collective_ops(text) if op.branch}
  model = NetworkModel.calibrated(1e9, 0.01, 4, TransportFit())  # 1 RTT per ring step
  step = 6 * 0.02  # an all-reduce's 2(N-1) ring steps at 1 RTT each, per call
  plain = CommSummary((0,), (0,), (0,), (0,), (0,), 0, 0, 1)
  assert model.step_time(plain, every) == pytest.approx(6 * step)  # every operand of every branch
  assert model.step_time(plain, taken_collectives(text, {cond: 0})) == pytest.approx(3 * step)
  assert NetworkModel(1e9, 0.01, 4).step_time(plain, every) == pytest.approx(5 * 6 * 0.01)  # ops
  # A local-update ledger (H = 10): the conditional operands once per period, all on the sync step.
  local = CommSummary((0,), (0,), (0,), (0,), (0,), 0, 0, 1, peak_reduce_bits=(0,),
                      peak_gather_bits=(0,), exchange_rate=0.1, peak_share=1.0)
  assert model.step_time(local, every) == pytest.approx((2 + 0.1 * 4) * step)
  assert model.peak_step_time(local, every) == pytest.approx(6 * step)
  ledger = {"reduce_bits": 0, "gather_bits": 0, "exchange_rate": 0.1, "peak_share": 1.0,
            "peak_reduce_bits": 0, "peak_gather_bits": 0,
            "ops": {k: dict(v) for k, v in vars(every).items()}}
  pred = predicted_comm(ledger, 1e9, 0.01, 4, TransportFit())
  assert pred["calibrated"] == pytest.approx((2 + 0.1 * 4) * step)
  assert pred["calibrated_peak"] == pytest.approx(6 * step)
  assert pred["textbook"] == pytest.approx((1 + 0.1 * 4) * 6 * 0.01)


def test_period_step_time_weighs_a_sync_step_once_per_period():
  from dadjax.netlab import LabRun  # pylint: disable=g-import-not-at-top
  steps = [9.0] + [1.0 if t % 5 else 6.0 for t in range(2, 12)]  # steps 5 and 10 sync
  run = LabRun(4, 1e8, 0.0, steps, [], [], [], {"exchange_rate": 0.2}, [])
  assert run.period == 5 and run.step_time == pytest.approx((4 * 1.0 + 6.0) / 5)
  assert LabRun(4, 1e8, 0.0, steps, [], [], [], {}, []).step_time == 1.0  # the median
  with pytest.raises(DadjaxError, match="at least 6 steps"):
    LabRun(4, 1e8, 0.0, steps[:4], [], [], [], {}, []).period_step_time(5)


@pytest.mark.multihost
def test_interrupted_cli_run_leaves_nothing_behind():
  import signal  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  import time  # pylint: disable=g-import-not-at-top
  reason = _lab_reason()
  if reason:
    pytest.skip(f"cannot build network namespaces here: {reason}")
  proc = subprocess.Popen([sys.executable, "-m", "dadjax.cli", "netlab", "--sites", "2", "--rate",
                           "20mbit", "--delay", "2ms", "train", "steps=100000"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  mine = f"dxl{proc.pid}"
  try:
    deadline = time.monotonic() + 120
    while not any(n.startswith(mine) for n in _lab.lab_namespaces()):  # the lab is up
      assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
      time.sleep(0.2)
    time.sleep(3)  # the sites are starting
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
  assert proc.returncode == 130, err
  assert "interrupted" in err
  assert not [n for n in _lab.lab_namespaces() if _lab._owner(n, "dxl") == proc.pid]
  assert not [n for n in _lab.lab_links() if _lab._owner(n, "dxl") == proc.pid]
