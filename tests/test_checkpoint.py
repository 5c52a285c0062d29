"""Specification of `restore_state`: checkpoints of earlier layouts and other configurations
restored into today's `LossScalingState`."""

from typing import Any
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import serialization

import jax_lossscale as jls
import jax_lossscale.flax  # noqa: F401  (flax serialization of the loss scales)
from jax_lossscale import StepCounts

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 4), "b": jnp.zeros(2)}


class PackedCountsState(NamedTuple):
  """The layout `LossScalingState` was checkpointed in before its counts had names: the
  same fields, the six counts in one int32 vector in the order skipped_steps,
  consecutive_skips, nonfinite_loss_steps, nonfinite_update_steps,
  consecutive_nonfinite_loss, consecutive_nonfinite_updates."""

  loss_scale: Any
  inner_state: Any
  counts: jax.Array
  last_applied: jax.Array
  last_loss_scale: Any = None
  grad_norm: Any = None


def trained_state(tx):
  """A state after a few steps, its six counts all different."""
  state = tx.init(PARAMS)
  params = PARAMS
  for grads in ({"w": jnp.ones(4), "b": jnp.ones(2)}, {"w": jnp.full(4, jnp.inf),
                                                         "b": jnp.ones(2)}):
    params, state = tx.apply_gradients(grads, state, params)
  return state._replace(counts=StepCounts(*(jnp.array(n, jnp.int32) for n in (9, 5, 4, 3, 2, 1))))


def packed(state) -> PackedCountsState:
  return PackedCountsState(state.loss_scale, state.inner_state, jnp.stack(list(state.counts)),
                           state.last_applied, state.last_loss_scale, state.grad_norm)


def test_the_counts_are_named_int32_scalars():
  state = jls.loss_scaling(optax.adam(1e-3)).init(PARAMS)
  assert type(state.counts) is StepCounts
  paths = [jax.tree_util.keystr(path) for path, _ in
           jax.tree_util.tree_flatten_with_path(state.counts)[0]]
  assert paths == [f".{name}" for name in StepCounts._fields]
  assert all(x.shape == () and x.dtype == jnp.int32 for x in state.counts)


def test_the_counts_read_as_properties_and_in_metrics():
  state = trained_state(jls.loss_scaling(optax.adam(1e-3)))
  assert [int(getattr(state, name)) for name in StepCounts._fields] == [9, 5, 4, 3, 2, 1]
  metrics = jls.metrics(state)
  assert [int(metrics[name]) for name in StepCounts._fields] == [9, 5, 4, 3, 2, 1]


def test_an_orbax_checkpoint_of_packed_counts_restores_into_named_counts(tmp_path):
  tx = jls.loss_scaling(optax.adam(1e-3), grad_norm=True)
  state = trained_state(tx)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "old", packed(state))
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.restore(tmp_path / "old")
  restored = jls.restore_state(saved, like=tx.init(PARAMS))
  chex.assert_trees_all_equal(restored, state)
  chex.assert_trees_all_equal_dtypes(restored, state)


def test_a_flax_msgpack_checkpoint_of_packed_counts_restores_into_named_counts():
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(64.0, hysteresis=2))
  state = trained_state(tx)
  saved = serialization.msgpack_restore(serialization.to_bytes(packed(state)))
  restored = jls.restore_state(saved, like=tx.init(PARAMS))
  chex.assert_trees_all_equal(restored, state)


def test_packed_counts_written_before_the_last_scale_was_kept_restore_it_as_the_scale():
  # The first packed layout: loss scale, inner state, counts, last_applied, nothing after.
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(64.0, hysteresis=2))
  state = trained_state(tx)
  first = {"loss_scale": state.loss_scale, "inner_state": state.inner_state,
           "counts": jnp.stack(list(state.counts)), "last_applied": state.last_applied}
  saved = serialization.msgpack_restore(serialization.to_bytes(first))
  restored = jls.restore_state(saved, like=tx.init(PARAMS))
  assert float(restored.last_loss_scale) == float(state.loss_scale())
  chex.assert_trees_all_equal(restored._replace(last_loss_scale=state.last_loss_scale), state)


def test_a_measured_scale_written_before_it_kept_its_proven_scale_restores_it_as_zero():
  tx = jls.loss_scaling(optax.adam(1e-3), jls.MeasuredLossScale())
  state = trained_state(tx)
  older = {"current_loss_scale", "maxima", "ceiling", "patience", "strikes"}
  written = {name: getattr(state.loss_scale, name) for name in older}
  saved = serialization.to_state_dict(state._replace(loss_scale=None))
  saved["loss_scale"] = jax.tree.map(np.asarray, written)
  restored = jls.restore_state(saved, like=tx.init(PARAMS))
  assert float(restored.loss_scale.proven) == 0.0
  for name in older:
    chex.assert_trees_all_equal(getattr(restored.loss_scale, name),
                                getattr(state.loss_scale, name))


def test_a_checkpoint_of_todays_layout_restores_inside_a_larger_tree(tmp_path):
  tx = jls.loss_scaling(optax.adam(1e-3))
  state = trained_state(tx)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "new", {"params": PARAMS, "opt_state": state})
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.restore(tmp_path / "new")
  restored = jls.restore_state(saved, like={"params": PARAMS, "opt_state": tx.init(PARAMS)})
  chex.assert_trees_all_equal(restored, {"params": PARAMS, "opt_state": state})


def test_grad_norm_missing_from_the_checkpoint_starts_as_init_makes_it():
  state = trained_state(jls.loss_scaling(optax.adam(1e-3)))
  like = jls.loss_scaling(optax.adam(1e-3), grad_norm=True).init(PARAMS)
  restored = jls.restore_state(serialization.to_state_dict(packed(state)), like=like)
  assert jnp.isnan(restored.grad_norm)
  assert int(restored.skipped_steps) == 9


def test_fields_missing_from_the_checkpoint_start_as_arrays_of_their_own_with_an_abstract_like():
  state = trained_state(jls.loss_scaling(optax.adam(1e-3)))
  params = {"w": PARAMS["w"].astype(jnp.bfloat16), "b": PARAMS["b"]}
  tx = jls.loss_scaling(optax.adam(1e-3), rounding="compensated", grad_norm=True)
  saved = serialization.to_state_dict(packed(state._replace(inner_state=tx.init(
      params).inner_state)))
  abstract = jax.eval_shape(tx.init, params)
  restored = jls.restore_state(saved, like=abstract)
  assert isinstance(restored.grad_norm, jax.Array) and jnp.isnan(restored.grad_norm)
  assert isinstance(restored.rounding_counter, jax.Array)
  assert restored.rounding_counter.dtype == jnp.uint32 and int(restored.rounding_counter) == 0
  assert restored.compensation["w"].dtype == jnp.bfloat16
  assert not jnp.any(restored.compensation["w"]) and restored.compensation["b"] is None
  like = tx.init(params)  # concrete: restored arrays are not `like`'s, which a donating
  restored = jls.restore_state(saved, like=like)  # step would delete
  step = jax.jit(lambda s: tx.apply_gradients(jax.tree.map(jnp.ones_like, params), s, params),
                 donate_argnums=0)
  step(restored)
  assert not like.compensation["w"].is_deleted() and not like.rounding_counter.is_deleted()


def test_a_checkpoint_without_a_leaf_of_like_is_refused_naming_the_path():
  saved = serialization.to_state_dict(packed(trained_state(jls.loss_scaling(optax.adam(1e-3)))))
  del saved["inner_state"]["0"]["nu"]
  with pytest.raises(ValueError, match=r"`\.inner_state\[0\]\.nu\['b'\]`"):
    jls.restore_state(saved, like=jls.loss_scaling(optax.adam(1e-3)).init(PARAMS))


def test_a_leaf_of_another_shape_is_refused_naming_the_path():
  state = trained_state(jls.loss_scaling(optax.adam(1e-3)))
  like = jls.loss_scaling(optax.adam(1e-3)).init({"w": jnp.zeros(5), "b": jnp.zeros(2)})
  with pytest.raises(ValueError, match=r"`\.inner_state\[0\]\.mu\['w'\]`.*\(4,\).*\(5,\)"):
    jls.restore_state(state, like=like)


def test_a_flax_train_state_whose_step_is_a_python_int_restores_from_msgpack():
  from jax_lossscale.flax import TrainState
  tx = jls.loss_scaling(optax.adam(1e-2), rounding="compensated", state_dtype=jnp.bfloat16)
  params = {"w": jnp.linspace(-1.0, 1.0, 8).astype(jnp.bfloat16), "b": jnp.zeros(2)}
  fresh = TrainState.create(apply_fn=None, params=params, tx=tx)  # step: the int 0
  trained = fresh.apply_gradients(grads=jax.tree.map(jnp.ones_like, params))
  saved = serialization.msgpack_restore(serialization.to_bytes(trained))
  restored = jls.restore_state(saved, like=fresh)
  assert type(restored.step) is int and restored.step == 1
  chex.assert_trees_all_equal(restored.replace(step=0), trained.replace(step=0))
  with pytest.raises(ValueError, match=r"`\.step`.*float64.*Python int"):
    jls.restore_state({**saved, "step": 1.5}, like=fresh)
