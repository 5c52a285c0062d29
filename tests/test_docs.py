"""README and the docs: every Python block runs, the API reference builds cleanly."""

import ast
import os
import pathlib
import subprocess
import sys

import pytest
from code_blocks import blocks

ROOT = pathlib.Path(__file__).parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def clean_env(**extra):
  env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_"))}
  env.update(extra)
  return env


def test_readme_and_the_docs_index_have_python_blocks():
  assert len(blocks(ROOT / "README.md")) >= 6 and blocks(ROOT / "docs" / "index.md")


@pytest.mark.parametrize("document", [d for d in DOCUMENTS if blocks(d)], ids=lambda p: p.name)
def test_every_python_block_runs(document):
  result = subprocess.run(
      [sys.executable, str(ROOT / "tests" / "code_blocks.py"), str(document)],
      env=clean_env(XLA_FLAGS="--xla_force_host_platform_device_count=8"),
      capture_output=True, text=True, timeout=600, cwd=ROOT / "tests",
  )
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def test_the_api_reference_builds_without_warnings(tmp_path):
  result = subprocess.run(
      [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
       str(ROOT / "docs"), str(tmp_path)],
      capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  api = (tmp_path / "api.html").read_text()
  for name in ("loss_scaling", "apply_gradients", "scaled_value_and_grad", "get_policy",
               "TrainState", "DynamicLossScale", "presets.pytorch"):
    assert name in api, name


def test_readmes_first_training_step_is_the_fused_one():
  first = blocks(ROOT / "README.md")[0][1]
  assert "tx.apply_gradients(" in first and "tx.update(" not in first


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  command = next(line for line in ci.splitlines() if "pytest" in line)
  assert command in readme
  assert ".venv/bin/python -m jax_lossscale.demo" in readme


def _code_lines(lines: list[str]) -> int:
  return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def test_every_module_is_a_room_of_at_most_350_lines_and_50_code_lines_a_function():
  for path in sorted((ROOT / "jax_lossscale").rglob("*.py")):
    source = path.read_text()
    lines = source.split("\n")
    assert source.count("\n") <= 350, path.name
    for node in ast.walk(ast.parse(source)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        start = node.body[0].lineno  # after the docstring, if there is one
        if isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
          start = node.body[0].end_lineno + 1
        assert _code_lines(lines[start - 1:node.end_lineno]) <= 50, f"{path.name}: {node.name}"


def test_readme_names_every_module_and_each_has_its_test_file():
  readme = (ROOT / "README.md").read_text()
  listing = readme[readme.index("The package, one concept a module"):]
  listing = listing[:listing.index("`tests/` mirrors it")]
  package = ROOT / "jax_lossscale"
  for path in sorted(package.glob("*.py")):
    if path.name == "__init__.py":
      continue
    name = path.stem
    assert (f"`{path.name}`" if name.startswith("_") else f"`{name}`") in listing, path.name
    assert (ROOT / "tests" / f"test_{name.lstrip('_')}.py").exists(), name
  assert "`demo`" in listing and (ROOT / "tests" / "test_demo.py").exists()
