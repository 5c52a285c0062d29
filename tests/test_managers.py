"""Specification of TensorFlow contrib's manager API."""

import json

import chex
import jax
import jax.numpy as jnp
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf


def test_fixed_manager_never_changes():
  manager = jls_tf.FixedLossScaleManager(256)
  for finite in [True, False, jnp.array(False)]:
    manager = manager.update_loss_scale(finite)
  scale = manager.get_loss_scale()
  assert scale.dtype == jnp.float32 and float(scale) == 256


@pytest.mark.parametrize("value, match", [(0.5, ">= 1"), (float("inf"), "finite"),
                                          ("8", "real number")])
def test_fixed_manager_rejects_bad_scales(value, match):
  with pytest.raises(ValueError, match=f"`loss_scale`.*{match}"):
    jls_tf.FixedLossScaleManager(value)


def test_exponential_manager_returns_a_new_manager_and_keeps_the_old_one():
  manager = jls_tf.ExponentialUpdateLossScaleManager(8, 2)
  updated = manager.update_loss_scale(False).update_loss_scale(False)
  assert float(manager.get_loss_scale()) == 8
  assert float(updated.get_loss_scale()) == pytest.approx(8 * 0.8)


def test_exponential_manager_needs_consecutive_finite_steps_to_grow(maybe_jit):
  update = maybe_jit(lambda m, f: m.update_loss_scale(f))
  manager, scales = jls_tf.ExponentialUpdateLossScaleManager(4, 3, decr_every_n_nan_or_inf=5), []
  for finite in [True, True, False, True, True, True, True]:
    manager = update(manager, finite)
    scales.append(float(manager.get_loss_scale()))
  assert scales == [4, 4, 4, 4, 4, 8, 8]


def test_exponential_manager_bad_steps_need_not_be_consecutive():
  manager = jls_tf.ExponentialUpdateLossScaleManager(10, 100, decr_every_n_nan_or_inf=3,
                                                  decr_ratio=0.5)
  for finite in [False, True, False, True, True, False]:
    manager = manager.update_loss_scale(finite)
  assert float(manager.get_loss_scale()) == 5
  assert int(manager.num_bad_steps) == 0 and int(manager.num_good_steps) == 0


@pytest.mark.parametrize("loss_scale, measured", [
    (jls_tf.ExponentialUpdateLossScaleManager(8.0, 1, 1, 2.0, 0.5), None),
    (jls.MeasuredLossScale(8.0), jnp.float32(4.0)),
    (jls.DynamicLossScale(8.0, increment_period=1), None)])
def test_adjust_takes_a_python_bool_as_the_array_it_stands_for(loss_scale, measured):
  # `~True` is -2 in Python: each adjust reads the flag as a bool array, not by accident.
  for finite in (True, False):
    by_bool = loss_scale.adjust(finite, measured)
    by_array = loss_scale.adjust(jnp.asarray(finite), measured)
    assert float(by_bool()) == float(by_array())


def test_a_measured_scale_adjusted_without_its_measurement_is_refused():
  # Read as a step with no gradient, it jumped to max_loss_scale (2**24).
  with pytest.raises(ValueError, match=r"needs `measured`.*got None"):
    jls.MeasuredLossScale(8.0).adjust(jnp.asarray(True))


def test_exponential_manager_never_goes_below_one():
  manager = jls_tf.ExponentialUpdateLossScaleManager(1.5, 10, decr_every_n_nan_or_inf=1)
  for _ in range(3):
    manager = manager.update_loss_scale(False)
  assert float(manager.get_loss_scale()) == 1


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(init_loss_scale=0.5, incr_every_n_steps=2), "init_loss_scale"),
     (dict(init_loss_scale=8, incr_every_n_steps=0), "incr_every_n_steps"),
     (dict(init_loss_scale=8, incr_every_n_steps=2, decr_every_n_nan_or_inf=0),
      "decr_every_n_nan_or_inf"),
     (dict(init_loss_scale=8, incr_every_n_steps=2, incr_ratio=1), "incr_ratio"),
     (dict(init_loss_scale=8, incr_every_n_steps=2, decr_ratio=1), "decr_ratio"),
     (dict(init_loss_scale=8, incr_every_n_steps=2, decr_ratio=0), "decr_ratio")],
)
def test_exponential_manager_rejects_bad_arguments(kwargs, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    jls_tf.ExponentialUpdateLossScaleManager(**kwargs)


@pytest.mark.parametrize("manager", [jls_tf.FixedLossScaleManager(4.0),
                                     jls_tf.ExponentialUpdateLossScaleManager(8, 3, 4, 3.0, 0.5)],
                         ids=lambda m: type(m).__name__)
def test_managers_are_loss_scales_with_config_and_serialization(manager):
  assert isinstance(manager, jls.LossScale) and isinstance(manager, jls_tf.LossScaleManager)
  assert jls_tf.deserialize(json.loads(json.dumps(jls_tf.serialize(manager)))) == manager
  assert type(manager).from_config(manager.get_config()) == manager
  chex.assert_trees_all_equal(manager.unscale(manager.scale(jnp.ones(2))), jnp.ones(2))
  _, should_apply = manager.update({"g": jnp.array([jnp.inf])})
  assert not bool(should_apply)  # managers apply only finite steps, as contrib did
  assert_same = jax.jit(lambda m: m)(manager)
  assert assert_same == manager


def test_manager_inside_loss_scaling():
  tx = jls.loss_scaling(optax.sgd(1.0), jls_tf.ExponentialUpdateLossScaleManager(8, 1))
  params = {"w": jnp.zeros(2)}
  state = tx.init(params)
  updates, state = jax.jit(tx.update)({"w": jnp.full(2, 8.0)}, state, params)
  chex.assert_trees_all_equal(updates, {"w": jnp.full(2, -1.0)})
  assert float(jls.metrics(state)["loss_scale"]) == 16
