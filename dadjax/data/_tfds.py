"""TensorFlow Datasets loading into numpy `Dataset`s (no TensorFlow needed).

Data sets prepared in the ``array_record`` file format are read through
``tfds`` random-access data sources, which need neither TensorFlow nor a
network. Data sets prepared as ``tfrecord`` fall back to ``tfds.as_numpy``,
which needs TensorFlow installed.
"""

import re
import zlib
from typing import Iterable, Optional

import numpy as np

from dadjax.data._embedded import Dataset

_TEXT_KEYS = ("text", "sentence", "content", "review")
_INPUT_KEYS = ("image",) + _TEXT_KEYS
_BYTE_VOCAB = 257  # 0 = padding, byte b -> b + 1.
_CHUNK = 1024


def tokenize(texts: Iterable, seq_len: int, vocab_size: Optional[int] = None) -> np.ndarray:
  """Turn strings into fixed-length int32 token ids, 0 being padding.

  Two deterministic tokenizers, no vocabulary file needed:

  * ``vocab_size=None`` (byte level): the UTF-8 bytes ``b`` of each text
    become ids ``b + 1`` in ``[1, 256]`` (vocabulary 257).
  * ``vocab_size=V`` (hashed words): the text is lower-cased and split into
    runs of letters/digits; each word becomes ``1 + crc32(word) % (V - 1)``.

  Sequences are truncated to, or right-padded with 0 up to, ``seq_len``.

  Args:
    texts: iterable of ``str`` or UTF-8 ``bytes``.
    seq_len: output length, >= 1.
    vocab_size: ``None`` for bytes, else the hashed vocabulary size, >= 2.

  Returns:
    int32 array of shape ``(len(texts), seq_len)``.
  """
  if seq_len < 1:
    raise ValueError(f"seq_len must be >= 1, got {seq_len}.")
  if vocab_size is not None and vocab_size < 2:
    raise ValueError(f"vocab_size must be None or >= 2, got {vocab_size}.")
  rows = []
  for t in texts:
    b = t if isinstance(t, bytes) else str(t).encode("utf-8")
    if vocab_size is None:
      ids = np.frombuffer(b[:seq_len], np.uint8).astype(np.int32) + 1
    else:
      words = re.findall(r"\w+", b.decode("utf-8", "replace").lower())
      ids = [1 + zlib.crc32(w.encode()) % (vocab_size - 1) for w in words[:seq_len]]
    row = np.zeros(seq_len, np.int32)
    row[: len(ids)] = ids
    rows.append(row)
  return np.stack(rows) if rows else np.zeros((0, seq_len), np.int32)


def _keys(info):
  """(input key, label key) from supervised_keys, else by feature names."""
  sk = info.supervised_keys
  if sk and len(sk) == 2 and all(isinstance(k, str) for k in sk):
    return sk
  names = list(info.features.keys())
  x_key = next((k for k in _INPUT_KEYS if k in names), None)
  if x_key is None or "label" not in names:
    raise ValueError(
      f"Cannot tell inputs and labels apart in features {names}; "
      "expected supervised_keys or an 'image'/'text' and a 'label' feature."
    )
  return x_key, "label"


def _read_split(builder, split, x_key, y_key, max_examples):
  """Reads one split as (list-like of inputs, int32 labels)."""
  try:
    source = builder.as_data_source(split=split)
  except NotImplementedError:  # tfrecord: sequential read, needs TensorFlow.
    try:
      import tensorflow_datasets as tfds

      ds = builder.as_dataset(split=split, batch_size=-1)
      ex = tfds.as_numpy(ds)
    except ImportError as e:
      raise ValueError(
        f"Data set {builder.name!r} is stored as {builder.info.file_format}; "
        "reading it needs TensorFlow. Install it, or prepare the data set "
        "with file_format='array_record'."
      ) from e
    n = len(ex[y_key]) if max_examples is None else min(max_examples, len(ex[y_key]))
    return list(ex[x_key][:n]), np.asarray(ex[y_key][:n], np.int32)
  n = len(source) if max_examples is None else min(max_examples, len(source))
  xs, ys = [], []
  for start in range(0, n, _CHUNK):
    batch = source.__getitems__(list(range(start, min(start + _CHUNK, n))))
    xs.extend(e[x_key] for e in batch)
    ys.extend(e[y_key] for e in batch)
  return xs, np.asarray(ys, np.int32)


def load_tfds(
  name: str,
  data_dir: Optional[str] = None,
  split_train: str = "train",
  split_test: str = "test",
  max_examples: Optional[int] = None,
  seq_len: Optional[int] = None,
  vocab_size: Optional[int] = None,
  download: bool = False,
) -> Dataset:
  """Loads an (already prepared) TFDS image or text classification data set.

  Image sets (e.g. ``mnist``, ``cifar10``; features ``image``, ``label``)
  become float32 ``(n, H, W, C)`` in [0, 1]. Text sets (e.g.
  ``imdb_reviews``; features ``text``, ``label``) become int32 ids
  ``(n, seq_len)`` via `tokenize`. Examples are taken in stored order (TFDS
  shuffles at preparation time), so ``max_examples`` keeps a prefix.

  Args:
    name: TFDS name, optionally with config/version (``"mnist:3.*.*"``).
    data_dir: TFDS data directory (default: TFDS's, ``~/tensorflow_datasets``).
    split_train: split (or TFDS slice, e.g. ``"train[:10%]"``) for training.
    split_test: split for testing.
    max_examples: if given (>= 1), keep at most this many examples per split.
    seq_len: text only; tokens per sequence, default 256.
    vocab_size: text only; ``None`` for byte-level ids (vocabulary 257), else
      the hashed word vocabulary size.
    download: if True, download and prepare (array_record) when missing;
      needs network access and possibly TensorFlow. Default False.

  Returns:
    A `Dataset` named ``name``.
  """
  if max_examples is not None and max_examples < 1:
    raise ValueError(f"max_examples must be None or >= 1, got {max_examples}.")
  import tensorflow_datasets as tfds

  try:
    builder = tfds.builder(name, data_dir=data_dir)
  except tfds.core.registered.DatasetNotFoundError as e:
    raise ValueError(
      f"Unknown data set name {name!r}: not built in ('digits', 'synthetic', "
      f"'synthetic_seq'), not a TFDS name, and not prepared under "
      f"data_dir={data_dir!r}."
    ) from e
  if not builder.is_prepared():
    if not download:
      raise ValueError(
        f"TFDS data set {name!r} is not prepared under data_dir="
        f"{data_dir!r}; prepare it first (file_format='array_record') or "
        "pass download=True."
      )
    builder.download_and_prepare(file_format="array_record")
  info = builder.info
  x_key, y_key = _keys(info)
  num_classes = int(info.features[y_key].num_classes)
  is_text = x_key in _TEXT_KEYS
  out, vocab = [], None
  for split in (split_train, split_test):
    xs, y = _read_split(builder, split, x_key, y_key, max_examples)
    if is_text:
      x = tokenize(xs, 256 if seq_len is None else seq_len, vocab_size)
      vocab = _BYTE_VOCAB if vocab_size is None else vocab_size
    else:
      x = np.stack(xs)
      if x.ndim == 3:
        x = x[..., None]
      x = x.astype(np.float32) / 255.0 if x.dtype == np.uint8 else x.astype(np.float32)
    out += [x, y]
  return Dataset(*out, num_classes=num_classes, name=name, vocab_size=vocab)
