"""Synthetic, learnable classification tasks of any size (for scaling studies)."""

from typing import Sequence

import numpy as np

from dadjax.data._embedded import Dataset


def _check_sizes(num_train, num_test, num_classes):
  if num_train < 1:
    raise ValueError(f"num_train must be >= 1, got {num_train}.")
  if num_test < 1:
    raise ValueError(f"num_test must be >= 1, got {num_test}.")
  if num_classes < 2:
    raise ValueError(f"num_classes must be >= 2, got {num_classes}.")


def synthetic_classification(
  num_train: int = 4096,
  num_test: int = 1024,
  shape: Sequence[int] = (8, 8, 1),
  num_classes: int = 10,
  seed: int = 0,
  noise: float = 2.0,
) -> Dataset:
  """Gaussian class clusters squashed into [0, 1] images.

  Each class ``c`` has a mean ``mu_c ~ N(0, I)`` over all ``prod(shape)``
  pixels; an example is ``sigmoid(mu_y + noise * eps)`` with ``eps ~ N(0, I)``
  and ``y`` uniform. The task is learnable (nearly linearly separable) and gets
  harder as ``noise`` grows or the number of pixels shrinks. Means, train and
  test sets use independent random streams derived from ``seed``, so the task
  and test set do not change with ``num_train``.

  Args:
    num_train: number of training examples, >= 1. Default 4096.
    num_test: number of test examples, >= 1. Default 1024.
    shape: image shape ``(H, W, C)``. Default ``(8, 8, 1)``.
    num_classes: number of classes, >= 2. Default 10.
    seed: integer seed; outputs are a deterministic function of all arguments.
    noise: standard deviation of the per-pixel noise, >= 0. Default 2.0.

  Returns:
    A `Dataset` with float32 images ``(n, *shape)`` in [0, 1], int32 labels.
  """
  _check_sizes(num_train, num_test, num_classes)
  if noise < 0:
    raise ValueError(f"noise must be >= 0, got {noise}.")
  shape = tuple(int(s) for s in shape)
  if not shape or min(shape) < 1:
    raise ValueError(f"shape must be non-empty with positive sizes, got {shape}.")
  dim = int(np.prod(shape))
  means = np.random.default_rng([seed, 0]).normal(size=(num_classes, dim))

  def draw(n, stream):
    rng = np.random.default_rng([seed, stream])
    y = rng.integers(0, num_classes, size=n)
    z = means[y] + noise * rng.normal(size=(n, dim))
    x = 1.0 / (1.0 + np.exp(-z))
    return x.reshape((n,) + shape).astype(np.float32), y.astype(np.int32)

  x_tr, y_tr = draw(num_train, 1)
  x_te, y_te = draw(num_test, 2)
  return Dataset(x_tr, y_tr, x_te, y_te, num_classes, "synthetic")


def synthetic_sequences(
  num_train: int = 4096,
  num_test: int = 1024,
  seq_len: int = 32,
  vocab_size: int = 32,
  num_classes: int = 4,
  seed: int = 0,
) -> Dataset:
  """Token sequences labelled by which "marker" token occurs most often.

  Tokens ``0 .. num_classes - 1`` are markers. The label of a sequence is
  ``argmax_c count(tokens == c)`` (ties go to the smaller ``c``), an exact,
  order-invariant rule that GRUs and transformers can learn by counting.
  Sequences are drawn uniformly over the vocabulary, then each position is
  replaced by a randomly chosen favoured marker with probability 0.25, which
  keeps classes roughly balanced.

  Args:
    num_train: number of training sequences, >= 1. Default 4096.
    num_test: number of test sequences, >= 1. Default 1024.
    seq_len: tokens per sequence, >= 1. Default 32.
    vocab_size: number of token ids, >= num_classes. Default 32.
    num_classes: number of classes (and markers), >= 2. Default 4.
    seed: integer seed; outputs are a deterministic function of all arguments.

  Returns:
    A `Dataset` with int32 tokens ``(n, seq_len)`` in ``[0, vocab_size)``,
    int32 labels, and ``vocab_size`` set.
  """
  _check_sizes(num_train, num_test, num_classes)
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
  if vocab_size < num_classes:
    raise ValueError(f"vocab_size must be >= num_classes ({num_classes}), got {vocab_size}.")

  def draw(n, stream):
    rng = np.random.default_rng([seed, stream])
    tokens = rng.integers(0, vocab_size, size=(n, seq_len))
    favoured = rng.integers(0, num_classes, size=(n, 1))
    boost = rng.random(size=(n, seq_len)) < 0.25
    tokens = np.where(boost, favoured, tokens)
    counts = (tokens[..., None] == np.arange(num_classes)).sum(axis=1)
    return tokens.astype(np.int32), counts.argmax(axis=1).astype(np.int32)

  x_tr, y_tr = draw(num_train, 1)
  x_te, y_te = draw(num_test, 2)
  return Dataset(x_tr, y_tr, x_te, y_te, num_classes, "synthetic_seq", vocab_size=vocab_size)
