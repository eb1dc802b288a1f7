"""The `Dataset` container and the embedded, network-free digits data set."""

from typing import NamedTuple, Optional

import numpy as np


class Dataset(NamedTuple):
  """A train/test split held in host memory as numpy arrays.

  Attributes:
    x_train: inputs, shape ``(n_train, ...)``. Images are float32 in [0, 1]
      shaped ``(n, H, W, C)``; sequences are int32 token ids shaped ``(n, T)``.
    y_train: int32 labels in ``[0, num_classes)``, shape ``(n_train,)``; for
      language modelling the next-token targets ``(n_train, T)``.
    x_test: inputs, shape ``(n_test, ...)``, same layout as ``x_train``.
    y_test: int32 labels, shape ``(n_test,)``.
    num_classes: number of label classes.
    name: short name of the data set.
    vocab_size: for token data, ids lie in ``[0, vocab_size)``; ``None`` for
      images.
    groups: optional int ``(n_train,)`` group of each training row (e.g. the
      file a text window comes from); when set, the training loop partitions
      by it instead of by ``y_train``. ``None`` (default): by ``y_train``.
  """

  x_train: np.ndarray
  y_train: np.ndarray
  x_test: np.ndarray
  y_test: np.ndarray
  num_classes: int
  name: str
  vocab_size: Optional[int] = None
  groups: Optional[np.ndarray] = None


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> Dataset:
  """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes).

  The data ships inside scikit-learn, so no network or download is needed.

  Args:
    test_fraction: fraction of examples held out for the test split, in
      (0, 1). Default 0.2 (1437 train / 360 test).
    seed: seed of the stratified (per-class proportional) split.

  Returns:
    A `Dataset` with images float32 in [0, 1] shaped ``(n, 8, 8, 1)`` and
    int32 labels.
  """
  if not 0.0 < test_fraction < 1.0:
    raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction}.")
  from sklearn import datasets, model_selection

  raw = datasets.load_digits()
  x = (raw.images / 16.0).astype(np.float32)[..., None]
  y = raw.target.astype(np.int32)
  x_tr, x_te, y_tr, y_te = model_selection.train_test_split(
    x, y, test_size=test_fraction, random_state=seed, stratify=y
  )
  return Dataset(x_tr, y_tr, x_te, y_te, num_classes=10, name="digits")
