"""An input pipeline per host on Grain: random-access sources, a process's sites, resume.

The in-memory path (`SiteBatcher` over whole numpy arrays) holds every row
in every process. This pipeline reads rows on demand from a random-access
source (Grain's ``RandomAccessDataSource`` protocol: ``__len__`` and
``__getitem__``):

* `TextSource`: the byte-level corpus of `load_text`, windows of ``T + 1``
  bytes read from the files when asked for (nothing is loaded up front);
* `ArraySource`: in-memory arrays (the demo data sets, any `Dataset`);
* `ArrayRecordSource`: ArrayRecord files (``grain.sources.ArrayRecordDataSource``)
  of examples written by `write_array_record`;
* `TfdsSource`: a tensorflow-datasets split prepared as ``array_record``
  (``builder.as_data_source``), images scaled as `load_tfds` scales them.

`SitePipeline` turns a source into the site-major batches of `SiteBatcher`
-- the same rows in the same order for the same ``(seed, partition)`` -- as
a Grain ``MapDataset`` whose element ``t`` is the batch of step ``t``, read
through Grain's iterator (threads, prefetch). A process builds it for its
own sites only (`process_sites`, or ``TrainStep.local_sites``) and reads
only those sites' rows. Its iterator state (Grain's ``{"next_index": t}``) is
checkpointed with orbax next to the train state through Grain's checkpoint
handler (``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``, one
JSON file per process) and restored exactly.

References:
  Grain, the JAX input pipeline library: https://github.com/google/grain
"""

from __future__ import annotations

import io
import os
import sys
import threading
from typing import Any, Callable, Optional, Sequence

import grain
import numpy as np

from dadjax.data._embedded import Dataset
from dadjax.data._partition import SiteBatcher, partition
from dadjax.data._text import BYTE_VOCAB, _split_windows, resolve_files, split_files
from dadjax.errors import DadjaxError

__all__ = ["ArraySource", "TextSource", "ArrayRecordSource", "TfdsSource", "SitePipeline",
           "text_source", "write_array_record", "process_sites", "grain_pipeline"]


# ----------------------------------------------------------------- sources ---

class ArraySource:
  """Rows of in-memory arrays as a Grain random-access source.

  Args:
    x: inputs, shape ``(n, ...)``.
    y: labels ``(n,)`` or next-token targets ``(n, T)``.

  Element ``i`` is ``{"x": x[i], "y": y[i]}``.
  """

  def __init__(self, x, y):
    if len(x) != len(y):
      raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
    self.x, self.y = x, y

  def __len__(self) -> int:
    return len(self.x)

  def __getitem__(self, i: int) -> dict:
    return {"x": self.x[i], "y": self.y[i]}

  def rows(self, indices: np.ndarray) -> dict:
    """The rows ``indices`` stacked (one gather per array)."""
    return {"x": self.x[indices], "y": self.y[indices]}

  def __repr__(self) -> str:
    return f"ArraySource(n={len(self)}, x={tuple(np.shape(self.x)[1:])})"


class TextSource:
  """Next-byte windows over text files, read from the files on demand.

  The files are one byte stream in the given order (as `load_text`
  concatenates a split); window ``i`` is the ``seq_len + 1`` bytes at
  ``i * stride`` (with ``max_windows``, the ``i``-th of the evenly spaced
  windows `load_text` keeps). Element ``i`` is ``{"x": window[:-1], "y":
  window[1:]}``, int32 -- exactly `load_text`'s training row ``i`` for the
  same files. Only the files' sizes are read up front; a window's bytes are
  read when it is asked for, so the corpus never has to fit in memory.

  Args:
    files: the text files, in stream order.
    seq_len: bytes of context per window, >= 1.
    stride: bytes between window starts, >= 1; default ``seq_len``.
    max_windows: keep at most this many windows, evenly spaced (>= 1;
      default all).

  Attributes:
    groups: int32 ``(len,)``: the index into ``files`` of the file each
      window starts in (`load_text`'s ``Dataset.groups``), for a partition
      by file.
  """

  def __init__(self, files: Sequence[str], seq_len: int, stride: Optional[int] = None,
               max_windows: Optional[int] = None):
    if not isinstance(seq_len, int) or seq_len < 1:
      raise ValueError(f"seq_len must be an int >= 1, got {seq_len!r}")
    stride = seq_len if stride is None else stride
    if not isinstance(stride, int) or stride < 1:
      raise ValueError(f"stride must be an int >= 1, got {stride!r}")
    if max_windows is not None and max_windows < 1:
      raise ValueError(f"max_windows must be None or an int >= 1, got {max_windows!r}")
    self.files = [str(f) for f in files]
    self.seq_len, self.stride = seq_len, stride
    sizes = np.array([os.path.getsize(f) for f in self.files], np.int64)
    self._starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    self._ends = self._starts + sizes
    total = int(sizes.sum())
    n = (total - seq_len - 1) // stride + 1 if total >= seq_len + 1 else 0
    self._keep = None
    if max_windows is not None and n > max_windows:  # load_text's evenly spaced windows
      self._keep = np.unique(np.linspace(0, n - 1, max_windows).round().astype(np.int64))
      n = len(self._keep)
    self._n = n
    self._groups = None

  def __len__(self) -> int:
    return self._n

  def offsets(self, indices) -> np.ndarray:
    """Stream offsets of windows ``indices``."""
    idx = np.asarray(indices, np.int64)
    return (idx if self._keep is None else self._keep[idx]) * self.stride

  @property
  def groups(self) -> np.ndarray:
    if self._groups is None:
      where = self.offsets(np.arange(self._n))
      self._groups = (np.searchsorted(self._starts, where, side="right") - 1).astype(np.int32)
    return self._groups

  def _window(self, offset: int) -> np.ndarray:
    need, pos = self.seq_len + 1, int(offset)
    k = int(np.searchsorted(self._starts, pos, side="right")) - 1
    chunks = []
    while need:
      take = min(need, int(self._ends[k]) - pos)
      if take > 0:  # empty files take nothing
        with open(self.files[k], "rb") as f:
          f.seek(pos - int(self._starts[k]))
          chunk = f.read(take)
        if len(chunk) != take:
          raise DadjaxError(f"TextSource: {self.files[k]!r} is shorter than when the source was "
                            "built (a corpus file changed during training)")
        chunks.append(chunk)
        pos, need = pos + take, need - take
      k += 1
    return np.frombuffer(b"".join(chunks), np.uint8).astype(np.int32)

  def __getitem__(self, i: int) -> dict:
    i = int(i)
    if not 0 <= i < self._n:
      raise IndexError(f"window {i} out of range [0, {self._n})")
    w = self._window(int(self.offsets(i)))
    return {"x": w[:-1], "y": w[1:]}

  def rows(self, indices: np.ndarray) -> dict:
    """The windows ``indices`` stacked: ``{"x": (k, T), "y": (k, T)}``."""
    idx = np.asarray(indices, np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= self._n):
      raise IndexError(f"windows must be in [0, {self._n})")
    w = np.stack([self._window(o) for o in self.offsets(idx)]) if idx.size else np.zeros(
        (0, self.seq_len + 1), np.int32)
    return {"x": w[:, :-1], "y": w[:, 1:]}

  def __repr__(self) -> str:
    return f"TextSource({len(self.files)} files, {self._n} windows of {self.seq_len} + 1 bytes)"


def text_source(paths_or_glob, seq_len: int = 128, stride: Optional[int] = None,
                fractions: Sequence[float] = (0.8, 0.1, 0.1), seed: int = 0,
                split: str = "train", max_windows: Optional[int] = None) -> TextSource:
  """The `TextSource` of one split of a corpus, split by file as `load_text` splits it.

  Args:
    paths_or_glob: a glob (``**`` recurses), directory, file or a sequence.
    seq_len, stride, fractions, seed, max_windows: as in `load_text`.
    split: ``"train"``, ``"validation"`` or ``"test"``.

  Returns:
    A `TextSource` whose rows equal `load_text`'s rows of that split (its
    ``x_train``/``y_train`` for ``"train"``) for the same arguments.
  """
  if split not in ("train", "validation", "test"):
    raise ValueError(f"split must be 'train', 'validation' or 'test', got {split!r}")
  return TextSource(split_files(paths_or_glob, fractions, seed)[split], seq_len, stride,
                    max_windows)


def _encode(example: dict) -> bytes:
  buf = io.BytesIO()
  np.savez(buf, **{k: np.asarray(v) for k, v in example.items()})
  return buf.getvalue()


def _decode(record: bytes) -> dict:
  with np.load(io.BytesIO(record)) as z:
    return {k: z[k] for k in z.files}


def write_array_record(path, x, y) -> str:
  """Write rows ``{"x": x[i], "y": y[i]}`` to one ArrayRecord file (``.npz`` bytes a record).

  Args:
    path: the file to write.
    x, y: arrays with one row per example.

  Returns:
    ``str(path)``.
  """
  # pylint: disable-next=g-import-not-at-top
  from array_record.python.array_record_module import ArrayRecordWriter
  if len(x) != len(y):
    raise ValueError(f"x and y must have the same length, got {len(x)} and {len(y)}")
  writer = ArrayRecordWriter(str(path), "group_size:1")
  try:
    for xi, yi in zip(x, y):
      writer.write(_encode({"x": xi, "y": yi}))
  finally:
    writer.close()
  return str(path)


class ArrayRecordSource:
  """Examples in ArrayRecord files, through ``grain.sources.ArrayRecordDataSource``.

  Args:
    paths: one file or a sequence of files (a glob or directory is resolved
      like `load_text`'s, sorted).
    decode: ``bytes -> {"x": ..., "y": ...}``; default reads the records
      `write_array_record` writes.
  """

  def __init__(self, paths, decode: Optional[Callable[[bytes], dict]] = None):
    self.paths = resolve_files(paths)
    self._source = grain.sources.ArrayRecordDataSource(self.paths)
    self._decode = decode or _decode

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> dict:
    return self._decode(self._source[int(i)])

  def __repr__(self) -> str:
    return f"ArrayRecordSource({len(self.paths)} files, {len(self)} records)"


class TfdsSource:
  """A tensorflow-datasets split prepared as ``array_record``, read by index.

  Uses ``builder.as_data_source(split)`` (no TensorFlow, no network). Image
  inputs become float32 in [0, 1] with a channel axis, as in `load_tfds`.

  Args:
    name: TFDS name (optionally with config/version).
    split: split or slice, e.g. ``"train"`` or ``"train[:10%]"``.
    data_dir: the TFDS data directory.
    x_key, y_key: feature names of inputs and labels; default the builder's
      supervised keys, else ``"image"``/``"label"``.
  """

  def __init__(self, name: str, split: str = "train", data_dir: Optional[str] = None,
               x_key: Optional[str] = None, y_key: Optional[str] = None):
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
    from dadjax.data._tfds import _keys  # pylint: disable=g-import-not-at-top
    builder = tfds.builder(name, data_dir=data_dir)
    if not builder.is_prepared():
      raise ValueError(f"TFDS data set {name!r} is not prepared under data_dir={data_dir!r}; "
                       "prepare it with file_format='array_record'")
    keys = _keys(builder.info) if x_key is None or y_key is None else (x_key, y_key)
    self.x_key, self.y_key = x_key or keys[0], y_key or keys[1]
    self.num_classes = int(builder.info.features[self.y_key].num_classes)
    self._source = builder.as_data_source(split=split)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, i: int) -> dict:
    e = self._source[int(i)]
    x = np.asarray(e[self.x_key])
    if x.dtype == np.uint8:
      x = x.astype(np.float32) / 255.0
    if x.ndim == 2:
      x = x[..., None]
    return {"x": x, "y": np.int32(e[self.y_key])}


# ---------------------------------------------------------------- sharding ---

def process_sites(num_sites: int, process_index: Optional[int] = None,
                  process_count: Optional[int] = None, *,
                  shard_options: Optional[grain.sharding.ShardOptions] = None) -> tuple[int, ...]:
  """The sites whose rows one process reads: its contiguous block of ``num_sites``.

  Processes own equal, contiguous blocks of sites in process order (the
  order of ``jax.devices()``, so the block of a process is the sites of its
  devices on a one-device-per-site mesh; in `dadjax.train` the step's
  ``local_sites`` decide). Default: this JAX process
  (``grain.sharding.ShardByJaxProcess``).

  Args:
    num_sites: sites of the global batch, >= 1.
    process_index, process_count: the process and how many there are.
    shard_options: a Grain ``ShardOptions`` instead (its ``shard_index`` and
      ``shard_count``).

  Returns:
    ``(first, ..., last)``: ``num_sites / process_count`` site ids.

  Raises:
    ValueError: ``process_count`` does not divide ``num_sites``, or an index
      out of range.
  """
  if shard_options is None and process_index is None and process_count is None:
    shard_options = grain.sharding.ShardByJaxProcess()
  if shard_options is not None:
    process_index, process_count = shard_options.shard_index, shard_options.shard_count
  if process_index is None or process_count is None:
    raise ValueError("give both process_index and process_count, or shard_options")
  if not isinstance(num_sites, int) or num_sites < 1:
    raise ValueError(f"num_sites must be an int >= 1, got {num_sites!r}")
  if not 1 <= process_count <= num_sites or num_sites % process_count:
    raise ValueError(f"process_count must divide num_sites={num_sites} (each process feeds "
                     f"whole sites), got {process_count}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index must be in [0, {process_count}), got {process_index}")
  k = num_sites // process_count
  return tuple(range(process_index * k, (process_index + 1) * k))


# ---------------------------------------------------------------- pipeline ---

class _StepRows(grain.MapDataset):
  """Grain ``MapDataset`` whose element ``t`` is the rows of ``sites`` at step ``t``.

  Endless (steps never run out: every site wraps around its rows, reshuffled
  per pass, as `SiteBatcher` does). Reads only the rows of ``sites``.
  """

  def __init__(self, rows: grain.MapDataset, source, sampler: SiteBatcher,
               sites: tuple[int, ...]):
    super().__init__(rows)
    self._source, self._sampler, self._sites = source, sampler, sites
    self._lock = threading.Lock()  # the sampler's permutation cache is shared by Grain's threads

  def __len__(self) -> int:
    return sys.maxsize

  def __getitem__(self, step):
    if isinstance(step, slice):
      return self.slice(step)
    with self._lock:
      idx = self._sampler.indices_at(int(step), self._sites)
    if hasattr(self._source, "rows"):
      return self._source.rows(idx)
    elements = self._parent._getitems([int(i) for i in idx])  # pylint: disable=protected-access
    return {k: np.stack([np.asarray(e[k]) for e in elements]) for k in ("x", "y")}

  def __str__(self) -> str:
    return f"_StepRows(sites={list(self._sites)})"


class SitePipeline:
  """`SiteBatcher`'s site-major batches, read per process through a Grain pipeline.

  The batch of step ``t`` holds ``batch_per_site`` rows of each site,
  chosen exactly as `SiteBatcher` chooses them (a fresh permutation of the
  site's rows per pass, seeded by ``(seed, site, pass)``), so the order
  depends only on ``(seed, step)`` and a pipeline over the same rows gives
  the in-memory path's batches bit for bit. A process reads the rows of
  ``sites`` only. Batches come from a Grain iterator over a ``MapDataset``
  whose element ``t`` is step ``t``'s batch (``prefetch`` steps read ahead
  by ``num_threads`` threads); its state is ``{"next_index": t}``.

  Args:
    source: a random-access source of ``{"x": row, "y": row}`` elements
      (`TextSource`, `ArraySource`, `ArrayRecordSource`, `TfdsSource`, or
      any Grain ``RandomAccessDataSource``).
    parts: index arrays into ``source``, one per site (`partition`).
    batch_per_site: rows per site per step, in ``[1, smallest site]``.
    seed: seed of the per-site shuffles. Default 0.
    sites: the sites this process reads (default every site).
    prefetch: steps read ahead, >= 0. Default 2.
    num_threads: reader threads, >= 1 (with ``prefetch`` 0: none). Default 1.

  Attributes:
    num_sites, batch_per_site, global_batch, steps_per_epoch: as `SiteBatcher`'s.
    sites: the sites read.
  """

  def __init__(self, source, parts: Sequence[np.ndarray], batch_per_site: int, seed: int = 0,
               *, sites: Optional[Sequence[int]] = None, prefetch: int = 2,
               num_threads: int = 1):
    if not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    if not isinstance(num_threads, int) or num_threads < 1:
      raise ValueError(f"num_threads must be an int >= 1, got {num_threads!r}")
    n = len(source)
    # The sampler only draws indices: its x and y are zero-sized stand-ins of the right length.
    stand_in = np.broadcast_to(np.zeros((), np.int8), (n,))
    self.sampler = SiteBatcher(stand_in, stand_in, parts, batch_per_site, seed)
    self.source = source
    self.num_sites = self.sampler.num_sites
    self.batch_per_site = self.sampler.batch_per_site
    self.global_batch = self.sampler.global_batch
    self.steps_per_epoch = self.sampler.steps_per_epoch
    self.sites = self._check_sites(sites)
    self._options = grain.ReadOptions(num_threads=num_threads if prefetch else 0,
                                      prefetch_buffer_size=prefetch)
    self._rows = grain.MapDataset.source(source)
    self._iter = None
    self._next = None  # the step the live iterator returns next

  def _check_sites(self, sites) -> tuple[int, ...]:
    return tuple(self.sampler._sites(sites))  # pylint: disable=protected-access

  def use_sites(self, sites: Sequence[int]) -> None:
    """Read the rows of ``sites`` from now on (drops the live iterator)."""
    self.sites = self._check_sites(sites)
    self.close()

  def dataset(self, sites: Optional[Sequence[int]] = None) -> grain.MapDataset:
    """The Grain ``MapDataset`` of the steps' batches of ``sites`` (default: ``self.sites``)."""
    sites = self.sites if sites is None else self._check_sites(sites)
    return _StepRows(self._rows, self.source, self.sampler, sites)

  def iterator(self, step: int = 0, sites: Optional[Sequence[int]] = None):
    """A Grain iterator yielding the batches of ``step, step + 1, ...`` (dicts ``x``, ``y``)."""
    if step < 0:
      raise ValueError(f"step must be >= 0, got {step}")
    it = iter(self.dataset(sites).to_iter_dataset(self._options))
    if step:
      it.set_state({"next_index": int(step)})
    return it

  def indices_at(self, step: int, sites: Optional[Sequence[int]] = None) -> np.ndarray:
    """Source indices of step ``step``'s rows of ``sites`` (default ``self.sites``), site-major."""
    return self.sampler.indices_at(step, self.sites if sites is None else sites)

  def batch_at(self, step: int, sites: Optional[Sequence[int]] = None):
    """The ``(x, y)`` rows of ``self.sites`` at ``step``, from the live iterator.

    Consecutive steps are read ahead; any other step moves the iterator
    there first. ``sites``, if given, must be ``self.sites`` (the rows this
    pipeline reads).
    """
    if sites is not None and tuple(int(s) for s in sites) != self.sites:
      raise ValueError(f"sites {list(sites)} are not the sites this pipeline reads, "
                       f"{list(self.sites)}; call use_sites first")
    if self._iter is None:
      self._iter = self.iterator(step)
    elif self._next != step:
      self._iter.set_state({"next_index": int(step)})
    batch = next(self._iter)
    self._next = step + 1
    return batch["x"], batch["y"]

  def iterate(self, start_step: int = 0, num_steps: Optional[int] = None):
    """Yields `batch_at` for ``start_step, start_step + 1, ...``."""
    step = start_step
    while num_steps is None or step < start_step + num_steps:
      yield self.batch_at(step)
      step += 1

  # -- checkpointing (with orbax, through Grain's handler) --------------------

  def state(self) -> dict:
    """The live iterator's Grain state (``{"next_index": t}``; ``t = 0`` before any read)."""
    return self._iter.get_state() if self._iter is not None else {"next_index": 0}

  def checkpoint_item(self, step: int):
    """An iterator holding the live iterator's state at ``step``, for
    ``grain.checkpoint.CheckpointSave`` (a copy: the live one keeps reading ahead).

    Raises:
      ValueError: the live iterator is not at ``step``.
    """
    state = self.state() if self._iter is not None else {"next_index": int(step)}
    if state.get("next_index") != step:
      raise ValueError(f"the input pipeline is at step {state.get('next_index')}, the train "
                       f"state at step {step}")
    snapshot = iter(self.dataset().to_iter_dataset(self._options))
    snapshot.set_state(state)
    return snapshot

  def restore_item(self):
    """A fresh iterator to restore a checkpoint into (``CheckpointRestore``)."""
    return iter(self.dataset().to_iter_dataset(self._options))

  def adopt(self, iterator, step: int) -> None:
    """Continue from a restored ``iterator``, which must be at ``step``.

    Raises:
      ValueError: it is at another step.
    """
    at = iterator.get_state().get("next_index")
    if at != step:
      raise ValueError(f"the input pipeline state is at step {at}, the train state at {step}")
    self.close()
    self._iter, self._next = iterator, step

  def close(self) -> None:
    """Stop the live iterator's reader threads."""
    if self._iter is not None:
      self._iter.close()
    self._iter, self._next = None, None

  def __repr__(self) -> str:
    return (f"SitePipeline({self.source!r}, sites={list(self.sites)} of {self.num_sites}, "
            f"batch_per_site={self.batch_per_site})")


# -------------------------------------------------------------- from config ---

def grain_pipeline(config, sites: Optional[Sequence[int]] = None
                   ) -> tuple[Dataset, list, SitePipeline]:
  """The data of a run with ``config.pipeline = "grain"``.

  ``"text:GLOB"`` data sets are read through a `TextSource` over the train
  files (nothing of the training split is loaded: the returned `Dataset`'s
  ``x_train``/``y_train`` hold only its first ``batch_per_site`` windows, for
  shapes and initialization), the evaluation windows in memory; every
  other data set is loaded as usual and read through an `ArraySource`.
  Sites are partitioned exactly as the in-memory path partitions them
  (by file for text, ``config.partition``), so the batches are the same.

  Args:
    config: a :class:`~dadjax.config.Config`.
    sites: the sites this process reads (default every site).

  Returns:
    ``(dataset, parts, pipeline)``.
  """
  from dadjax.data._lookup import load  # pylint: disable=g-import-not-at-top
  kwargs = dict(config.dataset_kwargs)
  prefix, _, arg = config.dataset.partition(":")
  if prefix == "text" and arg:
    seq_len = kwargs.get("seq_len", 128)
    stride = kwargs.get("stride")
    fractions, split_seed = kwargs.get("fractions", (0.8, 0.1, 0.1)), kwargs.get("seed", 0)
    eval_split = kwargs.get("eval_split", "test")
    if eval_split not in ("test", "validation"):
      raise DadjaxError(f"eval_split must be 'test' or 'validation', got {eval_split!r}")
    splits = split_files(arg, fractions, split_seed)
    source = TextSource(splits["train"], seq_len, stride, kwargs.get("max_windows"))
    x_te, y_te, _ = _split_windows(splits[eval_split], seq_len, stride,
                                   kwargs.get("max_eval_windows"))
    for split, n in (("train", len(source)), (eval_split, len(x_te))):
      if n == 0:
        raise DadjaxError(f"load_text: the {split} files hold fewer than seq_len + 1 = "
                          f"{seq_len + 1} bytes; lower seq_len or add files")
    head = source.rows(np.arange(min(len(source), config.batch_per_site)))
    dataset = Dataset(head["x"], head["y"], x_te, y_te, num_classes=BYTE_VOCAB,
                      name=kwargs.get("name", "text"), vocab_size=BYTE_VOCAB)
    labels = source.groups
  else:
    if config.data_dir:
      kwargs["data_dir"] = config.data_dir
    dataset = load(config.dataset, **kwargs)
    source = ArraySource(dataset.x_train, dataset.y_train)
    labels = dataset.y_train if dataset.groups is None else dataset.groups
  parts = partition(labels, config.num_sites, scheme=config.partition, alpha=config.alpha,
                    seed=config.seed)
  pipeline = SitePipeline(source, parts, config.batch_per_site, seed=config.seed, sites=sites,
                          prefetch=getattr(config, "pipeline_prefetch", 2))
  return dataset, parts, pipeline
