"""README, the guide and the notebooks: every Python block and code cell runs, notebooks are
stored without outputs, every link resolves, the site builds cleanly with the notebooks run
(their outputs and plots on their pages), and CI runs README's test command.

The Markdown documents' blocks run in `code_blocks.py`; the notebooks run once, in the
docs' build, where myst-nb executes each in a fresh kernel and a cell that raises fails
the build (`nb_execution_raise_on_error` in docs/conf.py).
"""

import ast
import json
import pathlib
import re
import subprocess
import sys
import tomllib
import types

import nbformat
import pytest
from ci_script import ci_environments
from ci_script import recorded
from code_blocks import blocks
from helpers import clean_env

ROOT = pathlib.Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


RUNNABLE = [d for d in DOCUMENTS if blocks(d)]


@pytest.fixture(scope="module")
def ran_documents(tmp_path_factory):
  """Every Markdown document's blocks, run by `code_blocks.py` in one subprocess (JAX
  starts once), each document in a namespace of its own: `({document's name: None, or the
  traceback}, the subprocess's exit status, its output)`."""
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


def test_the_docs_build_without_warnings_with_the_notebooks_run(tmp_path):
  # As `sphinx-build docs docs/_build` builds it: myst-nb wrote the executed notebooks
  # beside the output directory (docs/jupyter_execute/, in the checkout).
  build = tmp_path / "_build"
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       str(ROOT / "docs"), str(build)],
      capture_output=True, text=True, timeout=1800)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  assert [path.name for path in tmp_path.iterdir()] == ["_build"]
  api = (build / "api.html").read_text()
  for name in ("loss_scaling", "apply_gradients", "scaled_value_and_grad", "get_policy",
               "TrainState", "DynamicLossScale", "presets.pytorch"):
    assert name in api, name
  for notebook in NOTEBOOKS:  # every code cell ran, in order, and none raised
    executed = nbformat.read(build / ".doctrees" / "jupyter_execute" / "notebooks"
                             / notebook.name, as_version=4)
    code = [cell for cell in executed.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), notebook
    assert not [output for cell in code for output in cell.outputs
                if output.output_type == "error"], notebook.name
    page = (build / "notebooks" / f"{notebook.stem}.html").read_text()
    assert "jax_lossscale" in page and 'class="cell_output' in page, notebook.name
    if notebook.stem != "porting":  # the others end in a plot
      assert '<img alt="../_images/' in page, notebook.name


def test_readmes_relative_links_point_at_files_of_the_repository():
  readme = (ROOT / "README.md").read_text()
  targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
  local = [t for t in targets if "://" not in t]
  assert local
  for target in local:
    assert (ROOT / target).exists(), target


def test_readmes_table_of_contents_links_every_page_of_the_guide():
  readme = (ROOT / "README.md").read_text()
  table = readme[readme.index("## What is inside"):].split("\n\n")[1]
  linked = set(re.findall(r"\]\(docs/([^)#\s]+\.md)", table))
  pages = {page.name for page in (ROOT / "docs").glob("*.md")}
  assert pages - linked == {"index.md", "demos.md"}  # the demos': from README's demo section


def test_readmes_first_training_step_is_the_fused_one():
  first = blocks(ROOT / "README.md")[0][1]
  methods = {node.func.attr for node in ast.walk(ast.parse(first))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
  assert "apply_gradients" in methods and "update" not in methods


def _readmes_command(word: str) -> str:
  """The one line of README's ```bash blocks that holds `word`."""
  readme = (ROOT / "README.md").read_text()
  [line] = [line for block in re.findall(r"^```bash\n(.*?)^```$", readme, re.M | re.S)
            for line in block.splitlines() if word in line]
  return line


def test_ci_runs_the_readme_test_command(tmp_path):
  (tmp_path / "readme").mkdir()
  readme = [call[:2] for call in recorded(_readmes_command("pytest"), tmp_path / "readme")]
  (tmp_path / "ci").mkdir()
  environments = ci_environments(ROOT, tmp_path / "ci")
  assert len(environments) == 2
  for calls in environments:
    assert [call[:2] for call in calls[:len(readme)]] == readme
  assert readme[-1] == (".venv/bin/python", ("-m", "pytest"))


def test_readmes_demo_command_runs_the_demo_module(tmp_path):
  import importlib.util

  calls = recorded(_readmes_command("jax_lossscale.demo"), tmp_path)
  assert calls[-1].args == ("-m", "jax_lossscale.demo")
  assert importlib.util.find_spec("jax_lossscale.demo.__main__") is not None


def _distribution_name(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def _installed_by(extra: str) -> set[str]:
  """The distributions `pip install .[extra]` installs (its requirements, the package's
  own, and theirs, as the installed packages' metadata states them)."""
  import importlib.metadata

  from packaging.requirements import Requirement

  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  pending = [Requirement(r) for r in project["dependencies"] +
             project["optional-dependencies"][extra]]
  found = set()
  while pending:
    requirement = pending.pop()
    name = _distribution_name(requirement.name)
    if name == "jax-lossscale":
      pending += [Requirement(r) for extra_named in requirement.extras
                  for r in project["optional-dependencies"][extra_named]]
    elif name not in found:
      found.add(name)
      try:
        needs = importlib.metadata.requires(name) or []
      except importlib.metadata.PackageNotFoundError:
        continue
      pending += [r for r in map(Requirement, needs)
                  if r.marker is None or r.marker.evaluate({"extra": ""})]
  return found


def _imported_modules(code: str) -> set[str]:
  """The absolute imports of `code`, anywhere in it."""
  found = set()
  for node in ast.walk(ast.parse(code)):
    if isinstance(node, ast.Import):
      found |= {alias.name for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.level == 0:
      found |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
  return found


def _third_party_imports(modules: set[str]) -> set[str]:
  """The top-level packages `modules` import, following the package's own modules
  through their module-level imports."""
  import importlib.util

  found, seen, pending = set(), set(), list(modules)
  while pending:
    module = pending.pop()
    top = module.split(".")[0]
    if top != "jax_lossscale":
      found.add(top)
      continue
    try:  # `module` may name a function or class of a module
      spec = importlib.util.find_spec(module) if module not in seen else None
    except (ImportError, AttributeError):
      spec = None
    seen.add(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
      continue
    body = ast.parse(pathlib.Path(spec.origin).read_text()).body
    pending += [name for node in body if isinstance(node, (ast.Import, ast.ImportFrom))
                for name in _imported_modules(ast.unparse(node))]
  return found - set(sys.stdlib_module_names) - {"__future__"}


def test_the_docs_extra_installs_every_package_the_guide_and_the_notebooks_import():
  import importlib.metadata

  documents = [*sorted((ROOT / "docs").glob("*.md")), *NOTEBOOKS]
  imported = _third_party_imports(
      {module for document in documents for _, code in blocks(document)
       for module in _imported_modules(code)})
  assert {"equinox", "jmp", "sklearn", "matplotlib"} <= imported  # what a guide reads
  installed = _installed_by("docs")
  distributions = importlib.metadata.packages_distributions()
  missing = {top for top in imported
             if not {_distribution_name(d) for d in distributions.get(top, [])} & installed}
  assert not missing, f"imported by the docs, not installed by [docs]: {sorted(missing)}"


def test_every_public_name_of_every_public_module_is_on_the_api_page():
  import importlib

  api = (ROOT / "docs" / "api.md").read_text()
  modules = ["jax_lossscale", "jax_lossscale.diagnostics", "jax_lossscale.presets",
             "jax_lossscale.tensorflow", "jax_lossscale.jmp", "jax_lossscale.flax"]
  missing = []
  for name in modules:
    module = importlib.import_module(name)
    for public in module.__all__:
      if isinstance(getattr(module, public), types.ModuleType):
        continue  # a module: documented by its own names
      if not re.search(rf"{re.escape(name)}\.{re.escape(public)}\b|"
                       rf"automodule:: {re.escape(name)}\n\s+:members:\n", api):
        missing.append(f"{name}.{public}")
  assert not missing, missing
