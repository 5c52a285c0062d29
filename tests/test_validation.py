"""Every number a loss scale holds is checked as the dtype that holds it.

The scale is a float32 and the counters are int32: a value that is inf in float32, a
factor that rounds to 1, a floor that rounds to 0, a count beyond int32 is refused when
the object is built, naming the argument in the caller's own vocabulary. Python
numbers, NumPy scalars and concrete JAX scalars are accepted alike.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf

BIG = 2**31  # one more than the largest int32


@pytest.mark.parametrize(
    "build, name",
    [
        # Each of these was accepted and later gave inf, 0, a frozen scale or an
        # int32 overflow deep inside JAX.
        (lambda: jls.FixedLossScale(1e39), "loss_scale_value"),
        (lambda: jls_tf.FixedLossScaleManager(1e39), "loss_scale"),
        (lambda: jls_tf.ExponentialUpdateLossScaleManager(1e39, 10), "init_loss_scale"),
        (lambda: jls.DynamicLossScale(2.0**127, 1, max_loss_scale=1e39), "max_loss_scale"),
        (lambda: jls.DynamicLossScale(1e39), "initial_loss_scale"),
        (lambda: jls.DynamicLossScale(min_loss_scale=1e-46), "min_loss_scale"),
        (lambda: jls.DynamicLossScale(min_loss_scale=1e-40), "min_loss_scale"),  # flushed
        (lambda: jls.DynamicLossScale(multiplier=1 + 1e-9), "multiplier"),
        (lambda: jls.DynamicLossScale(multiplier=1e39), "multiplier"),
        (lambda: jls.DynamicLossScale(backoff_factor=1 - 1e-12), "backoff_factor"),
        (lambda: jls.DynamicLossScale(backoff_factor=1e-50), "backoff_factor"),
        (lambda: jls.DynamicLossScale(increment_period=BIG), "increment_period"),
        (lambda: jls.DynamicLossScale(hysteresis=BIG), "hysteresis"),
        (lambda: jls_tf.ExponentialUpdateLossScaleManager(8, BIG), "incr_every_n_steps"),
        (lambda: jls_tf.ExponentialUpdateLossScaleManager(8, 2, BIG), "decr_every_n_nan_or_inf"),
        (lambda: jls_tf.ExponentialUpdateLossScaleManager(8, 2, incr_ratio=1 + 1e-9), "incr_ratio"),
        (lambda: jls_tf.ExponentialUpdateLossScaleManager(8, 2, decr_ratio=1 - 1e-12),
         "decr_ratio"),
    ],
)
def test_values_are_checked_as_float32_and_int32(build, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    build()


def test_the_limits_themselves_are_accepted():
  top = float(np.finfo(np.float32).max)
  assert float(jls.FixedLossScale(top)()) == top
  tiny = float(np.finfo(np.float32).tiny)
  assert jls.DynamicLossScale(min_loss_scale=tiny).min_loss_scale == tiny
  edge = jls.DynamicLossScale(increment_period=BIG - 1, hysteresis=BIG - 1)
  assert (edge.increment_period, edge.hysteresis) == (BIG - 1, BIG - 1)
  factors = jls.DynamicLossScale(multiplier=1 + 2.0**-23, backoff_factor=1 - 2.0**-24)
  assert (factors.multiplier, factors.backoff_factor) == (1 + 2.0**-23, 1 - 2.0**-24)


def test_a_dynamic_scale_at_the_edge_of_float32_never_becomes_inf_nan_or_zero():
  # Growth from 2**127 and backoff to the floor, in one jitted scan.
  def run(loss_scale, finite):
    step = lambda ls, f: (ls.update({"g": jnp.where(f, 1.0, jnp.inf)})[0],) * 2
    return jax.lax.scan(step, loss_scale, finite)[1]

  finite = jnp.concatenate([jnp.ones(5, bool), jnp.zeros(200, bool), jnp.ones(300, bool)])
  scales = np.asarray(jax.jit(run)(jls.DynamicLossScale(2.0**126, 1, 2), finite)())
  assert np.isfinite(scales).all() and (scales >= 1).all() and scales.max() == 2.0**127


@pytest.mark.parametrize("value", [np.float32(2.0**15), jnp.float32(2.0**15), np.int64(32768),
                                   jnp.array(32768.0), np.array(32768.0)])
def test_numpy_and_concrete_jax_scalars_are_accepted_as_numbers(value):
  # jmp's idiom is jnp.float32(2**15).
  assert float(jls.FixedLossScale(value)()) == 32768.0
  assert float(jls.DynamicLossScale(value)()) == 32768.0
  assert float(jls_tf.get(value)()) == 32768.0
  assert jls.DynamicLossScale(increment_period=np.int32(5)).increment_period == 5


@pytest.mark.parametrize("value", [jnp.ones(2), np.ones((1,)), True, np.bool_(True), "8"])
def test_arrays_booleans_and_strings_are_not_numbers(value):
  with pytest.raises(ValueError, match="`loss_scale_value`"):
    jls.FixedLossScale(value)


def test_the_kind_of_number_asked_for_reads_as_english():
  with pytest.raises(ValueError, match=r"`increment_period` must be an integer, got 'x'"):
    jls.DynamicLossScale(increment_period="x")
  with pytest.raises(ValueError, match=r"`loss_scale_value` must be a real number"):
    jls.FixedLossScale("x")


def test_a_traced_hyperparameter_is_refused_with_a_clear_message():
  with pytest.raises(ValueError, match="`initial_loss_scale`.*traced"):
    jax.jit(lambda s: jls.DynamicLossScale(s)())(jnp.float32(8.0))


@pytest.mark.parametrize("flag", ["x", float("nan"), 2.5, 1, jnp.array([True, False]),
                                  jnp.ones(()), None])
def test_update_loss_scale_takes_only_a_boolean_scalar(flag):
  # "x", nan and 2.5 used to count as finite; a shape-(2,) flag gave the state shape (2,).
  with pytest.raises(ValueError, match="`finite_grads`"):
    jls_tf.ExponentialUpdateLossScaleManager(8, 2).update_loss_scale(flag)


@pytest.mark.parametrize("flag", [True, np.bool_(False), jnp.array(True)])
def test_update_loss_scale_takes_python_numpy_and_jax_booleans(flag):
  manager = jls_tf.ExponentialUpdateLossScaleManager(8.0, 1).update_loss_scale(flag)
  assert float(manager()) == (16.0 if bool(flag) else 8.0)
  assert manager.current_loss_scale.shape == ()


@pytest.mark.parametrize(
    "state, name",
    [({"current_loss_scale": -3.0}, "current_loss_scale"),
     ({"current_loss_scale": float("inf")}, "current_loss_scale"),
     ({"num_good_steps": -1}, "num_good_steps"),
     ({"num_good_steps": 2000}, "num_good_steps"),
     ({"hysteresis_left": 5}, "hysteresis_left"),
     ({"current_loss_scale": "x"}, "current_loss_scale"),
     ({"current_loss_scale": True}, "current_loss_scale"),  # not 1.0
     ({"current_loss_scale": [1.0, 2.0]}, "current_loss_scale"),  # not a second leaf
     ({"num_good_steps": np.array([True, False])}, "num_good_steps")],
)
def test_state_given_to_the_constructor_is_checked(state, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    jls.DynamicLossScale(**state)


@pytest.mark.parametrize("maxima", [np.zeros(4), np.zeros(())])
def test_state_of_another_shape_than_the_configuration_is_refused(maxima):
  # A history of 4 maxima was accepted by a scale configured for 16.
  with pytest.raises(ValueError, match=r"`maxima`.*\(16,\)"):
    jls.MeasuredLossScale(maxima=maxima)
  batch = jls.MeasuredLossScale(history=4, maxima=np.zeros((3, 4)))  # a batch, for vmap
  assert batch.maxima.shape == (3, 4)


@pytest.mark.parametrize("value", [jnp.bfloat16(1024), jnp.float16(1024), np.int64(1024)])
def test_state_of_any_real_dtype_is_accepted(value):
  assert float(jls.DynamicLossScale(current_loss_scale=value)()) == 1024.0


def test_deserialize_refuses_state_and_unknown_keys():
  # `deserialize` used to accept {"current_loss_scale": -3.0}.
  config = jls_tf.serialize(jls.DynamicLossScale())
  config["config"]["current_loss_scale"] = -3.0
  with pytest.raises(ValueError, match="'current_loss_scale'"):
    jls_tf.deserialize(json.loads(json.dumps(config)))


def test_loss_scaling_errors_name_the_argument():
  with pytest.raises(TypeError, match="`inner`"):
    jls.loss_scaling("adam")  # was AttributeError
  tx = jls.loss_scaling(optax.sgd(0.1))
  with pytest.raises(TypeError, match="`state`"):
    tx.update({"w": jnp.ones(2)}, None)  # was AttributeError
  tx = jls.loss_scaling(optax.sgd(1.0), 1.0, clip_by_global_norm=np.float32(1.0))  # was refused
  updates, _ = tx.update({"w": jnp.full(4, 10.0)}, tx.init({"w": jnp.zeros(4)}))
  np.testing.assert_allclose(np.linalg.norm(updates["w"]), 1.0, rtol=1e-6)


@pytest.mark.parametrize("loss_scale, match", [
    ("Dynamic ", "'Dynamic '.*`loss_scale`"),
    (0.5, r"`loss_scale`.*\b0\.5\b"),
    (None, r"`loss_scale`.*\bNone\b")])
def test_loss_scaling_names_its_own_loss_scale_argument(loss_scale, match):
  # It said neither `loss_scale` nor what is allowed, or named `loss_scale_value`.
  with pytest.raises(ValueError, match=match):
    jls.loss_scaling(optax.sgd(0.1), loss_scale)


def test_raise_if_stuck_accepts_numpy_integers():
  tx = jls.loss_scaling(optax.sgd(0.1))
  jls.raise_if_stuck(tx.init({"w": jnp.ones(2)}), max_consecutive_skips=np.int64(5))


@pytest.mark.parametrize("loss_scale", [-1.0, float("nan"), 0.0, 1e39])
def test_gradient_stats_refuses_a_scale_that_is_not_a_positive_float32(loss_scale):
  with pytest.raises(ValueError, match="`loss_scale`"):
    jls.diagnostics.gradient_stats({"g": jnp.ones(3)}, loss_scale=loss_scale)


def test_gradient_stats_still_takes_a_traced_scale():
  stats = jax.jit(lambda s: jls.diagnostics.gradient_stats({"g": jnp.ones(3)}, loss_scale=s))(
      jnp.float32(2.0))
  assert int(stats["nonzero"]) == 3
