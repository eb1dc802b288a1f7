"""The API reference's pages, written from each public package's ``__all__`` at build time.

One page per public package (``api/<package>.md``): the package's docstring, then an
autosummary table whose ``:toctree:`` makes Sphinx write one page per name. A name in
``__all__`` that is itself a package links to that package's page. The pages are generated
(and ignored by git), so a name added to or removed from an ``__all__`` is documented or
dropped without editing the docs; ``tests/test_docs.py`` checks that every public package has
a section here.
"""

from __future__ import annotations

import importlib
import pathlib
import types

# Every public package (and public module with an ``__all__``) with its one-line title; the
# order is the reference's.
SECTIONS = [
    ("dadjax", "the public face"),
    ("dadjax.compress", "compressors, their states and the optax transform"),
    ("dadjax.comm", "the ledger, the baseline, collectives and the network model"),
    ("dadjax.dad", "dAD / rank-dAD layers and their synchronization"),
    ("dadjax.dataquant", "quantizing data instead of gradients"),
    ("dadjax.adaptive", "Accordion: critical-regime detection and switching"),
    ("dadjax.local", "local updates: local SGD, DiLoCo, Streaming DiLoCo, SparseLoCo, DeMo"),
    ("dadjax.parallel", "meshes and the SPMD train step"),
    ("dadjax.elastic", "sites that come and go: the lighthouse and elastic DiLoCo"),
    ("dadjax.pod", "a step compiled by the TPU compiler for a named topology, and its report"),
    ("dadjax.nnx", "Flax NNX models in the train step"),
    ("dadjax.data", "data sets, site partitions, the Grain pipeline per host"),
    ("dadjax.models", "Flax models with a swappable dense factory"),
    ("dadjax.registry", "methods by name"),
    ("dadjax.extend", "building blocks for writing new methods"),
    ("dadjax.run", "the run layer: a run from a Config, checkpoints, the CLI and the demo"),
    ("dadjax.netlab", "one process per site behind real, shaped links"),
    ("dadjax.errors", "the errors a user sees"),
    ("dadjax.methods", "the baselines and build_method"),
    ("dadjax.train", "a stable import path to the run layer's train"),
    ("dadjax.config", "a stable import path to the run layer's Config"),
    ("dadjax.cli", "a stable import path to the dadjax command"),
    ("dadjax.stage", "a stable import path to the batch-stage protocol"),
]


def _key(name: str, value) -> tuple:
  """What identifies an exported thing: the object; for plain values (interned ints and
  strings are shared by unrelated constants) the object and its name."""
  return (id(value),) if callable(value) else (id(value), name)


def homes() -> dict[tuple, str]:
  """Where each public object is documented: ``_key(name, object) -> "package.name"``.

  An object exported by several packages (``dadjax.topk`` is ``dadjax.compress.topk``) gets
  one page, under the package whose tree defines it (else the first section exporting it);
  the other packages' lists link there.
  """
  found: dict[tuple, list[str]] = {}
  for module_name, _ in SECTIONS:
    module = importlib.import_module(module_name)
    for name in module.__all__:
      value = getattr(module, name)
      if not isinstance(value, types.ModuleType):
        found.setdefault(_key(name, value), []).append(f"{module_name}.{name}")
  out = {}
  for key, places in found.items():
    obj_module = None
    for place in places:
      package, name = place.rsplit(".", 1)
      obj_module = getattr(getattr(importlib.import_module(package), name), "__module__", None)
      break
    inside = [p for p in places
              if obj_module and (obj_module + ".").startswith(p.rsplit(".", 1)[0] + ".")
              and p.rsplit(".", 1)[0] != "dadjax"]
    out[key] = (inside or places)[0]
  return out


def page_text(module_name: str, title: str, home: dict[tuple, str]) -> str:
  """The MyST source of one package's reference page."""
  module = importlib.import_module(module_name)
  own, elsewhere, packages = [], [], []
  for name in module.__all__:
    value = getattr(module, name)
    if isinstance(value, types.ModuleType):
      packages.append(name)
    elif home[_key(name, value)] == f"{module_name}.{name}":
      own.append(name)
    else:
      elsewhere.append((name, home[_key(name, value)]))
  lines = [f"# `{module_name}`: {title}", "", "```{eval-rst}",
           f".. automodule:: {module_name}", "   :no-members:", "```", ""]
  if packages:
    lines += ["Packages: " + ", ".join(f"[`{module_name}.{p}`]({module_name}.{p}.md)"
                                       for p in packages) + ".", ""]
  if own:
    lines += ["```{eval-rst}", f".. currentmodule:: {module_name}", "",
              ".. autosummary::", "   :toctree: _autosummary", ""]
    lines += [f"   {name}" for name in own]
    lines += ["```", ""]
  if elsewhere:
    lines += ["Also exported here (documented where they are defined):", ""]
    lines += [f"- `{module_name}.{name}`: {{py:obj}}`{target}`" for name, target in elsewhere]
    lines += [""]
  return "\n".join(lines)


def write_pages(out_dir: pathlib.Path) -> list[pathlib.Path]:
  """Writes ``<package>.md`` for every section into ``out_dir``; returns the paths."""
  out_dir.mkdir(parents=True, exist_ok=True)
  home = homes()
  written = []
  for module_name, title in SECTIONS:
    path = out_dir / f"{module_name}.md"
    text = page_text(module_name, title, home)
    if not path.exists() or path.read_text() != text:  # unchanged files keep Sphinx's cache
      path.write_text(text)
    written.append(path)
  return written
