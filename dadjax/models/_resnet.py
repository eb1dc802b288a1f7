"""CIFAR-style ResNet (BasicBlock)."""

import functools
import math
from typing import Callable, Sequence

import flax.linen as nn
import jax.numpy as jnp

_conv_init = nn.initializers.variance_scaling(2.0, "fan_out", "normal")  # Kaiming


def _norm(kind: str, train: bool, name: str) -> Callable[[jnp.ndarray], jnp.ndarray]:
  """Normalisation layer by name: "group", "batch" or "none"."""
  if kind == "group":

    def apply(x):
      # 32 groups when possible; gcd keeps it valid for any channel count.
      return nn.GroupNorm(num_groups=math.gcd(32, x.shape[-1]), name=name)(x)

    return apply
  if kind == "batch":
    return nn.BatchNorm(use_running_average=not train, momentum=0.9, name=name)
  if kind == "none":
    return lambda x: x
  raise ValueError(f"norm must be 'group', 'batch' or 'none', got {kind!r}")


class BasicBlock(nn.Module):
  """Two 3x3 convs with a residual connection (1x1 conv projection when the
  shape changes).

  Input ``(batch, H, W, C_in)`` -> output ``(batch, H/s, W/s, channels)``.
  """

  channels: int
  strides: int = 1
  norm: str = "group"

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    s = (self.strides, self.strides)
    y = nn.Conv(
      self.channels, (3, 3), s, padding=1, use_bias=False, kernel_init=_conv_init, name="conv1"
    )(x)
    y = nn.relu(_norm(self.norm, train, "norm1")(y))
    y = nn.Conv(
      self.channels, (3, 3), padding=1, use_bias=False, kernel_init=_conv_init, name="conv2"
    )(y)
    y = _norm(self.norm, train, "norm2")(y)
    if x.shape[-1] != self.channels or self.strides != 1:
      x = nn.Conv(
        self.channels, (1, 1), s, use_bias=False, kernel_init=_conv_init, name="shortcut_conv"
      )(x)
      x = _norm(self.norm, train, "shortcut_norm")(x)
    return nn.relu(x + y)


class ResNet(nn.Module):
  """ResNet with BasicBlocks for small (CIFAR-size) images: 3x3 stem conv,
  no max-pool, stages of widths ``width * 2**i`` (stride 2 from stage 2 on),
  global average pool, dense head.

  Input:  images ``(batch, H, W, C)`` (NHWC), e.g. ``(b, 32, 32, 3)``.
  Output: logits ``(batch, num_classes)``.

  Attributes:
    stage_sizes: blocks per stage (default ``(2, 2, 2, 2)`` = ResNet-18).
    width: channels of the stem / first stage (default 64; about 11.17M
      parameters for 10 classes).
    num_classes: number of classes (default 10).
    dense: factory for the (only) dense layer, the head (default
      ``nn.Dense``).
    norm: ``"group"`` (default) -- GroupNorm, so the model is a pure function
      of ``params`` (no mutable state, convenient for data-parallel
      training); ``"batch"`` -- BatchNorm with
      ``use_running_average=not train`` (call ``apply(..., train=True,
      mutable=["batch_stats"])`` when training); ``"none"``.

  Reference: He et al., "Deep Residual Learning for Image Recognition",
  CVPR 2016 (CIFAR variant as in kuangliu/pytorch-cifar); GroupNorm: Wu & He,
  ECCV 2018.
  """

  stage_sizes: Sequence[int] = (2, 2, 2, 2)
  width: int = 64
  num_classes: int = 10
  dense: Callable[..., nn.Module] = nn.Dense
  norm: str = "group"

  @nn.compact
  def __call__(self, x: jnp.ndarray, train: bool = False) -> jnp.ndarray:
    x = nn.Conv(
      self.width, (3, 3), padding=1, use_bias=False, kernel_init=_conv_init, name="stem_conv"
    )(x)
    x = nn.relu(_norm(self.norm, train, "stem_norm")(x))
    for i, n_blocks in enumerate(self.stage_sizes):
      for j in range(n_blocks):
        strides = 2 if i > 0 and j == 0 else 1
        x = BasicBlock(self.width * 2**i, strides, self.norm, name=f"stage{i + 1}_block{j + 1}")(
          x, train
        )
    x = jnp.mean(x, axis=(1, 2))
    return self.dense(self.num_classes, use_bias=True, name="head")(x)


ResNet18 = functools.partial(ResNet, stage_sizes=(2, 2, 2, 2))
