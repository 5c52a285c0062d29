"""Overhead of loss scaling in the optimizer update, against the alternatives.

Measures, side by side in one process with the variants interleaved, a jitted and
donated `update + apply_updates` step of Adam over N float32 parameters split into L
leaves, for:

  plain        optax.adam, no loss scaling (the reference)
  all_finite, then cond  no loss scale: `lax.cond(jls.all_finite(grads), adam step,
               keep everything)`, the check and the skip alone (what a step that skips
               bit-identically must do: decide before its first write)
  jls.update   loss_scaling(adam) with its defaults: tx.update + optax.apply_updates
               (what optax.chain, flax's TrainState and nnx.Optimizer call)
  jls.apply_gradients  the same transformation's fused tx.apply_gradients
  jmp          jmp.DynamicLossScale: unscale, all_finite, adjust, select_tree
  flax         the flax DynamicScale pattern: unscale, finiteness, scale update,
               jnp.where on parameters and optimizer state
  apply_if_finite  optax.apply_if_finite(adam) after a manual unscale

With --clip every optimizer is chain(clip_by_global_norm(1.0), adam), and the
jax_lossscale variants pass the clipping to loss_scaling(adam,
clip_by_global_norm=1.0) instead, whose one norm reduction is also the finiteness
check; `jls.apply_gradients(clip inside)` keeps the clip inside the chain.

Reports the median time ratio to `plain`, the ratio of XLA's `cost_analysis()` bytes
accessed, and the temporaries of the donated step from `memory_analysis()`. jmp and
flax come with the `bench` extra; a missing anchor is left out. Example:

  python benchmarks/overhead.py --params 1e6 1e7 --leaves 1 64 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls


def make_params(n: int, leaves: int, dtype=jnp.float32) -> dict:
  sizes = [n // leaves + (1 if i < n % leaves else 0) for i in range(leaves)]
  return {f"leaf_{i:03d}": jnp.full((s,), 0.5, dtype) for i, s in enumerate(sizes)}


def variants(optimizer: optax.GradientTransformation, clip_norm: float | None = None) -> dict:
  """name -> (init(params) -> state, step(params, state, grads) -> (params, state)).

  Every variant runs `optimizer`, after `clip_by_global_norm(clip_norm)` if given.
  """
  inner = optimizer
  if clip_norm is not None:
    inner = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)

  def plain_step(params, state, grads):
    updates, state = inner.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  # With --clip, the library's own clipping: loss_scaling(adam, clip_by_global_norm=...).
  tx = jls.loss_scaling(optimizer, clip_by_global_norm=clip_norm)

  def jls_step(params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  def jls_fused_step(params, state, grads):
    return tx.apply_gradients(grads, state, params)

  def check_then_cond_step(params, state, grads):
    return jax.lax.cond(jls.all_finite(grads), plain_step, lambda p, s, g: (p, s),
                        params, state, grads)

  out = {
      "plain": (inner.init, plain_step),
      "all_finite, then cond": (inner.init, check_then_cond_step),
      "jls.update": (tx.init, jls_step),
      "jls.apply_gradients": (tx.init, jls_fused_step),
  }
  if clip_norm is not None:
    inside = jls.loss_scaling(inner)
    out["jls.apply_gradients(clip inside)"] = (
        inside.init, lambda p, s, g: inside.apply_gradients(g, s, p))

  try:
    import jmp

    # jmp 0.0.4's pytree unflatten runs validation that breaks `jit(...).lower()` on
    # current JAX, so its state crosses the jit boundary as plain arrays.
    def jmp_init(params):
      return (jnp.asarray(2.0**15, jnp.float32), jnp.zeros([], jnp.int32)), inner.init(params)

    def jmp_step(params, state, grads):
      (scale, counter), opt_state = state
      loss_scale = jmp.DynamicLossScale(scale, counter)
      grads = loss_scale.unscale(grads)
      finite = jmp.all_finite(grads)
      loss_scale = loss_scale.adjust(finite)
      updates, new_opt_state = inner.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      return (jmp.select_tree(finite, new_params, params),
              ((loss_scale.loss_scale, loss_scale.counter),
               jmp.select_tree(finite, new_opt_state, opt_state)))

    out["jmp"] = (jmp_init, jmp_step)
  except ImportError:
    pass

  try:
    from flax.training.dynamic_scale import DynamicScale

    def flax_init(params):
      return DynamicScale(), inner.init(params)

    def flax_step(params, state, grads):
      # What DynamicScale.value_and_grad does after differentiation, then the
      # select on parameters and optimizer state from flax's mixed-precision example.
      dyn, opt_state = state
      grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32) / dyn.scale, grads)
      finite = jnp.array(True)
      for g in jax.tree.leaves(grads):
        finite &= jnp.all(jax.lax.is_finite(g))
      grow = dyn.fin_steps == dyn.growth_interval
      fin_scale = jnp.where(grow & finite, jnp.minimum(dyn.scale * dyn.growth_factor,
                                                       jnp.finfo(jnp.float32).max), dyn.scale)
      inf_scale = jnp.maximum(dyn.scale * dyn.backoff_factor, dyn.minimum_scale)
      dyn = dyn.replace(scale=jnp.where(finite, fin_scale, inf_scale),
                        fin_steps=jnp.where(grow | ~finite, 0, dyn.fin_steps + 1))
      updates, new_opt_state = inner.update(grads, opt_state, params)
      new_params = optax.apply_updates(params, updates)
      select = functools.partial(jax.tree.map, functools.partial(jnp.where, finite))
      return select(new_params, params), (dyn, select(new_opt_state, opt_state))

    out["flax"] = (flax_init, flax_step)
  except ImportError:
    pass

  guarded = optax.apply_if_finite(inner, max_consecutive_errors=10**6)

  def aif_init(params):
    return jnp.asarray(2.0**15, jnp.float32), guarded.init(params)

  def aif_step(params, state, grads):
    scale, opt_state = state
    grads = jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = guarded.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), (scale, opt_state)

  out["apply_if_finite"] = (aif_init, aif_step)
  return out


def analyse(compiled) -> tuple[float, int]:
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["bytes accessed"]), int(compiled.memory_analysis().temp_size_in_bytes)


def compile_variants(n: int, leaves: int, steps: dict, budget=None,
                     dtype=jnp.float32) -> dict:
  """Each variant of `steps` (name -> (init, step), `plain` first) jitted with parameters
  and state donated, compiled and run once on `n` parameters of `dtype` in `leaves`
  leaves: name -> run (its compiled step, parameters and state, XLA's bytes and
  temporaries). With a `budget` (an object whose `expired()` says when to stop), the
  variants compiled before it expired."""
  params = make_params(n, leaves, dtype)
  grads = jax.tree.map(lambda p: p * 1e-3, params)
  runs = {}
  for name, (init, step) in steps.items():
    if budget is not None and budget.expired():
      break
    jitted = jax.jit(step, donate_argnums=(0, 1))
    state = init(params)
    compiled = jitted.lower(params, state, grads).compile()
    bytes_accessed, temps = analyse(compiled)
    p, s = jax.tree.map(jnp.copy, params), state
    p, s = compiled(p, s, grads)  # warm up
    jax.block_until_ready(p)
    runs[name] = {"compiled": compiled, "p": p, "s": s, "times": [], "grads": grads,
                  "bytes": bytes_accessed, "temps": temps}
  return runs


MIN_ROUNDS = 5  # timed rounds even past a budget: one call is no measurement


def time_runs(runs: dict, reps: int, seed: int = 0, budget=None,
              min_rounds: int = MIN_ROUNDS) -> None:
  """`reps` rounds of one step of each run, in a random order each round, appended to each
  run's times; with a `budget`, the rounds finished before it expired, and at least
  `min_rounds` (or `reps`, if fewer)."""
  rng = np.random.default_rng(seed)
  names = list(runs)
  for i in range(reps):
    if i >= min_rounds and budget is not None and budget.expired():
      break
    for name in rng.permutation(names):  # interleaved, in a random order each round
      r = runs[name]
      start = time.perf_counter()
      r["p"], r["s"] = r["compiled"](r["p"], r["s"], r["grads"])
      jax.block_until_ready(r["p"])
      r["times"].append(time.perf_counter() - start)


def summarize(runs: dict) -> dict:
  """Per run: the median step time, and its time and bytes as ratios to `plain`'s; its XLA
  temporaries, in bytes and as a multiple of its parameters' bytes (in their own dtype)."""
  base = runs["plain"]
  return {
      name: {
          "median_ms": 1e3 * statistics.median(r["times"]),
          "time_ratio": statistics.median(r["times"]) / statistics.median(base["times"]),
          "bytes_ratio": r["bytes"] / base["bytes"],
          "temps_bytes": r["temps"],
          "temps_vs_params": r["temps"] / sum(x.nbytes for x in jax.tree.leaves(r["p"])),
          "reps": len(r["times"]),
      }
      for name, r in runs.items()
  }


def measure(n: int, leaves: int, optimizer, clip_norm, reps: int, seed: int = 0) -> dict:
  runs = compile_variants(n, leaves, variants(optimizer, clip_norm))
  time_runs(runs, reps, seed)
  return summarize(runs)


HEADER = (f"{'params':>8s} {'leaves':>6s} {'variant':>33s} {'ms':>8s} {'time×':>6s} "
          f"{'bytes×':>7s} {'temps MB':>9s} {'temps/params':>12s}")


def format_row(n: int, leaves: int, name: str, r: dict) -> str:
  return (f"{int(n):8.0e} {leaves:6d} {name:>33s} {r['median_ms']:8.2f} "
          f"{r['time_ratio']:6.2f} {r['bytes_ratio']:7.3f} {r['temps_bytes'] / 1e6:9.1f} "
          f"{r['temps_vs_params']:12.2f}")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7])
  parser.add_argument("--leaves", type=int, nargs="+", default=[1, 64])
  parser.add_argument("--reps", type=int, default=30)
  parser.add_argument("--clip", action="store_true",
                      help="inner = chain(clip_by_global_norm(1.0), adam)")
  parser.add_argument("--json", help="also write the results to this file")
  args = parser.parse_args(argv)

  clip_norm = 1.0 if args.clip else None
  device = jax.devices()[0]
  machine = platform.processor() or platform.machine()
  print(f"# {device.platform.upper()} {device.device_kind}, {machine}, "
        f"jax {jax.__version__}, optax {optax.__version__}, inner="
        f"{'clip+adam' if args.clip else 'adam'}; ratios vs plain, same process, interleaved")
  print(HEADER)
  results = []
  for n in args.params:
    for leaves in args.leaves:
      row = measure(int(n), leaves, optax.adam(1e-3), clip_norm, args.reps)
      for name, r in row.items():
        print(format_row(n, leaves, name, r))
      results.append({"params": int(n), "leaves": leaves, "results": row})
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"device": str(device), "clip": args.clip, "rows": results}, f, indent=1)


if __name__ == "__main__":
  main()
