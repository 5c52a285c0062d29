"""Specification of the precision policy, against DeepMind's jmp."""

import functools
import itertools
import re
import warnings

import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import _policy
from jax_lossscale import tensorflow as jls_tf

NAMES = ["bf16", "bfloat16", "f16", "float16", "full", "f32", "float32", "f64", "float64",
         "half"]
KEYS = {"p": ["p", "params"], "c": ["c", "compute"], "o": ["o", "output"]}


def jmp_strings():
  """Every string jmp's grammar accepts, up to repeated keys."""
  yield from NAMES
  for size in (1, 2, 3):
    for keys in itertools.permutations("pco", size):
      for spellings in itertools.product(*(KEYS[k] for k in keys)):
        for values in itertools.product(NAMES, repeat=size):
          yield ",".join(f"{k}={v}" for k, v in zip(spellings, values, strict=True))


def test_get_policy_gives_the_same_dtypes_as_jmp_for_every_string_it_accepts():
  count = 0
  for name in jmp_strings():
    ours, theirs = jls.get_policy(name), jmp.get_policy(name)
    for field in ("param_dtype", "compute_dtype", "output_dtype"):
      assert getattr(ours, field) == jnp.dtype(getattr(theirs, field)), (name, field)
    count += 1
  assert count > 9000


def test_c_f16_means_float32_params_and_float16_compute_and_output():
  policy = jls.get_policy("c=f16")
  assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
      jnp.float32, jnp.float16, jnp.float16)
  assert str(policy) == "p=full,c=f16,o=f16" == str(jmp.get_policy("c=f16"))


@pytest.mark.parametrize("name", ["p=f32,c=half", "c=bf16", "params=float64"])
def test_policy_dtypes_are_jaxs_scalar_types_as_jmps_are(name):
  # They were NumPy dtypes: jmp code calling `policy.compute_dtype(x)`, or using it as a
  # key next to jnp.float16, failed.
  ours, theirs = jls.get_policy(name), jmp.get_policy(name)
  for field in ("param_dtype", "compute_dtype", "output_dtype"):
    assert getattr(ours, field) is getattr(theirs, field)
  assert ours.compute_dtype(2**15).dtype == theirs.compute_dtype(2**15).dtype
  assert {theirs.compute_dtype: "found"}[ours.compute_dtype] == "found"


def test_half_is_bfloat16_on_tpu_and_float16_elsewhere():
  expected = jnp.bfloat16 if jax.default_backend() == "tpu" else jnp.float16
  assert jls.get_policy("half").compute_dtype == expected
  assert jls.get_policy("half").compute_dtype == jnp.dtype(jmp.half_dtype())


@pytest.mark.parametrize("name, match", [
    ("c=f8", "dtype 'f8'"), ("x=f16", "key 'x'"), ("C=f16", "key 'C'"),
    ("p=f16,,c=f32", "key=dtype"), ("c=f16=f32", "key=dtype"),
    ("", "dtype ''"), ("p = f16", "key 'p '"), (16, "`policy_name`")])
def test_get_policy_refuses_an_unknown_key_or_dtype_with_a_clear_message(name, match):
  with pytest.raises(ValueError, match=match):
    jls.get_policy(name)


def test_policy_refuses_a_dtype_that_is_not_floating():
  with pytest.raises(ValueError, match="`compute_dtype`.*int8"):
    jls.Policy(jnp.float32, jnp.int8, jnp.float32)
  with pytest.raises(ValueError, match="`output_dtype`"):
    jls.Policy(jnp.float32, jnp.float16, "nope")


@pytest.mark.parametrize("name, expected", [
    ("f16", jnp.float16), ("float16", jnp.float16), ("bf16", jnp.bfloat16),
    ("f32", jnp.float32), ("full", jnp.float32), ("f64", jnp.float64)])
def test_a_policy_name_means_the_same_dtype_in_policy_as_in_get_policy(name, expected):
  policy = jls.Policy(jnp.float32, name, jnp.float32)
  assert policy.compute_dtype == expected == jls.get_policy(f"c={name}").compute_dtype


def test_half_in_policy_is_the_backend_half_dtype():
  assert jls.Policy("half", "half", "half").param_dtype == jls.get_policy("half").param_dtype


@pytest.mark.parametrize("dtype", [
    jnp.float16, np.float16, np.dtype("float16"), jnp.dtype(jnp.bfloat16), "float8_e4m3fn",
    jnp.float8_e5m2])
def test_policy_keeps_a_real_floating_dtype(dtype):
  assert jls.Policy(dtype, dtype, dtype).output_dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype", "output_dtype"])
def test_policy_refuses_none_naming_the_field(field):
  dtypes = dict(param_dtype=jnp.float32, compute_dtype=jnp.float16, output_dtype=jnp.float32)
  dtypes[field] = None
  with pytest.raises(ValueError, match=f"`{field}`.*None"):
    jls.Policy(**dtypes)


@pytest.mark.parametrize("value", [
    "f8", "f4", "float", "double", "e", "<f2", "F16", "int8", "", "fp16",
    pytest.param(float, id="python-float"), pytest.param(complex, id="python-complex"),
    jnp.complex64, jnp.int32, np.dtype("uint8"), jnp.bool_, pytest.param(object(), id="object"),
    pytest.param(np.longdouble, id="float128-that-jax-lacks"),
    # Values, not dtypes (NumPy reads their `dtype`: an array passed for a dtype passed).
    pytest.param(jnp.ones(3, jnp.float16), id="jax-array"),
    pytest.param(np.float32(7.0), id="numpy-scalar"),
    pytest.param(np.ones(2, np.float16), id="numpy-array")])
def test_as_dtype_refuses_anything_but_a_floating_dtype_or_a_policy_name(value):
  with pytest.raises(ValueError) as error:
    _policy.as_dtype(value, "dtype")
  message = str(error.value)
  assert message.startswith("`dtype` must be a floating dtype")
  assert repr(value) in message and "'bf16'" in message and "'half'" in message


def test_with_output_dtype_reads_a_policy_name():
  assert jls.get_policy("f32").with_output_dtype("f16").output_dtype == jnp.float16
  with pytest.raises(ValueError, match="`output_dtype`.*'f8'"):
    jls.get_policy("f32").with_output_dtype("f8")


def test_casts_touch_floating_leaves_only():
  policy = jls.get_policy("p=f32,c=f16,o=f32")
  tree = {"w": jnp.ones(2), "step": jnp.array(3), "mask": jnp.array([True]), "none": None,
          "name": "mlp", "act": jax.nn.relu, "np": np.ones(2, np.float64),
          "python": 1.5, "complex": jnp.ones(1, jnp.complex64)}
  cast = policy.cast_to_compute(tree)
  assert cast["w"].dtype == jnp.float16 and cast["np"].dtype == jnp.float16
  for key in ("step", "mask", "none", "name", "act", "python", "complex"):
    assert cast[key] is tree[key]
  assert policy.cast_to_output(cast)["w"].dtype == jnp.float32
  assert policy.cast_to_param(cast)["w"].dtype == jnp.float32
  # The same as jmp, leaf for leaf (jmp leaves complex leaves alone too).
  theirs = jmp.get_policy("p=f32,c=f16,o=f32").cast_to_compute(tree)
  same = jax.tree.map(lambda a, b: a is b or a.dtype == b.dtype, cast, theirs)
  assert all(jax.tree.leaves(same)), same


def test_casts_work_under_jit():
  policy = jls.get_policy("c=bf16")
  out = jax.jit(policy.cast_to_compute)({"w": jnp.ones(3), "i": jnp.arange(3)})
  assert out["w"].dtype == jnp.bfloat16 and out["i"].dtype == jnp.int32


def test_with_output_dtype():
  policy = jls.get_policy("c=f16").with_output_dtype(jnp.float32)
  assert (policy.compute_dtype, policy.output_dtype) == (jnp.float16, jnp.float32)


@pytest.mark.parametrize("name, expected", [
    ("c=f16", jls.DynamicLossScale), ("p=f16", jls.DynamicLossScale),
    ("c=bf16", jls.NoOpLossScale), ("full", jls.NoOpLossScale), ("f64", jls.NoOpLossScale)])
def test_each_policy_calls_for_the_loss_scale_its_compute_dtype_needs(name, expected):
  assert type(jls.get_policy(name).loss_scale()) is expected
  float8 = jls.Policy(jnp.float32, jnp.float8_e4m3fn, jnp.float32)
  assert isinstance(float8.loss_scale(), jls.DynamicLossScale)


def test_one_string_switches_an_experiment_between_bfloat16_and_float16():
  def train(policy_name):
    policy = jls.get_policy(policy_name)
    params = policy.cast_to_param({"w": jnp.linspace(-1.0, 1.0, 8)})
    tx = jls.loss_scaling(optax.adam(1e-2), policy.loss_scale())
    state = tx.init(params)

    def loss_fn(params, x):
      x, params = policy.cast_to_compute((x, params))
      return policy.cast_to_output(jnp.mean((params["w"] * x) ** 2))

    grad_fn = jls.scaled_value_and_grad(loss_fn)
    for _ in range(3):
      loss, grads = grad_fn(state, params, jnp.ones(8))
      params, state = tx.apply_gradients(grads, state, params, loss=loss)
    return params, state

  for name in ("p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"):
    params, state = train(name)
    assert params["w"].dtype == jnp.float32 and int(state.skipped_steps) == 0


@pytest.mark.parametrize("name", ["p=f32,c=f16,o=f32", "half", "c=bf16", "f32"])
def test_a_policy_equals_jmps_with_the_same_dtypes(name):
  ours, theirs = jls.get_policy(name), jmp.get_policy(name)
  assert ours == theirs and theirs == ours and hash(ours) == hash(theirs)
  assert ours != jmp.get_policy("f64") and len({ours, theirs}) == 1


def test_jmps_policy_is_taken_where_ours_is():
  # What a config parsed with jmp gives (levanter's `mp`): get_policy makes it ours, and
  # loss_scaling takes it as the loss scale its compute dtype calls for.
  theirs = jmp.get_policy("p=f32,c=f16,o=f32")
  ours = jls.get_policy(theirs)
  assert isinstance(ours, jls.Policy) and ours == theirs
  assert ours.loss_scale() == jls.DynamicLossScale()
  tx = jls.loss_scaling(optax.sgd(0.1), theirs)
  assert tx.init({"w": jnp.ones(2)}).loss_scale == jls.DynamicLossScale()
  assert jls_tf.get(jmp.get_policy("p=f32,c=bf16")) == jls.NoOpLossScale()
  assert jls.get_policy(ours) is ours


def test_jmps_loss_scales_are_taken_where_ours_are():
  import jax_lossscale.jmp as drop_in

  dynamic = jmp.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(5), period=100, factor=4,
                                 min_loss_scale=jnp.float32(2.0))
  expected = jls.DynamicLossScale(2.0**12, increment_period=100, multiplier=4.0,
                                  min_loss_scale=2.0, num_good_steps=5)
  assert jls_tf.get(dynamic) == expected
  assert jls_tf.get(drop_in.DynamicLossScale(jnp.float32(2.0**12), np.int32(5), period=100,
                                          factor=4, min_loss_scale=2.0)) == expected
  for static in (jmp.StaticLossScale(128.0), drop_in.StaticLossScale(128.0)):
    assert jls_tf.get(static) == jls.FixedLossScale(128.0)
  assert jls_tf.get(jmp.NoOpLossScale()) == jls.NoOpLossScale()
  tx = jls.loss_scaling(optax.sgd(0.1), dynamic)
  assert float(tx.init({"w": jnp.ones(2)}).loss_scale()) == 2.0**12


def autocast_step(loss_scale, compute_dtype, wrap=lambda f: f, calls=2):
  """`calls` steps of a float32 model whose loss runs under `autocast(compute_dtype)`; the
  warnings they raised."""
  def loss_fn(params, x):
    return jnp.mean((x @ params["w"]) ** 2)

  params, x = {"w": jnp.ones((8, 2))}, jnp.ones((4, 8))
  tx = jls.loss_scaling(optax.sgd(0.1), loss_scale)
  state = tx.init(params)
  grad_fn = jls.scaled_value_and_grad(wrap(jls.autocast(loss_fn, compute_dtype)))
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    for _ in range(calls):
      loss, grads = grad_fn(state, params, x)
      params, state = tx.apply_gradients(grads, state, params, loss=loss)
  return [str(w.message) for w in record]


@pytest.mark.parametrize("wrap", [lambda f: f, jax.jit, lambda f: functools.partial(f)],
                         ids=["autocast", "jit", "partial"])
def test_float16_autocast_under_a_float32_policys_scale_warns_once_naming_the_one_to_use(wrap):
  # A levanter-style policy switched to float32 so that autocast does the casting calls
  # for NoOpLossScale, under which float16 would train unscaled.
  policy = jmp.get_policy("p=f32,c=f32,o=f32")
  messages = autocast_step(jls_tf.get(policy), jnp.float16, wrap)
  assert len(messages) == 1
  assert re.search(r"autocast.*float16.*NoOpLossScale.*loss_scaling\(.*'dynamic'\)",
                   messages[0], re.DOTALL)


@pytest.mark.parametrize("loss_scale, compute_dtype", [
    (jls.NoOpLossScale(), jnp.bfloat16), (jls.DynamicLossScale(), jnp.float16),
    (jls.get_policy("p=f32,c=f16").loss_scale(), jnp.float16)])
def test_autocast_with_the_scale_its_dtype_calls_for_does_not_warn(loss_scale, compute_dtype):
  assert autocast_step(loss_scale, compute_dtype) == []
