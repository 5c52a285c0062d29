"""Plain-Python reference models of each system's documented loss-scale algorithm.

Written independently of the library, step by step from each system's source, in
float32 arithmetic where the system keeps its scale in float32. Each model's `step`
takes whether the step's gradients were finite and returns whether it was applied.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32
_TINY = np.finfo(np.float32).tiny


def xla_f32(x):
  """float32 with subnormal results flushed to zero, as XLA's CPU and TPU compute it
  and as the library rounds a loss scale on every platform."""
  x = f32(x)
  return f32(0) if abs(x) < _TINY else x


class TensorFlowDynamic:
  """tf.mixed_precision DynamicLossScale (r1.15 `loss_scale.py`)."""

  def __init__(self, initial_loss_scale=2.0**15, increment_period=2000, multiplier=2.0):
    self.scale, self.good = f32(initial_loss_scale), 0
    self.period, self.multiplier = increment_period, f32(multiplier)

  def step(self, finite):
    if finite:
      if self.good + 1 >= self.period:
        new = f32(self.scale * self.multiplier)
        if np.isfinite(new):  # _assign_if_finite
          self.scale = new
        self.good = 0
      else:
        self.good += 1
      return True
    self.scale = max(f32(self.scale / self.multiplier), f32(1))
    self.good = 0
    return False


class Documented:
  """The algorithm as documented for `DynamicLossScale` (hysteresis included)."""

  def __init__(self, initial=2.0**15, period=2000, multiplier=2.0, backoff=None, minimum=1.0,
               maximum=None, hysteresis=1, consecutive=False):
    self.scale, self.good, self.left = f32(initial), 0, hysteresis
    self.period, self.multiplier, self.backoff = period, f32(multiplier), backoff
    self.minimum, self.maximum = f32(minimum), maximum
    self.hysteresis, self.consecutive = hysteresis, consecutive

  def step(self, finite):
    if finite:
      self.good += 1
      if self.consecutive:
        self.left = self.hysteresis
      if self.good >= self.period:
        new = f32(self.scale * self.multiplier)
        if self.maximum is None:
          self.scale = new if np.isfinite(new) else self.scale
        else:
          self.scale = min(new, f32(self.maximum))
        self.good, self.left = 0, self.hysteresis
      return True
    self.good = 0
    self.left = max(self.left - 1, 0)
    if self.left == 0:
      shrunk = (f32(self.scale / self.multiplier) if self.backoff is None
                else f32(self.scale * f32(self.backoff)))
      self.scale = max(shrunk, self.minimum)
    return False


class PyTorch:
  """torch.amp.GradScaler (`_amp_update_scale_cpu_`): float32 scale, growth only if finite.

  The kernel multiplies the float scale by the factor, a C++ double, and stores the
  double product into the float: `(float)((double)scale * factor)`, which Python's
  float arithmetic reproduces exactly.
  """

  def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
               growth_interval=2000, flush_subnormals=False):
    self.round = xla_f32 if flush_subnormals else f32
    self.scale, self.tracker = f32(init_scale), 0
    self.growth, self.backoff = float(growth_factor), float(backoff_factor)
    self.interval = growth_interval

  def step(self, finite):
    if not finite:
      self.scale, self.tracker = self.round(float(self.scale) * self.backoff), 0
      return False
    successful = self.tracker + 1
    if successful == self.interval:
      new = self.round(float(self.scale) * self.growth)
      if np.isfinite(new):
        self.scale = new
      self.tracker = 0
    else:
      self.tracker = successful
    return True

  def counters(self):
    return self.tracker, None


class DeepSpeed:
  """DeepSpeed `DynamicLossScaler.update_scale`, iteration-based, Python floats."""

  def __init__(self, init_scale=2.0**16, scale_factor=2.0, scale_window=1000, min_scale=1.0,
               delayed_shift=2, consecutive_hysteresis=False):
    self.cur_scale, self.cur_iter, self.last_overflow_iter = float(init_scale), 0, -1
    self.scale_factor, self.scale_window, self.min_scale = scale_factor, scale_window, min_scale
    self.delayed_shift, self.cur_hysteresis = delayed_shift, delayed_shift
    self.consecutive_hysteresis = consecutive_hysteresis

  @property
  def scale(self):
    return self.cur_scale

  def step(self, finite):
    overflow = not finite
    if overflow:
      if self.delayed_shift == 1 or self.cur_hysteresis == 1:
        self.cur_scale = max(self.cur_scale / self.scale_factor, self.min_scale)
      else:
        self.cur_hysteresis -= 1
      self.last_overflow_iter = self.cur_iter
    else:
      if self.consecutive_hysteresis:
        self.cur_hysteresis = self.delayed_shift
      if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
        if not self.consecutive_hysteresis:
          self.cur_hysteresis = self.delayed_shift
        self.cur_scale *= self.scale_factor
    self.cur_iter += 1
    return not overflow

  def counters(self):
    good = (self.cur_iter - self.last_overflow_iter - 1) % self.scale_window
    return good, self.cur_hysteresis


class Megatron:
  """Megatron-LM `DynamicGradScaler.update`: float32 scale, hysteresis tracker."""

  def __init__(self, initial_scale=2.0**32, min_scale=1.0, growth_factor=2.0,
               backoff_factor=0.5, growth_interval=1000, hysteresis=2):
    self.scale, self.min_scale = f32(initial_scale), f32(min_scale)
    self.growth, self.backoff = f32(growth_factor), f32(backoff_factor)
    self.interval, self.hysteresis = growth_interval, hysteresis
    self.growth_tracker, self.hysteresis_tracker = 0, hysteresis

  def step(self, finite):
    if not finite:
      self.growth_tracker = 0
      self.hysteresis_tracker -= 1
      if self.hysteresis_tracker <= 0:
        self.scale = max(f32(self.scale * self.backoff), self.min_scale)
      return False
    self.growth_tracker += 1
    if self.growth_tracker == self.interval:
      self.growth_tracker, self.hysteresis_tracker = 0, self.hysteresis
      self.scale = f32(self.scale * self.growth)
    return True

  def counters(self):
    return self.growth_tracker, self.hysteresis_tracker


class Keras:
  """Keras 3 `LossScaleOptimizer`: ×2 after `dynamic_growth_steps`, ÷2 on overflow."""

  def __init__(self, initial_scale=2.0**15, dynamic_growth_steps=2000, flush_subnormals=False):
    self.round = xla_f32 if flush_subnormals else f32
    self.scale, self.counter, self.steps = f32(initial_scale), 0, dynamic_growth_steps

  def step(self, finite):
    if finite:
      if self.counter == self.steps - 1:
        self.counter, self.scale = 0, self.round(self.scale * f32(2))
      else:
        self.counter += 1
      return True
    self.scale, self.counter = self.round(self.scale / f32(2)), 0
    return False

  def counters(self):
    return self.counter, None


class Jmp:
  """jmp `DynamicLossScale.adjust`."""

  def __init__(self, loss_scale=2.0**15, period=2000, factor=2.0, min_loss_scale=1.0):
    self.scale, self.counter = f32(loss_scale), 0
    self.period, self.factor, self.min = period, f32(factor), f32(min_loss_scale)

  def step(self, finite):
    if finite:
      if self.counter == self.period - 1:
        self.scale = f32(self.scale * self.factor)
      self.counter = (self.counter + 1) % self.period
      return True
    # `scale / factor` with a static factor, as `jit` compiles it: times its reciprocal.
    self.scale, self.counter = max(self.min, f32(self.scale * f32(1 / self.factor))), 0
    return False

  def counters(self):
    return self.counter, None


class Flax:
  """flax `DynamicScale.value_and_grad`: grows when `fin_steps == growth_interval`."""

  def __init__(self, growth_factor=2.0, backoff_factor=0.5, growth_interval=2000,
               scale=65536.0, minimum_scale=float(_TINY)):
    self.scale, self.fin_steps = f32(scale), 0
    self.growth, self.backoff = f32(growth_factor), f32(backoff_factor)
    self.interval = growth_interval
    self.minimum = minimum_scale

  def step(self, finite):
    grow = self.fin_steps == self.interval
    if finite:
      if grow:
        self.scale = min(f32(self.scale * self.growth), np.finfo(np.float32).max)
    else:
      self.scale = f32(self.scale * self.backoff)
      if self.minimum is not None:
        self.scale = max(self.scale, f32(self.minimum))
    self.fin_steps = 0 if (grow or not finite) else self.fin_steps + 1
    return finite

  def counters(self):
    return self.fin_steps, None


class TensorFlowContribExponential:
  """tf.contrib.mixed_precision `ExponentialUpdateLossScaleManager.update_loss_scale`."""

  def __init__(self, init_loss_scale, incr_every_n_steps, decr_every_n_nan_or_inf=2,
               incr_ratio=2.0, decr_ratio=0.8):
    self.scale, self.good, self.bad = f32(init_loss_scale), 0, 0
    self.incr_every, self.decr_every = incr_every_n_steps, decr_every_n_nan_or_inf
    self.incr_ratio, self.decr_ratio = f32(incr_ratio), f32(decr_ratio)

  def step(self, finite):
    if finite:
      if self.good + 1 >= self.incr_every:
        new = f32(self.scale * self.incr_ratio)
        if np.isfinite(new):
          self.scale = new
        self.good, self.bad = 0, 0
      else:
        self.good += 1
      return True
    if self.bad + 1 >= self.decr_every:
      self.scale = max(f32(1), f32(self.scale * self.decr_ratio))
      self.good, self.bad = 0, 0
    else:
      self.bad += 1
      self.good = 0
    return False
