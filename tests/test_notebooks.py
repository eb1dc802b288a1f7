"""Every notebook in notebooks/ executes top to bottom (quick settings)."""
import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, monkeypatch):
  monkeypatch.setenv("DADJAX_NOTEBOOK_STEPS", "20")
  monkeypatch.setenv("MPLBACKEND", "Agg")
  nb = nbformat.read(path, as_version=4)
  NotebookClient(nb, timeout=300, kernel_name="python3",
                 resources={"metadata": {"path": str(path.parent)}}).execute()
  errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
            if o.get("output_type") == "error"]
  assert not errors


def test_there_are_notebooks():
  assert NOTEBOOKS, "notebooks/ is empty"
