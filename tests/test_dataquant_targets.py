"""Data quantization with regression targets of any shape (rows, ...)."""

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import dadjax
from dadjax import dataquant as DQ
from dadjax.parallel import regression_loss

SITES, ROWS, DIM = 8, 4, 6


class Head(nn.Module):
  shape: tuple = (3,)

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(8)(x))
    return nn.Dense(int(np.prod(self.shape)))(h).reshape((x.shape[0],) + self.shape)


def _run(model, tx, stage, y_shape, steps=2):
  step = dadjax.make_train_step(model, optax.chain(tx, optax.sgd(0.2)), batch_stage=stage,
                                loss_fn=regression_loss(model), num_sites=SITES, backend="vmap")
  state = step.init(jax.random.key(0), np.zeros((1, DIM), np.float32))
  rng = np.random.default_rng(0)
  for _ in range(steps):
    batch = {"x": rng.normal(size=(SITES * ROWS, DIM)).astype(np.float32),
             "y": rng.normal(size=(SITES * ROWS,) + y_shape).astype(np.float32)}
    state, metrics = step(state, batch)
  return state, metrics


@pytest.mark.parametrize("y_shape", [(3,), (2, 3)])
def test_exact_rows_with_nd_targets_train_like_allreduce(y_shape):
  model = Head(y_shape)
  ref, ref_metrics = _run(model, dadjax.allreduce("data"), None, y_shape)
  state, metrics = _run(model, optax.identity(), DQ.dataquant(None), y_shape)
  for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(ref.params)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
  np.testing.assert_allclose(metrics["mse"], ref_metrics["mse"], rtol=1e-5)
  # x (rows x 6 fp32) and y (rows x prod(y_shape) fp32) travel as they are.
  sent = dadjax.comm_stats(state).gather_bits[0]
  assert sent == ROWS * (DIM + int(np.prod(y_shape))) * 32


def test_quantized_gated_rows_with_2d_targets_run_and_count_target_bits():
  model = Head((3,))
  state, metrics = _run(model, optax.identity(),
                        DQ.dataquant(4, gate=0.5, gate_mode="sample"), (3,))
  assert np.isfinite(np.asarray(metrics["loss"])).all()
  assert dadjax.comm_stats(state).gather_bits[0] > 0


def test_class_packing_refuses_regression_targets():
  model = Head((3,))
  with pytest.raises(ValueError, match="num_classes=None for regression"):
    _run(model, optax.identity(), DQ.dataquant(4, num_classes=3), (3,), steps=1)
