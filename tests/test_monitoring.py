"""Specification of reading the state: `metrics`, `if_applied`, `raise_if_stuck`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Wrapped

import jax_lossscale as jls
from jax_lossscale import _monitoring
from jax_lossscale import tensorflow as jls_tf

PARAMS = {"dense": {"kernel": jnp.ones((4, 3)), "bias": jnp.zeros(3)}}
GOOD = jax.tree.map(jnp.ones_like, PARAMS)
BAD = jax.tree.map(lambda p: jnp.full_like(p, jnp.nan), PARAMS)


def steps(tx, sequence, params=PARAMS):
  """Runs `tx.update` over `(grads, loss)` pairs (loss may be None)."""
  state, update = tx.init(params), jax.jit(tx.update)
  for grads, loss in sequence:
    _, state = update(grads, state, params) if loss is None else update(
        grads, state, params, loss=loss)
  return state


@pytest.mark.parametrize(
    "make, why",
    [(lambda tx: optax.chain(optax.add_decayed_weights(1e-4), tx), "chained before"),
     (lambda tx: optax.chain(tx, optax.add_decayed_weights(1e-4)), "chained after"),
     (lambda tx: optax.MultiSteps(tx, 2), "MultiSteps around loss_scaling"),
     (lambda tx: optax.inject_hyperparams(lambda learning_rate: tx)(learning_rate=0.1),
      "inject_hyperparams around loss_scaling"),
     (lambda tx: optax.multi_transform({"a": tx, "b": optax.set_to_zero()},
                                       {"dense": {"kernel": "a", "bias": "b"}}),
      "multi_transform"),
     (lambda tx: optax.named_chain(("decay", optax.add_decayed_weights(1e-4)), ("ls", tx)),
      "chained before"),
     (lambda tx: optax.named_chain(("ls", tx), ("scale", optax.scale(0.5))), "chained after"),
     (lambda tx: optax.apply_if_finite(tx, 3), "apply_if_finite around loss_scaling keeps"),
     (lambda tx: optax.conditionally_transform(tx, lambda step: step > 0),
      "ConditionallyTransformState runs around it")],
    ids=["decay_before", "decay_after", "multisteps", "inject_hyperparams", "multi_transform",
         "named_chain_before", "named_chain_after", "apply_if_finite", "another_wrapper"])
def test_a_composition_where_loss_scaling_is_not_outermost_is_refused(make, why):
  # The docs chained add_decayed_weights before loss_scaling: the decay was divided by
  # the scale. After it, a decay (or a schedule) still ran on skipped steps.
  state = make(jls.loss_scaling(optax.sgd(0.1))).init(PARAMS)
  for read in (jls.metrics, lambda s: jls.scaled_value_and_grad(lambda p: 0.0)(s, PARAMS)):
    with pytest.raises(ValueError, match=f"outermost.*{why}"):
      read(state)


@pytest.mark.parametrize("make", [lambda tx: tx, lambda tx: optax.chain(tx),
                                  lambda tx: optax.named_chain(("ls", tx))],
                         ids=["bare", "chain_of_one", "named_chain_of_one"])
def test_the_state_is_found_where_loss_scaling_is_outermost(make):
  state = make(jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(64.0))).init(PARAMS)
  assert float(jls.metrics(state)["loss_scale"]) == 64.0


def test_without_loss_scaling_the_error_names_the_function_and_argument():
  with pytest.raises(ValueError, match=r"`opt_state`.*found 0\b"):
    jls.metrics(optax.adam(1e-3).init(PARAMS))


def test_if_applied_with_the_state_last_says_the_order_of_its_arguments():
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(ValueError, match=r"\(opt_state, new, old\)"):
    jls.if_applied(GOOD, PARAMS, state)
  with pytest.raises(ValueError, match="`opt_state`"):
    jls.if_applied(GOOD, PARAMS, PARAMS)


def test_raise_if_stuck_refuses_probes_that_are_not_measurements_at_once():
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(TypeError, match=r"`probes`.*probes=True.*\bdict\b"):
    jls.raise_if_stuck(state, probes={"layer": 1.0})


def test_unscale_divides_by_the_scale_the_gradients_were_computed_with():
  # The step grows the scale from 16 to 32: the state after it holds the next scale, and
  # dividing by it would halve the gradients.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0, increment_period=1))
  state = tx.init(PARAMS)
  grads = jax.tree.map(lambda g: g * 3.0 * 16.0, GOOD)
  _, after = jax.jit(tx.apply_gradients)(grads, state, PARAMS)
  assert float(after.loss_scale()) == 32.0 and float(after.last_loss_scale) == 16.0
  chex.assert_trees_all_equal(jls.unscale(grads, after), jax.tree.map(lambda g: g * 3.0, GOOD))
  chex.assert_trees_all_equal(jls.unscale(grads, after), state.loss_scale.unscale(grads))
  half = jls.unscale({"g": jnp.array([32.0], jnp.float16), "n": 1}, after)
  assert half["g"].dtype == jnp.float16 and float(half["g"][0]) == 2.0 and half["n"] == 1


def test_metrics_give_the_unscaled_gradients_norm_when_asked_for():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(2.0**10), grad_norm=True)
  state = tx.init(PARAMS)
  assert np.isnan(float(jls.metrics(state)["grad_norm"]))  # before any step
  unscaled = jax.tree.map(lambda p: jnp.full_like(p, 0.5), PARAMS)  # 15 values of 0.5
  grads = jax.tree.map(lambda g: g * 2.0**10, unscaled)
  _, state = jax.jit(tx.apply_gradients)(grads, state, PARAMS)
  assert float(jls.metrics(state)["grad_norm"]) == pytest.approx(0.5 * 15**0.5, rel=1e-6)
  _, state = jax.jit(tx.apply_gradients)(BAD, state, PARAMS)  # skipped: the norm is NaN
  assert np.isnan(float(jls.metrics(state)["grad_norm"])) and not bool(state.last_applied)
  assert "grad_norm" not in jls.metrics(jls.loss_scaling(optax.sgd(0.1)).init(PARAMS))
  clipped = jls.loss_scaling(optax.sgd(0.1), clip_by_global_norm=1.0)
  assert "grad_norm" not in jls.metrics(clipped.init(PARAMS))


def test_with_clipping_the_norm_recorded_is_the_clips_before_the_clip():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(4.0), clip_by_global_norm=1.0,
                        grad_norm=True)
  grads = jax.tree.map(lambda g: g * 4.0 * 2.0, GOOD)  # unscaled: 15 values of 2
  _, state = tx.update(grads, tx.init(PARAMS), PARAMS)
  assert float(jls.metrics(state)["grad_norm"]) == pytest.approx(2.0 * 15**0.5, rel=1e-6)


def test_a_state_made_without_the_norm_is_refused_by_a_step_that_records_it():
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(ValueError, match=r"`state`.*norm"):
    jls.loss_scaling(optax.sgd(0.1), grad_norm=True).update(GOOD, state, PARAMS)
  with pytest.raises(ValueError, match=r"`grad_norm`.*\b1\b"):
    jls.loss_scaling(optax.sgd(0.1), grad_norm=1)


def test_inject_hyperparams_inside_are_read_where_logging_code_reads_them():
  # levanter logs `opt_state.hyperparams` when the state has it; optax's tree_get finds
  # them inside any state.
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
  state = jls.loss_scaling(optax.MultiSteps(inner, 2)).init(PARAMS)
  assert float(state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
  assert float(optax.tree_utils.tree_get(state, "learning_rate")) == pytest.approx(1e-3)
  plain = jls.loss_scaling(optax.adam(1e-3)).init(PARAMS)
  assert not hasattr(plain, "hyperparams")
  with pytest.raises(AttributeError, match=r"\b0 optax.inject_hyperparams\b"):
    plain.hyperparams  # noqa: B018


def test_the_count_method_of_the_state_documents_itself():
  assert "COUNTS" in jls.LossScalingState.count.__doc__


def test_metrics_of_an_nnx_optimizer_and_of_nnx_state():
  from flax import nnx

  model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, jls.loss_scaling(optax.sgd(0.1)), wrt=nnx.Param)
  assert float(jls.metrics(optimizer)["loss_scale"]) == 2.0**15
  # nnx.state keeps only arrays, in dicts: README sends users to the optimizer instead.
  with pytest.raises(ValueError, match=r"nnx.state\(optimizer\)"):
    jls.metrics(nnx.state(optimizer))


@pytest.mark.parametrize("old", [{"mean": jnp.zeros(3)}, {"mean": jnp.zeros(2, jnp.int32)},
                                 {"average": jnp.zeros(2)}, {"mean": 0.0}],
                         ids=["shape", "dtype", "structure", "a_number_for_an_array"])
def test_if_applied_refuses_new_and_old_that_do_not_match_naming_them(old):
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises((TypeError, ValueError), match="`new` and `old`"):
    jls.if_applied(state, {"mean": jnp.ones(2)}, old)


def test_if_applied_makes_other_state_follow_the_step_decision():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))
  old, new = {"mean": jnp.zeros(2)}, {"mean": jnp.full(2, jnp.nan)}
  skipped = steps(tx, [(BAD, None)])
  chex.assert_trees_all_equal(jax.jit(jls.if_applied)(skipped, new, old), old)
  applied = steps(tx, [(GOOD, None)])
  chex.assert_trees_all_equal(jls.if_applied(applied, {"mean": jnp.ones(2)}, old),
                              {"mean": jnp.ones(2)})


def test_if_applied_chooses_python_numbers_too_and_keeps_equal_static_ones():
  # A counter of one's own (README) advanced on a skipped step, and a NaN Python float
  # came through: Python numbers were passed through from `new` as static leaves.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))
  skipped, applied = steps(tx, [(BAD, None)]), steps(tx, [(GOOD, None)])
  new, old = {"step": 1, "lr": float("nan"), "name": "adam"}, {"step": 0, "lr": 0.5,
                                                                 "name": "adam"}
  for state, expected in ((skipped, old), (applied, new)):
    chosen = jls.if_applied(state, new, old)
    assert int(chosen["step"]) == expected["step"] and chosen["name"] == "adam"
    np.testing.assert_equal(float(chosen["lr"]), expected["lr"])
  assert jls.if_applied(skipped, {"eps": 1e-8}, {"eps": 1e-8})["eps"] == 1e-8  # as it is


def test_metrics_are_scalars_ready_for_logging():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))
  state = steps(tx, [(BAD, None)])
  metrics = jax.jit(jls.metrics)(state)
  assert {k: v.item() for k, v in metrics.items()} == {
      "loss_scale": 8.0, "skipped_steps": 1, "consecutive_skips": 1,
      "last_applied": False, "nonfinite_loss_steps": 0, "nonfinite_update_steps": 0,
      "consecutive_nonfinite_loss": 0, "consecutive_nonfinite_updates": 0,
  }


def test_metrics_and_loss_scale_are_plain_arrays_whatever_wraps_the_state():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))
  state = steps(tx, [(BAD, None)])
  wrapped = jax.tree.map(Wrapped, state)
  metrics = jls.metrics(wrapped)
  assert all(isinstance(v, jax.Array) for v in metrics.values())
  assert f"{metrics['skipped_steps']:d}" == "1" and not bool(metrics["last_applied"])
  loss_scale = _monitoring.find_state(wrapped).loss_scale
  assert isinstance(loss_scale.current_loss_scale, jax.Array)
  assert float(loss_scale()) == 8.0
  jls.raise_if_stuck(wrapped, max_consecutive_skips=2)


def test_raise_if_stuck_fails_fast_with_a_clear_message():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(4.0))
  state = steps(tx, [(BAD, None)] * 5)
  jls.raise_if_stuck(state, max_consecutive_skips=6)
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"max_consecutive_skips=5\b.*minimum 1\b"):
    jls.raise_if_stuck(state, max_consecutive_skips=5)


def test_raise_if_stuck_knows_the_floor_of_every_scale_that_backs_off():
  # contrib's manager has no `min_loss_scale` argument: its floor is 1.
  manager = jls_tf.ExponentialUpdateLossScaleManager(4.0, 10, 1, 2.0, 0.5)
  tx = jls.loss_scaling(optax.sgd(0.1), manager)
  state = steps(tx, [(BAD, None)] * 5)
  assert float(state.loss_scale()) == 1.0
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"minimum 1\b.*diverges"):
    jls.raise_if_stuck(state, max_consecutive_skips=5)


def test_raise_if_stuck_knows_a_floor_that_float32_rounds():
  # 1.1 is 1.10000002 in float32, where the scale is held and floored.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(4.4, min_loss_scale=1.1))
  state = steps(tx, [(BAD, None)] * 5)
  with pytest.raises(jls.LossScaleStuckError, match=r"minimum 1.1\b.*diverges"):
    jls.raise_if_stuck(state, max_consecutive_skips=5)


@pytest.mark.parametrize("loss_scale", [jls.NoOpLossScale(), jls.FixedLossScale(8.0),
                                        jls.DynamicLossScale(8.0)])
def test_raise_if_stuck_reads_a_vmapped_state_of_any_loss_scale(loss_scale):
  # Three runs at once; a fixed scale is one for all of them, not an array per run.
  tx = jls.loss_scaling(optax.sgd(0.1), loss_scale)
  params = jnp.ones((3, 2))
  step = jax.vmap(lambda g, s, p: tx.update(g, s, p)[1])
  state = jax.vmap(tx.init)(params)
  for _ in range(3):
    state = step(jnp.full((3, 2), jnp.inf), state, params)
  with pytest.raises(jls.LossScaleStuckError, match=r"the last 3 steps were all skipped"):
    jls.raise_if_stuck(state, max_consecutive_skips=3)


@pytest.mark.parametrize("loss_scale", [jls.NoOpLossScale(), jls.FixedLossScale(1.0)],
                         ids=["no_op", "fixed_at_1"])
def test_raise_if_stuck_at_scale_1_blames_the_model_not_the_scale(loss_scale):
  # A bfloat16 run (no scaling) whose gradients are all NaN was told "the gradients keep
  # overflowing", pointing at a loss scale that scales nothing.
  state = steps(jls.loss_scaling(optax.sgd(0.1), loss_scale), [(BAD, None)] * 3)
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"scale 1\b.*diverges"):
    jls.raise_if_stuck(state, max_consecutive_skips=3)


def test_raise_if_stuck_blames_the_current_streak_not_the_running_totals():
  # 5 steps with a NaN loss, a clean step, then 5 overflows: the loss is not to blame.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(2.0**20))
  nan = jnp.array(jnp.nan)
  state = steps(tx, [(BAD, nan)] * 5 + [(GOOD, None)] + [(BAD, None)] * 5)
  assert int(state.nonfinite_loss_steps) == 5 and int(state.consecutive_skips) == 5
  with pytest.raises(jls.LossScaleStuckError, match="overflowing") as info:
    jls.raise_if_stuck(state, max_consecutive_skips=5)
  assert "loss itself" not in str(info.value)


def test_raise_if_stuck_blames_a_nonfinite_loss():
  tx = jls.loss_scaling(optax.sgd(0.1))
  state = steps(tx, [(BAD, jnp.array(jnp.nan))] * 3)
  with pytest.raises(jls.LossScaleStuckError, match="loss itself"):
    jls.raise_if_stuck(state, max_consecutive_skips=3)


def test_raise_if_stuck_names_an_optimizer_that_makes_nan_from_finite_gradients():
  params = {"w": jnp.ones(2, jnp.float16)}
  tx = jls.loss_scaling(optax.adam(1e-3))  # eps=1e-8 is 0 in float16
  state = steps(tx, [({"w": jnp.zeros(2, jnp.float16)}, None)] * 3, params)
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"non-finite updates.*eps.*get_policy\('p=f32,c=f16'\)"):
    jls.raise_if_stuck(state, max_consecutive_skips=3)


def test_raise_if_stuck_lists_every_cause_of_a_mixed_streak():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(2.0**20))
  state = steps(tx, [(BAD, jnp.array(jnp.nan))] * 2 + [(BAD, None)] * 3)
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"\b3\b[^;]*overflowing.*\b2\b[^;]*loss"):
    jls.raise_if_stuck(state, max_consecutive_skips=5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "3", np.int64(0)])
def test_raise_if_stuck_rejects_a_bad_threshold(bad):
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    jls.raise_if_stuck(None, max_consecutive_skips=bad)


@pytest.mark.parametrize("threshold", [np.int64(3), np.int32(3), jnp.int32(3)])
def test_raise_if_stuck_accepts_numpy_and_jax_integers(threshold):
  tx = jls.loss_scaling(optax.sgd(0.1))
  with pytest.raises(jls.LossScaleStuckError):
    jls.raise_if_stuck(steps(tx, [(BAD, None)] * 3), max_consecutive_skips=threshold)


def forward_nan_loss(params, x):
  for i, w in enumerate(params):
    x = jnp.tanh(x @ w)
    x = jls.diagnostics.probe(x / 0.0 if i == 1 else x, f"layer_{i}")  # inf from layer 1 on
  return jnp.mean(x**2)


def backward_overflow_loss(params, x):
  from test_value_and_grad import layers_loss

  return layers_loss(params, x)  # an overflow in layer 2's backward pass


@pytest.mark.parametrize("loss_fn, where", [
    (backward_overflow_loss, "backward pass of 'layer_2'"),
    (forward_nan_loss, "forward output of 'layer_1'")],
    ids=["backward", "forward"])
def test_raise_if_stuck_names_the_layer_where_the_trouble_began(loss_fn, where):
  params = [jnp.eye(3) * 0.5 for _ in range(4)]
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(8.0))
  state = tx.init(params)
  grad_fn = jax.jit(jls.scaled_value_and_grad(loss_fn, probes=True))
  for _ in range(3):
    loss, grads, probes = grad_fn(state, params, jnp.ones((2, 3)))
    params, state = tx.apply_gradients(grads, state, params, loss=loss, probes=probes)
  with pytest.raises(jls.LossScaleStuckError, match=where):
    jls.raise_if_stuck(state, max_consecutive_skips=3, probes=probes)
