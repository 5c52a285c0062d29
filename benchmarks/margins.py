"""What each margin of `MeasuredLossScale` costs, against `DynamicLossScale`.

Two models, one row per loss scale:

- noisy gradients: each step's largest unscaled gradient is log-normal, e**(sigma * z)
  with z standard normal (median 1), and the backward pass gives it times the scale in
  float16 (inf past 65504); `--steps` steps of the real `loss_scaling` step in a jitted
  `lax.scan`, for each of `--seeds` seeds: the skipped steps, and the mean log2 of the
  scale the steps ran with (higher keeps more of small gradients);
- the MLP demo (`jax_lossscale.demo.mlp`) at the test suite's sizes: skipped steps, the
  held-out loss, and the mean over the run of the fraction of one set of logit gradients
  (the float32 run's, over a training batch of held-out windows) lost to underflow at the
  scale each step ran with.

Usage: python benchmarks/margins.py [--steps 3000] [--seeds 4] [--sigma 1.0]
[--demo-steps 150] [--margins 0 1 2 3]. `--demo-steps 0` leaves the demo out.
"""

from __future__ import annotations

import argparse
import platform

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls
from jax_lossscale.demo import mlp


def noisy_gradients(loss_scale, seed: int, steps: int, sigma: float) -> tuple[int, float]:
  """`(skipped steps, mean log2 of the scale each step ran with)` of `steps` steps of
  log-normal gradient maxima."""
  tx = jls.loss_scaling(optax.sgd(0.0), loss_scale)
  params = jnp.zeros([], jnp.float32)
  maxima = jnp.exp(sigma * jax.random.normal(jax.random.key(seed), (steps,)))

  def step(state, maximum):
    scale = state.loss_scale()  # this step's, before its update changes it
    _, state = tx.update((maximum * scale).astype(jnp.float16), state, params)
    return state, jnp.log2(scale)

  state, scales = jax.jit(lambda state: jax.lax.scan(step, state, maxima))(tx.init(params))
  return int(state.skipped_steps), float(jnp.mean(scales))


def demo_runs(plan: dict, steps: int) -> dict:
  """`{name: (skipped steps, held-out loss, mean underflow)}` of the MLP demo's runs."""
  config = mlp.Config(steps=steps, batch=8192, hidden=64, learning_rate=1e-2)
  data = mlp.Text.load()
  reference = mlp.train("float32", data, config, jnp.float32, jls.NoOpLossScale(),
                        progress=False)
  x, y = mlp.held_out(data, config, config.batch)
  out = {}
  for name, loss_scale in plan.items():
    run = mlp.evaluate(mlp.train(name, data, config, jnp.float16, loss_scale, progress=False),
                       data, config, jnp.float16)
    # run.scales: the scale each step ran with.
    at = {s: float(mlp.logit_underflow(reference.params, x, y, jnp.float16, jnp.float32(s)))
          for s in set(run.scales)}
    out[name] = (int((~np.asarray(run.applied)).sum()), run.eval_loss,
                 float(np.mean([at[s] for s in run.scales])))
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=3000)
  parser.add_argument("--seeds", type=int, default=4)
  parser.add_argument("--sigma", type=float, default=1.0)
  parser.add_argument("--demo-steps", type=int, default=150)
  parser.add_argument("--margins", type=int, nargs="+", default=[0, 1, 2, 3])
  args = parser.parse_args(argv)
  plan = {"DynamicLossScale()": jls.DynamicLossScale()}
  plan |= {f"MeasuredLossScale(margin={m})": jls.MeasuredLossScale(margin=m)
           for m in args.margins}
  demo_plan = {name: (jls.DynamicLossScale(increment_period=10)
                      if name.startswith("Dynamic") else loss_scale)
               for name, loss_scale in plan.items()}
  demo = demo_runs(demo_plan, args.demo_steps) if args.demo_steps else {}
  print(f"Python {platform.python_version()}, jax {jax.__version__}; noisy gradients: "
        f"{args.steps} steps, sigma {args.sigma}, seeds 0-{args.seeds - 1}; MLP demo: "
        f"{args.demo_steps} steps (DynamicLossScale(increment_period=10) there)\n")
  print("| loss scale | skipped of noisy steps, each seed | mean log2 scale | demo: skipped "
        "| demo: held-out loss | demo: logit gradients lost to underflow |")
  print("| --- | --- | --- | --- | --- | --- |")
  for name, loss_scale in plan.items():
    runs = [noisy_gradients(loss_scale, seed, args.steps, args.sigma)
            for seed in range(args.seeds)]
    skipped = ", ".join(str(s) for s, _ in runs)
    row = [name, f"{skipped} (sum {sum(s for s, _ in runs)})",
           f"{np.mean([scale for _, scale in runs]):.2f}"]
    if name in demo:
      skipped, loss, underflow = demo[name]
      row += [str(skipped), f"{loss:.4f}", f"{underflow:.2%}"]
    else:
      row += ["", "", ""]
    print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
  main()
