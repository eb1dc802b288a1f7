"""Tests for dadjax.data: embedded, synthetic and TFDS loading, partitioning."""

import io

import numpy as np
import pytest

from dadjax import data


# ----------------------------------------------------------------- digits ---


def test_digits_shapes_range_and_determinism():
  ds = data.load_digits()
  assert ds.name == "digits" and ds.num_classes == 10 and ds.vocab_size is None
  assert ds.x_train.shape == (1437, 8, 8, 1) and ds.x_test.shape == (360, 8, 8, 1)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert ds.x_train.min() >= 0.0 and ds.x_train.max() == 1.0
  assert set(np.unique(ds.y_test)) == set(range(10))  # stratified
  again = data.load_digits()
  np.testing.assert_array_equal(ds.x_train, again.x_train)
  np.testing.assert_array_equal(ds.y_test, again.y_test)
  assert not np.array_equal(ds.y_train, data.load_digits(seed=1).y_train)
  assert data.load("digits", test_fraction=0.5).x_test.shape[0] == 899


def test_digits_bad_fraction():
  with pytest.raises(ValueError, match="test_fraction"):
    data.load_digits(test_fraction=1.0)


# -------------------------------------------------------------- synthetic ---


def test_synthetic_classification_deterministic_and_learnable():
  ds = data.synthetic_classification(2000, 500, shape=(8, 8, 1), seed=3)
  assert ds.x_train.shape == (2000, 8, 8, 1) and ds.y_test.shape == (500,)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
  same = data.load("synthetic", num_train=2000, num_test=500, seed=3)
  np.testing.assert_array_equal(ds.x_train, same.x_train)
  np.testing.assert_array_equal(ds.y_test, same.y_test)
  assert not np.array_equal(ds.x_train, data.synthetic_classification(2000, 500, seed=4).x_train)
  # Class means differ enough for a nearest-centroid classifier.
  xtr, xte = ds.x_train.reshape(2000, -1), ds.x_test.reshape(500, -1)
  means = np.stack([xtr[ds.y_train == c].mean(0) for c in range(10)])
  pred = ((xte[:, None] - means) ** 2).sum(-1).argmin(1)
  assert (pred == ds.y_test).mean() > 0.8
  with pytest.raises(ValueError, match="noise"):
    data.synthetic_classification(10, 10, noise=-1.0)
  with pytest.raises(ValueError, match="num_train"):
    data.synthetic_classification(0, 10)


def test_synthetic_sequences_rule():
  ds = data.synthetic_sequences(1000, 200, seq_len=16, vocab_size=20, num_classes=4, seed=1)
  assert ds.x_train.shape == (1000, 16) and ds.x_train.dtype == np.int32
  assert ds.vocab_size == 20 and ds.name == "synthetic_seq"
  assert ds.x_train.min() >= 0 and ds.x_train.max() < 20
  counts = (ds.x_test[..., None] == np.arange(4)).sum(1)
  np.testing.assert_array_equal(counts.argmax(1), ds.y_test)
  assert np.bincount(ds.y_train, minlength=4).min() > 100  # roughly balanced
  np.testing.assert_array_equal(
    ds.x_train,
    data.load(
      "synthetic_seq",
      num_train=1000,
      num_test=200,
      seq_len=16,
      vocab_size=20,
      num_classes=4,
      seed=1,
    ).x_train,
  )
  with pytest.raises(ValueError, match="vocab_size"):
    data.synthetic_sequences(10, 10, vocab_size=2, num_classes=4)


# ------------------------------------------------------------------- tfds ---


@pytest.fixture(scope="module")
def tfds_dir(tmp_path_factory):
  """Builds tiny image and text data sets (array_record, no TensorFlow) in a
  temporary directory, without registering their builders, so loading goes
  through TFDS's read-from-files path as for a prepared MNIST/IMDB."""
  tfds = pytest.importorskip("tensorflow_datasets")
  from PIL import Image

  root = tmp_path_factory.mktemp("tfds")

  def png(a):
    buf = io.BytesIO()
    Image.fromarray(a[..., 0]).save(buf, format="PNG")
    return buf.getvalue()

  with tfds.core.registered.skip_registration():

    class TinyImages(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")

      def _info(self):
        return tfds.core.DatasetInfo(
          builder=self,
          supervised_keys=("image", "label"),
          features=tfds.features.FeaturesDict(
            {
              "image": tfds.features.Image(shape=(6, 6, 1)),
              "label": tfds.features.ClassLabel(num_classes=3),
            }
          ),
        )

      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(30, 0), "test": self._generate_examples(9, 1)}

      def _generate_examples(self, n, seed):
        rng = np.random.default_rng(seed)
        for i in range(n):  # pixel (0, 0) encodes the label.
          img = rng.integers(0, 256, (6, 6, 1), dtype=np.uint8)
          img[0, 0, 0] = 100 * (i % 3)
          yield i, {"image": png(img), "label": i % 3}

    class TinyText(tfds.core.GeneratorBasedBuilder):
      VERSION = tfds.core.Version("1.0.0")

      def _info(self):
        return tfds.core.DatasetInfo(
          builder=self,
          supervised_keys=("text", "label"),
          features=tfds.features.FeaturesDict(
            {"text": tfds.features.Text(), "label": tfds.features.ClassLabel(names=["neg", "pos"])}
          ),
        )

      def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(8), "test": self._generate_examples(4)}

      def _generate_examples(self, n):
        for i in range(n):
          yield i, {"text": "A good, good movie" if i % 2 else "bad", "label": i % 2}

    for cls in (TinyImages, TinyText):
      cls(data_dir=str(root), file_format="array_record").download_and_prepare()
  return str(root)


def test_load_tfds_images_offline(tfds_dir):
  ds = data.load_tfds("tiny_images", data_dir=tfds_dir)
  assert ds.name == "tiny_images" and ds.num_classes == 3
  assert ds.x_train.shape == (30, 6, 6, 1) and ds.x_test.shape == (9, 6, 6, 1)
  assert ds.x_train.dtype == np.float32 and ds.y_train.dtype == np.int32
  assert 0.0 <= ds.x_train.min() and ds.x_train.max() <= 1.0
  np.testing.assert_allclose(ds.x_train[:, 0, 0, 0], ds.y_train * 100 / 255.0, atol=1e-6)
  assert np.bincount(ds.y_train).tolist() == [10, 10, 10]
  small = data.load("tiny_images", data_dir=tfds_dir, max_examples=5)
  assert small.x_train.shape[0] == 5 and small.x_test.shape[0] == 5
  np.testing.assert_array_equal(small.y_train, ds.y_train[:5])


def test_load_tfds_text_offline(tfds_dir):
  ds = data.load_tfds("tiny_text", data_dir=tfds_dir, seq_len=10)
  assert ds.x_train.shape == (8, 10) and ds.x_train.dtype == np.int32 and ds.vocab_size == 257
  for x, y in zip(ds.x_train, ds.y_train):
    text = b"A good, good movie" if y else b"bad"
    np.testing.assert_array_equal(x, data.tokenize([text], 10)[0])
  words = data.load("tiny_text", data_dir=tfds_dir, seq_len=6, vocab_size=50)
  assert words.vocab_size == 50 and words.x_test.max() < 50
  row = words.x_train[words.y_train == 1][0]
  assert row[1] == row[2] != 0 and row[0] != row[1] and (row[4:] == 0).all()


def test_tokenize():
  ids = data.tokenize(["ab", b"\xff"], seq_len=3)
  np.testing.assert_array_equal(ids, [[98, 99, 0], [256, 0, 0]])
  with pytest.raises(ValueError, match="seq_len"):
    data.tokenize(["a"], seq_len=0)


def test_load_errors(tmp_path):
  with pytest.raises(ValueError, match="not_a_dataset_xyz"):
    data.load("not_a_dataset_xyz", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="not prepared"):
    data.load("mnist", data_dir=str(tmp_path))
  with pytest.raises(ValueError, match="max_examples"):
    data.load_tfds("mnist", max_examples=0)


# -------------------------------------------------------------- partition ---

LABELS = np.repeat(np.arange(10), 50)[np.random.default_rng(0).permutation(500)]


@pytest.mark.parametrize("scheme", ["iid", "by_class", "dirichlet"])
@pytest.mark.parametrize("num_sites", [1, 2, 3, 5])
def test_partition_disjoint_and_covering(scheme, num_sites):
  parts = data.partition(LABELS, num_sites, scheme=scheme, alpha=0.3, seed=1)
  assert len(parts) == num_sites and all(len(p) > 0 for p in parts)
  np.testing.assert_array_equal(np.sort(np.concatenate(parts)), np.arange(500))
  again = data.partition(LABELS, num_sites, scheme=scheme, alpha=0.3, seed=1)
  assert all(np.array_equal(a, b) for a, b in zip(parts, again))


def test_partition_iid_sizes():
  sizes = [len(p) for p in data.partition(LABELS, 3)]
  assert sizes == [167, 167, 166]


@pytest.mark.parametrize("num_sites", [2, 5])
def test_partition_by_class_disjoint_classes(num_sites):
  parts = data.partition(LABELS, num_sites, scheme="by_class")
  sets = [set(LABELS[p].tolist()) for p in parts]
  assert all(len(s) == 10 // num_sites for s in sets)
  assert len(set().union(*sets)) == 10
  if num_sites == 2:
    assert sets == [{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}]


def _skew(parts, num_classes=10):
  """Mean total-variation distance of site class mixes from the global mix."""
  glob = np.bincount(LABELS, minlength=num_classes) / len(LABELS)
  site = [np.bincount(LABELS[p], minlength=num_classes) / len(p) for p in parts]
  return float(np.mean([0.5 * np.abs(s - glob).sum() for s in site]))


def test_partition_dirichlet_skew_and_nonempty():
  small = np.mean(
    [_skew(data.partition(LABELS, 4, "dirichlet", alpha=0.1, seed=s)) for s in range(5)]
  )
  large = np.mean(
    [_skew(data.partition(LABELS, 4, "dirichlet", alpha=100.0, seed=s)) for s in range(5)]
  )
  assert small > 0.4 and large < 0.15 and small > 3 * large
  parts = data.partition(LABELS[:40], 30, "dirichlet", alpha=0.01)
  assert all(len(p) >= 1 for p in parts)


def test_partition_summary():
  parts = data.partition(LABELS, 2, scheme="by_class")
  text = data.partition_summary(LABELS, parts, num_classes=10)
  lines = text.splitlines()
  assert len(lines) == 4 and lines[0].split()[:2] == ["site", "n"]
  assert lines[1].split()[:3] == ["0", "250", "|"] and lines[1].split()[-1] == "0"
  assert lines[-1].split()[:2] == ["all", "500"]


@pytest.mark.parametrize(
  "kwargs, arg",
  [
    (dict(num_sites=0), "num_sites"),
    (dict(num_sites=501), "num_sites"),
    (dict(num_sites=11, scheme="by_class"), "num_sites"),
    (dict(num_sites=2, scheme="dirichlet", alpha=0.0), "alpha"),
    (dict(num_sites=2, scheme="random"), "scheme"),
  ],
)
def test_partition_bad_args(kwargs, arg):
  with pytest.raises(ValueError, match=arg):
    data.partition(LABELS, **kwargs)


# ---------------------------------------------------------------- batches ---


def _uneven():
  x = np.arange(500, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
  parts = [np.arange(0, 300), np.arange(300, 340), np.arange(340, 500)]
  return x, LABELS.astype(np.int32), parts


def test_site_major_layout_and_determinism():
  x, y, parts = _uneven()
  b = 8
  batcher = data.SiteBatcher(x, y, parts, batch_per_site=b, seed=7)
  assert batcher.global_batch == 24 and batcher.steps_per_epoch == 500 // 24
  for step in (0, 1, 4, 5, 37):
    xb, yb = batcher.batch_at(step)
    assert xb.shape == (24, 3) and yb.shape == (24,)
    idx = xb[:, 0].astype(int)
    np.testing.assert_array_equal(yb, y[idx])
    for i, p in enumerate(parts):
      assert np.isin(idx[i * b : (i + 1) * b], p).all()
  # Same (seed, step) -> same batch, from a fresh object (exact resume).
  fresh = data.SiteBatcher(x, y, parts, batch_per_site=b, seed=7)
  resumed = list(fresh.iterate(start_step=5, num_steps=3))
  for k, (xb, _) in enumerate(resumed):
    np.testing.assert_array_equal(xb, batcher.batch_at(5 + k)[0])
  assert not np.array_equal(
    data.SiteBatcher(x, y, parts, b, seed=8).indices_at(0), batcher.indices_at(0)
  )


def test_small_site_reshuffles_without_replacement():
  x, y, parts = _uneven()
  batcher = data.SiteBatcher(x, y, parts, batch_per_site=8, seed=0)
  site1 = np.concatenate([batcher.indices_at(t)[8:16] for t in range(10)])  # 80 = 2 passes
  first, second = site1[:40], site1[40:]
  np.testing.assert_array_equal(np.sort(first), parts[1])
  np.testing.assert_array_equal(np.sort(second), parts[1])
  assert not np.array_equal(first, second)


def test_site_batches_epochs():
  x, y, parts = _uneven()
  batcher = data.SiteBatcher(x, y, parts, batch_per_site=8, seed=2)
  epoch1 = list(data.site_batches(x, y, parts, batch_per_site=8, seed=2, epoch=1))
  assert len(epoch1) == batcher.steps_per_epoch
  np.testing.assert_array_equal(epoch1[0][0], batcher.batch_at(batcher.steps_per_epoch)[0])


@pytest.mark.parametrize(
  "kwargs, arg",
  [
    (dict(batch_per_site=41), "batch_per_site"),
    (dict(batch_per_site=0), "batch_per_site"),
    (dict(batch_per_site=4, epoch=-1), "epoch"),
  ],
)
def test_site_batches_bad_args(kwargs, arg):
  x, y, parts = _uneven()
  with pytest.raises(ValueError, match=arg):
    list(data.site_batches(x, y, parts, **kwargs))
  with pytest.raises(ValueError, match="step"):
    data.SiteBatcher(x, y, parts, 4).batch_at(-1)


def test_training_reads_a_tfds_directory_from_the_config(tfds_dir):
  from dadjax.config import load_config
  from dadjax.train import train

  config = load_config(
    None,
    [
      "dataset=tiny_images",
      f"data_dir={tfds_dir}",
      "num_sites=2",
      "backend=vmap",
      "batch_per_site=4",
      "steps=2",
      "eval_every=2",
    ],
  )
  run = train(config, progress=False)
  assert run.dataset.name == "tiny_images" and run.final["step"] == 2
  assert 0.0 <= run.final["test_accuracy"] <= 1.0
