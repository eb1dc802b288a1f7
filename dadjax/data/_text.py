"""Byte-level text corpora: a deterministic split by file, next-byte windows, LM metrics.

A text corpus is a set of files. `split_files` assigns whole files to the
train, validation and test splits (a seeded permutation of the sorted paths,
cut by the fractions), so no document is seen in two splits. `load_text`
concatenates each split's files into one byte stream and cuts it into
windows of ``seq_len + 1`` bytes: the inputs are a window's first
``seq_len`` bytes, the targets the last ``seq_len`` (the next byte at every
position). The windows are the rows of a `Dataset`, so `partition` and
`SiteBatcher` sample them like any other rows; ``Dataset.groups`` holds the
file of each training window, so ``partition(dataset.groups, n,
"by_class")`` gives every site its own files (the natural non-IID split of
text).

Byte ids are the raw byte values ``0 .. 255`` (vocabulary 256, no padding):
a model that predicts the uniform distribution has a loss of ``ln 256``
nats per byte, i.e. exactly 8 bits per byte.
"""

from __future__ import annotations

import glob as glob_lib
import math
import os
import pathlib
from typing import Dict, List, Optional, Sequence, Tuple, Union

import numpy as np

from dadjax.data._embedded import Dataset
from dadjax.errors import DadjaxError

BYTE_VOCAB = 256
SPLITS = ("train", "validation", "test")
PYTHON_DOCS_GLOB = "/usr/share/doc/python3.11/html/_sources/**/*.txt"
PYTHON_DOCS_PACKAGE = "apt-get install -y python3.11-doc"

PathLike = Union[str, os.PathLike]


def _expand(item: PathLike) -> List[str]:
  text = str(item)
  if any(c in text for c in "*?["):
    return [p for p in glob_lib.glob(text, recursive=True) if os.path.isfile(p)]
  path = pathlib.Path(text)
  if path.is_dir():
    return [str(p) for p in path.rglob("*") if p.is_file()]
  return [text] if path.is_file() else []


def resolve_files(paths_or_glob: Union[PathLike, Sequence[PathLike]]) -> List[str]:
  """The sorted, de-duplicated files named by a glob (``**`` recurses), a
  directory (all files below it), a file, or a sequence of these.

  Raises:
    DadjaxError: nothing matched (the message names the pattern).
  """
  items = [paths_or_glob] if isinstance(paths_or_glob, (str, os.PathLike)) else list(paths_or_glob)
  files = sorted({f for item in items for f in _expand(item)})
  if not files:
    hint = (f"; the Python documentation sources are installed by `{PYTHON_DOCS_PACKAGE}` (as "
            "root; or `make data`)") if any("python3" in str(i) for i in items) else ""
    raise DadjaxError(f"load_text: no files match {[str(i) for i in items]}{hint}")
  return files


def _check_fractions(fractions) -> Tuple[float, float, float]:
  f = tuple(float(v) for v in fractions)
  if len(f) != 3 or min(f) < 0 or not f[0] > 0 or not math.isclose(sum(f), 1.0, abs_tol=1e-6):
    raise DadjaxError(f"fractions must be 3 numbers >= 0 (train > 0) summing to 1, got "
                      f"{tuple(fractions)}")
  return f


def split_files(paths_or_glob: Union[PathLike, Sequence[PathLike]],
                fractions: Sequence[float] = (0.8, 0.1, 0.1),
                seed: int = 0) -> Dict[str, List[str]]:
  """Assigns whole files to the train / validation / test splits.

  The sorted paths are permuted with ``numpy.random.default_rng(seed)``;
  the first ``round(fractions[1] * n)`` files (at least 1 when the
  fraction is > 0) go to validation, the next ones likewise to test, the
  rest to train. Deterministic in the file set and ``seed``.

  Args:
    paths_or_glob: see `resolve_files`.
    fractions: (train, validation, test), each >= 0, train > 0, summing to
      1. Default ``(0.8, 0.1, 0.1)``.
    seed: integer seed of the permutation. Default 0.

  Returns:
    ``{"train": [...], "validation": [...], "test": [...]}``: disjoint
    sorted lists of paths covering every file.

  Raises:
    DadjaxError: no files, bad fractions, or too few files for every split
      with a positive fraction to hold one.
  """
  f = _check_fractions(fractions)
  files = resolve_files(paths_or_glob)
  n = len(files)
  counts = [max(1, round(fi * n)) if fi > 0 else 0 for fi in f[1:]]
  if sum(counts) >= n:
    raise DadjaxError(f"split_files: {n} file(s) cannot fill the splits with fractions {f} "
                      f"(each split with a positive fraction needs a file, train at least one)")
  order = [files[i] for i in np.random.default_rng(seed).permutation(n)]
  val, test = order[:counts[0]], order[counts[0]:counts[0] + counts[1]]
  train = order[counts[0] + counts[1]:]
  return {"train": sorted(train), "validation": sorted(val), "test": sorted(test)}


def text_windows(data: Union[bytes, np.ndarray], seq_len: int,
                 stride: Optional[int] = None) -> Tuple[np.ndarray, np.ndarray]:
  """Cuts a byte stream into next-byte prediction windows.

  Window ``i`` is ``data[i * stride : i * stride + seq_len + 1]``; its inputs
  are the first ``seq_len`` bytes, its targets the last ``seq_len``.

  Args:
    data: ``bytes`` or a 1-D integer array of byte ids.
    seq_len: inputs per window, >= 1.
    stride: bytes between window starts, >= 1; default ``seq_len`` (every
      byte is a target exactly once).

  Returns:
    ``(inputs, targets)``, int32 ``(n, seq_len)`` each with
    ``targets[:, t] == inputs[:, t + 1]``, ``n = (len(data) - seq_len - 1) // stride + 1``
    (0 when the stream is shorter than ``seq_len + 1``). Both are views of
    one ``(n, seq_len + 1)`` array.
  """
  if seq_len < 1:
    raise DadjaxError(f"seq_len must be an int >= 1, got {seq_len!r}")
  stride = seq_len if stride is None else stride
  if stride < 1:
    raise DadjaxError(f"stride must be an int >= 1, got {stride!r}")
  arr = np.frombuffer(data, np.uint8) if isinstance(data, (bytes, bytearray)) else np.asarray(data)
  if arr.ndim != 1:
    raise DadjaxError(f"data must be 1-D, got shape {arr.shape}")
  if len(arr) < seq_len + 1:
    w = np.zeros((0, seq_len + 1), np.int32)
  else:
    w = np.lib.stride_tricks.sliding_window_view(arr, seq_len + 1)[::stride].astype(np.int32)
  return w[:, :-1], w[:, 1:]


def _stream(files: Sequence[str]) -> Tuple[np.ndarray, np.ndarray]:
  """The files' bytes concatenated, and each file's start offset."""
  chunks = [pathlib.Path(p).read_bytes() for p in files]
  starts = np.cumsum([0] + [len(c) for c in chunks[:-1]]).astype(np.int64)
  return np.frombuffer(b"".join(chunks), np.uint8), starts


def _split_windows(files, seq_len, stride, max_windows):
  stream, starts = _stream(files)
  x, y = text_windows(stream, seq_len, stride)
  groups = (np.searchsorted(starts, np.arange(len(x)) * (stride or seq_len), side="right") - 1)
  if max_windows is not None and len(x) > max_windows:
    keep = np.unique(np.linspace(0, len(x) - 1, max_windows).round().astype(np.int64))
    x, y, groups = x[keep], y[keep], groups[keep]
  return x, y, groups.astype(np.int32)


def load_text(paths_or_glob: Union[PathLike, Sequence[PathLike]] = PYTHON_DOCS_GLOB,
              seq_len: int = 128, stride: Optional[int] = None,
              fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0,
              eval_split: str = "test", max_windows: Optional[int] = None,
              max_eval_windows: Optional[int] = None, name: str = "text") -> Dataset:
  """A byte-level language-modelling data set from text files.

  Files are split by `split_files`; each split's files are concatenated in
  sorted order and cut by `text_windows`. Training rows come from the train
  files, the ``x_test``/``y_test`` rows from the ``eval_split`` files.

  Args:
    paths_or_glob: a glob (``**`` recurses), directory, file or a sequence
      of these. Default: the Python 3.11 documentation sources
      (``apt-get install -y python3.11-doc``).
    seq_len: bytes of context per window, >= 1. Default 128.
    stride: bytes between window starts, >= 1; default ``seq_len``.
    fractions: (train, validation, test) fractions of the files.
    seed: seed of the file split. Default 0.
    eval_split: ``"test"`` (default) or ``"validation"``: which held-out
      files fill ``x_test``/``y_test``.
    max_windows: keep at most this many training windows, evenly spaced
      over the stream (>= 1; default all).
    max_eval_windows: likewise for the evaluation windows.
    name: the `Dataset`'s name.

  Returns:
    A `Dataset` with int32 inputs and next-byte targets, both ``(n,
    seq_len)``, ``num_classes = vocab_size = 256``, and ``groups`` (int32
    ``(n_train,)``): the index, into ``split_files(...)["train"]``, of the
    file each training window starts in.

  Raises:
    DadjaxError: no files, bad sizes or fractions, a split without a whole
      window.
  """
  if eval_split not in ("test", "validation"):
    raise DadjaxError(f"eval_split must be 'test' or 'validation', got {eval_split!r}")
  for key, value in (("max_windows", max_windows), ("max_eval_windows", max_eval_windows)):
    if value is not None and value < 1:
      raise DadjaxError(f"{key} must be None or an int >= 1, got {value!r}")
  if seq_len < 1:
    raise DadjaxError(f"seq_len must be an int >= 1, got {seq_len!r}")
  splits = split_files(paths_or_glob, fractions, seed)
  x_tr, y_tr, groups = _split_windows(splits["train"], seq_len, stride, max_windows)
  x_te, y_te, _ = _split_windows(splits[eval_split], seq_len, stride, max_eval_windows)
  for split, x in (("train", x_tr), (eval_split, x_te)):
    if len(x) == 0:
      raise DadjaxError(f"load_text: the {split} files hold fewer than seq_len + 1 = "
                        f"{seq_len + 1} bytes; lower seq_len or add files")
  return Dataset(x_tr, y_tr, x_te, y_te, num_classes=BYTE_VOCAB, name=name,
                 vocab_size=BYTE_VOCAB, groups=groups)


def bits_per_byte(loss_nats):
  """Bits per byte of a byte-level model: its mean cross-entropy in nats per
  byte divided by ``ln 2``. A uniform model over 256 bytes scores 8."""
  return loss_nats / math.log(2.0)


def perplexity(loss_nats):
  """Per-token perplexity ``exp(loss)`` (``2 ** bits_per_byte`` for bytes)."""
  return np.exp(loss_nats)


def language_model_metrics(aux, batch) -> dict:
  """Metrics of next-token prediction, for ``make_train_step(metrics_fn=...)``.

  Reads ``aux["logits"]`` ``(rows, T, vocab)`` and integer targets
  ``batch["y"]`` ``(rows, T)``; returns ``{"accuracy": next-token accuracy,
  "bits_per_byte": mean cross-entropy / ln 2}``, means over every token.
  Both are linear in the tokens, so averaging them over sites and
  evaluation batches is exact (perplexity is not: take ``2 **
  bits_per_byte`` of the mean). Returns ``{}`` when the shapes do not match.
  """
  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp
  import optax
  # pylint: enable=g-import-not-at-top
  logits, y = aux.get("logits") if hasattr(aux, "get") else None, batch.get("y")
  if logits is None or y is None or logits.shape[:-1] != y.shape or y.ndim < 2:
    return {}
  ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
  return {"accuracy": jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32)),
          "bits_per_byte": jnp.mean(ce) / math.log(2.0)}
