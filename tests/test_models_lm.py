"""Language models (decoder-only transformer, LSTM) and the workload-sized image models."""

import functools
import pathlib

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dad
from dadjax.config import Config
from dadjax.data import language_model_metrics
from dadjax.models import CNN, LSTMLM, MLP, TransformerLM, get_model
from dadjax.parallel import classification_loss
from dadjax.train import train

SITES = 8
AXIS = "data"
TINY_LM = dict(num_layers=1, d_model=16, num_heads=2, mlp_dim=32, max_len=16)


def _count(model, x):
  shapes = jax.eval_shape(model.init, jax.random.key(0), x)
  return sum(int(np.prod(v.shape)) for v in jax.tree.leaves(shapes))


def _tokens(shape, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, 256, size=shape), jnp.int32)


@pytest.mark.parametrize("make", [lambda: TransformerLM(**TINY_LM),
                                  lambda: LSTMLM(hidden=12, embed_dim=8, num_layers=2)],
                         ids=["transformer", "lstm"])
def test_lm_shapes_and_causality(make):
  model = make()
  x = _tokens((3, 10))
  params = model.init(jax.random.key(0), x)
  logits = model.apply(params, x)
  assert logits.shape == (3, 10, 256)
  # Changing token 6 changes no logit before position 6, and some logit at or after it.
  changed = model.apply(params, x.at[:, 6].set((x[:, 6] + 1) % 256))
  np.testing.assert_allclose(changed[:, :6], logits[:, :6], atol=1e-6)
  assert float(jnp.abs(changed[:, 6:] - logits[:, 6:]).max()) > 1e-4


def test_lm_rejects_bad_inputs():
  with pytest.raises(ValueError, match="divisible"):
    TransformerLM(d_model=10, num_heads=4)
  model = TransformerLM(**TINY_LM)
  with pytest.raises(ValueError, match="max_len=16"):
    model.init(jax.random.key(0), _tokens((1, 17)))
  with pytest.raises(ValueError, match=r"\(batch, T\)"):
    LSTMLM(hidden=4).init(jax.random.key(0), jnp.zeros((2, 3, 4), jnp.int32))


def test_workload_model_sizes():
  img = jnp.zeros((1, 28, 28, 1))
  assert _count(MLP(hidden=(1024, 1024)), img) == 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 10250
  assert _count(get_model("cnn", 10, features=(32, 64), hidden=256), img) > 800_000
  # embed + pos_embed + 2 blocks (4 x 16,512 + 131,712 + 512) + ln_final + head
  assert _count(TransformerLM(), _tokens((1, 8))) == 32768 + 65536 + 2 * 198272 + 256 + 33024
  assert get_model("transformer_lm", 256, **TINY_LM).num_classes == 256
  assert isinstance(get_model("lstm_lm", 256), LSTMLM)
  assert CNN().features == (16, 32)


def test_classification_loss_is_the_per_token_cross_entropy():
  model = TransformerLM(**TINY_LM)
  x, y = _tokens((4, 8)), _tokens((4, 8), seed=1)
  params = model.init(jax.random.key(0), x)["params"]
  loss, aux = classification_loss(model)(params, {}, {"x": x, "y": y}, None, False)
  logits = model.apply({"params": params}, x)
  want = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
  np.testing.assert_allclose(loss, want, rtol=1e-6)
  metrics = language_model_metrics(aux, {"x": x, "y": y})
  np.testing.assert_allclose(metrics["bits_per_byte"], want / np.log(2), rtol=1e-6)


def _params(state):
  return dadjax.parallel.unstack_site(state.params)


def _run(model, tx, batches, backend):
  step = dadjax.make_train_step(model, tx, num_sites=SITES, backend=backend)
  state = step.init(jax.random.key(0), batches[0]["x"][: batches[0]["x"].shape[0] // SITES])
  for batch in batches:
    state, _ = step(state, batch)
  return state


@pytest.mark.parametrize("backend", ["shard_map", "vmap"])
def test_exact_dad_on_the_transformer_lm_equals_allreduce(backend):
  x, y = _tokens((16, 6)), _tokens((16, 6), seed=1)
  batches = [{"x": x, "y": y}] * 2
  make = lambda dense: TransformerLM(**TINY_LM, dense=dense)
  base = _run(make(nn.Dense), optax.chain(dadjax.allreduce(AXIS), optax.sgd(0.5)), batches,
              backend)
  model = make(dad.Dense)
  mask = dad.layer_mask(model, x[:2])
  block = mask["block_0"]
  assert all(block[n]["kernel"] for n in ("query", "key", "value", "out", "mlp_in", "mlp_out"))
  assert mask["head"]["kernel"] and not any(jax.tree.leaves(mask["embed"]))
  state = _run(model, optax.chain(dad.synchronize(mask), optax.sgd(0.5)), batches, backend)
  chex.assert_trees_all_close(_params(base), _params(state), atol=1e-5, rtol=1e-5)


def test_exact_dad_on_the_lstm_lm_equals_allreduce():
  x, y = _tokens((16, 4)), _tokens((16, 4), seed=1)
  batches = [{"x": x, "y": y}] * 2
  make = lambda dense: LSTMLM(hidden=6, embed_dim=4, dense=dense)
  base = _run(make(nn.Dense), optax.chain(dadjax.allreduce(AXIS), optax.sgd(0.5)), batches,
              "vmap")
  model = make(dad.Dense)
  state = _run(model, optax.chain(dad.synchronize(dad.layer_mask(model, x[:2])), optax.sgd(0.5)),
               batches, "vmap")
  chex.assert_trees_all_close(_params(base), _params(state), atol=1e-5, rtol=1e-5)


def _corpus(root: pathlib.Path) -> str:
  # A learnable corpus: repeated English-like lines, 12 files.
  line = b"the quick brown fox jumps over the lazy dog. "
  for i in range(12):
    (root / f"f{i}.txt").write_bytes(line * (20 + i))
  return str(root / "*.txt")


@pytest.mark.parametrize("model,kwargs", [("transformer_lm", TINY_LM), pytest.param(  # suite time
    "lstm_lm", {"hidden": 32, "embed_dim": 16}, marks=pytest.mark.slow)])
def test_a_few_steps_reduce_the_lm_loss_from_a_config(tmp_path, model, kwargs):
  cfg = Config(dataset="text:" + _corpus(tmp_path), dataset_kwargs={"seq_len": 16},
               model=model, model_kwargs=kwargs, num_sites=2, batch_per_site=8, steps=30,
               eval_every=30, backend="vmap", optimizer="adam", lr=1e-2, partition="by_class")
  run = train(cfg, progress=False)
  final = run.final
  # Untrained: about 8 bits per byte (log2 256); after 30 steps the repeated line is learnt.
  assert final["test_bits_per_byte"] < 5.0 and final["train_bits_per_byte"] < 5.0
  assert final["test_bits_per_byte"] == pytest.approx(final["test_loss"] / np.log(2), rel=1e-5)
  assert 0.0 < final["test_accuracy"] <= 1.0
