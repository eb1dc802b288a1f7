"""Setups the step refuses (each message names the fix), and the once-per-layout ledger check."""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import registry
from dadjax.comm import CommStats, ledger_init, ledger_record
from dadjax.methods import build_method
from helpers import mlp

SITES = 4
ROWS = 4


def _step(tx, backend="shard_map", model=None, **kw):
  return dadjax.make_train_step(model or mlp(), tx, backend=backend, num_sites=SITES, **kw)


# -- optax.MultiSteps: refused, pointing to dadjax.accumulate ------------------------------


@pytest.mark.parametrize("backend", ["shard_map", "pmap", "vmap"])
@pytest.mark.parametrize("spec", ["allreduce", "topk:0.1", "powersgd:2"])
def test_multisteps_around_a_communicating_transformation_is_refused(spec, backend, tiny_batch):
  inner = optax.chain(build_method(spec).tx, optax.sgd(0.1))
  step = _step(optax.MultiSteps(inner, every_k_schedule=4), backend)
  with pytest.raises(ValueError, match=r"MultiSteps.*dadjax\.accumulate\(tx, every_k\)"):
    step.init(jax.random.key(0), tiny_batch["x"][:ROWS])


def test_accumulate_is_the_supported_way_and_books_once_per_optimizer_step(tiny_batch):
  step = _step(dadjax.accumulate(optax.chain(dadjax.allreduce("data"), optax.sgd(0.1)), 2))
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  for _ in range(2):
    state, _ = step(state, tiny_batch)  # the ledger check passes on the first micro-step
  n = sum(int(np.prod(p.shape[1:])) for p in jax.tree.leaves(state.params))
  assert dadjax.comm_stats(state.opt_state).bits_per_step == 32 * n


# -- refusals that name the fix --------------------------------------------------------------


def test_no_communicating_transformation_is_refused_unless_allowed(tiny_batch):
  with pytest.raises(ValueError, match=r"no dadjax communicating transformation.*"
                                       r"dadjax\.allreduce\('data'\).*allow_local=True"):
    _step(optax.adam(1e-3), "vmap").init(jax.random.key(0), tiny_batch["x"][:ROWS])
  step = _step(optax.sgd(0.1), "vmap", allow_local=True)
  state, _ = step(step.init(jax.random.key(0), tiny_batch["x"][:ROWS]), tiny_batch)
  leaf = np.asarray(jax.tree.leaves(state.params)[0])
  assert not np.allclose(leaf[0], leaf[1])  # the sites trained apart, as asked
  one = dadjax.make_train_step(mlp(), optax.sgd(0.1), backend="vmap", num_sites=1)
  one.init(jax.random.key(0), tiny_batch["x"][:ROWS])  # one site needs no communication


def test_a_communicating_transformation_after_a_stateful_one_is_refused(tiny_batch):
  tx = optax.chain(optax.adamw(1e-3), dadjax.compressed(dadjax.powersgd(2)))
  with pytest.raises(ValueError, match=r"\['ScaleByAdamState'.*before its communicating.*"
                                       r"Put the communicating transformation first"):
    _step(tx, "vmap").init(jax.random.key(0), tiny_batch["x"][:ROWS])
  nested = optax.chain(optax.chain(optax.sgd(0.1, momentum=0.9), dadjax.allreduce()))
  with pytest.raises(ValueError, match="Put the communicating transformation first"):
    _step(nested, "vmap").init(jax.random.key(0), tiny_batch["x"][:ROWS])
  # stateless transformations before it (clipping, scaling) are fine
  ok = optax.chain(optax.clip(1.0), dadjax.allreduce(), optax.adam(1e-3))
  _step(ok, "vmap").init(jax.random.key(0), tiny_batch["x"][:ROWS])


def test_a_wrong_axis_name_names_the_steps_axis(tiny_batch):
  step = _step(optax.chain(dadjax.allreduce("batch"), optax.sgd(0.1)), "vmap")
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  with pytest.raises(ValueError, match=r"site axis is 'data'.*dadjax\.allreduce\('data'\)"):
    step(state, tiny_batch)


def test_dad_layers_without_their_synchronization_are_refused(tiny_batch):
  method = build_method("dad")
  model = mlp(dense=method.dense)
  step = _step(optax.chain(dadjax.allreduce("data"), optax.sgd(0.1)), "vmap", model=model)
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  with pytest.raises(ValueError, match=r"communicates in its own backward pass.*"
                                       r"build_method\('dad'\).*method\.optimizer"):
    step(state, tiny_batch)
  good = _step(method.optimizer(optax.sgd(0.1)), "vmap", model=model)
  good(good.init(jax.random.key(0), tiny_batch["x"][:ROWS]), tiny_batch)


# -- the once-per-layout ledger check --------------------------------------------------------


class _SneakyState(NamedTuple):
  comm: CommStats


def _unbooked_allreduce(axis_name="data"):
  """A test-only transformation that all-reduces the gradients and books nothing."""

  def init(params):
    del params
    return _SneakyState(ledger_init())

  def update(updates, state, params=None):
    del params
    mean = jax.lax.pmean(updates, axis_name)
    return mean, _SneakyState(ledger_record(state.comm))

  return optax.GradientTransformation(init, update)


@pytest.mark.parametrize("backend", ["shard_map", "pmap"])
def test_ledger_check_catches_an_unbooked_collective(backend, tiny_batch):
  step = _step(optax.chain(_unbooked_allreduce(), optax.sgd(0.1)), backend)
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  n = sum(int(np.prod(p.shape[1:])) for p in jax.tree.leaves(state.params))
  metrics = 2 * 32  # the step's pmean of loss and accuracy (booked)
  with pytest.raises(ValueError, match=rf"move {32 * n + metrics} bits .* booked {metrics} bits"):
    step(state, tiny_batch)
  quiet = _step(optax.chain(_unbooked_allreduce(), optax.sgd(0.1)), backend, check_ledger=False)
  quiet(quiet.init(jax.random.key(0), tiny_batch["x"][:ROWS]), tiny_batch)  # opted out


@pytest.mark.parametrize("spec", ["allreduce", "topk:0.1", "ef_topk:0.1", "powersgd:2", "dad",
                                  "rank_dad:2", "dataquant:4"])
def test_ledger_check_passes_for_methods(spec, tiny_batch):
  method = build_method(spec)
  model = mlp(dense=method.dense)
  step = _step(method.optimizer(optax.sgd(0.1)), model=model, batch_stage=method.batch_stage)
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  out = step.ledger_check(state, tiny_batch)
  assert out["program_bits"] <= out["booked_bits"]


# the registered entries that need arguments, with one example each
_WITH_ARGS = {"accordion": "accordion(powersgd:2,powersgd:1)",
              "accordion_batch": "accordion_batch(allreduce)", "ef": "ef(topk:0.1)",
              "accordion_rank_dad": "accordion_rank_dad(2,1)"}


def _method_specs():
  return [_WITH_ARGS.get(e.name, e.name) for kind in ("method", "compressor")
          for e in registry.entries(kind)
          if e.name in _WITH_ARGS or not any(a.required for a in e.args)]


@pytest.mark.slow
@pytest.mark.parametrize("spec", _method_specs())
def test_ledger_check_passes_for_every_registered_method(spec, tiny_batch):
  method = build_method(spec, steps_per_epoch=2)
  model = mlp(dense=method.dense)
  step = _step(method.optimizer(optax.sgd(0.1)), model=model, batch_stage=method.batch_stage)
  state = step.init(jax.random.key(0), tiny_batch["x"][:ROWS])
  for _ in range(3):  # the check runs on the first; later steps run the same program
    state, _ = step(state, tiny_batch)
