"""The notebooks run top to bottom, and are stored without outputs.

`transformer.ipynb` trains the transformer demo's runs at the sizes its test trains them,
so it runs in `test_transformer_demo.py`, after those runs, on the programs they compiled.
"""

import pathlib

import nbformat
import pytest
from helpers import run_notebooks

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
RUN_HERE = [p for p in NOTEBOOKS if p.name != "transformer.ipynb"]


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
  return run_notebooks(RUN_HERE, tmp_path_factory)


def test_there_are_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "porting.ipynb", "frameworks.ipynb",
                                         "transformer.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  assert all(not cell.get("outputs") for cell in notebook.cells)


@pytest.mark.parametrize("path", RUN_HERE, ids=lambda p: p.name)
def test_notebook_runs_top_to_bottom(path, errors):
  assert None not in errors, errors[None]  # a cell between notebooks failed
  assert path.name not in errors, errors[path.name][-6000:]
