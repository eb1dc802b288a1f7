"""Checkpoints reach orbax through its public API only; nothing process-wide is installed on
import, and what a save installs lasts as long as the save.

The fault behaviour (full disks, read-only and vanishing directories, damaged steps) is in
tests/test_faults.py.
"""
import ast
import asyncio
import json
import logging
import pathlib
import subprocess
import sys
import threading
import types
import warnings

import jax.numpy as jnp
import pytest

import dadjax
from dadjax.config import Config
from dadjax.run import CheckpointDir
from dadjax.run import _checkpoint

PACKAGE = pathlib.Path(dadjax.__file__).resolve().parent


def _modules():
  return sorted(PACKAGE.rglob("*.py"))


def _orbax_imports(tree: ast.AST) -> tuple[list[tuple[int, str]], set[str]]:
  """Every orbax module path a module imports (with its line), and the names bound to them."""
  paths, names = [], set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        if alias.name.split(".")[0] == "orbax":
          paths.append((node.lineno, alias.name))
          names.add(alias.asname or alias.name.split(".")[0])
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module.split(".")[0] == "orbax":
        for alias in node.names:
          paths.append((node.lineno, f"{node.module}.{alias.name}"))
          names.add(alias.asname or alias.name)
    elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
      func = node.func  # importlib.import_module("orbax...") / __import__("orbax...")
      called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
      value = node.args[0].value
      if (called in ("import_module", "__import__") and isinstance(value, str)
          and value.split(".")[0] == "orbax"):
        paths.append((node.lineno, value))
  return paths, names


def _root(node: ast.AST) -> str | None:
  while isinstance(node, (ast.Attribute, ast.Subscript)):
    node = node.value
  return node.id if isinstance(node, ast.Name) else None


def _private_orbax_use(source: str, where: str) -> list[str]:
  """``where:line: what`` for each private orbax import or orbax attribute assignment."""
  tree = ast.parse(source, filename=where)
  imports, names = _orbax_imports(tree)
  found = [f"{where}:{line}: imports {module}" for line, module in imports
           if any(part.startswith("_") for part in module.split("."))]
  for node in ast.walk(tree):
    targets = []
    if isinstance(node, ast.Assign):
      targets = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
      targets = [node.target]
    elif isinstance(node, ast.Delete):
      targets = node.targets
    for target in targets:
      for t in (target.elts if isinstance(target, (ast.Tuple, ast.List)) else [target]):
        if isinstance(t, ast.Attribute) and _root(t) in names:
          found.append(f"{where}:{node.lineno}: assigns to {ast.unparse(t)}")
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
        and node.func.id in ("setattr", "delattr") and node.args
        and _root(node.args[0]) in names):
      found.append(f"{where}:{node.lineno}: {node.func.id} on {ast.unparse(node.args[0])}")
  return found


def test_no_dadjax_module_reaches_into_orbax():
  """No private orbax module is imported, and no orbax module's attribute is (re)assigned."""
  modules = _modules()
  assert PACKAGE / "run" / "_checkpoint.py" in modules
  assert _orbax_imports(ast.parse((PACKAGE / "run" / "_checkpoint.py").read_text()))[0]
  found = [line for path in modules
           for line in _private_orbax_use(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
  assert found == []


@pytest.mark.parametrize("source,what", [
    ("from orbax.checkpoint._src import asyncio_utils", "imports orbax.checkpoint._src"),
    ("import orbax.checkpoint._src.asyncio_utils as a", "imports orbax.checkpoint._src"),
    ("import importlib\nimportlib.import_module('orbax.checkpoint._src.futures')",
     "imports orbax.checkpoint._src"),
    ("import orbax.checkpoint as ocp\nocp.CheckpointManager = None", "assigns to ocp."),
    ("import orbax.checkpoint as ocp\nocp.args.StandardSave.x = 1", "assigns to ocp.args."),
    ("from orbax.checkpoint import args\nsetattr(args, 'x', 1)", "setattr on args"),
    ("import orbax\ndel orbax.checkpoint", "assigns to orbax.checkpoint"),
])
def test_the_orbax_scan_sees_private_imports_and_assignments(source, what):
  found = _private_orbax_use(source + "\n", "m.py")
  assert len(found) == 1 and what in found[0], found


def test_public_orbax_use_is_not_flagged():
  source = ("import orbax.checkpoint as ocp\nimport os\nos.environ = {}\n"
            "m = ocp.CheckpointManager('d')\nm.x = 1\nfrom dadjax.run import _checkpoint\n")
  assert _private_orbax_use(source, "m.py") == []


_PROBE = """
import asyncio, json, logging, sys, warnings
import absl.logging
import jax, flax, optax, numpy, orbax.checkpoint

def snap():
  return {"warnings": repr(warnings.filters), "absl_verbosity": absl.logging.get_verbosity(),
          "policy": type(asyncio.get_event_loop_policy()).__name__,
          "unraisablehook": repr(sys.unraisablehook),
          "filters": {n: repr(logging.getLogger(n).filters)
                      for n in ("", "absl", "asyncio", "jax", "orbax")}}

before = snap()
import dadjax.run, dadjax.train
print(json.dumps([before, snap()]))
"""


def test_importing_the_run_layer_installs_nothing_process_wide():
  out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                       check=True, timeout=300).stdout
  before, after = json.loads(out.strip().splitlines()[-1])
  assert after == before


def test_saves_are_synchronous_and_leave_no_writer_behind(tmp_path):
  absl_filters = list(logging.getLogger("absl").filters)
  hook = sys.unraisablehook
  with CheckpointDir(tmp_path / "ckpt", Config()) as store:
    assert store._quiet in logging.getLogger("absl").filters  # pylint: disable=protected-access
    store.save(3, {"w": jnp.arange(8.0)})
    # finalized when save returns: the step is on disk, no temporary directory, no writer
    assert store.finished_step() == 3 and store.latest_step() == 3
    assert not list((tmp_path / "ckpt").glob("*orbax-checkpoint-tmp*"))
    assert [t.name for t in threading.enumerate() if not t.daemon] == ["MainThread"]
    assert sys.unraisablehook is hook  # what a save installs ends with it
  assert logging.getLogger("absl").filters == absl_filters


def _closed_loop_report():
  """What Python hands ``sys.unraisablehook`` when a write completes on a closed loop."""
  loop = asyncio.new_event_loop()
  loop.close()
  try:
    loop.call_soon_threadsafe(lambda: None)
  except RuntimeError as e:
    return types.SimpleNamespace(exc_type=RuntimeError, exc_value=e, exc_traceback=e.__traceback__,
                                 err_msg=None, object=None)
  raise AssertionError("a closed loop accepted a callback")


def test_a_save_drops_only_the_reports_of_writes_on_a_closed_loop():
  seen = []
  previous, sys.unraisablehook = sys.unraisablehook, seen.append
  try:
    report = _closed_loop_report()
    other = types.SimpleNamespace(**{**vars(report), "exc_value": RuntimeError("other")})
    owned = types.SimpleNamespace(**{**vars(report), "object": object()})
    with _checkpoint._quiet_save():  # pylint: disable=protected-access
      sys.unraisablehook(report)
      sys.unraisablehook(other)
      sys.unraisablehook(owned)
      assert logging.getLogger("asyncio").filters
    assert seen == [other, owned]  # everything else reaches the hook that was in place
    assert sys.unraisablehook == seen.append
    sys.unraisablehook(report)  # outside a save: reported as usual
    assert seen == [other, owned, report]
  finally:
    sys.unraisablehook = previous


def test_a_save_s_filters_end_with_it():
  before = (list(warnings.filters), list(logging.getLogger("asyncio").filters),
            sys.unraisablehook)
  with pytest.raises(ValueError):
    with _checkpoint._quiet_save():  # pylint: disable=protected-access
      assert logging.getLogger("asyncio").filters != before[1]
      assert sys.unraisablehook is not before[2]
      raise ValueError("a failed save")
  assert (list(warnings.filters), list(logging.getLogger("asyncio").filters),
          sys.unraisablehook) == before


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
