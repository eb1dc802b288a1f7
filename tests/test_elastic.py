"""Elastic DiLoCo: the lighthouse's quorum, and real site processes that are killed and come back."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax.elastic as elastic
import dadjax.local
from dadjax.elastic import _wire

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "elastic_worker.py"
sys.path.insert(0, str(ROOT / "tests"))
import elastic_worker  # noqa: E402  pylint: disable=g-import-not-at-top,wrong-import-position


def _flat(tree) -> np.ndarray:
  return np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])


def _sites_in_threads(address: str, method, steps: int, sites=(0, 1, 2)) -> dict:
  return elastic_worker.in_threads(lambda site: elastic.run_site(
      method, elastic_worker.init_params(), elastic_worker.batch_at, lighthouse=address,
      site=site, steps=steps, log=lambda _: None), sites, timeout_s=120)


def test_every_site_present_equals_pooled_sgd():
  # H = 1, inner SGD, outer sgd(1.0): the outer step applies the mean of the sites' SGD steps,
  # which is SGD on the mean gradient over the three sites' batches (exact up to float order).
  lr, steps = 0.05, 6
  method = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(lr), 1, outer=optax.sgd(1.0))
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, steps)
  params = elastic_worker.init_params()
  grad = jax.jit(jax.grad(elastic_worker.loss_fn))
  for step in range(steps):
    grads = [grad(params, elastic_worker.batch_at(s, step)) for s in range(3)]
    mean = jax.tree.map(lambda *g: sum(g) / 3, *grads)
    params = jax.tree.map(lambda p, g: p - lr * g, params, mean)
  for site, run in runs.items():
    np.testing.assert_allclose(_flat(run.anchor), _flat(params), rtol=2e-5, atol=2e-6)
    assert [r["quorum"] for r in run.rows] == [[0, 1, 2]] * steps, site
  # the payload on the wire: every parameter in fp32, each way
  n = _flat(params).size
  assert all(r["sent_bits"] == r["received_bits"] == 32 * n for r in runs[0].rows)


def test_bf16_payload_halves_the_bits_and_stays_close():
  method = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.05), 1, outer=optax.sgd(1.0),
                                 payload_dtype="bfloat16")
  with elastic.Lighthouse(expected_sites=2, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, 4, sites=(0, 1))
  n = _flat(runs[0].anchor).size
  assert runs[0].rows[0]["sent_bits"] == 16 * n
  np.testing.assert_array_equal(_flat(runs[0].anchor), _flat(runs[1].anchor))


def _anchor_of(method, steps: int) -> np.ndarray:
  """Site 0's final anchor of three sites in threads, flat."""
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    return _flat(_sites_in_threads(lighthouse.address, method, steps)[0].anchor)


def test_topk_at_ratio_one_equals_the_dense_exchange():
  dense = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.adam(1e-2), 2)
  full = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.adam(1e-2), 2, compressor="topk:1.0")
  np.testing.assert_allclose(_anchor_of(full, 6), _anchor_of(dense, 6), rtol=1e-5, atol=1e-6)


def test_error_feedback_topk_sends_its_payload_and_every_site_decodes_the_same_mean():
  method = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.adam(1e-2), 2,
                                 compressor="ef(topk:0.1)")
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, 8)
  n = _flat(runs[0].anchor).size
  for run in runs.values():
    np.testing.assert_array_equal(_flat(run.anchor), _flat(runs[0].anchor))
    for row in run.rows:  # ~10% of the entries as values and indices, under a third of fp32
      assert 0 < row["sent_bits"] < 32 * n / 3
      assert row["received_bits"] == 3 * row["sent_bits"]  # the quorum's payloads
  # each site's memory keeps what it did not send: its own, not zero, not another site's
  memories = [_flat(runs[s].state.codec_state.memory) for s in range(3)]
  assert all(np.abs(m).sum() > 0 for m in memories)
  assert not np.array_equal(memories[0], memories[1])


def test_sparseloco_keeping_every_entry_with_no_decay_is_the_dense_mean():
  loss, inner = elastic_worker.loss_fn, optax.adam(1e-2)
  dense = elastic.ElasticDiLoCo(loss, inner, 2, outer=optax.sgd(1.0))
  full = elastic.sparseloco(loss, inner, 2, k=16, chunk=4, values=None, decay=0.0)
  np.testing.assert_allclose(_anchor_of(full, 6), _anchor_of(dense, 6), rtol=1e-5, atol=1e-6)


def test_sparseloco_sends_a_chunked_payload_and_keeps_a_decaying_memory():
  method = elastic.sparseloco(elastic_worker.loss_fn, optax.adam(1e-2), 2, k=2, chunk=4)
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, 8)
  n = _flat(runs[0].anchor).size
  assert all(0 < r["sent_bits"] < 32 * n / 4 for r in runs[0].rows)  # 2 of 16, 2-bit values
  for run in runs.values():
    np.testing.assert_array_equal(_flat(run.anchor), _flat(runs[0].anchor))
    assert isinstance(run.state.codec_state, elastic.DecayingMemory)
    assert np.abs(_flat(run.state.codec_state.memory)).sum() > 0
  with pytest.raises(ValueError, match="decay must be None or a number in"):
    elastic.sparseloco(elastic_worker.loss_fn, optax.sgd(0.1), 2, decay=1.5)
  with pytest.raises(ValueError, match="decay needs a compressor"):
    elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.1), 2, decay=0.5)


def _local_method_anchor(tx, steps: int, sites: int = 3) -> np.ndarray:
  """Site 0's anchor of the dadjax.local method ``tx`` over ``sites`` vmapped sites."""
  stacked = jax.tree.map(lambda x: jnp.stack([x] * sites), elastic_worker.init_params())
  state = jax.vmap(tx.init)(stacked)
  grad = jax.grad(elastic_worker.loss_fn)

  @jax.jit
  def step(params, state, batch):
    def one(p, s, b):
      updates, s = tx.update(grad(p, b), s, p)
      return optax.apply_updates(p, updates), s
    return jax.vmap(one, axis_name="data")(params, state, batch)

  for i in range(steps):
    batch = jax.tree.map(lambda *b: jnp.stack(b),
                         *[elastic_worker.batch_at(s, i) for s in range(sites)])
    stacked, state = step(stacked, state, batch)
  return _flat(jax.tree.map(lambda a: a[0], state.anchor))


@pytest.mark.parametrize("compressor", [None, "qsgd:8"])
def test_streaming_diloco_with_every_site_present_is_the_local_method(compressor):
  # two fragments of H = 4 (sends at steps 2 and 4 of each period), merged 1 step later, alpha
  # 0.5, Nesterov outer state per fragment. The last round (step 8) is merged at the run's end,
  # so the local method runs one step more: the anchor does not depend on that step.
  outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
  method = elastic.streaming_diloco(elastic_worker.loss_fn, optax.adam(1e-2), 4, fragments=2,
                                    delay=1, alpha=0.5, outer=outer, compressor=compressor)
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, 8)
  rows = runs[0].rows
  assert [(r["round"], r["step"]) for r in rows] == [(0, 2), (1, 4), (2, 6), (3, 8)]
  # a round carries one fragment: the two fragments' payloads make up the model once
  n = _flat(runs[0].anchor).size
  if compressor is None:
    assert rows[0]["sent_bits"] + rows[1]["sent_bits"] == 32 * n
  assert len(runs[0].state.outer_state) == 2
  if compressor is None:  # (a compressor's keys are per site here, per mesh position there)
    local = dadjax.local.streaming_diloco(optax.adam(1e-2), 4, fragments=2, delay=1, alpha=0.5,
                                          outer=outer)
    np.testing.assert_allclose(_flat(runs[0].anchor), _local_method_anchor(local, 9), rtol=1e-5,
                               atol=1e-6)
  for run in runs.values():
    np.testing.assert_array_equal(_flat(run.anchor), _flat(runs[0].anchor))
  with pytest.raises(ValueError, match=r"delay must be an int in \[0, 1\] \(less than the 2 "
                                       r"steps between two sends"):
    elastic.streaming_diloco(elastic_worker.loss_fn, optax.sgd(0.1), 4, fragments=2, delay=2)
  with pytest.raises(ValueError, match=r"alpha must be a number in \[0, 1\]"):
    elastic.streaming_diloco(elastic_worker.loss_fn, optax.sgd(0.1), 4, alpha=1.5)


def test_demo_with_every_site_present_is_the_local_method():
  kwargs = dict(lr=0.01, k=4, chunk=4, decay=0.9)
  method = elastic.demo(elastic_worker.loss_fn, optax.sgd(0.05), **kwargs)
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, method, 5)
  local = dadjax.local.demo(optax.sgd(0.05), **kwargs)
  np.testing.assert_allclose(_flat(runs[0].anchor), _local_method_anchor(local, 5), rtol=1e-5,
                             atol=1e-6)
  n = _flat(runs[0].anchor).size
  assert all(0 < r["sent_bits"] < 32 * n / 2 for r in runs[0].rows)  # 4 of 16 per block
  momenta = [_flat(runs[s].state.codec_state.memory) for s in range(3)]
  assert all(np.abs(m).sum() > 0 for m in momenta) and not np.array_equal(*momenta[:2])
  with pytest.raises(ValueError, match="lr must be a number > 0"):
    elastic.demo(elastic_worker.loss_fn, optax.sgd(0.1), lr=0.0)


def test_a_lost_streaming_site_is_dropped_and_a_restart_joins_between_fragments():
  # threads, not processes: site 2 stops after 9 steps (no leave, no contribution), is dropped
  # after quorum_timeout_s, and a new site 2 joins from a donor's state, at a round boundary of
  # the fragment schedule, while the others train on.
  method = elastic.streaming_diloco(elastic_worker.loss_fn, optax.adam(1e-2), 4, fragments=2,
                                    delay=1)
  runs, errors, lost = {}, [], threading.Event()

  def batch_at(site, step):
    time.sleep(0.02)
    if site == 2 and not lost.is_set() and step == 9:
      lost.set()
      raise KeyboardInterrupt  # the site's program ends here
    return elastic_worker.batch_at(site, step)

  def go(site, key):
    try:
      runs[key] = elastic.run_site(method, elastic_worker.init_params(), batch_at,
                                   lighthouse=address, site=site, steps=80, log=lambda _: None)
    except KeyboardInterrupt:
      pass
    except Exception as e:  # noqa: BLE001 - reraised below
      errors.append(e)

  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=1.0) as lighthouse:
    address = lighthouse.address
    threads = [threading.Thread(target=go, args=(s, s)) for s in (0, 1, 2)]
    for t in threads:
      t.start()
    threads[2].join(60)
    restart = threading.Thread(target=go, args=(2, "2 again"))
    restart.start()
    for t in threads[:2] + [restart]:
      t.join(120)
  assert not errors, errors
  assert 2 not in runs
  quorums = [r["quorum"] for r in runs[0].rows]
  assert [0, 1] in quorums and quorums[-1] == [0, 1, 2]
  joined = [e for e in runs["2 again"].events if "joined at round" in e]
  assert len(joined) == 1
  first = runs["2 again"].rows[0]["round"]
  assert runs["2 again"].rows[0]["step"] == method.every * (first // 2) + (2, 4)[first % 2]
  for run in (runs[1], runs["2 again"]):
    np.testing.assert_array_equal(_flat(run.anchor), _flat(runs[0].anchor))


def test_a_compressor_that_is_not_one_is_refused():
  with pytest.raises(ValueError, match="compressor must be None, a dadjax Compressor"):
    elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.1), 2, compressor=3)


def _contribute(address, site, index, weight, value, out):
  def go():
    reply, arrays, _ = elastic._site._request(
        address, {"kind": "sync", "site": site, "round": index, "weight": weight},
        [np.full(3, value, np.float32)])
    out[site] = (reply, arrays)
  t = threading.Thread(target=go)
  t.start()
  return t


def _join(address, site, alone_round=0):
  return elastic._site._request(address, {"kind": "join", "site": site,
                                          "alone_round": alone_round})[:2]


def test_the_mean_is_weighted_by_the_rows_each_site_trained_on():
  with elastic.Lighthouse(expected_sites=2, quorum_timeout_s=5) as lighthouse:
    for site in (0, 1):
      assert _join(lighthouse.address, site)[0] == {"start": "own", "round": 0}
    out = {}
    for t in [_contribute(lighthouse.address, 0, 0, 1.0, 1.0, out),
              _contribute(lighthouse.address, 1, 0, 3.0, 5.0, out)]:
      t.join(10)
  for site in (0, 1):
    reply, (mean,) = out[site]
    assert reply["status"] == "ok" and reply["quorum"] == [0, 1]
    np.testing.assert_allclose(mean, np.full(3, (1 * 1 + 3 * 5) / 4, np.float32))


def test_a_silent_site_is_dropped_and_a_late_one_is_told_so():
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=0.5) as lighthouse:
    address = lighthouse.address
    for site in (0, 1, 2):
      _join(address, site)
    out = {}
    t0 = time.monotonic()
    first = [_contribute(address, 0, 0, 1.0, 2.0, out), _contribute(address, 1, 0, 1.0, 4.0, out)]
    time.sleep(1.0)  # past quorum_timeout_s: the first round waits start_timeout_s (120 s)
    assert not out  # for the expected sites
    for t in first + [_contribute(address, 2, 0, 1.0, 6.0, out)]:
      t.join(10)
    assert out[0][0]["quorum"] == [0, 1, 2]
    np.testing.assert_allclose(out[0][1][0], np.full(3, 4.0))
    # round 1: site 2 is silent, so after quorum_timeout_s the mean is over sites 0 and 1
    for t in [_contribute(address, 0, 1, 1.0, 2.0, out), _contribute(address, 1, 1, 1.0, 4.0, out)]:
      t.join(10)
    took = time.monotonic() - t0
    assert out[0][0] == {"status": "ok", "round": 1, "quorum": [0, 1], "dropped": [2],
                         "donor": False, "joiners": []}
    np.testing.assert_allclose(out[1][1][0], np.full(3, 3.0))
    assert lighthouse.members == [0, 1] and took < 10
    # site 2's contribution to round 1 comes late: it was dropped and must join again
    _contribute(address, 2, 1, 1.0, 6.0, out).join(10)
    assert out[2][0]["status"] == "dropped" and out[2][1] == []


def test_a_joiner_gets_the_donors_state_and_counts_from_the_next_round():
  with elastic.Lighthouse(expected_sites=1, quorum_timeout_s=5) as lighthouse:
    address = lighthouse.address
    _join(address, 0)
    out = {}
    _contribute(address, 0, 0, 1.0, 1.0, out).join(10)
    joined = {}
    joiner = threading.Thread(target=lambda: joined.update(zip(("reply", "arrays"),
                                                               _join(address, 5))))
    joiner.start()
    time.sleep(0.3)
    assert joiner.is_alive()  # it waits for a round to close and a donor's state
    _contribute(address, 0, 1, 1.0, 1.0, out).join(10)
    assert out[0][0]["donor"] is True and out[0][0]["joiners"] == [5]
    state = [np.arange(4, dtype=np.float32), np.ones((2, 2), np.float32)]
    reply, _, _ = elastic._site._request(address, {"kind": "state", "site": 0, "round": 2,
                                                   "step": 10}, state)
    joiner.join(10)
    assert reply == {"status": "ok"}
    assert joined["reply"] == {"round": 2, "step": 10, "donor": 0, "start": "peer"}
    for got, want in zip(joined["arrays"], state):
      np.testing.assert_array_equal(got, want)
    assert lighthouse.members == [0, 5]


def test_bad_arguments_are_clear_errors():
  with pytest.raises(ValueError, match="expected_sites must be an int >= 1"):
    elastic.Lighthouse(expected_sites=0)
  with pytest.raises(ValueError, match="quorum_timeout_s must be a number > 0"):
    elastic.Lighthouse(quorum_timeout_s=0)
  with pytest.raises(ValueError, match="every must be an int >= 1"):
    elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.1), 0)
  with pytest.raises(ValueError, match="payload_dtype must be one of"):
    elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.1), 1, payload_dtype="int8")
  method = elastic.ElasticDiLoCo(elastic_worker.loss_fn, optax.sgd(0.1), 4)
  with pytest.raises(ValueError, match="steps must be an int >= 0 and a multiple of every = 4"):
    elastic.run_site(method, elastic_worker.init_params(), elastic_worker.batch_at,
                     lighthouse="127.0.0.1:1", site=0, steps=10)
  with pytest.raises(elastic.LighthouseUnreachable, match="did not answer a 'join' request"):
    elastic.run_site(method, elastic_worker.init_params(), elastic_worker.batch_at,
                     lighthouse="127.0.0.1:1", site=0, steps=8)
  with elastic.Lighthouse() as lighthouse:
    _join(lighthouse.address, 0)
    with pytest.raises(RuntimeError, match="weight must be a finite number > 0"):
      elastic._site._request(lighthouse.address, {"kind": "sync", "site": 0, "round": 0,
                                                  "weight": 0.0}, [np.zeros(2, np.float32)])


def test_a_message_that_is_not_ours_is_refused():
  import socket
  a, b = socket.socketpair()
  with a, b:
    a.sendall((1 << 40).to_bytes(8, "big"))
    with pytest.raises(_wire.WireError, match="not a dadjax.elastic message"):
      _wire.recv(b)


# -- real processes ------------------------------------------------------------------------


class Sites:
  """A lighthouse in this process and site processes of tests/elastic_worker.py."""

  def __init__(self, tmp_path, expected: int, *, steps=100, every=5, quorum_timeout_s=4.0,
               step_sleep=0.1):
    self.tmp, self.steps, self.every, self.step_sleep = tmp_path, steps, every, step_sleep
    self.lighthouse = elastic.Lighthouse(expected_sites=expected,
                                         quorum_timeout_s=quorum_timeout_s,
                                         start_timeout_s=120).start()
    self.procs: dict[str, subprocess.Popen] = {}
    self.rows: dict[str, list[dict]] = {}

  def start(self, name: str, site: int, *extra: str) -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), self.lighthouse.address, str(site), "--steps",
         str(self.steps), "--every", str(self.every), "--step-sleep", str(self.step_sleep),
         *extra], stdout=subprocess.PIPE, stderr=open(self.tmp / f"{name}.err", "w"),
        text=True, env=env)
    self.procs[name], self.rows[name] = proc, []
    threading.Thread(target=self._read, args=(name, proc), daemon=True).start()

  def _read(self, name, proc):
    for line in proc.stdout:
      self.rows[name].append(json.loads(line))

  def wait_for_round(self, name: str, index: int, timeout=120) -> None:
    deadline = time.monotonic() + timeout
    while not any(r.get("round", -1) >= index for r in self.rows[name]):
      assert self.procs[name].poll() is None or any("final" in r for r in self.rows[name]), (
          name, self.err(name)[-2000:])
      assert time.monotonic() < deadline, (name, self.rows[name], self.err(name)[-2000:])
      time.sleep(0.05)

  def kill(self, name: str) -> None:
    os.kill(self.procs[name].pid, signal.SIGKILL)
    self.procs[name].wait()

  def finish(self, *names: str, timeout=180) -> dict[str, np.ndarray]:
    finals = {}
    for name in names:
      rc = self.procs[name].wait(timeout=timeout)
      time.sleep(0.1)  # the reader thread's last line
      assert rc == 0, (name, self.err(name)[-3000:])
      (final,) = [r["final"] for r in self.rows[name] if "final" in r]
      finals[name] = np.asarray(final)
    return finals

  def err(self, name: str) -> str:
    return (self.tmp / f"{name}.err").read_text()

  def losses(self, name: str) -> list[float]:
    return [r["loss"] for r in self.rows[name] if "loss" in r]

  def close(self):
    for proc in self.procs.values():
      if proc.poll() is None:
        proc.kill()
        proc.wait()
    self.lighthouse.close()


@pytest.fixture
def sites(tmp_path):
  made = []

  def make(expected, **kwargs):
    made.append(Sites(tmp_path, expected, **kwargs))
    return made[-1]

  yield make
  for s in made:
    s.close()


def _uninterrupted_final_loss(steps: int, every: int) -> float:
  """The three sites' mean last-interval loss with no fault (threads of this process)."""
  with elastic.Lighthouse(expected_sites=3, quorum_timeout_s=30) as lighthouse:
    runs = _sites_in_threads(lighthouse.address, elastic_worker.method(every), steps)
  return float(np.mean([run.rows[-1]["loss"] for run in runs.values()]))


def test_a_killed_site_is_dropped_and_a_restart_rejoins(sites):
  run = sites(3)
  for site in range(3):
    run.start(f"s{site}", site)
  run.wait_for_round("s2", 2)
  time.sleep(0.1)  # mid-interval
  run.kill("s2")
  run.wait_for_round("s0", 3)
  run.start("s2again", 2)  # the same site restarts: it joins from a live site's state
  finals = run.finish("s0", "s1", "s2again")
  # every live site ends on the same anchor
  np.testing.assert_array_equal(finals["s0"], finals["s1"])
  np.testing.assert_array_equal(finals["s0"], finals["s2again"])
  quorums = [r["quorum"] for r in run.rows["s0"] if "quorum" in r]
  assert [0, 1] in quorums and quorums[-1] == [0, 1, 2], quorums
  assert "sites [2] dropped (no contribution in time); the outer mean is over sites [0, 1]" \
      in run.err("s0")
  assert "site 2 joined at round" in run.err("s2again")
  # the restarted site starts where the live ones are, not from step 0
  assert run.rows["s2again"][0]["round"] > 3
  final_loss = float(np.mean([run.losses(n)[-1] for n in ("s0", "s1", "s2again")]))
  reference = _uninterrupted_final_loss(run.steps, run.every)
  assert final_loss < 2 * reference + 0.02, (final_loss, reference)


@pytest.mark.slow  # about 26 s; the kill-and-rejoin process test runs by default
def test_a_loss_during_a_synchronization_and_two_losses_in_a_row(sites):
  run = sites(3)
  run.start("s0", 0)
  run.start("s1", 1, "--die-in-sync", "3")  # sends round 3's pseudo-gradient, then dies
  run.start("s2", 2)
  run.wait_for_round("s0", 4)
  run.kill("s2")  # a second loss, the round after
  finals = run.finish("s0")
  assert finals["s0"].size
  quorums = {r["round"]: r["quorum"] for r in run.rows["s0"] if "quorum" in r}
  assert quorums[3] == [0, 1, 2]  # its contribution arrived: it counts
  assert quorums[max(quorums)] == [0]
  assert run.procs["s1"].wait(timeout=30) == -signal.SIGKILL
  assert run.losses("s0")[-1] < run.losses("s0")[0]


@pytest.mark.slow  # about 25 s
def test_a_join_while_another_leaves(sites):
  # with an error-feedback compressor: the joiner starts its own memory, the donor keeps its
  run = sites(2)
  run.start("s0", 0, "--compressor", "ef(topk:0.1)")
  run.start("s1", 1, "--compressor", "ef(topk:0.1)")
  run.wait_for_round("s0", 2)
  run.kill("s1")
  run.start("s3", 3, "--compressor", "ef(topk:0.1)")  # a new site at the same moment
  finals = run.finish("s0", "s3")
  np.testing.assert_array_equal(finals["s0"], finals["s3"])
  quorums = [r["quorum"] for r in run.rows["s0"] if "quorum" in r]
  assert quorums[-1] == [0, 3], quorums


@pytest.mark.slow  # about 30 s
def test_every_site_lost_resumes_from_a_checkpoint(sites, tmp_path):
  run = sites(2)
  for site in (0, 1):
    run.start(f"s{site}", site, "--checkpoint", str(tmp_path / f"ckpt{site}"))
  run.wait_for_round("s0", 3)
  run.kill("s0")
  run.kill("s1")
  saved = max(r["round"] for r in run.rows["s0"] if "round" in r) + 1
  run.start("s0again", 0, "--checkpoint", str(tmp_path / "ckpt0"))
  run.start("s1again", 1, "--checkpoint", str(tmp_path / "ckpt1"))
  finals = run.finish("s0again", "s1again")
  np.testing.assert_array_equal(finals["s0again"], finals["s1again"])
  errs = run.err("s0again") + run.err("s1again")
  assert "starts alone at round" in errs and "from its checkpoint of round" in errs
  first = min(r["round"] for r in run.rows["s0again"] + run.rows["s1again"] if "round" in r)
  assert saved - 1 <= first <= saved, (first, saved)


def test_the_lighthouse_command_prints_its_address_and_stops_on_sigterm():
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  bad = subprocess.run([sys.executable, "-m", "dadjax.elastic", "--expected-sites", "0"],
                       capture_output=True, text=True, env=env, timeout=60)
  assert bad.returncode == 2
  assert bad.stderr.strip() == "dadjax: error: expected_sites must be an int >= 1, got 0"
  proc = subprocess.Popen([sys.executable, "-m", "dadjax.elastic", "--expected-sites", "1"],
                          stdout=subprocess.PIPE, text=True, env=env)
  try:
    line = proc.stdout.readline()
    assert line.startswith("dadjax: elastic: lighthouse at 127.0.0.1:"), line
    address = line.rsplit(" ", 1)[1].strip()
    assert _join(address, 0)[0] == {"start": "own", "round": 0}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
  finally:
    if proc.poll() is None:
      proc.kill()
