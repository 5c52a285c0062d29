"""Which part of a float8 recipe costs held-out loss: the transformer showcase trained under
variants of the two recipes, side by side with bfloat16.

Each variant trains the showcase's model (`python -m jax_lossscale.demo --model
transformer`: a float32 flax NNX model under `jls.autocast(loss_fn, jnp.bfloat16, fp8=...)`,
Adam, no loss scale) from each seed's initial weights and data order, and is evaluated on
the seed's held-out batch in float32, as the demo's runs are:

  bfloat16                             autocast alone
  tensorwise                           fp8="tensorwise": a scale per tensor, e5m2 gradients
  tensorwise, attention in bfloat16    attention's two products left out of float8 (a
                                       `filter_fn` on the weights' rank), as torchao and
                                       Transformer Engine run float8: its linear layers only
  tensorwise, e4m3 gradients           `grad_format=jnp.float8_e4m3fn`
  tensorwise, power-of-two scales      `power_of_two_scales=True`, as rowwise's
  rowwise                              fp8="rowwise": a scale per row, rounded down to a
                                       power of two, e4m3 gradients
  rowwise, e5m2 gradients              `grad_format=jnp.float8_e5m2`
  rowwise, exact scales                `power_of_two_scales=False`, as tensorwise's

bfloat16 always runs, the baseline. The script prints each variant's held-out loss per
seed, and the mean and standard deviation over the seeds of each seed's difference to
bfloat16's (in percent):

  python benchmarks/fp8_recipes.py --steps 300 --seeds 0 1 2 3
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_lossscale as jls
from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text


def linear_layers_only(matmul: jls.Float8Matmul) -> bool:
  """Whether a matmul is a dense layer's (its weights have two dimensions), not one of
  attention's products (two activations of four)."""
  return len(matmul.rhs_shape) == 2


VARIANTS = {
    "bfloat16": None,
    "tensorwise": "tensorwise",
    "tensorwise, attention in bfloat16": jls.Float8Recipe.from_name(
        "tensorwise", filter_fn=linear_layers_only),
    "tensorwise, e4m3 gradients": jls.Float8Recipe.from_name(
        "tensorwise", grad_format=jnp.float8_e4m3fn),
    "tensorwise, power-of-two scales": jls.Float8Recipe.from_name(
        "tensorwise", power_of_two_scales=True),
    "rowwise": "rowwise",
    "rowwise, e5m2 gradients": jls.Float8Recipe.from_name(
        "rowwise", grad_format=jnp.float8_e5m2),
    "rowwise, exact scales": jls.Float8Recipe.from_name(
        "rowwise", power_of_two_scales=False),
}


def held_out_loss(variant: str, data: Text, config: transformer.Config, seed: int) -> float:
  policy = dataclasses.replace(transformer.BFLOAT16, fp8=VARIANTS[variant])
  run = transformer.train(variant, data, config, policy, jls.NoOpLossScale(), seed,
                          progress=False)
  return transformer.evaluate(run, data, config, policy).eval_loss


def main(argv=None) -> dict[str, list[float]]:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  defaults = transformer.Config()
  parser.add_argument("--steps", type=int, default=300)
  parser.add_argument("--seeds", type=int, nargs="+", default=[0])
  parser.add_argument("--batch", type=int, default=defaults.batch)
  parser.add_argument("--context", type=int, default=defaults.context)
  parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                      help="the variants beside bfloat16, which always runs")
  args = parser.parse_args(argv)
  variants = list(dict.fromkeys(["bfloat16", *args.variants]))  # once each, bfloat16 first
  config = transformer.Config(steps=args.steps, batch=args.batch, context=args.context,
                              seeds=tuple(args.seeds))
  data = Text.load()
  print(f"jax {jax.__version__}, {platform.machine()}; the transformer showcase, "
        f"{args.steps} steps of {args.batch}x{args.context} tokens, seeds {args.seeds}")
  losses: dict[str, list[float]] = {}
  for variant in variants:
    start = time.perf_counter()
    losses[variant] = [held_out_loss(variant, data, config, seed) for seed in args.seeds]
    print(f"#   {variant}: {time.perf_counter() - start:.0f} s", flush=True)
  base = np.array(losses["bfloat16"])
  print(f"{'variant':>36s} {'held-out loss, per seed':>32s} {'vs bfloat16, % (mean ± sd)':>28s}")
  for variant, values in losses.items():
    gap = 100 * (np.array(values) / base - 1)
    spread = (f"{gap.mean():+.2f} ± {gap.std(ddof=1):.2f}" if len(gap) > 1
              else f"{gap.mean():+.2f}")
    print(f"{variant:>36s} {', '.join(f'{v:.4f}' for v in values):>32s} "
          f"{'' if variant == 'bfloat16' else spread:>28s}")
  return losses


if __name__ == "__main__":
  main()
