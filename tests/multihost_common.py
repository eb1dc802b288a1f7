"""The problem both sides of the multi-host test train on."""
import flax.linen as nn
import numpy as np
import optax

import dadjax

STEPS = 3
# A training run both sides make through dadjax.train (8 sites: one per global device).
TRAIN_CONFIG = dict(num_sites=8, batch_per_site=4, eval_every=2, checkpoint_every=2,
                    model_kwargs={"hidden": [16]}, method="ef_topk:0.5")


class Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = x.reshape(x.shape[0], -1)
    return nn.Dense(10)(nn.tanh(nn.Dense(32)(x)))


def make_problem():
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(64, 8, 8, 1)).astype(np.float32),
              "y": rng.integers(0, 10, 64).astype(np.int32)} for _ in range(STEPS)]
  tx = optax.chain(dadjax.allreduce("data"), optax.sgd(0.05, momentum=0.9))
  return Net(), tx, batches
