"""Loss scales: immutable pytree dataclasses whose `update` is a pure function.

The JAX rebuild of TensorFlow's `LossScale`, `FixedLossScale` and `DynamicLossScale`.
Each loss scale is a frozen dataclass registered as a pytree: its state (scale and
counters) are array leaves, its hyperparameters are static fields kept in the tree
definition. Registration enumerates the dataclass fields, so no field can be forgotten
when a loss scale crosses `jit`, `vmap` or `jax.tree.map`.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import numbers
from typing import Any
from typing import ClassVar
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _tree

_T = TypeVar("_T", bound="LossScale")
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def state_field() -> Any:
  """A dataclass field holding array state (a pytree leaf); filled in `__post_init__`."""
  return dataclasses.field(default=None, kw_only=True, metadata={"state": True})


def _is_state(field: dataclasses.Field) -> bool:
  return field.metadata.get("state", False)


def loss_scale_dataclass(cls: type[_T]) -> type[_T]:
  """Makes `cls` a frozen dataclass and registers it as a pytree with keys.

  State fields (declared with `state_field()`) become leaves; every other field is
  static and lives in the tree definition. Unflattening bypasses `__init__`, so
  transformations may put any object (tracers, `None`, sentinels) in the leaves.
  """
  cls = dataclasses.dataclass(frozen=True, eq=False, repr=False)(cls)
  fields = dataclasses.fields(cls)
  state_names = tuple(f.name for f in fields if _is_state(f))
  static_names = tuple(f.name for f in fields if not _is_state(f))
  keys = tuple(jax.tree_util.GetAttrKey(n) for n in state_names)

  def flatten_with_keys(obj):
    children = tuple((k, getattr(obj, n)) for k, n in zip(keys, state_names, strict=False))
    return children, tuple(getattr(obj, n) for n in static_names)

  def unflatten(static, children):
    obj = object.__new__(cls)
    for name, value in zip(static_names, static, strict=False):
      object.__setattr__(obj, name, value)
    for name, value in zip(state_names, children, strict=False):
      object.__setattr__(obj, name, value)
    return obj

  def flatten(obj):
    children, static = flatten_with_keys(obj)
    return tuple(v for _, v in children), static

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  cls._state_names = state_names
  cls._static_names = static_names
  return cls


def check_real(name: str, value: Any) -> float:
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise ValueError(f"`{name}` must be a real number, got {value!r} ({type(value).__name__}).")
  value = float(value)
  if not math.isfinite(value):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return value


def check_scale_at_least_one(name: str, value: Any) -> float:
  """A fixed or initial loss scale: a finite real number >= 1 (TensorFlow's rule)."""
  checked = check_real(name, value)
  if checked < 1:
    raise ValueError(f"`{name}` must be >= 1, got {value!r}.")
  return checked


def check_int(name: str, value: Any, minimum: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise ValueError(f"`{name}` must be an integer, got {value!r} ({type(value).__name__}).")
  if value < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}.")
  return int(value)


def _scalar(value: Any, dtype) -> np.ndarray:
  # NumPy, not jax: building a loss scale must not initialise a JAX backend (a
  # default argument is built at import time, before `jax.distributed.initialize`).
  return np.asarray(value, dtype=dtype)


def _format(value: Any) -> str:
  if isinstance(value, jax.core.Tracer):
    return str(value.aval)
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    value = np.asarray(value)
    return repr(value.item()) if value.ndim == 0 else f"{value.dtype}{list(value.shape)}"
  return repr(value)


class LossScale(abc.ABC):
  """Base class of every loss scale.

  A loss scale multiplies the loss before differentiation (`scale`) so that float16
  gradients do not underflow, divides the gradients afterwards (`unscale`), and
  decides from the unscaled gradients whether the step should be applied and what
  the next scale is (`update`). Loss scales are immutable: `update` returns a new one.

  Subclasses are frozen dataclasses decorated with `loss_scale_dataclass`.
  """

  _state_names: ClassVar[tuple[str, ...]] = ()
  _static_names: ClassVar[tuple[str, ...]] = ()

  @abc.abstractmethod
  def __call__(self) -> jax.Array:
    """Returns the current loss scale as a float32 scalar array."""

  @property
  def loss_scale(self) -> jax.Array:
    """The current loss scale as a float32 scalar array (same as calling the object)."""
    return self()

  def scale(self, tree: Any) -> Any:
    """Multiplies every floating leaf of `tree` by the loss scale, keeping its dtype.

    The product is computed in float32 (or wider) and cast back, so a float16 loss
    stays float16. `None` and non-floating leaves pass through untouched.
    """
    factor = self()
    return _tree.map_float_leaves(lambda x: _times(x, factor), tree)

  def unscale(self, tree: Any) -> Any:
    """Divides every floating leaf of `tree` by the loss scale, keeping its dtype.

    The quotient is correctly rounded whatever the scale (see `exact_divide`),
    computed in float32 (or wider, for float64 leaves) and cast back to the leaf's
    dtype. `None` and non-floating leaves pass through untouched.
    """
    # A true division, never a multiply by the reciprocal: the compiler may contract
    # such a multiply into the optimizer's fused multiply-adds, which round
    # differently, and a scaled run would no longer equal an unscaled one bit for bit.
    factor = self()
    return _tree.map_float_leaves(lambda x: _divide(x, factor), tree)

  def update(self: _T, grads: Any, axis_name: _tree.AxisName = None) -> tuple[_T, jax.Array]:
    """Updates the loss scale from the unscaled gradients of one step.

    Pure and jittable, with no host synchronisation.

    Args:
      grads: the gradients, already divided by the loss scale. `None` leaves and
        non-floating or non-array leaves are ignored.
      axis_name: inside `shard_map`/`pmap`, the mapped axis name(s) over which the
        finiteness of `grads` is agreed before anything is decided.

    Returns:
      `(new_loss_scale, should_apply)`, where `should_apply` is a boolean scalar
      array: False when the gradients must not be applied this step.
    """
    return self.adjust(_tree.all_finite(grads, axis_name))

  @abc.abstractmethod
  def adjust(self: _T, grads_finite: Any) -> tuple[_T, jax.Array]:
    """Like `update`, given the finiteness of the gradients as a boolean scalar."""

  def get_config(self) -> dict[str, Any]:
    """Returns the constructor arguments as a JSON-serialisable dict.

    As in TensorFlow, the config describes the initial loss scale: the current
    state (scale, counters) lives in checkpoints, not in the config.
    """
    return {name: getattr(self, name) for name in self._static_names}

  @classmethod
  def from_config(cls: type[_T], config: dict[str, Any]) -> _T:
    """Creates a loss scale from the dict returned by `get_config`."""
    return cls(**config)

  def __eq__(self, other: object) -> bool:
    if type(self) is not type(other):
      return NotImplemented
    if self.get_config() != other.get_config():
      return False
    return all(
        np.array_equal(np.asarray(getattr(self, n)), np.asarray(getattr(other, n)))
        for n in self._state_names
    )

  __hash__ = None  # Array state makes loss scales unhashable, like arrays.

  def __repr__(self) -> str:
    parts = [f"{n}={_format(getattr(self, n))}" for n in self._static_names]
    parts += [f"{n}={_format(getattr(self, n))}" for n in self._state_names]
    return f"{type(self).__name__}({', '.join(parts)})"


def _compute_dtype(dtype) -> jnp.dtype:
  return jnp.promote_types(dtype, jnp.float32)


def _times(x: jax.Array, factor: jax.Array) -> jax.Array:
  return (x.astype(_compute_dtype(x.dtype)) * factor).astype(x.dtype)


def _divide(x: jax.Array, factor: jax.Array) -> jax.Array:
  return exact_divide(x.astype(_compute_dtype(x.dtype)), factor).astype(x.dtype)


def unscale_by_reciprocal(loss_scale: LossScale, tree: Any, times: Any = None) -> Any:
  """`loss_scale.unscale(tree)` as a multiplication by the reciprocal of the scale.

  The same values as `unscale` when the scale is a power of two (every scale that
  `DynamicLossScale` reaches with its default factors), otherwise within one more
  rounding. Unlike a division, the compiler fuses it into whatever consumes it.

  Args:
    loss_scale: the scale the gradients were computed with.
    tree: the scaled gradients.
    times: an optional float32 scalar folded into the same one multiplication (a
      clipping factor); where it is 1 the result is exactly the unscaled tree.
  """
  factor = None if isinstance(loss_scale, NoOpLossScale) else 1 / loss_scale()
  if times is not None:
    factor = times if factor is None else factor * times
  if factor is None:
    return tree
  return _tree.map_float_leaves(lambda x: _times(x, factor), tree)


def exact_divide(x: jax.Array, divisor: Any) -> jax.Array:
  """`x / divisor` for a scalar `divisor`, correctly rounded.

  XLA rewrites a division by a scalar into a multiplication by its reciprocal,
  which is inexact unless the divisor is a power of two (`x / 3 != x * (1/3)` in
  float32), for constants and run-time scalars alike. Dividing instead by a
  divisor that depends on `x` keeps a true division: NaN elements are divided by 1,
  which leaves them NaN, and every other element by `divisor`.
  """
  x = jnp.asarray(x)
  divisor = jnp.where(jnp.isnan(x), jnp.ones([], x.dtype), jnp.asarray(divisor, x.dtype))
  return x / divisor


@loss_scale_dataclass
class NoOpLossScale(LossScale):
  """A loss scale of 1 that always applies: the choice for bfloat16 (e.g. on TPU).

  `scale` and `unscale` return their argument unchanged, so wrapping an optimizer
  with it adds no work beyond the optional finiteness check.
  """

  def __call__(self) -> jax.Array:
    return jnp.ones([], jnp.float32)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale(self, tree: Any) -> Any:
    return tree

  def adjust(self, grads_finite: Any) -> tuple[NoOpLossScale, jax.Array]:
    del grads_finite
    return self, jnp.array(True)


@loss_scale_dataclass
class FixedLossScale(LossScale):
  """A loss scale with a fixed value (TensorFlow's `FixedLossScale`).

  The scale never changes, and `update` always says to apply the gradients: a fixed
  scale cannot react to overflow. (Inside `loss_scaling`, non-finite steps are still
  skipped by default, so a NaN never reaches the parameters.)

  Args:
    loss_scale_value: the scale, a real number >= 1. Too small a value lets float16
      gradients underflow; too large a value causes inf or NaN.

  Raises:
    ValueError: if `loss_scale_value` is not a real number, not finite, or below 1.
  """

  loss_scale_value: float

  def __post_init__(self):
    value = check_scale_at_least_one("loss_scale_value", self.loss_scale_value)
    object.__setattr__(self, "loss_scale_value", value)

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)

  def adjust(self, grads_finite: Any) -> tuple[FixedLossScale, jax.Array]:
    del grads_finite
    return self, jnp.array(True)


@loss_scale_dataclass
class DynamicLossScale(LossScale):
  """A loss scale that backs off on overflow and grows after a run of finite steps.

  With the defaults this is TensorFlow's `DynamicLossScale` step for step. Each
  `update`:

  * finite gradients: the good-step counter grows by one; when it reaches
    `increment_period`, the scale is multiplied by `multiplier` (capped at
    `max_loss_scale`), the counter resets and the hysteresis is refilled. With
    `consecutive_hysteresis=True` the hysteresis is refilled on every finite step.
  * non-finite gradients: the step is not applied, the counter resets, and one unit
    of hysteresis is used; once none is left, the scale becomes
    `max(scale * backoff_factor, min_loss_scale)` (TensorFlow's `scale / multiplier`
    when `backoff_factor` is not given).

  The scale is stored and applied in float32 and never becomes inf, NaN or 0 (unless
  `min_loss_scale=0`).

  Args:
    initial_loss_scale: the first scale; positive, finite, within [min, max].
    increment_period: finite steps in a row before the scale grows (>= 1).
    multiplier: growth factor (> 1).
    backoff_factor: shrink factor in (0, 1); default `1 / multiplier`.
    min_loss_scale: the floor (>= 0); 0 means no floor, as in PyTorch.
    max_loss_scale: the cap; by default a growth whose result is not a finite
      float32 is refused (TensorFlow and PyTorch behaviour), so the scale stays a
      power of the multiplier.
    hysteresis: non-finite steps needed before a backoff (>= 1); DeepSpeed's
      `delayed_shift`, Megatron's `hysteresis`. Once spent, every further non-finite
      step backs off until a growth (or a finite step, see below) refills it.
    consecutive_hysteresis: refill the hysteresis on every finite step, so only
      non-finite steps in a row count (DeepSpeed's flag of that name).
    current_loss_scale, num_good_steps, hysteresis_left: the state (float32, int32,
      int32 scalars). Leave them out to start from the initial state.

  Raises:
    ValueError: naming the argument, for any value outside the ranges above.
  """

  initial_loss_scale: float = 2.0**15
  increment_period: int = 2000
  multiplier: float = 2.0
  _: dataclasses.KW_ONLY
  backoff_factor: float | None = None
  min_loss_scale: float = 1.0
  max_loss_scale: float | None = None
  hysteresis: int = 1
  consecutive_hysteresis: bool = False
  current_loss_scale: jax.Array = state_field()
  num_good_steps: jax.Array = state_field()
  hysteresis_left: jax.Array = state_field()

  def __post_init__(self):
    setattr_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
    initial = check_real("initial_loss_scale", self.initial_loss_scale)
    if initial <= 0:
      raise ValueError(f"`initial_loss_scale` must be positive, got {self.initial_loss_scale!r}.")
    period = check_int("increment_period", self.increment_period, 1)
    multiplier = check_real("multiplier", self.multiplier)
    if multiplier <= 1:
      raise ValueError(f"`multiplier` must be > 1, got {self.multiplier!r}.")
    backoff = self.backoff_factor
    if backoff is not None:
      backoff = check_real("backoff_factor", backoff)
      if not 0 < backoff < 1:
        raise ValueError(f"`backoff_factor` must be in (0, 1), got {self.backoff_factor!r}.")
    minimum = check_real("min_loss_scale", self.min_loss_scale)
    if minimum < 0:
      raise ValueError(f"`min_loss_scale` must be >= 0, got {self.min_loss_scale!r}.")
    maximum = self.max_loss_scale
    if maximum is not None:
      maximum = check_real("max_loss_scale", maximum)
      if maximum < minimum:
        raise ValueError(
            f"`max_loss_scale` ({self.max_loss_scale!r}) must be >= `min_loss_scale` "
            f"({self.min_loss_scale!r})."
        )
    if not minimum <= initial <= (_FLOAT32_MAX if maximum is None else maximum):
      raise ValueError(
          f"`initial_loss_scale` must lie in [min_loss_scale, max_loss_scale] = "
          f"[{minimum!r}, {maximum!r}], got {self.initial_loss_scale!r}."
      )
    hysteresis = check_int("hysteresis", self.hysteresis, 1)
    if not isinstance(self.consecutive_hysteresis, bool):
      raise ValueError(
          f"`consecutive_hysteresis` must be a bool, got {self.consecutive_hysteresis!r}."
      )
    for name, value in [
        ("initial_loss_scale", initial), ("increment_period", period),
        ("multiplier", multiplier), ("backoff_factor", backoff),
        ("min_loss_scale", minimum), ("max_loss_scale", maximum),
        ("hysteresis", hysteresis),
    ]:
      setattr_(name, value)
    if self.current_loss_scale is None:
      setattr_("current_loss_scale", _scalar(initial, np.float32))
    if self.num_good_steps is None:
      setattr_("num_good_steps", _scalar(0, np.int32))
    if self.hysteresis_left is None:
      setattr_("hysteresis_left", _scalar(hysteresis, np.int32))

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.current_loss_scale, jnp.float32)

  def adjust(self, grads_finite: Any) -> tuple[DynamicLossScale, jax.Array]:
    finite = jnp.asarray(grads_finite, jnp.bool_)
    scale = self()
    good = jnp.asarray(self.num_good_steps, jnp.int32)
    left = jnp.asarray(self.hysteresis_left, jnp.int32)

    grow = finite & (good + 1 >= self.increment_period)
    grown = scale * self.multiplier
    if self.max_loss_scale is None:
      grown = jnp.where(jnp.isfinite(grown), grown, scale)
    else:
      grown = jnp.minimum(grown, self.max_loss_scale)

    left_after_overflow = jnp.maximum(left - 1, 0)
    shrink = ~finite & (left_after_overflow == 0)
    if self.backoff_factor is None:
      shrunk = exact_divide(scale, self.multiplier)
    else:
      shrunk = scale * self.backoff_factor
    shrunk = jnp.maximum(shrunk, self.min_loss_scale)

    refill = grow | finite if self.consecutive_hysteresis else grow
    new = dataclasses.replace(
        self,
        current_loss_scale=jnp.where(grow, grown, jnp.where(shrink, shrunk, scale)),
        num_good_steps=jnp.where(finite & ~grow, good + 1, 0).astype(jnp.int32),
        hysteresis_left=jnp.where(
            refill, self.hysteresis, jnp.where(finite, left, left_after_overflow)
        ).astype(jnp.int32),
    )
    return new, finite
