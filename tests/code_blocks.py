"""Runs every ```python block of Markdown documents: each document's blocks in order, in a
namespace of its own.

Usage: code_blocks.py [--report REPORT.json] DOCUMENT.md [DOCUMENT.md ...]. The documents run
one after another in this process (JAX starts once); a document whose block raises is
reported with its traceback and the next one runs. The exit status is 1 if any failed;
`--report` writes `{document's name: null, or the traceback}`. `test_docs.py` runs it in a
subprocess that forces 8 CPU devices (README's distributed examples use them).
"""

import argparse
import json
import pathlib
import re
import traceback

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(path: pathlib.Path) -> list[tuple[int, str]]:
  """`(line number, code)` of each ```python block."""
  text = path.read_text()
  return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def run(path: pathlib.Path) -> None:
  """Runs the blocks of `path` in order, in one new namespace."""
  namespace = {"__name__": "__main__"}
  for line, code in blocks(path):
    exec(compile(code, f"{path.name}, block at line {line}", "exec"), namespace)  # noqa: S102
  print(f"ran {len(blocks(path))} blocks of {path.name}", flush=True)


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
