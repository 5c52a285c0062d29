"""float8 matmuls under `autocast(..., fp8=recipe)`: error, compile time, and (on a GPU) speed.

Four tables:

- **error**: the relative error against float32 of an M x K by K x N matmul of N(0, 1)
  values (and of the same values times 1e-6 and 1e4, and with one row 1e5 times the
  others: the other rows' error), per recipe and in bfloat16;
- **compile**: the time to trace, lower and compile a training step of the transformer
  demo's model under `autocast(..., bfloat16)` and under each recipe, and its ratio to
  bfloat16's: the bare step (loss, gradient and Adam) and the demo's own step (the one its
  bfloat16 and float8 runs compile: `loss_scaling` around Adam with clipping, and the
  logged metrics), split into tracing and lowering (Python) and XLA's compilation; the
  float8 steps compiled with `jls.fp8_compiler_options()` (none on a CPU);
- **kernels**: XLA's compile time of a program of `--kernels` kernels of one kind (a
  row's amax; a scaling multiply and cast to float8; the same cast to bfloat16), each on
  an operand of its own shape: which of the steps a float8 matmul adds costs compile time;
- **layer** (`--layer`): one M x K by K x N layer forward and backward, jitted, in
  bfloat16 and in each recipe (compiled with `jls.fp8_compiler_options()`), timed; and
  how many of its 3 matmuls call cuBLASLt's float8 GEMM (`__cublas$lt$matmul$f8` custom
  calls in its HLO, as `gpu_suite.py` counts them). XLA:CPU runs float8 matmuls as
  converts and a float32 matmul, slower than float32: this table means something on a
  GPU (Hopper or newer) only.

  python benchmarks/fp8.py                                   # the CPU figures
  python benchmarks/fp8.py --layer 4096 8192 16384 --reps 20  # on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from gpu_suite import FLOAT8_GEMM  # noqa: E402
from gpu_suite import custom_calls  # noqa: E402

RECIPES = ("tensorwise", "rowwise")


def relative_error(approximate, reference) -> float:
  approximate, reference = np.asarray(approximate, np.float64), np.asarray(reference, np.float64)
  return float(np.linalg.norm(approximate - reference) / np.linalg.norm(reference))


def errors(m: int, k: int, n: int) -> dict[str, dict[str, float]]:
  """`{case: {recipe or "bfloat16": relative error}}` of the m x k by k x n matmul."""
  keys = jax.random.split(jax.random.key(0), 2)
  x, w = jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k, n))
  cases = {"N(0,1)": x, "x 1e-6": x * 1e-6, "x 1e4": x * 1e4,
           "outlier row (other rows)": x.at[0].multiply(1e5)}
  table = {}
  for case, values in cases.items():
    reference = values @ w
    rows = slice(1, None) if case.startswith("outlier") else slice(None)
    table[case] = {}
    for recipe in (None, *RECIPES):
      out = jax.jit(jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8=recipe))(values, w)
      table[case][recipe or "bfloat16"] = relative_error(out[rows], reference[rows])
  return table


def step_function(fp8, config: transformer.Config, vocab: int):
  model = transformer.TransformerLM(config, vocab, transformer.AUTOCAST, nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tx = optax.adam(1e-3)
  loss = jls.autocast(transformer.loss_fn, jnp.bfloat16, fp8=fp8)

  def step(params, opt_state, tokens):
    value, grads = jax.value_and_grad(lambda p: loss(nnx.merge(graphdef, p), tokens))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  tokens = jnp.zeros((config.batch, config.context + 1), jnp.int32)
  return step, (params, tx.init(params), tokens)


def showcase_step(fp8, config: transformer.Config, vocab: int):
  """The demo's own jitted step of its bfloat16 or float8 run, and its arguments."""
  precision = dataclasses.replace(transformer.BFLOAT16, fp8=fp8)
  graphdef, state = transformer.init(config, vocab, precision, jls.NoOpLossScale(), seed=0)
  step = transformer.make_step(graphdef, False, precision.compute_dtype, fp8)
  return step, (state, jnp.zeros((config.batch, config.context + 1), jnp.int32))


def compile_seconds(fp8, config: transformer.Config, vocab: int,
                    showcase: bool = False) -> tuple[float, float]:
  """`(trace and lower seconds, XLA compile seconds)` of the bare step, or of the demo's own
  (`showcase`), in the process's CPU seconds (all its threads; less disturbed than wall
  time by other processes on a shared machine)."""
  if showcase:
    step, args = showcase_step(fp8, config, vocab)
  else:
    step, args = step_function(fp8, config, vocab)
    step = jax.jit(step, compiler_options=jls.fp8_compiler_options() if fp8 else None)
  jax.clear_caches()
  start = time.process_time()
  lowered = step.lower(*args)
  traced = time.process_time()
  lowered.compile()
  return traced - start, time.process_time() - traced


def kernel_seconds(count: int) -> dict[str, float]:
  """XLA compile seconds (CPU time) of one program of `count` kernels of one kind, each on
  its own operand of a distinct shape (XLA compiles identical kernels once): what a
  float8 matmul adds per operand and per row-scaled operand, taken apart."""
  shapes = [(1024, 64 + 16 * i) for i in range(count)]
  factors = [jnp.full((shape[0], 1), 2.0**-3) for shape in shapes]
  kinds = {
      "amax along rows": lambda xs, fs: [jnp.max(jnp.abs(x), axis=1) for x in xs],
      "scale, cast to e4m3": lambda xs, fs: [(x * f).astype(jnp.float8_e4m3fn)
                                             for x, f in zip(xs, fs, strict=True)],
      "scale, cast to bfloat16": lambda xs, fs: [(x * f).astype(jnp.bfloat16)
                                                 for x, f in zip(xs, fs, strict=True)],
  }
  xs = [jnp.ones(shape, jnp.bfloat16) for shape in shapes]
  seconds = {}
  for name, kernels in kinds.items():
    jax.clear_caches()
    lowered = jax.jit(kernels).lower(xs, factors)
    start = time.process_time()
    lowered.compile()
    seconds[name] = time.process_time() - start
  return seconds


def layer(m: int, k: int, n: int, reps: int) -> dict[str, tuple[float, int]]:
  """`{recipe or "bfloat16": (median seconds of forward + backward, how many cuBLASLt float8
  GEMMs the program calls: 3 when all its matmuls run in float8 on a GPU)}`."""
  keys = jax.random.split(jax.random.key(1), 3)
  x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  w = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
  c = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
  out = {}
  for recipe in (None, *RECIPES):
    f = jls.autocast(lambda x, w: jnp.sum((x @ w) * c, dtype=jnp.float32), jnp.bfloat16,
                     fp8=recipe)
    grad = jax.jit(jax.grad(f, argnums=(0, 1)),
                   compiler_options=jls.fp8_compiler_options() if recipe else None)
    compiled = grad.lower(x, w).compile()
    jax.block_until_ready(compiled(x, w))
    times = []
    for _ in range(reps):
      start = time.perf_counter()
      jax.block_until_ready(compiled(x, w))
      times.append(time.perf_counter() - start)
    out[recipe or "bfloat16"] = (statistics.median(times),
                                 custom_calls(compiled).count(FLOAT8_GEMM))
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--matmul", type=int, nargs=3, default=(256, 1024, 512))
  parser.add_argument("--batch", type=int, default=16)
  parser.add_argument("--width", type=int, default=64)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--layer", type=int, nargs=3, default=None)
  parser.add_argument("--kernels", type=int, default=40,
                      help="how many kernels of each kind the kernel table compiles (0: none)")
  parser.add_argument("--no-demo-step", action="store_true",
                      help="leave out the demo's own step from the compile table (it is "
                      "compiled at the demo's sizes)")
  args = parser.parse_args(argv)
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {platform.processor()}")

  m, k, n = args.matmul
  print(f"\nrelative error against float32, {m}x{k} by {k}x{n}")
  table = errors(m, k, n)
  print(f"{'values':<26}" + "".join(f"{name:>12}" for name in ("bfloat16", *RECIPES)))
  for case, row in table.items():
    print(f"{case:<26}" + "".join(f"{100 * row[name]:11.2f}%" for name in row))

  bare = transformer.Config(batch=args.batch, width=args.width, heads=4, layers=2)
  demo = transformer.Config(width=args.width)  # its own sizes: 384 sequences of 64
  vocab = Text.load().vocab  # the demo's: not a multiple of 16, its head stays bfloat16
  steps = [("bare step: loss, gradient, Adam", bare, False),
           ("the demo's own step, at its sizes", demo, True)][:1 if args.no_demo_step else 2]
  for title, config, showcase in steps:
    print(f"\ncompile time (CPU seconds) of the transformer demo's model (width {args.width}),"
          f" {title}, median of {args.reps}")
    seconds = {name: [] for name in ("bfloat16", *RECIPES)}
    for _ in range(args.reps):  # interleaved
      for recipe in (None, *RECIPES):
        seconds[recipe or "bfloat16"].append(
            compile_seconds(recipe, config, vocab if showcase else 96, showcase))
    base = statistics.median(sum(pair) for pair in seconds["bfloat16"])
    for name, pairs in seconds.items():
      median = statistics.median(sum(pair) for pair in pairs)
      lowering = statistics.median(pair[0] for pair in pairs)
      xla = statistics.median(pair[1] for pair in pairs)
      print(f"{name:<12}{median:8.2f} s  {median / base:5.2f}x   trace and lower {lowering:5.2f} s,"
            f" XLA {xla:5.2f} s")

  if args.kernels:
    print(f"\nXLA compile time (CPU seconds) of {args.kernels} kernels of one kind, on bfloat16"
          f" operands of 1024 rows, each of its own width")
    for name, value in kernel_seconds(args.kernels).items():
      print(f"{name:<26}{value:7.3f} s  {1e3 * value / args.kernels:6.1f} ms per kernel")

  if args.layer:
    m, k, n = args.layer
    print(f"\none {m}x{k} by {k}x{n} layer, forward and backward, median of {args.reps}")
    results = layer(m, k, n, args.reps)
    base = results["bfloat16"][0]
    for name, (median, fp8_gemms) in results.items():
      print(f"{name:<12}{1e3 * median:9.2f} ms  speedup {base / median:5.2f}x  "
            f"cuBLASLt fp8 GEMM calls: {fp8_gemms} of 3")


if __name__ == "__main__":
  main()
