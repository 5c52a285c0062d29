"""The supported range: what pyproject.toml states is what CI installs at its lowest end."""

import pathlib
import re
import tomllib

from packaging.version import Version

ROOT = pathlib.Path(__file__).parent.parent


def floors() -> dict[str, Version]:
  """Each requirement's lower bound in pyproject.toml, by normalised name."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  requirements = project["dependencies"] + [
      r for extra in project["optional-dependencies"].values() for r in extra]
  found = {}
  for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", requirement)
    if match:
      found[match[1].lower().replace("_", "-")] = Version(match[2])
  return found


def test_the_lowest_end_ci_runs_pins_the_floors_pyproject_states():
  pins = dict(line.split("==") for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
              if line and not line.startswith("#"))
  stated = floors()
  assert {name: stated.get(name) for name in pins if name != "jaxlib"} == {
      name: Version(version) for name, version in pins.items() if name != "jaxlib"}
  assert pins["jaxlib"] == pins["jax"]
  assert {"jax", "numpy", "optax", "flax", "equinox", "orbax-checkpoint"} <= set(pins)


def test_ci_tests_both_ends_of_the_supported_python_range():
  ci = (ROOT / ".ci" / "run").read_text()
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  assert project["requires-python"] == ">=3.11"
  assert "PYENV_VERSION=3.11" in ci and "PIP_CONSTRAINT" in ci and "PYENV_VERSION=3.13" in ci
