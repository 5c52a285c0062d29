"""Plain-Python reference models of each system's documented loss-scale algorithm.

Written independently of the library, step by step from each system's source, in
float32 arithmetic where the system keeps its scale in float32. Each model's `step`
takes whether the step's gradients were finite and returns whether it was applied.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


class TensorFlowDynamic:
  """tf.mixed_precision DynamicLossScale (r1.15 `loss_scale.py`)."""

  def __init__(self, initial=2.0**15, period=2000, multiplier=2.0):
    self.scale, self.good, self.period, self.multiplier = f32(initial), 0, period, f32(multiplier)

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
