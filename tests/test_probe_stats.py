"""Specification of what one probe measures: exact statistics, headroom, sums over hits."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import count_compiles

from jax_lossscale import diagnostics
from jax_lossscale import probes as pr
from jax_lossscale.probes import stats as probe_stats

F16 = jnp.float16


def with_probes(fun):
  return pr.value_and_grad_with_probes(jax.value_and_grad, fun)


def injected(cotangent, forward=None):
  """A loss whose gradient at the probe is exactly `cotangent`."""
  def loss(w):
    x = pr.probe(w * (cotangent if forward is None else forward), "p")
    return jnp.sum(x * (cotangent if forward is None else 1.0))
  return loss


def test_backward_measurements_of_a_crafted_gradient_are_exact():
  g = jnp.array([0.0, 0.0, 3.0, -1024.0, 2.0**-20, 2.0**-15, 1.0, 0.5], F16)
  stats = with_probes(injected(g))(jnp.ones(8, F16))[2]["p"]
  assert int(stats.hits) == 1
  back = stats.backward
  assert float(back.max_abs) == 1024.0
  assert (float(back.zero_fraction), float(back.subnormal_fraction)) == (2 / 8, 2 / 8)
  assert bool(back.finite) and float(stats.headroom) == 5  # 1024 * 2**5 < 65504


def test_forward_measurements_of_a_crafted_activation_are_exact():
  a = jnp.array([jnp.nan, 0.0, -300.0, 2.0**-16, jnp.inf], F16)
  probes = with_probes(injected(jnp.ones(5, F16), forward=a))(jnp.ones(5, F16))[2]
  fwd = diagnostics.summarize(probes)["p"].forward
  assert float(fwd.max_abs) == np.inf and not fwd.finite  # NaN counts as inf
  assert (float(fwd.zero_fraction), float(fwd.subnormal_fraction)) == (
      np.float32(1 / 5), np.float32(1 / 5))


@pytest.mark.parametrize("largest, doublings", [
    (1.0, 15), (0.75, 16), (65504.0, 0), (40000.0, 0), (2.0**-24, 39),
    (0.0, np.inf), (np.inf, -np.inf)])
def test_headroom_counts_the_doublings_before_float16_overflows(largest, doublings):
  g = jnp.array([largest, 0.0], F16)
  assert diagnostics.headroom(with_probes(injected(g))(jnp.ones(2, F16))[2])["p"] == doublings


def twice(w, x):
  layer = lambda h: pr.probe(jnp.tanh(h * w), "shared")
  return jnp.sum(layer(layer(x)) * jnp.array([1.0, 300.0]))


def test_a_probe_hit_twice_sums_counts_and_keeps_the_max_at_binade_resolution():
  _, _, probes = with_probes(twice)(jnp.float32(1.0), jnp.array([0.5, 0.0]))
  summary = diagnostics.summarize(probes)["shared"]
  encoded = probes.encoded[0]  # per tensor: max, zero and subnormal counts, one-hot
  assert probes.sizes == (2,)  # each hit's elements: the counts are divided when read
  assert float(encoded[0, 1]) == 2.0 and float(encoded[:, 3:].sum()) == 4  # 1 + 1, 2 x 2
  assert summary.hits == 2 and summary.forward.zero_fraction == 0.5  # x[1] = 0 each time
  # Outer hit: 300 (binade 2**8). Inner: 300 * tanh'(tanh(0) = 0) = 300 too.
  assert summary.backward.max_abs == 256.0 and summary.headroom == 7


def test_a_probe_hit_with_tensors_of_two_sizes_averages_each_hits_fractions():
  # One zero of 2 elements, then 3 zeros of 4: fractions 1/2 and 3/4, averaged over hits.
  def loss(w):
    small = pr.probe(w[:2] * jnp.array([1.0, 0.0]), "shared")
    large = pr.probe(w * jnp.array([1.0, 0.0, 0.0, 0.0]), "shared")
    return jnp.sum(small) + jnp.sum(large)

  _, _, probes = with_probes(loss)(jnp.ones(4))
  summary = probes["shared"]
  assert probes.sizes == (None,) and summary.hits == 2
  assert float(summary.forward.zero_fraction) == (1 / 2 + 3 / 4) / 2


@pytest.mark.parametrize("largest, bottom", [
    (3.0, 2.0), (2.0**127 * 1.5, 2.0**127), (np.inf, np.inf), (0.0, 0.0),
    (2.0**-130, 0.0)])  # a float32 subnormal sits in binade 0, below anything float16 holds
def test_a_probe_hit_twice_reports_the_bottom_of_its_top_binade(largest, bottom):
  def loss(w):
    layer = lambda h: pr.probe(h * w, "shared")
    return jnp.sum(layer(layer(jnp.ones(2))) * jnp.array([largest, 0.0], jnp.float32))
  summary = diagnostics.summarize(with_probes(loss)(jnp.float32(1.0))[2])["shared"]
  assert int(summary.hits) == 2 and float(summary.backward.max_abs) == bottom
  assert bool(summary.backward.finite) == np.isfinite(largest)
  bound = probe_stats.largest_gradient(with_probes(loss)(jnp.float32(1.0))[2].encoded)
  with np.errstate(over="ignore"):
    assert float(bound) == float(np.float32(2 * bottom))  # 2**128 is inf in float32


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_tensors_measured_from_bit_patterns_give_the_float_statistics(dtype):
  # The bit-pattern kernel (half the cost of float compares on CPU) changes no number.
  rng = np.random.default_rng(0)
  x = rng.normal(size=(6, 33, 5)) * 10.0 ** rng.integers(-9, 4, size=(6, 33, 5))
  x[0, 0, :2], x[1, 2, 3], x[2, 2, 2] = 0.0, np.inf, 2.0**-20  # zeros, inf, a subnormal
  x, g = jnp.asarray(x, dtype), jnp.asarray(x[::-1] * 1e-3, dtype).at[3, 1, 1].set(jnp.nan)
  for t in (x, g):
    bits, zeros, below_normal = probe_stats.bit_operands(t)
    magnitude = np.where(np.isnan(np.float32(t)), np.inf, np.abs(np.float32(t)))
    np.testing.assert_array_equal(np.float32(probe_stats.as_magnitude(bits, t.dtype)), magnitude)
    np.testing.assert_array_equal(zeros, magnitude == 0)
    np.testing.assert_array_equal(below_normal, magnitude < 2.0**-14)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz,
                                   jnp.float8_e5m2fnuz, jnp.float64])
def test_eight_bit_floats_and_float64_give_the_float_statistics(dtype):
  # float16's smallest normal is 0 in e4m3 (a subnormal fraction of -25%), e4m3fnuz's NaN
  # is a negative zero's bits (read as a zero), and a float64 of 1e300 is not inf.
  x = np.array([0.0, 1.0, 2.0**-9, -3.0, np.nan], np.float32)
  with jax.enable_x64(dtype == jnp.float64):
    t = jnp.asarray(x if dtype != jnp.float64 else x.astype(np.float64) * 1e300, dtype)
    largest, zeros, subnormals = (float(v) for v in probe_stats.values(t, True))
    assert (largest, zeros, subnormals) == (np.inf, float(np.float32(0.2)), 0.0)
    finite = t[:4]
    expected = min(float(jnp.max(jnp.abs(finite.astype(jnp.float64 if dtype == jnp.float64
                                                       else jnp.float32)))),
                   float(np.finfo(np.float32).max))
    assert float(probe_stats.values(finite, True)[0]) == expected
    assert float(probe_stats.values(finite, True)[2]) == 0.0


@pytest.mark.parametrize("shape, kept", [
    ((1024, 64, 64), 1),  # rows of the first axis
    ((1, 2, 8, 2**18), 3),  # enough rows only from the third axis on
    ((4, 2**20), 1),  # few rows, long enough
    ((2**21, 2), 0),  # rows too short: one reduction
    ((1, 1, 2**22), 0),  # one row
    ((2**22,), 0),
    ((1023, 64, 64), 0),  # below the size worth a second kernel
    ((384, 64, 16), 0),
    ((), 0),
])
def test_a_tensor_is_reduced_in_rows_where_they_are_many_long_and_large(shape, kept):
  assert probe_stats._kept_axes(shape) == kept


@pytest.mark.parametrize("shape", [(1024, 64, 64), (1, 2, 8, 2**18), (384, 64, 16), ()])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32])
def test_a_tensor_reduced_in_rows_or_whole_gives_what_numpy_counts(shape, dtype):
  rng = np.random.default_rng(1)
  x = rng.normal(size=shape) * 10.0 ** rng.integers(-10, 3, size=shape)
  x.reshape(-1)[::7] = 0.0
  x = np.asarray(x, dtype)
  if x.size > 1:
    x.reshape(-1)[-1] = np.inf if dtype == jnp.float32 else np.nan  # the last row's last
  magnitude = np.where(np.isnan(np.float32(x)), np.inf, np.abs(np.float32(x)))
  expected = [magnitude.max(), (magnitude == 0).sum(),
              ((magnitude > 0) & (magnitude < 2.0**-14)).sum()]
  np.testing.assert_array_equal(probe_stats.values(jnp.asarray(x), False), expected)
  np.testing.assert_allclose(probe_stats.values(jnp.asarray(x), True),
                             np.array(expected) / [1, x.size, x.size], rtol=1e-7)


@pytest.mark.parametrize("shape, kept", [((7, 5, 9), 1), ((4, 8, 10), 2)])
def test_a_tensor_of_more_elements_than_int32_counts_is_counted_in_rows(monkeypatch, shape,
                                                                       kept):
  # A probed tensor of 2**31 float16 elements (16x2048x65536 logits) wrapped its zero
  # count to a negative one; here the limit is lowered so that a small tensor passes it.
  monkeypatch.setattr(probe_stats, "COUNT_LIMIT", 60)
  rng = np.random.default_rng(2)
  x = np.asarray(rng.normal(size=shape) * 10.0 ** rng.integers(-9, 2, size=shape), np.float16)
  x.reshape(-1)[::5] = 0.0
  magnitude = np.abs(np.float32(x))
  expected = [magnitude.max(), (magnitude == 0).sum(),
              ((magnitude > 0) & (magnitude < 2.0**-14)).sum()]
  assert probe_stats._rows_counted_exactly(shape) == kept  # rows of at most 60 elements
  np.testing.assert_array_equal(jax.jit(probe_stats._reduced, static_argnums=1)(
      jnp.asarray(x), False), expected)
  with pytest.raises(ValueError, match=r"shape \(61,\) has more than 60 elements"):
    probe_stats._rows_counted_exactly((61,))


def test_the_largest_gradient_over_all_probes_bounds_each_as_its_summary_does():
  # Rows of a scan (hit once each, exact), a probe hit twice (its binade's top) and one
  # under vmap (three hits): one computation over all gives what the summaries give.
  def loss(w, x):
    def body(h, i):
      return pr.probe(jnp.tanh(h * w[i]), "row", index=i, length=3), None
    h = jax.lax.scan(body, x, jnp.arange(3))[0]
    h = jax.vmap(lambda r: pr.probe(r * 3.0, "mapped"))(h)
    return jnp.sum(twice(w[0], h[0]) + h * jnp.array([[5.0, 0.0]]))
  _, _, probes = with_probes(loss)(jnp.array([0.5, 1.5, 2.0]), jnp.ones((3, 2)))
  summaries = diagnostics.summarize(probes)
  bounds = [jnp.where(s.hits == 1, s.backward.max_abs, 2 * s.backward.max_abs).max()
            for s in summaries.values()]
  assert [int(s.hits.max()) for s in summaries.values()] == [1, 3, 2]
  assert float(probe_stats.largest_gradient(probes.encoded)) == float(max(bounds)) > 0
  assert float(probe_stats.largest_gradient(probes.encoded[:1])) == float(bounds[0])


def test_reading_probes_compiles_one_program_per_shape_not_one_per_operation_or_size():
  def rows(hits, zeros):  # 13 rows: a shape no other test reads
    encoded = np.zeros((13, 2, probe_stats.WIDTH), np.float32)
    encoded[..., probe_stats.VALUES + 127] = hits
    encoded[..., 1] = zeros
    return jnp.asarray(encoded)

  once, twice, as_fractions = rows(1.0, 3.0), rows(2.0, 3.0), rows(1.0, 0.75)
  with count_compiles() as compiles:
    first = probe_stats.summary(once, 4)
  with count_compiles() as again:
    later = probe_stats.summary(twice, 6)  # another probe: hit twice, of 6 elements
    fractions = probe_stats.summary(as_fractions)  # fractions, not counts
  assert len(compiles) == 1 and again == []
  assert np.asarray(first.hits).tolist() == [1] * 13 and np.asarray(later.hits).tolist() == [2] * 13
  assert np.asarray(first.forward.zero_fraction).tolist() == [0.75] * 13  # 3 of 4
  assert np.asarray(later.forward.zero_fraction).tolist() == [0.25] * 13  # 3 of 2 * 6
  assert np.asarray(fractions.backward.zero_fraction).tolist() == [0.75] * 13
