"""End-to-end overhead: one float16 training step of a real model, with and without
loss scaling, measured side by side (interleaved) in one process: `tx.update` +
`optax.apply_updates` and `tx.apply_gradients`, both with the defaults.

The model is the demo's character-level MLP language model on Python's bundled
documentation (float32 master weights, float16 compute, Adam). Example:

  python benchmarks/end_to_end.py --batch 8192 --hidden 256 --reps 30
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls
from jax_lossscale.demo import mlp


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--batch", type=int, default=8192)
  parser.add_argument("--hidden", type=int, default=256)
  parser.add_argument("--reps", type=int, default=30)
  args = parser.parse_args(argv)

  data = mlp.Text.load()
  config = mlp.Config(steps=args.reps + 2, batch=args.batch, hidden=args.hidden)
  starts = data.train_starts(config.seed, config.steps, config.batch, mlp.CONTEXT + 1)
  batches = [mlp.windows(data, s) for s in starts]
  inner = optax.adam(1e-3)

  def plain_step(params, opt_state, x, y):
    loss, grads = jax.value_and_grad(mlp.loss_fn)(params, x, y, jnp.float16)
    updates, opt_state = inner.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  tx = jls.loss_scaling(inner)
  grad_fn = jls.scaled_value_and_grad(mlp.loss_fn)

  def scaled_step(params, opt_state, x, y):
    loss, grads = grad_fn(opt_state, params, x, y, jnp.float16)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def applying_step(tx):
    def step(params, opt_state, x, y):
      loss, grads = grad_fn(opt_state, params, x, y, jnp.float16)
      return *tx.apply_gradients(grads, opt_state, params), loss
    return step

  runs = {}
  for name, step, init in [("plain", plain_step, inner.init),
                           ("jls.update", scaled_step, tx.init),
                           ("jls.apply_gradients", applying_step(tx), tx.init)]:
    params = mlp.init_params(jax.random.key(0), data.vocab, args.hidden)
    jitted = jax.jit(step, donate_argnums=(0, 1))
    state = (params, init(params))
    out = jitted(*state, *batches[0])
    jax.block_until_ready(out)
    runs[name] = {"step": jitted, "state": out[:2], "times": []}
  rng = np.random.default_rng(0)
  for i in range(args.reps):
    for name in rng.permutation(list(runs)):
      r = runs[name]
      start = time.perf_counter()
      out = r["step"](*r["state"], *batches[1 + i])
      jax.block_until_ready(out)
      r["times"].append(time.perf_counter() - start)
      r["state"] = out[:2]
  base = statistics.median(runs["plain"]["times"])
  device = jax.devices()[0]
  print(f"# {device.platform.upper()} {device.device_kind} ({platform.machine()}), float16 MLP LM, "
        f"batch {args.batch}, hidden {args.hidden}, {args.reps} interleaved steps")
  for name, r in runs.items():
    median = statistics.median(r["times"])
    print(f"{name:>20s}: {1e3 * median:8.2f} ms/step  ratio {median / base:.3f}")


if __name__ == "__main__":
  main()
