"""Multi-layer perceptron classifier."""

from typing import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

from dadjax._core.validate import check_real


class MLP(nn.Module):
  """ReLU MLP on flattened inputs.

  Input: ``(batch, ...)`` float array; everything after the batch axis is
  flattened.

  Output: logits ``(batch, num_classes)``.

  Attributes:
    hidden: widths of the hidden layers (default ``(64, 64)``).
    num_classes: number of output classes (default 10).
    dense: factory for every fully-connected layer, called as
      ``dense(features, use_bias=..., name=...)`` (default ``nn.Dense``).
    dropout: dropout rate after every hidden activation, in ``[0, 1)``
      (default 0: none). Active only with ``train=True``; it draws from the
      ``"dropout"`` rng stream.

  Call: ``model.apply(variables, x, train=False)``.

  Reference: Rumelhart, Hinton & Williams, "Learning representations by
  back-propagating errors", Nature 1986.
  """

  hidden: Sequence[int] = (64, 64)
  num_classes: int = 10
  dense: Callable[..., nn.Module] = nn.Dense
  dropout: float = 0.0

  def __post_init__(self):
    check_real("dropout", self.dropout, "[0, 1)")
    super().__post_init__()

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = x.reshape(x.shape[0], -1)
    for i, width in enumerate(self.hidden):
      x = nn.relu(self.dense(width, use_bias=True, name=f"hidden_{i}")(x))
      if self.dropout:
        x = nn.Dropout(self.dropout, deterministic=not train, name=f"dropout_{i}")(x)
    return self.dense(self.num_classes, use_bias=True, name="head")(x)
