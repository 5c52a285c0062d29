"""TensorFlow contrib's loss-scale managers (`tf.contrib.mixed_precision`).

`get_loss_scale()` and `update_loss_scale(finite_grads)` as in TensorFlow 1.x, except that
`update_loss_scale` returns the new manager (state is immutable here) instead of an op.
Managers are also `LossScale`s, so they work wherever a loss scale does, `loss_scaling`
included; as in contrib's `LossScaleOptimizer`, a manager applies a step only when its
gradients are finite.
"""

from __future__ import annotations

from typing import Any
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _numerics
from jax_lossscale import _validation
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import StateSpec
from jax_lossscale._loss_scale import loss_scale_dataclass
from jax_lossscale._loss_scale import set_fields
from jax_lossscale._loss_scale import state_field
from jax_lossscale._loss_scale import with_state


class LossScaleManager(LossScale):
  """Base class of TensorFlow contrib's loss-scale managers."""

  def get_loss_scale(self) -> jax.Array:
    """Returns the loss scale as a float32 scalar array."""
    return self()

  def update_loss_scale(self, finite_grads: Any) -> LossScaleManager:
    """Returns the manager updated for one step.

    Args:
      finite_grads: boolean scalar (array or Python bool): whether all gradients of the
        step were finite.

    Raises:
      ValueError: if `finite_grads` is not a boolean scalar.
    """
    return self.adjust(_validation.flag("finite_grads", finite_grads))

  def should_apply(self, grads_finite: jax.Array) -> jax.Array:
    return _validation.flag("grads_finite", grads_finite)


@loss_scale_dataclass
class FixedLossScaleManager(LossScaleManager, FixedLossScale):
  """A manager whose loss scale never changes.

  Args:
    loss_scale: a real number >= 1 that is finite in float32.

  Raises:
    ValueError: if `loss_scale` is not a real number, is below 1, or is inf in float32.
  """

  def __init__(self, loss_scale: float):
    value = _validation.scale("loss_scale", loss_scale, minimum=1.0)
    object.__setattr__(self, "loss_scale_value", value)

  def get_config(self) -> dict[str, Any]:
    return {"loss_scale": self.loss_scale_value}


@loss_scale_dataclass
class ExponentialUpdateLossScaleManager(LossScaleManager):
  """A manager that grows the scale after good runs and shrinks it after overflows.

  Exactly contrib's algorithm:

  * finite step: if this makes `incr_every_n_steps` finite steps in a row, the scale is
    multiplied by `incr_ratio` (kept only if the result is finite) and both counts
    reset; otherwise the good-step count grows by one.
  * non-finite step: if this makes `decr_every_n_nan_or_inf` non-finite steps since the
    last change (not necessarily in a row), the scale becomes
    `max(scale * decr_ratio, 1)` and both counts reset; otherwise the bad-step count
    grows by one and the good-step count resets.

  Args:
    init_loss_scale: the first scale, a real number >= 1, finite in float32.
    incr_every_n_steps: finite steps in a row needed to grow (>= 1, an int32).
    decr_every_n_nan_or_inf: non-finite steps needed to shrink (>= 1, an int32).
    incr_ratio: growth factor (> 1, also once rounded to float32).
    decr_ratio: shrink factor in (0, 1), also once rounded to float32.
    current_loss_scale, num_good_steps, num_bad_steps: the state (float32, int32, int32
      scalars); leave them out to start fresh.

  Raises:
    ValueError: naming the argument, for a value outside the ranges above.
  """

  init_loss_scale: float
  incr_every_n_steps: int
  decr_every_n_nan_or_inf: int = 2
  incr_ratio: float = 2.0
  decr_ratio: float = 0.8
  current_loss_scale: jax.Array = state_field()
  num_good_steps: jax.Array = state_field()
  num_bad_steps: jax.Array = state_field()

  def __post_init__(self):
    checked = {
        "init_loss_scale": _validation.scale("init_loss_scale", self.init_loss_scale, minimum=1.0),
        "incr_every_n_steps": _validation.integer("incr_every_n_steps", self.incr_every_n_steps, 1),
        "decr_every_n_nan_or_inf": _validation.integer(
            "decr_every_n_nan_or_inf", self.decr_every_n_nan_or_inf, 1),
        "incr_ratio": _validation.growth_factor("incr_ratio", self.incr_ratio),
        "decr_ratio": _validation.shrink_factor("decr_ratio", self.decr_ratio),
    }
    set_fields(self, checked, {
        "current_loss_scale": StateSpec(checked["init_loss_scale"], np.float32,
                                        low=1.0, high=_numerics.FLOAT32_MAX),
        "num_good_steps": StateSpec(0, np.int32, low=0, high=checked["incr_every_n_steps"] - 1),
        "num_bad_steps": StateSpec(0, np.int32,
                                   low=0, high=checked["decr_every_n_nan_or_inf"] - 1),
    })

  min_loss_scale: ClassVar[float] = 1.0  # contrib's floor, `max(scale * decr_ratio, 1)`

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.current_loss_scale, jnp.float32)

  def adjust(self, grads_finite: jax.Array,
             measured: Any = None) -> ExponentialUpdateLossScaleManager:
    grads_finite = _validation.flag("grads_finite", grads_finite)  # `~True` is an int
    scale = self()
    good = jnp.asarray(self.num_good_steps, jnp.int32)
    bad = jnp.asarray(self.num_bad_steps, jnp.int32)
    increase = grads_finite & (good + 1 >= self.incr_every_n_steps)
    decrease = ~grads_finite & (bad + 1 >= self.decr_every_n_nan_or_inf)
    grown = _numerics.grow(scale, scale * np.float32(self.incr_ratio))
    shrunk = jnp.maximum(scale * np.float32(self.decr_ratio), np.float32(self.min_loss_scale))
    changed = increase | decrease
    return with_state(
        self,
        current_loss_scale=jnp.where(increase, grown, jnp.where(decrease, shrunk, scale)),
        num_good_steps=jnp.where(grads_finite & ~changed, good + 1, 0).astype(jnp.int32),
        num_bad_steps=jnp.where(changed, 0, jnp.where(grads_finite, bad, bad + 1)).astype(
            jnp.int32),
    )
