"""The notebooks run top to bottom, and are stored without outputs."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "porting.ipynb", "frameworks.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, tmp_path):
  notebook = nbformat.read(path, as_version=4)
  assert all(not cell.get("outputs") for cell in notebook.cells), "store notebooks clean"
  NotebookClient(notebook, timeout=120, kernel_name="python3",
                 resources={"metadata": {"path": str(tmp_path)}}).execute()
