"""Demos of float16 training with and without loss scaling: `python -m jax_lossscale.demo`.

`--model mlp` (the default) trains a character-level MLP language model five times (see
`jax_lossscale.demo.mlp`); `--model transformer` a small transformer language model,
reading its backward pass layer by layer (see `jax_lossscale.demo.transformer`). The
other options are the chosen demo's. Needs the `demo` extra.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

MODELS = ("mlp", "transformer")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument("--model", choices=MODELS, default="mlp")
  args, rest = parser.parse_known_args(argv)
  if args.model == "mlp":
    from jax_lossscale.demo import mlp

    mlp.main(rest)
  elif args.model == "transformer":
    from jax_lossscale.demo import transformer

    transformer.main(rest)
