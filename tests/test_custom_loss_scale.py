"""A loss scale written against the public contract: the warm-up loss scale of
docs/custom-loss-scale.md (its first block, run here, so the page and the tests share one
source) under `loss_scaling`, `jit`, `vmap`, an orbax checkpoint and agreeing replicas."""

import dataclasses
import pathlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from code_blocks import blocks

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf

PAGE = pathlib.Path(__file__).parent.parent / "docs" / "custom-loss-scale.md"
_line, _code = blocks(PAGE)[0]
_namespace = {"__name__": "custom_loss_scale"}
exec(compile(_code, f"{PAGE.name}, block at line {_line}", "exec"), _namespace)  # noqa: S102
WarmupLossScale = _namespace["WarmupLossScale"]

FINITE, OVERFLOW = True, False


def scales_after(loss_scale, verdicts, maybe_jit=lambda f: f):
  """The scale after `update` of each step's gradients (finite or not)."""
  update = maybe_jit(lambda ls, g: ls.update(g))
  scales, applied = [], []
  for finite in verdicts:
    loss_scale, should_apply = update(loss_scale, {"g": jnp.float32(1.0 if finite else jnp.inf)})
    scales.append(float(loss_scale()))
    applied.append(bool(should_apply))
  return scales, applied, loss_scale


def test_the_warm_up_doubles_every_finite_step_then_every_increment_period(maybe_jit):
  scales, applied, _ = scales_after(
      WarmupLossScale(warmup_steps=3, increment_period=2), [FINITE] * 7, maybe_jit)
  assert scales == [2, 4, 8, 8, 16, 16, 32]
  assert applied == [True] * 7


def test_an_overflow_halves_the_scale_and_ends_the_warm_up(maybe_jit):
  scales, applied, loss_scale = scales_after(
      WarmupLossScale(initial_loss_scale=4.0, warmup_steps=10, increment_period=3),
      [FINITE, OVERFLOW, FINITE, FINITE, FINITE], maybe_jit)
  assert scales == [8, 4, 4, 4, 8]
  assert applied == [True, False, True, True, True]
  assert int(loss_scale.warmup_left) == 0


def test_the_scale_never_exceeds_its_cap_nor_falls_below_one():
  scales, _, _ = scales_after(WarmupLossScale(max_loss_scale=4.0), [FINITE] * 3)
  assert scales == [2, 4, 4]
  scales, _, _ = scales_after(WarmupLossScale(initial_loss_scale=2.0), [OVERFLOW] * 3)
  assert scales == [1, 1, 1]


def test_adjust_keeps_the_class_configuration_shapes_and_dtypes():
  loss_scale = WarmupLossScale(warmup_steps=5, increment_period=7)
  for finite in (True, False):
    adjusted = jax.jit(lambda ls, f: ls.adjust(f))(loss_scale, jnp.array(finite))
    assert type(adjusted) is WarmupLossScale
    assert adjusted.get_config() == loss_scale.get_config()
    chex.assert_trees_all_equal_shapes_and_dtypes(adjusted, jax.tree.map(jnp.asarray, loss_scale))


def test_every_field_survives_jit_and_tree_map_and_serialization():
  loss_scale = WarmupLossScale(2.0, warmup_steps=5, increment_period=7, max_loss_scale=64.0,
                               warmup_left=np.int32(2), num_good_steps=np.int32(3))
  assert jax.jit(lambda ls: ls)(loss_scale) == loss_scale
  assert jax.tree.map(lambda x: x, loss_scale) == loss_scale
  assert jax.tree.leaves(loss_scale) == [2.0, 2, 3]
  assert loss_scale.get_config() == {"initial_loss_scale": 2.0, "warmup_steps": 5,
                                     "increment_period": 7, "max_loss_scale": 64.0}
  assert jls_tf.deserialize(jls_tf.serialize(loss_scale)) == WarmupLossScale(
      2.0, warmup_steps=5, increment_period=7, max_loss_scale=64.0)
  assert repr(loss_scale).startswith("WarmupLossScale(initial_loss_scale=2.0, warmup_steps=5")


@pytest.mark.parametrize("kwargs, argument", [
    ({"initial_loss_scale": 0.5}, "initial_loss_scale"),
    ({"warmup_steps": -1}, "warmup_steps"),
    ({"increment_period": 0}, "increment_period")])
def test_a_bad_configuration_is_refused_naming_the_argument(kwargs, argument):
  with pytest.raises(ValueError, match=f"`{argument}`"):
    WarmupLossScale(**kwargs)


# --- Under loss_scaling -------------------------------------------------------------


def float16_loss(params, x):
  """The page's model: the gradient of `w` is `x` times the scale, in float16."""
  w = params["w"].astype(jnp.float16)
  return jnp.sum(w * x, dtype=jnp.float32)


def train(tx, params, opt_state, steps, maybe_jit=lambda f: f, x=4000.0):
  grad_fn = jls.scaled_value_and_grad(float16_loss)
  inputs = jnp.full(params["w"].shape, x, jnp.float16)

  def step(params, opt_state):
    loss, grads = grad_fn(opt_state, params, inputs)
    return tx.apply_gradients(grads, opt_state, params, loss=loss)

  step, scales = maybe_jit(step), []
  for _ in range(steps):
    params, opt_state = step(params, opt_state)
    scales.append(float(opt_state.loss_scale()))
  return params, opt_state, scales


def test_trains_under_loss_scaling_skipping_only_the_overflowed_steps(maybe_jit):
  tx = jls.loss_scaling(optax.sgd(1e-6), WarmupLossScale(warmup_steps=8, increment_period=2))
  params = {"w": jnp.linspace(-1.0, 1.0, 8)}
  new_params, opt_state, scales = train(tx, params, tx.init(params), 9, maybe_jit)
  assert scales == [2, 4, 8, 16, 32, 16, 16, 32, 16]
  assert int(opt_state.skipped_steps) == 2
  # Seven applied steps of sgd on a gradient of exactly 4000 (unscaled by a power of two).
  chex.assert_trees_all_close(new_params["w"], params["w"] - 7 * 1e-6 * 4000.0,
                              rtol=1e-5, atol=1e-6)


def test_a_non_finite_loss_leaves_the_scale_and_the_warm_up_as_they_were():
  tx = jls.loss_scaling(optax.sgd(0.1), WarmupLossScale(warmup_steps=4))
  params = {"w": jnp.zeros(2)}
  opt_state = tx.init(params)
  _, new_state = tx.apply_gradients({"w": jnp.ones(2)}, opt_state, params, loss=jnp.nan)
  assert new_state.loss_scale == opt_state.loss_scale
  assert int(new_state.nonfinite_loss_steps) == 1


def test_a_batch_of_states_under_vmap_each_decides_alone():
  tx = jls.loss_scaling(optax.sgd(1e-6), WarmupLossScale(warmup_steps=8, increment_period=2))
  params = {"w": jnp.zeros((3, 8))}
  states = jax.vmap(tx.init)(params)
  x = jnp.array([4000.0, 500.0, 60000.0])[:, None]  # overflows at scales 32, 256 and 2

  def step(params, state, x):
    loss, grads = jls.scaled_value_and_grad(float16_loss)(
        state, params, jnp.broadcast_to(x, (8,)).astype(jnp.float16))
    return tx.apply_gradients(grads, state, params, loss=loss)

  batched = jax.jit(jax.vmap(step))
  for _ in range(9):
    params, states = batched(params, states, x)
  assert states.loss_scale().tolist() == [16.0, 128.0, 1.0]
  assert states.skipped_steps.tolist() == [2, 1, 3]


def test_an_orbax_checkpoint_resumes_the_run_as_if_uninterrupted(tmp_path):
  tx = jls.loss_scaling(optax.adam(1e-3), WarmupLossScale(warmup_steps=8, increment_period=2))
  params = {"w": jnp.linspace(-1.0, 1.0, 8)}
  mid_params, mid_state, _ = train(tx, params, tx.init(params), 6, jax.jit)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "checkpoint", {"params": mid_params, "opt_state": mid_state})
  target = {"params": params, "opt_state": tx.init(params)}
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "checkpoint", abstract)
  assert restored["opt_state"].loss_scale == mid_state.loss_scale
  assert int(restored["opt_state"].loss_scale.warmup_left) == 0  # ended by step 6's overflow

  resumed = train(tx, restored["params"], restored["opt_state"], 3, jax.jit)
  uninterrupted = train(tx, params, tx.init(params), 9, jax.jit)
  chex.assert_trees_all_equal(resumed[:2], uninterrupted[:2])
  assert resumed[2] == uninterrupted[2][6:] == [16, 32, 16]


def test_under_a_named_vmap_every_replica_skips_the_same_steps_and_keeps_one_scale():
  # vmap(..., axis_name=...) as pmap's one-device stand-in; replica 2's gradients are
  # poisoned on the second step only.
  tx = jls.loss_scaling(optax.sgd(0.1), WarmupLossScale(warmup_steps=8, increment_period=2))
  params = {"w": jnp.zeros((4, 2))}
  states = jax.vmap(tx.init)(params)
  step = jax.jit(jax.vmap(tx.apply_gradients, axis_name="replicas"))
  poisoned = jnp.ones((4, 2)).at[2, 1].set(jnp.nan)
  scales = []
  for grads in (jnp.ones((4, 2)), poisoned, jnp.ones((4, 2))):
    params, states = step({"w": grads}, states, params)
    scales.append(states.loss_scale().tolist())
  assert scales == [[2.0] * 4, [1.0] * 4, [1.0] * 4]
  assert states.skipped_steps.tolist() == [1] * 4
  assert states.loss_scale.warmup_left.tolist() == [0] * 4
  chex.assert_trees_all_equal(params["w"], jnp.full((4, 2), -0.2))


# --- A loss scale that measures ------------------------------------------------------


@jls.loss_scale_dataclass
class RecordingLossScale(jls.LossScale):
  """A fixed scale of 4 that keeps what the step measured (`measures = True`)."""

  measures = True
  measured: jax.Array = jls.state_field()

  def __post_init__(self):
    if self.measured is None:
      object.__setattr__(self, "measured", np.float32(0))

  def __call__(self) -> jax.Array:
    return jnp.float32(4.0)

  def adjust(self, grads_finite, measured=None):
    return dataclasses.replace(self, measured=measured)


def test_a_measuring_loss_scale_is_given_the_largest_scaled_gradient_magnitude(maybe_jit):
  tx = jls.loss_scaling(optax.sgd(0.1), RecordingLossScale())
  params = {"w": jnp.zeros(2), "b": jnp.zeros(())}
  grads = {"w": jnp.array([1.0, -6.0]), "b": jnp.array(2.0)}
  _, opt_state = maybe_jit(tx.apply_gradients)(grads, tx.init(params), params)
  assert float(opt_state.loss_scale.measured) == 6.0


def test_replicas_give_a_measuring_loss_scale_the_largest_of_their_measurements():
  tx = jls.loss_scaling(optax.sgd(0.1), RecordingLossScale())
  params = {"w": jnp.zeros((4, 2))}
  grads = {"w": jnp.array([[1.0, 0.0], [0.0, -3.0], [2.0, 2.0], [0.5, 0.5]])}
  states = jax.vmap(tx.init)(params)
  _, states = jax.jit(jax.vmap(tx.apply_gradients, axis_name="replicas"))(
      grads, states, params)
  assert states.loss_scale.measured.tolist() == [3.0] * 4
