"""Specification of `jax_lossscale.flax`: the linen `TrainState` and flax serialization."""

import subprocess
import sys
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import serialization
from flax.core import FrozenDict
from flax.training import train_state
from helpers import overflow_in_backward

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf
from jax_lossscale.flax import TrainState

X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)


class Model(linen.Module):
  dot_general_cls: type | None = None

  @linen.compact
  def __call__(self, x):
    kw = {} if self.dot_general_cls is None else {"dot_general_cls": self.dot_general_cls}
    return linen.Dense(2, **kw)(linen.relu(linen.Dense(8)(x)))


def make_state(state_class=TrainState, tx=None, model=None, params_only=True):
  model = model or Model()
  variables = model.init(jax.random.key(0), X)
  params = variables["params"] if params_only else variables
  return state_class.create(apply_fn=model.apply, params=params,
                            tx=tx or jls.loss_scaling(optax.adam(1e-2)))


def loss_fn(params, apply_fn, x, y, overflow=1.0):
  return overflow_in_backward(jnp.mean((apply_fn({"params": params}, x) - y) ** 2), overflow)


@jax.jit
def step(state, x, y):
  loss, grads = jls.scaled_value_and_grad(loss_fn)(state.opt_state, state.params,
                                                   state.apply_fn, x, y)
  return state.apply_gradients(grads=grads, loss=loss), loss


def test_train_state_takes_the_loss_and_fuses_the_step():
  tx = jls.loss_scaling(optax.MultiSteps(optax.adam(1e-2), 2), clip_by_global_norm=1.0)
  state = make_state(tx=tx)
  losses = []
  for _ in range(20):
    state, loss = step(state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and int(state.step) == 20
  # A NaN loss skips the step: params unchanged, the loss scale left alone.
  before = state.params
  state, _ = step(state, X * jnp.nan, Y)
  chex.assert_trees_all_equal(state.params, before)
  assert int(jls.metrics(state.opt_state)["nonfinite_loss_steps"]) == 1


def test_train_state_feeds_the_probes_to_a_measured_scale():
  # `probes=` went to `replace` as a field: AttributeError, 'TrainState' has no 'probes'.
  # Small inputs and no biases: the activation gradients that the probes measure are
  # about 60 times the parameter gradients, so they set the scale.
  model = linen.Sequential([linen.Dense(8, use_bias=False), linen.relu,
                            linen.Dense(2, use_bias=False)])
  state = make_state(tx=jls.loss_scaling(optax.adam(1e-2), jls.MeasuredLossScale(history=1)),
                     model=model)
  grad_fn = jls.scaled_value_and_grad(loss_fn, probes=True)

  @jax.jit
  def probed_step(state, x, y):
    loss, grads, probes = grad_fn(state.opt_state, state.params, state.apply_fn, x, y)
    return state.apply_gradients(grads=grads, loss=loss, probes=probes), loss

  losses = []
  for _ in range(10):
    state, loss = probed_step(state, X * 1e-3, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and int(state.step) == 10
  assert not int(state.opt_state.skipped_steps)
  # The step is the transformation's own, probes included, and they set the scale.
  _, grads, probes = grad_fn(state.opt_state, state.params, state.apply_fn, X * 1e-3, Y)
  params, opt_state = state.tx.apply_gradients(grads, state.opt_state, state.params,
                                               probes=probes)
  stepped = state.apply_gradients(grads=grads, probes=probes)
  chex.assert_trees_all_equal((stepped.params, stepped.opt_state), (params, opt_state))
  unprobed = state.apply_gradients(grads=grads).opt_state.loss_scale()
  assert float(stepped.opt_state.loss_scale()) < float(unprobed)


@pytest.mark.parametrize("tx, why", [
    (optax.adam(1e-2), "found 0"),
    (optax.chain(optax.scale(1.0), jls.loss_scaling(optax.sgd(1.0))), "not the outermost")])
def test_a_tx_without_loss_scaling_outermost_is_refused_when_the_state_is_created(tx, why):
  with pytest.raises(TypeError, match=f"`tx`.*{why}"):
    make_state(tx=tx)


def test_a_chain_of_one_loss_scaling_is_a_tx_like_any_other():
  state = make_state(tx=optax.chain(jls.loss_scaling(optax.adam(1e-2))))
  state, _ = step(state, X, Y)
  before = state.params
  state, _ = step(state, X * jnp.nan, Y)
  chex.assert_trees_all_equal(state.params, before)
  assert int(jls.metrics(state.opt_state)["skipped_steps"]) == 1


def test_step_counts_calls_as_flax_does_and_the_schedule_count_is_kept():
  tx = jls.loss_scaling(optax.adam(optax.linear_schedule(1e-2, 0.0, 10)))
  state, _ = step(make_state(tx=tx), X, Y)
  inner = state.opt_state.inner_state
  state, _ = step(state, X * jnp.nan, Y)
  assert int(state.step) == 2  # flax's TrainState (and its DynamicScale examples) count calls
  chex.assert_trees_all_equal(state.opt_state.inner_state, inner)  # optax's count: the schedule's


def test_train_state_equals_flax_own_to_float_rounding():
  tx = jls.loss_scaling(optax.adam(1e-2))
  ours, theirs = make_state(TrainState, tx), make_state(train_state.TrainState, tx)

  @jax.jit
  def their_step(state, x, y):
    _, grads = jls.scaled_value_and_grad(loss_fn)(state.opt_state, state.params,
                                                  state.apply_fn, x, y)
    return state.apply_gradients(grads=grads)

  for _ in range(5):
    ours, _ = step(ours, X, Y)
    theirs = their_step(theirs, X, Y)
  chex.assert_trees_all_close(ours.params, theirs.params, rtol=1e-6, atol=1e-7)


def fp8_step(state, overflow):
  def fp8_loss(variables):
    out = state.apply_fn(variables, X)
    return overflow_in_backward(jnp.mean((out - Y) ** 2), overflow)

  loss, grads = jls.scaled_value_and_grad(fp8_loss)(state.opt_state, state.params)
  return state.apply_gradients(grads=grads, loss=loss)


def test_fp8_statistics_are_kept_on_a_skipped_step_and_set_on_an_applied_one():
  # flax's fp8 layers keep scales and amax histories in "_overwrite_with_gradient"; an
  # overflowed step used to write its inf into a 1024-long history.
  state = make_state(model=Model(linen.Fp8DirectDotGeneralOp), params_only=False)
  state = jax.jit(fp8_step)(state, 1.0)
  fp8 = state.params["_overwrite_with_gradient"]
  skipped = jax.jit(fp8_step)(state, jnp.inf)
  assert int(jls.metrics(skipped.opt_state)["skipped_steps"]) == 1
  chex.assert_trees_all_equal(skipped.params, state.params)
  applied = jax.jit(fp8_step)(skipped, 1.0)
  assert bool(jls.all_finite(applied.params))
  before, after = (jax.tree_util.tree_leaves_with_path(tree) for tree in (
      fp8, applied.params["_overwrite_with_gradient"]))
  history = [i for i, (path, _) in enumerate(after) if "output_grad_amax" in str(path)]
  assert len(history) == 1 and not np.array_equal(after[history[0]][1], before[history[0]][1])


def test_replaced_fields_follow_the_step_decision():
  # BatchNorm statistics passed to apply_gradients are kept on a skipped step.
  class Stats(TrainState):
    batch_stats: dict

  state = Stats.create(apply_fn=None, params={"w": jnp.ones(2)}, batch_stats={"mean": jnp.ones(2)},
                       tx=jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0)))
  new_stats = {"mean": jnp.full(2, jnp.nan)}
  skipped = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])}, batch_stats=new_stats)
  chex.assert_trees_all_equal(skipped.batch_stats, state.batch_stats)
  applied = state.apply_gradients(grads={"w": jnp.ones(2)}, batch_stats={"mean": jnp.zeros(2)})
  chex.assert_trees_all_equal(applied.batch_stats, {"mean": jnp.zeros(2)})


@pytest.mark.parametrize("new_stats, match", [
    ({"mu": jnp.zeros(2), "var": jnp.zeros(2)}, "`batch_stats`"),
    ({"mean": jnp.zeros(2)}, "`batch_stats`")],
    ids=["renamed_key", "one_leaf_fewer"])
def test_a_replaced_field_of_another_structure_is_refused_naming_it(new_stats, match):
  # A renamed key got the old values by position on a skipped step ({"mu": old mean}),
  # and a field with fewer leaves raised JAX's bare "Too many leaves for PyTreeDef".
  class Stats(TrainState):
    batch_stats: dict

  state = Stats.create(apply_fn=None, params={"w": jnp.ones(2)},
                       batch_stats={"mean": jnp.ones(2), "var": jnp.full(2, 9.0)},
                       tx=jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0)))
  with pytest.raises(ValueError, match=match):
    state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])}, batch_stats=new_stats)


def test_a_frozen_dict_field_replaced_by_a_dict_follows_the_step_decision():
  class Stats(TrainState):
    batch_stats: Any

  state = Stats.create(apply_fn=None, params={"w": jnp.ones(2)},
                       batch_stats=FrozenDict({"mean": jnp.ones(2), "var": jnp.full(2, 9.0)}),
                       tx=jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0)))
  new_stats = {"mean": jnp.zeros(2), "var": jnp.zeros(2)}  # what flax's mutable apply returns
  skipped = state.apply_gradients(grads={"w": jnp.array([jnp.inf, 1.0])}, batch_stats=new_stats)
  assert type(skipped.batch_stats) is dict
  chex.assert_trees_all_equal(skipped.batch_stats, dict(state.batch_stats))


def test_loss_scaling_states_round_trip_through_flax_serialization():
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(64.0, hysteresis=2))
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  for grads in ({"w": jnp.ones(3)}, {"w": jnp.full(3, jnp.inf)}):
    _, state = tx.update(grads, state, params)
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  chex.assert_trees_all_equal(restored, state)
  assert restored.loss_scale.get_config() == state.loss_scale.get_config()


@pytest.mark.parametrize("loss_scale, grads", [
    (jls.DynamicLossScale(6e29, increment_period=1, max_loss_scale=1e30), jnp.ones(3)),
    (jls.DynamicLossScale(1.0, min_loss_scale=0.7), jnp.full(3, jnp.inf)),
    (jls.MeasuredLossScale(1.0, min_loss_scale=0.7), jnp.full(3, jnp.inf))],
    ids=["capped_at_1e30", "floored_at_0.7", "measured_floored_at_0.7"])
def test_a_scale_held_at_a_bound_that_float32_rounds_round_trips(loss_scale, grads):
  # The scale is clamped to the bound as float32 holds it (1e30 is 1.0000000150474662e30
  # there, 0.7 is 0.699999988): a restored state is checked against that, not the float64.
  tx = jls.loss_scaling(optax.sgd(0.1), loss_scale)
  params = {"w": jnp.ones(3)}
  _, state = tx.update({"w": grads}, tx.init(params), params)
  assert float(state.loss_scale()) in (float(np.float32(1e30)), float(np.float32(0.7)))
  restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
  chex.assert_trees_all_equal(restored, state)


@pytest.mark.parametrize("saved, target, match", [
    (jls.DynamicLossScale(), jls.FixedLossScale(128.0),
     r"\['current_loss_scale', 'hysteresis_left', 'num_good_steps'\].*FixedLossScale"),
    (jls.FixedLossScale(128.0), jls.DynamicLossScale(), r"\[\].*DynamicLossScale"),
    (jls.MeasuredLossScale(history=4), jls.MeasuredLossScale(), r"`maxima`.*\(4,\).*\(16,\)"),
    (jls.DynamicLossScale(2.0**20, hysteresis=2),
     jls.DynamicLossScale(2.0**10, max_loss_scale=2.0**12),
     r"'max_loss_scale': 4096.0.*`current_loss_scale`.*1048576.0")],
    ids=["extra_fields", "missing_fields", "other_history", "beyond_the_targets_limits"])
def test_a_checkpoint_of_another_loss_scale_is_refused_not_restored_in_part(saved, target, match):
  # Extra fields were dropped (the saved dynamic scale lost), a missing one raised a bare
  # KeyError, a history of 4 was restored into a scale configured for 16, and a scale of
  # 2**20 into one capped at 2**12, which it then exceeded.
  params = {"w": jnp.ones(3)}
  state = jls.loss_scaling(optax.adam(1e-3), saved).init(params)
  with pytest.raises(ValueError, match=match):
    serialization.from_bytes(jls.loss_scaling(optax.adam(1e-3), target).init(params),
                             serialization.to_bytes(state))


@pytest.mark.parametrize("manager", [jls_tf.FixedLossScaleManager(4.0),
                                     jls_tf.ExponentialUpdateLossScaleManager(8, 3)],
                         ids=lambda m: type(m).__name__)
def test_managers_round_trip_through_flax_serialization(manager):
  updated = manager.update_loss_scale(False).update_loss_scale(False)
  restored = serialization.from_bytes(manager, serialization.to_bytes(updated))
  assert restored == updated


def test_importing_the_package_imports_neither_flax_nor_equinox():
  code = ("import sys, jax_lossscale; "
          "imported = [m for m in ('flax', 'equinox') if m in sys.modules]; "
          "assert not imported, f'{imported} imported'")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0, result.stderr[-2000:]


def test_the_overwrite_with_gradient_collection_is_set_to_its_gradient_not_optimized():
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0))
  params = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"scale": jnp.ones(1)}}
  state = TrainState.create(apply_fn=None, params=params, tx=tx)
  grads = {"params": {"w": jnp.full(2, 0.5)},
           "_overwrite_with_gradient": {"scale": jnp.full(1, 7.0)}}
  state = state.apply_gradients(grads=grads)
  chex.assert_trees_all_equal(state.params["params"]["w"], jnp.full(2, 0.5))
  chex.assert_trees_all_equal(state.params["_overwrite_with_gradient"]["scale"], jnp.full(1, 7.0))


def test_a_loss_scale_class_defined_after_the_import_round_trips_through_flax_serialization():
  @jls.loss_scale_dataclass
  class Later(jls.DynamicLossScale):
    pass

  updated = Later(8.0).update({"g": jnp.inf})[0]
  restored = serialization.from_bytes(Later(8.0), serialization.to_bytes(updated))
  assert restored == updated
  assert serialization.to_state_dict(updated).keys() == set(updated._state_names)
