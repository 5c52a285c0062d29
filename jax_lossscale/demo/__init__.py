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


# One look per kind of run, in every panel and plot of both demos: a run is found by the
# first key its name contains.
RUN_STYLES = {
    "float8 tensorwise": {"color": "tab:brown", "linestyle": "-."},
    "float8 rowwise": {"color": "tab:olive", "linestyle": "-."},
    "bfloat16": {"color": "tab:gray", "linestyle": "--"},
    "float32": {"color": "black", "linestyle": "-"},
    "no loss scaling": {"color": "tab:red", "linestyle": ":"},
    "FixedLossScale": {"color": "tab:green", "linestyle": "-."},
    "DynamicLossScale": {"color": "tab:orange", "linestyle": "--"},
    "autocast": {"color": "tab:cyan", "linestyle": "--"},
    "MeasuredLossScale": {"color": "tab:blue", "linestyle": "-"},
}


def run_style(name: str) -> dict:
  """The colour and line style (matplotlib keywords) of the run named `name`."""
  for key, style in RUN_STYLES.items():
    if key in name:
      return style
  raise ValueError(f"no style for the run {name!r}: add it to RUN_STYLES")


def figure(**subplots):
  """A new matplotlib figure and its axes (`plt.subplots(**subplots)`), drawn off screen,
  laid out so that legends placed outside the axes stay in the picture."""
  import matplotlib.pyplot as plt

  plt.switch_backend("Agg")
  return plt.subplots(layout="constrained", **subplots)


def save(fig, path: str) -> None:
  """Writes `fig` to `path` and frees it."""
  import matplotlib.pyplot as plt

  fig.savefig(path, dpi=90)
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
