"""A local-update variant that is not in the catalog, written here from the family's public steps.

EF-sign DiLoCo: every ``H`` steps each site folds its pseudo-gradient into
an error-feedback memory, sends the scaled sign of it (``||e||_1 / d *
sign(e)`` per tensor, EF-signSGD's compressor), keeps what did not get
through, and an outer Nesterov SGD step applies the sites' average. It
trains through ``make_train_step`` (checked against the same math written
by hand) and through :func:`dadjax.run.train` (what ``dadjax train`` runs) as a
registered method.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import local, registry
from dadjax.run import Config, train
from dadjax.models import MLP

SITES, ROWS, H, INNER_LR, OUTER_LR, MOMENTUM = 2, 16, 2, 0.1, 0.7, 0.9


def ef_sign_diloco(inner, every, *, lr=OUTER_LR, axis_name="data"):
  """The variant: a composition of two public steps, no new flag."""
  return local.local_updates(
      inner, every,
      communicate=local.averaging(dadjax.compress.scaled_sign(), axis_name=axis_name, decay=1.0),
      merge=local.outer_step(optax.sgd(lr, momentum=MOMENTUM, nesterov=True)),
      name="ef_sign_diloco")


def _batch(step):
  rng = np.random.default_rng(step)
  return {"x": rng.normal(size=(ROWS, 6)).astype(np.float32),
          "y": rng.integers(0, 3, ROWS).astype(np.int32)}


def _scaled_sign(x):
  return np.where(x < 0, -1.0, 1.0) * np.abs(x).sum() / x.size


def _reference(model, params, b, steps):
  """The same math by hand: inner SGD per site, EF scaled sign, outer Nesterov, in numpy."""
  def loss(p, x, y):
    logits = model.apply({"params": p}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  grad = jax.jit(jax.grad(loss))
  to_np = lambda t: jax.tree.map(lambda a: np.asarray(a, np.float64), t)
  anchor = to_np(params)
  sites = [anchor] * SITES
  memory = [jax.tree.map(np.zeros_like, anchor)] * SITES
  momentum = jax.tree.map(np.zeros_like, anchor)
  for t in range(1, steps + 1):
    per = ROWS // SITES
    for i in range(SITES):
      g = to_np(grad(jax.tree.map(jnp.float32, sites[i]), b["x"][i * per:(i + 1) * per],
                     b["y"][i * per:(i + 1) * per]))
      sites[i] = jax.tree.map(lambda p, d: p - INNER_LR * d, sites[i], g)
    if t % H:
      continue
    sent = []
    for i in range(SITES):
      e = jax.tree.map(lambda m, a, l: m + (a - l), memory[i], anchor, sites[i])
      sent.append(jax.tree.map(_scaled_sign, e))
      memory[i] = jax.tree.map(lambda m, s: m - s, e, sent[i])
    mean = jax.tree.map(lambda *s: sum(s) / SITES, *sent)
    momentum = jax.tree.map(lambda m, g: g + MOMENTUM * m, momentum, mean)
    anchor = jax.tree.map(lambda a, g, m: a - OUTER_LR * (g + MOMENTUM * m), anchor, mean,
                          momentum)
    sites = [anchor] * SITES
  return anchor, sites


def test_variant_trains_through_make_train_step_and_equals_the_math():
  model = MLP(hidden=(8,), num_classes=3)
  ts = dadjax.make_train_step(model, ef_sign_diloco(optax.sgd(INNER_LR), H), num_sites=SITES,
                              backend="vmap")
  batch = _batch(7)  # one batch again and again: the loss must fall
  state = ts.init(jax.random.key(0), batch["x"][:2])
  start = dadjax.parallel.unstack_site(state.params, 0)
  steps, losses = 4 * H + 1, []  # four synchronizations and one inner step after
  for _ in range(steps):
    state, metrics = ts(state, batch)
    losses.append(float(np.mean(metrics["loss"])))
  assert losses[-1] < 0.8 * losses[0], losses
  anchor, sites = _reference(model, start, batch, steps)
  tol = dict(rtol=2e-5, atol=2e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol),
               dadjax.parallel.unstack_site(state.opt_state.anchor, 0), anchor)
  for i in range(SITES):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol),
                 dadjax.parallel.unstack_site(state.params, i), sites[i])
  # the exchange is the variant's: one fp32 scale and d sign bits per tensor, every H steps
  payload = sum(32 + 32 * -(-x.size // 32) for x in jax.tree.leaves(start))
  assert dadjax.comm_stats(state.opt_state).total == 4 * payload


def _ef_sign_diloco_method(ctx: registry.BuildContext, every: int = 2) -> registry.Method:
  """The variant as a method: it wraps the run's optimizer, as the catalog's local methods do."""
  return registry.Method(tx=None, wrap=lambda inner: ef_sign_diloco(inner, every,
                                                                    axis_name=ctx.axis_name))


@pytest.fixture
def registered():
  """``ef_sign_diloco:H`` in the method catalog for one test (a plugin registers it the same way)."""
  registry.register_method(
      "ef_sign_diloco", registry.Arg("every", int, within="[1, inf)", doc="H: inner steps"),
      family="local", doc="EF scaled sign of the pseudo-gradient, outer Nesterov (test variant)",
  )(_ef_sign_diloco_method)
  yield
  registry.unregister("method", "ef_sign_diloco")


def test_variant_trains_through_dadjax_train(registered):
  del registered
  run = train(Config(method="ef_sign_diloco:2", steps=4, eval_every=2,
                     num_sites=2, backend="vmap", batch_per_site=4,
                     model_kwargs={"hidden": [8]}), progress=False)
  assert run.final["step"] == 4 and run.final["method"] == "ef_sign_diloco:2"
  # two synchronizations of the scaled sign (one scale and the signs per tensor)
  params = jax.tree.leaves(dadjax.parallel.unstack_site(run.state.opt_state.anchor, 0))
  payload = sum(32 + 32 * -(-x.size // 32) for x in params)
  assert dadjax.comm_stats(run.state.opt_state).total == 2 * payload
