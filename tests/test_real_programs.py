"""Gradient-norm logs of two real training programs in float16, against their float32 runs.

The programs are ported in `real_programs.py`: flax's WMT example (a linen Transformer,
`pmap`, float16 with flax's `DynamicScale` or with `jls.loss_scaling(..., grad_norm=True)`)
and a slice of levanter's equinox trainer (a jmp policy, EMA of the parameters, a
gradient-norm hook given the step's gradients). Each trains 24 steps on synthetic tokens
from a fixed seed. The loader hands a skipped step's batch out again, so the k-th applied
step of every run sees batch k from parameters trained on the same k batches, and each
applied float16 step is compared with the float32 run's step k.

Tolerances. A float16 rounding is off by at most u = 2**-11 relative. A gradient element
passes through R of them on its path forward and back, so to first order it is within
R * u of float32's, and by the triangle inequality so is the global norm:
| |g16| - |g32| | <= |g16 - g32| <= R * u * |g32|. The estimate ignores the conditioning
of LayerNorm and softmax and the float16 runs drifting from the float32 one, which 24
steps keep small; the measured differences are 0.3% (WMT) and 5e-5 (levanter) at most,
on jax 0.10.2 and 0.12.

* WMT (one encoder and one decoder layer): about 30 roundings forward (the embeddings
  cast to float16, then per sub-block LayerNorm, projections, attention logits, softmax,
  weighted sum, output projection, residual; two attention sub-blocks and an MLP on the
  decoder's path; float16 logits and log-softmax) and as many back: R * u = 60 * 2**-11,
  about 2.9%: `WMT_RTOL` is 3%.
* levanter's slice: parameters cast to float16, LayerNorm, two dense layers, GELU,
  residual and unembedding forward, as many back: R * u = 16 * 2**-11, about 0.8%:
  `LEVANTER_RTOL` is 1%.

Two logs of the same gradients (the norm `loss_scaling` records and the norm of
`jls.unscale(grads, ...)`, or the scaled norm against the scale times the unscaled one)
are float32 reductions of the same numbers in another order (the scale is a power of 2,
so unscaling is exact): `SAME_RTOL`, 1e-5, for about 10**4 elements.
"""

import functools
from typing import Any
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest
import real_programs as rp
from flax import jax_utils
from flax.training import common_utils
from flax.training import dynamic_scale as dynamic_scale_lib

import jax_lossscale as jls
from jax_lossscale.flax import TrainState as LossScalingTrainState

STEPS = 24
VOCAB, LENGTH, BATCH = 64, 16, 8
WMT_RTOL = 0.03
LEVANTER_RTOL = 0.01
SAME_RTOL = 1e-5
# The example's DynamicScale() starts at 2**16 and grows after 2000 finite steps, so 24
# steps would never overflow. Started at 2**20 and growing after 5 finite steps, the scale
# overflows within the first steps and again when it grows, as a long run's does.
INITIAL_SCALE = 2.0**20
GROWTH_INTERVAL = 4
# levanter clips by global norm inside its optimizer (max_grad_norm=1.0 by default); here
# below the gradient norms (about 0.55 to 0.6), so that every step clips and a norm taken
# after clipping would show.
CLIP = 0.5


class Step(NamedTuple):
  """One step of a run, as its host loop saw it.

  Attributes:
    batch: which batch it was given: the number of steps applied before it.
    applied: whether the run reported the step as applied.
    unchanged: whether the watched state (parameters, EMA) is bit-identical after it.
    logs: the step's scalar logs.
  """

  batch: int
  applied: bool
  unchanged: bool
  logs: dict[str, float]


def bytes_of(tree: Any) -> list[bytes]:
  return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(jax.device_get(tree))]


def train(step_fn, state, batches, watched) -> list[Step]:
  """`STEPS` calls of `step_fn(state, batch) -> (state, logs)`; a skipped step's batch
  is handed out again. `logs["applied"]` is the step's report; `watched(state)` the state
  a skipped step must leave as it was."""
  steps = []
  batch = 0
  for _ in range(STEPS):
    before = bytes_of(watched(state))
    state, logs = step_fn(state, batches[batch])
    logs = {name: float(np.asarray(value).reshape(-1)[0]) for name, value in logs.items()}
    applied = bool(logs["applied"])
    steps.append(Step(batch, applied, bytes_of(watched(state)) == before, logs))
    batch += applied
  return steps


def applied_against_float32(run: list[Step], float32: list[Step], name: str,
                            reference: str = "grad_norm") -> list[tuple[int, float, float]]:
  """(step, logged, float32) for each applied step of `run`."""
  return [(i, step.logs[name], float32[step.batch].logs[reference])
          for i, step in enumerate(run) if step.applied]


def assert_relatively_close(rows, rtol, factor=None):
  """Each (step, logged, expected) within `rtol` of each other, `expected` times
  `factor(step)` if given."""
  for i, logged, expected in rows:
    expected = expected * (factor(i) if factor else 1.0)
    assert abs(logged / expected - 1) <= rtol, (
        f"step {i}: logged {logged!r}, expected {expected!r} (rtol {rtol})")


def assert_both_kinds_of_steps(run: list[Step]):
  """The run exercises what the tests check: skipped steps, and mostly applied ones."""
  skipped = sum(not step.applied for step in run)
  assert 1 <= skipped <= STEPS // 4, [step.applied for step in run]


# --- flax examples/wmt -----------------------------------------------------------------


def wmt_config(dtype) -> rp.TransformerConfig:
  """The example's model at a tiny size, dropout off (a skipped step would shift the
  dropout masks of the float16 runs against the float32 one)."""
  return rp.TransformerConfig(
      vocab_size=VOCAB, output_vocab_size=VOCAB, share_embeddings=True,
      logits_via_embedding=True, dtype=dtype, emb_dim=32, num_heads=4, num_layers=1,
      qkv_dim=32, mlp_dim=64, max_len=LENGTH, dropout_rate=0.0, attention_dropout_rate=0.0,
      deterministic=False)


def wmt_batches() -> list[dict[str, np.ndarray]]:
  """Token batches sharded over the local devices; the sequences end in padding (0),
  which the example's weights leave out of the loss."""
  n = jax.local_device_count()
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, VOCAB, (STEPS, 2, n * BATCH, LENGTH), dtype=np.int32)
  lengths = rng.integers(LENGTH // 2, LENGTH + 1, (STEPS, 2, n * BATCH, 1))
  tokens = np.where(np.arange(LENGTH) < lengths, tokens, 0)
  return [common_utils.shard({"inputs": inputs, "targets": targets})
          for inputs, targets in tokens]


def wmt_run(step_fn, state, dtype, learning_rate_fn, batches) -> list[Step]:
  p_train_step = jax.pmap(
      functools.partial(step_fn, config=wmt_config(dtype), learning_rate_fn=learning_rate_fn,
                        label_smoothing=0.1),
      axis_name="batch")
  # Replicated as a pmap returns it, so that the second step does not compile again.
  state = jax.pmap(lambda s: s, axis_name="batch")(jax_utils.replicate(state))
  return train(p_train_step, state, batches, lambda s: s.params)


@pytest.fixture(scope="module")
def wmt():
  """The example's three runs: float32, float16 with DynamicScale, float16 with
  `jls.loss_scaling` (flax's preset: DynamicScale's scale, step for step)."""
  learning_rate_fn = rp.create_learning_rate_schedule(learning_rate=0.002, warmup_steps=10)
  model = rp.Transformer(wmt_config(jnp.float32).replace(deterministic=True))
  params = jax.jit(model.init)(jax.random.key(0), jnp.ones((BATCH, LENGTH), jnp.float32),
                               jnp.ones((BATCH, LENGTH), jnp.float32))["params"]

  def adamw():
    return optax.adamw(learning_rate=learning_rate_fn, b1=0.9, b2=0.98, eps=1e-9,
                       weight_decay=0.0)

  batches = wmt_batches()
  runs = {}
  runs["float32"] = wmt_run(
      rp.train_step, rp.TrainState.create(apply_fn=model.apply, params=params, tx=adamw(),
                                          dynamic_scale=None),
      jnp.float32, learning_rate_fn, batches)
  dynamic_scale = dynamic_scale_lib.DynamicScale(growth_interval=GROWTH_INTERVAL,
                                                 scale=INITIAL_SCALE)
  runs["dynamic_scale"] = wmt_run(
      rp.train_step, rp.TrainState.create(apply_fn=model.apply, params=params, tx=adamw(),
                                          dynamic_scale=dynamic_scale),
      jnp.float16, learning_rate_fn, batches)
  loss_scale = jls.presets.flax(growth_interval=GROWTH_INTERVAL, scale=INITIAL_SCALE)
  runs["loss_scaling"] = wmt_run(
      rp.jls_train_step, LossScalingTrainState.create(
          apply_fn=model.apply, params=params,
          tx=jls.loss_scaling(adamw(), loss_scale, grad_norm=True)),
      jnp.float16, learning_rate_fn, batches)
  return runs


def test_wmt_runs_skip_some_steps_and_apply_the_rest(wmt):
  assert all(step.applied for step in wmt["float32"])
  assert_both_kinds_of_steps(wmt["dynamic_scale"])
  assert_both_kinds_of_steps(wmt["loss_scaling"])


def test_wmt_dynamic_scale_logs_the_float32_norm_on_applied_steps(wmt):
  rows = applied_against_float32(wmt["dynamic_scale"], wmt["float32"], "grad_norm")
  assert_relatively_close(rows, WMT_RTOL)


def test_wmt_loss_scaling_grad_norm_is_the_float32_norm_on_applied_steps(wmt):
  rows = applied_against_float32(wmt["loss_scaling"], wmt["float32"], "grad_norm")
  assert_relatively_close(rows, WMT_RTOL)


def test_wmt_norm_of_unscaled_gradients_is_the_recorded_grad_norm(wmt):
  rows = [(i, step.logs["unscaled_norm"], step.logs["grad_norm"])
          for i, step in enumerate(wmt["loss_scaling"]) if step.applied]
  assert_relatively_close(rows, SAME_RTOL)


def assert_off_by_the_loss_scale(run, float32_run, rtol):
  """The norm of a run's gradients as they come is, on every applied step, the float32
  run's norm times that step's loss scale (within `rtol`), and exactly the scale times the
  norm of the same gradients unscaled (within `SAME_RTOL`)."""
  def scale(i):
    return run[i].logs["step_scale"]

  assert_relatively_close(applied_against_float32(run, float32_run, "scaled_norm"),
                          rtol, scale)
  assert_relatively_close([(i, step.logs["scaled_norm"], step.logs["unscaled_norm"])
                           for i, step in enumerate(run) if step.applied], SAME_RTOL, scale)


def test_wmt_norm_of_the_gradients_as_they_come_is_off_by_the_loss_scale(wmt):
  assert_off_by_the_loss_scale(wmt["loss_scaling"], wmt["float32"], WMT_RTOL)
  assert min(step.logs["step_scale"] for step in wmt["loss_scaling"]) >= 2.0**16


def test_wmt_loss_scaling_skips_the_steps_dynamic_scale_skips(wmt):
  assert ([step.applied for step in wmt["loss_scaling"]]
          == [step.applied for step in wmt["dynamic_scale"]])


@pytest.mark.parametrize("run", ["dynamic_scale", "loss_scaling"])
def test_wmt_skipped_steps_leave_the_parameters_bit_identical(wmt, run):
  for i, step in enumerate(wmt[run]):
    assert step.applied or step.unchanged, f"step {i} was skipped but changed the parameters"
  assert not all(step.unchanged for step in wmt[run])


def test_wmt_loss_scaling_reports_skipped_steps(wmt):
  skipped = 0
  for i, step in enumerate(wmt["loss_scaling"]):
    skipped += not step.applied
    assert step.logs["skipped_steps"] == skipped, f"step {i}"
    assert step.applied == np.isfinite(step.logs["grad_norm"]), f"step {i}"


# --- levanter's trainer ----------------------------------------------------------------


def levanter_float32_step(state, tokens):
  _, state, hook = rp.levanter_train_step(state, tokens)
  return state, {"applied": True, "grad_norm": hook["grad/norm/total"]}


def levanter_float16_step(state, tokens):
  _, state, logs = rp.levanter_loss_scaled_train_step(state, tokens)
  metrics = logs["metrics"]
  return state, {"applied": metrics["last_applied"], "grad_norm": metrics["grad_norm"],
                 "skipped_steps": metrics["skipped_steps"],
                 "unscaled_norm": logs["unscaled"]["grad/norm/total"],
                 "scaled_norm": logs["naive"]["grad/norm/total"],
                 "step_scale": logs["step_scale"]}


@pytest.fixture(scope="module")
def levanter():
  """levanter's step in float32 (its default policy, no loss scaling) and in float16
  compute with float32 parameters and outputs, a `jls.loss_scaling` optimizer and
  `LossScalingTrainerState`."""
  batches = np.random.default_rng(1).integers(0, VOCAB, (STEPS, BATCH, LENGTH + 1),
                                              dtype=np.int32)
  # Built and initialized as one program each, not an eager operation per initializer.
  model = eqx.filter_jit(rp.TinyLm)(VOCAB, 32, key=jax.random.key(0))
  init = eqx.filter_jit(rp.TrainerState.init)
  init_loss_scaling = eqx.filter_jit(rp.LossScalingTrainerState.init)

  def watched(state):
    return state.model, state.model_averaging

  float32 = init(rp.adam_config_build(STEPS, max_grad_norm=CLIP), model,
                 mp=jmp.get_policy("f32"), ema_beta=0.9)
  loss_scale = jls.DynamicLossScale(initial_loss_scale=INITIAL_SCALE,
                                    increment_period=GROWTH_INTERVAL + 1)
  tx = jls.loss_scaling(rp.adam_config_build(STEPS, max_grad_norm=CLIP), loss_scale,
                        grad_norm=True)
  float16 = init_loss_scaling(
      tx, model, mp=jmp.get_policy("params=float32,compute=float16,output=float32"),
      ema_beta=0.9)
  return {"float32": train(levanter_float32_step, float32, batches, watched),
          "loss_scaling": train(levanter_float16_step, float16, batches, watched)}


def test_levanter_runs_clip_every_step_and_skip_some(levanter):
  assert all(step.applied for step in levanter["float32"])
  assert min(step.logs["grad_norm"] for step in levanter["float32"]) > CLIP
  assert_both_kinds_of_steps(levanter["loss_scaling"])


@pytest.mark.parametrize("name", ["grad_norm", "unscaled_norm"])
def test_levanter_hook_on_unscaled_gradients_logs_the_float32_norm(levanter, name):
  rows = applied_against_float32(levanter["loss_scaling"], levanter["float32"], name)
  assert_relatively_close(rows, LEVANTER_RTOL)


def test_levanter_hook_on_the_gradients_as_they_come_is_off_by_the_loss_scale(levanter):
  assert_off_by_the_loss_scale(levanter["loss_scaling"], levanter["float32"], LEVANTER_RTOL)


def test_levanter_skipped_steps_are_reported_and_leave_parameters_and_ema_bit_identical(
    levanter):
  skipped = 0
  for i, step in enumerate(levanter["loss_scaling"]):
    skipped += not step.applied
    assert step.logs["skipped_steps"] == skipped, f"step {i}"
    assert step.applied == np.isfinite(step.logs["grad_norm"]), f"step {i}"
    assert step.applied or step.unchanged, f"step {i} was skipped but changed the state"
  assert not all(step.unchanged for step in levanter["loss_scaling"])
