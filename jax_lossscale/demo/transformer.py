"""The transformer demo: which layers lose gradient signal to float16, and the scale that fits.

`python -m jax_lossscale.demo --model transformer`: a small flax NNX transformer language
model (ALiBi, pre-layer-norm blocks run by `nnx.scan`), float32 master weights, trained on
Python's bundled documentation in float32, in float16 without loss scaling, with
`DynamicLossScale(increment_period=10)` (it grows, overflows, skips, as in the MLP demo)
and `MeasuredLossScale(margin=1)` (set from probes at every module); and once more with
`MeasuredLossScale(margin=1)`, the model built with no dtype arguments (float32) and its loss
run by `jls.autocast` (matmuls in float16); then that float32 model under
`jls.autocast(..., jnp.bfloat16)` and under `fp8="tensorwise"` and `fp8="rowwise"` (its
matmuls in float8, scaled per tensor or per row, the rest in bfloat16), without loss
scaling. Prints the hand-cast measured run's per-layer table and the losses over seeds,
plots each layer's headroom (`demo` extra).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jax_lossscale as jls
from jax_lossscale import demo
from jax_lossscale.demo.text import Text

FLOAT32 = jls.get_policy("p=f32,c=f32,o=f32")
FLOAT16 = jls.get_policy("p=f32,c=f16,o=f32")


@dataclasses.dataclass(frozen=True)
class Autocast:
  """A model built with flax's defaults (float32, no dtype arguments), its loss run by
  `jls.autocast(loss_fn, compute_dtype, fp8=fp8)`: matmuls in `compute_dtype`, or in
  float8 with a recipe; in place of a `jls.Policy`."""

  compute_dtype: np.dtype = np.dtype(jnp.float16)
  fp8: str | None = None


AUTOCAST = Autocast()
BFLOAT16 = Autocast(np.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and training sizes. `batch` sequences of `context` tokens make one step's mean
  loss, so each token's share of the logits' gradient is below float16's smallest normal."""

  steps: int = 100
  batch: int = 384
  context: int = 64
  width: int = 64
  heads: int = 4
  layers: int = 2
  learning_rate: float = 1.5e-2
  b2: float = 0.95
  seeds: tuple[int, ...] = (0,)


def alibi(heads: int, length: int) -> jax.Array:
  """Causal ALiBi biases, float32 `[heads, length, length]`: -slope * distance, -inf ahead."""
  slopes = 2.0 ** (-8.0 * jnp.arange(1, heads + 1) / heads)
  distance = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
  return jnp.where(distance >= 0, -slopes[:, None, None] * distance, -jnp.inf)


def _constructors(policy: jls.Policy | Autocast, rngs: nnx.Rngs):
  """`nnx.Linear`, `nnx.LayerNorm` and `nnx.Embed`, in `policy`'s dtypes (flax's defaults
  for `Autocast`)."""
  dtypes = ({"rngs": rngs} if isinstance(policy, Autocast) else
            {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype, "rngs": rngs})
  return (functools.partial(module, **dtypes) for module in (nnx.Linear, nnx.LayerNorm, nnx.Embed))


class Attention(nnx.Module):
  """Causal multi-head self-attention; the softmax in float32."""

  def __init__(self, config: Config, dense):
    self.heads = config.heads
    self.qkv = dense(config.width, 3 * config.width, use_bias=False)
    self.out = dense(config.width, config.width)

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, width = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(b, t, 3 * self.heads, -1), 3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(width // self.heads)
    weights = jax.nn.softmax(scores.astype(jnp.float32) + alibi(self.heads, t)).astype(x.dtype)
    return self.out(jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, width))


class Block(nnx.Module):
  """A pre-layer-norm transformer block: attention, then a GELU MLP, each residual."""

  def __init__(self, config: Config, policy: jls.Policy | Autocast, rngs: nnx.Rngs):
    dense, norm, _ = _constructors(policy, rngs)
    self.norm_1, self.norm_2 = norm(config.width), norm(config.width)
    self.attention = Attention(config, dense)
    self.up = dense(config.width, 4 * config.width)
    self.down = dense(4 * config.width, config.width)

  def __call__(self, x: jax.Array) -> jax.Array:
    x = x + self.attention(self.norm_1(x))
    return x + self.down(nnx.gelu(self.up(self.norm_2(x))))


class TransformerLM(nnx.Module):
  """Token embedding, `layers` stacked blocks, a final norm and the vocabulary head."""

  def __init__(self, config: Config, vocab: int, policy: jls.Policy | Autocast,
               rngs: nnx.Rngs):
    self.policy = policy
    dense, norm, embed = _constructors(policy, rngs)
    self.embed = embed(vocab, config.width)

    @nnx.split_rngs(splits=config.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return Block(config, policy, rngs)

    self.blocks = blocks(rngs)
    self.norm = norm(config.width)
    self.head = dense(config.width, vocab)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return block(h)

    logits = self.head(self.norm(run(self.embed(tokens), self.blocks)))
    return logits if isinstance(self.policy, Autocast) else self.policy.cast_to_output(logits)


def loss_fn(model: TransformerLM, tokens: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy (nats) over every position, reduced in float32."""
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def init(config: Config, vocab: int, policy: jls.Policy | Autocast, loss_scale: jls.LossScale,
         seed: int) -> tuple[nnx.GraphDef, nnx.State]:
  """`nnx.split((model, optimizer))`: Adam (clipped at norm 1) inside `loss_scaling`."""
  model = TransformerLM(config, vocab, policy, nnx.Rngs(seed))
  tx = jls.loss_scaling(optax.adam(config.learning_rate, b2=config.b2), loss_scale,
                        clip_by_global_norm=1.0)
  return nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))


def make_step(graphdef: nnx.GraphDef, probes: bool, compute_dtype=None, fp8=None):
  """The jitted step `(state, tokens) -> (state, logs)`, donating the state. `logs`: the
  loss, the scale used, the largest parameter gradient (unscaled), `jls.metrics` after the
  update and, with `probes`, the backward pass's measurements (the loss scale gets them).
  With `compute_dtype`, the loss runs under `jls.autocast(loss_fn, compute_dtype, fp8=fp8)`,
  and with `fp8` the step compiles with `jls.fp8_compiler_options()`."""
  loss = loss_fn if compute_dtype is None else jls.autocast(loss_fn, compute_dtype, fp8=fp8)
  grad_fn = jls.scaled_value_and_grad(loss, value_and_grad=nnx.value_and_grad, probes=probes)

  def step(state, tokens):
    model, optimizer = nnx.merge(graphdef, state)
    scale = jls.metrics(optimizer)["loss_scale"]
    loss, grads, *measured = grad_fn(optimizer.opt_state, model, tokens)
    optimizer.update(model, grads, loss=loss, probes=measured[0] if measured else None)
    largest = jnp.max(jnp.stack([jnp.max(jnp.abs(g)) for g in jax.tree.leaves(grads)]))
    logs = {"loss": loss, "scale": scale, "param_max": largest / scale,
            **jls.metrics(optimizer), **({"probes": measured[0]} if measured else {})}
    return nnx.state((model, optimizer)), logs

  options = jls.fp8_compiler_options() if fp8 is not None else None
  return jax.jit(step, donate_argnums=0, compiler_options=options)


@dataclasses.dataclass
class RunResult:
  """What one training run produced; `logs` holds one array per logged value, by step."""

  name: str
  seed: int
  params: nnx.State
  logs: dict
  eval_loss: float = float("nan")
  underflow: float = float("nan")
  subnormal: float = float("nan")

  @property
  def skipped(self) -> int:
    return int((~self.logs["last_applied"]).sum())

  @property
  def final_scale(self) -> float:
    return float(self.logs["loss_scale"][-1])


def train(name: str, data: Text, config: Config, policy: jls.Policy | Autocast,
          loss_scale: jls.LossScale, seed: int, progress: bool = True) -> RunResult:
  """Trains from the seed's initial weights and data order, shared by every run."""
  graphdef, state = init(config, data.vocab, policy, loss_scale, seed)
  autocast = isinstance(policy, Autocast)
  step = make_step(graphdef, probes=isinstance(loss_scale, jls.MeasuredLossScale),
                   compute_dtype=policy.compute_dtype if autocast else None,
                   fp8=policy.fp8 if autocast else None)
  starts = data.train_starts(seed, config.steps, config.batch, config.context + 1)
  steps = range(config.steps)
  if progress:
    from tqdm.auto import tqdm
    steps = tqdm(steps, desc=f"{name:>48s} (seed {seed})", unit="step", leave=True)
  history = []
  for i in steps:
    state, logs = step(state, data.windows(starts[i], config.context + 1))
    history.append(logs)  # stays on device: no host round-trip per step
  model, _ = nnx.merge(graphdef, state)
  logs = jax.tree.map(lambda *xs: np.stack(xs), *jax.device_get(history))
  return RunResult(name, seed, nnx.state(model, nnx.Param), logs)


def with_params(params: nnx.State, config: Config, vocab: int, policy: jls.Policy) -> TransformerLM:
  """A model computing in `policy`'s dtypes, holding `params`."""
  model = TransformerLM(config, vocab, policy, nnx.Rngs(0))
  nnx.update(model, params)
  return model


def held_out(data: Text, config: Config, seed: int) -> jax.Array:
  """A training batch's worth of held-out sequences (so gradients have its magnitudes)."""
  return data.windows(data.eval_starts(seed, config.batch, config.context + 1),
                      config.context + 1)


@nnx.jit(static_argnums=2)
def _eval_metrics(model: TransformerLM, tokens: jax.Array, dtype, scale: jax.Array) -> tuple:
  logits = model(tokens[:, :-1])
  loss = lambda z: optax.softmax_cross_entropy_with_integer_labels(z, tokens[:, 1:]).mean()
  stats = jls.diagnostics.gradient_stats(jax.grad(loss)(logits), dtype, scale)
  return loss(logits), stats["underflow_fraction"], stats["subnormal_fraction"]


def evaluate(run: RunResult, data: Text, config: Config,
             policy: jls.Policy | Autocast) -> RunResult:
  """Held-out loss (float32 compute), and the fractions of d(mean loss)/d(logits) =
  (softmax - onehot) / tokens, where the backward pass enters the float16 model, that
  underflow to zero and that are subnormal at the run's final scale (`gradient_stats`)."""
  model = with_params(run.params, config, data.vocab, FLOAT32)
  run.eval_loss, run.underflow, run.subnormal = map(float, _eval_metrics(
      model, held_out(data, config, run.seed), policy.compute_dtype, jnp.float32(run.final_scale)))
  return run


_probed_grads = nnx.jit(jls.scaled_value_and_grad(loss_fn, value_and_grad=nnx.value_and_grad,
                                                   probes=True))


def layer_rows(model: TransformerLM, tokens: jax.Array, scale: float) -> list[tuple]:
  """One backward pass at `scale` (state, not configuration: compiled once for every scale):
  `(layer, max |grad|, headroom, subnormal fraction, zero fraction)` of each activation
  gradient (stacked blocks by row, in forward order), then of the parameter gradients."""
  tx = jls.loss_scaling(optax.identity(), jls.DynamicLossScale(current_loss_scale=scale))
  _, grads, probes = _probed_grads(tx.init(nnx.state(model, nnx.Param)), model, tokens)
  rows = [(name, float(s.backward.max_abs), float(s.headroom),
           float(s.backward.subnormal_fraction), float(s.backward.zero_fraction))
          for name, s in jls.diagnostics.layers(probes)]
  g = np.concatenate([np.abs(np.ravel(x)) for x in jax.tree.leaves(jax.device_get(grads))])
  return rows + [("parameter gradients", float(g.max()),
                  float(np.floor(np.log2(65504) - np.log2(g.max()))),
                  float(np.mean((g > 0) & (g < 2**-14))), float(np.mean(g == 0)))]


def plan() -> list[tuple[str, jls.Policy | Autocast, jls.LossScale]]:
  """The eight runs of each seed: name, precision (policy, or autocast), loss scale. The
  bfloat16 and float8 runs need no loss scale (bfloat16 has float32's range; each float8
  matmul scales its operands itself)."""
  return [("float32", FLOAT32, jls.NoOpLossScale()),
          ("float16, no loss scaling", FLOAT16, jls.NoOpLossScale()),
          ("float16, DynamicLossScale(increment_period=10)", FLOAT16,
           jls.DynamicLossScale(increment_period=10)),
          # margin=1: with none, a gradient above the last 16 steps' skips (1-2 in 100 here).
          ("float16, MeasuredLossScale(margin=1)", FLOAT16, jls.MeasuredLossScale(margin=1)),
          ("float16, autocast + MeasuredLossScale(margin=1)", AUTOCAST,
           jls.MeasuredLossScale(margin=1)),
          ("bfloat16, autocast", BFLOAT16, jls.NoOpLossScale()),
          ("float8 tensorwise, autocast (bfloat16)",
           dataclasses.replace(BFLOAT16, fp8="tensorwise"), jls.NoOpLossScale()),
          ("float8 rowwise, autocast (bfloat16)", dataclasses.replace(BFLOAT16, fp8="rowwise"),
           jls.NoOpLossScale())]


def run_all(config: Config, progress: bool = True) -> list[list[RunResult]]:
  """Every seed's runs (`plan()`), evaluated: `runs[seed][run]`."""
  data = Text.load()
  return [[evaluate(train(name, data, config, policy, ls, seed, progress), data, config, policy)
           for name, policy, ls in plan()] for seed in config.seeds]


def _spread(values: Sequence[float], fmt: str) -> str:
  """`mean`, or `mean ± half the range` over seeds."""
  mean = format(np.mean(values), fmt)
  half = format(np.ptp(values) / 2, fmt.lstrip("+"))
  return mean if len(values) == 1 else f"{mean} ± {half}"


def _power_of_two(x: float) -> str:
  """`2**k` for a power of two above 1, else `x` as `:g` formats it."""
  return f"2**{np.log2(x):.0f}" if x > 1 and np.log2(x) % 1 == 0 else f"{x:g}"


def format_layers(at_one: Sequence[tuple], at_scale: Sequence[tuple], scale: float) -> str:
  """`layer_rows` at scale 1 and at `scale`, side by side."""
  side = f"{'headroom':>8s} {'subnormal':>9s} {'zero':>6s}"
  header = f"{'layer':<28s} {'max |grad|':>10s}   {side}   {side}"
  lines = [f"{'':<28s} {'at scale 1':>10s}   {'at scale 1':^25s}   "
           f"{f'at scale 2**{np.log2(scale):.0f}':^25s}", header, "-" * len(header)]
  for one, scaled in zip(at_one, at_scale, strict=True):
    cells = [f"{h:8.0f} {100 * sub:8.1f}% {100 * z:5.1f}%" for *_, h, sub, z in (one, scaled)]
    lines.append(f"{one[0][:28]:<28s} {one[1]:10.3g}   {cells[0]}   {cells[1]}")
  return "\n".join(lines)


def format_runs(runs: Sequence[Sequence[RunResult]]) -> str:
  """Per run, over the seeds: held-out loss and its gap to float32 (mean ± half the
  range), skipped steps and final scale (per seed), the logits' gradient underflowing and
  subnormal (mean); then the held-out loss of MeasuredLossScale against DynamicLossScale,
  of the autocast model against the hand-cast one (both with MeasuredLossScale), and of
  each float8 recipe against bfloat16 (all three autocast)."""
  columns = list(zip(*runs, strict=True))
  reference = np.array([r.eval_loss for r in columns[0]])
  header = (f"{'run':<48s} {'held-out loss':>15s} {'vs float32':>15s} {'skipped':>7s} "
            f"{'final scale':>13s} {'logit grads underflow / subnormal':>33s}")
  lines = [header, "-" * len(header)]
  for seeds in columns:
    loss = np.array([r.eval_loss for r in seeds])
    lines.append(f"{seeds[0].name:<48s} {_spread(loss, '.4f'):>15s} "
                 f"{_spread(100 * (loss / reference - 1), '+.2f') + '%':>15s} "
                 f"{'/'.join(str(r.skipped) for r in seeds):>7s} "
                 f"{'/'.join(_power_of_two(r.final_scale) for r in seeds):>13s} "
                 f"{100 * np.mean([r.underflow for r in seeds]):22.2f}% / "
                 f"{100 * np.mean([r.subnormal for r in seeds]):5.1f}%")
  gaps = {"MeasuredLossScale vs DynamicLossScale": (columns[2], columns[3]),
          "autocast vs hand-cast float16 (MeasuredLossScale)": (columns[3], columns[4]),
          "float8 tensorwise vs bfloat16": (columns[5], columns[6]),
          "float8 rowwise vs bfloat16": (columns[5], columns[7])}
  lines.append("")
  for name, (base, other) in gaps.items():
    gap = [100 * (o.eval_loss / b.eval_loss - 1) for b, o in zip(base, other, strict=True)]
    lines.append(f"{name}, held-out loss: {_spread(gap, '+.2f')}%")
  return "\n".join(lines)


def plot(runs: Sequence[RunResult], path: str) -> None:
  """The training loss of every run; and each layer's headroom at scale 1 over training
  (from the hand-cast probed run's probes) and the parameter gradients', with log2 of every
  run's loss scale above 1 (a scale above a layer's line overflows there). The runs'
  legend sits below both panels, the layers' beside the second."""
  import matplotlib

  fig, (ax_loss, ax_room) = demo.figure(ncols=2, figsize=(13, 5.5), width_ratios=(1, 1.4))
  for r in runs:
    ax_loss.plot(r.logs["loss"], label=r.name, lw=1.2, **demo.run_style(r.name))
  ax_loss.set(xlabel="step", ylabel="training loss (nats)", title="Loss curves")
  probed = [r for r in runs if "probes" in r.logs][0]
  layers = jls.diagnostics.layers(probed.logs["probes"])
  # Layers in shades of grey, darker deeper in the model: no run's colour.
  shades = matplotlib.colormaps["Greys"](np.linspace(0.3, 0.9, len(layers)))
  for (name, s), shade in zip(layers, shades, strict=True):
    ax_room.plot(np.asarray(s.headroom) + np.log2(probed.logs["scale"]), lw=0.8, color=shade,
                 label=name)
  ax_room.plot(np.floor(np.log2(65504) - np.log2(probed.logs["param_max"])), lw=2.5,
               color="tab:purple", label="parameter gradients")
  for r in runs:
    if np.any(r.logs["scale"] != 1):
      ax_room.plot(np.log2(r.logs["scale"]), lw=2.5, drawstyle="steps-post",
                   **demo.run_style(r.name))
  ax_room.set(xlabel="step", ylabel="doublings",
              title=f"Each layer's headroom at scale 1 ({probed.name}),\n"
                    "and log2 of each run's loss scale, in the run's colour")
  ax_room.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5), frameon=False)
  fig.legend(*ax_loss.get_legend_handles_labels(), loc="outside lower center", ncols=2,
             frameon=False)
  demo.save(fig, path)


def main(argv: Sequence[str] | None = None) -> None:
  d = Config()
  parser = demo.argument_parser("transformer", __doc__)
  for flag in ("steps", "batch", "context", "width", "layers"):
    parser.add_argument(f"--{flag}", type=int, default=getattr(d, flag))
  parser.add_argument("--learning-rate", type=float, default=d.learning_rate)
  parser.add_argument("--seeds", type=int, nargs="+", default=list(d.seeds),
                      help="one set of runs per seed; losses are reported over seeds")
  parser.add_argument("--out", default="transformer_demo.png", help="where to write the plot")
  a = parser.parse_args(argv)
  demo.check_options(parser, a, "transformer",
                     at_least_one=("steps", "batch", "context", "width", "layers"),
                     at_least_zero=("seeds",), positive=("learning-rate",))
  if a.width % d.heads:
    parser.error(f"--width must be a multiple of the number of attention heads, {d.heads}; "
                 f"got {a.width}")
  config = Config(a.steps, a.batch, a.context, a.width, layers=a.layers,
                  learning_rate=a.learning_rate, seeds=tuple(a.seeds))
  start = time.perf_counter()
  data = Text.load()
  runs = run_all(config)
  run = runs[0][3]  # float16, MeasuredLossScale(margin=1): the hand-cast model
  model = with_params(run.params, config, data.vocab, FLOAT16)
  scale = run.final_scale
  tokens = held_out(data, config, run.seed)
  print(f"\nPer layer, the trained model of {run.name} (seed {run.seed}), one float16 "
        f"backward pass on {config.batch}x{config.context} held-out tokens:\n")
  print(format_layers(layer_rows(model, tokens, 1.0), layer_rows(model, tokens, scale), scale))
  print(f"\nHeld-out loss, seeds {'/'.join(map(str, config.seeds))} ({config.steps} steps "
        f"of {config.batch}x{config.context} tokens):\n")
  print(format_runs(runs))
  plot(runs[0], a.out)
  print(f"\nPlot written to {a.out} ({time.perf_counter() - start:.0f} s in all, "
        f"on {jax.devices()[0].platform.upper()}).")
