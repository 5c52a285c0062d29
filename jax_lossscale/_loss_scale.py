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
import inspect
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _rounding
from jax_lossscale import _tree
from jax_lossscale import _validation

_T = TypeVar("_T", bound="LossScale")


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
    children = tuple((k, getattr(obj, n)) for k, n in zip(keys, state_names, strict=True))
    return children, tuple(getattr(obj, n) for n in static_names)

  def unflatten(static, children):
    obj = object.__new__(cls)
    for name, value in zip(static_names, static, strict=True):
      object.__setattr__(obj, name, value)
    for name, value in zip(state_names, children, strict=True):
      object.__setattr__(obj, name, value)
    return obj

  def flatten(obj):
    children, static = flatten_with_keys(obj)
    return tuple(v for _, v in children), static

  jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  cls._state_names = state_names
  cls._static_names = static_names
  return cls


def with_state(loss_scale: _T, **state: Any) -> _T:
  """`loss_scale` with new state leaves: `dataclasses.replace` without re-validation.

  Used for the results of `update`, whose state comes from the previous state, so it
  never pulls traced or on-device values back to the host to check them.
  """
  leaves = [state.pop(name, getattr(loss_scale, name)) for name in loss_scale._state_names]
  if state:
    raise TypeError(f"Unknown state fields {sorted(state)}.")
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(loss_scale), leaves)


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


def reciprocal(scale: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Two float32 factors whose product with a value divides it by `scale`.

  `(1, 1 / scale)`, except above 2**126, where `1 / scale` would be a float32
  subnormal (flushed to zero on CPU and TPU): there `(2**-64, 2**64 / scale)`. Both
  are exact when `scale` is a power of two; otherwise the reciprocal adds a rounding
  (up to 2 ulp on GPU, whose float32 division is not correctly rounded).
  """
  scale = jnp.asarray(scale, jnp.float32)
  pre = jnp.where(scale > 2.0**126, jnp.float32(2.0**-64), jnp.float32(1.0))
  return pre, 1 / (scale * pre)


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

    The product is computed in float32 (float64 for float64 leaves) and cast back, so
    a float16 loss stays float16. `None` and non-floating leaves pass through.
    """
    factor = self()
    return _tree.map_float_leaves(lambda x: _tree.multiply(x, factor), tree)

  def unscale_factors(self) -> tuple[jax.Array, ...]:
    """The float32 factors `unscale` multiplies by (see `reciprocal`); `()` for none."""
    return reciprocal(self())

  def unscale(self, tree: Any) -> Any:
    """Divides every floating leaf of `tree` by the loss scale, keeping its dtype.

    Multiplies by the reciprocal of the scale, as TensorFlow and PyTorch do: exact
    for every power-of-two scale (all that `DynamicLossScale` reaches with its
    default factors), within one more rounding otherwise, and correct for scales up
    to the largest float32. Computed in float32 (float64 for float64 leaves) and cast
    back to each leaf's dtype. `None` and non-floating leaves pass through.
    """
    factors = self.unscale_factors()
    return _tree.map_float_leaves(lambda x: _tree.multiply(x, *factors), tree)

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

  def adjust(self: _T, grads_finite: Any) -> tuple[_T, jax.Array]:
    """Like `update`, given the finiteness of the gradients as a boolean scalar.

    Raises:
      ValueError: if `grads_finite` is not a boolean scalar.
    """
    return self._adjust(_validation.flag("grads_finite", grads_finite))

  @abc.abstractmethod
  def _adjust(self: _T, finite: jax.Array) -> tuple[_T, jax.Array]:
    """`adjust` for a validated boolean scalar array."""

  def get_config(self) -> dict[str, Any]:
    """Returns the constructor arguments as a JSON-serialisable dict.

    As in TensorFlow, the config describes the initial loss scale: the current
    state (scale, counters) lives in checkpoints, not in the config.
    """
    return {name: getattr(self, name) for name in self._static_names}

  @classmethod
  def from_config(cls: type[_T], config: dict[str, Any]) -> _T:
    """Creates a loss scale from the dict returned by `get_config`.

    Raises:
      ValueError: for a key that is not a constructor argument of the config (the
        state is not part of a config), or for a bad value.
    """
    if not isinstance(config, dict):
      raise ValueError(f"`config` must be a dict, got {config!r}.")
    allowed = [name for name in inspect.signature(cls).parameters
               if name not in cls._state_names and name != "_"]
    unknown = sorted(set(config) - set(allowed))
    if unknown:
      raise ValueError(
          f"Unknown {cls.__name__} config keys {unknown}; a config holds only "
          f"{allowed} (the state is restored from checkpoints, not configs).")
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


@loss_scale_dataclass
class NoOpLossScale(LossScale):
  """A loss scale of 1 that always applies: the choice for bfloat16 (e.g. on TPU).

  `scale` and `unscale` return their argument unchanged, so wrapping an optimizer
  with it adds no work beyond the finiteness check.
  """

  def __call__(self) -> jax.Array:
    return jnp.ones([], jnp.float32)

  def scale(self, tree: Any) -> Any:
    return tree

  def unscale_factors(self) -> tuple[jax.Array, ...]:
    return ()

  def unscale(self, tree: Any) -> Any:
    return tree

  def _adjust(self, finite: jax.Array) -> tuple[NoOpLossScale, jax.Array]:
    del finite
    return self, jnp.array(True)


@loss_scale_dataclass
class FixedLossScale(LossScale):
  """A loss scale with a fixed value (TensorFlow's `FixedLossScale`).

  The scale never changes, and `update` always says to apply the gradients: a fixed
  scale cannot react to overflow. (Inside `loss_scaling`, non-finite steps are still
  skipped, so a NaN never reaches the parameters.)

  Args:
    loss_scale_value: the scale, a real number >= 1 that is finite in float32 (at
      most about 3.4e38). Too small a value lets float16 gradients underflow; too
      large a value causes inf or NaN.

  Raises:
    ValueError: if `loss_scale_value` is not a real number, is below 1, or is inf in
      float32.
  """

  loss_scale_value: float

  def __post_init__(self):
    value = _validation.scale("loss_scale_value", self.loss_scale_value, minimum=1.0)
    object.__setattr__(self, "loss_scale_value", value)

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.loss_scale_value, jnp.float32)

  def _adjust(self, finite: jax.Array) -> tuple[FixedLossScale, jax.Array]:
    del finite
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

  The scale is stored and applied in float32 and never becomes inf or NaN, nor 0
  unless `min_loss_scale=0` (no floor). Every argument is checked as the dtype that
  holds it: a value that is inf in float32, a factor that rounds to 1, a floor that
  rounds to 0, a count beyond int32 is refused here, with its name.

  Args:
    initial_loss_scale: the first scale; positive, within [min, max].
    increment_period: finite steps in a row before the scale grows (>= 1).
    multiplier: growth factor (> 1).
    backoff_factor: shrink factor in (0, 1); default: divide by `multiplier`.
    min_loss_scale: the floor: 0 (no floor, as in PyTorch) or a float32 normal.
    max_loss_scale: the cap; by default a growth whose result is not a finite
      float32 is refused (TensorFlow and PyTorch behaviour), so the scale stays a
      power of the multiplier.
    hysteresis: non-finite steps needed before a backoff (>= 1); DeepSpeed's
      `delayed_shift`, Megatron's `hysteresis`. Once spent, every further non-finite
      step backs off until a growth (or a finite step, see below) refills it.
    consecutive_hysteresis: refill the hysteresis on every finite step, so only
      non-finite steps in a row count (DeepSpeed's flag of that name).
    factor_precision: how the scale is multiplied by `multiplier` and
      `backoff_factor`. `"float32"` (TensorFlow, Keras, jmp, flax, Megatron): the
      factors are rounded to float32 and the product is a float32 product.
      `"float64"` (PyTorch's `GradScaler`): the float32 scale times the factor as a
      double, rounded to float32, exactly as PyTorch computes it; needs an explicit
      `backoff_factor`. The two agree for factors that are float32 numbers (2, 0.5).
    current_loss_scale, num_good_steps, hysteresis_left: the state (float32, int32,
      int32 arrays). Leave them out to start from the initial state.

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
  factor_precision: Literal["float32", "float64"] = "float32"
  current_loss_scale: jax.Array = state_field()
  num_good_steps: jax.Array = state_field()
  hysteresis_left: jax.Array = state_field()

  def __post_init__(self):
    checked = _check_dynamic_config(self)
    for name, value in checked.items():
      object.__setattr__(self, name, value)
    state = {"current_loss_scale": (checked["initial_loss_scale"], np.float32),
             "num_good_steps": (0, np.int32),
             "hysteresis_left": (checked["hysteresis"], np.int32)}
    for name, (initial, dtype) in state.items():
      value = getattr(self, name)
      object.__setattr__(self, name, _scalar(initial, dtype) if value is None
                         else _check_state(self, name, value, dtype))

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.current_loss_scale, jnp.float32)

  def _times(self, scale: jax.Array, factor: float) -> jax.Array:
    if self.factor_precision == "float64":
      return _rounding.times_double(scale, factor)
    return _rounding.flush_subnormals(scale * np.float32(factor))

  def _adjust(self, finite: jax.Array) -> tuple[DynamicLossScale, jax.Array]:
    scale = self()
    good = jnp.asarray(self.num_good_steps, jnp.int32)
    left = jnp.asarray(self.hysteresis_left, jnp.int32)

    grow = finite & (good + 1 >= self.increment_period)
    grown = self._times(scale, self.multiplier)
    if self.max_loss_scale is None:
      grown = jnp.where(jnp.isfinite(grown), grown, scale)
    else:
      grown = jnp.minimum(grown, np.float32(self.max_loss_scale))

    left_after_overflow = jnp.maximum(left - 1, 0)
    shrink = ~finite & (left_after_overflow == 0)
    if self.backoff_factor is None:
      shrunk = _rounding.divided_by(scale, self.multiplier)
    else:
      shrunk = self._times(scale, self.backoff_factor)
    shrunk = jnp.maximum(shrunk, np.float32(self.min_loss_scale))

    refill = grow | finite if self.consecutive_hysteresis else grow
    new = with_state(
        self,
        current_loss_scale=jnp.where(grow, grown, jnp.where(shrink, shrunk, scale)),
        num_good_steps=jnp.where(finite & ~grow, good + 1, 0).astype(jnp.int32),
        hysteresis_left=jnp.where(
            refill, self.hysteresis, jnp.where(finite, left, left_after_overflow)
        ).astype(jnp.int32),
    )
    return new, finite


def _check_dynamic_config(ls: DynamicLossScale) -> dict[str, Any]:
  """The validated hyperparameters of a `DynamicLossScale`, by name."""
  v = _validation
  precision = ls.factor_precision
  if precision not in ("float32", "float64"):
    raise ValueError(
        f"`factor_precision` must be 'float32' or 'float64', got {precision!r}.")
  checked = {
      "increment_period": v.integer("increment_period", ls.increment_period, 1),
      "multiplier": v.growth_factor("multiplier", ls.multiplier),
      "min_loss_scale": v.floor("min_loss_scale", ls.min_loss_scale),
      "hysteresis": v.integer("hysteresis", ls.hysteresis, 1),
      "consecutive_hysteresis": v.boolean("consecutive_hysteresis", ls.consecutive_hysteresis),
      "backoff_factor": None,
      "max_loss_scale": None,
      "factor_precision": precision,
  }
  if ls.backoff_factor is not None:
    backoff = checked["backoff_factor"] = v.shrink_factor("backoff_factor", ls.backoff_factor)
    if precision == "float64" and backoff > 1 - 2.0**-24:
      raise ValueError(
          f"`backoff_factor` must be at most 1 - 2**-24 with factor_precision='float64', "
          f"got {ls.backoff_factor!r}: some float32 scales times it round back to "
          "themselves, so the loss scale would not back off.")
  elif precision == "float64":
    raise ValueError(
        "factor_precision='float64' needs an explicit `backoff_factor` (PyTorch's "
        "GradScaler multiplies by its backoff_factor; there is no division by the "
        "multiplier).")
  minimum = checked["min_loss_scale"]
  if ls.max_loss_scale is not None:
    maximum = checked["max_loss_scale"] = v.scale("max_loss_scale", ls.max_loss_scale)
    if maximum < minimum:
      raise ValueError(
          f"`max_loss_scale` ({ls.max_loss_scale!r}) must be >= `min_loss_scale` "
          f"({ls.min_loss_scale!r}).")
  initial = checked["initial_loss_scale"] = v.scale("initial_loss_scale",
                                                    ls.initial_loss_scale)
  if initial < minimum:
    raise ValueError(f"`initial_loss_scale` must be >= `min_loss_scale` ({minimum!r}), got "
                     f"{ls.initial_loss_scale!r}.")
  if checked["max_loss_scale"] is not None and initial > checked["max_loss_scale"]:
    raise ValueError(f"`initial_loss_scale` must be <= `max_loss_scale` "
                     f"({checked['max_loss_scale']!r}), got {ls.initial_loss_scale!r}.")
  return checked


def _check_state(ls: DynamicLossScale, name: str, value: Any, dtype) -> Any:
  """A state field given to the constructor: checked (and typed) when it is concrete."""
  if name == "current_loss_scale":
    high = _validation.FLOAT32_MAX if ls.max_loss_scale is None else ls.max_loss_scale
    return check_state_values(name, value, dtype, ls.min_loss_scale, high)
  high = ls.increment_period - 1 if name == "num_good_steps" else ls.hysteresis
  return check_state_values(name, value, dtype, 0, high)


def check_state_values(name: str, value: Any, dtype, low: float, high: float) -> Any:
  """A state array given to a constructor, checked against `[low, high]` when concrete.

  Traced and abstract values (under `jit`, `jax.eval_shape`) pass unchecked. Integer
  state must hold whole numbers. Returns `value` in `dtype`.
  """
  values = _validation.concrete_values(value)
  if values is None:
    return value
  ok = np.isfinite(values) & (values >= low) & (values <= high)
  if np.issubdtype(dtype, np.integer):
    ok &= np.round(values) == values
    allowed = f"an integer in [{low}, {high}]"
  else:
    allowed = f"finite, within [{low!r}, {high!r}]"
  if not np.all(ok):
    raise ValueError(f"`{name}` must be {allowed}, got {_format(value)}.")
  if isinstance(value, jax.Array):
    return value.astype(dtype)
  return np.asarray(values, dtype)
