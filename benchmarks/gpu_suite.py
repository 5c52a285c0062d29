"""Every GPU claim of this library, measured by one command in about 13 minutes.

On a fresh GPU machine (an H100 or H200), from the repository's root, in one line
(`jax[cuda13]` needs an NVIDIA driver >= 580; with an older one, `jax[cuda12]`):

  pip install -e ".[bench]" "jax[cuda13]" && python benchmarks/gpu_suite.py

It prints its tables and appends them to benchmarks/RESULTS.md under a heading naming
the device, the JAX version and the date. `--smoke` runs every part at toy sizes (on the
CPU in under two minutes) and writes nowhere unless given `--results PATH`;
tests/test_benchmarks.py runs it so, so that it never rots.

The parts, in the order they run, each with a budget of wall time on the GPU (compile
times included). A part checks its budget between compilations and between timed
rounds; one that overruns it stops there, and its table keeps the rows measured so far,
with a note. A part that finishes early leaves its time to the next: part k must end
`sum(budgets[:k + 1])` seconds after the start, and times at least `MIN_ROUNDS` rounds
even past it. The budgets are what each part took on an H200 (2026-12-04) with a margin:
710 s, with about 30 s of start-up (imports, CUDA's initialisation) and at most one
compilation of overrun (a float8 layer's 100 s with XLA's defaults), 12 to 14 minutes.
The float8 compilations with XLA's default options (about 100 s a float8 layer, 44 to 49 s a
float8 showcase step) are most of it.

   1. overhead (60 s): `overhead.py`'s table, plain Adam, at 1e7 and 1e8 parameters in 1
      and 64 leaves (1e8 in 64 first, the row the last GPU run was furthest behind in),
      every variant side by side in one process and interleaved, 50 rounds, plus the
      library step's alternative forms (`form: ...` rows): its form on an NVIDIA GPU is
      a `lax.cond` (the CPU's), one reduction per leaf and the inner optimizer inlined;
      each form row changes one or two of those (a select, as on TPU and as on a GPU
      until the H200 run of 2026-12-04; the reductions in rows of the CPU). About 1.5 s
      of compilation per variant and 11 variants; 47 s in all on the H200.
   2. overhead, clipped (60 s): the same with `clip_by_global_norm(1.0)`, 12 variants.
   3. demo step (30 s): the MLP demo's step (`python -m jax_lossscale.demo`: embedding,
      two GELU layers, `loss_scaling(adam)`, `apply_gradients`) at hidden 2048, batch
      32768, in float32, float16 cast by hand, float16 and bfloat16 by `jls.autocast`:
      compile time, step time (20 rounds), XLA's memory analysis, the device's memory.
      4 small compilations of 1-3 s.
   4. showcase step (50 s): the transformer demo's own jitted step
      (`transformer.make_step`) at 6 layers of width 768, 64 x 256 tokens (43M
      parameters), the same four precisions, 10 rounds. Compilation of an `nnx.scan`
      model of this size: about 5-10 s each.
   5. probes (20 s): the showcase step in float16 with and without probes on every
      module (`benchmarks/probes.py`'s `unprobed` and `probed`), 10 rounds; 2
      compilations.
   6. fp8 layer (250 s): one 4096x8192 by 8192x16384 matmul, forward and backward, in
      bfloat16 by `jls.autocast` (compiled as it is, and with `jls.fp8_compiler_options()`:
      what turning Triton's GEMMs off does to bfloat16's), in "tensorwise" and "rowwise"
      float8 (`fp8=`) compiled with `jls.fp8_compiler_options()` and then with XLA's
      default options (`, XLA's` rows), in float32 and in float16 by `jls.autocast`
      (ratios to bfloat16), with a check that each compiled fp8 program calls cuBLASLt's
      float8 GEMM (`__cublas$lt$matmul$f8`) for its three matmuls; and a 4096x8192 by
      8192x8192 one in float32 and float16. 20 rounds. On the H200 each float8 program
      took about 1 s to compile with those options and about 100 s with XLA's defaults
      (autotuning, most likely Triton GEMMs for every float8 dot), bfloat16's 2 s.
   7. fp8 showcase (140 s): the showcase's step under
      `jls.autocast(loss_fn, jnp.bfloat16, fp8=...)` against bfloat16 alone, each compiled
      as in part 6 both ways (44 to 49 s a float8 step with XLA's defaults; 133 s in all
      on the H200).
   8. bfloat16 writes (50 s): Adam's `apply_gradients` on 1e8 bfloat16 parameters in 64
      leaves, and on 1e7 in one, with each `rounding=` (and stochastic with
      `state_dtype=jnp.bfloat16`) against plain Adam on float32 parameters, 30 rounds;
      and nearest and compensated emitted as the `lax.cond` (`, cond` rows), which a
      step that checks its written values is not on a GPU.
   9. fp8 by width (50 s; 20 s on the H200): 16384 rows by a square weight of
      width 768, 1536, 3072 and 6144, forward and backward, in bfloat16 (as it is and
      with `jls.fp8_compiler_options()`) and in each recipe compiled with those options,
      20 rounds: the width below which float8 is slower than bfloat16 (the showcase's
      768 is), for `Float8Recipe.min_size`. 16 compilations of 0.2 to 2 s each. On the
      H200 float8 paid from width 3072 (docs/fp8.md, "On a GPU").

The parts are 710 s of budgets. `--parts 6,7,8,4` runs only the parts so numbered, in that
order, each with its own budget: where device time is short, the parts that matter most
first (`--parts 6,7,8`, float8 and the bfloat16 writes: 440 s of budgets, 7 to 8 minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import pathlib
import re
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable
from collections.abc import Sequence
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from jax_lossscale import _finite
from jax_lossscale import _transform
from jax_lossscale.demo import mlp
from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import overhead  # noqa: E402
import probes  # noqa: E402

RESULTS = pathlib.Path(__file__).parent / "RESULTS.md"
FLOAT8_GEMM = "__cublas$lt$matmul$f8"
RECIPES = ("tensorwise", "rowwise")
MB = 1e6


# --- budgets and tables ----------------------------------------------------------------


class OutOfTime(Exception):
  """Raised by `Budget.check` once the part's time is spent."""


@dataclasses.dataclass
class Budget:
  """A part's deadline, in `time.monotonic()` seconds."""

  deadline: float

  def expired(self) -> bool:
    return time.monotonic() >= self.deadline

  def check(self) -> None:
    if self.expired():
      raise OutOfTime


@dataclasses.dataclass
class Table:
  """A part's output: a title, a header, the rows measured so far and notes."""

  title: str
  header: str = ""
  rows: list[str] = dataclasses.field(default_factory=list)
  notes: list[str] = dataclasses.field(default_factory=list)
  failed: bool = False

  def text(self) -> str:
    lines = [f"# {self.title}", *([self.header] if self.header else []), *self.rows]
    return "\n".join(lines + [f"# {note}" for note in self.notes])


# --- sizes -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sizes:
  """Every part's sizes and rounds."""

  overhead_params: tuple[float, ...] = (1e8, 1e7)
  overhead_leaves: tuple[int, ...] = (64, 1)
  overhead_reps: int = 50
  mlp: mlp.Config = mlp.Config(batch=32768, hidden=2048)
  mlp_reps: int = 20
  showcase: transformer.Config = transformer.Config(batch=64, context=256, width=768,
                                                    heads=12, layers=6)
  showcase_reps: int = 10
  layer: tuple[int, int, int] = (4096, 8192, 16384)
  square_layer: tuple[int, int, int] = (4096, 8192, 8192)
  layer_reps: int = 20
  writes: tuple[tuple[float, int], ...] = ((1e8, 64), (1e7, 1))
  writes_reps: int = 30
  widths: tuple[int, ...] = (768, 1536, 3072, 6144)  # square layers of `width_rows` rows
  width_rows: int = 16384


GPU = Sizes()
SMOKE = Sizes(overhead_params=(1e3,), overhead_leaves=(2,), overhead_reps=2,
              mlp=mlp.Config(batch=64, hidden=16), mlp_reps=2,
              showcase=transformer.Config(batch=4, context=8, width=16, heads=2, layers=1),
              showcase_reps=2, layer=(32, 64, 48), square_layer=(32, 64, 64), layer_reps=2,
              writes=((1e3, 2),), writes_reps=2, widths=(16,), width_rows=32)


# --- shared measurements -------------------------------------------------------------------


MIN_ROUNDS = overhead.MIN_ROUNDS  # timed rounds even past a part's budget


def median_ms(times: list[float]) -> float:
  return 1e3 * statistics.median(times)


def interleaved(runs: dict, reps: int, budget: Budget) -> dict[str, list[float]]:
  """`reps` rounds of one call of each run (name -> [step, state], `step(state)` giving
  `(state, output)`), in a random order each round; the rounds finished within the
  budget, and at least `MIN_ROUNDS` (or `reps`, if fewer). Each run's state is replaced
  as it steps (it is donated)."""
  times, rng = {name: [] for name in runs}, np.random.default_rng(0)
  for i in range(reps):
    if i >= MIN_ROUNDS and budget.expired():
      break
    for name in rng.permutation(list(runs)):
      step, state = runs[name]
      start = time.perf_counter()
      state, out = step(state)
      jax.block_until_ready(out)
      times[name].append(time.perf_counter() - start)
      runs[name][1] = state
  return times


def memory(compiled) -> tuple[float, float]:
  """XLA's memory analysis of a compiled program: (its temporaries, its peak: arguments,
  outputs and temporaries, less the donated arguments that outputs reuse), in MB."""
  m = compiled.memory_analysis()
  peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)
  return m.temp_size_in_bytes / MB, peak / MB


def device_memory() -> str:
  """The device's own figures (`memory_stats()`): in use now, and the process's peak."""
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return "n/a"
  return f"{stats['bytes_in_use'] / MB:.0f}/{stats.get('peak_bytes_in_use', 0) / MB:.0f}"


def compiled_with_time(jitted, *args):
  """`(compiled, trace and lower seconds, XLA seconds)`, wall time."""
  start = time.perf_counter()
  lowered = jitted.lower(*args)
  middle = time.perf_counter()
  compiled = lowered.compile()
  return compiled, middle - start, time.perf_counter() - middle


STEP_HEADER = (f"{'variant':>24s} {'ms/step':>9s} {'ratio':>6s} {'lower s':>8s} "
               f"{'XLA s':>6s} {'temp MB':>8s} {'XLA peak MB':>11s} {'device MB now/peak':>18s}")


def step_table(table: Table, built: dict, runs: dict, reps: int, budget: Budget) -> None:
  """Times `runs` interleaved and writes one row per variant of `built` (name ->
  (compiled, lower s, XLA s, device memory)); ratios to the first row."""
  table.header = STEP_HEADER
  times = interleaved(runs, reps, budget)
  base = median_ms(times[next(iter(times))])
  for name, (compiled, lower_s, xla_s, device) in built.items():
    temp, peak = memory(compiled)
    table.rows.append(f"{name:>24s} {median_ms(times[name]):9.3f} "
                      f"{median_ms(times[name]) / base:6.3f} {lower_s:8.2f} {xla_s:6.2f} "
                      f"{temp:8.1f} {peak:11.1f} {device:>18s}")
  table.notes.append(f"medians of {len(times[next(iter(times))])} interleaved steps; device "
                     "MB: in use after the first step / the process's peak so far")


# --- 1, 2: the step's overhead, and its forms ------------------------------------------------


class _NotInlined(types.ModuleType):
  """`jax` whose `jit` ignores `inline=`: `_transform`'s inner step as a called function."""

  def __init__(self):
    super().__init__("jax")

  def __getattr__(self, name):
    if name == "jit":
      return lambda fun, inline=False, **kw: jax.jit(fun, **kw)
    return getattr(jax, name)


@contextlib.contextmanager
def step_form(emit: str, check: str, inline: bool = True):
  """While tracing: the step emitted by `emit` ("cond", the CPU form, or "select"), the
  gradients checked by `check` ("rows": small leaves concatenated, large ones in rows,
  the CPU form; or "leaf": one reduction per leaf), the inner optimizer inlined or not."""
  chosen = {"rows": _finite._largest_in_chunks, "leaf": _finite._largest_per_leaf}[check]

  def by_platform(*args, cpu, default, cuda=None):
    return (cpu if emit == "cond" else default)(*args)

  with contextlib.ExitStack() as stack:
    stack.enter_context(mock.patch.object(_finite, "by_platform", by_platform))
    stack.enter_context(mock.patch.object(_finite, "_largest_in_chunks", chosen))
    stack.enter_context(mock.patch.object(_finite, "_largest_per_leaf", chosen))
    if not inline:
      stack.enter_context(mock.patch.object(_transform, "jax", _NotInlined()))
    yield


FORMS = {
    "form: cond, rows (CPU's)": {"emit": "cond", "check": "rows"},
    "form: select, one per leaf": {"emit": "select", "check": "leaf"},
    "form: select, rows": {"emit": "select", "check": "rows"},
    "form: cond, not inlined": {"emit": "cond", "check": "leaf", "inline": False},
}


def form_variants(optimizer, clip_norm) -> dict:
  """`apply_gradients` of `loss_scaling(optimizer)` traced in each of `FORMS`."""
  tx = jls.loss_scaling(optimizer, clip_by_global_norm=clip_norm)

  def traced_in(form):
    def step(params, state, grads):
      with step_form(**form):
        return tx.apply_gradients(grads, state, params)
    return step

  return {name: (tx.init, traced_in(form)) for name, form in FORMS.items()}


def overhead_part(clip: bool):
  def part(sizes: Sizes, budget: Budget, table: Table) -> None:
    table.header = overhead.HEADER
    clip_norm = 1.0 if clip else None
    for n in sizes.overhead_params:
      for leaves in sizes.overhead_leaves:
        budget.check()
        steps = overhead.variants(optax.adam(1e-3), clip_norm) | form_variants(
            optax.adam(1e-3), clip_norm)
        runs = overhead.compile_variants(int(n), leaves, steps, budget)
        overhead.time_runs(runs, sizes.overhead_reps, budget=budget)
        rows = overhead.summarize(runs)
        table.rows += [overhead.format_row(n, leaves, name, r) for name, r in rows.items()]
        if len(rows) < len(steps):
          table.notes.append(f"{n:.0e}/{leaves}: {len(steps) - len(rows)} variants left out "
                             "at the budget")
        del runs
    table.notes.append(f"ratios to plain Adam{' clipped' if clip else ''} in the same "
                       f"process, {sizes.overhead_reps} interleaved rounds")
  return part


# --- 3, 4: the demos' training steps in four precisions ---------------------------------------


def mlp_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  config, data = sizes.mlp, text()
  table.title += f", hidden {config.hidden}, batch {config.batch}"
  contexts, targets = mlp.windows(
      data, data.train_starts(0, 1, config.batch, mlp.CONTEXT + 1)[0])
  f16, bf16 = jnp.float16, jnp.bfloat16
  variants = {
      "float32": (functools.partial(mlp.loss_fn, dtype=jnp.float32), jls.NoOpLossScale()),
      "float16, cast by hand": (functools.partial(mlp.loss_fn, dtype=f16),
                                jls.DynamicLossScale()),
      "float16, autocast": (jls.autocast(mlp.loss_fn, f16), jls.DynamicLossScale()),
      "bfloat16, autocast": (jls.autocast(mlp.loss_fn, bf16), jls.NoOpLossScale()),
  }
  built, runs = {}, {}
  for name, (loss, loss_scale) in variants.items():
    budget.check()
    tx = jls.loss_scaling(optax.adam(config.learning_rate), loss_scale)
    grad_fn = jls.scaled_value_and_grad(loss)

    def step(params, opt_state, x, y, grad_fn=grad_fn, tx=tx):
      value, grads = grad_fn(opt_state, params, x, y)
      params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=value)
      return params, opt_state, value

    params = mlp.init_params(jax.random.key(config.seed), data.vocab, config.hidden)
    state = (params, tx.init(params))
    jitted = jax.jit(step, donate_argnums=(0, 1))
    compiled, lower_s, xla_s = compiled_with_time(jitted, *state, contexts, targets)

    def run(state, compiled=compiled):
      params, opt_state, value = compiled(*state, contexts, targets)
      return (params, opt_state), value

    state, value = run(state)
    jax.block_until_ready(value)
    built[name] = (compiled, lower_s, xla_s, device_memory())
    runs[name] = [run, state]
  step_table(table, built, runs, sizes.mlp_reps, budget)


SHOWCASE_PRECISIONS = {
    "float32": (transformer.FLOAT32, jls.NoOpLossScale()),
    "float16, cast by hand": (transformer.FLOAT16, jls.DynamicLossScale()),
    "float16, autocast": (transformer.Autocast(np.dtype(jnp.float16)), jls.DynamicLossScale()),
    "bfloat16, autocast": (transformer.Autocast(np.dtype(jnp.bfloat16)), jls.NoOpLossScale()),
}


@functools.cache
def text() -> Text:
  return Text.load()


def showcase_batches(config: transformer.Config) -> tuple[Text, jax.Array]:
  data = text()
  return data, data.windows(data.train_starts(0, 1, config.batch, config.context + 1)[0],
                            config.context + 1)


def showcase_run(step, state, tokens) -> tuple[tuple, list]:
  """`(built row, run)` of a jitted showcase step `(state, tokens) -> (state, logs)`."""
  compiled, lower_s, xla_s = compiled_with_time(step, state, tokens)
  print(f"#   compiled a showcase step in {lower_s + xla_s:.1f} s", flush=True)

  def run(state):
    return compiled(state, tokens)

  state, logs = run(state)
  jax.block_until_ready(logs)
  return (compiled, lower_s, xla_s, device_memory()), [run, state]


def showcase_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  config = sizes.showcase
  data, tokens = showcase_batches(config)
  table.title += showcase_title(config)
  built, runs = {}, {}
  for name, (policy, loss_scale) in SHOWCASE_PRECISIONS.items():
    budget.check()
    graphdef, state = transformer.init(config, data.vocab, policy, loss_scale, seed=0)
    autocast = isinstance(policy, transformer.Autocast)
    step = transformer.make_step(graphdef, probes=False,
                                 compute_dtype=policy.compute_dtype if autocast else None)
    built[name], runs[name] = showcase_run(step, state, tokens)
  step_table(table, built, runs, sizes.showcase_reps, budget)


def showcase_title(config: transformer.Config) -> str:
  model = nnx.eval_shape(lambda: transformer.TransformerLM(
      config, text().vocab, transformer.FLOAT32, nnx.Rngs(0)))
  count = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  return (f", {config.layers} layers of width {config.width}, {config.batch}x{config.context} "
          f"tokens, {count / 1e6:.1f}M parameters")


# --- 5: the probes' cost -----------------------------------------------------------------------


def probes_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  config = sizes.showcase
  table.title += showcase_title(config)
  data, tokens = showcase_batches(config)
  split = lambda: transformer.init(config, data.vocab, transformer.FLOAT16,
                                   jls.MeasuredLossScale(), seed=0)
  graphdef, init = split()[0], lambda: split()[1]
  built, runs = {}, {}
  for name in ("unprobed", "probed"):
    budget.check()
    step = transformer.make_step(graphdef, probes=name == "probed")
    built[name], runs[name] = showcase_run(step, init(), tokens)
  step_table(table, built, runs, sizes.showcase_reps, budget)
  model = nnx.merge(graphdef, init())[0]
  elements = probes.probed_elements(model, tokens)["all"]
  table.notes.append(f"the probes read {elements / 1e6:.2f}M activation elements a step")


# --- 6, 7, 9: float8 -----------------------------------------------------------------------------


def layer_step(compute_dtype, compiler_options=None, **options):
  """A jitted matmul's forward and backward `(x, w, cotangent) -> (y, dx, dw)`, its matmuls
  in `compute_dtype` by `jls.autocast` (float32 for None), compiled with the XLA options
  `compiler_options`."""
  matmul = jnp.matmul if compute_dtype is None else jls.autocast(jnp.matmul, compute_dtype,
                                                                 **options)

  def step(x, w, cotangent):
    y, vjp = jax.vjp(matmul, x, w)
    return y, *vjp(cotangent)

  return jax.jit(step, compiler_options=compiler_options)


def custom_calls(compiled) -> list[str]:
  return re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())


def layer_rows(table: Table, shape, variants: dict, reps: int, budget: Budget) -> None:
  """One row per variant compiled within the budget (at least the first), each timed in
  interleaved rounds; ratios to the first variant. Each compilation's time is printed as
  it ends, so that a part stopped at its budget still shows where the time went."""
  m, k, n = shape
  keys = jax.random.split(jax.random.key(0), 3)
  args = (jax.random.normal(keys[0], (m, k)), jax.random.normal(keys[1], (k, n)),
          jax.random.normal(keys[2], (m, n)))
  built, runs = {}, {}
  for name, step in variants.items():
    if built and budget.expired():
      left = "; ".join(name for name in variants if name not in built)
      table.notes.append(f"{m}x{k}x{n}: not compiled within the budget: {left}")
      break
    compiled, lower_s, xla_s = compiled_with_time(step, *args)
    print(f"#   compiled {m}x{k}x{n} {name} in {lower_s + xla_s:.1f} s", flush=True)
    run = lambda state, compiled=compiled: (state, compiled(*args))
    jax.block_until_ready(run(None)[1])
    built[name], runs[name] = (compiled, lower_s, xla_s), [run, None]
  times = interleaved(runs, reps, budget)
  base = median_ms(times[next(iter(times))])
  flops = 6 * m * k * n
  for name, (compiled, lower_s, xla_s) in built.items():
    ms = median_ms(times[name])
    gemms = [call for call in custom_calls(compiled) if "cublas" in call]
    kinds = ", ".join(f"{gemms.count(c)} {c}" for c in sorted(set(gemms))) or "no cuBLAS call"
    if name.startswith("fp8") and gemms:  # not "bfloat16, fp8 options"
      kinds += " (float8: OK)" if gemms.count(FLOAT8_GEMM) == 3 else " (NOT ALL FLOAT8)"
    table.rows.append(f"{m}x{k} by {k}x{n} {name:>22s} {ms:9.3f} {ms / base:6.3f} "
                      f"{flops / ms / 1e9:9.1f} {lower_s + xla_s:6.2f}  {kinds}")


LAYER_HEADER = (f"{'matmul':>24s} {'variant':>22s} {'ms':>9s} {'ratio':>6s} {'TFLOP/s':>9s} "
                f"{'comp s':>6s}  GEMM")


def float8_variants(xla_defaults: bool = True) -> dict[str, tuple[dict, dict | None]]:
  """The float8 parts' variants, in the order they compile: `name -> (jls.autocast's
  options, the XLA options to compile with)`. bfloat16 as it is and with
  `jls.fp8_compiler_options()`, each recipe with them, and (`xla_defaults`) each recipe
  with XLA's defaults (", XLA's"), compiled after the others so that theirs is a cold
  compile."""
  options = jls.fp8_compiler_options()
  variants = {"bfloat16, autocast": ({}, None), "bfloat16, fp8 options": ({}, options)}
  variants |= {f"fp8 {recipe}": ({"fp8": recipe}, options) for recipe in RECIPES}
  if xla_defaults:
    variants |= {f"fp8 {recipe}, XLA's": ({"fp8": recipe}, None) for recipe in RECIPES}
  return variants


def float8_layer_steps(xla_defaults: bool = True) -> dict:
  """`float8_variants`, each as a jitted `layer_step`."""
  return {name: layer_step(jnp.bfloat16, compiler_options, **options)
          for name, (options, compiler_options) in float8_variants(xla_defaults).items()}


OPTIONS_NOTE = ("fp8 and 'fp8 options': compiled with jls.fp8_compiler_options(); ', XLA's': "
                "with XLA's default options")


def fp8_layer_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  table.header = LAYER_HEADER
  variants = float8_layer_steps()
  variants |= {"float32": layer_step(None), "float16, autocast": layer_step(jnp.float16)}
  table.notes.append("forward and backward (3 matmuls); ratios to each shape's first row; "
                     f"TFLOP/s counts 6mkn; {OPTIONS_NOTE}; each fp8 program should call "
                     f"{FLOAT8_GEMM} 3 times (GPU only)")
  layer_rows(table, sizes.layer, variants, sizes.layer_reps, budget)
  budget.check()
  layer_rows(table, sizes.square_layer, {name: variants[name] for name in (
      "float32", "float16, autocast")}, sizes.layer_reps, budget)


def fp8_widths_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  """Where float8 starts to pay: a layer of `width_rows` rows by a square weight of each
  width, forward and backward, in bfloat16 (as it is, and compiled with
  `jls.fp8_compiler_options()`, as a float8 step's bfloat16 matmuls are) and in each recipe
  compiled with them; ratios to bfloat16 at each width."""
  table.header = LAYER_HEADER
  table.notes.append(f"forward and backward; ratios to bfloat16 at each width; {OPTIONS_NOTE}; "
                     "Float8Recipe.min_size keeps the matmuls below a width in bfloat16")
  for width in sizes.widths:
    budget.check()
    layer_rows(table, (sizes.width_rows, width, width), float8_layer_steps(xla_defaults=False),
               sizes.layer_reps, budget)


def fp8_showcase_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  config = sizes.showcase
  table.title += showcase_title(config)
  data, tokens = showcase_batches(config)
  built, runs = {}, {}
  for name, (options, compiler_options) in float8_variants().items():
    budget.check()
    graphdef, state = transformer.init(config, data.vocab,
                                       transformer.Autocast(np.dtype(jnp.bfloat16)),
                                       jls.NoOpLossScale(), seed=0)
    built[name], runs[name] = showcase_run(
        autocast_step(graphdef, options, compiler_options), state, tokens)
  table.notes.append(OPTIONS_NOTE)
  step_table(table, built, runs, sizes.showcase_reps, budget)


def autocast_step(graphdef, options: dict, compiler_options: dict | None = None):
  """The showcase's step with its loss under `jls.autocast(loss_fn, jnp.bfloat16,
  **options)`, giving the loss as its log, compiled with the XLA options
  `compiler_options`."""
  grad_fn = jls.scaled_value_and_grad(
      jls.autocast(transformer.loss_fn, jnp.bfloat16, **options),
      value_and_grad=nnx.value_and_grad)

  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = grad_fn(optimizer.opt_state, model, tokens)
    optimizer.update(model, grads, loss=loss)
    return nnx.state((model, optimizer)), loss

  return jax.jit(step, donate_argnums=0, compiler_options=compiler_options)


# --- 8: bfloat16 parameter writes ---------------------------------------------------------------


def writes_part(sizes: Sizes, budget: Budget, table: Table) -> None:
  adam = optax.adam(1e-3)
  configurations = {f"bfloat16, {r}": {"rounding": r}
                    for r in ("nearest", "stochastic", "compensated")}
  configurations["bfloat16, stochastic, bfloat16 state"] = {
      "rounding": "stochastic", "state_dtype": jnp.bfloat16}
  def step_of(options):  # a function of its own: JAX caches a trace by function
    tx = jls.loss_scaling(adam, jls.NoOpLossScale(), **options)
    return tx.init, lambda p, s, g: tx.apply_gradients(g, s, p)

  steps = {name: step_of(options) for name, options in configurations.items()}
  plain = {"plain": overhead.variants(adam)["plain"]}
  in_cond = {f"{name}, cond": step_of(configurations[name])
             for name in ("bfloat16, nearest", "bfloat16, compensated")}
  table.header = f"{overhead.HEADER} {'params+state MB':>15s}"
  for n, leaves in sizes.writes:
    budget.check()
    n = int(n)
    runs = overhead.compile_variants(n, leaves, plain, budget) | overhead.compile_variants(
        n, leaves, steps, budget, dtype=jnp.bfloat16)
    with checked_steps_in_cond():
      runs |= overhead.compile_variants(n, leaves, in_cond, budget, dtype=jnp.bfloat16)
    overhead.time_runs(runs, sizes.writes_reps, budget=budget)
    for name, r in overhead.summarize(runs).items():
      state_bytes = sum(x.nbytes for x in jax.tree.leaves((runs[name]["p"], runs[name]["s"])))
      table.rows.append(f"{overhead.format_row(n, leaves, name, r)} {state_bytes / MB:15.1f}")
    del runs
  table.notes.append("plain: optax Adam on float32 parameters; ratios to it (a rounding's "
                     "cost over nearest's: the ratio of their ratios); ', cond': the step "
                     "that checks its written values emitted as a lax.cond on an NVIDIA GPU "
                     "too, not as the select")


@contextlib.contextmanager
def checked_steps_in_cond():
  """While tracing: a step that checks the values it writes (narrow parameters) emitted
  on an NVIDIA GPU as the `lax.cond` that a step checking nothing is, not as the select
  (a CPU program is the `lax.cond` either way)."""
  emit = _transform.run_or_pass

  def in_cond(*args, **kwargs):
    return emit(*args, **{**kwargs, "cond_on_cuda": True})

  with mock.patch.object(_transform, "run_or_pass", in_cond):
    yield


# --- running the parts -------------------------------------------------------------------

PARTS: list[tuple[str, float, Callable[[Sizes, Budget, Table], None]]] = [
    ("overhead: apply_gradients and the anchors, Adam", 60, overhead_part(clip=False)),
    ("overhead: the same, clip_by_global_norm(1.0) + Adam", 60, overhead_part(clip=True)),
    ("the MLP demo's training step", 30, mlp_part),
    ("the transformer showcase's training step", 50, showcase_part),
    ("the probes' cost on the showcase's float16 step", 20, probes_part),
    ("fp8 layer, forward and backward", 250, fp8_layer_part),
    ("the showcase in fp8", 140, fp8_showcase_part),
    ("bfloat16 parameter writes, apply_gradients", 50, writes_part),
    ("fp8 by width: where float8 starts to pay", 50, fp8_widths_part),
]


def run_parts(sizes: Sizes, scale: float = 1.0, stream=sys.stdout,
              order: Sequence[int] | None = None) -> list[Table]:
  """The parts numbered in `order` (1-based, as listed above; all by default) in that
  order, each ending by its cumulative deadline (budgets times `scale`)."""
  start, tables, planned = time.monotonic(), [], 0.0
  order = order or range(1, len(PARTS) + 1)
  for title, seconds, part in (PARTS[k - 1] for k in order):
    planned += seconds * scale
    table, begun = Table(title), time.monotonic()
    try:
      part(sizes, Budget(start + planned), table)
    except OutOfTime:
      table.notes.append("stopped at its budget: the rows above are those measured by then")
    except Exception as error:  # noqa: BLE001 - one part's failure must not lose the others
      table.failed = True
      table.notes.append(f"FAILED: {type(error).__name__}: {error}")
      traceback.print_exc()
    table.notes.append(f"{time.monotonic() - begun:.1f} s of a {seconds * scale:.0f} s budget")
    print(table.text() + "\n", file=stream, flush=True)
    tables.append(table)
  return tables


def heading() -> str:
  device = jax.devices()[0]
  date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
  return (f"## GPU suite: {device.platform.upper()} {device.device_kind}, jax "
          f"{jax.__version__}, optax {optax.__version__}, {date}")


def write(path: pathlib.Path, tables: list[Table], seconds: float, argv: list[str]) -> None:
  blocks = "\n\n".join(f"```\n{t.text()}\n```" for t in tables)
  command = " ".join(["python benchmarks/gpu_suite.py", *argv])
  with open(path, "a") as f:
    f.write(f"\n{heading()}\n\n`{command}`, {seconds:.0f} s in all.\n\n{blocks}\n")


def parts_order(value: str) -> list[int]:
  """`--parts`' value: distinct part numbers between 1 and len(PARTS), comma-separated."""
  try:
    order = [int(k) for k in value.split(",")]
  except ValueError:
    order = []
  if not order or len(set(order)) < len(order) or not all(1 <= k <= len(PARTS) for k in order):
    raise argparse.ArgumentTypeError(
        f"--parts must be distinct part numbers from 1 to {len(PARTS)}, comma-separated; "
        f"got {value!r}")
  return order


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--smoke", action="store_true",
                      help="every part at toy sizes; writes nowhere unless --results is given")
  parser.add_argument("--results", type=pathlib.Path,
                      help=f"append the tables to this file (default: {RESULTS}, none with "
                      "--smoke)")
  parser.add_argument("--scale", type=float, default=1.0,
                      help="multiply every part's budget by this")
  parser.add_argument("--parts", type=parts_order, default=None,
                      help="the parts to run, by number and in this order, e.g. 6,7,8,4 "
                      "(default: every part, in the order above)")
  args = parser.parse_args(argv)
  results = args.results or (None if args.smoke else RESULTS)
  start = time.monotonic()
  print(heading() + "\n")
  tables = run_parts(SMOKE if args.smoke else GPU, args.scale, order=args.parts)
  seconds = time.monotonic() - start
  print(f"# {seconds:.1f} s in all")
  if results is not None:
    write(results, tables, seconds, list(argv if argv is not None else sys.argv[1:]))
  if any(t.failed for t in tables):
    raise SystemExit(f"failed: {', '.join(t.title for t in tables if t.failed)}")


if __name__ == "__main__":
  main()
