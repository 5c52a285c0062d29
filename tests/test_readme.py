"""README's test command is the one CI runs."""

import pathlib

ROOT = pathlib.Path(__file__).parent.parent


def test_ci_runs_the_readme_test_command():
  readme = (ROOT / "README.md").read_text()
  ci = (ROOT / ".ci" / "run").read_text()
  command = next(line for line in ci.splitlines() if "pytest" in line)
  assert command in readme
  assert '.venv/bin/python -m jax_lossscale.demo' in readme
