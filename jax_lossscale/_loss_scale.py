"""Loss scales: immutable pytree dataclasses whose `update` is a pure function.

The JAX rebuild of TensorFlow's `LossScale`, `FixedLossScale` and `DynamicLossScale`::

    scaled_loss = loss_scale.scale(loss)            # loss * loss_scale()
    grads = loss_scale.unscale(grad(scaled_loss))   # grads / loss_scale()
    loss_scale, should_apply = loss_scale.update(grads)

A loss scale's state (scale, counters) are array leaves and its hyperparameters static
fields kept in the tree definition. `loss_scale_dataclass` registers each class from its
dataclass fields, so no field can be forgotten when a loss scale crosses `jit`, `vmap`
or `jax.tree.map` (jmp's hand-written flatten forgot its minimum scale).
"""

from __future__ import annotations

import abc
import dataclasses
import inspect
import json
from collections.abc import Callable
from typing import Any
from typing import ClassVar
from typing import Literal
from typing import NamedTuple
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import _numerics
from jax_lossscale import _trees
from jax_lossscale import _validation

_T = TypeVar("_T", bound="LossScale")

# Every loss-scale class by its `qualified_name`, for `deserialize`. A class defined again
# (a notebook cell run twice) replaces the entry of the class it redefines.
REGISTRY: dict[str, type[LossScale]] = {}

# What else must know of every loss-scale class (`jax_lossscale.flax`'s registration with
# flax's serialization), called for each class as it is defined.
_ON_DEFINE: list[Callable[[type[LossScale]], None]] = []

_PACKAGE = "jax_lossscale"


def qualified_name(cls: type) -> str:
  """The name a loss-scale class is known by: `module.qualname`, and the package's own
  classes by their public name (`jax_lossscale.DynamicLossScale`, wherever they are
  defined), so that a user class named like one of them is another class."""
  module = cls.__module__
  if module == _PACKAGE or module.startswith(f"{_PACKAGE}._"):
    module = _PACKAGE
  return f"{module}.{cls.__qualname__}"


def for_each_class(callback: Callable[[type[LossScale]], None]) -> None:
  """Calls `callback` with every loss-scale class defined so far, and with every class
  defined from now on."""
  _ON_DEFINE.append(callback)
  for cls in list(REGISTRY.values()):
    callback(cls)


def state_field() -> Any:
  """Declares a field of a `loss_scale_dataclass` as state: an array, a pytree leaf.

  The field is keyword-only and defaults to None, for `__post_init__` to fill in with the
  initial state; given, it is the state to start from (a restored checkpoint's).
  """
  return dataclasses.field(default=None, kw_only=True, metadata={"state": True})


class StateSpec(NamedTuple):
  """What a state field holds: its `initial` value (which also gives its shape), its
  `dtype`, and the inclusive range `[low, high]` a given (restored) value must lie in."""

  initial: Any
  dtype: Any
  low: float
  high: float


def set_fields(loss_scale: Any, checked: dict[str, Any], state: dict[str, StateSpec]) -> None:
  """`__post_init__`'s work: sets the `checked` configuration, then each state field, to
  its spec's `initial` value when not given, else to the given value checked against
  the spec."""
  for name, value in checked.items():
    object.__setattr__(loss_scale, name, value)
  for name, spec in state.items():
    value = getattr(loss_scale, name)
    # NumPy, not jax: building a loss scale must not initialise a JAX backend.
    if value is None:
      value = np.asarray(spec.initial, spec.dtype)
    else:
      value = _validation.state_values(name, value, spec.dtype, spec.low, spec.high,
                                       np.shape(spec.initial))
    object.__setattr__(loss_scale, name, value)


def loss_scale_dataclass(cls: type[_T]) -> type[_T]:
  """Makes the `LossScale` subclass `cls` a frozen dataclass and a pytree.

  Fields declared with `state_field()` are the leaves; every other field is static and
  lives in the tree definition, read from the dataclass so that none can be forgotten.
  Unflattening does not call the constructor (JAX puts tracers, None or sentinels in
  the leaves). The class is also known to `deserialize` and to `jax.export` serialization
  by its qualified name (`module.QualName`), and to `flax.serialization` once
  `jax_lossscale.flax` is imported. Defining a class again under the same name (a
  notebook cell run twice) replaces the earlier one in each.
  """
  cls = dataclasses.dataclass(frozen=True, eq=False, repr=False)(cls)
  cls._state_names = tuple(f.name for f in dataclasses.fields(cls) if f.metadata.get("state"))
  cls._static_names = _trees.register_dataclass(cls, cls._state_names)
  name = qualified_name(cls)
  _jax_internals.register_export_serialization(
      cls, name, serialize_auxdata=lambda static: json.dumps(list(static)).encode(),
      deserialize_auxdata=lambda data: tuple(json.loads(data)))
  REGISTRY[name] = cls
  for callback in _ON_DEFINE:
    callback(cls)
  return cls


def with_state(loss_scale: _T, **state: Any) -> _T:
  """`loss_scale` with new state leaves: `dataclasses.replace` without re-validation, for
  state computed from the previous state (never pulled back to the host to be checked)."""
  leaves = [state.pop(name, getattr(loss_scale, name)) for name in loss_scale._state_names]
  assert not state, f"unknown state fields {sorted(state)}"
  return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(loss_scale), leaves)


def _format(value: Any) -> str:
  if _jax_internals.is_tracer(value):
    return str(value.aval)
  if _trees.is_array(value):
    value = np.asarray(value)
    return repr(value.item()) if value.ndim == 0 else f"{value.dtype}{list(value.shape)}"
  return repr(value)


class LossScale(abc.ABC):
  """Base class of every loss scale (TensorFlow's `LossScale`).

  Calling a loss scale returns the current scale as a float32 scalar. `scale` multiplies
  the loss by it before differentiation so that float16 gradients do not underflow,
  `unscale` divides the gradients afterwards, and `update` decides from the unscaled
  gradients whether the step should be applied and what the next scale is. Loss scales
  are immutable: `update` returns a new one.

  A loss scale of your own is a subclass decorated with `loss_scale_dataclass`: its
  constructor arguments are fields (static, kept in the tree definition), its state
  arrays fields declared with `state_field()` (the pytree's leaves, filled in by
  `__post_init__` when not given). It implements:

  * `__call__()`: the current scale, a float32 scalar array.
  * `adjust(grads_finite, measured=None)`: the loss scale after a step.

  and may override:

  * `measures` (class attribute, default False): True to be given `measured`, the
    largest magnitude of the step's scaled gradients (and of its probed activation
    gradients); a measuring scale also adjusts on every applied micro-batch of an
    `optax.MultiSteps`, where others adjust only when the optimizer steps.
  * `should_apply(grads_finite)`: `update`'s verdict (default: always apply, TensorFlow's
    rule for a fixed scale). `loss_scaling` skips non-finite steps whatever it says.
  * `get_config()`: the constructor arguments (default: the static fields).

  A `loss_scaling` step calls, in order: `get_config` (in Python: the state must come
  from this transformation), `__call__` (the scale the gradients were computed with,
  which it divides them by), then `adjust` once, with `grads_finite` a bool scalar
  array and `measured` a float32 scalar array (None unless `measures`), both already
  agreed across replicas (one `psum`, one `pmax`). Its result becomes the state's loss
  scale after an overflow and after an applied step; after a step skipped for a
  non-finite `loss=` or for non-finite updates of finite gradients, and after a
  micro-batch only accumulated, the loss scale is kept as it was. So `adjust` must be
  pure and traceable (it runs under `jit`, `vmap` and `lax.cond`: no Python branching on
  array values, no host round trip, no collective, nothing that differs between devices,
  so that replicas given the same agreed inputs keep the same state), and must return a
  loss scale of the same class and configuration whose state arrays keep their shapes and
  dtypes (`dataclasses.replace(self, ...)` with `jnp` values does). `update`, standalone,
  calls `adjust` and `should_apply` the same way.

  Example::

    @jls.loss_scale_dataclass
    class HalvingLossScale(jls.LossScale):
      initial_loss_scale: float = 2.0**15
      current: jax.Array = jls.state_field()

      def __post_init__(self):
        if self.current is None:
          object.__setattr__(self, "current", np.float32(self.initial_loss_scale))

      def __call__(self):
        return jnp.asarray(self.current, jnp.float32)

      def adjust(self, grads_finite, measured=None):
        halved = jnp.maximum(self() / 2, 1.0)
        return dataclasses.replace(self, current=jnp.where(grads_finite, self(), halved))

  The guide's page "A loss scale of your own" trains one under `loss_scaling`.
  """

  _state_names: ClassVar[tuple[str, ...]] = ()
  _static_names: ClassVar[tuple[str, ...]] = ()
  measures: ClassVar[bool] = False

  @abc.abstractmethod
  def __call__(self) -> jax.Array:
    """Returns the current loss scale as a float32 scalar array."""

  def scale(self, tree: Any) -> Any:
    """Multiplies every floating leaf of `tree` (Python floats included) by the scale.

    Computed in float32 (float64 for float64 leaves) and cast back to each leaf's dtype,
    so a float16 loss stays float16. `None` and non-floating leaves pass through.
    """
    return _trees.rescale_floats(tree, self._scaling())

  def unscale(self, tree: Any) -> Any:
    """Divides every floating leaf of `tree` (Python floats included) by the scale.

    Multiplies by the reciprocal, as TensorFlow and PyTorch do: exact for every power of
    two (all that `DynamicLossScale` reaches with its default factors), one more rounding
    otherwise (a float32 reciprocal, also for float64 leaves), and right for scales up to
    the largest float32. Computed in float32 (float64 for float64 leaves) and cast back.
    Other leaves pass through.
    """
    return _trees.rescale_floats(tree, self._unscaling())

  def update(self: _T, grads: Any, axis_name: _finite.AxisName = None) -> tuple[_T, jax.Array]:
    """Updates the loss scale from one step's unscaled gradients (pure, jittable).

    Args:
      grads: the gradients, already divided by the loss scale. `None` leaves and
        non-floating leaves are ignored.
      axis_name: the mapped axis name(s) over which the finiteness of `grads` is
        agreed, `()` for none; by default as `loss_scaling`'s.

    Returns:
      `(new_loss_scale, should_apply)`, where `should_apply` is a boolean scalar array:
      False when the gradients must not be applied this step.
    """
    largest = _finite.largest_magnitudes(grads)
    finite = _finite.agree([_finite.finite_after(largest)], axis_name)[0]
    measured = None
    if self.measures:  # the scaled gradients' largest magnitude, as a step measures it
      measured = _finite.agree_max(_finite.largest_of(largest), axis_name) * self()
    return self.adjust(finite, measured), self.should_apply(finite)

  def should_apply(self, grads_finite: jax.Array) -> jax.Array:
    """Whether `update` says to apply a step whose gradients were `grads_finite`.

    Args:
      grads_finite: bool scalar array.

    Returns:
      A bool scalar array; by default True (TensorFlow: a fixed scale always applies).
      `loss_scaling` never applies non-finite gradients, whatever this returns.
    """
    return jnp.ones_like(_validation.flag("grads_finite", grads_finite))

  def _scaling(self) -> _numerics.Rescale:
    return _numerics.Rescale((self(),))

  def _unscaling(self) -> _numerics.Rescale:
    return _numerics.Rescale.reciprocal(self())

  @abc.abstractmethod
  def adjust(self: _T, grads_finite: jax.Array, measured: jax.Array | None = None) -> _T:
    """Returns the loss scale after a step (pure, traceable; jmp's `adjust`).

    Args:
      grads_finite: bool scalar array: whether the step's gradients were finite once
        unscaled (agreed across replicas inside `loss_scaling`).
      measured: float32 scalar array, the largest magnitude of the step's scaled
        gradients (and probed activation gradients), for a class whose `measures` is
        True; else None.

    Returns:
      A loss scale of the same class and configuration, its state arrays of the same
      shapes and dtypes.
    """

  def get_config(self) -> dict[str, Any]:
    """The constructor arguments as a JSON-serialisable dict (the initial scale: the
    current state lives in checkpoints, not in the config, as in TensorFlow)."""
    return {name: getattr(self, name) for name in self._static_names}

  @classmethod
  def from_config(cls: type[_T], config: dict[str, Any]) -> _T:
    """Creates a loss scale from the dict returned by `get_config`.

    Raises:
      ValueError: for a key that is not a constructor argument, or a bad value.
    """
    allowed = [name for name in inspect.signature(cls).parameters
               if name not in cls._state_names and name != "_"]
    _validation.config_keys(cls, config, allowed)
    return cls(**config)

  def __eq__(self, other: object) -> bool:
    if type(self) is not type(other):
      return NotImplemented
    return self.get_config() == other.get_config() and all(
        np.array_equal(np.asarray(getattr(self, n)), np.asarray(getattr(other, n)))
        for n in self._state_names)

  __hash__ = None  # Array state makes loss scales unhashable, like arrays.

  def __repr__(self) -> str:
    parts = [f"{n}={_format(getattr(self, n))}" for n in self._static_names + self._state_names]
    return f"{type(self).__name__}({', '.join(parts)})"


@loss_scale_dataclass
class NoOpLossScale(LossScale):
  """A loss scale of 1: the choice for bfloat16 (e.g. on TPU), which needs no scaling.

  `scale` and `unscale` return their argument unchanged, and `update` always says to
  apply (TensorFlow's rule for a fixed scale). Inside `loss_scaling` a step whose
  gradients (or `loss=`) are not finite is still skipped, for one read of the gradients:
  no NaN reaches the parameters.
  """

  def __call__(self) -> jax.Array:
    return jnp.ones([], jnp.float32)

  def _scaling(self) -> _numerics.Rescale:
    return _numerics.Rescale()

  def _unscaling(self) -> _numerics.Rescale:
    return _numerics.Rescale()

  def adjust(self, grads_finite: jax.Array, measured: Any = None) -> NoOpLossScale:
    _validation.flag("grads_finite", grads_finite)
    return self


@loss_scale_dataclass
class FixedLossScale(LossScale):
  """A loss scale with a fixed value (TensorFlow's `FixedLossScale`).

  The scale never changes and `update` always says to apply: a fixed scale cannot react
  to overflow. (Inside `loss_scaling`, non-finite steps are still skipped.)

  Args:
    loss_scale_value: the scale, a real number >= 1, finite in float32 (at most about
      3.4e38). Too small a value lets float16 gradients underflow; too large a value
      overflows them.

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

  def adjust(self: _T, grads_finite: jax.Array, measured: Any = None) -> _T:
    _validation.flag("grads_finite", grads_finite)
    return self


@loss_scale_dataclass
class DynamicLossScale(LossScale):
  """A loss scale that backs off on overflow and grows after a run of finite steps.

  With the defaults this is TensorFlow's `DynamicLossScale` step for step. Each update:

  * finite gradients: the good-step counter grows by one; when it reaches
    `increment_period`, the scale is multiplied by `multiplier` (capped at
    `max_loss_scale`), the counter resets and the hysteresis is refilled (with
    `consecutive_hysteresis=True`, on every finite step).
  * non-finite gradients: the step is not applied, the counter resets and one unit of
    hysteresis is used; once none is left, the scale becomes
    `max(scale * backoff_factor, min_loss_scale)` (TensorFlow's `scale / multiplier`
    when `backoff_factor` is not given).

  The scale is held in float32 and never becomes inf or NaN, nor 0 unless
  `min_loss_scale=0`. Every argument is checked as the dtype that holds it.

  Args:
    initial_loss_scale: the first scale; positive, within [min, max].
    increment_period: finite steps in a row before the scale grows (>= 1).
    multiplier: growth factor (> 1).
    backoff_factor: shrink factor in (0, 1); default: divide by `multiplier`.
    min_loss_scale: the floor: 0 (no floor, as in PyTorch) or a float32 normal.
    max_loss_scale: the cap; by default a growth whose result is not a finite float32
      is refused (TensorFlow and PyTorch), so the scale stays a power of the multiplier.
    hysteresis: non-finite steps needed before a backoff (>= 1); DeepSpeed's
      `delayed_shift`, Megatron's `hysteresis`. Once spent, every further non-finite
      step backs off until a growth (or a finite step, see below) refills it.
    consecutive_hysteresis: refill the hysteresis on every finite step, so only
      non-finite steps in a row count (DeepSpeed's flag of that name).
    factor_precision: `"float32"` (TensorFlow, Keras, jmp, flax, Megatron): the scale
      times the factor rounded to float32 is a float32 product. `"float64"` (PyTorch's
      `GradScaler`): the float32 scale times the factor as a double, rounded to float32;
      needs an explicit `backoff_factor`. The two agree for factors such as 2 and 0.5.
    current_loss_scale, num_good_steps, hysteresis_left: the state (float32, int32,
      int32 scalars); leave them out to start from the initial state.

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
    c = _validation.dynamic_config({n: getattr(self, n) for n in self._static_names})
    high = _numerics.FLOAT32_MAX if c["max_loss_scale"] is None else c["max_loss_scale"]
    set_fields(self, c, {
        "current_loss_scale": StateSpec(c["initial_loss_scale"], np.float32,
                                        low=c["min_loss_scale"], high=high),
        "num_good_steps": StateSpec(0, np.int32, low=0, high=c["increment_period"] - 1),
        "hysteresis_left": StateSpec(c["hysteresis"], np.int32, low=0, high=c["hysteresis"]),
    })

  def __call__(self) -> jax.Array:
    return jnp.asarray(self.current_loss_scale, jnp.float32)

  def should_apply(self, grads_finite: jax.Array) -> jax.Array:
    return _validation.flag("grads_finite", grads_finite)

  def _times(self, scale: jax.Array, factor: float) -> jax.Array:
    if self.factor_precision == "float64":
      return _numerics.times_double(scale, factor)
    return _numerics.flush_subnormals(scale * np.float32(factor))

  def adjust(self, grads_finite: jax.Array, measured: Any = None) -> DynamicLossScale:
    finite = _validation.flag("grads_finite", grads_finite)  # a Python bool's `~` is an int
    # Within this configuration's limits, also for a state restored unchecked (orbax).
    high = np.float32(np.inf if self.max_loss_scale is None else self.max_loss_scale)
    scale = jnp.clip(self(), np.float32(self.min_loss_scale), high)
    good = jnp.asarray(self.num_good_steps, jnp.int32)
    left = jnp.minimum(jnp.asarray(self.hysteresis_left, jnp.int32), self.hysteresis)
    grow = finite & (good + 1 >= self.increment_period)
    grown = self._times(scale, self.multiplier)  # capped, or kept if it overflows float32
    grown = (_numerics.grow(scale, grown) if self.max_loss_scale is None
             else jnp.minimum(grown, high))
    left_after_overflow = jnp.maximum(left - 1, 0)
    shrink = ~finite & (left_after_overflow == 0)
    if self.backoff_factor is None:
      shrunk = _numerics.divided_by(scale, self.multiplier)
    else:
      shrunk = self._times(scale, self.backoff_factor)
    shrunk = jnp.maximum(shrunk, np.float32(self.min_loss_scale))
    refill = grow | finite if self.consecutive_hysteresis else grow
    return with_state(
        self,
        current_loss_scale=jnp.where(grow, grown, jnp.where(shrink, shrunk, scale)),
        num_good_steps=jnp.where(finite & ~grow, good + 1, 0).astype(jnp.int32),
        hysteresis_left=jnp.where(
            refill, self.hysteresis, jnp.where(finite, left, left_after_overflow)
        ).astype(jnp.int32),
    )
