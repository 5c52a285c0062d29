"""The supported range: what pyproject.toml states is what CI installs at its lowest end."""

import pathlib
import tomllib

import jax
from ci_script import ci_environments
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from jax_lossscale import _jax_internals

ROOT = pathlib.Path(__file__).parent.parent


def requirements() -> list[Requirement]:
  """pyproject.toml's requirements, its extras' included."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  return [Requirement(r) for r in project["dependencies"] + [
      r for extra in project["optional-dependencies"].values() for r in extra]]


def floors() -> dict[str, Version]:
  """Each requirement's lower bound in pyproject.toml, by normalised name."""
  found = {}
  for requirement in requirements():
    for specifier in requirement.specifier:
      if specifier.operator == ">=":
        found[requirement.name.lower().replace("_", "-")] = Version(specifier.version)
  return found


def test_the_lowest_end_ci_runs_pins_the_floors_pyproject_states():
  pins = dict(line.split("==") for line in (ROOT / ".ci" / "lowest.txt").read_text().splitlines()
              if line and not line.startswith("#"))
  stated = floors()
  assert {name: stated.get(name) for name in pins if name != "jaxlib"} == {
      name: Version(version) for name, version in pins.items() if name != "jaxlib"}
  assert pins["jaxlib"] == pins["jax"]
  assert {"jax", "numpy", "optax", "flax", "equinox", "orbax-checkpoint"} <= set(pins)


def test_ci_tests_both_ends_of_the_supported_python_range(tmp_path):
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  lowest, newest = ci_environments(ROOT, tmp_path)
  assert SpecifierSet(project["requires-python"]) == SpecifierSet(">=3.11")
  assert Version(lowest[0].pyenv_version).release[:2] == (3, 11)
  assert Version(newest[0].pyenv_version).release[:2] >= (3, 13)
  assert {call.pip_constraint for call in lowest if call.program.endswith("pip")} == {
      str(tmp_path / ".ci" / "lowest.txt")}
  assert {call.pip_constraint for call in newest} == {None}


def test_jax_is_bounded_above_by_the_range_the_library_warns_outside_of():
  [stated] = [r.specifier for r in requirements() if r.name == "jax"]
  assert stated == SpecifierSet(_jax_internals.SUPPORTED_JAX)
  assert any(specifier.operator == "<" for specifier in stated)
  assert Version(jax.__version__) in stated


def test_ci_installs_torch_for_the_pytorch_parity_test_on_the_lowest_end_only(tmp_path):
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
  [torch] = [Requirement(r) for r in project["optional-dependencies"]["parity"]]
  assert torch.name == "torch"
  assert not any(Requirement(r).name == "jax_lossscale" and "parity" in Requirement(r).extras
                 for r in project["optional-dependencies"]["test"])  # no torch on 3.13

  def installs_parity_then_runs_its_test(calls):
    installs = [i for i, call in enumerate(calls) if call.program.endswith("pip")
                and ".[parity]" in call.args]
    runs = [i for i, call in enumerate(calls) if call.args[:2] == ("-m", "pytest")
            and "tests/test_torch_parity.py" in call.args]
    return bool(installs) and bool(runs) and installs[0] < runs[-1]

  lowest, newest = ci_environments(ROOT, tmp_path)
  assert installs_parity_then_runs_its_test(lowest)
  assert not any(".[parity]" in call.args for call in newest)
