"""Dtype facts and float32 arithmetic with an exact rounding on every platform.

Loss scales live in float32 and are applied to leaves of every floating dtype. This
module says in which dtype a leaf is scaled (`compute_dtype`), where a conversion to a
narrow dtype first underflows or overflows (`first_magnitude`), and how a float32 scale
is multiplied and divided so that every platform gives the same bits: XLA keeps float32
subnormals on GPU and flushes them on CPU and TPU, and its float32 division is not
correctly rounded on GPU (benchmarks/RESULTS.md, "Every platform rounds alike").
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal; XLA flushes below it
INT32_MAX = int(np.iinfo(np.int32).max)


def log2_floor_ratio(a: Any, b: Any) -> Any:
  """`floor(log2(a / b))` for positive `a` and `b`, exactly and without overflowing
  `a / b`: the difference of their exponents, less one where `a`'s mantissa is the
  smaller. `ceil(log2(a / b))` is `-log2_floor_ratio(b, a)`.

  JAX arrays (traced or not) are computed by JAX in float32, from their bits, so that a
  subnormal is read as it is on every platform (XLA:CPU reads one as zero, and its
  `frexp` with it); Python and NumPy numbers by NumPy, so that a float64 on the host
  keeps its range.
  """
  if not (isinstance(a, jax.Array) or isinstance(b, jax.Array)):
    (ma, ea), (mb, eb) = np.frexp(a), np.frexp(b)  # x = m * 2**e, m in [0.5, 1)
    return ea - eb + np.where(ma >= mb, 0, -1)
  (ma, ea), (mb, eb) = _normalized(a), _normalized(b)
  return ea - eb + jnp.where(ma >= mb, 0, -1)


def _normalized(x: Any) -> tuple[jax.Array, jax.Array]:
  """`(m, e)` of a positive float32 `x = m * 2**(e - 23)`, `m` an integer in [2**23,
  2**24), by integer operations on its bits: exact for subnormals too."""
  bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
  biased, fraction = bits >> 23, bits & 0x7FFFFF
  shift = jax.lax.clz(fraction) - 8  # a subnormal's fraction, shifted up to bit 23
  subnormal = biased == 0
  m = jnp.where(subnormal, fraction << jnp.maximum(shift, 0), fraction | 0x800000)
  return m, jnp.where(subnormal, -126 - shift, biased - 127)


def is_narrow(dtype) -> bool:
  """Whether a floating dtype is narrower than float32 (float16, bfloat16, float8...)."""
  return jnp.dtype(dtype).itemsize < 4


def has_short_range(dtype) -> bool:
  """Whether a floating dtype has a narrower exponent range than float32.

  float16 and the float8 types do; bfloat16 has float32's.
  """
  return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype a leaf of `dtype` is scaled in: float32, or its own if at least as wide.

  float8 and float4 types do not promote implicitly, so they are converted here.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if is_narrow(dtype) else dtype


class Rescale(NamedTuple):
  """`x * factor * ...`, computed in `compute_dtype(x.dtype)` and cast back: the one way
  the library scales and unscales. `factors` are real scalars, applied in order.
  """

  factors: tuple[Any, ...] = ()

  @classmethod
  def reciprocal(cls, scale: jax.Array) -> Rescale:
    """A division by `scale`, as a multiplication by its reciprocal.

    `1 / scale` in one factor, except above 2**126, where it would be a float32
    subnormal that XLA flushes to zero: there `2**-64` and `2**64 / scale`. Exact for
    every power of two, one more rounding otherwise. (Not a division: XLA rewrites a
    division by a broadcast scalar into this multiplication, without the split.)
    """
    scale = jnp.asarray(scale, jnp.float32)
    pre = jnp.where(scale > 2.0**126, jnp.float32(2.0**-64), jnp.float32(1.0))
    return cls((pre, 1 / (scale * pre)))

  @property
  def identity(self) -> bool:
    return not self.factors

  def times(self, factor: jax.Array) -> Rescale:
    return Rescale((*self.factors[:-1], self.factors[-1] * factor) if self.factors
                   else (factor,))

  def __call__(self, x: jax.Array) -> jax.Array:
    # lax primitives: this runs once per leaf when a step is traced, where jnp's dispatch
    # would cost more than the rest.
    x = jnp.asarray(x)
    wide_dtype = compute_dtype(x.dtype)
    wide = x if x.dtype == wide_dtype else jax.lax.convert_element_type(x, wide_dtype)
    real = jnp.finfo(wide_dtype).dtype
    for factor in self.factors:
      factor = jax.lax.convert_element_type(factor, real)
      if real != wide_dtype:  # complex leaves: a real factor scales both parts
        factor = jax.lax.convert_element_type(factor, wide_dtype)
      wide = jax.lax.mul(wide, jax.lax.broadcast_in_dim(factor, wide.shape, ()))
    return wide if wide.dtype == x.dtype else jax.lax.convert_element_type(wide, x.dtype)


# Each true from some magnitude on (NaN counts as large: past the largest value).
_CONVERTED = {
    "nonzero": lambda y, finfo: y != 0,
    "normal": lambda y, finfo: not abs(y) < float(finfo.smallest_normal),
    "nonfinite": lambda y, finfo: not np.isfinite(y),
}


@functools.cache
def first_magnitude(source, target, kind: str) -> np.ndarray | None:
  """The smallest non-negative `source` value whose conversion to `target` is `kind`.

  `kind` is "nonzero", "normal" (at least `target`'s smallest normal) or "nonfinite";
  `None` when no finite `source` value converts so (a dtype at least as wide, or float4,
  which saturates). Found once per triple by bisection over `source`'s bit patterns with
  NumPy's conversions, which round as XLA's do. Comparing with it classifies a value as
  the conversion would, with no conversion in the program: XLA:GPU may drop a round
  trip through a narrower dtype.
  """
  source, target = np.dtype(source), np.dtype(target)
  uint = np.dtype(f"uint{8 * source.itemsize}")
  finfo = jnp.finfo(target)
  holds = _CONVERTED[kind]

  def converts(bits: int) -> bool:
    value = np.array(bits, uint).view(source)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
      return bool(holds(value.astype(target).astype(np.float64), finfo))

  lo, hi = 0, int(np.array(np.finfo(source).max, source).view(uint))
  if not converts(hi):
    return None
  while lo < hi:  # invariant: converts(hi)
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if converts(mid) else (mid + 1, hi)
  return np.array(hi, uint).view(source)


# --- float32 scale arithmetic, rounded alike everywhere ---------------------------------

_U32 = jnp.uint32


def _u(value: int) -> jax.Array:
  return jnp.asarray(value, _U32)


def flush_subnormals(x: jax.Array) -> jax.Array:
  """`x` with float32 subnormals replaced by zeros of the same sign, on every platform."""
  tiny = np.float32(FLOAT32_TINY)
  return jnp.where(jnp.abs(x) < tiny, x * np.float32(0), x)


def grow(scale: jax.Array, grown: jax.Array) -> jax.Array:
  """`grown` if it is finite, else `scale`: a growth to inf is refused (TensorFlow's rule)."""
  return jnp.where(jnp.isfinite(grown), grown, scale)


def compiled_reciprocal(divisor: float) -> float | None:
  """What a compiled program multiplies by where it divides a float32 by the constant
  `divisor`: XLA's algebraic simplifier rewrites `x / c` as `x * f32(1 / c)` (`x / 3` is
  `x * 0.333333343`, not the exactly rounded quotient), as jmp's `DynamicLossScale`
  backs off by its static `factor` under `jit`. None where that is the division itself
  (a power of two) or where the reciprocal is no normal float32 (a divisor beyond about
  8.5e37, which the rewrite would flush to a product of zero)."""
  reciprocal = np.float32(1) / np.float32(divisor)
  mantissa, _ = math.frexp(float(divisor))
  if mantissa == 0.5 or not reciprocal >= np.finfo(np.float32).tiny:
    return None
  return float(reciprocal)


def divided_by(x: jax.Array, divisor: float) -> jax.Array:
  """`x / float32(divisor)`, elementwise, correctly rounded to float32.

  Computed as `times_double(x, 1 / float32(divisor))`, which is exact: the quotient of
  two 24-bit numbers lies at least 2**-49 (relative) from the nearest float32 rounding
  midpoint, and the double reciprocal and product move it by less than 2**-52.
  """
  return times_double(x, 1 / float(np.float32(divisor)))


def times_double(x: jax.Array, factor: float) -> jax.Array:
  """`float32(float64(x) * factor)`, elementwise: PyTorch's `GradScaler` arithmetic.

  Emulated with uint32 arithmetic (no x64; integers are immune to the compiler's
  contraction of multiply-adds): the exact 77-bit product of the mantissas, rounded to
  nearest-even at 53 bits and then at 24. A result below the smallest normal float32 is
  0, one above the largest is inf.

  Args:
    x: float32 array (a loss scale), any shape.
    factor: a positive finite Python float.
  """
  x = jnp.asarray(x, jnp.float32)
  factor = float(factor)
  if float(np.float32(factor)) == factor:
    # 24-bit × 24-bit mantissas fit in a double: one rounding, as float32 does it.
    return flush_subnormals(x * np.float32(factor))
  fraction, exponent = math.frexp(factor)  # factor = fraction * 2**exponent
  mantissa, shift = int(fraction * 2**53), exponent - 53  # factor = mantissa * 2**shift
  bits = jax.lax.bitcast_convert_type(x, _U32)
  biased = (bits >> 23) & _u(0xFF)
  m = (bits & _u(0x7FFFFF)) | _u(0x800000)
  w0, w1, w2 = _product_words(m, mantissa)
  r, s1, over = _round_to_float_mantissa(w0, w1, w2)
  # value = r * 2**(29 + s1 + biased - 150 + shift); as float32 bits:
  out_biased = (biased.astype(jnp.int32) + s1.astype(jnp.int32) + over.astype(jnp.int32)
                + (shift + 29))
  finite = (out_biased.clip(0, 255).astype(_U32) << 23) | (r & _u(0x7FFFFF))
  out = jnp.where(out_biased >= 255, _u(0x7F800000), jnp.where(out_biased <= 0, _u(0), finite))
  out = jnp.where(biased == _u(0), _u(0), out) | (bits & _u(0x80000000))
  result = jax.lax.bitcast_convert_type(out, jnp.float32)
  # inf and NaN inputs are themselves: a positive finite factor keeps them (even one that
  # float32 would round to zero, whose product with inf is NaN).
  return jnp.where(biased == _u(0xFF), x, result)


def _product_words(m: jax.Array, mantissa: int) -> tuple[jax.Array, ...]:
  """The exact product of a 24-bit and a 53-bit mantissa as three uint32 words."""
  a = [m & _u(0xFFFF), m >> 16]
  b = [(mantissa >> (16 * j)) & 0xFFFF for j in range(4)]
  columns = [_u(0)] * 6  # 16-bit limbs: every partial product fits in uint32
  for i, a_i in enumerate(a):
    for j, b_j in enumerate(b):
      p = a_i * _u(b_j)
      columns[i + j] = columns[i + j] + (p & _u(0xFFFF))
      columns[i + j + 1] = columns[i + j + 1] + (p >> 16)
  limbs, carry = [], _u(0)
  for column in columns:
    column = column + carry
    limbs.append(column & _u(0xFFFF))
    carry = column >> 16
  return tuple(limbs[k] | (limbs[k + 1] << 16) for k in (0, 2, 4))


def _round_to_float_mantissa(w0, w1, w2) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A 76- or 77-bit product rounded to 53 bits (the double), then to 24 (the float).

  Returns the 24-bit mantissa, the first shift and whether rounding carried a bit.
  """
  s1 = jnp.where((w2 >> 12) & _u(1), _u(24), _u(23))
  rest = w0 & ((_u(1) << s1) - _u(1))
  half = _u(1) << (s1 - _u(1))
  q_lo = (w0 >> s1) | (w1 << (_u(32) - s1))
  q_hi = (w1 >> s1) | (w2 << (_u(32) - s1))
  up = (rest > half) | ((rest == half) & ((q_lo & _u(1)) == _u(1)))
  d_lo = q_lo + up.astype(_U32)
  d_hi = q_hi + (d_lo < q_lo).astype(_U32)
  r = (d_hi << 3) | (d_lo >> 29)
  rest, half = d_lo & _u(0x1FFFFFFF), _u(0x10000000)
  r = r + ((rest > half) | ((rest == half) & ((r & _u(1)) == _u(1)))).astype(_U32)
  over = r >> 24  # 1 when rounding carried into a 25th bit (r == 2**24)
  return r >> over, s1, over
