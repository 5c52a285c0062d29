"""`autocast(..., fp8=recipe)`: current-scaled float8 matmuls, forward and backward.

Dtypes are asserted on the traced program (the float8 operands and float32 result of the
forward matmul and of both backward matmuls), numbers against float32, and composition
with JAX's transformations, flax, equinox and loss scaling.
"""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx
from jax import lax

import jax_lossscale as jls
from jax_lossscale import _fp8
from jax_lossscale import _jax_internals as internals

E4M3, E5M2 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)
F32, BF16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16)
KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (32, 64))
W = jax.random.normal(KEYS[1], (64, 48)) / 8
C = jax.random.normal(KEYS[2], (32, 48))
# The targets' matmul: 256x1024 by 1024x512, N(0, 1).
BIG_X = jax.random.normal(KEYS[0], (256, 1024))
BIG_W = jax.random.normal(KEYS[1], (1024, 512))
RECIPES = ("tensorwise", "rowwise")


def loss(x, w):
  return jnp.sum((x @ w) * C)


def relative_error(approximate, reference):
  approximate, reference = np.asarray(approximate, np.float64), np.asarray(reference, np.float64)
  return np.linalg.norm(approximate - reference) / np.linalg.norm(reference)


def float8_dots(program, primitive="dot_general"):
  """`(lhs dtype, rhs dtype, preferred_element_type)` of every `primitive` (a
  `dot_general`) with float8 operands in `program` and the programs inside it."""
  found = []
  for eqn in internals.equations(program):
    for inner in internals.programs(eqn):
      found += float8_dots(inner, primitive)
    if internals.primitive_name(eqn) == primitive:
      lhs, rhs = map(internals.dtype_of, internals.operands(eqn))
      if lhs.itemsize == 1:
        found.append((lhs, rhs, np.dtype(eqn.params["preferred_element_type"])))
  return found


def grads(fun, *args):
  return jax.jit(jax.grad(fun, argnums=tuple(range(len(args)))))(*args)


# --- what runs in float8 --------------------------------------------------------------


def test_tensorwise_runs_e4m3_forward_and_the_gradient_in_e5m2_backward_with_float32_results():
  program = jax.make_jaxpr(jax.grad(jls.autocast(loss, jnp.bfloat16, fp8="tensorwise"),
                                    argnums=(0, 1)))(X, W)
  assert sorted(float8_dots(program), key=str) == sorted(
      [(E4M3, E4M3, F32), (E5M2, E4M3, F32), (E5M2, E4M3, F32)], key=str)


def test_rowwise_runs_e4m3_in_all_three_matmuls_with_float32_results():
  program = jax.make_jaxpr(jax.grad(jls.autocast(loss, jnp.bfloat16, fp8="rowwise"),
                                    argnums=(0, 1)))(X, W)
  assert float8_dots(program) == [(E4M3, E4M3, F32)] * 3


def test_precision_summary_shows_the_float8_matmuls_forward_and_backward():
  summary = jls.precision_summary(jls.autocast(loss, jnp.bfloat16, fp8="tensorwise"), X, W)
  assert summary.count("dot_general", E4M3) == 1
  assert summary.count("dot_general", E5M2, backward=True) == 2
  assert summary.count("dot_general", BF16) + summary.count("dot_general", BF16, True) == 0
  assert "float8_e5m2" in str(summary)


def users_of(program, eqn):
  """`(primitive, result dtype)` of each equation of `program` reading a result of `eqn`."""
  results = internals.results(eqn)
  return [(internals.primitive_name(e), internals.dtype_of(internals.results(e)[0]))
          for e in internals.equations(program)
          if any(v is r for v in internals.operands(e) for r in results)]


def test_the_float8_matmul_returns_compute_dtype_and_the_function_keeps_its_dtypes():
  f = jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8="tensorwise")
  program = jax.make_jaxpr(f)(X, W)
  assert f(X, W).dtype == F32
  [call] = [e for e in internals.equations(program)
            if internals.primitive_name(e) == "custom_vjp_call"]
  assert [internals.dtype_of(v) for v in internals.results(call)] == [F32]  # scales divided out
  assert users_of(program, call) == [("convert_element_type", BF16)]


def test_a_float32_preferred_element_type_on_compute_dtype_operands_is_kept():
  f = lambda a, b: jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32)
  a, b = X.astype(BF16), W.astype(BF16)
  out = jls.autocast(f, jnp.bfloat16, fp8="tensorwise")(a, b)
  assert out.dtype == F32
  assert not jnp.all(out == out.astype(BF16).astype(F32))  # not rounded to bfloat16 between
  assert relative_error(out, f(a, b)) < 0.05
  summary = jls.precision_summary(
      jls.autocast(lambda a, b: f(a, b) * 3.0, jnp.bfloat16, fp8="tensorwise"), a, b)
  assert summary.count("mul", F32) >= 1 and summary.count("mul", BF16) == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_gradients_of_float32_inputs_are_float32(recipe):
  assert [g.dtype for g in grads(jls.autocast(loss, jnp.bfloat16, fp8=recipe), X, W)] == [F32] * 2


def test_without_fp8_autocast_runs_matmuls_in_compute_dtype_as_before():
  summary = jls.precision_summary(jls.autocast(loss, jnp.bfloat16), X, W)
  assert summary.count("dot_general", BF16) == 1
  assert summary.count("dot_general", E4M3) == 0


@pytest.mark.parametrize("shapes", [((32, 40), (40, 48)), ((8, 64), (64, 48)),
                                    ((32, 64), (64, 8))], ids=["k=40", "m=8", "n=8"])
def test_a_matmul_with_a_size_not_a_multiple_of_16_stays_in_compute_dtype(shapes):
  x, w = jnp.ones(shapes[0]), jnp.ones(shapes[1])
  summary = jls.precision_summary(jls.autocast(lambda x, w: jnp.sum(x @ w), jnp.bfloat16,
                                               fp8="tensorwise"), x, w)
  assert summary.count("dot_general", BF16) == 1
  assert summary.count("dot_general", E4M3) == 0


def test_batch_dimensions_do_not_count_in_the_contractions_size():
  x, w = jnp.ones((4, 32, 40)), jnp.ones((4, 40, 48))  # 4 x 40 = 160, a multiple of 16
  summary = jls.precision_summary(jls.autocast(lambda x, w: jnp.sum(x @ w), jnp.bfloat16,
                                               fp8="tensorwise"), x, w)
  assert summary.count("dot_general", BF16) == 1


def test_an_unknown_recipe_name_is_refused_naming_name():
  with pytest.raises(ValueError, match="`name`.*'columnwise'"):
    jls.Float8Recipe.from_name("columnwise")


def test_a_matmul_below_min_size_stays_in_compute_dtype():
  recipe = jls.Float8Recipe.from_name("tensorwise", min_size=64)
  summary = jls.precision_summary(jls.autocast(loss, jnp.bfloat16, fp8=recipe), X, W)
  assert summary.count("dot_general", BF16) == 1  # 48 columns


def test_a_matmul_with_an_integer_operand_stays_as_autocast_runs_it():
  w = jnp.ones((64, 48), jnp.int8)
  f = jls.autocast(lambda x, w: lax.dot_general(x, w, (((1,), (0,)), ((), ())),
                                                preferred_element_type=jnp.float32),
                   jnp.bfloat16, fp8="tensorwise")
  program = jax.make_jaxpr(f)(X, w)
  assert float8_dots(program) == []


def test_an_embedding_lookup_is_no_matmul_and_stays_a_gather_of_the_table():
  table = jax.random.normal(KEYS[3], (64, 32))
  summary = jls.precision_summary(jls.autocast(lambda t: jnp.sum(t[jnp.arange(16)] @ t.T),
                                               jnp.bfloat16, fp8="tensorwise"), table)
  assert summary.count("gather", F32) == 1
  assert summary.count("dot_general", E4M3) == 1


def test_filter_fn_keeps_the_matmuls_it_refuses_in_compute_dtype_by_name_scope():
  def two_layers(x, w):
    with jax.named_scope("body"):
      h = x @ w
    with jax.named_scope("head"):
      return jnp.sum((h @ w.T) ** 2)

  asked = []

  def filter_fn(matmul):
    asked.append(matmul)
    return "head" not in matmul.name_scope

  recipe = jls.Float8Recipe.from_name("tensorwise", filter_fn=filter_fn)
  summary = jls.precision_summary(jls.autocast(two_layers, jnp.bfloat16, fp8=recipe), X, W)
  assert summary.count("dot_general", E4M3) == 1
  assert summary.count("dot_general", BF16) == 1
  assert jls.Float8Matmul("body", (32, 64), (64, 48)) in asked
  assert jls.Float8Matmul("head", (32, 48), (48, 64)) in asked


def test_an_einsum_and_a_batched_matmul_run_in_float8():
  x, w = jax.random.normal(KEYS[0], (4, 32, 64)), jax.random.normal(KEYS[1], (4, 64, 48))
  f = jls.autocast(lambda x, w: jnp.sum(jnp.einsum("bij,bjk->bki", x, w) + jnp.matmul(x, w)
                                        .transpose(0, 2, 1)), jnp.bfloat16, fp8="rowwise")
  assert jls.precision_summary(f, x, w).count("dot_general", E4M3) == 2


# --- the numbers ------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("magnitude", [1.0, 1e-6, 1e4])
def test_the_matmuls_error_is_float8s_at_any_magnitude(recipe, magnitude):
  x = BIG_X * magnitude
  out = jax.jit(jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8=recipe))(x, BIG_W)
  error = relative_error(out, x @ BIG_W)
  assert 0.02 < error < 0.05  # float8's error, where bfloat16's is 0.003


def test_beside_an_outlier_row_rowwise_keeps_the_others_at_float8s_error_tensorwise_does_not():
  x = BIG_X.at[0].multiply(1e5)
  errors = {recipe: relative_error(jax.jit(jls.autocast(
      lambda x, w: x @ w, jnp.bfloat16, fp8=recipe))(x, BIG_W)[1:], (x @ BIG_W)[1:])
            for recipe in RECIPES}
  assert errors["rowwise"] < 0.05
  assert errors["tensorwise"] > 0.2


@pytest.mark.parametrize("recipe, limit", [("tensorwise", 0.07), ("rowwise", 0.05)])
def test_gradients_are_within_float8s_error_of_float32s(recipe, limit):
  x, w = BIG_X[:128, :256], BIG_W[:256, :128]
  c = jax.random.normal(KEYS[2], (128, 128))
  f = lambda x, w: jnp.sum((x @ w) * c)
  expected = grads(f, x, w)
  for got, want in zip(grads(jls.autocast(f, jnp.bfloat16, fp8=recipe), x, w), expected,
                       strict=True):
    assert 0.01 < relative_error(got, want) < limit


def test_rowwise_scales_are_powers_of_two_rounded_down_and_divided_out_exactly():
  amax = jnp.array([1.0, 3.0, 1e-30, 100.0, 0.0, jnp.inf, jnp.nan, 3e38, 448.0, 449.0])
  factor, inverse = map(np.asarray, _fp8.scale(amax, E4M3, power_of_two=True))
  np.testing.assert_array_equal(
      factor, [256.0, 128.0, 2.0 ** 108, 4.0, 1.0, 1.0, 1.0, 2.0 ** -120, 0.5, 0.5])
  np.testing.assert_array_equal(inverse, 1 / factor)


def test_rowwise_scales_are_the_largest_powers_of_two_that_keep_each_amax_inside():
  # Every float32 mantissa near 448's and across octaves: floor(log2(448 / amax)), exactly.
  bits = np.random.default_rng(1).integers(0x00800000, 0x7F800000, 100000).astype(np.uint32)
  amax = np.concatenate([bits.view(np.float32), np.float32(448 * (1 - 2**-20))
                         * np.float32(2.0) ** np.arange(-100, 100, dtype=np.float32)])
  factor, inverse = map(np.asarray, _fp8.scale(jnp.asarray(amax), E4M3, power_of_two=True))
  scaled = (amax.astype(np.float64) * factor)[(factor != 1) & (factor < 2.0**126)]
  assert np.all(scaled <= 448 * (1 - 2**-20)) and np.all(scaled > 224 * (1 - 2**-20))
  np.testing.assert_array_equal(np.log2(factor), np.round(np.log2(factor)))
  np.testing.assert_array_equal(inverse * factor, 1.0)


def test_a_zero_or_non_finite_amax_gives_scale_one():
  for power_of_two in (False, True):
    factor, inverse = _fp8.scale(jnp.array([0.0, jnp.inf, jnp.nan, -jnp.nan]), E4M3,
                                 power_of_two)
    np.testing.assert_array_equal(factor, [1.0, 1.0, 1.0, 1.0])
    np.testing.assert_array_equal(inverse, [1.0, 1.0, 1.0, 1.0])


def test_a_tiny_amax_takes_the_largest_scale_whose_inverse_is_a_normal_float():
  # An inverse below 2**-126 would be flushed to zero (XLA:CPU flushes subnormals): both
  # ways, scales stop at 2**126, the tensor still inside the format, not up to its largest.
  amax = jnp.array([1e-40, 2e-36, 1e-30])
  for power_of_two in (False, True):
    factor, inverse = map(np.asarray, _fp8.scale(amax, E4M3, power_of_two))
    np.testing.assert_array_equal(factor[:2], [2.0**126, 2.0**126])
    np.testing.assert_array_equal(inverse[:2], [2.0**-126, 2.0**-126])
    assert factor[2] * 1e-30 == pytest.approx(448, rel=1e-5 if not power_of_two else 0.5)
  np.testing.assert_array_equal(factor, [2.0**126, 2.0**126, 2.0**108])  # powers of two
  np.testing.assert_array_equal(inverse * factor, 1.0)
  x = jnp.full((32, 64), 2e-36).at[1:].set(1.0)  # one row of tiny values
  out = jls.autocast(lambda x, w: x @ w, jnp.float32, fp8="rowwise")(x, jnp.ones((64, 16)))
  assert float(out[0, 0]) == pytest.approx(64 * 2e-36, rel=0.1)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", _fp8.Float8Recipe("row")])
def test_a_matmul_of_values_below_5e_36_is_not_flushed_to_zero(recipe):
  # Tiny activations times huge weights: a finite float32 product of about 3e-6, at
  # float8's error with every recipe (before, "tensorwise" gave all zeros).
  x = jax.random.normal(jax.random.key(0), (32, 64)) * 1e-37
  w = jax.random.normal(jax.random.key(1), (64, 32)) * 1e30
  out = jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8=recipe)(x, w)
  reference = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
  error = np.linalg.norm(np.asarray(out, np.float64) - reference) / np.linalg.norm(reference)
  assert error < 0.06


@pytest.mark.parametrize("power_of_two", [False, True])
def test_the_largest_value_scales_to_at_most_the_formats_largest(power_of_two):
  amax = jnp.abs(jax.random.normal(KEYS[3], (10000,))) * 1e3
  factor, inverse = _fp8.scale(amax, E4M3, power_of_two)
  assert float(jnp.max(amax * factor)) <= 448.0
  assert float(jnp.min(amax * factor)) > (224.0 if power_of_two else 447.99)
  np.testing.assert_allclose(factor * inverse, 1.0, rtol=0 if power_of_two else 3e-7)


def test_current_scaling_never_saturates():
  values, _, _ = _fp8.scaled(BIG_X * 3.7, E4M3, (1,), jls.Float8Recipe.from_name("tensorwise"))
  assert float(jnp.max(jnp.abs(values))) <= 448.0


def test_a_matmul_of_zeros_is_zero():
  out = jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8="tensorwise")(jnp.zeros((32, 64)), W)
  np.testing.assert_array_equal(out, 0.0)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_non_finite_operand_gives_a_non_finite_product_and_the_next_call_is_exact_again(recipe):
  f = jax.jit(jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8=recipe))
  assert not np.all(np.isfinite(f(X.at[0, 0].set(jnp.inf), W)))
  assert relative_error(f(X, W), X @ W) < 0.05


# --- composition -----------------------------------------------------------------------


def assert_fp8_gradients_close(fun, *args, limit=0.25):
  """float8 gradients within `limit` of float32's: float8's error (0.04-0.06 per matmul,
  pinned above) compounds over layers, and a bias's gradient sums cancelling terms."""
  expected = grads(fun, *args)
  got = grads(jls.autocast(fun, jnp.bfloat16, fp8="tensorwise"), *args)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    assert g.dtype == e.dtype
    assert relative_error(g, e) < limit
  summary = jls.precision_summary(jls.autocast(fun, jnp.bfloat16, fp8="tensorwise"), *args)
  assert summary.count("dot_general", E4M3) >= 1
  assert summary.count("dot_general", E5M2, backward=True) >= 2


def test_fp8_under_vmap():
  xs = jnp.stack([X, 2 * X])
  assert_fp8_gradients_close(lambda xs, w: jnp.sum(jax.vmap(lambda x: (x @ w) * C)(xs)), xs, W)


def test_vmap_of_an_fp8_function():
  xs = jnp.stack([X, X / 3])
  f = jls.autocast(lambda x, w: x @ w, jnp.bfloat16, fp8="rowwise")
  out = jax.vmap(f, in_axes=(0, None))(xs, W)
  assert relative_error(out, jnp.einsum("bij,jk->bik", xs, W)) < 0.05


def test_vmap_of_a_per_example_fp8_function_warns_that_it_ran_no_float8_matmul():
  per_example = jls.autocast(lambda x, w: jnp.tanh(x @ w), jnp.bfloat16, fp8="tensorwise")
  with pytest.warns(UserWarning, match=r"ran no matmul in float8; it refused 1 for their sizes "
                    r"\(64 by 64x48\).*Under jax.vmap, autocast sees one example's shapes"):
    jax.vmap(per_example, in_axes=(0, None))(X, W)
  batched = jls.autocast(lambda xs, w: jax.vmap(lambda x: jnp.tanh(x @ w))(xs), jnp.bfloat16,
                         fp8="tensorwise")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    summary = jls.precision_summary(batched, X, W)
  assert summary.count("dot_general", E4M3) == 1


def test_an_inner_fp8_autocasts_float8_matmuls_count_for_the_outer_one():
  inner = jls.autocast(lambda x, w: jnp.tanh(x @ w), jnp.bfloat16, fp8="tensorwise")
  outer = jls.autocast(lambda x, w, head: jnp.sum(inner(x, w) @ head), jnp.bfloat16,
                       fp8="tensorwise")
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jax.grad(outer, argnums=(1, 2))(X, W, jnp.ones((48, 10)))  # the head: 10 columns


def test_fp8_inside_a_scan():
  def f(x, w):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=3)
    return jnp.sum(h * X[:, :1])

  assert_fp8_gradients_close(f, X, jax.random.normal(KEYS[3], (64, 64)) / 8)


def test_fp8_inside_a_cond_and_a_checkpoint():
  def f(x, w):
    h = jax.checkpoint(lambda x: jnp.tanh(x @ w))(x)
    return jnp.sum(lax.cond(jnp.sum(x) > -1e9, lambda h: h * C, lambda h: -h * C, h))

  assert_fp8_gradients_close(f, X, W)


def test_a_custom_jvp_rules_matmuls_run_in_compute_dtype_and_the_function_differentiates():
  @jax.custom_jvp
  def dense_tanh(x, w):
    return jnp.tanh(x @ w)

  @dense_tanh.defjvp
  def rule(primals, tangents):  # matmuls of the tangents, which reverse mode transposes
    (x, w), (x_dot, w_dot) = primals, tangents
    y = dense_tanh(x, w)
    return y, (1 - y * y) * (x_dot @ w + x @ w_dot)

  f = lambda x, w: jnp.sum(dense_tanh(x, w) * C)
  expected = grads(f, X, W)
  got = grads(jls.autocast(f, jnp.bfloat16, fp8="tensorwise"), X, W)
  for g, e in zip(got, expected, strict=True):
    assert g.dtype == F32
    assert relative_error(g, e) < 0.02  # bfloat16's error: the rule's matmuls
  summary = jls.precision_summary(jls.autocast(f, jnp.bfloat16, fp8="tensorwise"), X, W)
  assert summary.count("dot_general", E4M3) == 1  # the function's own, forward
  assert summary.count("dot_general", BF16, backward=True) >= 2  # the rule's, transposed
  assert summary.count("dot_general", E5M2, backward=True) == 0


def test_fp8_with_a_flax_linen_model():
  model = linen.Sequential([linen.Dense(64), linen.relu, linen.Dense(48)])
  params = model.init(KEYS[3], X)
  assert_fp8_gradients_close(lambda p, x: jnp.sum(model.apply(p, x) * C), params, X)


def test_fp8_with_a_flax_nnx_model():
  model = nnx.Linear(64, 48, rngs=nnx.Rngs(0))
  f = jls.autocast(lambda m, x: jnp.sum(m(x) * C), jnp.bfloat16, fp8="tensorwise")
  got = jax.tree.leaves(nnx.grad(f)(model, X))
  expected = jax.tree.leaves(nnx.grad(lambda m, x: jnp.sum(m(x) * C))(model, X))
  for g, e in zip(got, expected, strict=True):
    assert g.dtype == F32
    assert relative_error(g, e) < 0.08


def test_fp8_with_an_equinox_model():
  model = eqx.nn.MLP(64, 48, 64, 1, key=KEYS[3])
  f = lambda m, x: jnp.sum(jax.vmap(m)(x) * C)
  got = eqx.filter_grad(jls.autocast(f, jnp.bfloat16, fp8="rowwise"))(model, X)
  expected = eqx.filter_grad(f)(model, X)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    assert relative_error(g, e) < 0.25  # two layers (see assert_fp8_gradients_close)


def test_autocast_around_grad_runs_the_backward_matmuls_in_the_forward_formats():
  f = jls.autocast(jax.grad(loss, argnums=(0, 1)), jnp.bfloat16, fp8="tensorwise")
  assert float8_dots(jax.make_jaxpr(f)(X, W)) == [(E4M3, E4M3, F32)] * 3  # forward, backward
  for got, want in zip(f(X, W), grads(loss, X, W), strict=True):
    assert relative_error(got, want) < 0.05


def fp8_grads_at_scale(scale_value):
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(scale_value))
  grad_fn = jls.scaled_value_and_grad(jls.autocast(loss, jnp.bfloat16, fp8="tensorwise"),
                                      argnums=(0, 1))
  _, scaled = jax.jit(grad_fn)(tx.init((X, W)), X, W)
  return jax.tree.map(lambda g: g / scale_value, scaled)


def test_a_power_of_two_loss_scale_leaves_the_fp8_gradients_unchanged():
  for got, want in zip(fp8_grads_at_scale(2.0 ** 15), fp8_grads_at_scale(1.0), strict=True):
    np.testing.assert_array_equal(got, want)


def test_an_overflowed_fp8_step_is_skipped_and_the_next_one_applies():
  tx = jls.loss_scaling(optax.sgd(1e-3))
  grad_fn = jls.scaled_value_and_grad(jls.autocast(loss, jnp.bfloat16, fp8="tensorwise"),
                                      argnums=1)

  @jax.jit
  def step(w, opt_state, x):
    value, g = grad_fn(opt_state, x, w)
    w, opt_state = tx.apply_gradients(g, opt_state, w, loss=value)
    return w, opt_state

  opt_state = tx.init(W)
  w, opt_state = step(W, opt_state, X.at[3, 5].set(jnp.inf))
  assert int(jls.metrics(opt_state)["skipped_steps"]) == 1
  np.testing.assert_array_equal(w, W)
  w, opt_state = step(w, opt_state, X)
  assert int(jls.metrics(opt_state)["skipped_steps"]) == 1
  assert np.all(np.isfinite(w)) and not np.array_equal(w, W)


# --- refused arguments -------------------------------------------------------------------


def test_an_unknown_recipe_is_refused_naming_fp8():
  with pytest.raises(ValueError, match="`fp8`.*'columnwise'"):
    jls.autocast(loss, jnp.bfloat16, fp8="columnwise")


def test_an_fp8_argument_of_another_type_is_refused():
  with pytest.raises(TypeError, match="`fp8`.*True"):
    jls.autocast(loss, jnp.bfloat16, fp8=True)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, "float8_e5m2"])
def test_a_float8_compute_dtype_is_refused(dtype):
  with pytest.raises(ValueError, match=r"`compute_dtype` must not be a float of 8 bits or fewer "
                     r"\(float16, bfloat16 or float32\), got .*float8"):
    jls.autocast(loss, dtype, fp8="tensorwise")
  with pytest.raises(ValueError, match=r"\(float16, bfloat16, float32 or float64\)"):
    jls.autocast(loss, dtype)  # without fp8, float64 is allowed


def test_a_float4_compute_dtype_is_not_called_a_float8_one():
  with pytest.raises(ValueError, match=r"`compute_dtype` must not be a float of 8 bits or fewer "
                     r".*got dtype\(float4_e2m1fn\)"):
    jls.autocast(loss, jnp.float4_e2m1fn)


def test_a_float64_compute_dtype_is_refused_with_fp8():
  with pytest.raises(ValueError, match="`compute_dtype` must be float16, bfloat16 or float32 "
                     "with `fp8`, got dtype.'float64'."):
    jls.autocast(loss, jnp.float64, fp8="tensorwise")
  jls.autocast(loss, jnp.float64)  # without fp8, as before


def test_an_integer_compute_dtype_is_refused_with_floating_examples():
  with pytest.raises(ValueError, match=r"`compute_dtype` must be a floating dtype \(jnp.float16, "
                     r"jnp.bfloat16, 'float32', ...\)"):
    jls.autocast(loss, jnp.int8, fp8="tensorwise")


@pytest.mark.parametrize("argument", ["lhs_format", "rhs_format", "grad_format"])
def test_a_format_that_is_not_float8_is_refused_naming_it(argument):
  with pytest.raises(ValueError, match=f"`{argument}`.*bfloat16"):
    jls.Float8Recipe(**{argument: jnp.bfloat16})


@pytest.mark.parametrize("name", ["float8_e8m0fnu", "float4_e2m1fn"])
def test_a_byte_sized_format_that_is_not_a_signed_float8_is_refused(name):
  # e8m0 (an MX scale format) has no sign and no zero: every product would be NaN.
  with pytest.raises(ValueError, match=f"`lhs_format`.*signed float8.*{name}"):
    jls.Float8Recipe(lhs_format=getattr(jnp, name))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_second_derivative_through_a_float8_matmul_is_refused_not_wrong(recipe):
  # JAX's own rule would cast the tangents to float8 unscaled: zeros, or NaN.
  x, w = jnp.ones((32, 64)), jnp.ones((64, 32))
  grad_of_w = jax.grad(jls.autocast(lambda x, w: jnp.sum(x @ w), jnp.bfloat16, fp8=recipe),
                       argnums=1)
  penalty = lambda w: jnp.sum(grad_of_w(x, w) ** 2)
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.grad(penalty)(w)
  loss = jls.autocast(lambda w: jnp.sum(jnp.tanh(x @ w) ** 2), jnp.bfloat16, fp8=recipe)
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.hessian(loss)(w[:, :16])
  with pytest.raises(NotImplementedError, match="differentiated twice"):  # a Hessian-vector product
    jax.jvp(jax.grad(loss), (w,), (jnp.ones_like(w),))
  # The forward rule inside an outer derivative: an inner vjp's output, an inner grad's aux.
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.grad(lambda w: jax.vjp(loss, w)[0])(w)
  aux = lambda w: jax.grad(lambda v: (jnp.sum(v**2), loss(v)), has_aux=True)(w)[1]
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.grad(aux)(w)


def test_a_finite_product_of_a_huge_operand_stays_finite():
  x = jnp.full((32, 64), 1e36, jnp.float32).at[0].set(1.0)
  w = jnp.full((64, 32), 1e-3, jnp.float32)
  for recipe in ("tensorwise", "rowwise"):
    out = jax.jit(jls.autocast(lambda x, w: x @ w, jnp.float32, fp8=recipe))(x, w)
    assert np.all(np.isfinite(out)), recipe


def test_an_unknown_granularity_is_refused():
  with pytest.raises(ValueError, match="`granularity`.*'column'"):
    jls.Float8Recipe(granularity="column")


@pytest.mark.parametrize("value", ["no", None, 0.5, 1])
def test_power_of_two_scales_that_is_not_a_bool_is_refused_naming_it(value):
  with pytest.raises(TypeError, match=r"`power_of_two_scales` must be True or False, got "):
    _fp8.Float8Recipe(power_of_two_scales=value)


@pytest.mark.parametrize("value", [0, -16, 16.0, True, "16"])
def test_a_min_size_that_is_not_a_positive_int_is_refused(value):
  with pytest.raises(ValueError, match=f"`min_size` must be a positive int, got {value!r}"):
    jls.Float8Recipe(min_size=value)


def test_a_min_size_may_be_a_numpy_integer():
  assert jls.Float8Recipe(min_size=np.int64(32)).min_size == 32
  assert type(jls.Float8Recipe(min_size=np.int64(32)).min_size) is int


def test_the_named_recipes_are_torchaos():
  tensorwise, rowwise = map(jls.Float8Recipe.from_name, RECIPES)
  assert (tensorwise.granularity, tensorwise.lhs_format, tensorwise.rhs_format,
          tensorwise.grad_format, tensorwise.power_of_two_scales) == (
              "tensor", E4M3, E4M3, E5M2, False)
  assert (rowwise.granularity, rowwise.lhs_format, rowwise.rhs_format, rowwise.grad_format,
          rowwise.power_of_two_scales) == ("row", E4M3, E4M3, E4M3, True)


@pytest.mark.parametrize("backend", ["gpu", "cuda", "rocm", "GPU"])
def test_fp8_compiler_options_turn_off_triton_gemms_on_a_gpu(backend):
  assert jls.fp8_compiler_options(backend) == {"xla_gpu_enable_triton_gemm": False}


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_fp8_compiler_options_are_none_off_a_gpu(backend):
  assert jls.fp8_compiler_options(backend) == {}


@pytest.mark.parametrize(("default", "expected"), [
    ("gpu", {"xla_gpu_enable_triton_gemm": False}), ("cpu", {}), ("tpu", {})])
def test_fp8_compiler_options_default_to_jaxs_default_backend(monkeypatch, default, expected):
  monkeypatch.setattr(jax, "default_backend", lambda: default)
  assert jls.fp8_compiler_options() == expected


def test_fp8_compiler_options_are_a_new_dict_each_call():
  jls.fp8_compiler_options("gpu")["xla_gpu_enable_triton_gemm"] = True
  assert jls.fp8_compiler_options("gpu") == {"xla_gpu_enable_triton_gemm": False}


def test_a_jit_given_the_gpu_options_compiles_and_computes_the_same_on_the_cpu():
  fun = jls.autocast(jax.grad(loss, argnums=(0, 1)), jnp.bfloat16, fp8="tensorwise")
  configured = jax.jit(fun, compiler_options=jls.fp8_compiler_options("gpu"))
  for got, expected in zip(configured(X, W), jax.jit(fun)(X, W), strict=True):
    np.testing.assert_array_equal(got, expected)


def test_fp8_compiler_options_of_a_backend_that_is_not_a_name_are_refused():
  with pytest.raises(TypeError, match=r"fp8_compiler_options\(backend=...\).*got <object"):
    jls.fp8_compiler_options(object())


def test_filter_fn_sees_flax_linen_module_paths():
  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      return linen.Dense(48, name="head")(linen.relu(linen.Dense(64, name="body")(x)))

  seen = []
  recipe = jls.Float8Recipe.from_name(
      "tensorwise", filter_fn=lambda matmul: seen.append(matmul.name_scope) or True)
  model = Model()
  params = model.init(KEYS[3], X)
  jax.grad(jls.autocast(lambda p, x: jnp.sum(model.apply(p, x)), jnp.bfloat16, fp8=recipe))(
      params, X)
  assert seen == ["Model/body", "Model/head"]


def test_filter_fn_sees_the_scopes_around_a_loop_a_checkpoint_a_jit_and_a_cond():
  seen = set()
  recipe = jls.Float8Recipe.from_name(
      "tensorwise", filter_fn=lambda matmul: seen.add(matmul.name_scope) or True)
  ws = jnp.stack([W[:, :32], W[:, 16:]])[:, :32]

  def fun(ws, x):
    with jax.named_scope("decoder"):
      with jax.named_scope("scanned"):
        h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
      with jax.named_scope("rematted"):
        h = jax.checkpoint(lambda h: h @ ws[1])(h)
      with jax.named_scope("jitted"):
        h = jax.jit(lambda h: h @ ws[0])(h)
      with jax.named_scope("branch"):
        h = lax.cond(True, lambda h: h @ ws[1], lambda h: h, h)
    return jnp.sum(h)

  jax.grad(jls.autocast(fun, jnp.bfloat16, fp8=recipe))(ws, X[:, :32])
  assert seen == {"decoder/scanned", "decoder/rematted", "decoder/jitted", "decoder/branch"}
  report = jls.diagnostics.fp8_readiness(fun, ws, X[:, :32])
  assert {row.name_scope for row in report.rows} == seen


def test_filter_fn_sees_the_scopes_around_a_custom_jvp_function_it_differentiates():
  @jax.custom_jvp
  def dense_tanh(x, w):
    with jax.named_scope("inner"):
      return jnp.tanh(x @ w)

  dense_tanh.defjvp(lambda primals, tangents: jax.jvp(
      lambda x, w: jnp.tanh(x @ w), primals, tangents))

  def fun(ws, x):
    with jax.named_scope("looped"):
      h, _ = lax.scan(lambda h, w: (dense_tanh(h, w), None), x, ws)
    with jax.named_scope("head"):
      return jnp.sum(dense_tanh(h, ws[0]))

  seen = set()
  recipe = jls.Float8Recipe.from_name(
      "tensorwise", filter_fn=lambda matmul: seen.add(matmul.name_scope)
      or not matmul.name_scope.startswith("head"))
  ws = jnp.stack([W[:, :32], W[:, 16:]])[:, :32]
  program = jax.make_jaxpr(jax.grad(jls.autocast(fun, jnp.bfloat16, fp8=recipe)))(ws, X[:, :32])
  assert seen == {"looped/inner", "head/inner"}
  assert len(float8_dots(program)) == 1  # the loop's forward: the head's is refused


def test_filter_fn_sees_the_whole_path_of_linen_remat_and_scan_modules():
  class Head(linen.Module):
    @linen.compact
    def __call__(self, h):
      return linen.Dense(48, name="proj")(h)

  class Layer(linen.Module):  # with jax 0.10, flax binds a jit with no results beside it
    @linen.compact
    def __call__(self, h, _):
      return linen.Dense(64, name="down")(linen.relu(linen.Dense(64, name="up")(h))), None

  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      h, _ = linen.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=2)(name="layers")(x, None)
      return linen.remat(Head)(name="head")(h)

  seen = set()
  recipe = jls.Float8Recipe.from_name(
      "tensorwise", filter_fn=lambda matmul: seen.add(matmul.name_scope)
      or not matmul.name_scope.startswith("Model/head"))
  model = Model()
  params = model.init(KEYS[3], X)
  fun = jls.autocast(lambda p, x: jnp.sum(model.apply(p, x)), jnp.bfloat16, fp8=recipe)
  jax.grad(fun)(params, X)
  assert seen == {"Model/layers/up", "Model/layers/down", "Model/head/proj"}
  summary = jls.precision_summary(fun, params, X)
  assert {str(at.scope) for at in summary.locations("dot_general", E4M3)} == {
      "Model/layers/up", "Model/layers/down"}


# --- gradient accumulation and probes ----------------------------------------------------


def test_multisteps_applies_the_average_of_the_micro_batches_fp8_gradients():
  # Current scaling keeps no amax between calls: each micro-batch's gradient is scaled from
  # its own tensors, so accumulating them cannot keep only the last one's amax.
  micro_batches = [X, 16 * jax.random.normal(KEYS[3], X.shape)]
  f = jls.autocast(loss, jnp.bfloat16, fp8="tensorwise")
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(1.0), every_k_schedule=2))
  grad_fn = jls.scaled_value_and_grad(f, argnums=1)

  @jax.jit
  def step(w, opt_state, x):
    value, g = grad_fn(opt_state, x, w)
    return tx.apply_gradients(g, opt_state, w, loss=value)

  w, opt_state = step(W, tx.init(W), micro_batches[0])
  np.testing.assert_array_equal(w, W)
  w, _ = step(w, opt_state, micro_batches[1])
  each = [jax.jit(jax.grad(f, argnums=1))(x, W) for x in micro_batches]
  np.testing.assert_allclose(W - w, (each[0] + each[1]) / 2, rtol=1e-5, atol=1e-5)
  assert relative_error(W - w, each[1]) > 0.4  # not the last micro-batch's alone


@pytest.mark.parametrize("recipe", RECIPES)
def test_probes_measure_an_fp8_loss_and_leave_its_value_and_gradients_unchanged(recipe):
  def probed_loss(x, w):
    hidden = jls.diagnostics.probe(jnp.tanh(x @ w), "hidden")
    return jnp.sum(hidden * C)

  f = jls.autocast(probed_loss, jnp.bfloat16, fp8=recipe)
  state = jls.loss_scaling(optax.sgd(0.1)).init((X, W))
  value, g, probes = jax.jit(jls.scaled_value_and_grad(f, argnums=(0, 1), probes=True))(
      state, X, W)
  plain_value, plain_g = jax.jit(jls.scaled_value_and_grad(f, argnums=(0, 1)))(state, X, W)
  np.testing.assert_array_equal(value, plain_value)
  for got, want in zip(g, plain_g, strict=True):
    np.testing.assert_array_equal(got, want)
  assert int(probes["hidden"].hits) == 1
  program = jax.make_jaxpr(jls.scaled_value_and_grad(f, argnums=(0, 1), probes=True))(
      state, X, W)
  assert len(float8_dots(program)) == 3


# --- convolutions, by opt-in ---------------------------------------------------------------

CONV_X = jax.random.normal(KEYS[0], (8, 16, 16, 32))  # NHWC
CONV_W = jax.random.normal(KEYS[1], (3, 3, 32, 64)) / 10  # HWIO
CONVOLUTIONS = {name: jls.Float8Recipe.from_name(name, convolutions=True) for name in RECIPES}


def conv(x, w, strides=(1, 1), **kwargs):
  return lax.conv_general_dilated(x, w, strides, "SAME",
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"), **kwargs)


def conv_loss(x, w, strides=(1, 1)):
  out = conv(x, w, strides)
  return jnp.sum(out * jax.random.normal(KEYS[2], out.shape))


def float8_convs(fun, *args):
  """`float8_dots` of the convolutions of `fun`'s gradient with respect to `args`."""
  program = jax.make_jaxpr(jax.grad(fun, argnums=tuple(range(len(args)))))(*args)
  return sorted(float8_dots(program, "conv_general_dilated"), key=str)


def test_without_the_opt_in_a_convolution_stays_in_compute_dtype():
  f = jls.autocast(conv_loss, jnp.bfloat16, fp8="tensorwise")
  assert float8_convs(f, CONV_X, CONV_W) == []
  summary = jls.precision_summary(f, CONV_X, CONV_W)
  assert summary.count("conv_general_dilated", BF16) == 1
  assert summary.count("conv_general_dilated", BF16, backward=True) == 2


def test_tensorwise_convolutions_run_e4m3_forward_and_e5m2_in_both_backward_ones():
  f = jls.autocast(conv_loss, jnp.bfloat16, fp8=CONVOLUTIONS["tensorwise"])
  assert float8_convs(f, CONV_X, CONV_W) == [(E4M3, E4M3, F32)] + [(E5M2, E5M2, F32)] * 2


def test_rowwise_convolutions_run_e4m3_in_all_three_with_float32_results():
  f = jls.autocast(conv_loss, jnp.bfloat16, fp8=CONVOLUTIONS["rowwise"])
  assert float8_convs(f, CONV_X, CONV_W) == [(E4M3, E4M3, F32)] * 3


def test_precision_summary_shows_the_float8_convolutions_forward_and_backward():
  f = jls.autocast(conv_loss, jnp.bfloat16, fp8=CONVOLUTIONS["tensorwise"])
  summary = jls.precision_summary(f, CONV_X, CONV_W)
  assert summary.count("conv_general_dilated", E4M3) == 1
  assert summary.count("conv_general_dilated", E5M2, backward=True) == 2
  assert summary.count("conv_general_dilated", BF16) == 0
  assert summary.count("conv_general_dilated", BF16, backward=True) == 0


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
@pytest.mark.parametrize("magnitude", [1.0, 1e-6, 1e4])
def test_the_convolutions_error_is_float8s_at_any_magnitude(recipe, strides, magnitude):
  x = CONV_X * magnitude
  out = jax.jit(jls.autocast(conv, jnp.bfloat16, fp8=CONVOLUTIONS[recipe]),
                static_argnums=2)(x, CONV_W, strides)
  assert 0.02 < relative_error(out, conv(x, CONV_W, strides)) < 0.05


@pytest.mark.parametrize("recipe, limit", [("tensorwise", 0.09), ("rowwise", 0.05)])
@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
@pytest.mark.parametrize("magnitude", [1.0, 1e-6, 1e4])
def test_convolution_gradients_are_within_float8s_error_of_float32s(recipe, limit, strides,
                                                                    magnitude):
  # Tensorwise takes both backward operands in e5m2 (JAX's convolution has one operand
  # dtype): about 0.075, where e5m2 times e4m3 matmuls give 0.06.
  f = lambda x, w: conv_loss(x, w, strides)
  x = CONV_X * magnitude
  expected = grads(f, x, CONV_W)
  got = grads(jls.autocast(f, jnp.bfloat16, fp8=CONVOLUTIONS[recipe]), x, CONV_W)
  for g, e in zip(got, expected, strict=True):
    assert g.dtype == F32
    assert 0.01 < relative_error(g, e) < limit


@pytest.mark.parametrize("shapes", [((8, 16, 16, 24), (3, 3, 24, 64)),
                                    ((8, 16, 16, 32), (3, 3, 32, 40))], ids=["in=24", "out=40"])
def test_a_convolution_with_features_not_a_multiple_of_16_stays_in_compute_dtype(shapes):
  x, w = jnp.ones(shapes[0]), jnp.ones(shapes[1])
  f = jls.autocast(lambda x, w: jnp.sum(conv(x, w)), jnp.bfloat16,
                   fp8=CONVOLUTIONS["tensorwise"])
  assert float8_convs(f, x, w) == []
  assert jls.precision_summary(f, x, w).count("conv_general_dilated", BF16) == 1


def test_a_grouped_convolution_stays_in_compute_dtype():
  w = CONV_W[:, :, :16]  # two groups of 16 input features
  f = jls.autocast(lambda x, w: jnp.sum(conv(x, w, feature_group_count=2)), jnp.bfloat16,
                   fp8=CONVOLUTIONS["tensorwise"])
  assert float8_convs(f, CONV_X, w) == []
  assert jls.precision_summary(f, CONV_X, w).count("conv_general_dilated", BF16) == 1


def test_filter_fn_is_asked_about_a_convolution_with_its_name_scope_and_shapes():
  asked = []
  recipe = jls.Float8Recipe.from_name(
      "tensorwise", convolutions=True, filter_fn=lambda matmul: asked.append(matmul) or False)

  def scoped(x, w):
    with jax.named_scope("stem"):
      return conv_loss(x, w)

  f = jls.autocast(scoped, jnp.bfloat16, fp8=recipe)
  assert float8_convs(f, CONV_X, CONV_W) == []
  assert asked[0] == jls.Float8Matmul("stem", (8, 16, 16, 32), (3, 3, 32, 64))


def test_beside_an_outlier_batch_element_rowwise_convolutions_keep_the_others_at_float8s_error():
  x = CONV_X.at[0].multiply(1e5)
  errors = {recipe: relative_error(jax.jit(jls.autocast(
      conv, jnp.bfloat16, fp8=CONVOLUTIONS[recipe]))(x, CONV_W)[1:], conv(x, CONV_W)[1:])
            for recipe in RECIPES}
  assert errors["rowwise"] < 0.05
  assert errors["tensorwise"] > 0.2


@pytest.mark.parametrize("shapes, layout, strides, padding, lhs_dilation, rhs_dilation", [
    ((2, 9, 11, 16), ("NHWC", "HWIO", "NHWC"), (2, 3), ((1, 2), (0, 3)), (1, 1), (2, 1)),
    ((2, 16, 7, 10), ("NCHW", "OIHW", "NCHW"), (1, 2), ((2, 0), (1, 1)), (2, 1), (1, 2)),
    ((3, 13, 16), ("NWC", "WIO", "NWC"), (3,), ((1, 1),), (1,), (1,)),
    ((2, 5, 6, 7, 16), ("NDHWC", "DHWIO", "NDHWC"), (1, 2, 2), ((1, 1),) * 3, (1,) * 3, (1,) * 3),
], ids=["2d-nhwc", "2d-nchw-dilated", "1d", "3d"])
def test_the_backward_convolutions_give_jaxs_gradients(shapes, layout, strides, padding,
                                                       lhs_dilation, rhs_dilation):
  x = jax.random.normal(KEYS[0], shapes)
  features = shapes[layout[0].index("C")]
  kernel = {"H": 3, "W": 2, "D": 2, "I": features, "O": 32}
  w = jax.random.normal(KEYS[1], tuple(kernel[axis] for axis in layout[1]))
  dimension_numbers = lax.conv_dimension_numbers(x.shape, w.shape, layout)
  convolution = _fp8.Convolution(strides, padding, lhs_dilation, rhs_dilation, dimension_numbers)
  out, pullback = jax.vjp(convolution, x, w)
  g = jax.random.normal(KEYS[2], out.shape)
  x_bar, w_bar = pullback(g)
  reversed_w = lax.rev(w, dimension_numbers.rhs_spec[2:])
  np.testing.assert_array_equal(convolution.of_lhs(x.shape, w.shape, g.shape)(g, reversed_w),
                                x_bar)
  np.testing.assert_array_equal(convolution.of_rhs(x.shape, w.shape, g.shape)(x, g), w_bar)


def test_fp8_convolutions_in_a_flax_linen_model_give_gradients_close_to_float32s():
  model = linen.Sequential([linen.Conv(32, (3, 3)), linen.relu, linen.Conv(64, (3, 3),
                                                                           strides=2)])
  params = model.init(KEYS[3], CONV_X)
  f = lambda p, x: jnp.mean(model.apply(p, x) ** 2)
  recipe = jls.Float8Recipe.from_name("tensorwise", convolutions=True)
  got = jax.jit(jax.grad(jls.autocast(f, jnp.bfloat16, fp8=recipe)))(params, CONV_X)
  expected = jax.jit(jax.grad(f))(params, CONV_X)
  for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
    assert g.dtype == F32 and np.all(np.isfinite(g))
    assert relative_error(g, e) < 0.25  # two layers (see assert_fp8_gradients_close)
  summary = jls.precision_summary(jls.autocast(f, jnp.bfloat16, fp8=recipe), params, CONV_X)
  assert summary.count("conv_general_dilated", E4M3) == 2
  assert summary.count("conv_general_dilated", E5M2, backward=True) == 4


def test_fp8_convolutions_run_inside_a_scan_under_vmap():
  w = jax.random.normal(KEYS[3], (3, 3, 32, 32)) / 10

  def f(x, w):
    h, _ = lax.scan(lambda h, _: (jnp.tanh(conv(h, w)), None), x, None, length=3)
    return jnp.sum(h)

  xs = jnp.stack([CONV_X[:4], CONV_X[4:] / 3])
  batched = lambda f: jax.jit(jax.vmap(jax.grad(f, argnums=(0, 1)), in_axes=(0, None)))
  got = batched(jls.autocast(f, jnp.bfloat16, fp8=CONVOLUTIONS["rowwise"]))(xs, w)
  for g, e in zip(got, batched(f)(xs, w), strict=True):
    assert relative_error(g, e) < 0.25  # three layers (see assert_fp8_gradients_close)
  summary = jls.precision_summary(jls.autocast(f, jnp.bfloat16, fp8=CONVOLUTIONS["rowwise"]),
                                  CONV_X, w)
  assert summary.count("conv_general_dilated", E4M3) == 1  # the loop body's, once
  assert summary.count("conv_general_dilated", E4M3, backward=True) == 2


def test_fp8_convolutions_in_a_flax_nnx_model_train_as_float32_does():
  def train(fp8):  # losses of 5 SGD steps
    model = nnx.Conv(32, 64, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
    f = lambda m, x: jnp.mean((m(x) - 1.0) ** 2)
    f = f if fp8 is None else jls.autocast(f, jnp.bfloat16, fp8=fp8)
    losses = []
    for _ in range(5):
      value, g = nnx.value_and_grad(f)(model, CONV_X)
      nnx.update(model, jax.tree.map(lambda p, g: p - 3.0 * g, nnx.state(model, nnx.Param), g))
      losses.append(float(value))
    return losses

  expected, got = train(None), train(CONVOLUTIONS["tensorwise"])
  assert got[-1] < 0.75 * got[0]
  np.testing.assert_allclose(got, expected, rtol=0.01)


def test_a_convolutions_opt_in_that_is_not_a_bool_is_refused_naming_it():
  with pytest.raises(TypeError, match="`convolutions`.*'yes'"):
    jls.Float8Recipe(convolutions="yes")


def test_per_row_convolution_scales_are_divided_out_along_each_convolutions_own_axes():
  recipe = jls.Float8Recipe("row", grad_format=E4M3, convolutions=True)  # scales not rounded
  spread = lambda key, n: 10.0 ** jax.random.uniform(key, (n,), minval=-1.0, maxval=1.0)
  x = CONV_X * spread(KEYS[0], 8)[:, None, None, None] * spread(KEYS[1], 32)
  w = CONV_W * spread(KEYS[2], 64)
  c = jax.random.normal(KEYS[3], (8, 16, 16, 64)) * spread(KEYS[1], 8)[:, None, None, None]
  f = lambda x, w: jnp.sum(conv(x, w) * c * spread(KEYS[0], 64))
  assert relative_error(jls.autocast(conv, jnp.bfloat16, fp8=recipe)(x, w), conv(x, w)) < 0.05
  for got, want in zip(grads(jls.autocast(f, jnp.bfloat16, fp8=recipe), x, w), grads(f, x, w),
                       strict=True):
    assert relative_error(got, want) < 0.05


@pytest.mark.parametrize("name", RECIPES)
def test_a_second_derivative_through_a_float8_convolution_is_refused(name):
  loss = jls.autocast(conv_loss, jnp.bfloat16, fp8=CONVOLUTIONS[name])
  penalty = lambda w: jnp.sum(jax.grad(loss, argnums=1)(CONV_X, w) ** 2)
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.grad(penalty)(CONV_W)
  with pytest.raises(NotImplementedError, match="differentiated twice"):
    jax.grad(lambda w: jax.vjp(lambda v: loss(CONV_X, v), w)[0])(CONV_W)
