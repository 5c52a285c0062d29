"""Specification of the checks of a step's arguments: gradients shaped like the
parameters, the loss, the update's keywords and `axis_name`, each refused naming the
argument."""

import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls

FUSED = pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])


@pytest.mark.parametrize("grads, match", [
    ({"w": jnp.ones(2)}, r"`grads`.*`params`.*\b1\b.*\b2\b"),
    ({"w": jnp.ones(2), "b": jnp.ones(4)}, r"`grads\['b'\]`.*\(4,\).*`params\['b'\]`.*\(3,\)"),
    ({"weight": jnp.ones(2), "b": jnp.ones(3)}, r"`grads`.*\['weight'\].*`params`.*\['w'\]")],
    ids=["missing_leaf", "wrong_shape", "renamed_leaf"])
def test_gradients_that_do_not_match_the_parameters_are_refused_naming_both(grads, match):
  tx = jls.loss_scaling(optax.adam(0.1))
  params = {"w": jnp.ones(2), "b": jnp.ones(3)}
  for step in (tx.update, tx.apply_gradients):
    with pytest.raises(ValueError, match=match):
      step(grads, tx.init(params), params)


def test_a_python_float_parameter_with_a_gradient_is_refused_as_not_trained():
  # Python floats are static, as in equinox: init makes no optimizer state for them,
  # so a gradient for one would be dropped by apply_gradients (and break Adam's update).
  tx = jls.loss_scaling(optax.sgd(0.5), jls.NoOpLossScale())
  params = {"w": jnp.ones(3), "t": 1.0}
  for step in (tx.update, tx.apply_gradients):
    with pytest.raises(TypeError, match=r"`params\['t'\]`.*\b1\.0\b"):
      step({"w": jnp.ones(3), "t": 3.0}, tx.init(params), params)
  new, _ = tx.apply_gradients({"w": jnp.ones(3), "t": None}, tx.init(params), params)
  assert new["t"] == 1.0 and new["w"].tolist() == [0.5] * 3


@pytest.mark.parametrize("bad", [[["data"]], {"data": 1}, ("data", ["model"])])
def test_an_axis_name_that_is_not_names_is_refused_when_the_transformation_is_built(bad):
  with pytest.raises(TypeError, match="`axis_name`"):
    jls.loss_scaling(optax.sgd(0.1), axis_name=bad)


@pytest.mark.parametrize("keyword", ["losses", "lost", "probs", "value"])
def test_keywords_that_are_words_and_not_typos_of_loss_or_probes_reach_the_inner(keyword):
  seen = {}

  def update(updates, state, params=None, **extra_args):
    seen.update(extra_args)
    return updates, state

  tx = jls.loss_scaling(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                                              update))
  tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), **{keyword: 1.0})
  assert seen == {keyword: 1.0}


@FUSED
@pytest.mark.parametrize("keyword, meant", [("los", "loss"), ("losss", "loss"), ("Loss", "loss"),
                                            ("lsos", "loss"), ("probe", "probes")])
def test_a_misspelt_loss_or_probes_keyword_is_refused_not_passed_on(fused, keyword, meant):
  # optax's inner transformations ignore keywords they do not take: a NaN loss passed
  # as `los=` would skip the step as an overflow, and back the scale off.
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  step = tx.apply_gradients if fused else tx.update
  with pytest.raises(TypeError, match=rf"`{keyword}=`.*`{meant}=`"):
    step({"w": jnp.ones(2)}, tx.init(params), params, **{keyword: jnp.nan})


@pytest.mark.parametrize("grad", [jnp.full(3, 32768, jnp.int32), jnp.array([True, False, True])],
                         ids=["int32", "bool"])
def test_integer_gradients_of_float_parameters_are_refused_not_passed_on_unscaled(grad):
  # Only floating leaves are unscaled: int32 gradients reached the optimizer as they were,
  # 32768 times too large.
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones(3), "n": jnp.int32(3)}
  for step in (tx.update, tx.apply_gradients):
    with pytest.raises(TypeError, match=rf"`grads\['w'\]`.*{grad.dtype}.*float32.*`params\['w'\]`"):
      step({"w": grad, "n": jnp.int32(0)}, tx.init(params), params)
  # An integer parameter's integer "gradient" (zeros_like, an accumulator) passes, as in optax.
  updates, state = tx.update(jax.tree.map(jnp.zeros_like, params), tx.init(params), params)
  assert bool(state.last_applied) and updates["w"].tolist() == [0.0] * 3


@pytest.mark.parametrize("grad", [jnp.full(2, 0.5), jnp.full(2, 0.5, jnp.float16)],
                         ids=["float32", "float16"])
def test_a_floating_gradient_of_an_integer_parameter_is_refused_naming_it_not_truncated(
    maybe_jit, grad):
  # optax.apply_updates casts the sum back to the parameter's dtype: [1, 5] minus half a
  # step became [0, 4], silently.
  tx = jls.loss_scaling(optax.sgd(1.0))
  params = {"w": jnp.ones(2), "layer": {"n": jnp.array([1, 5], jnp.int32)}}
  grads = {"w": jnp.ones(2), "layer": {"n": grad}}
  for step in (tx.update, tx.apply_gradients):
    with pytest.raises(TypeError, match=rf"`grads\['layer'\]\['n'\]`.*{grad.dtype}.*"
                                        r"`params\['layer'\]\['n'\]`.*int32"):
      maybe_jit(step)(grads, tx.init(params), params)


def test_gradients_in_other_containers_than_the_parameters_are_refused_naming_both():
  # A tuple and a list print the same key paths; the step then failed inside JAX.
  tx = jls.loss_scaling(optax.adam(0.1))
  params = [jnp.ones(2), jnp.ones(3)]
  for step in (tx.update, tx.apply_gradients):
    with pytest.raises(ValueError, match=r"PyTreeDef\(\(\*, \*\)\).*PyTreeDef\(\[\*, \*\]\)"):
      step((jnp.ones(2), jnp.ones(3)), tx.init(params), params)


def test_update_takes_optax_keyword_names():
  # optax's signature is update(updates, state, params=None); code calls it by keyword.
  tx = jls.loss_scaling(optax.sgd(0.5), 4.0)
  params = {"w": jnp.ones(3)}
  updates, state = tx.update(updates={"w": jnp.full(3, 4.0)}, state=tx.init(params),
                             params=params)
  assert updates["w"].tolist() == [-0.5] * 3 and bool(state.last_applied)


def test_a_python_int_loss_is_a_float_loss():
  # 2**31 raised OverflowError (int32); 10**400, beyond any float, is not a finite loss.
  tx = jls.loss_scaling(optax.sgd(1.0), 1.0)
  params = {"w": jnp.ones(1)}
  _, state = tx.update({"w": jnp.ones(1)}, tx.init(params), params, loss=2**31)
  assert bool(state.last_applied)
  _, state = tx.update({"w": jnp.ones(1)}, tx.init(params), params, loss=-(10**400))
  assert not bool(state.last_applied) and int(state.nonfinite_loss_steps) == 1


def test_a_python_float_loss_beyond_float32_is_finite_under_x64():
  # It was converted to float32, where 1e300 is inf: the step was skipped as a bad loss.
  with jax.enable_x64(True):
    tx = jls.loss_scaling(optax.sgd(1.0), 1.0)
    params = {"w": jnp.ones(1, jnp.float64)}
    _, state = tx.update({"w": jnp.ones(1, jnp.float64)}, tx.init(params), params, loss=1e300)
    assert bool(state.last_applied) and int(state.nonfinite_loss_steps) == 0


@FUSED
def test_a_loss_passed_positionally_is_refused_saying_loss_is_keyword_only(fused):
  tx = jls.loss_scaling(optax.adam(0.1))
  params = {"w": jnp.ones(2)}
  step = tx.apply_gradients if fused else tx.update
  name = "apply_gradients" if fused else "update"
  with pytest.raises(TypeError, match=rf"{name}.*`loss=`.*ArrayImpl"):
    step(params, tx.init(params), params, jnp.float32(1.0))


@FUSED
def test_a_none_gradient_of_an_array_parameter_that_the_optimizer_keeps_state_for_is_named(
    fused):
  tx = jls.loss_scaling(optax.adam(0.1))
  params = {"w": jnp.ones(2), "b": jnp.ones(3)}
  step = tx.apply_gradients if fused else tx.update
  with pytest.raises(ValueError) as error:
    step({"w": jnp.ones(2), "b": None}, tx.init(params), params)
  assert ("`grads['b']` is None where `params['b']` is a floating-point array that the "
          "optimizer state has a slot for") in "\n".join(error.value.__notes__)
  assert not any("another optimizer's init" in note for note in error.value.__notes__)
