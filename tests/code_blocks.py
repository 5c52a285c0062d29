"""Runs every ```python block of Markdown documents and every code cell of notebooks: each
document's code in order, in a namespace of its own.

Usage: code_blocks.py [--report REPORT.json] DOCUMENT [DOCUMENT ...], each a `.md` or an
`.ipynb`. The documents run one after another in this process (JAX starts once); a document
whose code raises is reported with its traceback and the next one runs. A notebook runs in a
new temporary working directory (its cells may write files), as "Run all" in a fresh kernel
would run it; a Markdown document in this process's. The exit status is 1 if any failed;
`--report` writes `{document's name: null, or the traceback}`. `test_docs.py` runs it in a
subprocess that forces 8 CPU devices (README's distributed examples use them).
"""

import argparse
import contextlib
import json
import pathlib
import re
import sys
import tempfile
import traceback

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(path: pathlib.Path) -> list[tuple[str, str]]:
  """`(where, code)` of each ```python block of a Markdown document ("block at line N") or
  each code cell of a notebook ("cell N", counting code cells from 1)."""
  if path.suffix == ".ipynb":
    cells = json.loads(path.read_text())["cells"]
    sources = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    return [(f"cell {i}", source) for i, source in enumerate(sources, 1)]
  text = path.read_text()
  found = []
  for match in FENCE.finditer(text):
    line = text.count("\n", 0, match.start()) + 2  # the block's first line of code
    found.append((f"block at line {line}", match.group(1)))
  return found


@contextlib.contextmanager
def working_directory(path: pathlib.Path):
  """A new temporary working directory while a notebook runs (its cells may write files);
  this process's own for a Markdown document."""
  if path.suffix != ".ipynb":
    yield
    return
  with tempfile.TemporaryDirectory() as directory, contextlib.chdir(directory):
    yield


def run(path: pathlib.Path) -> None:
  """Runs the code of `path` in order, in one new namespace (a notebook in a new temporary
  working directory)."""
  namespace = {"__name__": "__main__"}
  code_blocks = blocks(path)  # read before a notebook's working directory replaces this one
  with working_directory(path):
    for where, code in code_blocks:
      exec(compile(code, f"{path.name}, {where}", "exec"), namespace)  # noqa: S102
  if "matplotlib.pyplot" in sys.modules:  # the next document starts without this one's figures
    sys.modules["matplotlib.pyplot"].close("all")
  print(f"ran {len(code_blocks)} blocks of {path.name}", flush=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--report", type=pathlib.Path)
  parser.add_argument("documents", type=pathlib.Path, nargs="+")
  args = parser.parse_args(argv)
  failures = {}
  for path in args.documents:
    try:
      run(path)
      failures[path.name] = None
    except Exception:  # reported; the next document still runs
      failures[path.name] = traceback.format_exc()
      print(failures[path.name], flush=True)
    if args.report:
      args.report.write_text(json.dumps(failures))
  return int(any(failures.values()))


if __name__ == "__main__":
  raise SystemExit(main())
