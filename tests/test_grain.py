"""The Grain input pipeline per host: sources, per-process rows, (seed, step) order, resume."""
import chex
import numpy as np
import pytest

from dadjax import data
from dadjax.config import Config
from dadjax.train import train
from test_data import tfds_dir  # noqa: F401  (the tiny prepared tfds sets, a fixture)


def _corpus(root, n_files=8, size=700):
  """Small text files of different lengths (one empty), bytes varied per file."""
  root.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  for i in range(n_files):
    n = 0 if i == 3 else size + 37 * i
    text = bytes(rng.integers(32, 127, n).astype(np.uint8))
    (root / f"doc{i:02d}.txt").write_bytes(text)
  return root


class _Counting:
  """A source that records which rows were read."""

  def __init__(self, source):
    self.source, self.read = source, set()

  def __len__(self):
    return len(self.source)

  def __getitem__(self, i):
    self.read.add(int(i))
    return self.source[i]


@pytest.mark.parametrize("stride,max_windows", [(None, None), (5, None), (None, 20)])
def test_text_source_rows_equal_load_text(tmp_path, stride, max_windows):
  corpus = _corpus(tmp_path / "c")
  ds = data.load_text(str(corpus), seq_len=16, stride=stride, max_windows=max_windows, seed=3)
  src = data.text_source(str(corpus), seq_len=16, stride=stride, max_windows=max_windows, seed=3)
  assert len(src) == len(ds.x_train)
  rows = src.rows(np.arange(len(src)))
  np.testing.assert_array_equal(rows["x"], ds.x_train)
  np.testing.assert_array_equal(rows["y"], ds.y_train)
  np.testing.assert_array_equal(src.groups, ds.groups)
  i = len(src) // 2  # one element through Grain's protocol, a window that may cross files
  np.testing.assert_array_equal(src[i]["x"], ds.x_train[i])
  with pytest.raises(IndexError):
    src[len(src)]


@pytest.mark.parametrize("scheme", ["iid", "by_class"])
def test_pipeline_batches_equal_site_batcher_and_processes_read_only_their_rows(tmp_path, scheme):
  corpus = _corpus(tmp_path / "c")
  ds = data.load_text(str(corpus), seq_len=16)
  src = data.text_source(str(corpus), seq_len=16)
  parts = data.partition(ds.groups, 4, scheme, seed=1)  # by_class: each site its own files
  b = 3
  ref = data.SiteBatcher(ds.x_train, ds.y_train, parts, b, seed=1)
  whole = data.SitePipeline(src, parts, b, seed=1)
  halves = []
  for p in range(2):
    counted = _Counting(src)
    sites = data.process_sites(4, process_index=p, process_count=2)
    pipe = data.SitePipeline(counted, parts, b, seed=1, sites=sites)
    halves.append((sites, counted, [pipe.batch_at(t) for t in range(12)]))
    pipe.close()
  assert halves[0][0] == (0, 1) and halves[1][0] == (2, 3)
  for t in range(12):  # past one pass of the smallest site: wraps and reshuffles
    x, y = whole.batch_at(t)
    rx, ry = ref.batch_at(t)
    np.testing.assert_array_equal(x, rx)
    np.testing.assert_array_equal(y, ry)
    both = np.concatenate([halves[0][2][t][0], halves[1][2][t][0]])
    np.testing.assert_array_equal(both, rx)  # the two processes' rows are the global batch
  for sites, counted, _ in halves:
    own = set(np.concatenate([parts[s] for s in sites]).tolist())
    assert counted.read and counted.read <= own  # no process read another's rows
  assert not halves[0][1].read & halves[1][1].read
  whole.close()


def test_process_sites_checks_and_grain_shard_options():
  import grain
  assert data.process_sites(8, 3, 4) == (6, 7)
  assert data.process_sites(8) == tuple(range(8))  # one JAX process here
  opts = grain.sharding.ShardOptions(shard_index=1, shard_count=2)
  assert data.process_sites(4, shard_options=opts) == (2, 3)
  with pytest.raises(ValueError, match="process_count must divide"):
    data.process_sites(6, 0, 4)
  with pytest.raises(ValueError, match="process_index"):
    data.process_sites(4, 2, 2)


def test_order_depends_only_on_seed_and_step():
  x = np.arange(60, dtype=np.float32).reshape(30, 2)
  y = np.arange(30, dtype=np.int32) % 3
  parts = data.partition(y, 3, "iid", seed=0)
  a = data.SitePipeline(data.ArraySource(x, y), parts, 4, seed=7)
  b = data.SitePipeline(data.ArraySource(x, y), parts, 4, seed=7, prefetch=0)
  c = data.SitePipeline(data.ArraySource(x, y), parts, 4, seed=8)
  seq = [a.batch_at(t)[0] for t in range(6)]
  for t in (5, 2, 0, 4):  # random access, through a fresh pipeline without read-ahead
    np.testing.assert_array_equal(b.batch_at(t)[0], seq[t])
  assert any(not np.array_equal(c.batch_at(t)[0], seq[t]) for t in range(6))
  # Grain's own iterator, started at a step, continues the same sequence.
  it = a.iterator(step=3)
  np.testing.assert_array_equal(next(it)["x"], seq[3])
  assert it.get_state() == {"next_index": 4}
  for p in (a, b, c):
    p.close()


def test_array_record_source_through_the_pipeline(tmp_path):
  pytest.importorskip("array_record")
  rng = np.random.default_rng(0)
  x = rng.normal(size=(24, 3)).astype(np.float32)
  y = rng.integers(0, 4, 24).astype(np.int32)
  path = data.write_array_record(tmp_path / "rows.array_record", x, y)
  src = data.ArrayRecordSource(path)
  assert len(src) == 24
  np.testing.assert_array_equal(src[5]["x"], x[5])
  parts = data.partition(y, 2, "iid")
  got = data.SitePipeline(src, parts, 3).batch_at(4)
  want = data.SiteBatcher(x, y, parts, 3).batch_at(4)
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


def test_tfds_source_rows_equal_load_tfds(tfds_dir):
  ds = data.load_tfds("tiny_images", data_dir=tfds_dir)
  src = data.TfdsSource("tiny_images", "train", data_dir=tfds_dir)
  assert len(src) == len(ds.x_train) and src.num_classes == 3
  parts = data.partition(ds.y_train, 3, "by_class")
  got = data.SitePipeline(src, parts, 2, sites=[1, 2]).batch_at(6)
  want = data.SiteBatcher(ds.x_train, ds.y_train, parts, 2).batch_at(6, [1, 2])
  np.testing.assert_array_equal(got[0], want[0])
  np.testing.assert_array_equal(got[1], want[1])


def test_iterator_state_saved_and_restored_through_orbax(tmp_path):
  import grain
  import orbax.checkpoint as ocp
  x = np.arange(80, dtype=np.float32).reshape(40, 2)
  y = np.arange(40, dtype=np.int32) % 4
  parts = data.partition(y, 4, "iid")
  pipe = data.SitePipeline(data.ArraySource(x, y), parts, 2, seed=5)
  for t in range(7):
    pipe.batch_at(t)
  expected = [pipe.batch_at(t)[0] for t in range(7, 10)]
  pipe.batch_at(7)  # moves back: the live iterator is at step 8
  with ocp.CheckpointManager(tmp_path / "ck") as mgr:
    mgr.save(8, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(
        pipe.checkpoint_item(8))))
    mgr.wait_until_finished()
    with pytest.raises(ValueError, match="at step 8"):
      pipe.checkpoint_item(9)
    fresh = data.SitePipeline(data.ArraySource(x, y), parts, 2, seed=5)
    it = mgr.restore(8, args=ocp.args.Composite(
        data=grain.checkpoint.CheckpointRestore(fresh.restore_item()))).data
  assert it.get_state() == {"next_index": 8}
  fresh.adopt(it, 8)
  np.testing.assert_array_equal(fresh.batch_at(8)[0], expected[1])
  np.testing.assert_array_equal(fresh.batch_at(9)[0], expected[2])
  with pytest.raises(ValueError, match="state is at step"):
    fresh.adopt(fresh.restore_item(), 3)
  pipe.close()
  fresh.close()


# ------------------------------------------------------------ dadjax train ---

TINY_LM = {"d_model": 16, "num_heads": 2, "num_layers": 1, "mlp_dim": 32}


def _text_config(tmp_path, **overrides):
  corpus = _corpus(tmp_path / "corpus", n_files=10, size=400)
  base = dict(dataset=f"text:{corpus}/*.txt", dataset_kwargs={"seq_len": 16},
              model="transformer_lm", model_kwargs=TINY_LM, num_sites=4, batch_per_site=2,
              steps=6, eval_every=3, backend="vmap", optimizer="adam", lr=1e-2,
              partition="by_class", pipeline="grain")
  return Config(**{**base, **overrides})


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
  """The uninterrupted 6-step grain run (vmap) every resumed run must reproduce exactly."""
  cfg = _text_config(tmp_path_factory.mktemp("whole"))
  return cfg, train(cfg, progress=False)


def test_train_with_grain_on_shard_map_equals_the_in_memory_path(tmp_path, whole):
  cfg = whole[0].replace(backend="shard_map", eval_every=6)
  grain_run = train(cfg, progress=False)
  memory = train(cfg.replace(pipeline="memory"), progress=False)
  assert grain_run.step_fn.local_sites == (0, 1, 2, 3)
  chex.assert_trees_all_close(grain_run.params, memory.params, atol=0, rtol=0)


@pytest.mark.slow  # about 23 s
def test_sigterm_mid_epoch_saves_the_read_ahead_pipeline_and_resumes_bit_identical(
    tmp_path, whole, capsys):
  import os
  import shutil
  import signal
  from dadjax.errors import Stopped
  cfg, ref = whole
  assert ref.steps_per_epoch > 6  # so steps 3 and 4 are in the middle of an epoch
  assert len(ref.dataset.x_train) == cfg.batch_per_site  # the corpus was not loaded
  ckpt = tmp_path / "ckpt"
  stopping = cfg.replace(eval_every=1, checkpoint_dir=str(ckpt), checkpoint_every=3,
                         pipeline_prefetch=3)

  def log(row):
    if row["step"] == 4:  # the pipeline has read steps 4.. ahead; its state says 4
      os.kill(os.getpid(), signal.SIGTERM)

  with pytest.raises(Stopped, match="at step 4; checkpoint 4 saved"):
    train(stopping, progress=False, log=log)
  saved = sorted(p.name for p in (ckpt / "4" / "data").glob("process_*"))
  assert saved == ["process_0-of-1.json"]  # Grain's handler: one file per process
  assert '"next_index": 4' in (ckpt / "4" / "data" / saved[0]).read_text()
  shutil.copytree(ckpt, tmp_path / "lost")
  shutil.copytree(ckpt, tmp_path / "other")
  resumed = train(stopping.replace(pipeline_prefetch=0), progress=False)  # not in the fingerprint
  assert [row["step"] for row in resumed.history] == [5, 6]
  chex.assert_trees_all_close(resumed.params, ref.params, atol=0, rtol=0)
  # A step that lost its pipeline state is damaged: the run resumes from the one before.
  shutil.rmtree(tmp_path / "lost" / "4" / "data")
  capsys.readouterr()
  again = train(stopping.replace(checkpoint_dir=str(tmp_path / "lost")), progress=False)
  err = capsys.readouterr().err
  assert "checkpoint step 4" in err and "no input pipeline state" in err
  assert "resuming from checkpoint step 3" in err
  chex.assert_trees_all_close(again.params, ref.params, atol=0, rtol=0)
  # Pipeline state written by another number of processes: refused, nothing deleted.
  data_dir = tmp_path / "other" / "4" / "data"
  (data_dir / "process_0-of-1.json").rename(data_dir / "process_0-of-2.json")
  with pytest.raises(ValueError, match="another number of processes"):
    train(stopping.replace(checkpoint_dir=str(tmp_path / "other")), progress=False)
  assert (data_dir / "process_0-of-2.json").is_file()


def test_pipeline_config_keys_are_checked():
  with pytest.raises(ValueError, match="config.pipeline must be one of"):
    Config(pipeline="tfdata")
  with pytest.raises(ValueError, match="config.pipeline_prefetch must be an int >= 0"):
    Config(pipeline_prefetch=-1)


# --------------------------------------------------------------- multihost ---

@pytest.mark.slow
@pytest.mark.multihost
def test_two_processes_read_their_own_rows_and_resume_like_the_one_process_run(tmp_path):
  # 2 processes x 2 CPU devices, `dadjax train` of gpt_tiny with pipeline=grain on a text
  # corpus: stopped after step 2 (steps=2; a checkpoint with one pipeline file per process), resumed
  # to step 4, it logs what one process on 4 sites logs uninterrupted.
  import subprocess
  import sys
  from test_multihost import _free_port
  from test_multihost_cli import _env, _wait
  corpus = _corpus(tmp_path / "corpus", n_files=10, size=400)
  ckpt = tmp_path / "ckpt"
  args = [f"dataset=text:{corpus}/*.txt", 'dataset_kwargs={"seq_len": 16}',
          "model=gpt_tiny", "num_sites=4",
          "batch_per_site=2", "eval_every=2", "optimizer=adam", "lr=0.01",
          "partition=by_class", "pipeline=grain", "checkpoint_every=2"]

  def cli(extra, processes):
    port, flags = _free_port(), []
    procs = []
    for i in range(processes):
      if processes > 1:
        flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                 "--process-id", str(i)]
      procs.append(subprocess.Popen(
          [sys.executable, "-m", "dadjax.cli", "train", "--no-progress", *flags, *args, *extra],
          env=_env(2 if processes > 1 else None), stdout=subprocess.PIPE,
          stderr=subprocess.PIPE, text=True))
    return _wait(procs)

  cli(["steps=2", f"checkpoint_dir={ckpt}"], 2)
  assert sorted(p.name for p in (ckpt / "2" / "data").glob("process_*")) == [
      "process_0-of-2.json", "process_1-of-2.json"]
  (rows0, err0), (rows1, err1) = cli(["steps=4", f"checkpoint_dir={ckpt}"], 2)
  ((whole, _),) = cli(["steps=4"], 1)
  assert "resuming from checkpoint step 2" in err0
  assert "sites [0, 1] of 4: host batch (4, 16)" in err0
  assert "sites [2, 3] of 4: host batch (4, 16)" in err1
  assert rows0 == rows1 and [r["step"] for r in rows0] == [4]
  for k in ("loss", "test_loss", "test_accuracy"):
    assert rows0[-1][k] == pytest.approx(whole[-1][k], rel=1e-5, abs=1e-6), k
