"""Runs every ```python block of a Markdown document, in order, in one namespace.

Usage: code_blocks.py DOCUMENT.md. `test_docs.py` runs it in a subprocess that forces
8 CPU devices (README's distributed examples use them).
"""

import pathlib
import re
import sys

FENCE = re.compile(r"^```python\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def blocks(path: pathlib.Path) -> list[tuple[int, str]]:
  """`(line number, code)` of each ```python block."""
  text = path.read_text()
  return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in FENCE.finditer(text)]


def main(path: str) -> None:
  path = pathlib.Path(path)
  namespace = {"__name__": "__main__"}
  for line, code in blocks(path):
    exec(compile(code, f"{path.name}, block at line {line}", "exec"), namespace)  # noqa: S102
  print(f"ran {len(blocks(path))} blocks of {path.name}")


if __name__ == "__main__":
  main(sys.argv[1])
