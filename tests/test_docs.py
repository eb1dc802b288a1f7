"""The documentation site's sources: every public name has an API page, the layout page is the
tree, the front page links to pages that exist, and examples call only exported names.

Reads the sources (``docs/*.md``, the API pages ``docs/_apigen.py`` writes), never the HTML,
so it runs without building (``make docs`` builds, with warnings as errors).
"""
import ast
import functools
import importlib
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "dadjax"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


@functools.cache
def _apigen():
  sys.path.insert(0, str(DOCS))
  try:
    return importlib.import_module("_apigen")
  finally:
    sys.path.remove(str(DOCS))


def _public_modules():
  """Every public package of dadjax/ and every public top-level module with an ``__all__``."""
  names = ["dadjax"]
  for init in sorted(PACKAGE.glob("*/__init__.py")):
    if not init.parent.name.startswith("_"):  # private packages (the core) have no public face
      names.append(f"dadjax.{init.parent.name}")
  for module in sorted(PACKAGE.glob("*.py")):
    if not module.name.startswith("_") and "__all__" in module.read_text():
      names.append(f"dadjax.{module.stem}")
  return names


@functools.cache
def _api_pages() -> dict:
  """What each generated API page lists, by module name."""
  apigen = _apigen()
  home = apigen.homes()
  return {m: _listed(apigen.page_text(m, t, home)) for m, t in apigen.SECTIONS}


def _listed(page: str) -> dict:
  """The names a generated API page documents (autosummary entries) or links to."""
  own = re.findall(r"^   (\w+)$", page, re.M)
  elsewhere = dict(re.findall(r"^- `[\w.]+\.(\w+)`: \{py:obj\}`([\w.]+)`$", page, re.M))
  return {"own": own, "elsewhere": elsewhere}


def test_every_public_module_has_an_api_section():
  sections = [name for name, _ in _apigen().SECTIONS]
  assert len(sections) == len(set(sections))
  missing = sorted(set(_public_modules()) - set(sections))
  assert not missing, f"add to docs/_apigen.py SECTIONS: {missing}"
  assert not set(sections) - set(_public_modules()), "SECTIONS names a module that is gone"


@pytest.mark.parametrize("name", _public_modules())
def test_every_public_name_has_a_page(name):
  module = importlib.import_module(name)
  assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
  assert len(module.__all__) == len(set(module.__all__)), f"{name}: a name is listed twice"
  pages = _api_pages()
  listed = pages[name]
  for attr in module.__all__:
    assert hasattr(module, attr), f"{name}.{attr} is in __all__ but does not exist"
    value = getattr(module, attr)
    if isinstance(value, type(module)):  # a subpackage: its own section
      assert value.__name__ in pages, f"{value.__name__} has no API page"
    elif attr in listed["elsewhere"]:  # documented once, where it is defined
      target_module, target = listed["elsewhere"][attr].rsplit(".", 1)
      assert target in pages[target_module]["own"], f"{name}.{attr} links to a missing page"
      assert getattr(importlib.import_module(target_module), target) is value
    else:
      assert attr in listed["own"], f"{name}.{attr} has no API page"
  assert set(listed["own"]) | set(listed["elsewhere"]) <= set(module.__all__)


def test_layout_page_lists_every_package_and_top_level_module():
  text = (DOCS / "layout.md").read_text()
  block = re.search(r"^```text\n(.*?)^```", text, re.S | re.M).group(1)
  listed = {m.group(1).rstrip("/") for m in re.finditer(r"^(dadjax/\S+)", block, re.M)}
  tree = {f"dadjax/{p.parent.name}" for p in PACKAGE.glob("*/__init__.py")}
  tree |= {f"dadjax/{p.name}" for p in PACKAGE.glob("*.py")}
  assert sorted(tree - listed) == [], "docs/layout.md misses these; add a line for each"
  assert sorted(listed - tree) == [], "docs/layout.md lists what is no longer in dadjax/"


def test_front_page_is_short_and_its_links_resolve():
  assert len(README.read_text().splitlines()) <= 250
  for page in PAGES:
    for target in re.findall(r"\]\(([^)#:]+\.md)(?:#[\w-]+)?\)", page.read_text()):
      assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
  linked = set(re.findall(r"\]\(docs/([\w]+\.md)", README.read_text()))
  guides = {p.name for p in DOCS.glob("*.md")} - {"index.md"}
  assert guides - linked == set(), "the README links to every guide"


def test_every_guide_is_in_the_site():
  text = (DOCS / "index.md").read_text()
  entries = set(re.findall(r"^(\w+)$", text, re.M))
  guides = {p.stem for p in DOCS.glob("*.md")} - {"index"}
  assert guides - entries == set(), "docs/index.md's toctrees miss these pages"


def test_docs_call_only_exported_names():
  missing = set()
  for page in PAGES:
    for m in re.finditer(r"\bdadjax((?:\.[a-z_]+)*)\.([A-Za-z_]\w*)\(", page.read_text()):
      module = importlib.import_module("dadjax" + m.group(1))
      if m.group(2) not in module.__all__:
        missing.add(f"{page.name}: dadjax{m.group(1)}.{m.group(2)}")
  assert missing == set()


def test_docs_config_builds_offline():
  tree = ast.parse((DOCS / "conf.py").read_text())
  assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name)}
  extensions = ast.literal_eval(assigned["extensions"])
  assert "sphinx.ext.intersphinx" not in extensions  # no network
  assert ast.literal_eval(assigned["nb_execution_mode"]) == "off"  # committed outputs
  assert (DOCS / "notebooks").resolve() == (ROOT / "notebooks").resolve()
