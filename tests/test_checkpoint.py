"""Checkpoints reach orbax through its public API; what has no public route is in one module
whose test fails loudly when orbax moves it; nothing process-wide is installed on import.

The fault behaviour (full disks, read-only and vanishing directories, damaged steps) is in
tests/test_faults.py.
"""
import json
import logging
import subprocess
import sys
import warnings

import pytest

from dadjax.config import Config
from dadjax.run import CheckpointDir
from dadjax.run import _checkpoint, _orbax_internals


def test_orbax_internals_are_where_dadjax_expects():
  """Fails with the orbax version and the missing attribute when an orbax release moves them."""
  assert _orbax_internals.missing() == []
  _orbax_internals.check()  # raises OrbaxInternalsMoved naming them otherwise


@pytest.mark.parametrize("module,name", [
    ("orbax.checkpoint._src.futures.future", "_SignalingThread"),
    ("orbax.checkpoint._src.asyncio_utils", "_run_sync_via_new_loop"),
])
def test_a_moved_internal_is_named_with_the_orbax_version(monkeypatch, module, name):
  import importlib  # pylint: disable=g-import-not-at-top
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  monkeypatch.delattr(importlib.import_module(module), name)
  with pytest.raises(_orbax_internals.OrbaxInternalsMoved,
                     match=rf"orbax-checkpoint {ocp.__version__} lacks {module}\.{name}"):
    _orbax_internals.check()
  assert _orbax_internals.stop_writer_threads() == []  # without it: nothing to stop


_PROBE = """
import asyncio, json, logging, warnings
import absl.logging
import jax, flax, optax, numpy, orbax.checkpoint
from orbax.checkpoint._src import asyncio_utils

def snap():
  return {"warnings": repr(warnings.filters), "absl_verbosity": absl.logging.get_verbosity(),
          "policy": type(asyncio.get_event_loop_policy()).__name__,
          "filters": {n: repr(logging.getLogger(n).filters)
                      for n in ("", "absl", "asyncio", "jax", "orbax")},
          "orbax_loop": repr(asyncio_utils._run_sync_via_new_loop)}

before = snap()
import dadjax.run, dadjax.train
print(json.dumps([before, snap()]))
"""


def test_importing_the_run_layer_installs_nothing_process_wide():
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       check=True, timeout=300).stdout
  before, after = json.loads(out.strip().splitlines()[-1])
  assert after == before


def test_a_checkpoint_dir_scopes_its_log_filter_and_settles_orbax_loops(tmp_path):
  absl_filters = list(logging.getLogger("absl").filters)
  with CheckpointDir(tmp_path / "ckpt", Config()) as store:
    assert store._quiet in logging.getLogger("absl").filters  # pylint: disable=protected-access
    from orbax.checkpoint._src import asyncio_utils  # pylint: disable=g-import-not-at-top
    run_sync = asyncio_utils._run_sync_via_new_loop  # pylint: disable=protected-access
    assert getattr(run_sync, "_dadjax_settles", False)
  assert logging.getLogger("absl").filters == absl_filters


def test_a_failed_save_s_filters_end_with_it():
  before = (list(warnings.filters), list(logging.getLogger("asyncio").filters))
  with _checkpoint._dropping_failed_writes():  # pylint: disable=protected-access
    assert logging.getLogger("asyncio").filters != before[1]
  assert (list(warnings.filters), list(logging.getLogger("asyncio").filters)) == before


def test_own_steps_lists_only_dadjax_steps_through_the_public_name_format(tmp_path):
  for step in (3, 5):
    (tmp_path / str(step)).mkdir()
  (tmp_path / "3" / "meta").mkdir()  # dadjax's record: its own
  (tmp_path / "7").symlink_to(tmp_path / "3")  # a link: never its own
  names = _checkpoint._OwnSteps()  # pylint: disable=protected-access
  assert names.build_name(12) == "12"
  assert [m.step for m in names.find_all(tmp_path)] == [3]
  assert names.find_step(tmp_path, 3).step == 3
  for step in (5, 7):
    with pytest.raises(ValueError):
      names.find_step(tmp_path, step)
