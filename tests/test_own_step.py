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
