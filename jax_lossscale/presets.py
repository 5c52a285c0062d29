"""Presets: `DynamicLossScale` instances that behave exactly like the scalers users know.

Each function takes that system's own argument names and defaults and returns the
equivalent `DynamicLossScale`; the table of docs/porting.md lists what each maps to and the
few places where behaviour differs. Every mapping is checked step by step against a
reference model of that system in `tests/test_parity.py`.

    >>> from jax_lossscale import presets
    >>> loss_scale = presets.pytorch(init_scale=2.0**16, growth_interval=2000)
"""

from __future__ import annotations

import dataclasses

from jax_lossscale import _numerics
from jax_lossscale import _validation
from jax_lossscale._loss_scale import DynamicLossScale

__all__ = ("deepspeed", "flax", "jmp", "keras", "megatron", "pytorch", "tensorflow")


def _dynamic(names: dict[str, str], *args, **kwargs) -> DynamicLossScale:
  """`DynamicLossScale(*args, **kwargs)` whose errors call its arguments by `names`."""
  with _validation.renamed(**names):
    return DynamicLossScale(*args, **kwargs)


def tensorflow(
    initial_loss_scale: float = 2.0**15, increment_period: int = 2000, multiplier: float = 2.0
) -> DynamicLossScale:
  """TensorFlow's `DynamicLossScale` (these are also `DynamicLossScale`'s defaults)."""
  return DynamicLossScale(initial_loss_scale, increment_period, multiplier)


def pytorch(
    init_scale: float = 2.0**16,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
) -> DynamicLossScale:
  """PyTorch's `torch.amp.GradScaler`: no floor; a growth to inf is refused.

  The scale is multiplied by the factors exactly as PyTorch does it (a float32
  scale times a double, rounded to float32: `factor_precision="float64"`), so any
  factor, not only powers of two, gives PyTorch's trajectory bit for bit.
  """
  names = dict(initial_loss_scale="init_scale", increment_period="growth_interval",
               multiplier="growth_factor")
  return _dynamic(names, init_scale, growth_interval, growth_factor,
                  backoff_factor=backoff_factor, min_loss_scale=0.0, factor_precision="float64")


def deepspeed(
    init_scale: float = 2.0**16, scale_factor: float = 2.0, scale_window: int = 1000,
    min_scale: float = 1.0, delayed_shift: int = 2, consecutive_hysteresis: bool = False,
) -> DynamicLossScale:
  """DeepSpeed's `DynamicLossScaler` with its config-file defaults.

  (The class itself defaults to `init_scale=2**32` and `delayed_shift=1`; DeepSpeed's
  fp16 config defaults to `initial_scale_power=16`, `hysteresis=2`.)
  """
  names = dict(initial_loss_scale="init_scale", increment_period="scale_window",
               multiplier="scale_factor", min_loss_scale="min_scale", hysteresis="delayed_shift")
  return _dynamic(names, init_scale, scale_window, scale_factor, min_loss_scale=min_scale,
                  hysteresis=delayed_shift, consecutive_hysteresis=consecutive_hysteresis)


def megatron(
    initial_scale: float = 2.0**32, min_scale: float = 1.0, growth_factor: float = 2.0,
    backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2,
) -> DynamicLossScale:
  """Megatron-LM's `DynamicGradScaler`."""
  names = dict(initial_loss_scale="initial_scale", increment_period="growth_interval",
               multiplier="growth_factor", min_loss_scale="min_scale")
  return _dynamic(names, initial_scale, growth_interval, growth_factor,
                  backoff_factor=backoff_factor, min_loss_scale=min_scale, hysteresis=hysteresis)


def keras(initial_scale: float = 2.0**15, dynamic_growth_steps: int = 2000) -> DynamicLossScale:
  """Keras 3's `LossScaleOptimizer`: ×2 / ÷2, no floor."""
  names = dict(initial_loss_scale="initial_scale", increment_period="dynamic_growth_steps")
  return _dynamic(names, initial_scale, dynamic_growth_steps, 2.0, min_loss_scale=0.0)


def jmp(
    loss_scale: float = 2.0**15, period: int = 2000, factor: float = 2.0,
    min_loss_scale: float = 1.0,
) -> DynamicLossScale:
  """DeepMind jmp's `DynamicLossScale`, as it runs under `jit`: backing off by `factor`
  multiplies by its float32 reciprocal (`_numerics.compiled_reciprocal`)."""
  names = dict(initial_loss_scale="loss_scale", increment_period="period", multiplier="factor")
  return _backing_off_as_jmp(
      _dynamic(names, loss_scale, period, factor, min_loss_scale=min_loss_scale))


def _backing_off_as_jmp(scale: DynamicLossScale) -> DynamicLossScale:
  """`scale` backing off by its `multiplier` as jmp does under `jit`: times the float32
  reciprocal (`_numerics.compiled_reciprocal`), where that is not the division itself."""
  backoff = _numerics.compiled_reciprocal(scale.multiplier)
  return scale if backoff is None else dataclasses.replace(scale, backoff_factor=backoff)


def flax(
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    growth_interval: int = 2000,
    scale: float = 65536.0,
    minimum_scale: float | None = _numerics.FLOAT32_TINY,
) -> DynamicLossScale:
  """flax's `DynamicScale`, which grows one step later than the others.

  flax compares its finite-step count with `growth_interval` *before* counting the
  current step, so it grows on the `growth_interval + 1`-th finite step in a row:
  that is `increment_period = growth_interval + 1` here. It also caps the scale at
  the largest float32.
  """
  # flax accepts 0 (a growth on every finite step): increment_period 1 here.
  growth_interval = _validation.integer("growth_interval", growth_interval, 0,
                                        _numerics.INT32_MAX - 1)
  names = dict(initial_loss_scale="scale", multiplier="growth_factor",
               min_loss_scale="minimum_scale")
  return _dynamic(names, scale, growth_interval + 1, growth_factor,
                  backoff_factor=backoff_factor,
                  min_loss_scale=0.0 if minimum_scale is None else minimum_scale,
                  max_loss_scale=_numerics.FLOAT32_MAX)
