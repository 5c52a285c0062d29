"""Compile time of a training step with loss scaling, against plain optax and the anchors.

Lowers and compiles a jitted, donated Adam step over L leaves (default: 1000 leaves of
16x16, where per-leaf kernels dominate), with the caches cleared before each
compilation and the variants interleaved, several times each; reports the median wall
time and CPU time, and the ratio of each to plain optax. Also times eager
`jax_lossscale.all_finite` over 200 small leaves: the first call compiles, later calls
reuse it. Example:

  python benchmarks/compile_time.py --leaves 1000 --shape 16 16 --reps 3
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls


def variants(optimizer, clip_norm):
  """The variants of `overhead.py`, beside this file."""
  spec = importlib.util.spec_from_file_location(
      "overhead", pathlib.Path(__file__).with_name("overhead.py"))
  overhead = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(overhead)
  return overhead.variants(optimizer, clip_norm)


def parts(optimizer):
  """Where the step's compile time goes, `optimizer` being the plain step's (clipped under
  `--clip`): plain optax with the check's flag as one more output; plain optax inside a
  `lax.cond` on that flag (what a skip costs); and that `lax.cond` running on unscaled
  gradients, giving new parameters (the core of `apply_gradients`) or updates, applied
  after it (the core of `update`)."""

  def init_scaled(params):  # the loss scale is state, as in a real step: not a constant
    return jls.DynamicLossScale(), optimizer.init(params)

  def plain(params, state, grads):
    updates, state = optimizer.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def with_check(params, state, grads):
    return *plain(params, state, grads), jls.all_finite(grads)

  def in_cond(params, state, grads):
    return jax.lax.cond(jls.all_finite(grads), lambda: plain(params, state, grads),
                        lambda: (params, state))

  def in_cond_unscaled(params, state, grads):
    loss_scale, state = state
    params, state = jax.lax.cond(
        jls.all_finite(grads), lambda _: plain(params, state, loss_scale.unscale(grads)),
        lambda kept: kept, (params, state))
    return params, (loss_scale, state)

  def updates_in_cond_unscaled(params, state, grads):
    loss_scale, state = state
    skipped = jax.tree.map(lambda g: jnp.full_like(g, -0.0), grads)
    updates, state = jax.lax.cond(
        jls.all_finite(grads),
        lambda _: optimizer.update(loss_scale.unscale(grads), state, params),
        lambda kept: kept, (skipped, state))
    return optax.apply_updates(params, updates), (loss_scale, state)

  return {"plain + check": (optimizer.init, with_check),
          "plain in lax.cond": (optimizer.init, in_cond),
          "unscaled in lax.cond": (init_scaled, in_cond_unscaled),
          "updates unscaled in lax.cond": (init_scaled, updates_in_cond_unscaled)}


def candidates(clip_norm: float | None) -> dict:
  """Every variant by name, all running Adam, after `clip_by_global_norm(clip_norm)` if given:
  `overhead.py`'s variants and the `parts`."""
  adam = optax.adam(1e-3)
  inner = adam if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adam)
  return variants(adam, clip_norm) | parts(inner)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--leaves", type=int, default=1000)
  parser.add_argument("--shape", type=int, nargs="+", default=[16, 16])
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--clip", action="store_true",
                      help="inner = chain(clip_by_global_norm(1.0), adam)")
  parser.add_argument("--variants", nargs="+",
                      default=["plain", "jls.update", "jls.apply_gradients", "apply_if_finite"],
                      help="jmp and flax take many minutes to compile at 1000 leaves (flax: "
                           "over 15 minutes of CPU time); add them by name, and "
                           "'plain + check', 'plain in lax.cond', 'unscaled in lax.cond', "
                           "'updates unscaled in lax.cond' to see where the time goes; "
                           "'plain', the baseline of the ratios, always runs")
  args = parser.parse_args(argv)
  known = candidates(1.0 if args.clip else None)
  unknown = [name for name in args.variants if name not in known]
  if unknown:
    parser.error(f"--variants: no variant named {', '.join(map(repr, unknown))}; the variants "
                 f"are {', '.join(map(repr, known))}")

  params = {f"leaf_{i:04d}": jnp.full(tuple(args.shape), 0.5, jnp.float32)
            for i in range(args.leaves)}
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  chosen = {name: known[name] for name in dict.fromkeys(["plain", *args.variants])}
  wall = {name: [] for name in chosen}
  cpu = {name: [] for name in chosen}
  for _ in range(args.reps):
    for name, (init, step) in chosen.items():
      state = init(params)
      jax.clear_caches()
      start, start_cpu = time.perf_counter(), time.process_time()
      jax.jit(step, donate_argnums=(0, 1)).lower(params, state, grads).compile()
      wall[name].append(time.perf_counter() - start)
      cpu[name].append(time.process_time() - start_cpu)

  device = jax.devices()[0]
  print(f"# {device.platform.upper()} {device.device_kind}, {platform.machine()}, "
        f"jax {jax.__version__}, optax {optax.__version__}; {args.leaves} leaves of "
        f"{tuple(args.shape)}, inner={'clip+adam' if args.clip else 'adam'}, lower+compile, "
        f"median of {args.reps}, interleaved")
  base_wall, base_cpu = statistics.median(wall["plain"]), statistics.median(cpu["plain"])
  for name in chosen:
    w, c = statistics.median(wall[name]), statistics.median(cpu[name])
    print(f"{name:>28s}: wall {w:7.2f} s ({w / base_wall:.2f}x)   cpu {c:7.2f} s "
          f"({c / base_cpu:.2f}x)")

  leaves = [jnp.asarray(np.full((8, 8), 0.5, np.float32)) for _ in range(200)]
  times = []
  for _ in range(4):
    start = time.perf_counter()
    jax.block_until_ready(jls.all_finite(leaves))
    times.append(time.perf_counter() - start)
  print(f"eager all_finite, 200 leaves of 8x8: first call {times[0]:.2f} s, then "
        + ", ".join(f"{1e3 * t:.1f} ms" for t in times[1:]))


if __name__ == "__main__":
  main()
