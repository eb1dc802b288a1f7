"""Every notebook in notebooks/ executes top to bottom (quick settings)."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# The default suite executes the quickstart; the others (15-35 s each) run with -m slow. Every
# committed notebook's outputs are checked by default (test_committed_notebook_shows_its_outputs).
_EXECUTED_BY_DEFAULT = ("01_quickstart.ipynb",)


@pytest.mark.parametrize("path", [p if p.name in _EXECUTED_BY_DEFAULT else
                                  pytest.param(p, marks=pytest.mark.slow) for p in NOTEBOOKS],
                         ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
  monkeypatch.setenv("DADJAX_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebook_shows_its_outputs(path):
  # Committed with the outputs of a full-settings run (`make notebooks`), so a
  # reader sees the tables and plots without running anything.
  nb = nbformat.read(path, as_version=4)
  code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
  empty = [i for i in code if not nb.cells[i].get("outputs")]
  assert code and not empty, f"{path.name}: code cells {empty} have no outputs; run `make notebooks`"
  errors = [i for i in code for o in nb.cells[i].outputs if o.get("output_type") == "error"]
  assert not errors, f"{path.name}: cells {errors} hold errors"


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ is empty"
