"""Scalar float32 arithmetic with an exact rounding on every platform, without x64.

PyTorch's `GradScaler` keeps its scale in float32 and its factors as Python doubles:
`(float)((double)scale * factor)`, two roundings (to 53 bits, then to 24). When the
factor is not a float32 number (0.7, 1.1, ...), a float32 product differs from that
by an ulp now and then, and a trajectory that differs once differs from then on. This
emulates the double computation exactly with uint32 arithmetic (integers are immune
to the compiler's contraction of multiply-adds): the exact 77-bit product of the
mantissas, rounded to nearest-even at 53 bits and then at 24.

The same machinery gives a correctly rounded float32 division. XLA's own is not
one on GPU (it emits PTX `div.full.f32`, up to 2 ulp off: `10 / 3` is 3.3333335
there), nor on CPU for a divisor XLA rewrites into a reciprocal.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_U32 = jnp.uint32


def _u(value: int) -> jax.Array:
  return jnp.asarray(value, _U32)


def flush_subnormals(x: jax.Array) -> jax.Array:
  """`x` with float32 subnormals replaced by zeros of the same sign.

  XLA flushes them on CPU and TPU but keeps them on GPU; a loss scale flushed
  explicitly follows the same trajectory everywhere.
  """
  tiny = np.float32(np.finfo(np.float32).tiny)
  return jnp.where(jnp.abs(x) < tiny, x * np.float32(0), x)


def divided_by(x: jax.Array, divisor: float) -> jax.Array:
  """`x / float32(divisor)`, elementwise, correctly rounded to float32.

  Computed as `times_double(x, 1 / float32(divisor))`. That is exact: the quotient of
  two 24-bit numbers lies at least 2**-49 (relative) from the nearest float32
  rounding midpoint, and the reciprocal in double and the product's rounding to 53
  bits move it by less than 2**-52, so both round to the same float32. As everywhere
  here, a result below the smallest normal float32 is 0.

  Args:
    x: float32 array, any shape.
    divisor: a positive Python float, finite and nonzero in float32.
  """
  divisor = float(np.float32(divisor))
  if not (math.isfinite(divisor) and divisor > 0):
    raise ValueError(f"`divisor` must be positive and finite in float32, got {divisor!r}.")
  return times_double(x, 1 / divisor)


def times_double(x: jax.Array, factor: float) -> jax.Array:
  """`float32(float64(x) * factor)`, elementwise, as XLA rounds float32 results.

  Args:
    x: float32 array (a loss scale), any shape.
    factor: a positive finite Python float.

  Returns:
    A float32 array. A result below the smallest normal float32 is flushed to 0 on
    every platform (C would keep a subnormal), one above the largest is inf, and a
    zero or subnormal `x` gives 0.
  """
  x = jnp.asarray(x, jnp.float32)
  factor = float(factor)
  if not (math.isfinite(factor) and factor > 0):
    raise ValueError(f"`factor` must be positive and finite, got {factor!r}.")
  if float(np.float32(factor)) == factor:
    # 24-bit × 24-bit mantissas fit in a double: one rounding, as float32 does it.
    return flush_subnormals(x * np.float32(factor))
  fraction, exponent = math.frexp(factor)  # factor = fraction * 2**exponent
  mantissa, shift = int(fraction * 2**53), exponent - 53  # factor = mantissa * 2**shift
  b = [(mantissa >> (16 * j)) & 0xFFFF for j in range(4)]

  bits = jax.lax.bitcast_convert_type(x, _U32)
  sign = bits & _u(0x80000000)
  biased = (bits >> 23) & _u(0xFF)
  m = (bits & _u(0x7FFFFF)) | _u(0x800000)
  a = [m & _u(0xFFFF), m >> 16]

  # The 77-bit product in 16-bit limbs: every partial product fits in uint32.
  columns = [_u(0)] * 6
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
  w0, w1, w2 = (limbs[k] | (limbs[k + 1] << 16) for k in (0, 2, 4))

  # Round to 53 bits (the double), nearest-even: the product has 76 or 77 bits.
  s1 = jnp.where((w2 >> 12) & _u(1), _u(24), _u(23))
  rest = w0 & ((_u(1) << s1) - _u(1))
  half = _u(1) << (s1 - _u(1))
  q_lo = (w0 >> s1) | (w1 << (_u(32) - s1))
  q_hi = (w1 >> s1) | (w2 << (_u(32) - s1))
  up = (rest > half) | ((rest == half) & ((q_lo & _u(1)) == _u(1)))
  d_lo = q_lo + up.astype(_U32)
  d_hi = q_hi + (d_lo < q_lo).astype(_U32)

  # Round the double's 53 bits to 24 (the float), nearest-even.
  r = (d_hi << 3) | (d_lo >> 29)
  rest, half = d_lo & _u(0x1FFFFFFF), _u(0x10000000)
  r = r + ((rest > half) | ((rest == half) & ((r & _u(1)) == _u(1)))).astype(_U32)
  over = r >> 24  # 1 when rounding carried into a 25th bit (r == 2**24)
  r = r >> over

  # value = r * 2**(29 + s1 + biased - 150 + shift); as float32 bits:
  out_biased = (biased.astype(jnp.int32) + s1.astype(jnp.int32) + over.astype(jnp.int32)
                + (shift + 29))
  finite = (out_biased.clip(0, 255).astype(_U32) << 23) | (r & _u(0x7FFFFF))
  out = jnp.where(out_biased >= 255, _u(0x7F800000), jnp.where(out_biased <= 0, _u(0), finite))
  out = jnp.where(biased == _u(0), _u(0), out) | sign
  result = jax.lax.bitcast_convert_type(out, jnp.float32)
  # inf and NaN inputs: whatever float32 arithmetic gives.
  return jnp.where(biased == _u(0xFF), x * np.float32(factor), result)
