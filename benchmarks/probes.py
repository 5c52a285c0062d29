"""What probes cost: one float16 training step of the transformer demo, with and without
probes on every module's output, side by side (interleaved) in one process.

Every variant is the demo's own jitted step (`transformer.make_step`, the state donated):
float32 master weights, float16 compute, Adam clipped at norm 1 inside `loss_scaling`
with a `MeasuredLossScale`. `probed` measures every module's output, feeds the
measurements to the loss scale and returns them all; `unprobed` gives the scale the
parameter gradients only. Each `probed, without ...` variant leaves one group of module
classes unprobed, so `probed` minus it is what that group's probes cost. Reports the
median step time and XLA's bytes accessed, the elements each group's probes read, the
compile time (trace and lower, then XLA's compile; caches cleared, interleaved), and
checks that the unprobed program is the one traced with the probes placed but not
measuring. Example:

  python benchmarks/probes.py --reps 30
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import platform
import statistics
import time

import jax
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from jax_lossscale.demo import transformer
from jax_lossscale.demo.text import Text
from jax_lossscale.probes import core
from jax_lossscale.probes import placed

GROUPS = {
    "Linear, Embed": (nnx.Linear, nnx.Embed),
    "LayerNorm": (nnx.LayerNorm,),
    "Attention, Block, TransformerLM": (transformer.Attention, transformer.Block,
                                        transformer.TransformerLM),
}


@contextlib.contextmanager
def unprobed(classes):
  """While tracing, the NNX adapter leaves these classes' outputs unprobed (it gives no
  probed subclass to a class whose `__call__` is marked as probing already)."""
  calls = [cls.__call__ for cls in classes]
  for call in calls:
    call._probes_output = True
  try:
    yield
  finally:
    for call in calls:
      del call._probes_output


VARIANTS = {"unprobed": (False, contextlib.nullcontext),
            "probed": (True, contextlib.nullcontext)} | {
    f"probed, without {group}": (True, lambda classes=classes: unprobed(classes))
    for group, classes in GROUPS.items()}


def build(graphdef, init, tokens, names=tuple(VARIANTS)) -> tuple[dict, dict, dict, dict]:
  """Each variant's step (of those in `names`), state after one step, XLA's bytes
  accessed and its temporary buffers' size (what the step holds beyond its inputs and
  outputs: activations kept for the backward pass among them)."""
  steps, states, bytes_accessed, temp_bytes = {}, {}, {}, {}
  for name in names:
    probes, context = VARIANTS[name]
    steps[name], states[name] = transformer.make_step(graphdef, probes), init()
    with context():  # traced and compiled here, once
      compiled = steps[name].lower(states[name], tokens).compile()
      states[name], logs = steps[name](states[name], tokens)
    jax.block_until_ready(logs)
    bytes_accessed[name] = compiled.cost_analysis()["bytes accessed"]
    temp_bytes[name] = compiled.memory_analysis().temp_size_in_bytes
  return steps, states, bytes_accessed, temp_bytes


def step_times(steps: dict, states: dict, batches: list, reps: int) -> dict[str, float]:
  """Each variant's median step time, the variants in a new random order every time."""
  times, rng = {name: [] for name in steps}, np.random.default_rng(0)
  for i in range(reps):
    for name in rng.permutation(list(steps)):
      start = time.perf_counter()
      states[name], logs = steps[name](states[name], batches[i % len(batches)])
      jax.block_until_ready(logs)
      times[name].append(time.perf_counter() - start)
  return {name: statistics.median(t) for name, t in times.items()}


def compile_times(graphdef, state, tokens, reps: int) -> dict[str, dict[str, float]]:
  """Median trace + lower, and XLA's compile, of the unprobed and probed steps."""
  times = {name: {"lower": [], "compile": []} for name in ("unprobed", "probed")}
  for _ in range(reps):
    for name, t in times.items():
      jax.clear_caches()
      start = time.perf_counter()
      lowered = transformer.make_step(graphdef, probes=name == "probed").lower(state, tokens)
      middle = time.perf_counter()
      lowered.compile()
      t["lower"].append(middle - start)
      t["compile"].append(time.perf_counter() - middle)
  return {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity, as jit needs
class _Sizes:
  """A probing session that records each probe's elements per step."""
  seen: dict
  returned: dict = dataclasses.field(default_factory=dict)
  skipped: set = dataclasses.field(default_factory=set)  # names of tensors probed already
  rows: bool = True  # stacked modules get their row index, as in a measuring session
  probed_copy: bool = True  # an equinox model is a probed copy, as in a measuring session

  def probe(self, x, name, index, length):
    del index
    self.seen.setdefault(name, math.prod(x.shape) * (length or 1))
    return x


def probed_elements(model, tokens) -> dict[str, int]:
  """Per group (and for all), the activation elements its probes measure in one step."""
  def count(classes):
    session = _Sizes({})
    with unprobed(classes), core._SESSION(session):
      nnx.eval_shape(placed(transformer.loss_fn), model, tokens)
    return sum(session.seen.values())

  total = count(())
  return {group: total - count(classes) for group, classes in GROUPS.items()} | {"all": total}


def unprobed_program_is_unchanged(model, tokens) -> bool:
  """Whether the gradient's program is the same with the probes placed but not measuring."""
  graphdef, state = nnx.split(model)
  jaxpr = lambda f: str(jax.make_jaxpr(
      lambda s, t: nnx.grad(f)(nnx.merge(graphdef, s), t))(state, tokens))
  return jaxpr(transformer.loss_fn) == jaxpr(placed(transformer.loss_fn))


def report(config, reps, median, bytes_accessed, temp_bytes, elements, compiled) -> None:
  device = jax.devices()[0]
  print(f"# {device.platform.upper()} {device.device_kind} ({platform.machine()}), jax "
        f"{jax.__version__}, optax {optax.__version__}; the transformer demo's float16 step, "
        f"{config.layers} layers, {config.batch}x{config.context} tokens; medians of {reps} "
        f"interleaved steps")
  base = median["unprobed"]
  print(f"{'variant':>48s} {'ms/step':>8s} {'ratio':>6s} {'bytes ratio':>11s} "
        f"{'temp MB':>8s}")
  for name in median:
    print(f"{name:>48s} {1e3 * median[name]:8.1f} {median[name] / base:6.3f} "
          f"{bytes_accessed[name] / bytes_accessed['unprobed']:11.3f} "
          f"{temp_bytes[name] / 1e6:8.1f}")
  print(f"\n{'probes on':>48s} {'elements':>9s} {'ms/step':>8s} {'ns/element':>10s}")
  for group in [*GROUPS, "all"]:
    cost = median["probed"] - median["unprobed" if group == "all" else f"probed, without {group}"]
    print(f"{group:>48s} {elements[group] / 1e6:8.1f}M {1e3 * cost:8.1f} "
          f"{1e9 * cost / elements[group]:10.2f}")
  (u_lower, u_compile), (p_lower, p_compile) = (compiled[n].values() for n in compiled)
  print(f"\ncompile: trace + lower {u_lower:.2f} s unprobed, {p_lower:.2f} s probed "
        f"({p_lower / u_lower:.2f}x); XLA {u_compile:.2f} s, {p_compile:.2f} s "
        f"({p_compile / u_compile:.2f}x); in all "
        f"{(p_lower + p_compile) / (u_lower + u_compile):.2f}x")


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--reps", type=int, default=30)
  parser.add_argument("--compile-reps", type=int, default=3)
  parser.add_argument("--batch", type=int, default=transformer.Config.batch)
  args = parser.parse_args(argv)
  config = transformer.Config(batch=args.batch)
  data = Text.load()
  batches = [data.windows(s, config.context + 1)
             for s in data.train_starts(0, 8, config.batch, config.context + 1)]
  split = lambda: transformer.init(config, data.vocab, transformer.FLOAT16,
                                   jls.MeasuredLossScale(), seed=0)
  graphdef, init = split()[0], lambda: split()[1]
  steps, states, bytes_accessed, temp_bytes = build(graphdef, init, batches[0])
  median = step_times(steps, states, batches, args.reps)
  model = nnx.merge(graphdef, init())[0]
  report(config, args.reps, median, bytes_accessed, temp_bytes,
         probed_elements(model, batches[0]),
         compile_times(graphdef, init(), batches[0], args.compile_reps))
  print(f"unprobed program identical with the probes placed but not measuring: "
        f"{unprobed_program_is_unchanged(model, batches[0])}")


if __name__ == "__main__":
  main()
