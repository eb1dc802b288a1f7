"""rank-dAD when the requested rank exceeds what the local gradient can have.

``G = A^T D`` (d_in x d_out, n rows) has rank at most ``min(n, d_in,
d_out)``; asking for more components must give exactly that many, an
exact factorization, and the exact synchronized gradient (a regression head
with 3 outputs at rank 4, one-way and two-way).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dadjax import dad
from dadjax._core.linalg import orthogonalize, project_out

SITES = 8
AXIS = "data"


@pytest.mark.parametrize("n, d_in, d_out, rank", [
    (32, 8, 3, 4),  # full column rank, rank > d_out
    (32, 3, 8, 4),  # rank > d_in
    (2, 8, 8, 4),  # rank > rows
    (16, 5, 5, 8),  # rank > every dimension
])
@pytest.mark.parametrize("method", ["deflated", "block"])
def test_factorize_caps_components_at_the_rank_of_g(n, d_in, d_out, rank, method):
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.normal(size=(n, d_in)), jnp.float32)
  d = jnp.asarray(rng.normal(size=(n, d_out)), jnp.float32)
  fac = dad.factorize(a, d, rank=rank, iters=30, tol=0.0, key=jax.random.key(0), method=method)
  assert fac.u.shape == (d_in, rank) and fac.v.shape == (d_out, rank)
  cap = min(n, d_in, d_out)
  assert int(fac.rank) == cap
  np.testing.assert_array_equal(np.asarray(fac.sigma)[cap:], 0)
  np.testing.assert_array_equal(np.asarray(fac.iterations)[cap:], 0)
  v = np.asarray(fac.v)
  np.testing.assert_allclose(v.T @ v, np.diag([1.0] * cap + [0.0] * (rank - cap)), atol=1e-5)
  g = np.asarray(a.T @ d)
  np.testing.assert_allclose(np.asarray(fac.u @ fac.v.T), g, atol=1e-4 * np.abs(g).max())


def test_factorize_warm_start_inside_the_found_span_falls_back_to_random():
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.normal(size=(20, 6)), jnp.float32)
  d = jnp.asarray(rng.normal(size=(20, 5)), jnp.float32)
  first = dad.factorize(a, d, rank=1, iters=50, tol=0.0, key=jax.random.key(0))
  init = jnp.concatenate([first.v, first.v, first.v], axis=1)  # columns 1, 2 lie in span(col 0)
  fac = dad.factorize(a, d, rank=3, iters=50, tol=0.0, key=jax.random.key(1), init=init)
  assert int(fac.rank) == 3
  s = np.linalg.svd(np.asarray(a.T @ d), compute_uv=False)
  np.testing.assert_allclose(np.asarray(fac.sigma), s[:3], rtol=1e-3)


def test_project_out_drops_vectors_in_the_span_and_is_scale_safe():
  basis = orthogonalize(jnp.asarray(np.random.default_rng(2).normal(size=(4, 4)), jnp.float32))
  inside = basis @ jnp.array([1.0, -2.0, 0.5, 3.0])
  unit, norm = project_out(inside, basis, 3e-4)
  np.testing.assert_array_equal(np.asarray(unit), 0)
  assert float(norm) == 0
  tiny = jnp.array([3e-30, 4e-30, 0.0], jnp.float32)
  unit, norm = project_out(tiny, None, 3e-4)
  np.testing.assert_allclose(np.asarray(unit), [0.6, 0.8, 0.0], rtol=1e-6)
  np.testing.assert_allclose(float(norm), 5e-30, rtol=1e-6)


class _Head(nn.Module):
  """A hidden layer and a 3-output regression head."""

  dense: object = nn.Dense

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(5, name="hidden")(x))
    return self.dense(3, name="head")(h)


@pytest.mark.parametrize("aggregation", ["one_way", "two_way"])
def test_rank_dense_with_three_outputs_at_rank_four_is_exact(aggregation):
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.normal(size=(SITES, 16, 4)), jnp.float32)
  y = jnp.asarray(rng.normal(size=(SITES, 16, 3)), jnp.float32)
  make = functools.partial(dad.Dense, axis_name=AXIS, mode="rank", rank=4, iters=30, tol=0.0,
                           aggregation=aggregation)
  model, plain = _Head(dense=make), _Head()
  variables = model.init(jax.random.key(0), x[0])
  params = variables["params"]

  def site(x, y, state):
    def loss(p, s):
      out = model.apply({"params": p, "dad_state": s}, x)
      return jnp.mean((out - y) ** 2)
    grads, cts = jax.grad(loss, argnums=(0, 1), allow_int=True)(params, state)
    return grads, dad.next_state(state, cts)

  def plain_site(x, y):
    return jax.grad(lambda p: jnp.mean((plain.apply({"params": p}, x) - y) ** 2))(params)

  grads, new_state = jax.jit(jax.vmap(site, in_axes=(0, 0, None), axis_name=AXIS))(
      x, y, variables["dad_state"])
  exact = jax.tree.map(lambda g: g.mean(axis=0), jax.jit(jax.vmap(plain_site))(x, y))
  head = np.asarray(grads["head"]["kernel"])
  np.testing.assert_allclose(head[0], np.asarray(exact["head"]["kernel"]), rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(head[0], head[-1])
  state = jax.vmap(dad.current_state)(new_state["head"]["dad"])
  np.testing.assert_array_equal(np.asarray(state["rank"]), 3)
  if aggregation == "two_way":
    np.testing.assert_array_equal(np.asarray(state["rank_global"]), 3)
