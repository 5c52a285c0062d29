"""Specification of `all_finite` and `select_tree`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls


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


def test_all_finite_ignores_zero_size_leaves():
  assert bool(jls.all_finite({"empty": jnp.zeros((0, 3)), "w": jnp.ones(2)}))
  assert not bool(jls.all_finite({"empty": jnp.zeros((0,)), "w": jnp.array([jnp.nan])}))


def test_all_finite_ignores_integer_and_non_array_leaves():
  tree = {"i": jnp.array([2**31 - 1]), "b": jnp.array(True), "s": "name", "f": len}
  assert bool(jls.all_finite(tree))


@pytest.mark.parametrize("tree", [{}, None, [None], ((), {})])
def test_all_finite_of_an_empty_tree_is_true(tree):
  result = jls.all_finite(tree)
  assert result.dtype == jnp.bool_ and result.shape == () and bool(result)


def test_select_tree_picks_whole_trees_without_leaking_nan(maybe_jit):
  good = {"m": jnp.ones(3), "count": jnp.array(4, jnp.int32)}
  bad = {"m": jnp.full(3, jnp.nan), "count": jnp.array(5, jnp.int32)}
  select = maybe_jit(jls.select_tree)
  chex.assert_trees_all_equal(select(jnp.array(False), bad, good), good)
  chex.assert_trees_all_equal(select(jnp.array(True), good, bad), good)
  chex.assert_trees_all_equal(select(False, bad, good), good)


def test_select_tree_rejects_a_non_scalar_predicate():
  with pytest.raises(ValueError, match="`pred` must be a scalar"):
    jls.select_tree(jnp.array([True, False]), [jnp.ones(2)], [jnp.ones(2)])


def test_select_tree_rejects_mismatched_leaves():
  with pytest.raises(TypeError, match="same shape and dtype"):
    jls.select_tree(True, [jnp.ones(2)], [jnp.ones(2, jnp.float16)])


def test_select_tree_keeps_non_array_leaves_of_the_first_tree():
  out = jls.select_tree(False, {"f": jax.nn.relu, "x": jnp.ones(1)},
                        {"f": jax.nn.relu, "x": jnp.zeros(1)})
  assert out["f"] is jax.nn.relu and float(out["x"][0]) == 0


# --- the one-pass largest magnitude behind every check ---------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(1,), (9,), (1000,), (3, 333), (333, 3)])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_max_magnitude_is_not_finite_for_a_bad_value_anywhere(dtype, shape, bad):
  from jax_lossscale import _tree

  n = int(np.prod(shape))
  base = np.random.default_rng(n).normal(size=n).astype(np.float32)
  f = jax.jit(_tree.max_magnitude)
  assert float(f(jnp.asarray(base.reshape(shape), dtype))) == float(
      jnp.max(jnp.abs(jnp.asarray(base, dtype))))
  for position in sorted({0, n // 2, n - 1, max(n - 8, 0)}):
    x = base.copy()
    x[position] = bad
    assert not np.isfinite(float(f(jnp.asarray(x.reshape(shape), dtype)))), position


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(4096,), (64, 64), (100_003,), (7, 70_001)])
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf, -jnp.inf])
def test_no_check_loses_a_bad_value_in_a_large_leaf(dtype, shape, bad):
  # XLA:CPU (jax 0.10.2) drops NaN from float32 max-reductions of 4096 elements or
  # more (`jnp.max` returns the largest other value), so no check may rely on a max
  # propagating NaN.
  from jax_lossscale import _tree

  n = int(np.prod(shape))
  checks = {
      "max_magnitude": jax.jit(lambda x: ~jnp.isfinite(_tree.max_magnitude(x))),
      "all_finite": jax.jit(lambda x: ~jls.all_finite({"g": [x]})),
      "per_dtype": jax.jit(lambda x: ~jnp.isfinite(_tree.max_magnitude_per_dtype([x, x])[0])),
  }
  for position in (0, n // 2, n - 1):
    x = jnp.full(n, 0.5, dtype).at[position].set(bad).reshape(shape)
    for name, nonfinite in checks.items():
      assert bool(nonfinite(x)), (name, position)


def test_a_nan_among_thousands_of_leaves_is_not_lost():
  # Per-leaf maxima are combined with one more max-reduction, over as many values.
  leaves = [jnp.full((), 0.5) for _ in range(4100)]
  leaves[1234] = jnp.array(jnp.nan)
  assert not bool(jls.all_finite(leaves))


def test_max_magnitude_of_huge_values_of_both_signs_and_complex_leaves():
  from jax_lossscale import _tree

  # max - min would overflow here; max(max, -min) does not.
  assert float(_tree.max_magnitude(jnp.array([3e38, -3.2e38], jnp.float32))) == float(
      jnp.float32(3.2e38))
  assert float(_tree.max_magnitude(jnp.array([3 + 4j, -1j], jnp.complex64))) == 5.0
  assert _tree.max_magnitude_per_dtype(
      {"a": jnp.ones(3), "b": -2 * jnp.ones(4), "c": jnp.ones(2, jnp.float16), "d": None}
  ) == [2.0, 1.0]


def test_global_norm_is_optax_norm_for_float32_and_squares_narrow_leaves_in_float32():
  from jax_lossscale import _tree

  rng = np.random.default_rng(0)
  f32 = {"a": jnp.asarray(rng.normal(size=(7, 9)), jnp.float32), "b": jnp.arange(5.0)}
  chex.assert_trees_all_equal(_tree.global_norm(f32), optax.tree.norm(f32))
  # float16 squares overflow beyond 256; the norm does not.
  mixed = {"h": jnp.full(4, 300.0, jnp.float16), "i": jnp.arange(3), "n": None, "s": "name"}
  norm = _tree.global_norm(mixed)
  assert norm.dtype == jnp.float32 and float(norm) == 600.0
  assert float(_tree.global_norm({})) == 0.0 and _tree.global_norm({}).dtype == jnp.float32
  assert not np.isfinite(float(_tree.global_norm([jnp.ones(3).at[1].set(jnp.nan)])))


@pytest.mark.parametrize("max_norm", [0.5, 100.0])
def test_clip_by_norm_is_optax_clip_by_global_norm_with_the_norm_given(max_norm):
  from jax_lossscale import _tree

  tree = {"a": jnp.linspace(-3.0, 3.0, 11), "b": jnp.ones((2, 3))}
  expected, _ = optax.clip_by_global_norm(max_norm).update(tree, optax.EmptyState())
  got = jax.jit(lambda t: _tree.clip_by_norm(t, _tree.global_norm(t), max_norm))(tree)
  chex.assert_trees_all_equal(got, jax.jit(lambda t: optax.clip_by_global_norm(
      max_norm).update(t, optax.EmptyState())[0])(tree))
  chex.assert_trees_all_close(got, expected, rtol=1e-6)
  # A float16 leaf is divided in float32: a norm beyond float16's range is fine.
  clipped = _tree.clip_by_norm({"h": jnp.full(2, 3e4, jnp.float16)}, jnp.float32(1e5), max_norm)
  np.testing.assert_allclose(np.float32(clipped["h"]), 3e4 / 1e5 * max_norm, rtol=1e-3)
