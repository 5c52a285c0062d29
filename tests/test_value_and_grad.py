"""Specification of `scaled_value_and_grad`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TRACED
from helpers import assert_trees_close
from helpers import count_compiles

import jax_lossscale as jls

PARAMS = {"w": jnp.array([1.0, -2.0, 3.0])}


def loss_fn(params, x):
  return jnp.sum((params["w"] * x) ** 2)


def state_with_scale(scale, params=PARAMS):
  return jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(scale)).init(params)


def test_returns_the_unscaled_value_and_the_gradients_of_the_scaled_loss():
  x = jnp.array([0.5, 1.0, 2.0])
  value, grads = jls.scaled_value_and_grad(loss_fn)(state_with_scale(8.0), PARAMS, x)
  ref_value, ref_grads = jax.value_and_grad(loss_fn)(PARAMS, x)
  assert float(value) == float(ref_value)
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: g * 8.0, ref_grads))


def test_aux_and_argnums_count_the_functions_own_arguments():
  def f(a, b):
    return a * b, {"ab": a * b}

  state = state_with_scale(4.0)
  (value, aux), grads = jls.scaled_value_and_grad(f, argnums=(0, 1), has_aux=True)(
      state, 2.0, 3.0)
  assert float(value) == 6.0 and float(aux["ab"]) == 6.0
  assert (float(grads[0]), float(grads[1])) == (12.0, 8.0)


@pytest.mark.parametrize("argnums, expected", [(-1, 8.0), (1, 8.0), (-2, 12.0), ((-1,), (8.0,))])
def test_negative_argnums_count_from_the_end_of_the_functions_arguments(argnums, expected):
  # argnums=-1 used to differentiate the loss scale itself.
  _, grads = jls.scaled_value_and_grad(lambda a, b: a * b, argnums=argnums)(
      state_with_scale(4.0), 2.0, 3.0)
  assert jax.tree.map(float, grads) == expected


def test_a_loss_scale_object_instead_of_the_optimizer_state_is_refused():
  # A loss scale kept outside the optimizer goes stale as soon as the scale moves.
  with pytest.raises(TypeError, match="DynamicLossScale.*loss_scale.scale"):
    jls.scaled_value_and_grad(loss_fn)(jls.DynamicLossScale(), PARAMS, jnp.ones(3))


@pytest.mark.parametrize("call, where", [
    (lambda f, s: f(PARAMS, jnp.ones(3), s), "argument 3"),
    (lambda f, s: f(PARAMS, jnp.ones(3), state=s), "`state=`"),
    (lambda f, s: f(PARAMS, type("Holder", (), {"opt_state": s})()), "argument 2")])
def test_an_optimizer_state_passed_after_the_loss_arguments_is_refused_saying_where(call, where):
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(TypeError, match=rf"optimizer state.*{where}"):
    call(jls.scaled_value_and_grad(lambda p, x, state=None: loss_fn(p, x)), state)


def test_the_scale_is_looked_up_wherever_the_state_is_held():
  # In an optax chain of one, or in an object holding the state (a flax TrainState).
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(2.0))
  expected = jax.tree.map(lambda g: 2 * g, jax.grad(loss_fn)(PARAMS, jnp.ones(3)))
  holder = type("Holder", (), {"opt_state": tx.init(PARAMS)})()
  for state in (optax.chain(tx).init(PARAMS), holder):
    _, grads = jls.scaled_value_and_grad(loss_fn)(state, PARAMS, jnp.ones(3))
    chex.assert_trees_all_equal(grads, expected)
  with pytest.raises(ValueError, match=r"\bfound 0\b"):
    jls.scaled_value_and_grad(loss_fn)(optax.sgd(0.1).init(PARAMS), PARAMS, jnp.ones(3))


def test_the_differentiation_transform_is_a_parameter():
  calls = []

  def my_value_and_grad(f, has_aux=False, **kwargs):
    calls.append(kwargs)
    return jax.value_and_grad(f, has_aux=has_aux, **kwargs)

  state = state_with_scale(2.0)
  jls.scaled_value_and_grad(loss_fn, value_and_grad=my_value_and_grad)(
      state, PARAMS, jnp.ones(3))
  jls.scaled_value_and_grad(loss_fn, argnums=1, value_and_grad=my_value_and_grad)(
      state, PARAMS, jnp.ones(3))
  # Transforms without `argnums` (equinox's) are called without it by default.
  assert calls == [{}, {"argnums": 1}]


def test_a_float16_loss_is_scaled_in_float32_and_returned_unscaled():
  def half_loss(params, x):
    return jnp.sum((params["w"].astype(jnp.float16) * x.astype(jnp.float16)) ** 2) * 1e-6

  value, grads = jls.scaled_value_and_grad(half_loss)(
      state_with_scale(2.0**15), PARAMS, jnp.ones(3))
  assert value.dtype == jnp.float16
  assert float(value) == float(half_loss(PARAMS, jnp.ones(3)))  # unscaled
  assert bool(jls.all_finite(grads))


@pytest.mark.parametrize("has_aux, returns, match", [
    (True, lambda p: jnp.sum(p["w"]), r"has_aux=True.*sum_loss.*shape \(\)"),
    (False, lambda p: (jnp.sum(p["w"]), 1.0), r"sum_loss.*tuple.*has_aux=True")])
def test_a_loss_that_does_not_return_what_has_aux_says_is_refused(has_aux, returns, match):
  # JAX's own errors came from inside the wrapper, or showed the aux scaled as the loss.
  def sum_loss(p):
    return returns(p)
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones(3)}
  with pytest.raises(TypeError, match=match):
    jls.scaled_value_and_grad(sum_loss, has_aux=has_aux)(tx.init(params), params)


def test_the_wrapper_is_named_after_the_loss_function():
  assert jls.scaled_value_and_grad(loss_fn).__name__ == "scaled_value_and_grad(loss_fn)"


@pytest.mark.parametrize("probes", [False, True], ids=["unprobed", "probed"])
def test_a_value_and_grad_that_returns_only_gradients_is_refused_naming_it(probes):
  # jax.grad failed with "iteration over a 0-d array" from deep inside; with probes, with
  # "'NoneType' object has no attribute 'get'".
  with pytest.raises(TypeError, match=r"`value_and_grad`.*jax.grad"):
    jls.scaled_value_and_grad(loss_fn, value_and_grad=jax.grad, probes=probes)(
        state_with_scale(2.0), PARAMS, jnp.ones(3))


def test_nnx_diff_state_as_argnums_is_probed_as_its_argument():
  # `first = argnums[0]` raised "'DiffState' object is not subscriptable" with probes.
  from flax import nnx

  model, x = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), jnp.ones((2, 4))
  loss = lambda model, x: jnp.mean(model(x) ** 2)
  state = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(4.0)).init(
      nnx.state(model, nnx.Param))
  grad_fn = lambda argnums: jls.scaled_value_and_grad(
      loss, argnums=argnums, value_and_grad=nnx.value_and_grad, probes=True)(state, model, x)
  (value, grads, probes), (value_0, grads_0, probes_0) = grad_fn(
      nnx.DiffState(0, nnx.Param)), grad_fn(0)
  chex.assert_trees_all_equal((value, grads), (value_0, grads_0))
  assert list(probes) == ["Linear"] and int(probes["Linear"].hits) == 1
  chex.assert_trees_all_equal(probes, probes_0)


def test_axis_name_averages_the_loss_and_the_gradients_across_replicas():
  n = jax.local_device_count()
  x = jnp.arange(3.0 * n).reshape(n, 3)
  state = jax.tree.map(lambda a: jnp.stack([a] * n), state_with_scale(4.0))
  grad_fn = jls.scaled_value_and_grad(loss_fn, axis_name="batch")
  loss, grads = jax.pmap(lambda s, x: grad_fn(s, PARAMS, x), axis_name="batch")(state, x)
  expected_loss = jnp.mean(jax.vmap(lambda x: loss_fn(PARAMS, x))(x))
  expected = jax.tree.map(lambda g: 4.0 * jnp.mean(g, axis=0),
                          jax.vmap(lambda x: jax.grad(loss_fn)(PARAMS, x))(x))
  np.testing.assert_allclose(loss, jnp.full(n, expected_loss), rtol=1e-6)
  chex.assert_trees_all_close(jax.tree.map(lambda g: g[0], grads), expected, rtol=1e-6)


def test_float16_gradients_and_losses_are_averaged_without_overflowing_their_sum():
  # pmean summed in float16: 8 replicas' scaled gradients of 16384 (and losses of 5000)
  # gave inf, so every step was skipped (and with a float16 loss, forever).
  tx = jls.loss_scaling(optax.sgd(0.1))  # scale 2**15
  params = {"w": jnp.ones(4, jnp.float16), "v": jnp.ones(1)}
  grad_fn = jls.scaled_value_and_grad(
      lambda p, x: (jnp.sum(p["w"] * x) + 5000 * p["v"][0]).astype(jnp.float16),
      axis_name="batch")

  def step(x):
    loss, grads = grad_fn(tx.init(params), params, x)
    return loss, grads, tx.update(grads, tx.init(params), params, loss=loss)[1]

  loss, grads, state = jax.vmap(step, axis_name="batch")(jnp.full((8, 4), 0.5, jnp.float16))
  assert loss.dtype == grads["w"].dtype == jnp.float16
  np.testing.assert_array_equal(loss, np.float16(5002.0))
  np.testing.assert_array_equal(grads["w"], 16384.0)  # 0.5 * 2**15, finite in float16
  assert bool(state.last_applied.all()) and float(state.loss_scale()[0]) == 2.0**15


def test_an_axis_name_outside_pmap_or_shard_map_is_refused_naming_axis_name():
  grad_fn = jls.scaled_value_and_grad(loss_fn, axis_name="batch")
  with pytest.raises(ValueError, match="`axis_name`.*'batch'"):
    jax.jit(grad_fn)(state_with_scale(4.0), PARAMS, jnp.ones(3))


@jax.custom_vjp
def overflow_in_backward(x):
  return x


overflow_in_backward.defvjp(lambda x: (x, None), lambda _, g: (g * jnp.inf,))


def layers_loss(params, x):
  for i, w in enumerate(params):
    h = jnp.tanh(x @ w)
    x = jls.diagnostics.probe(overflow_in_backward(h) if i == 2 else h, f"layer_{i}")
  return jnp.mean(x**2)


def test_probes_measure_each_marked_point_and_name_the_layer_an_overflow_began_in():
  params = [jnp.eye(3) * 0.5 for _ in range(4)]
  state = state_with_scale(8.0, params)
  loss, grads, probes = jax.jit(jls.scaled_value_and_grad(layers_loss, probes=True))(
      state, params, jnp.ones((2, 3)))
  assert list(probes) == [f"layer_{i}" for i in range(4)]
  assert float(loss) == float(layers_loss(params, jnp.ones((2, 3))))
  assert jls.diagnostics.backward_overflow_origin(probes) == "layer_2"
  assert "layer_3" in jls.diagnostics.table(probes)


def test_probes_are_placed_on_every_module_of_linen_nnx_and_equinox_models():
  import equinox as eqx
  from flax import linen
  from flax import nnx

  x = jnp.ones((4, 3))
  linen_model = linen.Sequential([linen.Dense(5), linen.Dense(2)])
  linen_params = linen_model.init(jax.random.key(0), x)
  nnx_model = nnx.Sequential(nnx.Linear(3, 5, rngs=nnx.Rngs(0)), nnx.Linear(5, 2, rngs=nnx.Rngs(1)))
  eqx_model = eqx.nn.MLP(3, 2, width_size=5, depth=1, key=jax.random.key(0))
  cases = [
      (lambda p: jnp.mean(linen_model.apply(p, x) ** 2), jax.value_and_grad, linen_params),
      (lambda m: jnp.mean(m(x) ** 2), nnx.value_and_grad, nnx_model),
      (lambda m: jnp.mean(jax.vmap(m)(x) ** 2), eqx.filter_value_and_grad, eqx_model)]
  for loss_fn, value_and_grad, model in cases:
    state = jls.loss_scaling(optax.sgd(0.1)).init(eqx.filter(model, eqx.is_array)
                                                  if isinstance(model, eqx.Module) else {})
    grad_fn = jls.scaled_value_and_grad(loss_fn, value_and_grad=value_and_grad, probes=True)
    _, _, probes = grad_fn(state, model)
    assert len(probes) >= 2, (value_and_grad, list(probes))


@pytest.mark.parametrize("framework", ["jax", "equinox"])
def test_a_probed_gradient_function_called_without_jit_compiles_and_traces_only_its_first_call(
    framework):
  import equinox as eqx

  from jax_lossscale.probes import stats as probe_stats

  x = jnp.ones((2, 3))
  if framework == "jax":
    model, value_and_grad = [jnp.eye(3) * 0.5 for _ in range(3)], jax.value_and_grad

    def loss(params, x):
      for i, w in enumerate(params):
        x = jls.diagnostics.probe(jnp.tanh(x @ w), f"layer_{i}")
      return jnp.mean(x**2)
  else:  # a module with functions among its leaves
    model = eqx.nn.MLP(3, 2, width_size=5, depth=2, key=jax.random.key(0))
    value_and_grad = eqx.filter_value_and_grad
    loss = lambda m, x: jnp.mean(jax.vmap(m)(x) ** 2)
  state = jls.loss_scaling(optax.sgd(0.1)).init(eqx.filter(model, eqx.is_array))
  grad_fn = jls.scaled_value_and_grad(loss, value_and_grad=value_and_grad, probes=True)
  first = grad_fn(state, model, x)
  cached = probe_stats.values._cache_size()
  with count_compiles() as compiles, count_compiles(TRACED) as traces:
    for _ in range(50):
      last = grad_fn(state, model, x)
  assert compiles == [] and traces == [] and probe_stats.values._cache_size() == cached
  assert len(last[2]) >= 3 and all(int(last[2][name].hits) > 0 for name in last[2])
  chex.assert_trees_all_equal(eqx.filter(last, eqx.is_array), eqx.filter(first, eqx.is_array))
  chex.assert_trees_all_equal(eqx.filter(last, eqx.is_array), eqx.filter(
      eqx.filter_jit(grad_fn)(state, model, x), eqx.is_array))


def test_called_without_jit_a_batch_of_other_shape_gets_its_own_traces_static_outputs():
  # An epoch's last, smaller batch: the same signature traced again for other shapes.
  # What came back with the arrays (the aux's batch size, the probes' sizes) was the last
  # trace's, whatever the call's shapes: `{"n": 5}` for a batch of 3, or a pytree error.
  def loss(w, x):
    h = jls.diagnostics.probe(jnp.tanh(x @ w), "h")
    return jnp.sum(h), {"n": x.shape[0]}

  w = jnp.ones((4, 2))
  state = jls.loss_scaling(optax.sgd(0.1)).init(w)
  grad_fn = jls.scaled_value_and_grad(loss, has_aux=True, probes=True)
  for n in (3, 5, 3, 5):
    (value, aux), _, probes = grad_fn(state, w, jnp.ones((n, 4)))
    assert aux == {"n": n}
    np.testing.assert_allclose(value, n * 2 * np.tanh(4.0), rtol=1e-6)


def test_a_probed_nnx_model_called_without_jit_compiles_once_and_keeps_what_the_loss_changed():
  from flax import nnx

  x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
  loss = lambda m: jnp.mean(m(x) ** 2)
  models = [nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.BatchNorm(3, rngs=nnx.Rngs(0)))
            for _ in range(2)]
  state = state_with_scale(4.0, {})
  probed = jls.scaled_value_and_grad(loss, value_and_grad=nnx.value_and_grad, probes=True)
  plain = jls.scaled_value_and_grad(loss, value_and_grad=nnx.value_and_grad)
  probed(state, models[0])
  with count_compiles() as compiles:
    for _ in range(20):
      _, grads, probes = probed(state, models[0])
  for _ in range(21):
    _, expected = plain(state, models[1])
  assert compiles == [] and len(probes) >= 2
  batch_stats = [nnx.state(m, nnx.BatchStat) for m in models]
  assert_trees_close(batch_stats[0], batch_stats[1])
  chex.assert_trees_all_close(grads, expected, atol=1e-5)  # a bias before BatchNorm: ~0
