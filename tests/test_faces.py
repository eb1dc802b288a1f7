"""Packages talk through their faces.

A package of dadjax (a directory with an ``__init__.py``) is imported by
other code through its face (``dadjax.comm``, never ``dadjax.comm._ledger``),
and every name imported across packages is in the exporter's ``__all__``.
``dadjax._core`` has no face: its modules are imported by their full path
(``dadjax._core.trees``), so each of them lists what it exports in its own
``__all__``.
"""

import ast
import importlib
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "dadjax"


def _module_name(path: pathlib.Path) -> str:
  parts = path.relative_to(ROOT).with_suffix("").parts
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package_of(module: str) -> str:
  """``dadjax.comm._ledger`` -> ``dadjax.comm``; a root module (``dadjax.extend``) -> ``dadjax``."""
  parts = module.split(".")
  if len(parts) > 1 and (PACKAGE / parts[1]).is_dir():
    return ".".join(parts[:2])
  return "dadjax"


def _imports(path: pathlib.Path):
  """``(module, names)`` of every absolute ``dadjax`` import in a file (names: () for ``import m``)."""
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith(
        "dadjax"):
      yield node.module, tuple(a.name for a in node.names)
    elif isinstance(node, ast.Import):
      for a in node.names:
        if a.name.startswith("dadjax"):
          yield a.name, ()


def _is_private(module: str) -> bool:
  return any(part.startswith("_") for part in module.split(".")[1:])


def _sources():
  return sorted(PACKAGE.rglob("*.py"))


def _crossings():
  """``(importer, imported module, names)`` for imports from another package."""
  for path in _sources():
    importer = _module_name(path)
    for module, names in _imports(path):
      if _package_of(module) != _package_of(importer):
        yield importer, module, names


def test_no_package_reaches_into_another_packages_private_modules():
  bad = sorted({(importer, module) for importer, module, _ in _crossings()
                if _is_private(module) and _package_of(module) != "dadjax._core"})
  assert bad == [], "import these through the package's face:\n" + "\n".join(
      f"  {i} imports {m}" for i, m in bad)


def test_every_name_imported_across_packages_is_in_the_exporters_all():
  bad = []
  for importer, module, names in _crossings():
    exporter = importlib.import_module(module)
    exported = getattr(exporter, "__all__", None)
    for name in names:
      if importlib.util.find_spec(f"{module}.{name}") if _is_subpackage(module) else False:
        continue  # ``from dadjax import comm``: a module, not a name
      if exported is None or name not in exported:
        bad.append(f"{importer}: {module}.{name}")
  assert bad == [], "names imported across packages must be in the exporter's __all__:\n" + (
      "\n".join(sorted(set(bad))))


def _is_subpackage(module: str) -> bool:
  spec = importlib.util.find_spec(module)
  return spec is not None and spec.submodule_search_locations is not None


@pytest.mark.parametrize("path", sorted((PACKAGE / "_core").glob("[!_]*.py")), ids=lambda p: p.name)
def test_each_core_module_lists_what_it_exports(path):
  module = importlib.import_module(_module_name(path))
  assert hasattr(module, "__all__"), f"{path.name} needs an __all__"
  missing = [n for n in module.__all__ if not hasattr(module, n)]
  assert missing == [], (path.name, missing)


def test_the_checks_see_a_violation(tmp_path, monkeypatch):
  """The crossing finder is not vacuous: a module reaching into a private module is found."""
  fake = tmp_path / "dadjax"
  (fake / "alpha").mkdir(parents=True)
  (fake / "beta").mkdir()
  (fake / "alpha" / "__init__.py").write_text("")
  (fake / "beta" / "__init__.py").write_text("")
  (fake / "alpha" / "_x.py").write_text(
      "from dadjax.beta._y import z\nfrom dadjax.alpha._w import v\nfrom dadjax.beta import u\n")
  this = sys.modules[__name__]
  monkeypatch.setattr(this, "ROOT", tmp_path)
  monkeypatch.setattr(this, "PACKAGE", fake)
  found = list(_crossings())
  assert ("dadjax.alpha._x", "dadjax.beta._y", ("z",)) in found
  assert ("dadjax.alpha._x", "dadjax.beta", ("u",)) in found
  assert all(m != "dadjax.alpha._w" for _, m, _ in found)  # inside its own package: allowed


def test_no_function_over_80_lines_without_a_reason():
  long = []
  for path in _sources():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        reason = "Long because" in (ast.get_docstring(node) or "")
        if node.end_lineno - node.lineno + 1 > 80 and not reason:
          long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
  assert long == [], "split these, or say in the docstring 'Long because ...':\n" + "\n".join(long)
