"""float8 matmuls with current scaling, for `autocast(fun, fp8=recipe)`.

A float8 matmul scales each operand into its format's range, casts it to float8, multiplies
the float8 operands with a float32 result (`dot_general(..., preferred_element_type=
float32)`, which XLA:GPU runs as a cuBLASLt float8 GEMM on Hopper) and divides the scales
out of the product. Scales are computed from the tensors at every call ("current"
scaling, as torchao and Transformer Engine's `Float8CurrentScaling` do): `finfo(format).max
/ amax`, so nothing is kept between steps and one overflowed step cannot spoil the next.

The backward pass runs both of its matmuls in float8 too, with the incoming gradient in
the recipe's `grad_format`, each operand scaled again along that matmul's own rows.

Convolutions (`conv_general_dilated`, by the recipe's opt-in `convolutions`) run the same
way: the forward convolution and both backward ones on scaled float8 operands with a
float32 result. JAX's convolution takes operands of one dtype only, so both operands of a
convolution share one format: `lhs_format` forward, `grad_format` backward (as JAX's own
transpose rules cast the kernel to the incoming gradient's dtype).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_lossscale import _jax_internals as internals

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
GRANULARITIES = ("tensor", "row")
_F32 = np.dtype(jnp.float32)


class Float8Matmul(NamedTuple):
  """A matmul (or convolution) that a recipe's `filter_fn` is asked about.

  Attributes:
    name_scope: its name scope (a flax linen module's path, a `jax.named_scope`, those
      around a loop, checkpoint or jitted function holding it included), "" if none.
    lhs_shape: its left operand's shape (a convolution's input; equinox's weight, which
      it multiplies by the input as `weight @ x`).
    rhs_shape: its right operand's shape (a flax dense layer's kernel, a convolution's
      kernel).
  """
  name_scope: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Float8Recipe:
  """How `autocast(fun, fp8=recipe)` runs a matmul in float8.

  The named recipes are `Float8Recipe.from_name("tensorwise")` (torchao's tensorwise,
  Transformer Engine's current scaling with its HYBRID formats) and
  `Float8Recipe.from_name("rowwise")` (torchao's rowwise); change one with keyword
  arguments, e.g. `Float8Recipe.from_name("tensorwise", filter_fn=...)`.

  Attributes:
    granularity: `"tensor"`, one scale per operand; or `"row"`, one scale per row of each
      operand along its non-contracting dimensions, so that one outlier row does not
      flush the other rows to zero.
    lhs_format: the float8 format of the forward matmul's left operand (activations).
    rhs_format: the float8 format of its right operand (weights).
    grad_format: the float8 format of the incoming gradient in both backward matmuls.
    power_of_two_scales: whether scales are rounded down to powers of two (applying and
      removing them is then exact).
    min_size: the smallest size of a matmul's rows, columns and contraction (each also a
      multiple of 16, as cuBLASLt's float8 GEMM requires) for it to run in float8; on a
      GPU, matmuls below a few thousand are faster in bfloat16 (torchao measures 0.8x at
      1024x2048x1024): raise it there.
    filter_fn: `None`, or a function of a `Float8Matmul` that returns whether that
      matmul runs in float8 (torchao's `module_filter_fn`), e.g. to keep the first and
      last layers in `compute_dtype`.
    convolutions: whether convolutions (`lax.conv_general_dilated`: flax's and equinox's
      `Conv`) run in float8 too (off by default), forward and both backward convolutions,
      where their input and output features are multiples of 16, at least `min_size`,
      and not grouped (`feature_group_count` and `batch_group_count` 1). Both operands
      of a convolution take one format (JAX's convolution requires it): `lhs_format`
      forward, `grad_format` backward; per row, a convolution's scales are per batch
      element of its input and per output feature of its kernel.
  """
  granularity: str = "tensor"
  lhs_format: Any = E4M3
  rhs_format: Any = E4M3
  grad_format: Any = E5M2
  power_of_two_scales: bool = False
  min_size: int = 16
  filter_fn: Callable[[Float8Matmul], bool] | None = None
  convolutions: bool = False

  def __post_init__(self):
    if self.granularity not in GRANULARITIES:
      raise ValueError(f"`granularity` must be one of {GRANULARITIES}, got {self.granularity!r}.")
    for argument in ("lhs_format", "rhs_format", "grad_format"):
      object.__setattr__(self, argument, _float8_format(getattr(self, argument), argument))
    if (not isinstance(self.min_size, numbers.Integral) or isinstance(self.min_size, bool)
        or self.min_size < 1):
      raise ValueError(f"`min_size` must be a positive int, got {self.min_size!r}.")
    object.__setattr__(self, "min_size", int(self.min_size))  # a NumPy integer as an int
    if self.filter_fn is not None and not callable(self.filter_fn):
      raise TypeError(f"`filter_fn` must be None or a function of a Float8Matmul, got "
                      f"{self.filter_fn!r}.")
    if not isinstance(self.power_of_two_scales, bool):
      raise TypeError(f"`power_of_two_scales` must be True or False, got "
                      f"{self.power_of_two_scales!r}.")
    if not isinstance(self.convolutions, bool):
      raise TypeError(f"`convolutions` must be True or False, got {self.convolutions!r}.")

  @classmethod
  def from_name(cls, name: str, **changes: Any) -> Float8Recipe:
    """The recipe named `name` (`"tensorwise"` or `"rowwise"`), with `changes` to its fields."""
    if name not in RECIPES:
      raise ValueError(f"`name` must be one of {tuple(RECIPES)}, got {name!r}.")
    return dataclasses.replace(RECIPES[name], **changes)

  def runs(self, matmul: Float8Matmul, dimension_numbers: Any) -> bool:
    """Whether `matmul` runs in float8 under this recipe."""
    return self.fits(matmul, dimension_numbers) and self._accepts(matmul)

  def fits(self, matmul: Float8Matmul, dimension_numbers: Any) -> bool:
    """Whether `matmul`'s rows, columns and contraction are sizes float8 takes."""
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
    rows = _size(matmul.lhs_shape, lhs_contract, lhs_batch)
    contraction = math.prod(matmul.lhs_shape[axis] for axis in lhs_contract)
    columns = _size(matmul.rhs_shape, rhs_contract, rhs_batch)
    return self._fit((rows, contraction, columns))

  def runs_convolution(self, matmul: Float8Matmul, convolution: Convolution) -> bool:
    """Whether the convolution `matmul` runs in float8 under this recipe (its input and
    output features counted)."""
    lhs_spec, rhs_spec, _ = convolution.dimension_numbers
    features = (matmul.lhs_shape[lhs_spec[1]], matmul.rhs_shape[rhs_spec[0]])
    return self.convolutions and self._fit(features) and self._accepts(matmul)

  def _fit(self, sizes: tuple[int, ...]) -> bool:
    return not any(size % 16 or size < self.min_size for size in sizes)

  def _accepts(self, matmul: Float8Matmul) -> bool:
    return self.filter_fn is None or bool(self.filter_fn(matmul))


def _size(shape: tuple[int, ...], *excluded: Any) -> int:
  """The product of `shape`'s dimensions outside `excluded` (sequences of axes)."""
  skip = {axis for axes in excluded for axis in axes}
  return math.prod(n for axis, n in enumerate(shape) if axis not in skip)


def _others(ndim: int, *axes: Any) -> list[int]:
  """The axes of an `ndim`-dimensional array that are in none of `axes`, in order."""
  taken = {axis for group in axes for axis in group}
  return [axis for axis in range(ndim) if axis not in taken]


def _float8_format(value: Any, argument: str) -> np.dtype:
  try:
    dtype = np.dtype(value)
  except TypeError:
    dtype = None
  # Signed 8-bit formats with a mantissa only: float4_e2m1fn is stored in a byte too (XLA
  # refuses its casts), float8_e8m0fnu (an MX scale format) has no sign, no zero.
  if (dtype is None or not jnp.issubdtype(dtype, jnp.floating) or dtype.itemsize != 1
      or jnp.finfo(dtype).bits != 8 or not float(jnp.finfo(dtype).min) < 0):
    raise ValueError(f"`{argument}` must be a signed float8 format (jnp.float8_e4m3fn, "
                     f"jnp.float8_e5m2, ...), got {value!r}.")
  return dtype


RECIPES = {
    "tensorwise": Float8Recipe(),
    "rowwise": Float8Recipe("row", grad_format=E4M3, power_of_two_scales=True),
}


def as_recipe(fp8: Any, compute_dtype: np.dtype) -> Any:
  """`autocast`'s `fp8` argument as a recipe (`None` stays `None`), checked with its
  `compute_dtype`."""
  if np.dtype(compute_dtype).itemsize == 1:
    allowed = ("float16, bfloat16, float32 or float64" if fp8 is None
               else "float16, bfloat16 or float32")
    raise ValueError(
        f"`compute_dtype` must not be a float of 8 bits or fewer ({allowed}), got "
        f"{compute_dtype!r}: an unscaled float8 matmul flushes small values to zero; pass "
        "`compute_dtype=jnp.bfloat16, fp8=\"tensorwise\"` for scaled float8 matmuls.")
  if fp8 is None or isinstance(fp8, Measurement):  # a readiness report's: any dtype
    return fp8
  if np.dtype(compute_dtype).itemsize > 4:
    raise ValueError(
        f"`compute_dtype` must be float16, bfloat16 or float32 with `fp8`, got "
        f"{compute_dtype!r}: the matmuls float8 does not take run in `compute_dtype`.")
  if isinstance(fp8, Float8Recipe):
    return fp8
  if isinstance(fp8, str) and fp8 not in RECIPES:
    raise ValueError(f"`fp8` must be one of {tuple(RECIPES)} or a Float8Recipe, got {fp8!r}.")
  if isinstance(fp8, str):
    return Float8Recipe.from_name(fp8)
  raise TypeError(f"`fp8` must be None, one of {tuple(RECIPES)} or a Float8Recipe, got "
                  f"{fp8!r}.")


def matmul(recipe: Any, op: Any, operands: list, compute_dtype: np.dtype,
           result_dtype: np.dtype, refused: list | None = None) -> jax.Array | None:
  """The matmul `op` (an `Operation` of `autocast`'s interpreter) on `operands` in float8
  under `recipe`, its float32 product returned in `result_dtype` (`compute_dtype`, or a
  wider `preferred_element_type` the program asked for); None where the recipe does not
  take it (integer operands, a size it excludes, a convolution unless it opted in: it
  runs in `compute_dtype`). A `dot_general` the recipe refuses for its sizes is appended
  to `refused` as a `Float8Matmul`."""
  if not all(_is_floating(x) for x in operands):
    return None
  lhs, rhs = operands
  if not (lhs.size and rhs.size):  # an empty batch: nothing to scale, nothing to measure
    return None
  described = Float8Matmul(op.name_scope, tuple(lhs.shape), tuple(rhs.shape))
  measured = recipe.recipes[0] if isinstance(recipe, Measurement) else recipe
  if op.name == "conv_general_dilated":
    if (op.param("feature_group_count") != 1 or op.param("batch_group_count") != 1
        or not measured.convolutions):  # grouped, or not opted in: read no further
      return None
    convolution = Convolution.of(op)
    if not measured.runs_convolution(described, convolution):
      return None
    float8 = lambda lhs, rhs: _float8_conv(lhs, rhs, convolution, recipe, compute_dtype)
    return _run(recipe, op, described, lhs, rhs, convolution, float8, compute_dtype,
                result_dtype)
  if op.name != "dot_general":
    return None
  dimension_numbers = jax.tree.map(int, op.param("dimension_numbers"))
  if not measured.fits(described, dimension_numbers):
    if refused is not None:
      refused.append(described)
    return None
  if not measured._accepts(described):
    return None
  out_sharding = op.param("out_sharding")  # the program's own, where it named one
  float8 = lambda lhs, rhs: _float8_dot(lhs, rhs, dimension_numbers, recipe, compute_dtype,
                                        out_sharding)
  return _run(recipe, op, described, lhs, rhs, Dot(dimension_numbers, out_sharding), float8,
              compute_dtype, result_dtype)


def _run(recipe: Any, op: Any, described: Float8Matmul, lhs: jax.Array, rhs: jax.Array,
         product: Any, float8: Callable, compute_dtype: np.dtype,
         result_dtype: np.dtype) -> jax.Array:
  """`float8(lhs, rhs)` (a float32 product) on the operands in `compute_dtype`, in `op`'s
  scope, returned in `result_dtype` (the incoming gradient arrives in float32: the same
  values); measured instead for a readiness report (`product`: a `Dot` or `Convolution`)."""
  lhs, rhs = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
  with op.in_scope():
    if isinstance(recipe, Measurement):
      out = _measured(lhs, rhs, product, recipe, recipe.add(described))
    else:
      out = float8(lhs, rhs)
    return out.astype(result_dtype)


def _is_floating(x: Any) -> bool:
  dtype = getattr(x, "dtype", None)
  return isinstance(dtype, np.dtype) and bool(jnp.issubdtype(dtype, jnp.floating))


# Scaling.


def scale(amax: jax.Array, fmt: np.dtype, power_of_two: bool) -> tuple[jax.Array, jax.Array]:
  """`(factor, inverse)`: the float32 factor that takes a tensor of largest magnitude `amax`
  just inside `fmt`'s largest value (by 2**-20, so that rounding never takes it past), and
  what divides it out of a product (exactly for a power of two, within an ulp otherwise);
  1 and 1 where `amax` is 0 or not finite (what is scaled stays non-finite, and the next
  call computes its scale afresh). Below about 5e-36, where the inverse would not be a
  normal float32, `2**126` and `2**-126`: the tensor is scaled as far as float32 allows,
  not up to the format's largest value (as the powers of two are).

  The inverse is computed from `amax`, not as `1 / factor`: XLA:CPU computes a divide
  read by two kernels as a kernel of its own, one per scale of every matmul, each compiled
  apart, and a float8 step's compile time follows its number of kernels
  (benchmarks/RESULTS.md).
  """
  largest = np.float32(float(jnp.finfo(fmt).max) * (1 - 2**-20))
  if power_of_two:
    return _power_of_two_scale(amax, largest)
  one = lax.full_like(amax, 1)
  inverse = lax.mul(amax, np.float32(1) / largest)
  normal = lax.ge(inverse, np.float32(2.0**-126))  # False for NaN
  usable = lax.bitwise_and(normal, lax.lt(inverse, np.float32(np.inf)))
  # Positive and finite by its bits: some XLA:CPU versions compare a subnormal as zero.
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  tiny = lax.bitwise_and(lax.bitwise_not(normal), lax.bitwise_and(
      lax.gt(bits, np.int32(0)), lax.lt(bits, np.int32(0x7F800000))))
  factor = lax.select(tiny, lax.full_like(amax, 2.0**126), one)
  smallest = lax.select(tiny, lax.full_like(amax, 2.0**-126), one)
  return (lax.select(usable, lax.div(largest, amax), factor),
          lax.select(usable, inverse, smallest))


def _power_of_two_scale(amax: jax.Array, largest: np.float32) -> tuple:
  """`scale` rounded down to a power of two, `2**k` for `k = floor(log2(largest / amax))`,
  and its inverse `2**-k`, exactly and with no divide: a positive float32 times `2**k` adds
  `k * 2**23` to its bits, so `k` is the bits' difference, `bits(largest) - bits(amax)`,
  rounded down to a multiple of `2**23`. At most 126, so that both are normal numbers (an
  amax below about 2.6e-36 is scaled by `2**126`, within the format but not up to its
  largest value); 1 for an amax of 0 or not finite."""
  bits = lax.bitcast_convert_type(amax, jnp.int32)
  exponent = lax.min(lax.bitwise_and(lax.sub(largest.view(np.int32), bits),
                                     np.int32(-(2**23))),  # k * 2**23
                     np.int32(126 << 23))
  usable = lax.bitwise_and(lax.gt(bits, np.int32(0)),  # not 0, inf or NaN (of either sign)
                           lax.lt(bits, np.int32(0x7F800000)))
  exponent = lax.select(usable, exponent, lax.full_like(exponent, 0))
  one = np.int32(0x3F800000)  # 1.0's bits
  return (lax.bitcast_convert_type(lax.add(one, exponent), _F32),
          lax.bitcast_convert_type(lax.sub(one, exponent), _F32))


def scaled(x: jax.Array, fmt: np.dtype, contract: Any, recipe: Float8Recipe) -> tuple:
  """`(x * factor in float32, factor, inverse)`: the scale per tensor, or per row (the amax
  taken over the contracting axes `contract`), with `x`'s number of dimensions."""
  # lax, not jnp: each jnp function traces a jitted function of its own per shape, and a
  # rowwise step scales hundreds of operands (a third of its tracing time).
  x = lax.convert_element_type(x, _F32)
  axes = tuple(range(x.ndim)) if recipe.granularity == "tensor" else tuple(sorted(contract))
  kept = [axis for axis in range(x.ndim) if axis not in axes]
  amax = lax.broadcast_in_dim(lax.reduce_max(lax.abs(x), axes),
                              [1 if axis in axes else x.shape[axis] for axis in range(x.ndim)],
                              kept)
  factor, inverse = scale(amax, fmt, recipe.power_of_two_scales)
  return lax.mul(x, lax.broadcast_in_dim(factor, x.shape, range(x.ndim))), factor, inverse


def to_float8(values: jax.Array, fmt: np.dtype) -> jax.Array:
  """`scaled` values cast to `fmt`: none is past its largest value (`scale` sees to it),
  and inf and NaN stay non-finite (e4m3 has no inf: they become NaN), so an overflow is
  still seen."""
  return lax.convert_element_type(values, fmt)


def _refuse_second_order(*_: Any) -> None:
  """The derivative rule of a float8 matmul's forward and backward rules (the `custom_vjp`
  pair that its first derivative runs). JAX's own rule for their float8 casts would take
  the tangents to float8 unscaled (flushed to zero or NaN), which a derivative of that
  derivative would meet: the backward rule differentiated again (a Hessian, a gradient
  penalty), or the forward rule run inside an outer derivative (`jax.grad` of an inner
  `jax.vjp`'s output or `has_aux` output). One rule per matmul, not per cast: a step
  traces hundreds of casts."""
  raise NotImplementedError(
      "a float8 matmul of `autocast(..., fp8=...)` cannot be differentiated twice "
      "(jax.hessian, Hessian-vector products, a gradient of a gradient, jax.jvp of its "
      "gradient): its float8 casts would take the tangents unscaled. Put the inner "
      "`jax.grad` inside the autocast function (`autocast(lambda w: penalty(jax.grad(f)"
      "(w)), ...)`), whose backward matmuls then run as forward ones, or use `fp8=None` "
      "for that part.")


class Quantized(NamedTuple):
  """A tensor in float8 and the inverse of the float32 factor it was scaled by (of the
  tensor's rank, of size 1 along the axes its amax was taken over).

  Attributes:
    values: the scaled tensor, in float8.
    inverse: what divides the scale out of a product.
  """
  values: jax.Array
  inverse: jax.Array

  @property
  def ndim(self) -> int:
    return self.values.ndim

  @property
  def shape(self) -> tuple[int, ...]:
    return self.values.shape


def quantize(x: jax.Array, fmt: np.dtype, contract: Any, recipe: Float8Recipe) -> Quantized:
  values, _, inverse = scaled(x, fmt, contract, recipe)
  return Quantized(to_float8(values, fmt), inverse)


def _output_scale(inverse: jax.Array, batch: Any, contract: Any, lhs: bool,
                  others: int) -> jax.Array:
  """An operand's inverse scale laid out for `dot_general`'s result (batch axes, the
  left operand's other axes, the right operand's), with `others` axes of size 1 for the
  other operand's free axes; a scalar for a tensor's one scale."""
  if inverse.size == 1:
    return inverse.reshape(())
  free = _others(inverse.ndim, contract, batch)
  order = list(batch) + free
  shape = [inverse.shape[axis] for axis in order]
  ones = [1] * others
  if lhs:
    shape = shape + ones
  else:
    shape = shape[:len(batch)] + ones + shape[len(batch):]
  return lax.reshape(lax.transpose(inverse, order + list(contract)), shape)


def scaled_dot(lhs: jax.Array | Quantized, rhs: jax.Array | Quantized, dimension_numbers: Any,
               lhs_format: np.dtype, rhs_format: np.dtype, recipe: Float8Recipe,
               out_sharding: Any = None) -> jax.Array:
  """`dot_general(lhs, rhs)` on float8 operands (each quantized here unless it is already
  `Quantized`), in float32, the scales divided out; `out_sharding` as `dot_general`'s."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  if not isinstance(lhs, Quantized):
    lhs = quantize(lhs, lhs_format, lhs_contract, recipe)
  if not isinstance(rhs, Quantized):
    rhs = quantize(rhs, rhs_format, rhs_contract, recipe)
  out = lax.dot_general(lhs.values, rhs.values, dimension_numbers, preferred_element_type=_F32,
                        **_sharded(out_sharding))
  lhs_free = len(_others(lhs.ndim, lhs_contract, lhs_batch))
  rhs_free = len(_others(rhs.ndim, rhs_contract, rhs_batch))
  lhs_inverse = _output_scale(lhs.inverse, lhs_batch, lhs_contract, True, rhs_free)
  rhs_inverse = _output_scale(rhs.inverse, rhs_batch, rhs_contract, False, lhs_free)
  return _unscaled(out, lhs_inverse, rhs_inverse)


def _unscaled(out: jax.Array, lhs_inverse: jax.Array, rhs_inverse: jax.Array) -> jax.Array:
  """`out * lhs_inverse * rhs_inverse`, the smaller inverse first: `out * lhs_inverse`
  alone is the true product divided by the rhs inverse, which overflows float32 for a
  finite product of an operand beyond ~1e35."""
  lhs_inverse, rhs_inverse = (lax.broadcast_in_dim(x, out.shape, range(out.ndim)) if x.ndim
                              else x for x in (lhs_inverse, rhs_inverse))
  return lax.mul(lax.mul(out, lax.min(lhs_inverse, rhs_inverse)),
                 lax.max(lhs_inverse, rhs_inverse))


def plain_dot(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, *_: Any,
              out_sharding: Any = None) -> jax.Array:
  """`dot_general(lhs, rhs)` accumulated and returned in float32 (on float32 copies of the
  operands: the same products, and XLA:CPU has no bfloat16 x bfloat16 = float32 dot)."""
  return lax.dot_general(lhs.astype(_F32), rhs.astype(_F32), dimension_numbers,
                         **_sharded(out_sharding))


def _sharded(out_sharding: Any) -> dict:
  """`dot_general`'s keyword for `out_sharding`, none where JAX is to infer it."""
  return {} if out_sharding is None else {"out_sharding": out_sharding}


# The backward pass's matmuls.


class _Transposed(NamedTuple):
  """A backward matmul: `dot_general(gradient, other, dimension_numbers)` transposed by
  `axes` is the gradient of one operand."""
  dimension_numbers: Any
  axes: tuple[int, ...]


def _ranges(*groups: Any) -> list[list[int]]:
  """Consecutive ranges of axes, one as long as each of `groups`."""
  start, out = 0, []
  for group in groups:
    out.append(list(range(start, start + len(group))))
    start += len(group)
  return out


def _gradient_of_lhs(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int,
                     swapped: bool = False) -> _Transposed:
  """The backward matmul giving the left operand's gradient (JAX's own transpose of
  `dot_general`): the incoming gradient contracted with the right operand."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  lhs_kept = _others(lhs_ndim, lhs_contract, lhs_batch)
  rhs_kept = _others(rhs_ndim, rhs_contract, rhs_batch)
  if swapped:
    out_batch, out_rhs, _ = _ranges(lhs_batch, rhs_kept, lhs_kept)
  else:
    out_batch, _, out_rhs = _ranges(lhs_batch, lhs_kept, rhs_kept)
  numbers = ((tuple(out_rhs), tuple(rhs_kept)), (tuple(out_batch), tuple(rhs_batch)))
  contract_by_rhs = [lhs_contract[i] for i in np.argsort(rhs_contract)]
  axes = tuple(int(a) for a in np.argsort(list(lhs_batch) + lhs_kept + contract_by_rhs))
  return _Transposed(numbers, axes)


def _gradient_of_rhs(dimension_numbers: Any, lhs_ndim: int, rhs_ndim: int) -> _Transposed:
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
  return _gradient_of_lhs(((rhs_contract, lhs_contract), (rhs_batch, lhs_batch)), rhs_ndim,
                          lhs_ndim, swapped=True)


def _gradients(dot: Callable, g: jax.Array, lhs: jax.Array, rhs: jax.Array,
               dimension_numbers: Any, formats: tuple, recipe: Any) -> tuple:
  """The gradients of `lhs` and `rhs` (float32) from the incoming gradient `g`, each a
  `dot(g, other, numbers, grad_format, other's format, recipe)` transposed."""
  grad_format, lhs_format, rhs_format = formats
  of_lhs = _gradient_of_lhs(dimension_numbers, lhs.ndim, rhs.ndim)
  of_rhs = _gradient_of_rhs(dimension_numbers, lhs.ndim, rhs.ndim)
  # Each gradient sharded as its operand, as JAX's own transpose does: the weight's
  # gradient of a batch-sharded matmul contracts the sharded batch.
  lhs_bar = dot(g, rhs, of_lhs.dimension_numbers, grad_format, rhs_format, recipe,
                out_sharding=_values_sharding(lhs, of_lhs.axes))
  rhs_bar = dot(g, lhs, of_rhs.dimension_numbers, grad_format, lhs_format, recipe,
                out_sharding=_values_sharding(rhs, of_rhs.axes))
  return jnp.transpose(lhs_bar, of_lhs.axes), jnp.transpose(rhs_bar, of_rhs.axes)


def _values_sharding(operand: jax.Array | Quantized, axes: tuple[int, ...]) -> Any:
  values = operand.values if isinstance(operand, Quantized) else operand
  return internals.transposed_sharding(values, axes)


def _formats(recipe: Float8Recipe) -> tuple:
  return recipe.grad_format, recipe.lhs_format, recipe.rhs_format


class Dot(NamedTuple):
  """A `dot_general` and its two backward matmuls, as the readiness report measures them
  (a `Convolution` answers the same four questions).

  Attributes:
    dimension_numbers: its dimension numbers.
    out_sharding: its result's sharding, where the program named one.
  """
  dimension_numbers: Any
  out_sharding: Any = None

  def product(self, lhs: jax.Array, rhs: jax.Array, recipe: Float8Recipe | None) -> jax.Array:
    """The forward product in float32: in float8 under `recipe`, exact for None."""
    if recipe is None:
      return plain_dot(lhs, rhs, self.dimension_numbers, out_sharding=self.out_sharding)
    return scaled_dot(lhs, rhs, self.dimension_numbers, recipe.lhs_format, recipe.rhs_format,
                      recipe, self.out_sharding)

  def gradients(self, g: jax.Array, lhs: jax.Array, rhs: jax.Array,
                recipe: Float8Recipe | None) -> tuple:
    """The gradients of `lhs` and `rhs` in float32: in float8 under `recipe`, exact for None."""
    if recipe is None:
      return _gradients(plain_dot, g, lhs, rhs, self.dimension_numbers, (None,) * 3, None)
    return _gradients(scaled_dot, g, lhs, rhs, self.dimension_numbers, _formats(recipe), recipe)

  def operands(self, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """`(kind, operand, contracting axes, the recipe's attribute naming its format)` of
    each forward operand."""
    (lhs_contract, rhs_contract), _ = self.dimension_numbers
    return (("lhs", lhs, lhs_contract, "lhs_format"), ("rhs", rhs, rhs_contract, "rhs_format"))

  def incoming(self, g: jax.Array, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """`(kind, contracting axes)` of the incoming gradient in each backward matmul."""
    return tuple((kind, of(self.dimension_numbers, lhs.ndim, rhs.ndim).dimension_numbers[0][0])
                 for kind, of in (("gradient for lhs", _gradient_of_lhs),
                                  ("gradient for rhs", _gradient_of_rhs)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _float8_dot(lhs, rhs, dimension_numbers, recipe, dtype, out_sharding):
  """The float32 product, sharded as `out_sharding` says (None: as JAX infers); the
  operands' gradients in `dtype`, each sharded as its operand."""
  return scaled_dot(lhs, rhs, dimension_numbers, recipe.lhs_format, recipe.rhs_format, recipe,
                    out_sharding)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4, 5))
def _float8_dot_forward(lhs, rhs, dimension_numbers, recipe, dtype, out_sharding):
  (lhs_contract, rhs_contract), _ = dimension_numbers
  if recipe.granularity == "tensor":  # the backward matmuls take the same scales: kept in float8
    lhs = quantize(lhs, recipe.lhs_format, lhs_contract, recipe)
    rhs = quantize(rhs, recipe.rhs_format, rhs_contract, recipe)
  out = scaled_dot(lhs, rhs, dimension_numbers, recipe.lhs_format, recipe.rhs_format, recipe,
                   out_sharding)
  return out, (lhs, rhs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2, 3))
def _float8_dot_backward(dimension_numbers, recipe, dtype, out_sharding, residuals, g):
  lhs, rhs = residuals  # `Quantized` per tensor, in `dtype` per row (scaled anew along rows)
  lhs_bar, rhs_bar = _gradients(scaled_dot, g, lhs, rhs, dimension_numbers, _formats(recipe),
                                recipe)
  return lhs_bar.astype(dtype), rhs_bar.astype(dtype)


_float8_dot_forward.defjvp(_refuse_second_order)
_float8_dot_backward.defjvp(_refuse_second_order)
_float8_dot.defvjp(_float8_dot_forward, _float8_dot_backward)


# Convolutions.


class Convolution(NamedTuple):
  """A `lax.conv_general_dilated`'s parameters, its padding explicit (groups of 1).

  Attributes:
    window_strides: its strides.
    padding: `(low, high)` per spatial dimension.
    lhs_dilation: its input's dilation.
    rhs_dilation: its kernel's dilation.
    dimension_numbers: its `lax.ConvDimensionNumbers` (each operand's and the result's
      batch or output-feature axis, feature axis, then spatial axes).
  """
  window_strides: tuple[int, ...]
  padding: tuple[tuple[int, int], ...]
  lhs_dilation: tuple[int, ...]
  rhs_dilation: tuple[int, ...]
  dimension_numbers: lax.ConvDimensionNumbers

  @classmethod
  def of(cls, op: Any) -> Convolution:
    """The convolution of `op`, an `Operation` of `conv_general_dilated`."""
    ints = lambda values: tuple(int(v) for v in values)
    return cls(ints(op.param("window_strides")),
               tuple(ints(pair) for pair in op.param("padding")),
               ints(op.param("lhs_dilation")), ints(op.param("rhs_dilation")),
               lax.ConvDimensionNumbers(*map(ints, op.param("dimension_numbers"))))

  def __call__(self, lhs: jax.Array, rhs: jax.Array, out_sharding: Any = None) -> jax.Array:
    """The convolution of `lhs` by `rhs`, accumulated and returned in float32, sharded
    as `out_sharding` says (None: as JAX infers)."""
    return lax.conv_general_dilated(lhs, rhs, self.window_strides, self.padding,
                                    self.lhs_dilation, self.rhs_dilation,
                                    self.dimension_numbers, preferred_element_type=_F32,
                                    **_sharded(out_sharding))

  def _dilated(self, lhs_shape: tuple, rhs_shape: tuple, out_shape: tuple) -> tuple:
    """The spatial sizes of the input, kernel and result, each dilated as this
    convolution dilates it (the result by the strides)."""
    lhs_spec, rhs_spec, out_spec = self.dimension_numbers

    def dilated(shape, spec, dilation):
      return [0 if shape[axis] == 0 else 1 + d * (shape[axis] - 1)
              for axis, d in zip(spec[2:], dilation, strict=True)]

    return (dilated(lhs_shape, lhs_spec, self.lhs_dilation),
            dilated(rhs_shape, rhs_spec, self.rhs_dilation),
            dilated(out_shape, out_spec, self.window_strides))

  def of_lhs(self, lhs_shape: tuple, rhs_shape: tuple, out_shape: tuple) -> Convolution:
    """The convolution of the incoming gradient by the spatially reversed kernel that
    gives the input's gradient (JAX's transpose rule of `conv_general_dilated`)."""
    lhs_spec, rhs_spec, out_spec = self.dimension_numbers
    lhs, rhs, out = self._dilated(lhs_shape, rhs_shape, out_shape)
    before = [k - low - 1 for k, (low, _) in zip(rhs, self.padding, strict=True)]
    after = [n + k - 1 - o - b for n, k, o, b in zip(lhs, rhs, out, before, strict=True)]
    return Convolution(self.lhs_dilation, tuple(zip(before, after, strict=True)),
                       self.window_strides, self.rhs_dilation,
                       lax.ConvDimensionNumbers(out_spec, _swapped(rhs_spec), lhs_spec))

  def of_rhs(self, lhs_shape: tuple, rhs_shape: tuple, out_shape: tuple) -> Convolution:
    """The convolution of the input by the incoming gradient that gives the kernel's
    gradient (JAX's transpose rule of `conv_general_dilated`)."""
    lhs_spec, rhs_spec, out_spec = self.dimension_numbers
    lhs, rhs, out = self._dilated(lhs_shape, rhs_shape, out_shape)
    low = [low for low, _ in self.padding]
    high = [o - n + k - lo - 1 for o, n, k, lo in zip(out, lhs, rhs, low, strict=True)]
    return Convolution(self.rhs_dilation, tuple(zip(low, high, strict=True)),
                       self.lhs_dilation, self.window_strides,
                       lax.ConvDimensionNumbers(_swapped(lhs_spec), _swapped(out_spec),
                                                _swapped(rhs_spec)))

  def product(self, lhs: jax.Array, rhs: jax.Array, recipe: Float8Recipe | None) -> jax.Array:
    """The forward convolution in float32: in float8 under `recipe`, exact for None."""
    if recipe is None:
      return self(lhs.astype(_F32), rhs.astype(_F32))
    return scaled_conv(lhs, rhs, self, recipe.lhs_format, recipe)

  def gradients(self, g: jax.Array, lhs: jax.Array | Quantized, rhs: jax.Array | Quantized,
                recipe: Float8Recipe | None) -> tuple:
    """The gradients of `lhs` and `rhs` in float32 (the backward convolutions): in
    float8 under `recipe` (both operands in its `grad_format`), exact for None."""
    spatial = self.dimension_numbers.rhs_spec[2:]
    if isinstance(rhs, Quantized):  # its one scale does not change
      reversed_rhs = Quantized(lax.rev(rhs.values, spatial), rhs.inverse)
    else:
      reversed_rhs = lax.rev(rhs, spatial)
    of_lhs = self.of_lhs(lhs.shape, rhs.shape, g.shape)
    of_rhs = self.of_rhs(lhs.shape, rhs.shape, g.shape)
    # Each gradient laid out and sharded as its operand, as JAX's transpose gives them (the
    # kernel's gradient of a batch-sharded convolution contracts the sharded batch).
    lhs_sharding = _values_sharding(lhs, tuple(range(lhs.ndim)))
    rhs_sharding = _values_sharding(rhs, tuple(range(rhs.ndim)))
    if recipe is None:
      return (of_lhs(g.astype(_F32), reversed_rhs.astype(_F32), lhs_sharding),
              of_rhs(lhs.astype(_F32), g.astype(_F32), rhs_sharding))
    return (scaled_conv(g, reversed_rhs, of_lhs, recipe.grad_format, recipe, lhs_sharding),
            scaled_conv(lhs, g, of_rhs, recipe.grad_format, recipe, rhs_sharding))

  def operands(self, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """`(kind, operand, axes its amax is taken over per row, the recipe's attribute
    naming its format)` of each forward operand."""
    lhs_spec, rhs_spec, _ = self.dimension_numbers
    return (("lhs", lhs, _others(lhs.ndim, [lhs_spec[0]]), "lhs_format"),
            ("rhs", rhs, _others(rhs.ndim, [rhs_spec[0]]), "lhs_format"))

  def incoming(self, g: jax.Array, lhs: jax.Array, rhs: jax.Array) -> tuple:
    """`(kind, axes its amax is taken over per row)` of the incoming gradient in each
    backward convolution: per batch element for the input's, per output feature for the
    kernel's."""
    _, _, out_spec = self.dimension_numbers
    return (("gradient for lhs", _others(g.ndim, [out_spec[0]])),
            ("gradient for rhs", _others(g.ndim, [out_spec[1]])))


def _swapped(spec: tuple[int, ...]) -> tuple[int, ...]:
  """A convolution spec with its first two axes' roles exchanged (batch and feature)."""
  return (spec[1], spec[0], *spec[2:])


def _conv_output_scale(inverse: jax.Array, axis: int, ndim: int) -> jax.Array:
  """An operand's inverse scale laid out along `axis` of the convolution's `ndim`-dimensional
  result; a scalar for a tensor's one scale."""
  if inverse.size == 1:
    return inverse.reshape(())
  shape = [1] * ndim
  shape[axis] = inverse.size
  return inverse.reshape(shape)


def scaled_conv(lhs: jax.Array | Quantized, rhs: jax.Array | Quantized,
                convolution: Convolution, fmt: np.dtype, recipe: Float8Recipe,
                out_sharding: Any = None) -> jax.Array:
  """`convolution(lhs, rhs)` on float8 operands, both in `fmt` (each quantized here
  unless it is already `Quantized`; per row, along the input's batch axis and the
  kernel's output-feature axis, outside the contraction), in float32, the scales
  divided out."""
  lhs_spec, rhs_spec, out_spec = convolution.dimension_numbers
  if not isinstance(lhs, Quantized):
    lhs = quantize(lhs, fmt, _others(lhs.ndim, [lhs_spec[0]]), recipe)
  if not isinstance(rhs, Quantized):
    rhs = quantize(rhs, fmt, _others(rhs.ndim, [rhs_spec[0]]), recipe)
  out = convolution(lhs.values, rhs.values, out_sharding)
  return _unscaled(out, _conv_output_scale(lhs.inverse, out_spec[0], out.ndim),
                   _conv_output_scale(rhs.inverse, out_spec[1], out.ndim))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _float8_conv(lhs, rhs, convolution, recipe, dtype):
  """The float32 convolution; the operands' gradients in `dtype`."""
  return scaled_conv(lhs, rhs, convolution, recipe.lhs_format, recipe)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3, 4))
def _float8_conv_forward(lhs, rhs, convolution, recipe, dtype):
  out = scaled_conv(lhs, rhs, convolution, recipe.lhs_format, recipe)
  if recipe.granularity == "tensor":  # the backward convolutions' operands: kept in float8
    lhs, rhs = (quantize(x, recipe.grad_format, range(x.ndim), recipe) for x in (lhs, rhs))
  return out, (lhs, rhs)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0, 1, 2))
def _float8_conv_backward(convolution, recipe, dtype, residuals, g):
  lhs, rhs = residuals  # `Quantized` per tensor, in `dtype` per row (scaled anew)
  lhs_bar, rhs_bar = convolution.gradients(g, lhs, rhs, recipe)
  return lhs_bar.astype(dtype), rhs_bar.astype(dtype)


_float8_conv_forward.defjvp(_refuse_second_order)
_float8_conv_backward.defjvp(_refuse_second_order)
_float8_conv.defvjp(_float8_conv_forward, _float8_conv_backward)


# Measuring what float8 would do, for the readiness report.


class TensorStats(NamedTuple):
  """What casting one tensor to float8 under one recipe does.

  Attributes:
    size: how many values it holds.
    amax: its largest magnitude.
    flushed: how many of its non-zero values become zero.
    saturated: how many scale past the format's largest value (non-finite ones included).
  """
  size: Any
  amax: Any
  flushed: Any
  saturated: Any


def tensor_stats(x: jax.Array, fmt: np.dtype, contract: Any, recipe: Float8Recipe) -> TensorStats:
  """`TensorStats` of `x`, scaled as `scaled_dot` scales it along `contract`."""
  values, _, _ = scaled(x, fmt, contract, recipe)
  largest = float(jnp.finfo(fmt).max)
  quantized = to_float8(values, fmt)
  # Non-zero before scaling: a value far below the amax may scale to zero in float32
  # already. Non-zero by its bits: XLA:CPU compares a subnormal as zero (and flushes it).
  magnitude = lax.bitwise_and(lax.bitcast_convert_type(x.astype(_F32), jnp.int32),
                              np.int32(0x7FFFFFFF))
  flushed = jnp.sum((magnitude != 0) & (quantized == 0))
  saturated = jnp.sum(~(jnp.abs(values) <= largest))
  return TensorStats(jnp.asarray(x.size), jnp.max(jnp.abs(x.astype(_F32))), flushed, saturated)


def relative_error(approximate: jax.Array, reference: jax.Array) -> tuple:
  """`(sum of the rows' squared relative errors, how many rows)`, rows along the last
  axis, rows of zeros left out: a row flushed to zero counts in full, however small."""
  difference = jnp.sum(jnp.square(approximate - reference), axis=-1)
  norm = jnp.sum(jnp.square(reference), axis=-1)
  counted = norm > 0
  return jnp.sum(jnp.where(counted, difference / jnp.where(counted, norm, 1.0), 0.0)), jnp.sum(
      counted)


@dataclasses.dataclass(frozen=True, eq=False)
class Measurement:
  """A stand-in for a recipe that runs each eligible matmul (and convolution) in
  `compute_dtype` and reports, through `record`, what each of `recipes` would do to it.

  Attributes:
    recipes: the recipes measured; the first decides which matmuls and convolutions are
      eligible.
    record: called on the host as `record(matmul index, kind, stats)`, `kind` one of
      "lhs", "rhs", "gradient for lhs", "gradient for rhs" (the incoming gradient as
      scaled for each backward matmul; a `{recipe index: TensorStats}`) or "forward", "lhs
      gradient", "rhs gradient" (a `{recipe index: relative_error pair}`).
    matmuls: the `Float8Matmul` of each index, as they were met.
  """
  recipes: tuple[Float8Recipe, ...]
  record: Callable[[int, str, dict], None]
  matmuls: list = dataclasses.field(default_factory=list)

  def add(self, matmul: Float8Matmul) -> int:
    self.matmuls.append(matmul)
    return len(self.matmuls) - 1

  def emit(self, index: int, kind: str, stats: dict) -> None:
    jax.debug.callback(functools.partial(self.record, index, kind), stats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _measured(lhs, rhs, products, measurement, index):
  """The product of `lhs` and `rhs` (`products`: a `Dot` or a `Convolution`) in float32;
  what each recipe would do to it and to its backward products is emitted, forward and
  backward."""
  return _measured_forward(lhs, rhs, products, measurement, index)[0]


def _measured_forward(lhs, rhs, products, measurement, index):
  reference = products.product(lhs, rhs, None)
  for kind, x, contract, fmt in products.operands(lhs, rhs):
    measurement.emit(index, kind, {i: tensor_stats(x, getattr(r, fmt), contract, r)
                                   for i, r in enumerate(measurement.recipes)})
  measurement.emit(index, "forward", {
      i: relative_error(products.product(lhs, rhs, r), reference)
      for i, r in enumerate(measurement.recipes)})
  return reference, (lhs, rhs)


def _measured_backward(products, measurement, index, residuals, g):
  lhs, rhs = residuals
  for kind, contract in products.incoming(g, lhs, rhs):
    measurement.emit(index, kind, {i: tensor_stats(g, r.grad_format, contract, r)
                                   for i, r in enumerate(measurement.recipes)})
  references = products.gradients(g, lhs, rhs, None)
  lhs_errors, rhs_errors = {}, {}
  for i, r in enumerate(measurement.recipes):
    lhs_bar, rhs_bar = products.gradients(g, lhs, rhs, r)
    lhs_errors[i] = relative_error(lhs_bar, references[0])
    rhs_errors[i] = relative_error(rhs_bar, references[1])
  measurement.emit(index, "lhs gradient", lhs_errors)
  measurement.emit(index, "rhs gradient", rhs_errors)
  return references[0].astype(lhs.dtype), references[1].astype(rhs.dtype)


_measured.defvjp(_measured_forward, _measured_backward)


# With XLA's default options, compiling a layer's three float8 matmuls took about 100 s
# on an H200, spent autotuning (most likely the Triton GEMM candidates that XLA:GPU weighs
# against cuBLASLt for each float8 dot); with Triton's GEMMs off, 0.9 s, and the program
# called the same cuBLASLt float8 GEMMs.
_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
_GPU_BACKENDS = ("gpu", "cuda", "rocm")


def compiler_options(backend: str | None = None) -> dict[str, Any]:
  """XLA options for compiling a step of float8 matmuls on `backend`.

  Pass them to the step's `jax.jit`: `jax.jit(step, compiler_options=
  jls.fp8_compiler_options())`. On a GPU they turn off XLA's Triton GEMMs, so that XLA
  takes cuBLASLt's float8 GEMM for each float8 matmul without autotuning alternatives to
  it first. On an H200 that compiled a 4096x8192 by 8192x16384 float8 layer, forward
  and backward, in 0.9 s instead of about 100 s, calling the same float8 GEMMs (their
  times are in docs/fp8.md, "On a GPU"). They turn Triton off for every GEMM of the step,
  those of bfloat16 included (not measured). Off a GPU there are none.

  Args:
    backend: the platform that compiles the step: "cpu", "gpu", "cuda", "rocm", "tpu", ...
      (`jax.default_backend()` if None).

  Returns:
    A new dict, empty off a GPU.

  Raises:
    TypeError: if `backend` is not a string or None.
  """
  if backend is None:
    backend = jax.default_backend()
  elif not isinstance(backend, str):
    raise TypeError(f"fp8_compiler_options(backend=...) takes a platform's name such as "
                    f"'gpu' or 'cpu' (or None for jax.default_backend()), got {backend!r}")
  return dict(_GPU_OPTIONS) if backend.lower() in _GPU_BACKENDS else {}
