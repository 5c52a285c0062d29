"""README, the guide and the notebooks: every Python block and code cell runs, notebooks are
stored without outputs, every link resolves, the site builds cleanly with the notebooks
rendered, and CI runs README's test command.

`transformer.ipynb` trains two of the transformer demo's runs at the sizes its test trains
them, so it runs in `test_transformer_demo.py`, after those runs, on the programs they
compiled.
"""

import json
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest
from code_blocks import blocks
from helpers import clean_env

ROOT = pathlib.Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


RUNNABLE = [d for d in DOCUMENTS if blocks(d)] + [
    p for p in NOTEBOOKS if p.name != "transformer.ipynb"]


@pytest.fixture(scope="module")
def ran_documents(tmp_path_factory):
  """Every document's blocks and every notebook's cells, run by `code_blocks.py` in one
  subprocess (JAX starts once), each document in a namespace of its own: `({document's
  name: None, or the traceback}, the subprocess's exit status, its output)`."""
  report = tmp_path_factory.mktemp("code_blocks") / "report.json"
  result = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "code_blocks.py"), "--report", str(report),
       *map(str, RUNNABLE)],
      env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      capture_output=True, text=True, timeout=600, cwd=ROOT / "tests",
  )
  failures = json.loads(report.read_text()) if report.exists() else {}
  return failures, result.returncode, result.stdout[-3000:] + result.stderr[-6000:]


@pytest.mark.parametrize("document", RUNNABLE, ids=lambda p: p.name)
def test_every_python_block_runs(document, ran_documents):
  failures, returncode, output = ran_documents
  assert document.name in failures, output  # the process ended before this document ran
  assert failures[document.name] is None, failures[document.name][-6000:]
  assert returncode == any(failures.values()), output  # nothing failed after the documents


def test_there_are_notebooks():
  assert {p.name for p in NOTEBOOKS} >= {"quickstart.ipynb", "porting.ipynb", "frameworks.ipynb",
                                         "transformer.ipynb"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
  notebook = nbformat.read(path, as_version=4)
  assert all(not cell.get("outputs") for cell in notebook.cells)


def test_the_docs_build_without_warnings_with_the_notebooks_rendered(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       str(ROOT / "docs"), str(tmp_path)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  api = (tmp_path / "api.html").read_text()
  for name in ("loss_scaling", "apply_gradients", "scaled_value_and_grad", "get_policy",
               "TrainState", "DynamicLossScale", "presets.pytorch"):
    assert name in api, name
  for notebook in NOTEBOOKS:
    page = (tmp_path / "notebooks" / f"{notebook.stem}.html").read_text()
    assert "jax_lossscale" in page, notebook.name


def test_readmes_relative_links_point_at_files_of_the_repository():
  readme = (ROOT / "README.md").read_text()
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
  local = [t for t in targets if "://" not in t]
  assert local
  for target in local:
    assert (ROOT / target).exists(), target


def test_readmes_first_training_step_is_the_fused_one():
  first = blocks(ROOT / "README.md")[0][1]
  assert "tx.apply_gradients(" in first and "tx.update(" not in first


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  command = next(line.strip() for line in ci.splitlines() if "pytest" in line)
  assert command in readme
  assert ".venv/bin/python -m jax_lossscale.demo" in readme
