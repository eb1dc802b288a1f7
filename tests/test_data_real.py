"""Real data sets: the IDX loader (Fashion-MNIST), byte-level text, and their config routes.

The files are written by the tests themselves; the tests that read the
installed Fashion-MNIST package skip (with the reason) where it is absent.
"""

import gzip
import math
import pathlib
import struct

import numpy as np
import pytest

from dadjax import data
from dadjax.config import load_config, validate
from dadjax.errors import DadjaxError

FASHION = pathlib.Path("/usr/share/datasets/fashion-mnist")
IMAGES = np.array([[[0, 1], [2, 255]], [[10, 20], [30, 40]], [[255, 0], [0, 128]]], np.uint8)
LABELS = np.array([3, 0, 9], np.uint8)


def _idx_bytes(array: np.ndarray, kind: int = 0x08) -> bytes:
  """An IDX file written by hand: 0, 0, type, ndim, big-endian sizes, big-endian values."""
  head = bytes([0, 0, kind, array.ndim]) + b"".join(struct.pack(">I", s) for s in array.shape)
  big = array.astype(array.dtype.newbyteorder(">"))
  return head + big.tobytes()


def _write_idx_dir(directory: pathlib.Path, compress: bool) -> None:
  directory.mkdir(parents=True, exist_ok=True)
  files = {"train-images-idx3-ubyte": IMAGES, "train-labels-idx1-ubyte": LABELS,
           "t10k-images-idx3-ubyte": IMAGES[:2], "t10k-labels-idx1-ubyte": LABELS[:2]}
  for name, array in files.items():
    raw = _idx_bytes(array)
    if compress:
      (directory / (name + ".gz")).write_bytes(gzip.compress(raw))
    else:
      (directory / name).write_bytes(raw)


# -- IDX ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compress", [False, True], ids=["raw", "gzip"])
def test_load_idx_reads_a_hand_written_file_exactly(tmp_path, compress):
  _write_idx_dir(tmp_path, compress)
  ds = data.load_idx(tmp_path)
  assert ds.x_train.shape == (3, 2, 2, 1) and ds.x_train.dtype == np.float32
  np.testing.assert_array_equal(ds.x_train[..., 0] * 255.0, IMAGES.astype(np.float32))
  np.testing.assert_array_equal(ds.y_train, [3, 0, 9])
  np.testing.assert_array_equal(ds.x_test[..., 0] * 255.0, IMAGES[:2].astype(np.float32))
  np.testing.assert_array_equal(ds.y_test, [3, 0])
  assert ds.y_train.dtype == np.int32 and ds.num_classes == 10
  suffix = ".gz" if compress else ""
  np.testing.assert_array_equal(data.read_idx(tmp_path / f"train-images-idx3-ubyte{suffix}"),
                                IMAGES)


def test_read_idx_wider_types_and_file_list(tmp_path):
  values = np.array([[1, -2, 300], [70000, 0, -1]], np.int32)
  (tmp_path / "a").write_bytes(gzip.compress(_idx_bytes(values, 0x0C)))
  got = data.read_idx(tmp_path / "a")
  assert got.dtype == np.int32 and got.dtype.byteorder in "=<|"
  np.testing.assert_array_equal(got, values)
  floats = np.array([0.5, -1.25], np.float32)
  (tmp_path / "b").write_bytes(_idx_bytes(floats, 0x0D))
  np.testing.assert_array_equal(data.read_idx(tmp_path / "b"), floats)
  _write_idx_dir(tmp_path / "d", compress=False)
  d = tmp_path / "d"
  ds = data.load_idx([d / "train-images-idx3-ubyte", d / "train-labels-idx1-ubyte",
                      d / "t10k-images-idx3-ubyte", d / "t10k-labels-idx1-ubyte"], num_classes=12)
  assert ds.num_classes == 12 and len(ds.y_test) == 2
  few = data.load_idx(d, max_examples=1)
  assert len(few.x_train) == len(few.y_test) == 1 and few.y_train[0] == 3
  padded = data.load_idx(d, pad_to=5)
  assert padded.x_train.shape == (3, 5, 5, 1) and padded.x_test.shape == (2, 5, 5, 1)
  np.testing.assert_array_equal(padded.x_train[:, 1:3, 1:3], ds.x_train)
  assert padded.x_train.sum() == pytest.approx(ds.x_train.sum())
  with pytest.raises(DadjaxError, match="pad_to"):
    data.load_idx(d, pad_to=1)


def test_read_idx_rejects_damaged_files(tmp_path):
  good = _idx_bytes(IMAGES)
  (tmp_path / "short").write_bytes(good[:-1])
  with pytest.raises(DadjaxError, match=r"shape \(3, 2, 2\)"):
    data.read_idx(tmp_path / "short")
  (tmp_path / "magic").write_bytes(b"\x01" + good[1:])
  with pytest.raises(DadjaxError, match="not an IDX file"):
    data.read_idx(tmp_path / "magic")
  (tmp_path / "type").write_bytes(good[:2] + b"\x07" + good[3:])
  with pytest.raises(DadjaxError, match="type byte 0x07"):
    data.read_idx(tmp_path / "type")
  with pytest.raises(DadjaxError, match="t10k-images-idx3-ubyte"):
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "train-images-idx3-ubyte").write_bytes(good)
    data.load_idx(tmp_path / "partial")


def test_missing_fashion_mnist_names_the_package(tmp_path):
  with pytest.raises(DadjaxError, match=r"apt-get install -y dataset-fashion-mnist"):
    data.load_fashion_mnist(tmp_path / "nowhere")


def test_fashion_mnist_from_a_directory_and_by_config_name(tmp_path):
  _write_idx_dir(tmp_path, compress=True)
  ds = data.load_fashion_mnist(tmp_path)
  assert ds.name == "fashion_mnist" and ds.num_classes == 10 and len(ds.x_train) == 3
  got = data.load("fashion_mnist", path=str(tmp_path))
  np.testing.assert_array_equal(got.x_train, ds.x_train)
  np.testing.assert_array_equal(data.load(f"idx:{tmp_path}").y_train, ds.y_train)
  validate(load_config(overrides=["dataset=fashion_mnist", f'dataset_kwargs={{"path": '
                                  f'"{tmp_path}"}}']))


@pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").exists(),
                    reason="Fashion-MNIST is not installed (apt-get install -y "
                    "dataset-fashion-mnist)")
def test_installed_fashion_mnist_has_the_documented_counts():
  ds = data.load_fashion_mnist()
  assert ds.x_train.shape == (60000, 28, 28, 1) and ds.x_test.shape == (10000, 28, 28, 1)
  np.testing.assert_array_equal(np.bincount(ds.y_train), [6000] * 10)
  np.testing.assert_array_equal(np.bincount(ds.y_test), [1000] * 10)
  assert 0.0 <= ds.x_train.min() and ds.x_train.max() == 1.0
  assert len(data._idx.FASHION_MNIST_CLASSES) == 10


# -- text -----------------------------------------------------------------------------------------


def _tree(root: pathlib.Path, n: int = 10) -> list:
  rng = np.random.default_rng(0)
  paths = []
  for i in range(n):
    p = root / f"dir{i % 3}" / f"doc{i}.txt"
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(bytes(rng.integers(32, 127, size=200 + 37 * i, dtype=np.uint8)))
    paths.append(str(p))
  (root / "dir0" / "skip.bin").write_bytes(b"\x00" * 50)
  return sorted(paths)


def test_split_files_is_disjoint_deterministic_and_covers(tmp_path):
  paths = _tree(tmp_path)
  splits = data.split_files(str(tmp_path / "**" / "*.txt"), seed=3)
  assert [len(splits[s]) for s in ("train", "validation", "test")] == [8, 1, 1]
  sets = [set(splits[s]) for s in ("train", "validation", "test")]
  assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
  assert sorted(sets[0] | sets[1] | sets[2]) == paths
  assert data.split_files(str(tmp_path / "**" / "*.txt"), seed=3) == splits
  assert data.split_files(paths, seed=3) == splits  # a list of files names the same split
  # A directory takes every file below it (here also the .bin file).
  assert sum(map(len, data.split_files(tmp_path).values())) == 11
  with pytest.raises(DadjaxError, match="fractions"):
    data.split_files(paths, fractions=(0.5, 0.5, 0.5))
  with pytest.raises(DadjaxError, match="no files match"):
    data.split_files(str(tmp_path / "*.nothing"))
  with pytest.raises(DadjaxError, match="cannot fill"):
    data.split_files(paths[:2])


def test_text_windows_are_next_byte_pairs():
  x, y = data.text_windows(b"abcdefghij", seq_len=4)
  assert x.shape == y.shape == (2, 4) and x.dtype == np.int32
  np.testing.assert_array_equal(x, [list(b"abcd"), list(b"efgh")])
  np.testing.assert_array_equal(y, [list(b"bcde"), list(b"fghi")])
  x, y = data.text_windows(b"abcdef", seq_len=2, stride=1)
  assert len(x) == 4 and bytes(x[3].astype(np.uint8)) == b"de" and bytes(
      y[3].astype(np.uint8)) == b"ef"
  assert data.text_windows(b"ab", seq_len=4)[0].shape == (0, 4)


def test_load_text_split_windows_and_groups(tmp_path):
  _tree(tmp_path)
  pattern = str(tmp_path / "**" / "*.txt")
  splits = data.split_files(pattern)
  ds = data.load_text(pattern, seq_len=16)
  train_bytes = b"".join(pathlib.Path(p).read_bytes() for p in splits["train"])
  test_bytes = b"".join(pathlib.Path(p).read_bytes() for p in splits["test"])
  assert ds.x_train.shape == ((len(train_bytes) - 17) // 16 + 1, 16)
  assert ds.vocab_size == ds.num_classes == 256 and ds.y_train.shape == ds.x_train.shape
  # Every window is the stream, shifted by one for the targets.
  np.testing.assert_array_equal(ds.x_train.reshape(-1), np.frombuffer(
      train_bytes[:ds.x_train.size], np.uint8))
  np.testing.assert_array_equal(ds.y_train[:, :-1], ds.x_train[:, 1:])
  np.testing.assert_array_equal(ds.x_test[0], np.frombuffer(test_bytes[:16], np.uint8))
  # groups: the train file each window starts in.
  sizes = [pathlib.Path(p).stat().st_size for p in splits["train"]]
  starts = np.arange(len(ds.x_train)) * 16
  np.testing.assert_array_equal(ds.groups, np.searchsorted(np.cumsum(sizes), starts,
                                                           side="right"))
  # Deterministic: the same call gives the same windows; another seed other files.
  again = data.load_text(pattern, seq_len=16)
  np.testing.assert_array_equal(again.x_train, ds.x_train)
  val = data.load_text(pattern, seq_len=16, eval_split="validation")
  val_bytes = pathlib.Path(splits["validation"][0]).read_bytes()
  np.testing.assert_array_equal(val.x_test[0], np.frombuffer(val_bytes[:16], np.uint8))
  few = data.load_text(pattern, seq_len=16, max_windows=5, max_eval_windows=2)
  assert len(few.x_train) == 5 and len(few.x_test) == 2 and len(few.groups) == 5
  np.testing.assert_array_equal(few.x_train[0], ds.x_train[0])
  np.testing.assert_array_equal(few.x_train[-1], ds.x_train[-1])


def test_text_site_batches_are_deterministic_and_by_file(tmp_path):
  _tree(tmp_path)
  ds = data.load("text:" + str(tmp_path / "**" / "*.txt"), seq_len=8)
  parts = data.partition(ds.groups, 4, scheme="by_class")
  files = [set(ds.groups[p]) for p in parts]
  assert all(files[i].isdisjoint(files[j]) for i in range(4) for j in range(i + 1, 4))
  a = data.SiteBatcher(ds.x_train, ds.y_train, parts, batch_per_site=3, seed=1)
  b = data.SiteBatcher(ds.x_train, ds.y_train, parts, batch_per_site=3, seed=1)
  for step in (0, 5):
    (xa, ya), (xb, yb) = a.batch_at(step), b.batch_at(step)
    np.testing.assert_array_equal(xa, xb)
    np.testing.assert_array_equal(ya, yb)
    np.testing.assert_array_equal(ya[:, :-1], xa[:, 1:])
    assert xa.shape == (12, 8)


def test_uniform_model_scores_8_bits_per_byte():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  y = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(4, 7)), jnp.int32)
  metrics = data.language_model_metrics({"logits": jnp.zeros((4, 7, 256))}, {"y": y})
  assert float(metrics["bits_per_byte"]) == pytest.approx(8.0, abs=1e-5)
  assert data.bits_per_byte(math.log(256)) == pytest.approx(8.0)
  assert data.perplexity(math.log(256)) == pytest.approx(256.0)
  assert data.language_model_metrics({"logits": jnp.zeros((4, 10))}, {"y": y[:, 0]}) == {}


def test_text_config_validates_and_names_bad_kwargs(tmp_path):
  _tree(tmp_path)
  pattern = str(tmp_path / "**" / "*.txt")
  validate(load_config(overrides=[f"dataset=text:{pattern}", 'dataset_kwargs={"seq_len": 8}',
                                  "model=mlp"]))
  with pytest.raises(DadjaxError, match="max_windows"):
    validate(load_config(overrides=[f"dataset=text:{pattern}", 'dataset_kwargs={"seq": 8}']))


def test_train_runs_on_an_idx_directory_from_a_config(tmp_path):
  from dadjax.config import Config  # pylint: disable=g-import-not-at-top
  from dadjax.train import train  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  images = rng.integers(0, 256, size=(64, 28, 28), dtype=np.uint8)
  labels = (np.arange(64) % 10).astype(np.uint8)
  for prefix, n in (("train", 64), ("t10k", 16)):
    (tmp_path / f"{prefix}-images-idx3-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(
        images[:n])))
    (tmp_path / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(gzip.compress(_idx_bytes(
        labels[:n])))
  run = train(Config(dataset="fashion_mnist", dataset_kwargs={"path": str(tmp_path)},
                     model_kwargs={"hidden": [8]}, num_sites=2, batch_per_site=4, steps=2,
                     eval_every=2, backend="vmap"), progress=False)
  assert run.dataset.x_train.shape == (64, 28, 28, 1)
  assert np.isfinite(run.final["test_loss"]) and 0.0 <= run.final["test_accuracy"] <= 1.0
