"""`autocast` against the same model cast by hand to the same dtypes, and its trace time.

A stack of residual MLP blocks (dense layers with biases, layer norms, GELU) over an
embedding, with a softmax cross-entropy loss, trained by a jitted Adam step. The
hand-cast loss is the model as flax's `Dense(dtype=jnp.float16)` runs it: each matmul's
operands and its bias cast to float16, the GELU on the float16 result in float16; the
autocast loss is the float32 model under `autocast` (the bias added in float16 too, its
gradient summed in float32; the GELU computed in float32 and returned in float16).
`precision_summary` checks that both run their matmuls in float16; the compiled steps'
operations and temporaries (`memory_analysis()`) are printed. Compile time (trace and
lower, then XLA's compile, caches cleared) and step time are measured interleaved, in one
process, several times each; medians are reported (and the fastest step time, the least
disturbed by other load), with the ratio autocast / hand-cast. Compile and trace times are
CPU times of this process.

The interpreter's trace time is measured on a chain of N/2 `tanh(x @ w)` (N equations):
`jax.make_jaxpr` of the function itself, and of its `autocast`; it must grow linearly.

  python benchmarks/autocast.py --reps 5 --steps 30
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
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


def float32_dense(h, layer):
  return h @ layer["w"] + layer["b"]


def hand_cast_dense(h, layer):
  """flax's `Dense(dtype=jnp.float16)`: input, kernel and bias in float16."""
  return h.astype(F16) @ layer["w"].astype(F16) + layer["b"].astype(F16)


def make_loss(dense):
  """The loss, with its dense layers computed by `dense(h, layer)`."""

  def loss(params, tokens, targets):
    h = params["embed"][tokens]
    for block in params["blocks"]:
      h = layer_norm(h + dense(jax.nn.gelu(dense(h, block["up"])), block["down"]))
    logits = dense(h, params["out"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  return loss


def init(key, vocab, width, depth):
  keys = iter(jax.random.split(key, 2 + 2 * depth))

  def dense(n_in, n_out):
    return {"w": jax.random.normal(next(keys), (n_in, n_out)) / np.sqrt(n_in),
            "b": jnp.zeros(n_out)}

  return {"embed": jax.random.normal(next(keys), (vocab, width)),
          "blocks": [{"up": dense(width, 4 * width), "down": dense(4 * width, width)}
                     for _ in range(depth)],
          "out": dense(width, vocab)}


def xla_operations(compiled):
  """The compiled program's operations, by result type and opcode."""
  return collections.Counter(re.findall(r"= (\w+\[[^\]]*\]\S*) (\w[\w-]*)\(",
                                        compiled.as_text()))


def make_step(loss, optimizer):
  def step(params, opt_state, tokens, targets):
    value, grads = jax.value_and_grad(loss)(params, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
  return step


def compile_seconds(loss, optimizer, args):
  """`(trace and lower seconds, XLA compile seconds, compiled step)`, in CPU time of this
  process (wall time moves with whatever else the machine runs)."""
  jax.clear_caches()
  start = time.process_time()
  lowered = jax.jit(make_step(loss, optimizer)).lower(*args)
  traced = time.process_time()
  compiled = lowered.compile()
  return traced - start, time.process_time() - traced, compiled


def step_seconds(compiled, args, steps):
  """The seconds of each of `steps` steps of each compiled step in `compiled` (a dict),
  one step of each in turn, so that other load on the machine hits both alike."""
  state = {name: args for name in compiled}
  seconds = {name: [] for name in compiled}
  for _ in range(steps + 1):
    for name, step in compiled.items():
      params, opt_state, tokens, targets = state[name]
      start = time.perf_counter()
      params, opt_state, value = jax.block_until_ready(step(params, opt_state, tokens, targets))
      seconds[name].append(time.perf_counter() - start)
      state[name] = params, opt_state, tokens, targets
  return {name: s[1:] for name, s in seconds.items()}  # the first: warm-up


def chain(n_equations):
  def f(x, w):
    for _ in range(n_equations // 2):
      x = jnp.tanh(x @ w)
    return x
  return f


def trace_seconds(fun, args):
  """CPU seconds to trace `fun` on `args`, and the number of equations traced."""
  start = time.process_time()
  program = jax.make_jaxpr(fun)(*args)
  return time.process_time() - start, len(program.eqns)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--reps", type=int, default=5)
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--width", type=int, default=128)
  parser.add_argument("--depth", type=int, default=4)
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
  losses = {"hand-cast": make_loss(hand_cast_dense),
            "autocast": jls.autocast(make_loss(float32_dense))}
  summaries = {name: jls.precision_summary(loss, params, tokens, targets)
               for name, loss in losses.items()}
  for name, summary in summaries.items():
    print(f"{name}: dot_general {summary.count('dot_general', F16)} forward and "
          f"{summary.count('dot_general', F16, backward=True)} backward in float16, "
          f"{summary.count('dot_general', jnp.float32)} + "
          f"{summary.count('dot_general', jnp.float32, backward=True)} in float32")

  times = {name: {"trace": [], "xla": [], "compile": [], "step": []} for name in losses}
  operations = {}
  for _ in range(options.reps):
    compiled = {}
    for name, loss in losses.items():
      trace_s, xla_s, compiled[name] = compile_seconds(loss, optimizer, args)
      operations[name] = xla_operations(compiled[name])
      times[name]["trace"].append(trace_s)
      times[name]["xla"].append(xla_s)
      times[name]["compile"].append(trace_s + xla_s)
    for name, seconds in step_seconds(compiled, args, options.steps).items():
      times[name]["step"] += seconds
  median = {name: {k: statistics.median(v) for k, v in parts.items()}
            for name, parts in times.items()}
  for name, m in median.items():
    print(f"{name:>9}: compile {m['compile'] * 1e3:8.1f} ms CPU (trace and lower "
          f"{m['trace'] * 1e3:7.1f}, XLA {m['xla'] * 1e3:7.1f})   step {m['step'] * 1e3:8.3f} ms")
  fastest = {name: min(parts["step"]) for name, parts in times.items()}
  print(f"fastest step: hand-cast {fastest['hand-cast'] * 1e3:.3f} ms, autocast "
        f"{fastest['autocast'] * 1e3:.3f} ms ({fastest['autocast'] / fastest['hand-cast']:.3f}x)")
  temporaries = {name: step.memory_analysis().temp_size_in_bytes / 1e6
                 for name, step in compiled.items()}
  print(f"compiled operations: autocast {sum(operations['autocast'].values())}, hand-cast "
        f"{sum(operations['hand-cast'].values())}; temporaries: autocast "
        f"{temporaries['autocast']:.2f} MB, hand-cast {temporaries['hand-cast']:.2f} MB "
        f"({temporaries['autocast'] / temporaries['hand-cast']:.3f}x)")
  ratio = {k: median["autocast"][k] / median["hand-cast"][k] for k in median["autocast"]}
  print(f"autocast / hand-cast: compile {ratio['compile']:.3f}x (trace and lower "
        f"{ratio['trace']:.3f}x, XLA {ratio['xla']:.3f}x), step {ratio['step']:.3f}x")

  x, w = jnp.ones((4, 4)), jnp.eye(4)
  for n in options.equations:
    plain, count = trace_seconds(chain(n), (x, w))
    auto, auto_count = trace_seconds(jls.autocast(chain(n)), (x, w))
    print(f"{count:>7} equations: make_jaxpr {plain:7.2f} s CPU, of its autocast {auto:7.2f} s "
          f"({auto_count} equations, {(auto - plain) / count * 1e6:.1f} us per equation "
          "interpreted)")


if __name__ == "__main__":
  main()
