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


def figure(**subplots):
  """A new matplotlib figure and its axes (`plt.subplots(**subplots)`), drawn off screen."""
  import matplotlib.pyplot as plt

  plt.switch_backend("Agg")
  return plt.subplots(**subplots)


def save(fig, path: str) -> None:
  """Lays out `fig`, writes it to `path` and frees it."""
  import matplotlib.pyplot as plt

  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def argument_parser(model: str, doc: str | None) -> argparse.ArgumentParser:
  """The command line of `python -m jax_lossscale.demo --model MODEL`, described by `doc`."""
  return argparse.ArgumentParser(prog=f"python -m jax_lossscale.demo --model {model}",
                                 description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)


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
