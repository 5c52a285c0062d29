"""bfloat16 parameters and optimizer state: the bytes each configuration keeps and the time
of its step, side by side.

For Adam over N parameters split into L leaves, a jitted and donated step of each
configuration:

  optax float32        optax.adam, update + optax.apply_updates, float32 parameters (the
                       reference)
  float32              loss_scaling(adam, NoOpLossScale()).apply_gradients, float32
  float32, state bf16  the same with state_dtype=jnp.bfloat16
  bf16 <rounding>      bfloat16 parameters written with rounding="nearest",
                       "stochastic" or "compensated" (its buffer in the state)
  bf16 <rounding>, state bf16  the same with state_dtype=jnp.bfloat16

Reports the bytes of the parameters and of the optimizer state from the pytrees, XLA's
`memory_analysis()` of the donated step (arguments, outputs, temporaries), the CPU
seconds to lower and compile it (once), the median time of the step (the variants
interleaved, in a random order each round) and its ratio to "optax float32" and to the
same configuration written to nearest. Examples, the speed at 10**7 parameters and the
compile time of many small leaves (where each distinct kernel costs its compile):

  python benchmarks/bf16_writes.py --params 1e7 --leaves 8 --reps 10
  python benchmarks/bf16_writes.py --params 76800 --leaves 300 --reps 1
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import optax

import jax_lossscale as jls

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import overhead  # noqa: E402

CONFIGURATIONS = {  # name: (parameters' dtype, loss_scaling's options)
    "float32": (jnp.float32, {}),
    "float32, state bf16": (jnp.float32, {"state_dtype": jnp.bfloat16}),
    "bf16 nearest": (jnp.bfloat16, {}),
    "bf16 stochastic": (jnp.bfloat16, {"rounding": "stochastic"}),
    "bf16 compensated": (jnp.bfloat16, {"rounding": "compensated"}),
    "bf16 nearest, state bf16": (jnp.bfloat16, {"state_dtype": jnp.bfloat16}),
    "bf16 stochastic, state bf16": (jnp.bfloat16, {"rounding": "stochastic",
                                                   "state_dtype": jnp.bfloat16}),
    "bf16 compensated, state bf16": (jnp.bfloat16, {"rounding": "compensated",
                                                    "state_dtype": jnp.bfloat16}),
}


def nearest_of(name: str) -> str:
  """The configuration `name` with rounding to nearest: what its ratio is taken to."""
  return name.replace("stochastic", "nearest").replace("compensated", "nearest")


def make_params(n: int, leaves: int, dtype) -> dict:
  sizes = [n // leaves + (1 if i < n % leaves else 0) for i in range(leaves)]
  return {f"leaf_{i:03d}": jnp.linspace(-1.0, 1.0, s, dtype=jnp.float32).astype(dtype)
          for i, s in enumerate(sizes)}


def variants(learning_rate: float) -> dict:
  """name -> (parameters' dtype, init(params) -> state, step(params, state, grads))."""
  adam = optax.adam(learning_rate)

  def optax_step(params, state, grads):
    updates, state = adam.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  out = {"optax float32": (jnp.float32, adam.init, optax_step)}
  for name, (dtype, options) in CONFIGURATIONS.items():
    tx = jls.loss_scaling(adam, jls.NoOpLossScale(), **options)
    out[name] = (dtype, tx.init, lambda p, s, g, tx=tx: tx.apply_gradients(g, s, p))
  return out


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def measure(n: int, leaves: int, reps: int, learning_rate: float = 3e-4,
            seed: int = 0) -> dict:
  runs = {}
  for name, (dtype, init, step) in variants(learning_rate).items():
    params = make_params(n, leaves, dtype)
    grads = jax.tree.map(lambda p: (p * 1e-3).astype(p.dtype), params)
    state = init(params)
    started = time.process_time()
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
    compile_seconds = time.process_time() - started
    memory = compiled.memory_analysis()
    p, s = compiled(jax.tree.map(jnp.copy, params), state, grads)  # warm up
    jax.block_until_ready(p)
    runs[name] = {"compiled": compiled, "p": p, "s": s, "grads": grads, "times": [],
                  "compile_seconds": compile_seconds,
                  "param_bytes": nbytes(params), "state_bytes": nbytes(state),
                  "xla_argument_bytes": int(memory.argument_size_in_bytes),
                  "xla_output_bytes": int(memory.output_size_in_bytes),
                  "xla_temp_bytes": int(memory.temp_size_in_bytes)}
  overhead.time_runs(runs, reps, seed)
  median = {name: statistics.median(r["times"]) for name, r in runs.items()}
  return {
      name: {
          **{k: v for k, v in r.items() if k.endswith("_bytes")},
          "compile_seconds": r["compile_seconds"],
          "median_ms": 1e3 * median[name],
          "vs_optax_float32": median[name] / median["optax float32"],
          "vs_nearest": median[name] / median[nearest_of(name)] if name in CONFIGURATIONS
          else 1.0,
      }
      for name, r in runs.items()
  }


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--params", type=float, default=1e7)
  parser.add_argument("--leaves", type=int, default=8)
  parser.add_argument("--reps", type=int, default=10)
  parser.add_argument("--json", help="write the results to this file")
  args = parser.parse_args(argv)
  n = int(args.params)
  results = measure(n, args.leaves, args.reps)
  print(f"jax {jax.__version__}, {jax.devices()[0].platform}, {platform.processor() or '?'}; "
        f"Adam over {n:.0e} parameters in {args.leaves} leaves, {args.reps} reps")
  print(f"{'configuration':30} {'params MB':>9} {'state MB':>9} {'XLA args':>9} "
        f"{'XLA temps':>9} {'compile s':>9} {'ms':>8} {'/optax':>7} {'/nearest':>8}")
  for name, r in results.items():
    print(f"{name:30} {r['param_bytes'] / 1e6:9.1f} {r['state_bytes'] / 1e6:9.1f} "
          f"{r['xla_argument_bytes'] / 1e6:9.1f} {r['xla_temp_bytes'] / 1e6:9.1f} "
          f"{r['compile_seconds']:9.2f} "
          f"{r['median_ms']:8.2f} {r['vs_optax_float32']:7.2f} {r['vs_nearest']:8.2f}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"params": n, "leaves": args.leaves, "reps": args.reps,
                 "jax": jax.__version__, "results": results}, f, indent=1)
  return results


if __name__ == "__main__":
  main()
