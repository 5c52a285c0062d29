"""`autocast`: each primitive at its chosen precision, through every JAX transformation.

Dtypes are asserted on the traced program, forward and backward, with
`precision_summary`, inside every kind of sub-program; numerics against float32.
"""

import inspect
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx
from helpers import count_compiles
from helpers import dtypes_of
from helpers import forward_dtypes
from jax import lax

import jax_lossscale as jls

F16, BF16, F32 = np.dtype(jnp.float16), np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
KEYS = jax.random.split(jax.random.key(0), 4)
X = jax.random.normal(KEYS[0], (8, 4))
W = jax.random.normal(KEYS[1], (4, 4)) / 2
Y = jax.random.normal(KEYS[2], (8, 4))


def summary(fun, *args):
  return jls.precision_summary(fun, *args)


def loss_of(model):
  return lambda w, x: jnp.mean((model(w, x) - Y) ** 2)


# --- the precision of each primitive ------------------------------------------------


def test_matmuls_run_in_compute_dtype_and_the_outputs_keep_their_dtypes():
  out = jls.autocast(lambda w, x: x @ w)(W, X)
  ran = summary(jls.autocast(lambda w, x: jnp.sum(x @ w)), W, X)
  assert out.dtype == F32
  assert dtypes_of(ran, "dot_general") == {"float16"}
  assert dtypes_of(ran, "dot_general", backward=True) == {"float16"}


def test_outputs_that_are_constants_come_back_as_arrays_as_jit_returns_them():
  # equinox's BatchNorm returns its `first_time` flag as a constant of the program.
  f = lambda x: (x, jnp.array(False), 2.0, jnp.float32(3.0), jnp.int32(4))
  called, jitted = jls.autocast(f)(jnp.ones(2)), jax.jit(f)(jnp.ones(2))
  assert all(isinstance(x, jax.Array) for x in called)
  assert [(x.dtype, x.weak_type) for x in called] == [(x.dtype, x.weak_type) for x in jitted]


def test_called_without_jit_it_compiles_once_and_nnx_state_is_written_back():
  # Interpreted anew at each call, its jitted functions (`relu`, `log_softmax`) were new
  # programs, compiled again every time.
  from flax import nnx

  model = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)), nnx.BatchNorm(16, rngs=nnx.Rngs(0)))
  f = jls.autocast(lambda m, x: jnp.mean(jax.nn.log_softmax(jax.nn.relu(m(x)), axis=-1)))
  first = f(model, X)
  with count_compiles() as compiles:
    for _ in range(5):
      again = f(model, X)
  assert compiles == [] and again.dtype == F32 and float(again) == float(first)
  # The running statistics moved at each of the six calls, as eagerly called layers move them.
  reference = nnx.Sequential(nnx.Linear(4, 16, rngs=nnx.Rngs(0)),
                             nnx.BatchNorm(16, rngs=nnx.Rngs(0)))
  for _ in range(6):
    reference(X)
  np.testing.assert_allclose(model.layers[1].mean[...], reference.layers[1].mean[...],
                             rtol=1e-2, atol=1e-3)


def test_called_without_jit_arguments_equal_in_value_but_not_in_type_are_other_calls():
  # 2, 2.0 and True are equal in Python: each must run as its own call, as under
  # jax.jit's static arguments, not as the program traced with the first.
  f = jls.autocast(lambda x, n: x * n)
  x = jnp.arange(4)
  for n in (2, 2.0, True, 2, np.float32(2.0), -0.0, 0.0, float("nan"), float("nan")):
    out, expected = f(x, n), x * n
    assert out.dtype == expected.dtype, n
    np.testing.assert_array_equal(out, expected)
    assert np.signbit(out).tolist() == np.signbit(expected).tolist(), n
  with count_compiles() as compiles:
    f(x, float("nan"))  # a new NaN object: the same signature
  assert compiles == []


def test_called_without_jit_complex_numbers_are_keyed_by_their_parts_bits():
  # sqrt's branch cut: complex(-1, -0.0) is not complex(-1, 0.0), and a complex NaN is
  # one signature, not a new one at every call.
  f = jls.autocast(lambda x, z: x * jnp.sqrt(z))
  x = jnp.ones(2)
  for z in (complex(-1, 0.0), complex(-1, -0.0)):
    np.testing.assert_array_equal(f(x, z), x * jnp.sqrt(z))
  f(x, complex(float("nan"), 0))
  with count_compiles() as compiles:
    f(x, complex(float("nan"), 0))
  assert compiles == []


def test_called_without_jit_an_unhashable_argument_runs_as_it_is_with_a_warning():
  import dataclasses

  @dataclasses.dataclass
  class Config:  # not frozen: unhashable
    weight: float = 2.0

  f = jls.autocast(lambda x, config: x * config.weight)
  with pytest.warns(UserWarning, match=r"autocast\(<lambda>\).*neither an array nor hashable "
                    r"\(a Config\)"):
    out = f(X, Config())
  np.testing.assert_array_equal(out, X * 2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once
    f(X, Config())


@pytest.mark.parametrize("fp8", [None, "tensorwise"])
def test_a_jitted_function_holding_an_array_constant_is_autocast_too(fp8):
  # With jax 0.12 its program holds the constant: it ran at float32, with a warning that
  # autocast "does not know how to run `jit`".
  weights = jnp.array([0.5, 1.5] * 8)
  layer = jax.jit(lambda h, w: jnp.tanh(h @ w) * weights)
  x, w = jnp.ones((16, 16)), jnp.ones((16, 16)) / 16
  f = jls.autocast(lambda w, x: jnp.sum(layer(x, w)), jnp.float16 if fp8 is None
                   else jnp.bfloat16, fp8=fp8)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    ran = summary(f, w, x)
  assert dtypes_of(ran, "dot_general") == {"float16" if fp8 is None else "float8_e4m3fn"}
  np.testing.assert_allclose(f(w, x), jnp.sum(layer(x, w)), rtol=2e-2)


def test_convolutions_run_in_compute_dtype_forward_and_backward():
  image, kernel = jnp.ones((1, 2, 6, 6)), jnp.ones((3, 2, 3, 3)) / 9
  conv = lambda k, x: jnp.sum(lax.conv(x, k, (1, 1), "SAME") ** 2)
  ran = summary(jls.autocast(conv), kernel, image)
  assert dtypes_of(ran, "conv_general_dilated") == {"float16"}
  assert dtypes_of(ran, "conv_general_dilated", backward=True) == {"float16"}
  np.testing.assert_allclose(jls.autocast(conv)(kernel, image), conv(kernel, image), rtol=1e-2)


@pytest.mark.parametrize("compute_dtype, expected", [
    (jnp.float16, "float16"), (jnp.bfloat16, "bfloat16"), ("f16", "float16"),
    ("half", "float16"), ("bf16", "bfloat16")])
def test_compute_dtype_takes_dtypes_and_the_policy_grammars_names(compute_dtype, expected):
  ran = summary(jls.autocast(lambda w, x: jnp.sum(x @ w), compute_dtype), W, X)
  assert dtypes_of(ran, "dot_general") == {expected}


@pytest.mark.parametrize("compute_dtype", [jnp.int32, jnp.bool_, "f8", None, float])
def test_a_compute_dtype_that_is_not_floating_is_refused_naming_it(compute_dtype):
  with pytest.raises(ValueError, match="compute_dtype"):
    jls.autocast(lambda x: x, compute_dtype)


@pytest.mark.parametrize("op, primitive", [
    (jnp.exp, "exp"), (jnp.log1p, "log1p"), (jnp.expm1, "expm1"), (jnp.square, "square"),
    (lambda h: h ** 3, "integer_pow"), (lambda h: h ** 2.5, "pow"), (lax.rsqrt, "rsqrt"),
    (jax.nn.sigmoid, "logistic"), (lambda h: jnp.sum(h, axis=0), "reduce_sum"),
    (lambda h: lax.cumsum(h, axis=0), "cumsum"), (lambda h: jnp.prod(h, axis=0), "reduce_prod"),
    (lambda h: jnp.log(jnp.abs(h) + 1), "log")])
def test_precision_sensitive_primitives_run_in_float32_on_a_float16_matmuls_result(op, primitive):
  program = jax.make_jaxpr(jls.autocast(lambda w, x: op(jnp.abs(x @ w) + 0.5)))(W, X)
  ran = {e.primitive.name: e.invars[0].aval.dtype for e in program.eqns}
  assert (ran[primitive], ran["dot_general"]) == (F32, F16)


def test_other_primitives_run_at_the_widest_dtype_of_their_operands():
  def model(w, x):
    h = jnp.tanh(x @ w) * 2.0  # float16, a Python scalar does not widen it
    return h + jnp.ones(4)  # a float32 bias: float32
  ran = forward_dtypes(jls.autocast(model), W, X)
  assert (ran["tanh"], ran["mul"], ran["add"]) == ({F16}, {F16}, {F32})


def test_an_explicit_cast_is_respected():
  ran = summary(jls.autocast(lambda x: jnp.sum(jnp.tanh(x.astype(jnp.bfloat16)))), X)
  assert dtypes_of(ran, "tanh") == {"bfloat16"}


def test_integers_booleans_and_non_array_arguments_pass_through():
  def fun(w, x, ids, mask, scale, activation):
    h = activation(x[ids] @ w) * scale
    return jnp.where(mask, h, 0.0), ids + 1

  out, ids = jls.autocast(fun)(W, X, jnp.arange(3), jnp.ones((3, 4), bool), 0.5, jnp.tanh)
  assert (out.dtype, ids.dtype) == (F32, jnp.arange(3).dtype)
  np.testing.assert_array_equal(ids, jnp.arange(1, 4))


def test_a_scatter_written_by_hand_runs_as_traced_without_a_warning():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    out = jls.autocast(lambda w, x: jnp.zeros(8).at[jnp.arange(4)].add((x @ w)[0]))(W, X)
  np.testing.assert_allclose(out[:4], (X @ W)[0], rtol=1e-2, atol=1e-3)
  assert out.dtype == F32


def test_autocast_of_a_gradient_runs_the_derivatives_sums_in_float32_too():
  loss = lambda w, x: jnp.sum(jnp.tanh(x @ w) * 2.0)
  ran = forward_dtypes(jls.autocast(jax.value_and_grad(loss)), W, X)
  assert ran["dot_general"] == {F16} and ran["reduce_sum"] == {F32}
  value, grads = jls.autocast(jax.value_and_grad(loss))(W, X)
  assert grads.dtype == F32
  np.testing.assert_allclose(grads, jax.grad(loss)(W, X), rtol=2e-2, atol=2e-2)


def test_an_embedding_lookup_reads_the_float32_table_and_accumulates_its_gradient_in_float32():
  table = jax.random.normal(KEYS[3], (50, 4))
  loss = jls.autocast(lambda table, w, ids: jnp.sum((table[ids] @ w) ** 2))
  ids = jnp.array([1, 2, 2, 7])
  ran = summary(lambda table, w: loss(table, w, ids), table, W)
  program = jax.make_jaxpr(jax.grad(loss))(table, W, ids)
  assert dtypes_of(ran, "gather") == {"float32"}
  assert dtypes_of(ran, "scatter-add", backward=True) | dtypes_of(
      ran, "scatter_add", backward=True) == {"float32"}
  assert not any(e.primitive.name == "convert_element_type" and e.outvars[0].aval.shape == (
      50, 4) for e in program.eqns)  # no float16 copy of the table
  assert jax.grad(loss)(table, W, ids).dtype == F32


# --- every transformation, every sub-program ----------------------------------------


def mlp(w, x):
  return jnp.tanh(jnp.tanh(x @ w) @ w) @ w


def test_gradients_of_float32_inputs_are_float32_and_close_to_float32s():
  grads = jax.grad(loss_of(jls.autocast(mlp)), argnums=(0, 1))(W, X)
  expected = jax.grad(loss_of(mlp), argnums=(0, 1))(W, X)
  assert [g.dtype for g in grads] == [F32, F32]
  for g, e in zip(grads, expected, strict=True):
    np.testing.assert_allclose(g, e, rtol=2e-2, atol=2e-3)


def test_jit_vmap_and_jvp_of_autocast_agree_with_float32():
  fast = jls.autocast(mlp)
  np.testing.assert_allclose(jax.jit(fast)(W, X), mlp(W, X), rtol=2e-2, atol=2e-3)
  np.testing.assert_allclose(jax.vmap(fast, (None, 0))(W, X), mlp(W, X), rtol=2e-2, atol=2e-3)
  _, tangent = jax.jvp(fast, (W, X), (W, X))
  _, expected = jax.jvp(mlp, (W, X), (W, X))
  assert tangent.dtype == F32
  np.testing.assert_allclose(tangent, expected, rtol=3e-2, atol=3e-3)


@jax.custom_jvp
def custom_jvp_matmul(w, x):
  return x @ w


custom_jvp_matmul.defjvp(lambda primals, tangents: (
    custom_jvp_matmul(*primals), tangents[1] @ primals[0] + primals[1] @ tangents[0]))


@jax.custom_vjp
def custom_vjp_matmul(w, x):
  return x @ w


custom_vjp_matmul.defvjp(lambda w, x: (x @ w, (w, x)),
                         lambda res, g: (res[1].T @ g, g @ res[0].T))

SUB_PROGRAMS = {
    "scan": lambda w, x: lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=2)[0],
    "fori_loop": lambda w, x: lax.fori_loop(0, 2, lambda i, h: jnp.tanh(h @ w), x),
    "while_loop": lambda w, x: lax.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1],
    "cond": lambda w, x: lax.cond(x[0, 0] > 0, lambda h: h @ w, lambda h: -(h @ w), x),
    "switch": lambda w, x: lax.switch(1, [lambda h: h @ w, lambda h: h @ w.T], x),
    "jit": lambda w, x: jax.jit(lambda h: jnp.tanh(h @ w))(x),
    "checkpoint": lambda w, x: jax.checkpoint(lambda h: jnp.tanh(h @ w))(x),
    "custom_jvp": custom_jvp_matmul,
    "custom_vjp": custom_vjp_matmul,
}


@pytest.mark.parametrize("name", SUB_PROGRAMS)
def test_matmuls_inside_every_sub_program_run_in_float16_forward(name):
  ran = forward_dtypes(jls.autocast(SUB_PROGRAMS[name]), W, X)
  assert ran["dot_general"] == {F16}


@pytest.mark.parametrize("name", ["scan", "fori_loop", "cond", "jit", "checkpoint"])
def test_backward_matmuls_inside_sub_programs_run_in_float16_with_float32_gradients(name):
  fun = SUB_PROGRAMS[name]
  ran = summary(jls.autocast(fun), W, X)
  assert dtypes_of(ran, "dot_general", backward=True) == {"float16"}
  grads = jax.grad(loss_of(jls.autocast(fun)))(W, X)
  assert grads.dtype == F32
  np.testing.assert_allclose(grads, jax.grad(loss_of(fun))(W, X), rtol=3e-2, atol=3e-3)


def test_custom_derivative_rules_are_kept_not_inlined():
  @jax.custom_vjp
  def clip_gradient(x):
    return x

  clip_gradient.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -1e-3, 1e-3),))
  grads = jax.grad(lambda w: jnp.sum(jls.autocast(
      lambda w, x: clip_gradient(x @ w))(w, X) * 100.0))(W)
  expected = X.T @ jnp.full((8, 4), 1e-3)
  np.testing.assert_allclose(grads, expected, rtol=1e-2)
  relu_grad = jax.grad(lambda x: jls.autocast(jax.nn.relu)(x))(0.0)
  assert relu_grad == 0.0  # relu's own rule at 0 (max's would give 0.5)


def test_nested_autocast_and_autocast_of_a_jitted_function():
  inner = jls.autocast(lambda w, x: jnp.tanh(x @ w), jnp.bfloat16)
  nested = jls.autocast(lambda w, x: inner(w, x) @ w)
  ran = summary(nested, W, X)
  assert dtypes_of(ran, "dot_general") == {"float16", "bfloat16"}
  jitted = summary(jls.autocast(jax.jit(mlp)), W, X)
  assert dtypes_of(jitted, "dot_general") == {"float16"}
  assert dtypes_of(jitted, "dot_general", backward=True) == {"float16"}
  np.testing.assert_allclose(jls.autocast(jax.jit(mlp))(W, X), mlp(W, X), rtol=2e-2, atol=2e-3)


def test_a_primitive_holding_programs_it_does_not_know_runs_as_traced_with_one_warning():
  opaque = jax.extend.core.Primitive("opaque_call")
  opaque.def_abstract_eval(lambda x, *, program: x)

  def fun(w, x):
    program = jax.make_jaxpr(jnp.tanh)(x)
    h = opaque.bind(x @ w, program=program)
    return opaque.bind(h @ w, program=program)

  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    program = jax.make_jaxpr(jls.autocast(fun))(W, X)
  assert [str(w.message).count("`opaque_call`") for w in caught] == [1]
  ops = [e for e in program.eqns if e.primitive.name == "opaque_call"]
  assert [e.invars[0].aval.dtype for e in ops] == [F32, F32]


def test_a_foreign_function_call_runs_as_traced_with_a_warning():
  def fun(w, x):
    return jax.ffi.ffi_call("some_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))(x @ w)

  with pytest.warns(UserWarning, match="`ffi_call`"):
    program = jax.make_jaxpr(jls.autocast(fun))(W, X)
  [call] = [e for e in program.eqns if e.primitive.name == "ffi_call"]
  assert call.invars[0].aval.dtype == F32


def test_the_summary_prints_a_table_of_each_primitive_and_dtype():
  table = str(jls.precision_summary(jls.autocast(loss_of(mlp)), W, X))
  assert table.splitlines()[0].split() == ["primitive", "dtype", "forward", "backward", "location"]
  assert any(line.split()[:2] == ["dot_general", "float16"] for line in table.splitlines())


def test_linear_solves_run_at_traced_precision_without_a_warning():
  a = W @ W.T + 4 * jnp.eye(4)  # symmetric positive definite, for cg
  solves = {"solve": jnp.linalg.solve, "inv": lambda a, b: jnp.linalg.inv(a),
            "cg": lambda a, b: jax.scipy.sparse.linalg.cg(lambda v: a @ v, b)[0]}
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    for solve in solves.values():
      np.testing.assert_allclose(jls.autocast(solve)(a, X[0]), solve(a, X[0]), rtol=1e-5)


def test_jaxs_high_level_primitives_run_as_traced():
  # With jax 0.12, ldexp, frexp and searchsorted (interp, digitize) are `call_hi_primitive`
  # equations, typed by what they were traced with: ldexp of a float16 matmul's result by
  # 2**20 would be inf in float16, and interp crashed inside JAX.
  ldexp = lambda w, x: jnp.ldexp(x @ w, 20)
  out = jls.autocast(ldexp)(W, X)
  assert out.dtype == F32 and np.isfinite(out).all()
  np.testing.assert_allclose(out / 2**20, X @ W, atol=1e-2)  # float16's matmul, scaled
  interp = lambda w, x: jnp.interp(x @ w, jnp.linspace(-3.0, 3.0, 7), jnp.arange(7.0))
  np.testing.assert_allclose(jls.autocast(interp)(W, X), interp(W, X), atol=1e-2)
  loss = lambda w, x: jnp.sum(jnp.ldexp(x @ w, 20) ** 2) * 1e-12
  np.testing.assert_allclose(jax.jit(jax.grad(jls.autocast(loss)))(W, X), jax.grad(loss)(W, X),
                             rtol=2e-2, atol=1e-2)


def test_called_without_jit_a_typed_prng_key_is_an_argument_like_any_array():
  def dropout_loss(w, key, x):
    h = x @ w
    return jnp.mean(jnp.where(jax.random.bernoulli(key, 0.9, h.shape), h, 0.0) ** 2)

  key = jax.random.key(0)
  expected = jax.jit(jls.autocast(dropout_loss))(W, key, X)
  np.testing.assert_array_equal(jls.autocast(dropout_loss)(W, key, X), expected)


# --- where operations ran, and messages in the user's words ----------------------------


def line_of(fun, text):
  """The line number of the line of `fun`'s source that contains `text`."""
  lines, first = inspect.getsourcelines(fun)
  [offset] = [i for i, line in enumerate(lines) if text in line]
  return first + offset


def two_layers(w, x):
  h = jnp.tanh(x @ w)  # first layer
  return jnp.sum(h @ w)  # second layer


def test_the_summary_locates_each_rows_operations_at_the_users_lines_forward_and_backward():
  ran = summary(jls.autocast(two_layers), W, X)
  lines = [line_of(two_layers, "# first layer"), line_of(two_layers, "# second layer")]
  for backward, each in ((False, 1), (True, 2)):
    where = ran.locations("dot_general", F16, backward)
    assert {(loc.file, loc.line, loc.function): n for loc, n in where.items()} == {
        (__file__, line, "two_layers"): each for line in lines}


def test_the_casts_autocast_inserts_are_located_at_the_operations_they_serve():
  ran = summary(jls.autocast(two_layers), W, X)
  casts = [loc for _, dtype, *_ in ran.rows for backward in (False, True)
           for loc in ran.locations("convert_element_type", dtype, backward)]
  assert casts and {loc.file for loc in casts} == {__file__}


def test_the_summary_locates_operations_in_their_name_scope_inside_sub_programs():
  def layer(h, w):
    with jax.named_scope("dense"):
      return jnp.tanh(h @ w)

  def model(w, x):
    with jax.named_scope("encoder"):
      return jnp.sum(jax.jit(layer)(x, w))

  ran = summary(jls.autocast(model), W, X)
  for backward in (False, True):
    assert {loc.scope for loc in ran.locations("dot_general", F16, backward)} == {
        "encoder/dense"}


def test_an_activation_and_a_checkpoint_are_located_in_their_name_scope_once_and_at_its_line():
  def model(w, x):
    with jax.named_scope("mlp"):
      h = jax.nn.gelu(x @ w)  # the activation
      return jnp.sum(jax.checkpoint(lambda h: jnp.sin(h) * h)(h))

  ran = summary(jls.autocast(model), W, X)
  line = line_of(model, "# the activation")
  for primitive in ("integer_pow", "tanh", "sin", "convert_element_type"):
    for dtype in ("float16", "float32"):
      for backward in (False, True):
        assert {loc.scope for loc in ran.locations(primitive, dtype, backward)} <= {"mlp"}
  assert {(loc.file, loc.line) for backward in (False, True)
          for dtype in ("float16", "float32")
          for loc in ran.locations("convert_element_type", dtype, backward)} >= {(__file__, line)}
  assert {loc.line for loc in ran.locations("tanh", "float32", True)} == {line}


def test_the_printed_summary_shows_a_few_locations_per_row_and_counts_the_rest():
  def deep(w, x):
    for i in range(jls.PrecisionSummary.SHOWN + 2):
      with jax.named_scope(f"layer_{i}"):
        x = x @ w
    return jnp.sum(x)

  table = str(summary(jls.autocast(deep), W, X))
  line = line_of(deep, "x = x @ w")
  assert f"layer_0: test_autocast.py:{line} (deep)" in table
  assert "... 2 more (summary.locations('dot_general', 'float16'))" in table


def test_a_gradient_that_raises_is_raised_by_the_summary():
  @jax.custom_vjp
  def broken(x):
    return x

  def backward(_, g):
    raise ValueError("a broken backward rule")

  broken.defvjp(lambda x: (x, None), backward)
  with pytest.raises(ValueError, match="a broken backward rule"):
    summary(lambda w, x: jnp.sum(broken(x @ w)), W, X)


def test_the_summary_reads_a_dtype_as_autocast_does():
  # NumPy reads "f16" as float128: a count by that name would be 0 whatever ran.
  ran = summary(jls.autocast(loss_of(two_layers)), W, X)
  assert ran.count("dot_general", "f16") == ran.count("dot_general", F16) > 0
  assert ran.locations("dot_general", "f16") == ran.locations("dot_general", F16)
  assert ran.count("dot_general", "bf16") == 0
  with pytest.raises(ValueError, match=r"`dtype` must be a dtype.*got 'f8'"):
    ran.count("dot_general", "f8")


def test_a_function_with_no_reverse_derivative_is_summarized_forward_with_a_warning():
  def looped(w, x):
    body = lambda c: (c[0] + 1, jnp.tanh(c[1] @ w))
    return jnp.sum(lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1])

  with pytest.warns(UserWarning, match="reverse mode"):
    ran = summary(jls.autocast(looped), W, X)
  assert ran.count("dot_general", F16) == 1
  assert not any(backward for *_, backward in ran.rows)


def test_a_function_that_cannot_be_traced_is_named_with_its_arguments_as_jit_names_them():
  def branchy(params, x):
    if jnp.sum(x @ params["w"]) > 0:
      return x
    return -x

  with pytest.raises(jax.errors.TracerBoolConversionError,
                     match=r"branchy at .* arguments params\['w'\] and x") as error:
    jls.autocast(branchy)({"w": W}, X)
  assert "new_arrays" not in str(error.value)


def test_the_summary_of_a_function_that_cannot_be_traced_names_it_and_its_arguments():
  def branchy(params, x):
    return x if jnp.sum(x @ params["w"]) > 0 else -x

  with pytest.raises(jax.errors.TracerBoolConversionError,
                     match=r"branchy at .* arguments params\['w'\] and x"):
    summary(branchy, {"w": W}, X)


@pytest.mark.parametrize("fun", [3, None])
def test_a_fun_that_is_not_callable_is_refused_at_once_naming_it(fun):
  with pytest.raises(TypeError, match=f"`fun`.*{fun}"):
    jls.autocast(fun)
  with pytest.raises(TypeError, match=f"precision_summary's `fun`.*{fun}"):
    jls.precision_summary(fun, W, X)
  with pytest.raises(TypeError, match=f"scaled_value_and_grad's `fun`.*{fun}"):
    jls.scaled_value_and_grad(fun)


def test_an_unknown_primitives_warning_points_at_the_users_line():
  def fun(w, x):
    kernel = jax.ffi.ffi_call("some_kernel", jax.ShapeDtypeStruct(x.shape, x.dtype))
    return kernel(x @ w)  # the call

  with pytest.warns(UserWarning, match="`ffi_call`") as caught:
    jax.make_jaxpr(jls.autocast(fun))(W, X)
  [warning] = [w for w in caught if "`ffi_call`" in str(w.message)]
  assert (warning.filename, warning.lineno) == (__file__, line_of(fun, "# the call"))


# --- numerics and training ----------------------------------------------------------


def layer_norm(h):
  mean = jnp.mean(h, axis=-1, keepdims=True)
  return (h - mean) * lax.rsqrt(jnp.var(h, axis=-1, keepdims=True) + 1e-5)


def attention_block(params, x):
  q, k, v = (x @ params[name] for name in "qkv")
  weights = jax.nn.softmax(q @ jnp.swapaxes(k, -1, -2) / 2.0, axis=-1)
  h = layer_norm(x + weights @ v)
  return layer_norm(h + jax.nn.gelu(h @ params["up"]) @ params["down"])


def test_a_small_transformer_block_matches_float32_with_softmax_and_norms_in_float32():
  keys = jax.random.split(jax.random.key(1), 6)
  params = {name: jax.random.normal(key, (8, 8)) / 3 for name, key in zip(
      ("q", "k", "v", "up", "down"), keys, strict=False)}
  x = jax.random.normal(keys[5], (2, 6, 8)) * 30  # squares overflow float16 in a norm
  out = jax.jit(jls.autocast(attention_block))(params, x)
  ran = summary(jls.autocast(lambda p, x: jnp.sum(attention_block(p, x))), params, x)
  assert dtypes_of(ran, "exp") == {"float32"} and dtypes_of(ran, "rsqrt") == {"float32"}
  assert dtypes_of(ran, "dot_general") == dtypes_of(ran, "dot_general", backward=True) == {
      "float16"}  # q @ k.T, both float16 already, too
  assert bool(jnp.all(jnp.isfinite(out)))
  np.testing.assert_allclose(out, attention_block(params, x), atol=3e-2)


def test_training_with_loss_scaling_matches_float32_within_a_few_percent():
  keys = jax.random.split(jax.random.key(2), 3)
  params = {"w1": jax.random.normal(keys[0], (4, 32)) / 2, "w2": jax.random.normal(
      keys[1], (32, 1)) / 6}
  x = jax.random.normal(keys[2], (64, 4))
  y = jnp.sin(x[:, :1])

  def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)

  def train(loss_fn):
    tx = jls.loss_scaling(optax.adam(1e-2))
    grad_fn = jls.scaled_value_and_grad(loss_fn)

    @jax.jit
    def step(params, opt_state):
      loss, grads = grad_fn(opt_state, params, x, y)
      params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss)
      return params, opt_state, loss

    p, opt_state, losses = params, tx.init(params), []
    for _ in range(30):
      p, opt_state, loss = step(p, opt_state)
      losses.append(float(loss))
    return np.array(losses)

  autocast, full = train(jls.autocast(loss_fn)), train(loss_fn)
  assert autocast[-1] < autocast[0] / 4
  np.testing.assert_allclose(autocast, full, rtol=0.05)


def test_multisteps_accumulates_autocast_gradients():
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
  opt_state = tx.init(W)
  grad_fn = jls.scaled_value_and_grad(jls.autocast(loss_of(mlp)))
  for _ in range(2):
    loss, grads = grad_fn(opt_state, W, X)
    new_w, opt_state = tx.apply_gradients(grads, opt_state, W, loss=loss)
  assert new_w.dtype == F32 and not np.allclose(new_w, W)


# --- training stacks ------------------------------------------------------------------


class LinenMLP(linen.Module):
  @linen.compact
  def __call__(self, x):
    x = linen.relu(linen.Dense(8, name="hidden")(x))
    return linen.Dense(4, name="out")(x)


def test_flax_linen_apply_runs_its_dense_layers_in_float16():
  model = LinenMLP()
  variables = model.init(jax.random.key(0), X)
  loss = lambda v, x: jnp.mean((model.apply(v, x) - Y) ** 2)
  ran = summary(jls.autocast(loss), variables, X)
  grads = jax.jit(jax.grad(jls.autocast(loss)))(variables, X)
  assert dtypes_of(ran, "dot_general") == {"float16"}
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda v: v.dtype, variables)
  np.testing.assert_allclose(jax.jit(jls.autocast(loss))(variables, X), loss(variables, X),
                             rtol=2e-2)


def test_the_summary_locates_flax_linen_layers_by_their_module_path():
  model = LinenMLP()
  variables = model.init(jax.random.key(0), X)
  ran = summary(jls.autocast(lambda v, x: jnp.sum(model.apply(v, x))), variables, X)
  for backward in (False, True):
    assert {loc.scope for loc in ran.locations("dot_general", F16, backward)} == {
        "LinenMLP/hidden", "LinenMLP/out"}


def test_probes_on_an_autocast_linen_loss_still_name_each_layer():
  model = LinenMLP()
  params = model.init(jax.random.key(0), X)["params"]
  loss = jls.autocast(lambda p, x: jnp.mean((model.apply({"params": p}, x) - Y) ** 2))
  tx = jls.loss_scaling(optax.adam(1e-3))
  loss_value, grads, probes = jls.scaled_value_and_grad(loss, probes=True)(
      tx.init(params), params, X)
  assert list(probes) == ["hidden", "out"]
  assert all(int(probes[name].hits) == 1 for name in probes)
  assert jax.tree.map(lambda g: g.dtype, grads) == jax.tree.map(lambda p: p.dtype, params)
  assert loss_value.dtype == F32


class NNXMLP(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.hidden(x)))


def test_flax_nnx_trains_under_nnx_value_and_grad_and_nnx_jit():
  model = NNXMLP(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  loss = jls.autocast(lambda model, x: jnp.mean((model(x) - Y) ** 2))

  @nnx.jit
  def step(model, optimizer):
    value, grads = nnx.value_and_grad(loss)(model, X)
    optimizer.update(model, grads)
    return value

  losses = [float(step(model, optimizer)) for _ in range(10)]
  assert losses[-1] < losses[0]
  assert model.hidden.kernel[...].dtype == F32
  assert dtypes_of(summary(loss, model, X), "dot_general") == {"float16"}


def test_probes_on_an_autocast_nnx_loss_name_each_layer():
  model = NNXMLP(nnx.Rngs(0))
  tx = jls.loss_scaling(optax.adam(1e-3))
  loss = jls.autocast(lambda model, x: jnp.mean((model(x) - Y) ** 2))
  _, grads, probes = jls.scaled_value_and_grad(
      loss, value_and_grad=nnx.value_and_grad, probes=True)(
          tx.init(nnx.state(model, nnx.Param)), model, X)
  assert list(probes) == ["hidden", "out"]
  assert all(int(probes[name].hits) == 1 for name in probes)
  assert grads["hidden"]["kernel"][...].dtype == F32


def test_flax_nnx_state_that_the_model_changes_is_kept():
  class Noisy(nnx.Module):
    def __init__(self, rngs):
      self.linear = nnx.Linear(4, 4, rngs=rngs)
      self.norm = nnx.BatchNorm(4, rngs=rngs)
      self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
      return self.dropout(self.norm(self.linear(x)))

  model = Noisy(nnx.Rngs(0))
  forward = nnx.jit(jls.autocast(lambda model, x: model(x)))
  first, second = forward(model, X), forward(model, X)
  assert not np.allclose(first, second)  # the dropout's RNG moved on
  assert float(jnp.abs(model.norm.mean[...]).sum()) > 0  # the batch statistics moved
  assert model.norm.mean[...].dtype == F32 and first.dtype == F32


def test_equinox_modules_with_non_array_fields():
  model = eqx.nn.MLP(4, 4, 8, depth=2, activation=jax.nn.gelu, key=jax.random.key(0))
  loss = jls.autocast(lambda model, x: jnp.mean((jax.vmap(model)(x) - Y) ** 2))
  value, grads = eqx.filter_jit(eqx.filter_value_and_grad(loss))(model, X)
  expected = jnp.mean((jax.vmap(model)(X) - Y) ** 2)
  np.testing.assert_allclose(value, expected, rtol=2e-2)
  assert grads.layers[0].weight.dtype == F32
  assert dtypes_of(summary(loss, model, X), "dot_general") == {"float16"}


