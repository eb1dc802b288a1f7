"""Small convolutional classifier."""

from typing import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp


class CNN(nn.Module):
  """LeNet-style conv net: ``[conv3x3 -> relu -> avgpool2x2] * len(features)``,
  flatten, dense ``hidden`` + relu, dense head.

  Input: images ``(batch, H, W, C)`` (NHWC), e.g. ``(b, 8, 8, 1)`` digits or
  ``(b, 32, 32, 3)`` CIFAR. ``H`` and ``W`` must be divisible by
  ``2 ** len(features)``.

  Output: logits ``(batch, num_classes)``.

  Attributes:
    features: conv channels per stage (default ``(16, 32)``).
    hidden: width of the dense hidden layer (default 64).
    num_classes: number of classes (default 10).
    dense: factory for the dense layers (default ``nn.Dense``); convs are
      always ``nn.Conv``.

  Reference: LeCun et al., "Gradient-based learning applied to document
  recognition", Proc. IEEE 1998.
  """

  features: Sequence[int] = (16, 32)
  hidden: int = 64
  num_classes: int = 10
  dense: Callable[..., nn.Module] = nn.Dense

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    del train
    for i, ch in enumerate(self.features):
      x = nn.Conv(ch, (3, 3), padding="SAME", name=f"conv_{i}")(x)
      x = nn.relu(x)
      x = nn.avg_pool(x, (2, 2), strides=(2, 2))
    x = x.reshape(x.shape[0], -1)
    x = nn.relu(self.dense(self.hidden, use_bias=True, name="hidden")(x))
    return self.dense(self.num_classes, use_bias=True, name="head")(x)
