"""The IDX file format of the MNIST family (MNIST, Fashion-MNIST, KMNIST), gzip or raw.

An IDX file is two zero bytes, a type byte, a byte giving the number of
dimensions ``k``, ``k`` big-endian uint32 sizes, then the values in C order,
big-endian (LeCun et al., http://yann.lecun.com/exdb/mnist/). Files are read
whether or not they are gzip-compressed (told by the gzip magic bytes, not
by the name).
"""

from __future__ import annotations

import gzip
import os
import pathlib
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from dadjax.data._embedded import Dataset
from dadjax.errors import DadjaxError

# type byte -> big-endian numpy dtype
_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
# The four files, in Dataset order; each is looked for with and without ".gz".
_NAMES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
          "t10k-labels-idx1-ubyte")
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_PACKAGE = "apt-get install -y dataset-fashion-mnist"
FASHION_MNIST_CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                         "Sneaker", "Bag", "Ankle boot")

PathLike = Union[str, os.PathLike]


def read_idx(path: PathLike) -> np.ndarray:
  """Reads one IDX file (gzip-compressed or raw) into a numpy array.

  Args:
    path: the file.

  Returns:
    An array of the file's shape and type in native byte order (uint8 for
    MNIST-style images ``(n, 28, 28)`` and labels ``(n,)``).

  Raises:
    DadjaxError: the file is not IDX (bad magic, unknown type byte) or its
      length does not match its header; the message names the file.
  """
  with open(path, "rb") as f:
    raw = f.read()
  if raw[:2] == b"\x1f\x8b":
    raw = gzip.decompress(raw)
  if len(raw) < 4 or raw[:2] != b"\x00\x00":
    raise DadjaxError(f"{str(path)!r} is not an IDX file (it must start with two zero bytes)")
  kind, ndim = raw[2], raw[3]
  if kind not in _TYPES:
    raise DadjaxError(f"{str(path)!r}: unknown IDX type byte 0x{kind:02x}; valid: "
                      f"{', '.join(f'0x{k:02x}' for k in _TYPES)}")
  head = 4 + 4 * ndim
  if len(raw) < head:
    raise DadjaxError(f"{str(path)!r}: truncated IDX header ({ndim} dimensions)")
  shape = tuple(int(s) for s in np.frombuffer(raw, ">u4", ndim, 4))
  dtype = np.dtype(_TYPES[kind])
  expected = head + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  if len(raw) != expected:
    raise DadjaxError(f"{str(path)!r}: IDX header says shape {shape} ({expected} bytes), "
                      f"the file holds {len(raw)} bytes")
  values = np.frombuffer(raw, dtype, offset=head).reshape(shape)
  return values.astype(dtype.newbyteorder("="))


def _find(directory: pathlib.Path, stem: str) -> pathlib.Path:
  for name in (stem + ".gz", stem):
    if (directory / name).is_file():
      return directory / name
  raise FileNotFoundError(str(directory / (stem + "[.gz]")))


def load_idx(directory_or_files: Union[PathLike, Sequence[PathLike], Mapping[str, PathLike]],
             name: str = "idx", num_classes: Optional[int] = None,
             max_examples: Optional[int] = None, pad_to: Optional[int] = None) -> Dataset:
  """Loads an MNIST-style data set (MNIST, Fashion-MNIST, KMNIST, ...) from IDX files.

  Args:
    directory_or_files: a directory holding ``train-images-idx3-ubyte``,
      ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and
      ``t10k-labels-idx1-ubyte`` (each with or without ``.gz``); or the four
      paths in that order (train images, train labels, test images, test
      labels); or a mapping with keys ``x_train``, ``y_train``, ``x_test``,
      ``y_test``.
    name: the `Dataset`'s name. Default ``"idx"``.
    num_classes: number of classes; default ``max(label) + 1`` over both
      splits.
    max_examples: keep at most this many examples of each split (a prefix,
      >= 1); default all.
    pad_to: zero-pad the images (centred) to ``pad_to x pad_to``, e.g. 32 for
      CIFAR-sized models on 28x28 digits; default no padding.

  Returns:
    A `Dataset` with float32 images in [0, 1] shaped ``(n, H, W, 1)`` (uint8
    pixels divided by 255) and int32 labels ``(n,)``.

  Raises:
    DadjaxError: a file is missing or malformed, or images and labels
      disagree in number (the message names the files).
  """
  keys = ("x_train", "y_train", "x_test", "y_test")
  if max_examples is not None and max_examples < 1:
    raise DadjaxError(f"max_examples must be None or an int >= 1, got {max_examples!r}")
  if isinstance(directory_or_files, Mapping):
    missing = sorted(set(keys) - set(directory_or_files))
    if missing:
      raise DadjaxError(f"load_idx: directory_or_files is missing key(s) {missing}; "
                        f"expected {list(keys)}")
    paths = [pathlib.Path(directory_or_files[k]) for k in keys]
  elif isinstance(directory_or_files, (str, os.PathLike)):
    directory = pathlib.Path(directory_or_files)
    if not directory.is_dir():
      raise DadjaxError(f"load_idx: {str(directory)!r} is not a directory")
    try:
      paths = [_find(directory, stem) for stem in _NAMES]
    except FileNotFoundError as e:
      raise DadjaxError(f"load_idx: {e} not found; the directory must hold "
                        f"{', '.join(_NAMES)} (each may end in .gz)") from None
  else:
    paths = [pathlib.Path(p) for p in directory_or_files]
    if len(paths) != 4:
      raise DadjaxError(f"load_idx: directory_or_files must be a directory or 4 files (train "
                        f"images, train labels, test images, test labels), got {len(paths)}")
  for p in paths:
    if not p.is_file():
      raise DadjaxError(f"load_idx: {str(p)!r} not found")
  arrays = [read_idx(p) for p in paths]
  out = []
  for (images, labels), (pi, pl) in zip((arrays[:2], arrays[2:]), (paths[:2], paths[2:])):
    if images.ndim not in (3, 4) or labels.ndim != 1 or len(images) != len(labels):
      raise DadjaxError(f"load_idx: {str(pi)!r} holds shape {images.shape} and {str(pl)!r} "
                        f"shape {labels.shape}; expected (n, H, W) images and (n,) labels")
    images, labels = images[:max_examples], labels[:max_examples]
    x = images.astype(np.float32)
    if images.dtype == np.uint8:
      x /= 255.0
    x = x[..., None] if x.ndim == 3 else x
    if pad_to is not None:
      h, w = x.shape[1:3]
      if pad_to < max(h, w):
        raise DadjaxError(f"pad_to must be >= the image size {h}x{w}, got {pad_to}")
      top, left = (pad_to - h) // 2, (pad_to - w) // 2
      x = np.pad(x, ((0, 0), (top, pad_to - h - top), (left, pad_to - w - left), (0, 0)))
    out += [x, labels.astype(np.int32)]
  k = int(max(out[1].max(initial=0), out[3].max(initial=0))) + 1 if num_classes is None else \
      int(num_classes)
  return Dataset(*out, num_classes=k, name=name)


def load_fashion_mnist(path: Optional[PathLike] = None, max_examples: Optional[int] = None,
                       pad_to: Optional[int] = None) -> Dataset:
  """Fashion-MNIST (Xiao, Rasul & Vollgraf 2017, https://arxiv.org/abs/1708.07747).

  60,000 training and 10,000 test images of 28x28 grey-scale clothing, 10
  classes (:data:`FASHION_MNIST_CLASSES`), 6,000 / 1,000 of each class.
  Debian ships the files: ``apt-get install -y dataset-fashion-mnist``
  (as root) puts them in ``/usr/share/datasets/fashion-mnist/``.

  Args:
    path: directory of the four IDX files (gzip or raw); default
      ``/usr/share/datasets/fashion-mnist``.
    max_examples: keep at most this many examples of each split (a prefix;
      the files are in shuffled order); default all.
    pad_to: zero-pad the images to ``pad_to x pad_to`` (e.g. 32); default 28x28.

  Returns:
    A `Dataset` named ``"fashion_mnist"``: float32 images ``(n, 28, 28, 1)``
    in [0, 1], int32 labels.

  Raises:
    DadjaxError: the directory does not hold the files; the message names
      the ``apt-get`` line that installs them.
  """
  directory = pathlib.Path(FASHION_MNIST_DIR if path is None else path)
  if not all(any((directory / (s + e)).is_file() for e in (".gz", "")) for s in _NAMES):
    raise DadjaxError(f"Fashion-MNIST not found in {str(directory)!r}: install it with "
                      f"`{FASHION_MNIST_PACKAGE}` (as root; or `make data`), or pass the "
                      "directory that holds its four IDX files")
  return load_idx(directory, name="fashion_mnist", num_classes=10, max_examples=max_examples,
                  pad_to=pad_to)
