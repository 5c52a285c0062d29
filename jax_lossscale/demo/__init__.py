"""Demos of float16 training with and without loss scaling: `python -m jax_lossscale.demo`.

`--model mlp` (the default) trains a character-level MLP language model five times (see
`jax_lossscale.demo.mlp`); `--model transformer` a small transformer language model,
reading its backward pass layer by layer (see `jax_lossscale.demo.transformer`). The
other options are the chosen demo's. Needs the `demo` extra.
"""

from __future__ import annotations

import argparse
import math
import os
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
  """The command line of `python -m jax_lossscale.demo --model MODEL`, described by `doc`.

  Its `--model` option is `main`'s, listed so that the help shows how to choose the demo;
  a demo's own `main` refuses any other model.
  """
  other = next(m for m in MODELS if m != model)
  parser = argparse.ArgumentParser(prog="python -m jax_lossscale.demo", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--model", choices=MODELS, default=model,
                      help=f"the demo to run: mlp (the default) or transformer; the other "
                           f"options are the {model} demo's (`--model {other} --help` lists "
                           f"the {other} demo's)")
  return parser


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace, model: str, *,
                  at_least_one: Sequence[str] = (), at_least_zero: Sequence[str] = (),
                  positive: Sequence[str] = ()) -> None:
  """Exits through `parser.error`, before any training, naming the first option out of range.

  Args:
    parser: the demo's `argument_parser`.
    args: what it parsed.
    model: the demo's name: `--model` must be it.
    at_least_one: options (without `--`) whose every value must be an integer >= 1.
    at_least_zero: options whose every value must be an integer >= 0.
    positive: options whose every value must be a finite number > 0.

  `--out`'s directory must exist, so that the plot can be written after training.
  """
  if args.model != model:
    parser.error(f"--model {args.model}: this is the {model} demo's command line; run "
                 f"`python -m jax_lossscale.demo --model {args.model}`")
  for names, valid, allowed in ((at_least_one, lambda v: v >= 1, "an integer >= 1"),
                                (at_least_zero, lambda v: v >= 0, "an integer >= 0"),
                                (positive, lambda v: v > 0 and math.isfinite(v),
                                 "a finite number > 0")):
    for name in names:
      value = getattr(args, name.replace("-", "_"))
      for v in value if isinstance(value, list) else [value]:
        if not valid(v):
          parser.error(f"--{name} must be {allowed}; got {v}")
  directory = os.path.dirname(os.path.abspath(args.out))
  if not os.path.isdir(directory):
    parser.error(f"--out {args.out}: the directory {directory} does not exist")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(prog="python -m jax_lossscale.demo", add_help=False)
  parser.add_argument("--model", choices=MODELS, default="mlp")
  args, rest = parser.parse_known_args(argv)
  if args.model == "mlp":
    from jax_lossscale.demo import mlp

    mlp.main(rest)
  elif args.model == "transformer":
    from jax_lossscale.demo import transformer

    transformer.main(rest)
