"""The MLP demo: why loss scaling exists, shown on real data (`python -m jax_lossscale.demo`).

A character-level MLP language model learns the documentation text that ships with
Python (`pydoc_data.topics`, about 465k characters) with a large batch, where each
example's share of the mean loss is tiny. Five runs with the same seed and data order:

1. float32 (the reference),
2. float16 compute without loss scaling: small gradients underflow to zero,
3. float16 with a `FixedLossScale` picked by `recommend_loss_scale`,
4. float16 with a `DynamicLossScale`,
5. float16 with a `MeasuredLossScale`, set from probes at every layer.

It prints a table (final held-out loss and accuracy, skipped steps, final scale,
fraction of gradient values lost to float16 underflow) and writes a PNG plot.
Needs the `demo` extra (matplotlib, tqdm): `pip install "jax_lossscale[demo]"`.
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

import jax_lossscale as jls
from jax_lossscale import demo
from jax_lossscale.demo.text import Text

CONTEXT, EMBED = 16, 16


@dataclasses.dataclass(frozen=True)
class Config:
  """Model and training sizes; the defaults finish in under 2 minutes on 2 CPU cores."""

  steps: int = 150
  batch: int = 32768
  hidden: int = 128
  learning_rate: float = 1e-2
  seed: int = 0
  eval_size: int = 8192  # held-out windows for the loss and accuracy


def windows(data: Text, starts: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """`(contexts, next characters)` for the windows starting at `starts`."""
  w = data.windows(starts, CONTEXT + 1)
  return w[..., :CONTEXT], w[..., CONTEXT]


def init_params(key: jax.Array, vocab: int, hidden: int) -> dict:
  """float32 master weights of a 2-hidden-layer GELU MLP over embedded characters."""
  k = jax.random.split(key, 4)
  fan_in = CONTEXT * EMBED
  return {
      "embed": jax.random.normal(k[0], (vocab, EMBED)) * 0.1,
      "hidden_1": {"kernel": jax.random.normal(k[1], (fan_in, hidden)) / np.sqrt(fan_in),
                   "bias": jnp.zeros(hidden)},
      "hidden_2": {"kernel": jax.random.normal(k[2], (hidden, hidden)) / np.sqrt(hidden),
                   "bias": jnp.zeros(hidden)},
      "output": {"kernel": jax.random.normal(k[3], (hidden, vocab)) / np.sqrt(hidden),
                 "bias": jnp.zeros(vocab)},
  }


def logits_fn(params: dict, x: jax.Array, dtype) -> jax.Array:
  """The forward pass computed in `dtype`; logits returned in float32."""
  p = jax.tree.map(lambda a: a.astype(dtype), params)
  probe = jls.diagnostics.probe  # measures only under scaled_value_and_grad(probes=True)
  h = probe(p["embed"][x].reshape(x.shape[0], -1), "embed")
  for layer in ("hidden_1", "hidden_2"):
    h = probe(jax.nn.gelu(h @ p[layer]["kernel"] + p[layer]["bias"]), layer)
  logits = probe(h @ p["output"]["kernel"] + p["output"]["bias"], "output")
  return logits.astype(jnp.float32)


def loss_fn(params: dict, x: jax.Array, y: jax.Array, dtype=jnp.float32) -> jax.Array:
  """Mean next-character cross-entropy (nats), reduced in float32."""
  return optax.softmax_cross_entropy_with_integer_labels(logits_fn(params, x, dtype), y).mean()


@dataclasses.dataclass
class RunResult:
  """What one training run produced: by step, the training loss, the loss scale the step ran
  with (before its update changed it) and whether it applied its update; then the scale
  after the last step, and the evaluation's figures."""

  name: str
  params: dict
  losses: np.ndarray
  scales: np.ndarray
  applied: np.ndarray
  final_scale: float = float("nan")
  eval_loss: float = float("nan")
  accuracy: float = float("nan")
  underflow: float = float("nan")


def train(name: str, data: Text, config: Config, dtype, loss_scale: jls.LossScale,
          progress: bool = True) -> RunResult:
  """Trains from the same initial weights and data order as every other run."""
  tx = jls.loss_scaling(optax.adam(config.learning_rate), loss_scale)
  params = init_params(jax.random.key(config.seed), data.vocab, config.hidden)
  opt_state = tx.init(params)
  # A MeasuredLossScale sets the scale from the probes' measurements.
  measured = isinstance(loss_scale, jls.MeasuredLossScale)
  grad_fn = jls.scaled_value_and_grad(loss_fn, probes=measured)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, x, y):
    scale = jls.metrics(opt_state)["loss_scale"]  # the scale this step runs with
    loss, grads, *probes = grad_fn(opt_state, params, x, y, dtype)
    params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss,
                                           probes=probes[0] if probes else None)
    return params, opt_state, (loss, scale, jls.metrics(opt_state))

  starts = data.train_starts(config.seed, config.steps, config.batch, CONTEXT + 1)
  steps = range(config.steps)
  if progress:
    from tqdm.auto import tqdm

    steps = tqdm(steps, desc=f"{name:>47s}", unit="step", leave=True)
  history = []
  for i in steps:
    params, opt_state, out = step(params, opt_state, *windows(data, starts[i]))
    history.append(out)  # stays on device: no host round-trip per step
  history = jax.device_get(history)
  return RunResult(
      name, params,
      losses=np.array([loss for loss, _, _ in history]),
      scales=np.array([scale for _, scale, _ in history]),
      applied=np.array([m["last_applied"] for _, _, m in history]),
      final_scale=float(history[-1][2]["loss_scale"]),
  )


def held_out(data: Text, config: Config, size: int) -> tuple[jax.Array, jax.Array]:
  """`size` held-out windows, `(contexts, next characters)`: `config.eval_size` of them for
  the loss and accuracy, `config.batch` (a training batch's worth, so that gradients have a
  training step's magnitudes) for the gradients."""
  return windows(data, data.eval_starts(config.seed, size, CONTEXT + 1))


@jax.jit
def _eval_metrics(params: dict, x: jax.Array, y: jax.Array) -> dict:
  logits = logits_fn(params, x, jnp.float32)
  return {"loss": optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
          "accuracy": jnp.mean(jnp.argmax(logits, -1) == y)}


@functools.partial(jax.jit, static_argnums=3)
def logit_underflow(params: dict, x: jax.Array, y: jax.Array, dtype,
                    scale: jax.Array) -> jax.Array:
  """The fraction of d(mean loss over `x`'s windows)/d(logits) = (softmax - onehot) /
  len(x), times `scale`, that underflows to zero in `dtype` (`gradient_stats` on the
  float32 values, the logits computed in float32)."""
  logits = logits_fn(params, x, jnp.float32)
  cotangent = jax.grad(
      lambda z: optax.softmax_cross_entropy_with_integer_labels(z, y).mean())(logits)
  return jls.diagnostics.gradient_stats(cotangent, dtype, scale)["underflow_fraction"]


def evaluate(run: RunResult, data: Text, config: Config, dtype) -> RunResult:
  """Held-out loss and accuracy, and the gradient signal lost to underflow.

  The loss and accuracy are over `config.eval_size` held-out windows. The backward pass
  enters the low-precision model at the logits with d(mean loss)/d(logits) =
  (softmax - onehot) / batch, times the loss scale; this is where a large batch pushes
  values below float16's smallest subnormal. Measured exactly with `gradient_stats` on
  the float32 values of `config.batch` held-out windows (a training batch, so that the
  values have a training step's magnitudes), at the run's final scale.
  """
  metrics = jax.device_get(_eval_metrics(run.params, *held_out(data, config, config.eval_size)))
  run.eval_loss = float(metrics["loss"])
  run.accuracy = float(metrics["accuracy"])
  run.underflow = float(logit_underflow(run.params, *held_out(data, config, config.batch),
                                        jnp.dtype(dtype), jnp.float32(run.final_scale)))
  return run


def fixed_scale_for(data: Text, config: Config) -> float:
  """The `recommend_loss_scale` advice for the float32 gradients at initialisation."""
  params = init_params(jax.random.key(config.seed), data.vocab, config.hidden)
  x, y = windows(data, data.train_starts(config.seed, config.steps, config.batch, CONTEXT + 1)[0])
  advice = jls.diagnostics.recommend_loss_scale(jax.jit(jax.grad(loss_fn))(params, x, y))
  return advice.recommended


def run_all(config: Config, progress: bool = True) -> list[RunResult]:
  """The five runs of the demo, evaluated."""
  data = Text.load()
  fixed = fixed_scale_for(data, config)
  plan = [
      ("float32", jnp.float32, jls.NoOpLossScale()),
      ("float16, no loss scaling", jnp.float16, jls.NoOpLossScale()),
      (f"float16, FixedLossScale({fixed:g})", jnp.float16, jls.FixedLossScale(fixed)),
      # A short growth period, so that the plot shows the scale growing, overflowing,
      # skipping a step and backing off within the demo's 150 steps.
      ("float16, DynamicLossScale(increment_period=10)", jnp.float16,
       jls.DynamicLossScale(increment_period=10)),
      # Margin 0: this model's gradient maxima move smoothly from step to step; the
      # default margin is for noisy ones (docs/backward-pass.md, "What the margin costs").
      ("float16, MeasuredLossScale(margin=0)", jnp.float16, jls.MeasuredLossScale(margin=0)),
  ]
  return [evaluate(train(name, data, config, dtype, ls, progress), data, config, dtype)
          for name, dtype, ls in plan]


def format_table(runs: Sequence[RunResult]) -> str:
  reference = runs[0].eval_loss
  header = (f"{'run':<47s} {'eval loss':>9s} {'vs fp32':>8s} {'accuracy':>8s} "
            f"{'skipped':>7s} {'final scale':>11s} {'logit grads lost to underflow':>29s}")
  lines = [header, "-" * len(header)]
  for r in runs:
    lines.append(
        f"{r.name:<47s} {r.eval_loss:9.4f} {100 * (r.eval_loss / reference - 1):+7.2f}% "
        f"{100 * r.accuracy:7.2f}% {int((~r.applied).sum()):7d} {r.final_scale:11g} "
        f"{100 * r.underflow:28.2f}%"
    )
  return "\n".join(lines)


def plot(runs: Sequence[RunResult], path: str) -> None:
  """The training loss of every run, and the loss scale each step of the scaled runs ran
  with, a skipped step marked at the scale that overflowed; one legend for both panels,
  below them."""
  fig, (ax_loss, ax_scale) = demo.figure(ncols=2, figsize=(12, 4.8))
  for r in runs:
    ax_loss.plot(r.losses, label=r.name, lw=1.2, **demo.run_style(r.name))
  ax_loss.set(xlabel="step", ylabel="training loss (nats)", title="Loss curves")
  for r in runs[2:]:
    style = demo.run_style(r.name)
    ax_scale.plot(r.scales, lw=1.5, drawstyle="steps-post", **style)
    skipped = np.flatnonzero(~r.applied)
    ax_scale.scatter(skipped, r.scales[skipped], marker="x", s=40, color=style["color"],
                     zorder=3)
  ax_scale.scatter([], [], marker="x", color="gray", label="skipped step")
  ax_scale.set(xlabel="step", ylabel="loss scale", title="Loss scale")
  ax_scale.set_yscale("log", base=2)
  runs_handles, runs_labels = ax_loss.get_legend_handles_labels()
  skip_handles, skip_labels = ax_scale.get_legend_handles_labels()
  fig.legend(runs_handles + skip_handles, runs_labels + skip_labels, loc="outside lower center",
             ncols=3, frameon=False)
  demo.save(fig, path)


def main(argv: Sequence[str] | None = None) -> None:
  defaults = Config()
  parser = demo.argument_parser("mlp", __doc__)
  parser.add_argument("--steps", type=int, default=defaults.steps)
  parser.add_argument("--batch", type=int, default=defaults.batch,
                      help="examples per step; large batches make per-example gradients tiny")
  parser.add_argument("--hidden", type=int, default=defaults.hidden, help="hidden layer width")
  parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
  parser.add_argument("--seed", type=int, default=defaults.seed)
  parser.add_argument("--out", default="loss_scaling_demo.png", help="where to write the plot")
  args = parser.parse_args(argv)
  demo.check_options(parser, args, "mlp", at_least_one=("steps", "batch", "hidden"),
                     at_least_zero=("seed",), positive=("learning-rate",))
  config = Config(args.steps, args.batch, args.hidden, args.learning_rate, args.seed)

  start = time.perf_counter()
  runs = run_all(config)
  print()
  print(format_table(runs))
  plot(runs, args.out)
  print(f"\nPlot written to {args.out} ({time.perf_counter() - start:.0f} s in all, "
        f"on {jax.devices()[0].platform.upper()}).")

