"""Runs a shell command line or script with `python3` and the virtual environment's
`pip` and `python` replaced by recorders: what it would run, in order, without running it.

`recorded(script, directory)` returns one `Call` per command: the program's name
(`python3`, `.venv/bin/pip`, `.venv/bin/python`), its arguments, and the environment
variables that choose the Python and the pins (`PYENV_VERSION`, `PIP_CONSTRAINT`).
`python3 -m venv DIR` makes `DIR/bin/pip` and `DIR/bin/python` recorders too.
`ci_environments` records `.ci/run` so, split by the virtual environments it makes.
"""

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
from typing import NamedTuple

_RECORDER = '''
import json, os, pathlib, stat, sys
log, program, args = sys.argv[1], sys.argv[2], sys.argv[3:]
env = {name: os.environ.get(name) for name in ("PYENV_VERSION", "PIP_CONSTRAINT")}
with open(log, "a") as file:
  file.write(json.dumps({"program": program, "args": args, "env": env}) + "\\n")
if program == "python3" and args[:2] == ["-m", "venv"]:
  bin_dir = pathlib.Path(args[2]) / "bin"
  bin_dir.mkdir(parents=True, exist_ok=True)
  for name in ("pip", "python"):
    shim = bin_dir / name
    shim.write_text(f"#!/bin/sh\\nexec {sys.executable} {__file__} {log} "
                    f"{args[2]}/bin/{name} \\"$@\\"\\n")
    shim.chmod(shim.stat().st_mode | stat.S_IEXEC)
'''


class Call(NamedTuple):
  program: str
  args: tuple[str, ...]
  pyenv_version: str | None
  pip_constraint: str | None


def recorded(script: str, directory: pathlib.Path) -> list[Call]:
  """The commands `script` (bash) runs from `directory`, each recorded, none run."""
  tools = directory / "_tools"
  tools.mkdir()
  recorder, log = tools / "record.py", tools / "calls.jsonl"
  recorder.write_text(_RECORDER)
  python3 = tools / "python3"
  python3.write_text(f"#!/bin/sh\nexec {sys.executable} {recorder} {log} python3 \"$@\"\n")
  python3.chmod(python3.stat().st_mode | stat.S_IEXEC)
  env = {**os.environ, "PATH": f"{tools}{os.pathsep}{os.environ['PATH']}"}
  for name in ("PYENV_VERSION", "PIP_CONSTRAINT"):
    env.pop(name, None)
  result = subprocess.run(["bash", "-c", script], cwd=directory, env=env,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
  calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
  return [Call(c["program"], tuple(c["args"]), c["env"]["PYENV_VERSION"],
               c["env"]["PIP_CONSTRAINT"]) for c in calls]


def is_new_environment(call: Call) -> bool:
  return call.program == "python3" and call.args[:2] == ("-m", "venv")


def ci_environments(root: pathlib.Path, directory: pathlib.Path) -> list[list[Call]]:
  """What `.ci/run` runs, environment by environment: each list starts with the
  `python3 -m venv` that makes it and holds the commands run in it."""
  shutil.copytree(root / ".ci", directory / ".ci")
  environments = []
  for call in recorded("bash .ci/run", directory):
    if is_new_environment(call):
      environments.append([])
    environments[-1].append(call)
  return environments
