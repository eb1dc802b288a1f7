"""Sphinx configuration: MyST pages, the API reference from the docstrings, notebooks as committed.

``make docs`` builds it with warnings as errors. Nothing here reaches the network: no
intersphinx, and the notebooks are rendered from their committed outputs, never executed.
"""

import os
import pathlib
import sys
import types

HERE = pathlib.Path(__file__).parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
# dadjax's imports must not need an accelerator to be documented.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import _apigen  # pylint: disable=wrong-import-position
import dadjax  # pylint: disable=wrong-import-position

project = "dadjax"
copyright = "the dadjax authors"  # pylint: disable=redefined-builtin
release = dadjax.__version__

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]

# The API reference: one page per public package, written from its __all__ now, and one page
# per name, written by autosummary.
_apigen.write_pages(HERE / "api")
autosummary_generate = True
autosummary_imported_members = True
autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "short"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
templates_path = ["_templates"]

# MyST: the guides are Markdown; notebooks show their committed outputs.
nb_execution_mode = "off"
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
# .rst first: autosummary writes its per-name pages with the first suffix.
source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}

exclude_patterns = ["_build", "**.ipynb_checkpoints"]

html_theme = "sphinx_book_theme"
html_title = "dadjax"
html_theme_options = {"show_toc_level": 2, "collapse_navigation": True, "navigation_depth": 2}
# The per-name pages go without the navigation sidebar: rendering it on each of the ~400
# pages was 3/4 of the build's time.
html_sidebars = {"api/_autosummary/*": []}

# A class's fields are described once, by its docstring's "Attributes:" section (one
# attribute entry each); :members: adds the methods and properties only (see _methods_only).
napoleon_use_ivar = False


def _drop_inherited_docstring(app, what, name, obj, options, lines):
  """A module-level constant (a dict, a tuple) has no docstring of its own: autodoc would
  show its type's (``dict``'s), which is neither about dadjax nor valid reST."""
  del app, name, options
  inherited = type(obj).__doc__
  if what in ("data", "attribute") and lines and isinstance(inherited, str) and inherited.strip():
    if lines[0].strip() == inherited.strip().splitlines()[0].strip():
      lines[:] = []


def _methods_only(app, what, name, obj, skip, options):
  """Of a class's members, methods and properties get entries; fields and constants do not
  (the docstring's "Attributes:" describe them; a NamedTuple field's own text is "Alias for
  field number 0")."""
  del app, options
  if what != "class" or skip:
    return None
  if isinstance(obj, property):
    return None
  if isinstance(obj, (types.FunctionType, types.MethodType, classmethod, staticmethod)):
    # A method of the class, not a function stored as a field's default (an initializer).
    return None if getattr(obj, "__qualname__", "").endswith("." + name) else True
  return True


def setup(app):
  app.connect("autodoc-process-docstring", _drop_inherited_docstring)
  app.connect("autodoc-skip-member", _methods_only)
