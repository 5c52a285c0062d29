"""`MeasuredLossScale`: a loss scale set from what the backward pass measured.

Transformer Engine's delayed scaling for float8, applied to float16 loss scaling: the
next scale is the largest power of two at which the largest gradient of the last
`history` steps (every probed activation gradient, and the parameter gradients) keeps
`margin` doublings below the largest float16. An overflow is the safety net: it tells
that the unscaled maximum was at least `65504 / scale`, which enters the history like a
measurement: the maximum exceeded `65504 / scale`, so at half the scale it might fit.
A gradient no probe sees can overflow where the measurements say the scale fits: the
scale that overflowed becomes a ceiling, held for `history` steps, then tried again;
each time the retry overflows, the next ceiling is held twice as long (up to 64 times).
An overflow at a scale not yet run finite under the ceiling lowers the ceiling to it.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _numerics
from jax_lossscale import _policy
from jax_lossscale import _validation
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import StateSpec
from jax_lossscale._loss_scale import loss_scale_dataclass
from jax_lossscale._loss_scale import set_fields
from jax_lossscale._loss_scale import state_field
from jax_lossscale._loss_scale import with_state

_MAX_STRIKES = 6  # the longest wait: history << 6


@loss_scale_dataclass
class MeasuredLossScale(LossScale):
  """A loss scale chosen each step from the measured gradient maxima.

  Give it measurements: `scaled_value_and_grad(loss_fn, probes=True)` returns them,
  `tx.update(..., probes=probes)` passes them on (without probes, the parameter
  gradients are the only measurement). Each update records the largest magnitude seen,
  unscaled (an overflow, in the parameter gradients or in a probed activation gradient,
  records `2 * max_value / scale`: the maximum exceeded
  `max_value / scale`, and at half the scale it might fit), and sets the
  scale to the largest power of two `p` with `p * max(history) * 2**margin <= max_value`,
  within `[min_loss_scale, max_loss_scale]`. A probe hit several times (a `vmap` inside
  the loss, each device of a `shard_map`) knows its largest magnitude only to a binade
  and is recorded at the binade's top, 2**e, so the scale may sit one doubling lower
  than the exact maximum would allow. So the scale sits just below overflow
  without the grow-overflow-skip cycle of `DynamicLossScale`; a step is skipped only
  when a gradient grows more than `2**margin` times beyond the recent maximum, or when
  a gradient nothing measures (inside a layer, between probes) overflows. Then the
  scale that overflowed is a ceiling: for `history` steps the scale stays below it
  (an overflow there within `history` steps of the last lowers it), then it is tried
  again; an overflow on that first step back (a strike) holds the next ceiling twice as
  long (4, 8, ... up to 64 times `history`), so such a gradient costs skipped steps that
  grow with the logarithm of the run's length, where `DynamicLossScale` skips one step
  every growth period. With a margin, an overflow drops the scale more than one doubling
  and it climbs back below the ceiling once the overflow leaves the history: an overflow
  at a scale that has not run finite since the ceiling was set lowers the ceiling to it.
  A NaN that no scale avoids (a bad example) skips its step and, recorded as an overflow,
  drops the scale `1 + margin` doublings for `history` steps; more than `history` steps
  after the last overflow, at a scale already proven, it does not lower the ceiling. NaNs
  closer together than `history` steps lower the scale and the ceiling at each one (to
  `min_loss_scale` if they keep coming), as `DynamicLossScale` halves at each. Under
  `optax.MultiSteps`, each micro-batch is a step of the history.

  Args:
    initial_loss_scale: the first scale (before anything is measured).
    margin: doublings of headroom kept below `max_value` (>= 0). The default, 2, is
      for gradient maxima that jump from step to step: with maxima that vary
      log-normally (sigma 1) by the step, margin 0 skips about one step in 33, where
      the next maximum beats the last `history` steps' by more than the rounding to a
      power of two; margin 2 skips no more than `DynamicLossScale` does. Margin 0
      keeps the scale as high as the measurements allow (two doublings more of small
      gradients' bits), for gradients whose maxima move smoothly (the MLP demo's):
      `benchmarks/margins.py` gives each margin's cost on both kinds.
    history: how many steps' maxima the scale respects (>= 1).
    dtype: the compute dtype whose largest value bounds the gradients: "float16" (the
      default) or a float8 type (others need no loss scale); its name is kept, so the
      config stays JSON.
    min_loss_scale: the floor, a positive float32 normal.
    max_loss_scale: the cap (default 2**24: beyond it float16 gradients of 2**-24, the
      smallest subnormal, would already be 1).
    current_loss_scale, maxima, ceiling, patience, strikes, proven: the state: the
      scale and the recent maxima (float32 scalar, `[history]`); the last scale that
      overflowed (float32, 0 before any), the steps its ceiling still holds (int32;
      counting down below 0 once lifted, to `-history`), the strikes (int32) and the
      largest scale that ran finite since the ceiling was set (float32).

  Raises:
    ValueError: naming the argument, for a value outside these ranges.
  """

  initial_loss_scale: float = 2.0**15
  margin: int = 2
  history: int = 16
  dtype: str = "float16"
  min_loss_scale: float = 1.0
  max_loss_scale: float = 2.0**24
  current_loss_scale: jax.Array = state_field()
  maxima: jax.Array = state_field()
  ceiling: jax.Array = state_field()
  patience: jax.Array = state_field()
  strikes: jax.Array = state_field()
  proven: jax.Array = state_field()
  measures = True  # the step passes it what was measured

  def __post_init__(self):
    checked = {
        "initial_loss_scale": _validation.scale("initial_loss_scale", self.initial_loss_scale),
        "margin": _validation.integer("margin", self.margin, 0, 100),
        "history": _validation.integer("history", self.history, 1, 1 << 16),
        "dtype": _policy.as_dtype(self.dtype, "dtype").name,
        "min_loss_scale": _validation.scale("min_loss_scale", self.min_loss_scale),
        "max_loss_scale": _validation.scale("max_loss_scale", self.max_loss_scale),
    }
    if not _numerics.has_short_range(checked["dtype"]):
      raise ValueError(
          f"`dtype` must be float16 or a float8 type, got {self.dtype!r}, which has float32's "
          "range: it needs no loss scale (NoOpLossScale still skips non-finite steps).")
    for name, value in checked.items():
      object.__setattr__(self, name, value)
    if not self.min_loss_scale <= self.initial_loss_scale <= self.max_loss_scale:
      raise ValueError(
          f"`initial_loss_scale` must be within [min_loss_scale, max_loss_scale] = "
          f"[{self.min_loss_scale}, {self.max_loss_scale}], got {self.initial_loss_scale}.")
    largest = _numerics.FLOAT32_MAX
    set_fields(self, {}, {
        "current_loss_scale": StateSpec(self.initial_loss_scale, np.float32,
                                        low=self.min_loss_scale, high=self.max_loss_scale),
        "maxima": StateSpec(np.zeros(self.history), np.float32, low=0.0, high=largest),
        "ceiling": StateSpec(0.0, np.float32, low=0.0, high=largest),
        "patience": StateSpec(-self.history, np.int32,
                              low=-self.history, high=self.history << _MAX_STRIKES),
        "strikes": StateSpec(0, np.int32, low=0, high=_MAX_STRIKES),
        "proven": StateSpec(0.0, np.float32, low=0.0, high=largest),
    })

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.current_loss_scale, jnp.float32)

  def should_apply(self, grads_finite: jax.Array) -> jax.Array:
    return _validation.flag("grads_finite", grads_finite)

  def adjust(self, grads_finite: jax.Array, measured: Any = None) -> MeasuredLossScale:
    grads_finite = _validation.flag("grads_finite", grads_finite)  # `~True` is an int
    scale = self()
    limit = np.float32(jnp.finfo(self.dtype).max)
    if measured is None:  # read as no gradient at all, it would jump to max_loss_scale
      raise ValueError(
          "MeasuredLossScale.adjust(grads_finite, measured) needs `measured`, the step's "
          "largest scaled gradient magnitude (float32 scalar), got None: its scale is set "
          "from it. update(grads) and loss_scaling pass it.")
    # A non-finite measurement (a probed activation gradient that overflowed while the
    # parameter gradients stayed finite) is an overflow too.
    unscaled = jnp.asarray(measured, jnp.float32) / scale
    overflow = ~(grads_finite & jnp.isfinite(unscaled))
    unscaled = jnp.where(overflow, jnp.minimum(2 * limit / scale, _numerics.FLOAT32_MAX),
                         unscaled)  # finite: a checkpoint's `maxima` are checked finite
    maxima = jnp.roll(jnp.asarray(self.maxima, jnp.float32), 1).at[0].set(unscaled)
    largest = jnp.max(maxima)
    exponent = _numerics.log2_floor_ratio(limit, largest) - self.margin
    target = jnp.ldexp(jnp.float32(1), jnp.clip(exponent, -126, 127))
    target = jnp.where(largest > 0, target, np.float32(self.max_loss_scale))
    ceiling, patience, strikes, proven = self._ceiling(overflow, scale)
    target = jnp.minimum(target, jnp.where(patience > 0, ceiling / 2, jnp.where(
        patience > -self.history, ceiling, jnp.inf)))
    target = jnp.clip(target, np.float32(self.min_loss_scale), np.float32(self.max_loss_scale))
    return with_state(self, current_loss_scale=target, maxima=maxima, ceiling=ceiling,
                      patience=patience, strikes=strikes, proven=proven)

  def _ceiling(self, overflow: jax.Array, scale: jax.Array):
    """The ceiling, its patience, the strikes and the proven scale after this step.

    An overflow makes the scale it ran at the ceiling: for `history << strikes` steps
    the scale stays below it, for `history` more at most at it, then it is free. An
    overflow on the first step back at the ceiling is a strike (the ceiling was right).
    One while it holds, more than `history` steps after the last, at a scale that has
    already run finite since the ceiling was set, changes nothing but the history (a NaN
    that no scale avoids must not drive the ceiling down); at a scale not yet proven (with
    a margin, the scale climbs back below the ceiling only once the overflow leaves the
    history), it lowers the ceiling to that scale.
    """
    ceiling = jnp.asarray(self.ceiling, jnp.float32)
    patience = jnp.asarray(self.patience, jnp.int32)
    strikes = jnp.asarray(self.strikes, jnp.int32)
    proven = jnp.asarray(self.proven, jnp.float32)
    held = np.int32(self.history) << strikes
    struck = (patience == 0) & (scale >= ceiling)
    stale = (patience > 0) & (patience <= held - self.history) & (scale <= proven)
    strikes = jnp.where(overflow, jnp.where(patience <= -self.history, 0, jnp.where(
        struck, jnp.minimum(strikes + 1, _MAX_STRIKES), strikes)), strikes)
    moved = overflow & ~stale
    patience = jnp.where(moved, np.int32(self.history) << strikes,
                         jnp.maximum(patience - 1, -self.history))
    proven = jnp.where(moved, 0, jnp.where(overflow, proven, jnp.maximum(proven, scale)))
    return jnp.where(moved, scale, ceiling), patience, strikes, proven
