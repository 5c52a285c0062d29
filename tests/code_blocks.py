"""Runs every ```python block of Markdown documents: each document's blocks in order, in a
namespace of its own.

Usage: code_blocks.py [--report REPORT.json] DOCUMENT [DOCUMENT ...]. The documents run one
after another in this process (JAX starts once); a document whose code raises is reported
with its traceback and the next one runs. The exit status is 1 if any failed; `--report`
writes `{document's name: null, or the traceback}`. `test_docs.py` runs it in a subprocess
that forces 8 CPU devices (README's distributed examples use them). The notebooks run in
the docs' build (myst-nb), as "Run all" in a fresh kernel; `blocks` reads their code cells
too (`test_docs.py` checks what they import).
"""

import argparse
import json
import pathlib
import re
import sys
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


def run(path: pathlib.Path) -> None:
  """Runs the blocks of `path` in order, in one new namespace."""
  namespace = {"__name__": "__main__"}
  code_blocks = blocks(path)
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
