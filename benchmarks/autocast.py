"""`autocast` against the same model cast by hand to the same dtypes, and its trace time.

A small transformer-like block stack (matmuls, layer norms, GELU, softmax attention, a
cross-entropy loss), trained by a jitted Adam step. The hand-cast loss casts each
matmul's operands to float16 and its result back to float32, which is the program
`autocast` makes (checked below with `precision_summary`). Compile time (trace, lower
and compile, caches cleared) and step time are measured interleaved, in one process,
several times each; medians are reported with the ratio autocast / hand-cast.

The interpreter's trace time is measured on a chain of N/2 `tanh(x @ w)` (N equations):
`jax.make_jaxpr` of the function itself, and of its `autocast`; it must grow linearly.

  python benchmarks/autocast.py --reps 5 --steps 50
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

F16 = jnp.float16


def layer_norm(h):
  mean = jnp.mean(h, axis=-1, keepdims=True)
  return (h - mean) * jax.lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + 1e-5)


def make_loss(matmul):
  """The loss, with its matmuls computed by `matmul(a, b)`."""

  def loss(params, tokens, targets):
    h = params["embed"][tokens]
    for layer in params["layers"]:
      q, k, v = (matmul(h, layer[name]) for name in ("q", "k", "v"))
      scores = matmul(q, jnp.swapaxes(k, -1, -2)) / np.sqrt(q.shape[-1])
      h = layer_norm(h + matmul(jax.nn.softmax(scores, axis=-1), v))
      h = layer_norm(h + matmul(jax.nn.gelu(matmul(h, layer["up"])), layer["down"]))
    logits = matmul(h, params["embed"].T)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


def hand_cast_matmul(a, b):
  return (a.astype(F16) @ b.astype(F16)).astype(jnp.float32)


def init(key, vocab, width, depth):
  keys = iter(jax.random.split(key, 1 + 5 * depth))
  normal = lambda *shape: jax.random.normal(next(keys), shape) / np.sqrt(shape[0])  # noqa: E731
  return {"embed": normal(vocab, width), "layers": [
      {name: normal(width, 4 * width if name == "up" else width) if name != "down"
       else normal(4 * width, width) for name in ("q", "k", "v", "up", "down")}
      for _ in range(depth)]}


def make_step(loss, optimizer):
  def step(params, opt_state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def compile_seconds(loss, optimizer, args):
  """`(trace and lower seconds, XLA compile seconds, compiled step)`."""
  jax.clear_caches()
  start = time.perf_counter()
  lowered = jax.jit(make_step(loss, optimizer)).lower(*args)
  traced = time.perf_counter()
  compiled = lowered.compile()
  return traced - start, time.perf_counter() - traced, compiled


def step_seconds(compiled, args, steps):
  params, opt_state, tokens, targets = args
  jax.block_until_ready(compiled(params, opt_state, tokens, targets))
  start = time.perf_counter()
  for _ in range(steps):
    params, opt_state, value = compiled(params, opt_state, tokens, targets)
  jax.block_until_ready(value)
  return (time.perf_counter() - start) / steps


def chain(n_equations):
  def f(x, w):
    for _ in range(n_equations // 2):
      x = jnp.tanh(x @ w)
    return x
  return f


def trace_seconds(fun, args):
  start = time.perf_counter()
  program = jax.make_jaxpr(fun)(*args)
  return time.perf_counter() - start, len(program.eqns)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--depth", type=int, default=2)
  parser.add_argument("--batch", type=int, default=8)
  parser.add_argument("--seq", type=int, default=64)
  parser.add_argument("--vocab", type=int, default=512)
  parser.add_argument("--equations", type=int, nargs="*", default=[1_000, 10_000, 100_000])
  options = parser.parse_args()

  print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {platform.processor() or '?'}"
        f", {os.cpu_count()} CPUs")
  params = init(jax.random.key(0), options.vocab, options.width, options.depth)
  tokens = jax.random.randint(jax.random.key(1), (options.batch, options.seq), 0,
                              options.vocab)
  targets = jnp.roll(tokens, -1, axis=1)
  optimizer = optax.adam(1e-3)
  args = (params, optimizer.init(params), tokens, targets)
  losses = {"hand-cast": make_loss(hand_cast_matmul),
            "autocast": jls.autocast(make_loss(jnp.matmul))}
  summaries = {name: jls.precision_summary(loss, params, tokens, targets)
               for name, loss in losses.items()}
  for name, summary in summaries.items():
    print(f"{name}: dot_general {summary.count('dot_general', F16)} forward and "
          f"{summary.count('dot_general', F16, backward=True)} backward in float16, "
          f"{summary.count('dot_general', jnp.float32)} + "
          f"{summary.count('dot_general', jnp.float32, backward=True)} in float32")

  times = {name: {"trace": [], "xla": [], "compile": [], "step": []} for name in losses}
  for _ in range(options.reps):
    for name, loss in losses.items():
      trace_s, xla_s, compiled = compile_seconds(loss, optimizer, args)
      times[name]["trace"].append(trace_s)
      times[name]["xla"].append(xla_s)
      times[name]["compile"].append(trace_s + xla_s)
      times[name]["step"].append(step_seconds(compiled, args, options.steps))
  median = {name: {k: statistics.median(v) for k, v in parts.items()}
            for name, parts in times.items()}
  for name, m in median.items():
    print(f"{name:>9}: compile {m['compile'] * 1e3:8.1f} ms (trace and lower "
          f"{m['trace'] * 1e3:7.1f}, XLA {m['xla'] * 1e3:7.1f})   step {m['step'] * 1e3:8.3f} ms")
  ratio = {k: median["autocast"][k] / median["hand-cast"][k] for k in median["autocast"]}
  print(f"autocast / hand-cast: compile {ratio['compile']:.3f}x (trace and lower "
        f"{ratio['trace']:.3f}x, XLA {ratio['xla']:.3f}x), step {ratio['step']:.3f}x")

  x, w = jnp.ones((4, 4)), jnp.eye(4)
  for n in options.equations:
    plain, count = trace_seconds(chain(n), (x, w))
    auto, auto_count = trace_seconds(jls.autocast(chain(n)), (x, w))
    print(f"{count:>7} equations: make_jaxpr {plain:7.2f} s, of its autocast {auto:7.2f} s "
          f"({auto_count} equations, {(auto - plain) / count * 1e6:.1f} us per equation "
          "interpreted)")


if __name__ == "__main__":
  main()
