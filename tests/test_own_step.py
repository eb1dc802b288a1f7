"""A user's own ``jax.jit(jax.shard_map(...))`` step with dadjax pieces, no make_train_step.

The step uses ``dadjax.compressed(powersgd(2))`` for the plain layers, dAD
layers (``dadjax.dad.Dense`` and a ``dot_general_cls``) that synchronize
themselves, and reads the ledger with ``dadjax.comm_stats``; it must train
bit for bit like the same method through :func:`dadjax.make_train_step`.
"""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import dadjax
from dadjax import dad
from dadjax.parallel import stack_sites

SITES = 8


class Net(nn.Module):

  @nn.compact
  def __call__(self, x):
    h = nn.relu(dad.Dense(16, name="inp")(x))                     # dAD (exact)
    h = nn.relu(nn.Dense(16, name="mid")(h))                      # PowerSGD
    h = nn.relu(nn.Dense(16, dot_general_cls=dad.DotGeneral, name="gen")(h))  # dAD kernel
    return nn.Dense(3, name="out")(h)                             # PowerSGD


def _method(variables):
  sync = dad.synchronize(dad.layer_mask(variables),
                         other=dadjax.compressed(dadjax.powersgd(2), axis_name="data"))
  return optax.chain(sync, optax.sgd(0.1, momentum=0.9))


def own_step(net, tx, mesh):
  """The user's step: one site's program under shard_map, state stacked per site."""

  def site(state, x, y):
    params, dad_state, opt_state = jax.tree.map(lambda v: v[0], state)

    def loss(p, s):
      logits, sown = net.apply({"params": p, "dad_state": s}, x, mutable=["comm"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), sown["comm"]

    (grads, cts), comm = jax.grad(loss, argnums=(0, 1), has_aux=True, allow_int=True)(
        params, dad_state)
    updates, opt_state = tx.update(grads, opt_state, params, model_comm=comm)
    new = (optax.apply_updates(params, updates), dad.next_state(dad_state, cts), opt_state)
    return jax.tree.map(lambda v: v[None], new)

  return jax.jit(jax.shard_map(site, mesh=mesh, in_specs=(P("data"),) * 3,
                               out_specs=P("data")))


def test_own_shard_map_step_matches_make_train_step_bit_for_bit():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(SITES * 4, 10)).astype(np.float32)
  y = rng.integers(0, 3, SITES * 4).astype(np.int32)
  net = Net()
  variables = net.init(jax.random.key(0), x[:4])
  tx = _method(variables)

  state = stack_sites((variables["params"], variables["dad_state"],
                       tx.init(variables["params"])), SITES)
  step = own_step(net, tx, dadjax.make_mesh(SITES, "data"))
  for _ in range(3):
    state = step(state, x, y)
  params, dad_state, opt_state = state

  ref_step = dadjax.make_train_step(net, tx, backend="shard_map")
  ref = ref_step.init(jax.random.key(0), x[:4])
  for _ in range(3):
    ref, _ = ref_step(ref, {"x": x, "y": y})

  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(dad_state), jax.tree.leaves(ref.model_state["dad_state"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  mine, theirs = dadjax.comm_stats(opt_state), dadjax.comm_stats(ref.opt_state)
  assert mine == theirs and mine.gather_bits[0] > 0 and mine.reduce_bits[0] > 0


# --- A GSPMD step as the flax examples write it, wrapped with dadjax.site_map ----------------


class TPNet(nn.Module):
  """Column- then row-parallel kernels over the mesh's "model" axis."""

  @nn.compact
  def __call__(self, x, train=False):
    del train
    init = nn.initializers.lecun_normal()
    h = nn.relu(nn.Dense(32, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
    h = nn.relu(nn.Dense(16, kernel_init=nn.with_partitioning(init, ("model", None)))(h))
    return nn.Dense(3)(h)


def _gspmd_run(spec, mesh, x, y, steps=3):
  """The user's jit step over NamedSharding state; only the gradient-to-update part is per site."""
  net = TPNet()
  tx = dadjax.build_method(spec).optimizer(optax.sgd(0.1, momentum=0.9))
  variables = net.init(jax.random.key(0), x[:2])
  shardings = nn.get_sharding(variables, mesh)  # the model's own layout (no site axis)
  params = jax.device_put(nn.unbox(variables)["params"], shardings["params"])

  def loss_fn(p, batch):
    logits = net.apply({"params": p}, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

  def site_update(p, opt_state, batch):
    grads = jax.grad(loss_fn)(p, batch)
    return tx.update(grads, opt_state, p)

  site_fn = dadjax.site_map(site_update, mesh)
  batch = {"x": x, "y": y}
  opt_state = site_fn.init(tx.init(params), params, batch)

  @jax.jit
  def train_step(p, opt_state, batch):
    updates, opt_state = site_fn(p, opt_state, batch)
    return optax.apply_updates(p, updates), opt_state

  for _ in range(steps):
    params, opt_state = train_step(params, opt_state, batch)
  return params, opt_state, site_fn


@pytest.mark.parametrize("spec, model_axis", [  # suite time: two of the six run with -m slow
    ("allreduce", 1), ("allreduce", 4), pytest.param("ef(topk:0.01)", 1, marks=pytest.mark.slow),
    ("ef(topk:0.01)", 4), ("powersgd:2", 1), pytest.param("powersgd:2", 4, marks=pytest.mark.slow)])
def test_a_gspmd_step_wrapped_with_site_map_trains_like_make_train_step(spec, model_axis):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(16, 10)).astype(np.float32)
  y = rng.integers(0, 3, 16).astype(np.int32)
  mesh = dadjax.make_mesh(sites=2, inner={"model": model_axis})
  params, opt_state, site_fn = _gspmd_run(spec, mesh, x, y)
  # parameters keep the model's sharding and carry no site axis
  kernel = params["Dense_0"]["kernel"]
  assert kernel.shape == (10, 32)
  if model_axis > 1:
    assert kernel.sharding.spec == P(None, "model")

  ref_step = dadjax.make_train_step(TPNet(), dadjax.build_method(spec).optimizer(
      optax.sgd(0.1, momentum=0.9)), mesh=mesh)
  ref = ref_step.init(jax.random.key(0), x[:2])
  for _ in range(3):
    ref, _ = ref_step(ref, {"x": x, "y": y})
  # bit for bit with whole kernels; tensor-parallel kernels: the two programs' products are
  # split by GSPMD in different orders (the float rounding, no more)
  tol = 0 if model_axis == 1 else 1e-7
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_step.params(ref))):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=tol)
  # only state that differs between sites carries the site axis: the error-feedback memory
  # (EF-TopK's, PowerSGD's), not the momentum, the ledger or PowerSGD's shared Q
  flags = site_fn.per_site[jax.tree.structure(opt_state)]
  per_site = [l for l, f in zip(jax.tree.leaves(opt_state), flags) if f]
  n_params = sum(np.size(l) for l in jax.tree.leaves(params))
  if spec == "allreduce":
    assert not any(flags)
  else:
    assert all(np.shape(l)[0] == 2 for l in per_site)
    assert sum(np.size(l) for l in per_site) >= 2 * (n_params - 32 - 16 - 3)  # kernels' memory
    assert not all(flags)
  assert dadjax.comm_stats(opt_state).total == dadjax.comm_stats(ref.opt_state).total


def test_site_map_refuses_an_optimizer_that_does_not_communicate():
  mesh = dadjax.make_mesh(sites=2, inner={"model": 4})
  tx = optax.sgd(0.1)  # no communicating transformation: each site's update would be its own

  def site_update(p, opt_state, batch):
    return tx.update(jax.tree.map(lambda w: w * batch.mean(), p), opt_state, p)

  site_fn = dadjax.site_map(site_update, mesh)
  params = {"w": np.ones((4, 4), np.float32)}
  batch = np.ones((8, 4), np.float32)
  with pytest.raises(ValueError, match="communicating transformation"):
    site_fn.init(tx.init(params), params, batch)
  with pytest.raises(ValueError, match="site_axis 'sites' is not an axis"):
    dadjax.site_map(site_update, mesh, site_axis="sites")
  with pytest.raises(ValueError, match="call state = site_fn.init"):
    site_fn(params, {"other": 1.0}, batch)
