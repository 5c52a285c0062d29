"""`autocast`'s numerics: constants outside the compute dtype's range, a matmul's bias,
8-bit floats, and the sums that differentiation adds.

Values against float32; dtypes on the traced program (`precision_summary`); the memory
of a biased layer against the model cast by hand (XLA's memory analysis).
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import pytest
import real_programs as rp
from flax import linen
from flax import nnx
from helpers import dtypes_of
from helpers import forward_dtypes
from jax import lax

import jax_lossscale as jls

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
KEYS = jax.random.split(jax.random.key(0), 3)
X = jax.random.normal(KEYS[0], (64, 32))
W = jax.random.normal(KEYS[1], (32, 16)) / 4
SCALE = jnp.float32(1e5)  # closed over by the functions below
TINY = np.float32(1e-7)


# --- constants outside the compute dtype's range ------------------------------------

CONSTANTS = {
    "a literal divisor after a cast": lambda w, x: (x @ w).astype(jnp.float32) / 1e5,
    "a literal factor": lambda w, x: (x @ w) * 1e5,
    "a negative literal factor": lambda w, x: (x @ w) * -1e5,
    "a jnp.float32 scalar": lambda w, x: (x @ w) / jnp.float32(1e5),
    "a closed-over array": lambda w, x: (x @ w) / SCALE,
    "a closed-over NumPy scalar": lambda w, x: (x @ w) * TINY,
    "an epsilon below float16's subnormals": lambda w, x: jnp.log(
        jnp.maximum(x @ w, 0.0) + 1e-8),
}


@pytest.mark.parametrize("name", CONSTANTS)
def test_a_constant_outside_float16s_range_keeps_its_value(name):
  fun = CONSTANTS[name]
  out = jax.jit(jls.autocast(fun))(W, X)
  assert out.dtype == F32 and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(jnp.mean(out), jnp.mean(fun(W, X)), rtol=1e-2)


@pytest.mark.parametrize("name", ["a literal factor", "a jnp.float32 scalar",
                                  "a closed-over NumPy scalar"])
def test_the_operation_with_a_constant_outside_float16s_range_runs_in_float32(name):
  ran = forward_dtypes(jls.autocast(CONSTANTS[name]), W, X)
  assert ran["dot_general"] == {F16}
  assert (ran.get("mul", set()) | ran.get("div", set())) == {F32}


def test_a_constant_within_the_compute_dtypes_range_does_not_widen():
  ran = forward_dtypes(jls.autocast(lambda w, x: (x @ w) * 0.125 / jnp.float32(3.0)), W, X)
  assert (ran["mul"], ran["div"]) == ({F16}, {F16})


def test_bfloat16_keeps_a_constant_that_its_range_holds():
  ran = forward_dtypes(jls.autocast(CONSTANTS["a literal factor"], jnp.bfloat16), W, X)
  assert ran["mul"] == {BF16}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # JAX's, tracing `* 1e5`
def test_an_operation_traced_in_float16_keeps_its_constant_as_written():
  fun = lambda w, x: (x.astype(jnp.float16) @ w.astype(jnp.float16)) * 1e5
  ran = forward_dtypes(jls.autocast(fun), W, X)
  assert ran["mul"] == {F16}


def log_loss(w, x, part=lambda h: jnp.log(jnp.maximum(h, 0.0) + 1e-8)):
  return jnp.mean(part(x @ w))


def hand_cast_log_loss(w, x):
  h = (x.astype(jnp.float16) @ w.astype(jnp.float16)).astype(jnp.float32)
  return jnp.mean(jnp.log(jnp.maximum(h, 0.0) + 1e-8))


def test_an_inner_float32_autocast_runs_its_part_in_float32_forward_and_backward():
  part = jls.autocast(lambda h: jnp.tanh(h) * h, jnp.float32)
  loss = jls.autocast(lambda w, x: jnp.mean(part(x @ w)))
  ran = jls.precision_summary(loss, W, X)
  assert dtypes_of(ran, "dot_general") == dtypes_of(ran, "dot_general", backward=True) == {
      "float16"}
  assert dtypes_of(ran, "tanh") == {"float32"}
  assert dtypes_of(ran, "mul") == dtypes_of(ran, "mul", backward=True) == {"float32"}


@pytest.mark.parametrize("order", ["grad of autocast", "autocast of grad"])
def test_a_loss_in_an_inner_float32_autocast_has_float32s_gradients(order):
  part = jls.autocast(lambda h: jnp.log(jnp.maximum(h, 0.0) + 1e-8), jnp.float32)
  loss = lambda w, x: log_loss(w, x, part)
  grad = (jax.grad(jls.autocast(loss)) if order == "grad of autocast"
          else jls.autocast(jax.grad(loss)))
  grads = jax.jit(grad)(W, X)
  assert bool(jnp.all(jnp.isfinite(grads)))
  np.testing.assert_allclose(grads, jax.grad(hand_cast_log_loss)(W, X), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("order", ["grad of autocast", "autocast of grad"])
def test_an_epsilon_below_float16s_range_leaves_the_gradients_finite(order):
  # The max in front of `+ 1e-8` runs in float32 as well, so its derivative masks the
  # log's 1/1e-8 in float32; in float16 that is inf, and inf times the mask's 0 is NaN.
  grad = (jax.grad(jls.autocast(log_loss)) if order == "grad of autocast"
          else jls.autocast(jax.grad(log_loss)))
  grads = jax.jit(grad)(W, X)
  assert bool(jnp.all(jnp.isfinite(grads)))
  np.testing.assert_allclose(grads, jax.grad(hand_cast_log_loss)(W, X), rtol=1e-2, atol=1e-2)


def test_the_elementwise_operations_computing_a_widened_operand_run_in_float32():
  ran = jls.precision_summary(jls.autocast(log_loss), W, X)
  assert dtypes_of(ran, "dot_general") == dtypes_of(ran, "dot_general", backward=True) == {
      "float16"}
  assert dtypes_of(ran, "max") == dtypes_of(ran, "add") == {"float32"}


def test_an_operation_whose_result_no_constant_widens_keeps_the_compute_dtype():
  ran = forward_dtypes(jls.autocast(lambda w, x: jnp.maximum(x @ w, 0.0) * 2.0 + 1e-8), W, X)
  assert ran["max"] == {F32} and ran["mul"] == {F32}
  ran = forward_dtypes(jls.autocast(lambda w, x: jnp.maximum(x @ w, 0.0) * 2.0 + 1e-3), W, X)
  assert ran["max"] == ran["mul"] == ran["add"] == {F16}


# --- the linear layer's bias ----------------------------------------------------------


class LinenBiased(linen.Module):
  dtype: object = None

  @linen.compact
  def __call__(self, x):
    return jnp.tanh(linen.Dense(16, dtype=self.dtype)(x))


class LinenConv(linen.Module):
  @linen.compact
  def __call__(self, x):
    return jnp.tanh(linen.Conv(8, (3, 3))(x.reshape(8, 8, 4, 8)))


def biased_layers():
  """Each stack's biased layer followed by a tanh: `(function, its arguments)`."""
  linen_dense, linen_conv = LinenBiased(), LinenConv()
  nnx_linear = nnx.Linear(32, 16, rngs=nnx.Rngs(0))
  eqx_linear = eqx.nn.Linear(32, 16, key=KEYS[2])
  eqx_conv = eqx.nn.Conv2d(8, 8, 3, padding=1, key=KEYS[2])  # squeezes its batch of one
  return {
      "flax linen Dense": (lambda v, x: linen_dense.apply(v, x),
                           (linen_dense.init(KEYS[2], X), X)),
      "flax linen Conv": (lambda v, x: linen_conv.apply(v, x),
                          (linen_conv.init(KEYS[2], X.reshape(8, 8, 4, 8)), X)),
      "flax nnx Linear": (lambda m, x: jnp.tanh(m(x)), (nnx_linear, X)),
      "equinox Linear": (lambda m, x: jnp.tanh(jax.vmap(m)(x)), (eqx_linear, X)),
      "equinox Conv2d": (lambda m, x: jnp.tanh(jax.vmap(m)(x.reshape(8, 8, 8, 4))),
                         (eqx_conv, X)),
  }


@pytest.mark.parametrize("name", ["flax linen Dense", "flax linen Conv", "flax nnx Linear",
                                  "equinox Linear", "equinox Conv2d"])
def test_a_bias_added_to_a_matmuls_result_keeps_the_compute_dtype(name):
  fun, args = biased_layers()[name]
  ran = jls.precision_summary(jls.autocast(lambda *a: jnp.sum(fun(*a))), *args)
  assert dtypes_of(ran, "add") == {"float16"}
  assert dtypes_of(ran, "tanh") == {"float16"}  # the activation after the layer
  out = jax.jit(jls.autocast(fun))(*args)
  np.testing.assert_allclose(out, fun(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("weight", ["weight-normed", "LoRA", "dequantized"])
def test_a_bias_after_a_weight_computed_from_parameters_keeps_the_compute_dtype(weight):
  # The weight is computed, but elementwise from parameters (not a matmul's result, as
  # attention's keys are): its layer's bias is still a bias.
  w, a, b = (jax.random.normal(key, shape) for key, shape in zip(
      KEYS[:3], ((16, 8), (16, 2), (2, 8)), strict=True))
  bias, x = jnp.ones(8), jax.random.normal(KEYS[3], (4, 16))
  weights = {"weight-normed": lambda w, a, b: w / jnp.linalg.norm(w, axis=0),
             "LoRA": lambda w, a, b: w + a @ b,
             "dequantized": lambda w, a, b: jnp.round(w * 8).astype(jnp.int8) * 0.125}

  def layer(w, a, b, bias, x):
    return jnp.sum(jnp.tanh(x @ weights[weight](w, a, b) + bias))

  ran = jls.precision_summary(jls.autocast(layer), w, a, b, bias, x)
  assert dtypes_of(ran, "tanh") == {"float16"}
  np.testing.assert_allclose(jls.autocast(layer)(w, a, b, bias, x), layer(w, a, b, bias, x),
                             rtol=2e-2)


@pytest.mark.parametrize("masked", [-1e9, float(jnp.finfo(jnp.float32).min)])
def test_an_additive_attention_mask_is_not_a_bias_and_a_fully_masked_row_stays_finite(masked):
  # The mask varies over the queries: added in float16 its -1e9 is -inf, and a row of
  # them (a padding query) would give NaN after the softmax, forward and backward.
  q, k = jax.random.normal(KEYS[0], (2, 8, 16)), jax.random.normal(KEYS[1], (2, 8, 16))
  mask = jnp.where(jnp.tril(jnp.ones((8, 8), bool)).at[0].set(False), 0.0, masked)

  def attention(q, k, mask):
    return jnp.sum(jax.nn.softmax(q @ k.transpose(0, 2, 1) + mask, axis=-1) ** 2)

  ran = jls.precision_summary(jls.autocast(attention), q, k, mask)
  assert dtypes_of(ran, "add") == {"float32"}
  np.testing.assert_allclose(jls.autocast(attention)(q, k, mask), attention(q, k, mask),
                             rtol=1e-3)
  grads = jax.grad(jls.autocast(attention), argnums=(0, 1))(q, k, mask)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("batched", [False, True], ids=["one example", "vmapped"])
def test_a_key_padding_mask_computed_in_the_step_is_not_a_bias(batched):
  # `where(keep, 0, -1e9)[None, :]` varies over the keys alone, the free axis of `k`, as a
  # bias of `q @ k.T` would; but the program computes it, where a bias is a parameter.
  # Added in float16 its -1e9 is -inf, and an example of padding only gives NaN.
  q, k, v = (jax.random.normal(key, (n, 16)) for key, n in zip(KEYS[:3], (4, 6, 6), strict=True))

  def attention(q, k, v, keep):
    mask = jnp.where(keep, 0.0, -1e9)[None, :]
    return jnp.sum(jax.nn.softmax(q / 4 @ k.T + mask, axis=-1) @ v)

  keep = jnp.array([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool)
  if not batched:
    keep = keep[1]
  run = lambda f: jax.vmap(f, (None, None, None, 0)) if batched else f
  ran = jls.precision_summary(run(jls.autocast(attention)), q, k, v, keep)
  assert dtypes_of(ran, "add") == {"float32"}
  np.testing.assert_allclose(run(jls.autocast(attention))(q, k, v, keep),
                             run(attention)(q, k, v, keep), rtol=1e-2)
  grads = jax.grad(lambda *a: jnp.sum(run(jls.autocast(attention))(*a)), argnums=(0, 1, 2))(
      q, k, v, keep)
  assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


@pytest.mark.parametrize("batched", [False, True], ids=["one example", "vmapped"])
def test_a_key_padding_mask_given_as_an_input_stays_finite(batched):
  # The mask is an input, as a bias is, broadcast along the keys, `k`'s free axis. Where
  # the keys are computed (projected from the input) it is no bias: a bias varies along
  # a weight's free axes. Where `q` and `k` are inputs too, nothing tells it from one: it
  # runs in float16, saturated at half float16's largest value (-1e9 was -inf there, and
  # an example of padding only NaN): its rows stay distributions, where float32 makes them
  # uniform.
  x, wq, wk = (jax.random.normal(key, shape) for key, shape in zip(
      KEYS[:3], ((6, 16), (16, 16), (16, 16)), strict=True))
  mask = jnp.where(jnp.array([[1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]], bool), 0.0, -1e9)

  def projected(x, wq, wk, mask):
    return jax.nn.softmax((x @ wq) / 4 @ (x @ wk).T + mask[None, :], axis=-1)

  def given(q, k, mask):
    return jax.nn.softmax(q / 4 @ k.T + mask[None, :], axis=-1)

  for attention, args, add in ((projected, (x, wq, wk), "float32"),
                               (given, (x @ wq, x @ wk), "float16")):
    axes = (None,) * len(args) + (0,)
    run = (lambda f, axes=axes: jax.vmap(f, axes)) if batched else (lambda f: f)
    masks = mask if batched else mask[1]
    ran = jls.precision_summary(run(jls.autocast(attention)), *args, masks)
    assert dtypes_of(ran, "add") == {add}, attention.__name__
    out, expected = run(jls.autocast(attention))(*args, masks), run(attention)(*args, masks)
    np.testing.assert_allclose(jnp.sum(out, axis=-1), 1.0, rtol=1e-2)
    if batched or add == "float32":  # the example with keys to attend to, or every one
      np.testing.assert_allclose(out[0] if add == "float16" else out,
                                 expected[0] if add == "float16" else expected, atol=2e-2)
    autocast = run(jls.autocast(attention))
    grads = jax.grad(lambda *a, f=autocast: jnp.sum(f(*a) * jnp.arange(6.0)),
                     argnums=tuple(range(len(args))))(*args, masks)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads), attention.__name__


def test_a_gathers_fill_value_that_float16_cannot_hold_keeps_the_gather_in_float32():
  # `take_along_axis(..., mode="fill", fill_value=-1e9)`: the padding is a parameter of the
  # gather, not an operand; gathered in float16 it was -inf, and a row of it NaN.
  idx = jnp.array([[0, 3, 5], [20, 21, 22]])  # the second row: all out of bounds

  def f(w, x):
    scores = jnp.take_along_axis(x @ w, idx, axis=1, mode="fill", fill_value=-1e9)
    return jax.nn.softmax(scores, axis=-1)

  w, x = jax.random.normal(KEYS[0], (16, 8)), jax.random.normal(KEYS[1], (2, 16))
  ran = jls.precision_summary(jls.autocast(f), w, x)
  assert dtypes_of(ran, "gather") == {"float32"}
  np.testing.assert_allclose(jls.autocast(f)(w, x), f(w, x), atol=2e-2)


def test_flax_attention_with_a_padding_bias_stays_finite():
  class Attention(linen.Module):
    @linen.compact
    def __call__(self, x, bias):
      q, k, v = (linen.DenseGeneral((4, 4))(x) for _ in range(3))
      return linen.dot_product_attention(q, k, v, bias=bias)

  ids = jnp.array([[1, 2, 3, 0, 0, 0, 0, 0]] * 4)
  bias = jnp.where(linen.make_attention_mask(ids > 0, ids > 0) > 0, 0.0, -1e10)
  x = jax.random.normal(KEYS[0], (4, 8, 16))
  model = Attention()
  variables = model.init(KEYS[1], x, bias)
  out = jax.jit(jls.autocast(model.apply))(variables, x, bias)
  assert out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(out, model.apply(variables, x, bias), rtol=3e-2, atol=3e-2)


def test_a_value_multiplied_by_itself_is_squared_in_float32():
  # `jnp.linalg.norm` and an RMS norm's `mean(h * h)` square by `mul`: in float16 a
  # matmul's result above 256 squares to inf (an RMS norm then gives zeros, no NaN).
  x, w = jax.random.normal(KEYS[0], (2, 64)) * 30, jax.random.normal(KEYS[1], (64, 32))

  def norm(x, w):
    return jnp.linalg.norm(x @ w, axis=-1)

  def rms_norm(x, w):
    h = x @ w
    return h * lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

  for fun in (norm, rms_norm):
    assert float(jnp.max(jnp.abs(x @ w))) > 256
    ran = jls.precision_summary(jls.autocast(fun), x, w)
    assert dtypes_of(ran, "mul") >= {"float32"}
    np.testing.assert_allclose(jls.autocast(fun)(x, w), fun(x, w), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("compute_dtype", [jnp.float16, jnp.bfloat16])
def test_linear_algebra_and_fourier_transforms_of_a_matmuls_result_run_in_float32(
    compute_dtype):
  # JAX implements them for float32 and wider: float16 operands were refused inside it.
  x, w = jax.random.normal(KEYS[0], (16, 16)), jax.random.normal(KEYS[1], (16, 16)) / 4
  functions = {
      "eigh": lambda x, w: jnp.linalg.eigh((x @ w) @ (x @ w).T)[0],
      "svd": lambda x, w: jnp.linalg.svd(x @ w, compute_uv=False),
      "qr": lambda x, w: jnp.abs(jnp.diagonal(jnp.linalg.qr(x @ w)[1])),
      "det": lambda x, w: jnp.linalg.slogdet(x @ w)[1],
      "rfft": lambda x, w: jnp.abs(jnp.fft.rfft(x @ w, axis=-1)),
      "complex": lambda x, w: jnp.abs(lax.complex(x @ w, x @ w)),
  }
  for name, fun in functions.items():
    out = jax.jit(jls.autocast(fun, compute_dtype))(x, w)
    assert out.dtype == jnp.float32, name
    tolerance = 5e-3 if compute_dtype == jnp.float16 else 3e-2  # the matmuls' rounding
    np.testing.assert_allclose(out, fun(x, w), rtol=tolerance, atol=tolerance * 10,
                               err_msg=name)


@pytest.mark.parametrize("activation", [jax.nn.relu, linen.relu, nnx.relu],
                         ids=["jax.nn.relu", "flax linen relu", "flax nnx relu"])
def test_relu_after_a_biased_layer_keeps_float16_and_its_own_derivative(activation):
  fun = lambda w, x: activation(x @ w + 1.0)  # relu: a custom_jvp around a jitted function
  ran = jls.precision_summary(jls.autocast(lambda w, x: jnp.sum(fun(w, x) ** 2)), W, X)
  assert dtypes_of(ran, "max") == {"float16"}
  assert jax.grad(lambda x: jls.autocast(activation)(x))(0.0) == 0.0  # relu's rule at 0
  np.testing.assert_allclose(jax.grad(lambda w: jnp.sum(jls.autocast(fun)(w, X) ** 2))(W),
                             jax.grad(lambda w: jnp.sum(fun(w, X) ** 2))(W), rtol=2e-2, atol=0.1)


def test_a_jitted_function_runs_on_the_dtypes_its_operands_have():
  ran = jls.precision_summary(jls.autocast(
      lambda w, x: jnp.sum(jax.jit(jnp.tanh)(x @ w))), W, X)
  assert dtypes_of(ran, "tanh") == {"float16"}


@jax.custom_jvp
def twice_and_count(x):
  return x * 2, jnp.sum(x > 0)


twice_and_count.defjvp(lambda primals, tangents: (
    twice_and_count(*primals), (tangents[0] * 2, np.zeros((), jax.dtypes.float0))))


def test_a_custom_jvp_function_with_an_integer_result_is_differentiated_by_its_rule():
  loss = lambda w: jnp.sum(jls.autocast(lambda w, x: twice_and_count(x @ w)[0])(w, X))
  np.testing.assert_allclose(jax.grad(loss)(W), jax.grad(
      lambda w: jnp.sum(twice_and_count(X @ w)[0]))(W), rtol=1e-2)


def test_a_bias_gradient_is_summed_in_float32_over_more_rows_than_float16_holds():
  rows = 70_000  # each row adds 1 to the bias's gradient: 70,000 is past float16's 65,504
  x, w, b = jnp.ones((rows, 16)) / 16, jnp.zeros((16, 32)), jnp.zeros(32)
  loss = lambda w, b, x: jnp.sum((x @ w + b).astype(jnp.float32))
  grad = jax.jit(jax.grad(jls.autocast(loss), argnums=1))(w, b, x)
  np.testing.assert_array_equal(grad, np.full(32, rows, np.float32))


def test_a_residual_added_to_a_matmuls_result_takes_the_wider_dtype():
  square = jax.random.normal(KEYS[2], (32, 32)) / 6
  ran = forward_dtypes(jls.autocast(lambda w, x: x + x @ w), square, X)
  assert ran["add"] == {F32}


@jax.custom_jvp
def bias_summed_in_float32(bias, like):
  """`bias` broadcast to `like`'s shape and cast to its dtype, its gradient (the sum over
  the rows) summed in float32: the hand-cast model that sums its bias gradients as
  autocast does."""
  return jnp.broadcast_to(bias, like.shape).astype(like.dtype)


bias_summed_in_float32.defjvp(lambda primals, tangents: (
    bias_summed_in_float32(*primals),
    jnp.broadcast_to(tangents[0].astype(jnp.float32), primals[1].shape).astype(
        primals[1].dtype)))


@pytest.mark.parametrize("activation", [jnp.tanh, jax.nn.relu, jax.nn.gelu, jax.nn.silu],
                         ids=["tanh", "relu", "gelu", "silu"])
def test_a_biased_mlps_temporaries_are_within_2_percent_of_the_hand_cast_models(activation):
  # Two hand-cast models: flax's float16 `Dense`, which sums its bias gradients in float16
  # (losing precision past 2,048 rows, the tests above and below), and the same layer
  # summing them in float32, as autocast does. Which of the two XLA:CPU gives fewer
  # temporaries depends on the activation and on XLA's version (jax 0.10.2: the float16
  # sums, by 10% for tanh; jax 0.12: equal for tanh, the float16 sums for relu); autocast
  # costs no more than the one that computes what it computes, or than flax's.
  class Dense(linen.Module):
    width: int
    dtype: object = None

    @linen.compact
    def __call__(self, x):
      kernel = self.param("kernel", linen.initializers.lecun_normal(), (x.shape[-1], self.width))
      bias = self.param("bias", linen.initializers.zeros, (self.width,))
      if self.dtype is None:  # as written for autocast: float32, no casts
        return x @ kernel + bias
      y = x.astype(self.dtype) @ kernel.astype(self.dtype)
      return y + bias_summed_in_float32(bias, y)

  class FlaxMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
      for width in (512, 512, 512):
        x = activation(linen.Dense(width, dtype=jnp.float16)(x))
      return linen.Dense(1, dtype=jnp.float16)(x)

  class MLP(linen.Module):
    dtype: object = None

    @linen.compact
    def __call__(self, x):
      for width in (512, 512, 512):
        x = activation(Dense(width, dtype=self.dtype)(x))
      return Dense(1, dtype=self.dtype)(x)

  x = jax.random.normal(KEYS[0], (1024, 64))
  variables = MLP().init(KEYS[1], x)

  def temporaries(model, wrap):
    loss = wrap(lambda v, x: jnp.mean(model.apply(v, x).astype(jnp.float32) ** 2))
    step = jax.jit(jax.value_and_grad(loss)).lower(variables, x).compile()
    return step.memory_analysis().temp_size_in_bytes

  summing_alike = temporaries(MLP(jnp.float16), lambda f: f)
  flax_float16 = temporaries(FlaxMLP(), lambda f: f)
  assert temporaries(MLP(), jls.autocast) <= 1.02 * max(summing_alike, flax_float16)


def test_a_language_models_temporaries_are_within_2_percent_of_its_jmp_policys():
  # levanter's equinox slice (`real_programs.TinyLm`: embedding, LayerNorm, GELU MLP,
  # unembedding) with a language model's proportions, a vocabulary 64 times the width
  # (GPT-2's is 50,257 to 768): its float32 loss under autocast against the same loss under
  # levanter's float16 jmp policy (parameters cast to float16, logits cast to float32).
  # XLA's memory analysis of the jitted value and gradient: 0.97x on jax 0.12 and 0.99x on
  # 0.10.2. The logits stay in float16 and the loss's float32 runs inside its log-softmax,
  # where the policy writes float32 logits; the embedding's rows, the residual stream and
  # the LayerNorm's output stay float32 (as PyTorch's autocast keeps them), which the
  # policy casts to float16: with a vocabulary narrower than the width these weigh more
  # (1.17x at 64 words and width 128).
  model = rp.TinyLm(8192, 128, key=KEYS[0])
  tokens = jax.random.randint(KEYS[1], (16, 65), 0, 8192)
  params, static = eqx.partition(model, eqx.is_array)

  def temporaries(loss):
    step = lambda p, t: eqx.filter_value_and_grad(loss)(eqx.combine(p, static), t)
    return jax.jit(step).lower(params, tokens).compile().memory_analysis().temp_size_in_bytes

  hand_cast = temporaries(rp.make_loss_fn(jmp.get_policy("p=f32,c=f16,o=f32")))
  autocast = temporaries(jls.autocast(rp.make_loss_fn(jmp.get_policy("f32"))))
  assert autocast <= 1.02 * hand_cast, (autocast, hand_cast)


def test_a_bfloat16_convolutions_bias_gradient_is_summed_in_float32():
  conv = nnx.Conv(32, 64, (3, 3), rngs=nnx.Rngs(0))
  x = jax.random.normal(KEYS[0], (8, 16, 16, 32))  # 2,048 positions summed per feature
  loss = lambda m, x: jnp.mean(m(x) ** 2)
  exact = nnx.grad(loss)(conv, x).bias[...]
  autocast = nnx.grad(jls.autocast(loss, jnp.bfloat16))(conv, x).bias[...]
  # bfloat16's own rounding of the activations and of the result: 0.3% (5% when summed
  # in bfloat16).
  assert jnp.linalg.norm(autocast - exact) / jnp.linalg.norm(exact) < 0.01


def test_a_bias_gradient_summed_in_float32_leaves_forward_mode_working():
  b = jax.random.normal(KEYS[2], (16,))
  f = lambda w, b, x: jnp.tanh(x @ w + b)
  autocast = jls.autocast(f)
  out, tangent = jax.jvp(lambda b: autocast(W, b, X), (b,), (jnp.ones_like(b),))
  np.testing.assert_allclose(out, f(W, b, X), atol=3e-3)
  np.testing.assert_allclose(tangent, jax.jvp(lambda b: f(W, b, X), (b,), (jnp.ones_like(b),))[1],
                             atol=3e-3)
  assert forward_dtypes(autocast, W, b, X)["dot_general"] == {F16}


# --- activation functions ------------------------------------------------------------

ACTIVATIONS = {
    "gelu": jax.nn.gelu,
    "gelu, exact": functools.partial(jax.nn.gelu, approximate=False),
    "silu": jax.nn.silu,
    "mish": jax.nn.mish,
    "elu": jax.nn.elu,
    "celu": jax.nn.celu,
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_of_a_float16_value_is_float16_computed_in_float32(name):
  # As PyTorch's `F.gelu` under its autocast: one operation, float32 inside, its result in
  # its operand's dtype, so that what follows it stays in float16 (the `cos` below).
  activation = ACTIVATIONS[name]
  fun = lambda w, x: jnp.cos(activation(x @ w))
  ran = forward_dtypes(jls.autocast(fun), W, X)
  assert ran["dot_general"] == ran["cos"] == {F16}
  assert {F32} == set().union(*(ran.get(p, set()) for p in (
      "integer_pow", "tanh", "erfc", "logistic", "expm1", "exp", "log1p")))
  np.testing.assert_allclose(jax.jit(jls.autocast(fun))(W, X), fun(W, X), atol=5e-3)


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_an_activation_in_float16_is_differentiated_in_float32(name):
  # Large pre-activations: GELU's float16 formula overflows `x ** 3` and its derivative
  # `3 x ** 2` (inf times tanh's 0 derivative is NaN); computed in float32 it does not.
  activation = ACTIVATIONS[name]
  loss = lambda w, x: jnp.mean(activation(x @ w) ** 2)
  big = X * 100.0
  grads = jax.jit(jax.grad(jls.autocast(loss)))(W, big)
  assert bool(jnp.all(jnp.isfinite(grads)))
  exact = jax.grad(loss)(W, big)
  assert jnp.linalg.norm(grads - exact) / jnp.linalg.norm(exact) < 1e-2


def test_an_activation_inside_an_inner_float32_autocast_stays_float32():
  inside = lambda h: jnp.cos(jax.nn.gelu(h) + jax.nn.silu(h))
  part = jls.autocast(inside, jnp.float32)
  fun = jls.autocast(lambda w, x: part(x @ w))
  ran = forward_dtypes(fun, W, X)
  assert ran["dot_general"] == {F16} and ran["cos"] == ran["add"] == {F32}
  h = (X.astype(jnp.float16) @ W.astype(jnp.float16)).astype(jnp.float32)
  np.testing.assert_allclose(jax.jit(fun)(W, X), jax.jit(inside)(h), rtol=1e-6, atol=1e-6)


def test_an_activation_of_a_float32_value_runs_as_written():
  fun = lambda x: jax.nn.gelu(x) * 3.0
  assert forward_dtypes(jls.autocast(fun), X) == forward_dtypes(fun, X)


# --- 8-bit floats ---------------------------------------------------------------------


def test_a_matmul_between_two_float8_types_runs_as_written():
  a = (X[:, :16] * 8).astype(jnp.float8_e4m3fn)
  b = W[:16].astype(jnp.float8_e5m2)
  fun = lambda a, b: lax.dot_general(a, b, (((1,), (0,)), ((), ())),
                                     preferred_element_type=jnp.float32)
  out = jls.autocast(fun)(a, b)
  assert out.dtype == F32
  np.testing.assert_array_equal(out, jax.jit(fun)(a, b))


def test_flax_fp8_dense_runs_under_autocast_value_and_grad():
  model = linen.Dense(16, dot_general_cls=linen.Fp8DirectDotGeneralOp)
  variables = model.init(KEYS[2], X)
  loss = lambda v, x: jnp.mean(jax.nn.gelu(model.apply(v, x)) ** 2)
  value, grads = jax.jit(jls.autocast(jax.value_and_grad(loss)))(variables, X)
  expected, expected_grads = jax.jit(jax.value_and_grad(loss))(variables, X)
  np.testing.assert_allclose(value, expected, rtol=2e-2)
  kernel = grads["params"]["kernel"]
  assert kernel.dtype == F32 and bool(jnp.all(jnp.isfinite(kernel)))
  np.testing.assert_allclose(kernel, expected_grads["params"]["kernel"], rtol=0.1, atol=1e-3)


# --- the sums that differentiation adds ------------------------------------------------

TIES = jnp.ones((70_000, 4))  # more ties than float16 counts exactly (2,048) or at all (65,504)


def max_loss(w, x):
  return jnp.max(x @ w)


@pytest.mark.parametrize("order", ["grad of autocast", "autocast of grad"])
def test_the_derivative_of_max_counts_its_ties_in_float32(order):
  grad = (jax.grad(jls.autocast(max_loss)) if order == "grad of autocast"
          else jls.autocast(jax.grad(max_loss)))
  w = jnp.full((4, 1), 0.25)
  np.testing.assert_allclose(jax.jit(grad)(w, TIES), jax.grad(max_loss)(w, TIES), rtol=2e-3)


def test_the_summary_puts_the_derivatives_count_of_ties_in_the_backward_pass_in_float32():
  ran = jls.precision_summary(jls.autocast(max_loss), jnp.full((4, 1), 0.25), TIES[:4096])
  assert (ran.count("reduce_sum", jnp.float32), ran.count("reduce_sum", jnp.float16)) == (0, 0)
  assert dtypes_of(ran, "reduce_sum", backward=True) == {"float32"}
  assert dtypes_of(ran, "reduce_max") == {"float32"}


def test_the_summary_puts_what_only_the_derivative_computes_in_the_backward_pass_of_a_loop():
  def loss(w, x):
    return jnp.sum(lax.scan(lambda h, _: (jnp.sin(h @ w), None), x, None, length=2)[0])

  ran = jls.precision_summary(loss, jnp.eye(4), X[:8, :4])
  assert (ran.count("sin", jnp.float32), ran.count("sin", jnp.float32, backward=True)) == (1, 0)
  assert (ran.count("cos", jnp.float32), ran.count("cos", jnp.float32, backward=True)) == (0, 1)
