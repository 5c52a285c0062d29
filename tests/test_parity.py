"""Parity: each preset replays other systems' scalers step by step.

Every reference model in `reference_models.py` is transcribed from that system's
own update rule. Long random sequences (overflow storms that drive the scale to its
floor, clean runs long enough to grow it several times, and noise at several
overflow rates) are replayed through both; scale, skip decision and counters must
agree at every step.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_models as ref

from jax_lossscale import presets
from jax_lossscale import tensorflow as jls_tf


def finite_sequence(seed, period):
  """Overflow storms, long clean runs and noisy stretches, about 12 periods long."""
  rng = np.random.default_rng(seed)
  parts = []
  while sum(len(p) for p in parts) < 12 * period + 200:
    kind = rng.integers(4)
    if kind == 0:  # storm: enough overflows in a row to reach any floor
      parts.append(np.zeros(rng.integers(5, 70), bool))
    elif kind == 1:  # clean run: one to three growths
      parts.append(np.ones(rng.integers(period, 3 * period + 2), bool))
    else:  # noise at a random overflow rate
      rate = rng.choice([0.001, 0.05, 0.5])
      parts.append(rng.random(rng.integers(10, 2 * period + 10)) > rate)
  return np.concatenate(parts)


@jax.jit
def replay(loss_scale, finite):
  def step(ls, f):
    ls, should_apply = ls.update({"g": jnp.where(f, 1.0, jnp.inf)})
    counters = [getattr(ls, n) for n in ls._state_names[1:]]
    return ls, (ls(), should_apply, *counters)
  return jax.lax.scan(step, loss_scale, finite)[1]


CASES = {
    "tensorflow": (presets.tensorflow, ref.TensorFlowDynamic, {}),
    "tensorflow_small": (presets.tensorflow, ref.TensorFlowDynamic,
                         dict(initial_loss_scale=8.0, increment_period=3, multiplier=3.0)),
    "pytorch": (presets.pytorch, ref.PyTorch, {}),
    "pytorch_small": (presets.pytorch, ref.PyTorch,
                      dict(init_scale=4.0, growth_factor=1.5, backoff_factor=0.25,
                           growth_interval=4)),
    # Factors that are not float32 numbers: PyTorch multiplies by them as doubles.
    "pytorch_inexact_factors": (presets.pytorch, ref.PyTorch,
                                dict(init_scale=2.0**16, growth_factor=1.1, backoff_factor=0.7,
                                     growth_interval=3)),
    "pytorch_inexact_growth": (presets.pytorch, ref.PyTorch,
                               dict(init_scale=3.0, growth_factor=1.3, backoff_factor=0.55,
                                    growth_interval=2)),
    "deepspeed": (presets.deepspeed, ref.DeepSpeed, {}),
    "deepspeed_class_defaults": (presets.deepspeed, ref.DeepSpeed,
                                 dict(init_scale=2.0**32, delayed_shift=1)),
    "deepspeed_consecutive": (presets.deepspeed, ref.DeepSpeed,
                              dict(scale_window=5, delayed_shift=3, consecutive_hysteresis=True)),
    "deepspeed_small": (presets.deepspeed, ref.DeepSpeed,
                        dict(init_scale=64.0, scale_window=4, delayed_shift=3, min_scale=2.0)),
    "megatron": (presets.megatron, ref.Megatron, {}),
    "megatron_small": (presets.megatron, ref.Megatron,
                       dict(initial_scale=2.0**10, growth_interval=3, hysteresis=3,
                            backoff_factor=0.25, min_scale=4.0)),
    "keras": (presets.keras, ref.Keras, {}),
    "keras_small": (presets.keras, ref.Keras, dict(initial_scale=2.0, dynamic_growth_steps=3)),
    "jmp": (presets.jmp, ref.Jmp, {}),
    "jmp_small": (presets.jmp, ref.Jmp, dict(loss_scale=16.0, period=2, factor=4.0)),
    # Backing off by 3 multiplies by float32(1/3) under `jit`: not the exact quotient.
    "jmp_inexact_backoff": (presets.jmp, ref.Jmp, dict(loss_scale=1000.0, period=2, factor=3.0)),
    "flax": (presets.flax, ref.Flax, {}),
    "flax_small": (presets.flax, ref.Flax, dict(growth_interval=3, scale=2.0, minimum_scale=None)),
    # flax accepts 0: a growth on every finite step.
    "flax_every_step": (presets.flax, ref.Flax, dict(growth_interval=0, scale=2.0)),
}


# PyTorch and Keras have no floor. After ~140 overflows in a row their float32 scale
# drops below the smallest normal float32, where the library flushes it to zero on
# every platform while NumPy keeps a subnormal. Their models flush likewise here; see
# README's parity table and `test_floorless_scale_flushes_to_zero_below_float32_normals`.
FLOORLESS = {ref.PyTorch: dict(flush_subnormals=True), ref.Keras: dict(flush_subnormals=True)}


def period_of(loss_scale):
  return loss_scale.increment_period


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_preset_matches_reference_model_step_by_step(case, seed):
  make, model_cls, kwargs = CASES[case]
  loss_scale, model = make(**kwargs), model_cls(**kwargs, **FLOORLESS.get(model_cls, {}))
  finite = finite_sequence(seed, period_of(loss_scale))
  scales, applied, good, left = (np.asarray(a) for a in replay(loss_scale, finite))
  for i, f in enumerate(finite):
    expected_apply = model.step(bool(f))
    assert applied[i] == expected_apply, (case, i)
    assert scales[i] == model.scale, (case, i, scales[i], model.scale)
    model_good, model_hysteresis = (
        model.counters() if hasattr(model, "counters") else (model.good, None)
    )
    assert good[i] == model_good, (case, i)
    if case.startswith("deepspeed"):
      assert max(left[i], 1) == model_hysteresis, (case, i)  # DeepSpeed keeps it at >= 1
    elif case.startswith("megatron"):
      assert left[i] == max(model_hysteresis, 0), (case, i)  # Megatron lets it go negative
  # The sequences really exercise both directions.
  assert (np.diff(scales) > 0).any() and (np.diff(scales) < 0).any()


@pytest.mark.parametrize("factor", [0.7, 0.9, 0.3, 1 / 3, 0.999])
def test_pytorch_backoff_by_any_factor_equals_double_arithmetic(factor):
  # With a float32 product instead, the first backoff by 0.7 is already an ulp off.
  scale = np.float32(2.0**16)
  loss_scale = presets.pytorch(init_scale=float(scale), backoff_factor=factor)
  scales = np.asarray(replay(loss_scale, jnp.zeros(60, bool))[0])
  expected = []
  for _ in range(60):
    scale = ref.xla_f32(float(scale) * factor)
    expected.append(scale)
  np.testing.assert_array_equal(scales, np.array(expected, np.float32))
  # A float32 product of the same factor would have left PyTorch's trajectory.
  float32_scales, scale = [], np.float32(2.0**16)
  for _ in range(60):
    scale = ref.xla_f32(scale * np.float32(factor))
    float32_scales.append(scale)
  assert float32_scales != expected


@pytest.mark.parametrize("preset", [presets.pytorch, presets.keras])
def test_floorless_scale_flushes_to_zero_below_float32_normals(preset):
  # On every platform: XLA keeps float32 subnormals on GPU, flushes them on CPU/TPU.
  tiny = float(np.finfo(np.float32).tiny)  # 2**-126
  loss_scale = preset(**{"init_scale" if preset is presets.pytorch else "initial_scale":
                         2.0 * tiny})
  scales = list(map(float, replay(loss_scale, jnp.zeros(3, bool))[0]))
  assert scales == [tiny, 0.0, 0.0]  # a float32 subnormal would be tiny / 2


def test_sequences_reach_the_floor_and_grow_repeatedly():
  loss_scale = presets.megatron(growth_interval=3)
  scales = np.asarray(replay(loss_scale, finite_sequence(0, 3))[0])
  assert scales.min() == 1.0
  assert (np.diff(scales) > 0).sum() >= 10


def test_flax_grows_one_step_later_than_the_others():
  steps = jnp.ones(6, bool)
  flax_scales = replay(presets.flax(growth_interval=3, scale=1.0), steps)[0]
  jmp_scales = replay(presets.jmp(loss_scale=1.0, period=3), steps)[0]
  assert list(map(float, jmp_scales)) == [1, 1, 2, 2, 2, 4]
  assert list(map(float, flax_scales)) == [1, 1, 1, 2, 2, 2]


# --- TensorFlow contrib managers -----------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "kwargs",
    [dict(init_loss_scale=2.0**15, incr_every_n_steps=1000),
     dict(init_loss_scale=8.0, incr_every_n_steps=3, decr_every_n_nan_or_inf=3,
          incr_ratio=3.0, decr_ratio=0.5)],
    ids=["contrib_defaults", "small"],
)
def test_exponential_update_manager_matches_contrib_step_by_step(kwargs, seed):
  manager = jls_tf.ExponentialUpdateLossScaleManager(**kwargs)
  model = ref.TensorFlowContribExponential(**kwargs)
  finite = finite_sequence(seed, kwargs["incr_every_n_steps"])
  scales, applied, good, bad = (np.asarray(a) for a in replay(manager, finite))
  for i, f in enumerate(finite):
    assert applied[i] == model.step(bool(f)), i
    assert (scales[i], good[i], bad[i]) == (model.scale, model.good, model.bad), i
