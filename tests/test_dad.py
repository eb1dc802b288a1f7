"""Tests of dadjax.dad: exact dAD, rank-dAD, auto routes, ledger, state, backends.

Eight CPU devices are simulated (tests/conftest.py). Gradients are compared
through the real train step: one SGD step with learning rate 1 moves the
parameters by exactly minus the synchronized gradient.
"""

import functools

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import dadjax
from dadjax import dad
from dadjax.comm import Bits, bits_const, bits_to_int
from dadjax.extend import tree_bits
from dadjax.models import MLP, GRUClassifier, TransformerBlock
from dadjax.parallel import softmax_cross_entropy

SITES = 8
AXIS = "data"


# -- helpers ------------------------------------------------------------------


def _train(model, tx, batches, backend="vmap", sample=None):
  """Run the train step over ``batches``; returns (state, step)."""
  step = dadjax.make_train_step(model, tx, num_sites=SITES, backend=backend)
  x0 = batches[0]["x"]
  state = step.init(jax.random.key(0), x0[: x0.shape[0] // SITES] if sample is None else sample)
  for batch in batches:
    state, _ = step(state, batch)
  return state, step


def _params(state):
  return dadjax.parallel.unstack_site(state.params)


def _assert_trees_close(a, b, atol=2e-6, rtol=1e-5):
  chex.assert_trees_all_close(a, b, atol=atol, rtol=rtol)


def _dad_vs_allreduce(make, x, y, backend="vmap", steps=2, **dense_kwargs):
  """Params after ``steps`` SGD(1) steps: plain Dense + allreduce vs dAD + synchronize."""
  batches = [{"x": x, "y": y}] * steps
  base, _ = _train(make(nn.Dense), optax.chain(dadjax.allreduce(AXIS), optax.sgd(1.0)), batches,
                   backend)
  model = make(functools.partial(dad.Dense, **dense_kwargs))
  mask = dad.layer_mask(model, x[: x.shape[0] // SITES])
  state, _ = _train(model, optax.chain(dad.synchronize(mask), optax.sgd(1.0)), batches, backend)
  return _params(base), _params(state), state, mask


class _Block(nn.Module):
  """A transformer block on (batch, tokens, d) with a dense head."""

  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x, train=False):
    del train
    h = TransformerBlock(d_model=8, num_heads=2, mlp_dim=16, dense=self.dense, name="block")(x)
    return self.dense(3, name="head")(h.mean(axis=1))


class _Tokens(nn.Module):
  """A per-token layer (rows = batch x tokens) then a head; for ``mode="auto"``."""

  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x, train=False):
    del train
    h = nn.tanh(self.dense(4, name="tokens")(x))  # 3 -> 4 on 16 tokens: all-reduce is cheaper
    return self.dense(3, name="head")(h.mean(axis=1))


def _data(shape, classes=3, seed=0, ints=None):
  rng = np.random.default_rng(seed)
  if ints is not None:
    x = rng.integers(0, ints, shape).astype(np.int32)
  else:
    x = rng.normal(size=shape).astype(np.float32)
  return x, rng.integers(0, classes, shape[0]).astype(np.int32)


def _site_grads(fn):
  """Per-site (A, D) through ``dad.dense`` under vmap-simulated sites.

  Returns a jitted ``run(a, d, state=None)`` with ``a`` (sites, n, d_in) and
  ``d`` (sites, n, d_out); the cotangent fed to the layer output is exactly
  ``d``, so each site's local gradient is ``a^T d``. ``run`` returns the
  (kernel grads, bias grads, new state) stacked per site; the new state is
  ``dad.next_state`` of the state and its cotangent, as the train step makes it.
  """

  def site(a, d, kernel, bias, state):
    _, vjp = jax.vjp(lambda k, b, s: fn(a, k, b, s), kernel, bias, state)
    return vjp(d)

  run = jax.jit(jax.vmap(site, axis_name=AXIS))

  def call(a, d, state=None):
    kernel = jnp.zeros((a.shape[0], a.shape[2], d.shape[2]))
    bias = jnp.zeros((a.shape[0], d.shape[2]))
    gk, gb, ct = run(a, d, kernel, bias, state)
    return gk, gb, None if state is None else dad.next_state(state, ct)

  return call


# -- exact dAD equals the all-reduce gradient ---------------------------------


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_exact_mlp_matches_allreduce_and_ledger(backend):
  x, y = _data((16, 12), classes=5)
  make = lambda dense: MLP(hidden=(10,), num_classes=5, dense=dense)
  ref, got, state, mask = _dad_vs_allreduce(make, x, y, backend=backend)
  _assert_trees_close(ref, got)
  assert all(jax.tree.leaves(mask))  # every MLP parameter is a dAD layer
  # Ledger: rows * (d_in + d_out) * 32 per layer; bias from D costs nothing.
  summary = dadjax.comm_stats(state.opt_state)
  assert summary.bits_per_step == 2 * (12 + 10) * 32 + 2 * (10 + 5) * 32
  assert summary.dense_bits_per_step == (12 * 10 + 10 + 10 * 5 + 5) * 32
  assert summary.updates == 2


@pytest.mark.parametrize("backend", ["vmap", "shard_map"])
def test_exact_gru_matches_allreduce_per_step_capture(backend):
  # The GRU's input-to-hidden layer sees rows = batch x time; the
  # hidden-to-hidden layer runs inside nn.scan and all-gathers per step.
  x, y = _data((16, 5), ints=11)
  make = lambda dense: GRUClassifier(hidden=6, num_classes=3, vocab_size=11, embed_dim=5,
                                     dense=dense)
  ref, got, state, mask = _dad_vs_allreduce(make, x, y, backend=backend)
  _assert_trees_close(ref, got)
  assert mask["embed"]["embedding"] is False and mask["cell"]["hh"]["kernel"] is True
  hh = jax.tree.map(lambda v: np.asarray(v)[0], state.model_state["dad_state"]["cell"]["hh"]["dad"])
  assert float(hh["uses"]) == 5  # one cotangent per time step, summed by scan
  # The float fields are sums over the 5 uses; the int32 counter advanced once per step.
  assert hh["step"].dtype == np.int32 and int(hh["step"]) == 2
  assert int(dad.current_state(hh)["step"]) == 2
  ih_bits = 2 * 5 * (5 + 18) * 32  # rows = 2 sequences x 5 steps
  hh_bits = 5 * 2 * (6 + 18) * 32  # 5 steps x 2 rows
  head_bits = 2 * (6 + 3) * 32
  embed_bits = 11 * 5 * 32  # synchronized by the default all-reduce
  assert dadjax.comm_stats(state.opt_state).bits_per_step == ih_bits + hh_bits + head_bits + embed_bits


def test_exact_transformer_block_matches_allreduce_shard_map():
  x, y = _data((16, 4, 8))
  ref, got, _, mask = _dad_vs_allreduce(_Block, x, y, backend="shard_map")
  _assert_trees_close(ref, got)
  block = mask["block"]
  assert all(block[n]["kernel"] for n in ("query", "key", "value", "out", "mlp_in", "mlp_out"))
  assert not any(jax.tree.leaves(block["ln_attn"])) and not any(jax.tree.leaves(block["ln_mlp"]))


def test_auto_mode_routes_and_matches_allreduce():
  x, y = _data((16, 16, 3))
  model = _Tokens(functools.partial(dad.Dense, mode="auto"))
  # One site: nothing moves, auto compares payloads.
  plan1 = {p.path: p for p in dad.layer_plan(model, x[:2], num_sites=1)}
  assert plan1["tokens"].route == "allreduce" and plan1["tokens"].rows == 32
  assert plan1["head"].route == "gather" and plan1["head"].rows == 2
  assert plan1["head"].gather_bits == 2 * (4 + 3) * 32  # 448 < (4 * 3 + 3) * 32 = 480
  # Eight sites on a ring: the head's gather moves (8-1) 448 > 2 (7/8) 480 bits.
  plan = {p.path: p for p in dad.layer_plan(model, x[:2], num_sites=SITES)}
  assert plan["tokens"].route == "allreduce" and plan["head"].route == "allreduce"
  assert plan["tokens"].reduce_bits == (3 * 4 + 4) * 32
  assert plan["head"].reduce_bits == (4 * 3 + 3) * 32
  # shard_map: the all-reduce route's psum is invariant and must be re-typed varying.
  ref, got, state, _ = _dad_vs_allreduce(_Tokens, x, y, backend="shard_map", mode="auto")
  _assert_trees_close(ref, got)
  total = plan["tokens"].reduce_bits + plan["head"].reduce_bits
  assert dadjax.comm_stats(state.opt_state).bits_per_step == total


def test_auto_picks_allreduce_when_gather_payload_is_smaller_but_wire_larger():
  config = dad.DadConfig(mode="auto")
  rows, d_in, d_out = 4, 16, 16
  gather_payload = dad.layer_bits(dad.DadConfig(mode="exact"), rows, d_in, d_out)[0]
  reduce_payload = (d_in * d_out + d_out) * 32
  assert gather_payload == 4 * 32 * 32 < reduce_payload  # 4096 < 8704
  # ring, N = 8: (8-1) 4096 = 28672 > 2 (7/8) 8704 = 15232 bits on the wire.
  assert dad.layer_route(config, rows, d_in, d_out, num_sites=8) == "allreduce"
  assert dad.layer_bits(config, rows, d_in, d_out, num_sites=8) == (0, reduce_payload)
  # N = 2: 4096 < 8704: the gather is cheaper on the wire too.
  assert dad.layer_route(config, rows, d_in, d_out, num_sites=2) == "gather"
  # The choice follows N gather < 2 reduce: 4 * 4096 = 16384 < 17408 at N = 4.
  assert dad.layer_route(config, rows, d_in, d_out, num_sites=4) == "gather"
  assert dad.layer_route(config, rows, d_in, d_out, num_sites=5) == "allreduce"


def test_replicated_params_shard_map_check_vma():
  """P() params are invariant: the backward pass returns invariant (summed) cotangents."""
  mesh = dadjax.make_mesh(SITES)
  x, y = _data((16, 12), classes=5)

  def grads(model):
    variables = model.init(jax.random.key(0), x[:2])
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k not in ("params", "comm")}

    def site(params, rest, x, y):
      def loss(p):
        logits = model.apply({"params": p, **rest}, x)
        return jax.lax.pmean(softmax_cross_entropy(logits, y), AXIS)
      return jax.grad(loss)(params)

    put = lambda tree, spec: jax.tree.map(
        lambda v: jax.device_put(v, NamedSharding(mesh, spec)), tree)
    run = jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)),
                                out_specs=P(), check_vma=True))
    return run(put(params, P()), put(rest, P()), put(x, P(AXIS)), put(y, P(AXIS)))

  ref = grads(MLP(hidden=(10,), num_classes=5))
  for kwargs in (dict(mode="exact"), dict(mode="rank", rank=4)):  # rank 4 >= 2 rows: exact
    got = grads(MLP(hidden=(10,), num_classes=5, dense=functools.partial(dad.Dense, **kwargs)))
    _assert_trees_close(ref, got)


# -- backends, state, accumulation ----------------------------------------------


@pytest.mark.slow  # suite time; exact dAD's backend agreement runs by default
def test_backends_agree_rank_dad_with_state():
  x, y = _data((32, 12), classes=5)
  dense = functools.partial(dad.Dense, mode="rank", rank=2, warm_start=True, error_feedback=True)
  model = MLP(hidden=(10,), num_classes=5, dense=dense)
  mask = dad.layer_mask(model, x[:4])
  batches = [{"x": x, "y": y}, {"x": x[::-1].copy(), "y": y[::-1].copy()}]
  results = {}
  for backend in ("shard_map", "pmap", "vmap"):
    tx = optax.chain(dad.synchronize(mask), optax.sgd(0.5))
    state, _ = _train(model, tx, batches, backend)
    results[backend] = state
  ref = results["vmap"]
  for backend in ("shard_map", "pmap"):
    _assert_trees_close(_params(ref), _params(results[backend]))
    chex.assert_trees_all_close(jax.device_get(ref.model_state),
                                jax.device_get(results[backend].model_state), atol=1e-5)
    assert (dadjax.comm_stats(ref.opt_state).total
            == dadjax.comm_stats(results[backend].opt_state).total)
  ranks = dad.effective_ranks(ref.model_state)
  assert set(ranks) == {"hidden_0", "head"}
  for r in ranks.values():
    assert r.shape == (SITES,) and np.all((r >= 1) & (r <= 2))
  state = jax.tree.map(lambda v: np.asarray(v)[0], ref.model_state["dad_state"]["head"]["dad"])
  assert np.abs(state["memory"]).max() > 0 and np.abs(state["basis"]).max() > 0
  # rank r one-way: r (d_in + d_out) factors + d_out bias sums, per layer.
  per_step = (2 * (12 + 10) + 10) * 32 + (2 * (10 + 5) + 5) * 32
  assert dadjax.comm_stats(ref.opt_state).total == 2 * per_step


def test_gradient_accumulation_equals_big_batch():
  k, b = 2, 3
  x, y = _data((SITES * k * b, 12), classes=5)
  xs, ys = x.reshape(SITES, k, b, 12), y.reshape(SITES, k, b)
  micro = [{"x": xs[:, i].reshape(-1, 12), "y": ys[:, i].reshape(-1)} for i in range(k)]
  model = MLP(hidden=(10,), num_classes=5, dense=dad.Dense)
  mask = dad.layer_mask(model, x[:b])
  big, _ = _train(model, optax.chain(dad.synchronize(mask), optax.sgd(1.0)),
                  [{"x": x, "y": y}])
  tx = optax.chain(
      dad.model_ledger(),
      dadjax.accumulate(optax.chain(dad.synchronize(mask, record_model_comm=False),
                                    optax.sgd(1.0)), k))  # the step refuses optax.MultiSteps
  acc, _ = _train(model, tx, micro, sample=x[:b])
  _assert_trees_close(_params(big), _params(acc))
  # Every microbatch gathered its rows: k * b rows' worth in total, as the big batch.
  assert dadjax.comm_stats(acc.opt_state).total == dadjax.comm_stats(big.opt_state).total


# -- rank-dAD numerics (functional API, vmap-simulated sites) ---------------------


def _random_rows(n=4, d_in=12, d_out=10, seed=0):
  rng = np.random.default_rng(seed)
  a = rng.normal(size=(SITES, n, d_in)).astype(np.float32)
  d = rng.normal(size=(SITES, n, d_out)).astype(np.float32)
  return jnp.asarray(a), jnp.asarray(d)


def test_rank_error_decreases_and_reaches_exact():
  a, d = _random_rows(n=4)
  exact = np.einsum("sni,sno->io", a, d) / SITES
  errors = []
  for rank in (1, 2, 3, 4):
    fn = functools.partial(dad.dense, axis_name=AXIS, mode="rank", rank=rank, iters=30, tol=0.0)
    gk, gb, _ = _site_grads(lambda a, k, b, s, fn=fn: fn(a, k, b))(a, d)
    gk = np.asarray(gk)
    np.testing.assert_allclose(gk[0], gk[-1], atol=1e-6)  # every site applies the same update
    np.testing.assert_allclose(np.asarray(gb)[0], d.sum(axis=(0, 1)) / SITES, atol=1e-5)  # exact bias
    errors.append(np.linalg.norm(gk[0] - exact) / np.linalg.norm(exact))
  assert all(e1 > e2 for e1, e2 in zip(errors, errors[1:])), errors
  assert errors[-1] < 1e-5, errors  # rank 4 >= rank of every local gradient (4 rows)


def test_two_way_has_rank_at_most_r_and_one_way_more():
  a, d = _random_rows(n=4)
  for aggregation, low, high in (("one_way", 3, 10), ("two_way", 1, 2)):
    fn = functools.partial(dad.dense, axis_name=AXIS, mode="rank", rank=2, iters=20, tol=1e-6,
                           aggregation=aggregation)
    gk, _, _ = _site_grads(lambda a, k, b, s, fn=fn: fn(a, k, b))(a, d)
    gk = np.asarray(gk)
    np.testing.assert_array_equal(gk[0], gk[3])  # two-way: site 0's result is broadcast
    rank = np.linalg.matrix_rank(gk[0], tol=1e-4 * np.linalg.norm(gk[0], 2))
    assert low <= rank <= high, (aggregation, rank)


@pytest.mark.parametrize("aggregation", ["one_way", "two_way"])
def test_error_feedback_memory_accounts_for_every_residual(aggregation):
  # With fixed rows, applied_1 + applied_2 + mean_s(memory_2) = 2 * exact.
  a, d = _random_rows(n=4, seed=1)
  config = dad.DadConfig(axis_name=AXIS, mode="rank", rank=1, iters=5, tol=0.0,
                         aggregation=aggregation, error_feedback=True, warm_start=True)
  state = jax.tree.map(lambda v: jnp.broadcast_to(v, (SITES,) + v.shape),
                       dad.init_state(config, 12, 10))
  run = _site_grads(lambda a, k, b, s: dad.dense(a, k, b, s, config=config))
  exact = np.einsum("sni,sno->io", a, d) / SITES
  applied = 0
  for _ in range(2):
    gk, _, state = run(a, d, state)
    applied = applied + np.asarray(gk)[0]
  memory = np.asarray(jax.vmap(dad.current_state)(state)["memory"]).mean(axis=0)
  np.testing.assert_allclose(applied + memory, 2 * exact, atol=1e-4)
  assert state["step"].dtype == jnp.int32 and np.all(np.asarray(state["step"]) == 2)
  assert np.linalg.norm(memory) > 1e-3  # rank 1 of a rank-4 gradient leaves a residual


def test_zero_gradient_gives_no_nan_and_rank_zero():
  a, d = _random_rows(n=4)
  config = dad.DadConfig(axis_name=AXIS, mode="rank", rank=3, aggregation="two_way",
                         warm_start=True, error_feedback=True)
  state = jax.tree.map(lambda v: jnp.broadcast_to(v, (SITES,) + v.shape),
                       dad.init_state(config, 12, 10))
  run = _site_grads(lambda a, k, b, s: dad.dense(a, k, b, s, config=config))
  for zero_a, zero_d in ((True, False), (False, True)):
    aa = jnp.zeros_like(a) if zero_a else a
    dd = jnp.zeros_like(d) if zero_d else d
    gk, gb, new = run(aa, dd, state)
    for leaf in jax.tree.leaves((gk, gb, new)):
      assert np.all(np.isfinite(np.asarray(leaf)))
    np.testing.assert_array_equal(np.asarray(gk), 0)
    assert np.all(np.asarray(new["rank"]) == 0) and np.all(np.asarray(new["rank_global"]) == 0)


def test_factorize_structured_matches_dense_routes():
  rng = np.random.default_rng(3)
  a = jnp.asarray(rng.normal(size=(5, 30)).astype(np.float32))
  d = jnp.asarray(rng.normal(size=(5, 7)).astype(np.float32))
  g = np.asarray(a.T @ d)
  assert dad.product_route(5, 30, 7, 40, memory=False) == "gram"  # rows < d_in: never form G
  run = jax.jit(dad.factorize, static_argnames=("rank", "iters", "tol"))
  fac = run(a, d, rank=7, iters=30, tol=0.0, key=jax.random.key(0))
  assert int(fac.rank) == 5  # 5 rows: rank 5, the rest masked
  np.testing.assert_allclose(np.asarray(fac.u @ fac.v.T), g, atol=1e-4)
  s = np.linalg.svd(g, compute_uv=False)
  np.testing.assert_allclose(np.asarray(fac.sigma[:5]), s[:5], rtol=1e-3)
  early = run(a, d, rank=2, iters=50, tol=1e-2, key=jax.random.key(0))
  assert np.all(np.asarray(early.iterations) < 50)  # converged components stop early


# -- capture, ledger plumbing, validation ---------------------------------------------


def test_capture_exposes_rows_and_deltas():
  x, y = _data((6, 5))
  model = MLP(hidden=(4,), num_classes=3,
              dense=functools.partial(dad.Dense, axis_name=None, capture=True))
  variables = model.init(jax.random.key(0), x)

  def loss(params, perturbations):
    logits, inter = model.apply({**variables, "params": params, "perturbations": perturbations},
                                x, mutable=["intermediates"])
    return softmax_cross_entropy(logits, y), inter

  (_, inter), (g, deltas) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
      variables["params"], variables["perturbations"])
  a = inter["intermediates"]["head"]["inputs"][0]
  dl = deltas["head"]["outputs"]
  np.testing.assert_allclose(np.asarray(a.T @ dl), np.asarray(g["head"]["kernel"]), atol=1e-6)
  np.testing.assert_allclose(np.asarray(dl.sum(0)), np.asarray(g["head"]["bias"]), atol=1e-6)
  np.testing.assert_allclose(np.asarray(inter["intermediates"]["hidden_0"]["inputs"][0]), x)


def test_sown_bits_match_formulas_for_every_route():
  x = jnp.ones((3, 6))  # 3 rows, d_in 6, d_out 5
  cases = [  # (layer options, gather bits, reduce bits)
      (dict(mode="exact"), 3 * (6 + 5) * 32, 0),
      (dict(mode="rank", rank=2), (2 * (6 + 5) + 5) * 32, 0),
      (dict(mode="rank", rank=2, aggregation="two_way"), (2 * (6 + 5) + 5) * 32, 2 * (6 + 5) * 32),
      (dict(mode="auto"), 3 * (6 + 5) * 32, 0),  # 3 (6 + 5) = 33 < 6 * 5 + 5 = 35
      (dict(mode="local"), 0, 0),
  ]
  for kwargs, gather, reduce in cases:
    layer = dad.Dense(5, **kwargs)
    variables = layer.init(jax.random.key(0), x)
    variables.pop("comm", None)  # init sows too; apply would append to it
    _, sown = layer.apply(variables, x, mutable=["comm"])
    comm = sown.get("comm", {})
    got_g = bits_to_int(tree_bits(comm.get("gather_bits", ())))
    got_r = bits_to_int(tree_bits(comm.get("reduce_bits", ())))
    assert (got_g, got_r) == (gather, reduce), kwargs
    assert ("dad_state" in variables) == (kwargs["mode"] != "local")
  # The ledger splits a tree of sown bits by name; a summed Bits counts as gather.
  comm = {"a": {"gather_bits": (bits_const(7),)}, "b": {"reduce_bits": (bits_const(5),)}}
  tx = dad.synchronize({"w": True}, axis_name=None)
  st = tx.init({"w": jnp.zeros(3)})
  _, st = tx.update({"w": jnp.ones(3)}, st, model_comm=comm)
  assert (bits_to_int(st.comm.step_gather), bits_to_int(st.comm.step_reduce)) == (7, 5)
  # one call per sown count
  assert int(st.comm.step_reduce_calls) + int(st.comm.step_gather_calls) == 2
  _, st = tx.update({"w": jnp.ones(3)}, st, model_comm=bits_const(12))
  assert (bits_to_int(st.comm.step_gather), bits_to_int(st.comm.step_reduce)) == (12, 0)
  assert bits_to_int(st.comm.total_sent) == 24 and bits_to_int(st.comm.step_dense) == 96
  assert isinstance(tree_bits(comm), Bits)


def test_local_mode_is_synchronized_by_other():
  x, y = _data((16, 12), classes=5)
  make = lambda dense: MLP(hidden=(10,), num_classes=5, dense=dense)
  ref, got, state, mask = _dad_vs_allreduce(make, x, y, steps=1, mode="local")
  assert not any(jax.tree.leaves(mask))  # nothing is left unsynchronized
  _assert_trees_close(ref, got)
  assert dadjax.comm_stats(state.opt_state).bits_per_step == (12 * 10 + 10 + 10 * 5 + 5) * 32


@pytest.mark.parametrize("kwargs,name", [
    (dict(rank=0), "rank"), (dict(iters=0), "iters"), (dict(tol=-1e-3), "tol"),
    (dict(mode="fast"), "mode"), (dict(aggregation="three_way"), "aggregation"),
    (dict(rank=2.0), "rank"), (dict(warm_start=True), "warm_start"),
    (dict(mode="exact", error_feedback=True), "error_feedback"), (dict(axis_name=3), "axis_name"),
])
def test_bad_arguments_raise_at_construction(kwargs, name):
  with pytest.raises(ValueError, match=name):
    dad.Dense(4, **kwargs)
  with pytest.raises(ValueError, match=name):
    dad.DadConfig(**kwargs)


def test_dense_drop_in_for_flax_dense():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 5)).astype(np.float32))
  ref = nn.Dense(4, name="d")
  ours = dad.Dense(4, name="d", axis_name=None)
  v_ref = ref.init(jax.random.key(1), x)
  v_ours = ours.init(jax.random.key(1), x)
  chex.assert_trees_all_close(v_ref["params"], v_ours["params"])
  np.testing.assert_allclose(ours.apply(v_ours, x), ref.apply(v_ref, x), atol=1e-6)
  # Evaluation with params only: no dad_state needed.
  np.testing.assert_allclose(ours.apply({"params": v_ours["params"]}, x), ref.apply(v_ref, x),
                             atol=1e-6)
  with pytest.raises(ValueError, match="state"):
    dad.dense(x, v_ours["params"]["kernel"], mode="rank", warm_start=True)


def test_method_specs_give_factory_and_mask():
  assert dad.is_method("dad") and dad.is_method("rank_dad:4:two_way")
  assert not dad.is_method("powersgd:2") and not dad.is_method("allreduce")
  tx, dense = dad.get_method("rank_dad:3:two_way:warm:ef", seed=5)
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  assert dense.options == dict(axis_name=AXIS, seed=5, mode="rank", rank=3,
                               aggregation="two_way", warm_start=True, error_feedback=True)
  x = np.zeros((2, 5), np.int32)
  model = GRUClassifier(hidden=4, num_classes=3, vocab_size=7, embed_dim=3, dense=dense)
  with pytest.raises(ValueError, match="initialize"):
    dense.mask({})
  params = model.init(jax.random.key(0), x)["params"]
  assert dense.mask(params) == dad.layer_mask(model, x)
  assert dense.mask(params)["embed"]["embedding"] is False
  for spec, name in (("rank_dad:x", "RANK"), ("rank_dad:0", "rank"), ("dadd", "unknown"),
                     ("rank_dad:2:fast", "flag")):
    with pytest.raises(ValueError, match=name):
      dad.get_method(spec)



# -- GRU with stack_time_rows: one hh call over batch x time rows -----------------


def _gru(dense, stack_time_rows=True):
  return GRUClassifier(hidden=6, num_classes=3, vocab_size=11, embed_dim=5, dense=dense,
                       stack_time_rows=stack_time_rows)


def _hh_entries(model, x):
  """Shapes of the bits ``cell/hh`` sows in one forward pass (nothing is computed)."""
  variables = jax.eval_shape(model.init, jax.random.key(0), x)
  variables.pop("comm", None)
  _, sown = jax.eval_shape(lambda v: model.apply(v, x, mutable=["comm"]), variables)
  return [b.lo.shape for b in sown["comm"]["cell"]["hh"]["gather_bits"]]


def test_exact_gru_stack_time_rows_matches_allreduce_one_call():
  # The dAD paper's layout: hh's rows carry the time axis, one backward for
  # all 2 x 5 rows per site (one all-gather instead of 5).
  x, y = _data((16, 5), ints=11)
  ref, got, state, mask = _dad_vs_allreduce(_gru, x, y, backend="shard_map")
  _assert_trees_close(ref, got)
  assert mask["cell"]["hh"]["kernel"] is True and mask["embed"]["embedding"] is False
  hh = jax.tree.map(lambda v: np.asarray(v)[0], state.model_state["dad_state"]["cell"]["hh"]["dad"])
  assert float(hh["uses"]) == 1 and hh["step"].dtype == np.int32 and int(hh["step"]) == 2
  # Same rows as per-step gathering, counted once, in one collective.
  ih_bits = 2 * 5 * (5 + 18) * 32
  hh_bits = 2 * 5 * (6 + 18) * 32  # rows = B x T, one layer call
  head_bits = 2 * (6 + 3) * 32
  embed_bits = 11 * 5 * 32
  assert dadjax.comm_stats(state.opt_state).bits_per_step == ih_bits + hh_bits + head_bits + embed_bits
  assert _hh_entries(_gru(dad.Dense), x[:2]) == [()]  # one call, no time axis
  assert _hh_entries(_gru(dad.Dense, stack_time_rows=False), x[:2]) == [(5,)]  # one per step
  (plan,) = [p for p in dad.layer_plan(_gru(dad.Dense), x[:2]) if p.path == "cell/hh"]
  assert plan.rows == 2 * 5 and plan.gather_bits == hh_bits


def _site_model_grads(make, x, y, params):
  """Per-site gradients (vmap-simulated sites) and the bits each site sowed."""

  def site(x, y):
    def loss(p):
      logits, sown = make().apply({"params": p}, x, mutable=["comm"])
      return softmax_cross_entropy(logits, y), tree_bits(sown)
    return jax.grad(loss, has_aux=True)(params)

  return jax.jit(jax.vmap(site, axis_name=AXIS))(x.reshape(SITES, -1, *x.shape[1:]),
                                                 y.reshape(SITES, -1))


def test_rank_gru_stack_time_rows_factorizes_once_and_converges():
  x, y = _data((16, 5), ints=11)
  params = _gru(nn.Dense).init(jax.random.key(0), x[:2])["params"]
  ref, _ = _site_model_grads(lambda: _gru(nn.Dense), x, y, params)
  exact = np.asarray(ref["cell"]["hh"]["kernel"]).mean(axis=0)  # the all-reduce gradient
  errors = []
  for rank in (1, 2, 6):  # local hh gradient: 10 rows of d_in 6, rank <= 6
    def dense(features, name=None, rank=rank, **kwargs):  # rank-dAD on hh only (fast compile)
      mode = dict(mode="rank", rank=rank, iters=30, tol=0.0) if name == "hh" else dict(mode="local")
      return dad.Dense(features, name=name, **mode, **kwargs)
    grads, bits = _site_model_grads(lambda: _gru(dense), x, y, params)
    got = np.asarray(grads["cell"]["hh"]["kernel"])
    np.testing.assert_allclose(got[0], got[-1], atol=1e-6)  # every site applies the same update
    errors.append(np.linalg.norm(got[0] - exact) / np.linalg.norm(exact))
    # One factorization of sum_t A_t^T D_t, sent once (not 5 times): r (6 + 18) + 18 bias sums.
    assert bits_to_int(bits) == [(rank * (6 + 18) + 18) * 32] * SITES
  assert errors[0] > errors[1] > errors[2], errors
  assert errors[-1] < 1e-4, errors
