"""A drop-in replacement for DeepMind's jmp: `import jax_lossscale.jmp as jmp`.

The same names, signatures and meaning as jmp 0.0.4 (`DynamicLossScale`,
`StaticLossScale`, `NoOpLossScale`, `all_finite`, `select_tree`, `Policy`,
`get_policy`, ...), and the same pytree layout: a `DynamicLossScale` flattens to the
leaves `(loss_scale, counter)`, so a checkpoint written with jmp's classes restores
into these. Two of jmp's bugs are fixed:

* `min_loss_scale` survives `jit` and `tree_map`. jmp's hand-written unflatten forgot
  it, so after any `jit` the floor silently reset to 1. Here it is static data, like
  `period` and `factor`, and the registration enumerates every field.
* A `DynamicLossScale` holds its scale in float32 (a strongly typed JAX array). jmp
  keeps the dtype it is given, and a float16 scale cannot hold 2**16: it stops growing
  at 2**15, and its products overflow. A float16 or integer scale is converted to
  float32 (an integer one with jmp's warning); its products are float32 JAX arrays, as
  jmp's are once `adjust` has promoted its scale to its float32 `min_loss_scale`.

A `StaticLossScale` keeps its scale as given and returns jmp's products type for type
(Python floats, NumPy or JAX arrays, weak or strong types), and a concrete one passes
into `jit` as static data, a JAX array included. The casts of `Policy`, `cast_to_full`
and `cast_to_half` cast JAX and NumPy arrays only, as jmp's: NumPy scalars and Python
numbers pass through. `Policy` compares equal to jmp's with the same dtypes.

`all_finite` and `select_tree` are the library's: `all_finite` also catches the NaN
that XLA:CPU max-reductions drop, and handles float8 leaves; like jmp's, it answers per
device inside `pmap`/`shard_map`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any
from typing import TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale._policy import DTYPE_NAMES as dtype_to_names
from jax_lossscale._policy import Policy
from jax_lossscale._policy import cast_floating
from jax_lossscale._policy import get_policy
from jax_lossscale._policy import half_dtype

T = TypeVar("T")

__all__ = (
    "DynamicLossScale",
    "LossScale",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "dtype_to_names",
    "get_policy",
    "half_dtype",
    "select_tree",
)


class _NotABooleanScalar(ValueError, AssertionError):
  """A predicate that is not a boolean scalar.

  Also an `AssertionError`, as jmp's was (jmp asserts): code that catches it keeps working.
  """


def _boolean_scalar(value: Any, where: str, argument: str) -> jax.Array:
  """`value` as a boolean scalar array (traced or not); anything else is refused."""
  problem = _validation.not_a_flag(value)
  if problem is not None:  # in jmp's words, which code may match
    raise _NotABooleanScalar(f"{where} expected boolean scalar `{argument}` (such as "
                             f"jmp.all_finite(grads)), {problem}.")
  return jnp.asarray(value)


def _pytree(*leaves: str):
  """Registers a dataclass as jmp's pytree: `leaves` as children keyed by position, as
  jmp's are (so checkpoints name them alike), every other field static."""
  def register(cls):
    _trees.register_dataclass(cls, leaves, keyed=False)
    return cls
  return register


def _is_number(value: Any) -> bool:
  return isinstance(value, (jax.Array, np.ndarray, np.generic, int, float))


def _float32(value: Any) -> Any:
  """`value` as a float32 JAX array (traced or not), strongly typed as jmp's scale is once
  `adjust` has run (a weak one would let float16 stay). Objects that are not numbers pass
  through, as jmp lets them."""
  if isinstance(value, jax.Array):
    return (value if value.dtype == jnp.float32 and not value.weak_type else
            jax.lax.convert_element_type(value, jnp.float32))
  return jnp.asarray(value, jnp.float32) if _is_number(value) else value


def _warn_if_not_floating(value: Any, argument: str) -> None:
  """jmp's warning for a number that is not floating (it is converted all the same)."""
  if _is_number(value) and not jnp.issubdtype(jnp.result_type(value), jnp.floating):
    warnings.warn(f"Expected floating type for {argument}, got {jnp.result_type(value)}; "
                  "it is converted to float32.", stacklevel=4)


def _multiply(tree: T, factor: Any) -> T:
  """Every leaf times `factor`, as jmp multiplies: the leaf's type and `factor`'s decide
  the product's (a Python float times a Python number is a Python float, a NumPy array
  times a JAX array a JAX array, weak times weak stays weak)."""
  return jax.tree_util.tree_map(lambda x: x * factor, tree)


class _StaticValue:
  """A concrete scale as static pytree data: hashed and compared by its type, dtype, weak
  type, shape and bytes (a JAX or NumPy array is not hashable), keeping the value."""

  def __init__(self, value: Any):
    self.value = value
    if isinstance(value, (jax.Array, np.ndarray, np.generic)):
      array = np.asarray(value)
      self._key = (type(value).__name__, array.dtype.str, array.shape, array.tobytes(),
                   bool(getattr(value, "weak_type", False)))
    else:
      try:
        self._key = (type(value).__name__, hash(value), value)
      except TypeError:  # an object jmp lets through: static by identity
        self._key = (type(value).__name__, id(value))

  def __hash__(self) -> int:
    return hash(self._key)

  def __eq__(self, other: object) -> bool:
    return isinstance(other, _StaticValue) and self._key == other._key


def _register_static_scale(cls):
  """`cls`'s concrete `loss_scale` is static data (no leaves, as in jmp, so the object
  passes into a jitted function); a traced one is its one leaf."""
  def flatten(obj):
    if _jax_internals.is_tracer(obj.loss_scale):
      return (obj.loss_scale,), None
    return (), _StaticValue(obj.loss_scale)

  def unflatten(aux, children):
    obj = object.__new__(cls)
    object.__setattr__(obj, "loss_scale", children[0] if aux is None else aux.value)
    return obj

  jax.tree_util.register_pytree_node(cls, flatten, unflatten)
  return cls


@_pytree()
@dataclasses.dataclass(frozen=True)
class NoOpLossScale:
  """A loss scale of 1: `scale` and `unscale` return their argument."""

  @property
  def loss_scale(self) -> int:
    return 1

  def scale(self, tree: T) -> T:
    return tree

  def unscale(self, tree: T) -> T:
    return tree

  def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
    del grads_finite
    return self


@_register_static_scale
@dataclasses.dataclass(frozen=True)
class StaticLossScale:
  """Scales and unscales by a fixed constant, kept as given, as jmp keeps it.

  Products are jmp's, type for type: a float16 leaf times a Python number or a float16
  scale stays float16 (as a `lax.fori_loop` carrying it needs), a NumPy leaf times a JAX
  scale is a JAX array, a weak leaf times a Python number stays weak.

  Args:
    loss_scale: the constant. A concrete value is static (the object has no leaves, as
      in jmp, and can be passed to a jitted function, also a JAX array, which jmp's cannot);
      a traced one is a leaf.
  """

  loss_scale: jax.Array

  def scale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the scale, as jmp does."""
    return _multiply(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the reciprocal of the scale, as jmp does."""
    return _multiply(tree, 1 / self.loss_scale)

  def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
    del grads_finite
    return self


@_pytree("loss_scale", "counter")
@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """jmp's dynamic loss scale: grows after `period` finite steps, shrinks on overflow.

  Each `adjust(grads_finite)` returns the next loss scale. Finite gradients advance
  the counter; on the `period`-th finite step in a row the scale is multiplied by
  `factor` (unless that is inf) and the counter restarts. Non-finite gradients divide
  the scale by `factor`, never below `min_loss_scale`, and reset the counter.

  Example::

    loss_scale = jmp.DynamicLossScale(jnp.asarray(2.0**15))
    grads = loss_scale.unscale(jax.grad(lambda p: loss_scale.scale(loss_fn(p)))(params))
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    params = jmp.select_tree(grads_finite, optax.apply_updates(params, updates), params)

  Args:
    loss_scale: the current scale, held in float32 (a float16 or integer value is
      converted; an integer one with jmp's warning).
    counter: finite steps in a row since the last change (int32).
    period: finite steps in a row before the scale grows.
    factor: the growth and shrink factor.
    min_loss_scale: the floor, a concrete number held in float32 as static data, so it
      survives `jit` and `tree_map`.
  """

  loss_scale: jax.Array
  counter: jax.Array = dataclasses.field(default_factory=lambda: np.zeros([], np.int32))
  period: int = 2000
  factor: int = 2
  min_loss_scale: jax.Array = dataclasses.field(default_factory=lambda: np.float32(1))

  def __post_init__(self):
    _warn_if_not_floating(self.loss_scale, "loss_scale")
    _warn_if_not_floating(self.min_loss_scale, "min_loss_scale")
    if _jax_internals.is_tracer(self.min_loss_scale):
      raise ValueError(
          "`min_loss_scale` must be a concrete number (it is static, like `period` and "
          f"`factor`), got a traced value {self.min_loss_scale.aval}.")
    object.__setattr__(self, "loss_scale", _float32(self.loss_scale))
    object.__setattr__(self, "min_loss_scale", np.float32(np.asarray(self.min_loss_scale)))

  def scale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the scale, in float32 (float16 leaves widen,
    as with jmp's once `adjust` has promoted its scale to its float32 `min_loss_scale`:
    unscaled in float16, small gradients would be lost)."""
    return _multiply(tree, self.loss_scale)

  def unscale(self, tree: T) -> T:
    """Multiplies every leaf of `tree` by the reciprocal of the scale."""
    return _multiply(tree, 1 / self.loss_scale)

  def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
    """Returns the next loss scale, given whether this step's gradients are finite.

    Raises:
      ValueError: (also an `AssertionError`, as jmp's) if `grads_finite` is not a
        boolean scalar.
    """
    finite = _boolean_scalar(grads_finite, "DynamicLossScale.adjust", "grads_finite")
    scale = self.loss_scale
    grown = scale * self.factor
    grown = jnp.where((self.counter == self.period - 1) & jnp.isfinite(grown), grown, scale)
    shrunk = jnp.maximum(self.min_loss_scale, scale / self.factor)
    counter = jnp.where(finite, (self.counter + 1) % self.period, 0).astype(jnp.int32)
    return dataclasses.replace(
        self, loss_scale=jnp.where(finite, grown, shrunk), counter=counter)


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale


def all_finite(tree: Any) -> jax.Array:
  """Whether every floating value in `tree` is finite, as a boolean scalar array.

  `jax_lossscale.all_finite`'s check: NaN is caught even where an XLA:CPU max-reduction
  drops it, float8 types work, and `None` or non-floating leaves are ignored (an empty
  tree is finite). As jmp's, each device of a `pmap` or `shard_map` answers for its own
  leaves (pmean the gradients first, as jmp's examples do, or use
  `jax_lossscale.all_finite`, which agrees over the replicas in scope).
  """
  return _finite.finite(tree)


def select_tree(pred: jax.Array, a: T, b: T) -> T:
  """`a` where the boolean scalar `pred` is true, else `b`, leaf by leaf.

  Chooses with `jnp.where`, so a NaN in the tree not chosen never leaks into the result.
  Every leaf comes back a JAX array, as jmp's `lax.select` gives it (a Python number a
  weakly typed one).

  Raises:
    ValueError: (also an `AssertionError`, as jmp's) if `pred` is not a boolean scalar.
    TypeError: as jmp's `lax.select`, for two array leaves of different dtypes (a float16
      and a float32 parameter): choosing would silently widen the one chosen.
  """
  pred = _boolean_scalar(pred, "select_tree", "pred")

  def select(path, x, y):
    dtypes = [getattr(v, "dtype", None) for v in (x, y)]
    if None not in dtypes and dtypes[0] != dtypes[1]:
      raise TypeError(f"select_tree: `a` and `b` must have leaves of one dtype, got "
                      f"{dtypes[0]} and {dtypes[1]} at {jax.tree_util.keystr(path)}.")
    return jnp.where(pred, x, y)

  return jax.tree_util.tree_map_with_path(select, a, b)


def cast_to_full(tree: T) -> T:
  """Casts the floating array leaves of `tree` to float32; other leaves pass through."""
  return cast_floating(tree, jnp.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
  """Casts the floating array leaves of `tree` to `half_dtype()`; others pass through."""
  return cast_floating(tree, half_dtype())
