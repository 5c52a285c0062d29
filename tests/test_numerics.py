"""Specification of the dtype facts and the exactly rounded float32 arithmetic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lossscale import _jax_internals
from jax_lossscale import _numerics

# Every floating dtype JAX has (the float6 types cannot even be built on XLA:CPU).
NARROW = [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz, jnp.float8_e4m3b11fnuz,
          jnp.float8_e8m0fnu, jnp.float8_e5m2, jnp.float8_e4m3, jnp.float8_e3m4,
          jnp.float4_e2m1fn]


@pytest.mark.parametrize("dtype", NARROW + [jnp.float16, jnp.bfloat16])
def test_the_overflow_threshold_is_where_the_cast_overflows(dtype):
  limit = _numerics.first_magnitude(np.float32, dtype, "nonfinite")
  if limit is None:  # saturating float4
    assert np.isfinite(np.float32(3e38).astype(dtype).astype(np.float32))
    return
  below = np.nextafter(limit, np.float32(0))
  # XLA's own cast, read back in the narrow dtype (a cast back inside the program could
  # be dropped on GPU, which is the point of the thresholds).
  cast = jax.jit(lambda x: x.astype(dtype))
  assert not np.isfinite(np.asarray(cast(limit)).astype(np.float32))
  assert np.isfinite(np.asarray(cast(below)).astype(np.float32))


@pytest.mark.parametrize("kind, value, below", [
    ("nonzero", 2.0**-25, True), ("nonzero", 1.5 * 2.0**-25, False),
    ("normal", 2.0**-14, False), ("normal", 2.0**-14 - 2.0**-24, True)])
def test_float16_thresholds_classify_values_as_the_cast_does(kind, value, below):
  limit = _numerics.first_magnitude(np.float32, np.float16, kind)
  assert (np.float32(value) < limit) == below


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.float8_e5m2])
def test_compute_dtype_is_float32_for_narrow_dtypes(dtype):
  expected = jnp.float32 if jnp.dtype(dtype).itemsize < 4 else dtype
  assert _numerics.compute_dtype(dtype) == expected
  assert _numerics.has_short_range(dtype) == (dtype in (jnp.float16, jnp.float8_e5m2))


@pytest.mark.parametrize("scale", [2.0**10, 2.0**127, 2.0**-20, 3.0, 1000.0, 3e38])
@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_the_reciprocal_divides_exactly_for_powers_of_two_up_to_the_largest_float32(
    scale, jitted):
  # As TensorFlow and PyTorch do. Above 2**126 a plain reciprocal would be a float32
  # subnormal, which XLA flushes to zero (and XLA turns a division by a broadcast
  # scalar into that multiplication): the result must still be right there.
  x = np.random.default_rng(0).uniform(-1, 1, 4096).astype(np.float32) * np.float32(scale)
  x[:3] = [np.inf, -np.inf, np.nan]
  unscale = lambda s, x: _numerics.Rescale.reciprocal(s)(x)
  got = np.asarray((jax.jit(unscale) if jitted else unscale)(np.float32(scale), x))
  expected = x / np.float32(scale)
  if np.log2(scale).is_integer():
    np.testing.assert_array_equal(got, expected)
  else:  # the reciprocal adds one rounding
    np.testing.assert_allclose(got, expected, rtol=2.0**-23)
    assert np.isnan(got[2]) and list(got[:2]) == [np.inf, -np.inf]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, *NARROW[:3]])
def test_rescaling_computes_in_float32_and_casts_back(dtype):
  # 2**16 is not a float16 number, but 2**-4 * 2**16 = 4096 is; float8 types do not
  # promote implicitly at all.
  x = jnp.array([2.0**-4, 0.5], dtype)
  out = _numerics.Rescale((jnp.float32(2.0**4),))(x)
  assert out.dtype == dtype
  np.testing.assert_array_equal(np.float32(out), np.float32(x) * 16)


def test_rescaling_a_complex_leaf_scales_both_parts():
  z = jnp.array([1 - 2j], jnp.complex64)
  assert complex(_numerics.Rescale((jnp.float32(2),))(z)[0]) == 2 - 4j


def test_rescaling_with_no_factor_is_the_identity():
  assert _numerics.Rescale().identity and not _numerics.Rescale.reciprocal(2.0).identity
  assert _numerics.Rescale().times(3.0).factors == (3.0,)


@pytest.mark.parametrize("divisor", [3.0, 1.5, 7.0, 10.0, 1.1, 2.0**0.5, 2.0])
def test_a_division_of_the_scale_is_correctly_rounded(divisor):
  # On every platform: XLA's float32 division is up to 2 ulp off on GPU (10 / 3 is
  # 3.3333335 there), so the backoff does not use it. A double quotient rounded to
  # float32 is the correctly rounded float32 quotient.
  rng = np.random.default_rng(0)
  scales = np.exp2(rng.uniform(-125, 127, 200_000)).astype(np.float32)
  got = np.asarray(jax.jit(lambda s: _numerics.divided_by(s, divisor))(scales))
  want = (scales.astype(np.float64) / float(np.float32(divisor))).astype(np.float32)
  want[want < np.finfo(np.float32).tiny] = 0
  np.testing.assert_array_equal(got, want)


def test_scale_arithmetic_divides_nothing():
  # The structure that keeps the test above true on GPU: no float division at all.
  program = jax.make_jaxpr(lambda s: _numerics.divided_by(s, 3.0))(jnp.float32(10))
  assert "div" not in {op.name for op in _jax_internals.operations_ran(program, [])}, program


@pytest.mark.parametrize("factor", [0.7, 1.1, 0.55, 1 / 3, 1.3])
def test_times_double_rounds_as_a_double_product_rounded_to_float32(factor):
  rng = np.random.default_rng(1)
  scales = np.exp2(rng.uniform(-120, 120, 100_000)).astype(np.float32)
  got = np.asarray(jax.jit(lambda s: _numerics.times_double(s, factor))(scales))
  want = (scales.astype(np.float64) * factor).astype(np.float32)
  want[np.abs(want) < np.finfo(np.float32).tiny] = 0
  np.testing.assert_array_equal(got, want)


def test_times_double_keeps_infinities_and_nan_even_for_a_factor_below_float32s_range():
  # float32(1e-50) is 0, and inf * 0 is NaN: a scale at inf stays inf, whatever the factor.
  x = jnp.array([np.inf, -np.inf, np.nan, 1.0], jnp.float32)
  for factor in (1e-50, 0.7, 0.5):
    got = np.asarray(jax.jit(lambda s, f=factor: _numerics.times_double(s, f))(x))
    assert list(got[:2]) == [np.inf, -np.inf] and np.isnan(got[2]), (factor, got)


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
def test_log2_floor_ratio_is_exact_over_float32s_whole_range_subnormals_included(jitted):
  # XLA:CPU reads a float32 subnormal as zero (its frexp too): the exponent of a tiny
  # measured gradient must still be its own, on every platform.
  rng = np.random.default_rng(0)
  a = np.concatenate([np.exp2(rng.uniform(-149, 128, 20_000)),
                      [2.0**-149, 3 * 2.0**-149, 2.0**-127, 2.0**-126, 1.0, 3e38]])
  a = a.astype(np.float32)
  b = rng.permutation(a)
  log2_floor_ratio = jax.jit(_numerics.log2_floor_ratio) if jitted else (
      _numerics.log2_floor_ratio)
  got = np.asarray(log2_floor_ratio(jnp.asarray(a), jnp.asarray(b)))
  # float64 holds every float32 as a normal number: its frexp is exact for all of them.
  (ma, ea), (mb, eb) = np.frexp(a.astype(np.float64)), np.frexp(b.astype(np.float64))
  np.testing.assert_array_equal(got, ea - eb + np.where(ma >= mb, 0, -1))


def test_subnormal_scales_are_flushed_on_every_platform():
  tiny = np.float32(np.finfo(np.float32).tiny)
  out = np.asarray(_numerics.flush_subnormals(jnp.array([tiny, tiny / 2, -tiny / 4])))
  assert out[0] == tiny and out[1] == 0 and out[2] == 0 and np.signbit(out[2])


def test_a_growth_to_inf_is_refused():
  assert float(_numerics.grow(jnp.float32(2.0**127), jnp.float32(np.inf))) == 2.0**127
