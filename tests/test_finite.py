"""Specification of the finiteness check: `all_finite`, its one-pass reduction, agreement."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import count_compiles
from test_numerics import NARROW

import jax_lossscale as jls
from jax_lossscale import _finite
from jax_lossscale import _numerics


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_all_finite_is_false_for_a_single_bad_element(dtype, maybe_jit):
  tree = {"a": jnp.ones((4, 4), dtype), "b": [jnp.ones(7, dtype), None]}
  assert bool(maybe_jit(jls.all_finite)(tree))
  tree["b"][0] = tree["b"][0].at[6].set(jnp.nan)
  assert not bool(maybe_jit(jls.all_finite)(tree))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32, jnp.complex64])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_all_finite_finds_a_bad_value_among_huge_finite_ones(dtype, bad):
  big = jnp.finfo(jnp.float16 if dtype == jnp.complex64 else dtype).max
  tree = [jnp.full((3, 5), big, dtype), jnp.full((3,), -big, dtype)]
  assert bool(jls.all_finite(tree))
  tree[1] = tree[1].at[0].set(bad)
  assert not bool(jls.all_finite(tree))


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_every_narrow_type_counts_finite_values_finite_and_nan_not(dtype):
  # Types without an inf (e4m3fn, ...) used to count as non-finite always: the
  # reduction started from and replaced NaN with inf, which is NaN there.
  x = jnp.array([1.0, 2.0, 0.5], dtype)
  assert bool(jls.all_finite([x])) and bool(jax.jit(jls.all_finite)([x]))
  # float4_e2m1fn has neither inf nor NaN (both saturate to 6).
  if np.isnan(np.float32(jnp.array(jnp.nan, dtype))):
    assert not bool(jls.all_finite([x.at[1].set(jnp.nan)]))
  if np.isinf(np.float32(jnp.array(jnp.inf, dtype))):
    assert not bool(jls.all_finite([x.at[1].set(jnp.inf)]))


def test_python_float_leaves_are_checked():
  # A Python-float NaN among the leaves used to be ignored.
  assert not bool(jls.all_finite({"w": jnp.ones(2), "f": float("nan")}))
  assert not bool(jls.all_finite([1.0, float("inf")]))
  assert bool(jls.all_finite({"w": jnp.ones(2), "f": 2.5, "i": 3}))


def test_the_check_of_narrow_leaves_casts_nothing_to_their_dtype():
  # XLA:GPU drops a cast to float16 that is cast back to float32 (excess precision): an
  # overflow that only the cast shows would go unseen there. Thresholds instead.
  grads = {"h": jnp.ones(8, jnp.float16), "q": jnp.ones(8, jnp.float8_e4m3fn)}
  jaxpr = str(jax.make_jaxpr(
      lambda g, s: _finite.finite(g, _numerics.Rescale.reciprocal(s)))(grads, 0.5))
  assert "new_dtype=float16" not in jaxpr and "float8" not in jaxpr.split("let", 1)[1], jaxpr


def test_finiteness_after_unscaling_by_a_scale_below_one_is_checked_in_the_leaf_dtype():
  # 40000 is finite in float16, but 40000 / 0.5 = 80000 is not.
  grads = {"h": jnp.array([40000.0, 1.0], jnp.float16)}
  assert bool(_finite.finite(grads, _numerics.Rescale.reciprocal(1.0)))
  assert not bool(_finite.finite(grads, _numerics.Rescale.reciprocal(0.5)))


def test_float64_leaves_are_checked_in_float64_under_x64():
  # Their largest magnitudes were cast to float32: 1e300 counted as inf.
  with jax.enable_x64(True):
    big = jnp.array([1e300, -2.0], jnp.float64)
    assert bool(jls.all_finite([big])) and bool(jax.jit(jls.all_finite)([big]))
    assert not bool(jls.all_finite([big.at[1].set(jnp.nan)]))
    tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(4.0))
    updates, state = jax.jit(tx.update)({"w": big * 4}, tx.init({"w": big}))
    assert bool(state.last_applied) and updates["w"].dtype == jnp.float64
    np.testing.assert_array_equal(np.asarray(updates["w"]), -np.asarray(big))


def test_all_finite_ignores_zero_size_integer_and_non_array_leaves():
  assert bool(jls.all_finite({"empty": jnp.zeros((0, 3)), "w": jnp.ones(2)}))
  assert not bool(jls.all_finite({"empty": jnp.zeros((0,)), "w": jnp.array([jnp.nan])}))
  tree = {"i": jnp.array([2**31 - 1]), "b": jnp.array(True), "s": "name", "f": len}
  assert bool(jls.all_finite(tree))


@pytest.mark.parametrize("tree", [{}, None, [None], ((), {})])
def test_all_finite_of_an_empty_tree_is_true(tree):
  result = jls.all_finite(tree)
  assert result.dtype == jnp.bool_ and result.shape == () and bool(result)


# Jitted once for the module: parametrizations with the same shapes share compilations.
LARGEST = jax.jit(_finite.largest_magnitude)
NONFINITE_CHECKS = {
    "largest_magnitude": jax.jit(lambda x: ~jnp.isfinite(_finite.largest_magnitude(x))),
    "all_finite": jax.jit(lambda x: ~jls.all_finite({"g": [x]})),
    "per_dtype": jax.jit(lambda x: ~_finite.finite([x, x])),
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (9,), (1000,), (3, 333), (333, 3)])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_largest_magnitude_is_not_finite_for_a_bad_value_anywhere(dtype, shape, bad):
  n = int(np.prod(shape))
  base = np.random.default_rng(n).normal(size=n).astype(np.float32)
  assert float(LARGEST(jnp.asarray(base.reshape(shape), dtype))) == float(
      jnp.max(jnp.abs(jnp.asarray(base, dtype))))
  for position in sorted({0, n // 2, n - 1, max(n - 8, 0)}):
    x = base.copy()
    x[position] = bad
    assert not np.isfinite(float(LARGEST(jnp.asarray(x.reshape(shape), dtype)))), position


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4096,), (64, 64), (100_003,), (7, 70_001)])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_no_check_loses_a_bad_value_in_a_large_leaf(dtype, shape, bad):
  # XLA:CPU (jax 0.10.2) drops NaN from float32 max-reductions of 4096 elements or more
  # (`jnp.max` returns the largest other value), so no check may rely on a max
  # propagating NaN.
  n = int(np.prod(shape))
  for position in (0, n // 2, n - 1):
    x = jnp.full(n, 0.5, dtype).at[position].set(bad).reshape(shape)
    for name, nonfinite in NONFINITE_CHECKS.items():
      assert bool(nonfinite(x)), (name, position)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_leaves_reduced_in_rows_lose_no_bad_value(dtype, bad):
  # Leaves of 2**20 elements or more are reduced as 4 rows plus a remainder.
  n = (1 << 20) + 3
  check = NONFINITE_CHECKS["largest_magnitude"]
  base = jnp.full(n, 0.5, dtype).at[12345].set(-7.0)
  assert float(_finite.largest_magnitude(base)) == 7.0
  for position in (0, n // 4 - 1, n // 4, n // 2, 3 * (n // 4), n - 4, n - 1):
    assert bool(check(base.at[position].set(bad))), position


def test_a_nan_among_thousands_of_leaves_is_not_lost():
  # Per-leaf maxima are combined with one more max-reduction, over as many values.
  leaves = [np.float32(0.5)] * 4100
  leaves[1234] = np.float32(np.nan)
  assert not bool(jls.all_finite(jax.device_put(leaves)))


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_small_leaves_are_checked_together_and_no_bad_value_is_lost(bad, where):
  # Leaves below 4096 elements are concatenated, 64 at a time (and at most 2**20
  # elements), into one reduction each; a large leaf is checked on its own.
  leaves = [np.full((16, 16), 0.25 * (i % 7 + 1), np.float32) for i in range(1000)]
  leaves.append(np.ones(1 << 16, np.float32))
  index = {"first": 0, "middle": 64 * 7, "last": 999}[where]
  leaves[index] = leaves[index].copy()
  leaves[index][3, 5] = bad
  leaves = jax.device_put(leaves)
  assert not bool(jls.all_finite(leaves))
  largest = dict(_finite.largest_magnitudes(leaves))
  assert not np.isfinite(float(largest[jnp.dtype(jnp.float32)]))


def test_largest_magnitudes_are_exact_per_dtype():
  leaves = {"a": jnp.ones(3), "b": -2 * jnp.ones(4), "c": jnp.ones(2, jnp.float16),
            "d": None, "e": jnp.zeros((0, 3)), "f": jnp.full(70_000, -3.0)}
  assert [(d.name, float(m)) for d, m in _finite.largest_magnitudes(leaves)] == [
      ("float32", 3.0), ("float16", 1.0)]
  # max - min would overflow here; max(max, -min) does not.
  assert float(_finite.largest_magnitude(jnp.array([3e38, -3.2e38], jnp.float32))) == float(
      jnp.float32(3.2e38))


@pytest.mark.parametrize("bad", [None, jnp.nan, jnp.inf, -jnp.inf])
def test_both_forms_of_the_check_give_the_same_largest_magnitudes(branch, bad):
  # On CPU small leaves are concatenated and large ones reduced in rows; elsewhere each
  # leaf is reduced alone: the same answer, exactly.
  leaves = [jnp.full((1 << 18) + 3, -2.5), *[jnp.full((16, 16), 1.5 + i) for i in range(70)],
            jnp.array([3e38 + 1j, -2 - 3.2e38j], jnp.complex64), jnp.ones(5, jnp.float16),
            jnp.zeros((0, 3)), jnp.array(-7.0)]
  if bad is not None:
    leaves[0] = leaves[0].at[(1 << 18) + 1].set(bad)
    leaves[3] = leaves[3].at[2, 2].set(bad)
  largest = [(d.name, float(m)) for d, m in _finite.largest_magnitudes(leaves)]
  assert largest == [("float32", 70.5 if bad is None else np.inf),
                     ("complex64", float(jnp.float32(3.2e38))), ("float16", 1.0)]


def test_complex_leaves_are_checked_component_by_component():
  # |z| of two finite components can overflow; each component's magnitude cannot.
  z = jnp.array([3e38 + 3e38j, 1 - 2j], jnp.complex64)
  assert float(_finite.largest_magnitude(z)) == float(jnp.float32(3e38))
  assert bool(jls.all_finite([z]))
  assert not bool(jls.all_finite([z.at[1].set(complex(1, np.inf))]))
  assert not bool(jls.all_finite([z.at[0].set(complex(np.nan, 0))]))


def test_eager_all_finite_compiles_once_per_tree_shape():
  # Outside jit, each call used to rebuild (and recompile) the reduction.
  tree = [jnp.ones(7) * i for i in range(200)]
  jls.all_finite(tree)
  with count_compiles() as compiles:
    for _ in range(3):
      assert bool(jls.all_finite(tree))
  assert not compiles


def test_outside_shard_map_and_pmap_flags_are_not_agreed():
  flag = jnp.array(False)
  assert _finite.manual_axes(flag) == () and _finite.agree([flag]) == [flag]


def test_under_a_named_vmap_every_replica_gets_the_same_answer_as_under_pmap():
  # vmap(..., axis_name=) is pmap on one device: its replicas agree by default.
  trees = {"g": jnp.array([[1.0, 2.0], [jnp.nan, 1.0], [3.0, 4.0]])}
  assert jax.vmap(jls.all_finite, axis_name="b")(trees).tolist() == [False] * 3
  assert jax.vmap(jls.all_finite)(trees).tolist() == [True, False, True]
  nested = jax.vmap(jax.vmap(jls.all_finite, axis_name="i"), axis_name="o")
  assert nested({"g": jnp.array([[1.0, 2.0], [3.0, jnp.inf]])}).tolist() == [[False] * 2] * 2


@pytest.mark.parametrize("none", [(), []])
def test_an_empty_axis_name_agrees_over_no_axis(none):
  trees = {"g": jnp.array([[1.0, 2.0], [jnp.nan, 1.0], [3.0, 4.0]])}
  flags = jax.vmap(lambda t: jls.all_finite(t, axis_name=none), axis_name="b")(trees)
  assert flags.tolist() == [True, False, True]


def test_an_axis_name_that_is_not_mapped_is_refused_naming_axis_name():
  with pytest.raises(ValueError, match="`axis_name`.*'data'"):
    jax.jit(lambda g: jls.all_finite(g, axis_name="data"))(jnp.ones(2))
