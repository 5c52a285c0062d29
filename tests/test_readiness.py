"""`diagnostics.fp8_readiness`: every count recounted by brute force over the same tensors."""

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax import lax

import jax_lossscale as jls
from jax_lossscale import _readiness

KEYS = jax.random.split(jax.random.key(1), 3)
# Rows 0-7 of the activations are 1e-4 of the rest; columns 0-3 of the gradient 1e-5.
X = jax.random.normal(KEYS[0], (64, 128)).at[:8].multiply(1e-4)
W = jax.random.normal(KEYS[1], (128, 64)) / 10
C = jax.random.normal(KEYS[2], (64, 64)).at[:, :4].multiply(1e-5)
LARGEST = {"tensorwise": (448.0, 57344.0), "rowwise": (448.0, 448.0)}  # forward, gradient
FORMAT = {448.0: ml_dtypes.float8_e4m3fn, 57344.0: ml_dtypes.float8_e5m2}


def loss(x, w):
  return jnp.sum((x @ w) * C)


@pytest.fixture(scope="module")
def report():
  return jls.diagnostics.fp8_readiness(loss, X, W)


def row(report, tensor):
  [found] = [r for r in report.rows if r.tensor == tensor]
  return found


def recount(tensor, largest, axis, power_of_two):
  """`(flushed, saturated)` of `tensor` (float32 values of bfloat16 numbers) scaled to
  `largest` per tensor (`axis` None) or along `axis`, counted value by value."""
  amax = np.max(np.abs(tensor), axis=axis, keepdims=True).astype(np.float32)
  factor = np.float32(largest * (1 - 2**-20)) / amax  # just inside the largest value
  if power_of_two:
    factor = np.float32(2.0) ** (np.frexp(factor)[1] - 1).astype(np.float32)
  values = tensor * factor
  quantized = values.astype(FORMAT[largest]).astype(np.float32)
  return int(np.sum((tensor != 0) & (quantized == 0))), int(np.sum(~(np.abs(values) <= largest)))


def bfloat16(x):
  return np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tensor, values, axis, which", [
    ("lhs", X, 1, 0), ("rhs", W, 0, 0), ("gradient for lhs", C, 1, 1),
    ("gradient for rhs", C, 0, 1)])
def test_flushed_and_saturated_counts_equal_a_brute_force_recount(report, recipe, tensor, values,
                                                                  axis, which):
  found = row(report, tensor)
  rowwise = recipe == "rowwise"
  flushed, saturated = recount(bfloat16(values), LARGEST[recipe][which],
                               axis if rowwise else None, rowwise)
  assert (found.flushed[recipe], found.saturated[recipe]) == (flushed, saturated)
  assert found.size == values.size
  assert found.flushed_fraction(recipe) == flushed / values.size
  assert found.amax == float(np.max(np.abs(bfloat16(values))))


def test_the_small_rows_and_columns_are_flushed_per_tensor_and_kept_per_row(report):
  assert row(report, "lhs").flushed["tensorwise"] > 0
  assert row(report, "lhs").flushed["rowwise"] == 0
  assert row(report, "gradient for lhs").flushed["tensorwise"] == 0  # e5m2 reaches 2**-16


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_value_that_scaling_takes_to_zero_in_float32_counts_as_flushed(recipe):
  tiny = jnp.full((64, 128), 1e-37).at[0, 0].set(1e4)  # 1e-37 * 448 / 1e4 is 0 in float32
  found = row(jls.diagnostics.fp8_readiness(loss, tiny, W), "lhs")
  if recipe == "tensorwise":  # all but the amax
    assert found.flushed[recipe] == recount(bfloat16(tiny), 448.0, None, False)[0]
    assert found.flushed[recipe] == tiny.size - 1
  else:  # the first row's others; the other rows are scaled by 2**126 (amax below 5e-36)
    assert found.flushed[recipe] == 127


def test_any_floating_compute_dtype_may_be_measured():
  for dtype in (jnp.float16, jnp.float32, jnp.float64):
    assert len(jls.diagnostics.fp8_readiness(loss, X, W, compute_dtype=dtype).rows) == 4


def test_the_forward_error_is_the_float8_products_against_compute_dtypes(report):
  x, w = bfloat16(X), bfloat16(W)
  amax_x, amax_w = np.max(np.abs(x)), np.max(np.abs(w))
  factor = lambda amax: np.float32(448 * (1 - 2**-20)) / amax
  dequantize = lambda v, amax: (v * factor(amax)).astype(
      ml_dtypes.float8_e4m3fn).astype(np.float32) / factor(amax)
  approximate = dequantize(x, amax_x) @ dequantize(w, amax_w)
  reference = x @ w
  rows = np.linalg.norm(approximate - reference, axis=1) / np.linalg.norm(reference, axis=1)
  expected = np.sqrt(np.mean(rows ** 2))
  np.testing.assert_allclose(row(report, "lhs").error["tensorwise"], expected, rtol=1e-3)
  assert row(report, "rhs").error == row(report, "lhs").error


def test_rowwise_is_recommended_where_tensorwise_flushes_a_row_and_tensorwise_elsewhere():
  outlier = jls.diagnostics.fp8_readiness(loss, X.at[9].multiply(1e5), W)
  plain = jls.diagnostics.fp8_readiness(loss, X.at[:8].multiply(1e4), W)
  assert outlier.recommended() == {0: "rowwise"}
  assert plain.recommended() == {0: "tensorwise"}


def test_no_recipe_is_recommended_below_float8s_own_error():
  assert jls.diagnostics.fp8_readiness(loss, X, W, error_limit=0.001).recommended() == {0: None}


def test_no_recipe_is_recommended_for_a_matmul_whose_error_is_nan():
  # An operand holding inf: the forward product's error is NaN, the worst of all.
  report = jls.diagnostics.fp8_readiness(loss, X.at[0, 0].set(jnp.inf), W)
  assert np.isnan(row(report, "lhs").error["tensorwise"])
  assert report.recommended() == {0: None}


@pytest.mark.parametrize("order", list(itertools.permutations(_readiness._PRODUCTS)))
def test_a_nan_error_in_any_product_withholds_the_recommendation_whatever_their_order(
    order, monkeypatch):
  # Python's `max` keeps a NaN only if it comes first: the products were a set, whose
  # order changed with PYTHONHASHSEED.
  monkeypatch.setattr(_readiness, "_PRODUCTS", order)
  stats = {"size": 256, "amax": 1.0, "flushed": 0, "saturated": 0, "calls": 1}
  errors = {"forward": 0.01, "lhs gradient": np.nan, "rhs gradient": 0.02}
  totals = {(0, kind, "tensorwise"): dict(stats) for kind in _readiness.TENSORS}
  totals |= {(0, product, "tensorwise"): {"squared": error**2, "rows": 1.0, "calls": 1}
             for product, error in errors.items()}
  matmul = jls.Float8Matmul("", (16, 16), (16, 16))
  rows = _readiness._rows([matmul], totals, ("tensorwise",), error_limit=0.1)
  assert [r.recommended for r in rows] == [None] * 4


def test_a_subnormal_operand_value_counts_as_flushed():
  # XLA:CPU compares a subnormal as zero: the count read it as no value at all.
  tiny = jnp.full((64, 128), 1e-39).at[0, 0].set(1.0)  # bfloat16 subnormals
  found = row(jls.diagnostics.fp8_readiness(loss, tiny, W), "lhs")
  assert found.flushed["tensorwise"] == tiny.size - 1 == recount(
      bfloat16(tiny), 448.0, None, False)[0]


def test_a_matmul_over_an_empty_batch_is_left_out():
  a = jnp.ones((0, 16, 16))
  einsum = lambda a, c: jnp.sum(jnp.einsum("bij,bjk->bik", a, c))
  assert jls.diagnostics.fp8_readiness(einsum, a, a).rows == ()
  ran = jls.precision_summary(jls.autocast(einsum, jnp.bfloat16, fp8="tensorwise"), a, a)
  assert "float8_e4m3fn" not in str(ran)


def test_a_function_with_no_floating_output_is_refused_naming_the_report():
  with pytest.raises(TypeError, match="fp8_readiness.*floating outputs.*returned none"):
    jls.diagnostics.fp8_readiness(lambda x, w: jnp.argmax(x @ w, -1), X, W)


def test_a_matmul_float8_would_not_take_is_not_listed():
  report = jls.diagnostics.fp8_readiness(lambda x, w: jnp.sum((x[:, :40] @ w[:40]) ** 2), X, W)
  assert report.rows == ()


def test_a_matmul_in_a_loop_is_counted_at_every_iteration():
  def f(x, w):
    h, _ = lax.scan(lambda h, _: (h @ w @ w.T, None), x, None, length=3)
    return jnp.sum(h)

  report = jls.diagnostics.fp8_readiness(f, X, W)
  assert [r.size for r in report.rows if r.tensor == "lhs"] == [3 * X.size, 3 * X.size // 2]
  # The weight does not change in the loop: counted at every iteration all the same.
  assert [r.size for r in report.rows if r.tensor == "rhs"] == [3 * W.size, 3 * W.size]


def _counts(report):
  return [(r.matmul, r.tensor, r.size, r.flushed, r.saturated, r.error) for r in report.rows]


@pytest.mark.parametrize("where", ["around the loss", "around the loop's body"])
def test_a_checkpointed_matmul_is_counted_once_though_its_forward_pass_runs_twice(report, where):
  # jax.checkpoint runs the forward pass again in the backward pass, measurements and all.
  assert _counts(jls.diagnostics.fp8_readiness(jax.checkpoint(loss), X, W)) == _counts(report)

  def looped(x, w, remat_body=False):
    body = lambda h, _: (jnp.tanh(h @ w @ w.T), None)  # noqa: E731
    h, _ = lax.scan(jax.checkpoint(body) if remat_body else body, x, None, length=3)
    return jnp.sum(h)

  plain = jls.diagnostics.fp8_readiness(looped, X, W)
  if where == "around the loss":
    checkpointed = jax.checkpoint(looped)
  else:
    checkpointed = lambda x, w: looped(x, w, remat_body=True)  # noqa: E731
  assert _counts(jls.diagnostics.fp8_readiness(checkpointed, X, W)) == _counts(plain)


def test_a_matmul_no_gradient_reaches_keeps_its_forward_counts(report):
  stopped = jls.diagnostics.fp8_readiness(
      lambda x, w: jnp.sum(lax.stop_gradient(x @ w) * C) + jnp.sum(x) + jnp.sum(w), X, W)
  assert _counts(stopped) == [c for c in _counts(report) if c[1] in ("lhs", "rhs")]


def test_the_report_prints_one_line_per_tensor(report):
  lines = str(report).splitlines()
  assert len(lines) == 1 + 4
  assert "gradient for rhs" in lines[-1]
  assert lines[-1].endswith("tensorwise") or lines[-1].endswith("rowwise")


@pytest.mark.parametrize("kwargs, shown", [
    ({"recipes": ()}, r"`recipes`.*\(\)"),
    ({"recipes": "rowwise"}, "`recipes`.*'rowwise'"),
    ({"recipes": ("tensorwise", "columnwise")}, "`recipes`.*'columnwise'"),
    ({"recipes": ("rowwise", "rowwise")}, r"distinct names.*\('rowwise', 'rowwise'\)"),
    ({"error_limit": -0.1}, r"`error_limit`.*-0\.1"),
    ({"error_limit": float("nan")}, "`error_limit`.*nan"),
    ({"compute_dtype": jnp.float8_e4m3fn}, "`compute_dtype` must be the dtype float8 is "
     r"measured against, not a float8 one \(float16, bfloat16, float32 or float64\)"),
    ({"compute_dtype": jnp.int8}, "`compute_dtype` must be a floating dtype"),
])
def test_a_bad_argument_is_refused_naming_it(kwargs, shown):
  with pytest.raises(ValueError, match=shown):
    jls.diagnostics.fp8_readiness(loss, X, W, **kwargs)


# Convolutions: batch elements 0-1 of the images are 1e-4 of the rest; output features 0-3
# of the gradient 1e-5.
IMAGES = jax.random.normal(KEYS[0], (4, 8, 8, 32)).at[:2].multiply(1e-4)  # NHWC
KERNEL = jax.random.normal(KEYS[1], (3, 3, 32, 16)) / 10  # HWIO
CONV_C = jax.random.normal(KEYS[2], (4, 8, 8, 16)).at[..., :4].multiply(1e-5)


def conv(x, w):
  return lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def conv_loss(x, w):
  return jnp.sum(conv(x, w) * CONV_C)


@pytest.fixture(scope="module")
def conv_report():
  return jls.diagnostics.fp8_readiness(conv_loss, IMAGES, KERNEL, convolutions=True)


def test_convolutions_are_measured_only_when_asked(conv_report):
  assert jls.diagnostics.fp8_readiness(conv_loss, IMAGES, KERNEL).rows == ()
  assert [(r.matmul, r.tensor) for r in conv_report.rows] == [
      (0, "lhs"), (0, "rhs"), (0, "gradient for lhs"), (0, "gradient for rhs")]
  assert (conv_report.rows[0].lhs_shape, conv_report.rows[0].rhs_shape) == (
      IMAGES.shape, KERNEL.shape)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("tensor, values, axis, which", [
    ("lhs", IMAGES, (1, 2, 3), 0), ("rhs", KERNEL, (0, 1, 2), 0),
    ("gradient for lhs", CONV_C, (1, 2, 3), 1), ("gradient for rhs", CONV_C, (0, 1, 2), 1)])
def test_a_convolutions_counts_equal_a_brute_force_recount(conv_report, recipe, tensor, values,
                                                           axis, which):
  # Per row: per batch element of the images and of the gradient for the images' gradient,
  # per output feature of the kernel and of the gradient for the kernel's.
  found = row(conv_report, tensor)
  rowwise = recipe == "rowwise"
  flushed, saturated = recount(bfloat16(values), LARGEST[recipe][which],
                               axis if rowwise else None, rowwise)
  assert (found.flushed[recipe], found.saturated[recipe]) == (flushed, saturated)
  assert found.amax == float(np.max(np.abs(bfloat16(values))))


def test_a_convolutions_forward_error_is_the_float8_convolutions_against_compute_dtypes(
    conv_report):
  x, w = bfloat16(IMAGES), bfloat16(KERNEL)

  def dequantize(v):
    factor = np.float32(448 * (1 - 2**-20)) / np.max(np.abs(v))
    return (v * factor).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / factor

  approximate, reference = np.asarray(conv(dequantize(x), dequantize(w))), np.asarray(conv(x, w))
  rows = np.linalg.norm(approximate - reference, axis=-1) / np.linalg.norm(reference, axis=-1)
  expected = np.sqrt(np.mean(rows ** 2))
  np.testing.assert_allclose(row(conv_report, "lhs").error["tensorwise"], expected, rtol=1e-3)


def test_rowwise_is_recommended_for_a_convolution_beside_an_outlier_image_tensorwise_elsewhere():
  outlier = jls.diagnostics.fp8_readiness(conv_loss, IMAGES.at[3].multiply(1e5), KERNEL,
                                          convolutions=True)
  plain = jls.diagnostics.fp8_readiness(conv_loss, IMAGES.at[:2].multiply(1e4), KERNEL,
                                        convolutions=True)
  assert outlier.recommended() == {0: "rowwise"}
  assert plain.recommended() == {0: "tensorwise"}


def test_a_convolutions_opt_in_that_is_not_a_bool_is_refused():
  with pytest.raises(TypeError, match="`convolutions`.*1"):
    jls.diagnostics.fp8_readiness(conv_loss, IMAGES, KERNEL, convolutions=1)
