"""Specification of the loss scales: NoOp, Fixed and Dynamic."""

import dataclasses
import json

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_models
from test_numerics import NARROW

import jax_lossscale as jls
from jax_lossscale import _jax_internals
from jax_lossscale import tensorflow as jls_tf

FINITE = {"w": jnp.ones((3,)), "b": jnp.zeros(())}
INF = {"w": jnp.array([1.0, jnp.inf, 1.0]), "b": jnp.zeros(())}
NAN = {"w": jnp.ones((3,)), "b": jnp.array(jnp.nan, jnp.float32)}


def flagged(finite):
  """Gradients that are finite exactly when `finite` (a boolean scalar) is."""
  return {"g": jnp.where(finite, 1.0, jnp.inf)}


def trajectory(loss_scale, steps, maybe_jit=lambda f: f):
  """The scale after each update, for a list of gradient trees."""
  update = maybe_jit(lambda ls, g: ls.update(g))
  scales, applied = [], []
  for grads in steps:
    loss_scale, should_apply = update(loss_scale, grads)
    scales.append(float(loss_scale()))
    applied.append(bool(should_apply))
  return scales, applied, loss_scale


# --- DynamicLossScale: exact trajectories -------------------------------------------


def test_growth_doubles_every_increment_period(maybe_jit):
  scales, applied, _ = trajectory(jls.DynamicLossScale(1, 2, 2), [FINITE] * 6, maybe_jit)
  assert scales == [1, 2, 2, 4, 4, 8]
  assert applied == [True] * 6


def test_overflow_halves_scale_down_to_the_floor(maybe_jit):
  scales, applied, _ = trajectory(jls.DynamicLossScale(16), [INF] * 6, maybe_jit)
  assert scales == [8, 4, 2, 1, 1, 1]
  assert applied == [False] * 6


def test_overflow_resets_good_step_counter(maybe_jit):
  steps = [FINITE, NAN, FINITE, FINITE, FINITE]
  scales, applied, ls = trajectory(jls.DynamicLossScale(4, 2, 2), steps, maybe_jit)
  assert scales == [4, 2, 2, 4, 4]
  assert applied == [True, False, True, True, True]
  assert int(ls.num_good_steps) == 1


def test_non_default_multiplier_grows_and_backs_off_by_it():
  steps = [FINITE, FINITE, INF, INF]
  scales, _, _ = trajectory(jls.DynamicLossScale(9, 2, 3), steps)
  # TensorFlow divides by the multiplier when backing off, in float32.
  assert scales == [9, 27, 9, 3]
  scales, _, _ = trajectory(jls.DynamicLossScale(10, 1, 3), [INF, INF])
  assert scales == [float(np.float32(10) / np.float32(3)),
                    float(np.float32(np.float32(10) / np.float32(3)) / np.float32(3))]


def test_a_scale_update_divides_nothing():
  # The structure that keeps the test above true on GPU: no float division at all.
  loss_scale = jls.DynamicLossScale(10, 1, 3)
  program = jax.make_jaxpr(loss_scale.update)({"g": jnp.ones(3)})
  assert "div" not in {op.name for op in _jax_internals.operations_ran(program, [])}, program


def test_backoff_factor_is_independent_of_multiplier():
  scales, _, _ = trajectory(
      jls.DynamicLossScale(64, 1, 2, backoff_factor=0.25), [INF, INF, FINITE]
  )
  assert scales == [16, 4, 8]


def test_scale_stops_at_min_loss_scale():
  scales, _, _ = trajectory(jls.DynamicLossScale(32, min_loss_scale=5), [INF] * 4)
  assert scales == [16, 8, 5, 5]


def test_zero_min_loss_scale_means_no_floor():
  scales, _, _ = trajectory(jls.DynamicLossScale(2, min_loss_scale=0), [INF] * 4)
  assert scales == [1, 0.5, 0.25, 0.125]


def test_scale_stops_at_max_loss_scale():
  scales, _, _ = trajectory(jls.DynamicLossScale(4, 1, 2, max_loss_scale=10), [FINITE] * 3)
  assert scales == [8, 10, 10]


def test_growth_to_a_non_finite_scale_is_refused_by_default():
  top = float(2.0**127)
  scales, _, ls = trajectory(jls.DynamicLossScale(top, 1, 2), [FINITE] * 3)
  assert scales == [top] * 3
  assert np.isfinite(float(ls()))
  assert int(ls.num_good_steps) == 0


def test_growth_past_float32_max_is_clamped_when_max_is_given():
  f32max = float(np.finfo(np.float32).max)
  scales, _, _ = trajectory(
      jls.DynamicLossScale(2.0**127, 1, 2, max_loss_scale=f32max), [FINITE] * 2
  )
  assert scales == [f32max, f32max]


def test_hysteresis_delays_backoff_until_spent():
  ls = jls.DynamicLossScale(64, 3, 2, hysteresis=2)
  steps = [INF, FINITE, INF, INF, FINITE, FINITE, FINITE, INF, INF]
  scales, applied, _ = trajectory(ls, steps)
  # Hysteresis is only refilled by a growth: the second overflow (not consecutive)
  # spends it, and every overflow after that backs off until the scale grows again.
  assert scales == [64, 64, 32, 16, 16, 16, 32, 32, 16]
  assert applied == [False, True, False, False, True, True, True, False, False]


def test_consecutive_hysteresis_refills_on_every_finite_step():
  ls = jls.DynamicLossScale(64, 3, 2, hysteresis=2, consecutive_hysteresis=True)
  steps = [INF, FINITE, INF, FINITE, INF, INF, INF]
  scales, _, end = trajectory(ls, steps)
  assert scales == [64, 64, 64, 64, 64, 32, 16]
  assert int(end.hysteresis_left) == 0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
@pytest.mark.parametrize("position", range(4))
def test_any_nonfinite_value_in_any_leaf_is_detected(dtype, bad, position):
  grads = [jnp.ones((2, 3), dtype), jnp.ones((5,), dtype), jnp.ones((), dtype),
           jnp.ones((1, 1, 4), dtype)]
  leaf = grads[position]
  grads[position] = leaf.reshape(-1).at[leaf.size - 1].set(bad).reshape(leaf.shape)
  ls, should_apply = jls.DynamicLossScale(8).update({"params": grads})
  assert not bool(should_apply)
  assert float(ls()) == 4


def test_none_and_non_array_leaves_are_ignored(maybe_jit):
  grads = {"w": jnp.ones(2), "none": None, "step": jnp.array(3), "flag": jnp.array(True)}
  ls, should_apply = maybe_jit(lambda g: jls.DynamicLossScale(8, 1).update(g))(grads)
  assert bool(should_apply) and float(ls()) == 16
  # Non-array leaves (as in equinox modules) cannot go through jit; eager only.
  ls, should_apply = jls.DynamicLossScale(8, 1).update(
      {"w": jnp.ones(2), "name": "mlp", "act": jax.nn.relu, "n": 3}
  )
  assert bool(should_apply)


@pytest.mark.parametrize("grads", [{}, None, [None, None], ()])
def test_empty_tree_counts_as_finite(grads):
  ls, should_apply = jls.DynamicLossScale(8, 1).update(grads)
  assert bool(should_apply) and float(ls()) == 16


@pytest.mark.parametrize("ls", [jls.NoOpLossScale(), jls.FixedLossScale(8), jls.DynamicLossScale(),
                                jls.MeasuredLossScale(), jls_tf.FixedLossScaleManager(8),
                                jls_tf.ExponentialUpdateLossScaleManager(8.0, 2)],
                         ids=lambda ls: type(ls).__name__)
@pytest.mark.parametrize("grads_finite, problem", [
    (float("nan"), r"got nan \(float\)"), (jnp.ones(3), "dtype float32"),
    (jnp.array([True, False]), r"shape \(2,\)"), (jnp.asarray(1), "dtype int32")])
def test_adjust_and_should_apply_refuse_a_flag_that_is_not_a_boolean_scalar(
    ls, grads_finite, problem):
  # A NaN given as the flag counted as finite (the scale grew); the gradients given by
  # mistake made the scale a vector.
  with pytest.raises(ValueError, match=rf"`grads_finite` must be a boolean scalar.*{problem}"):
    ls.adjust(grads_finite, jnp.float32(1.0))
  with pytest.raises(ValueError, match=rf"`grads_finite` must be a boolean scalar.*{problem}"):
    ls.should_apply(grads_finite)


def test_update_returns_bool_scalar_and_typed_state():
  ls, should_apply = jls.DynamicLossScale().update(FINITE)
  assert should_apply.dtype == jnp.bool_ and should_apply.shape == ()
  assert ls.current_loss_scale.dtype == jnp.float32
  assert ls.num_good_steps.dtype == jnp.int32
  assert ls.hysteresis_left.dtype == jnp.int32


def test_scale_never_becomes_inf_nan_or_zero():
  ls = jls.DynamicLossScale(2.0**126, 1, 2)
  for grads in [FINITE] * 5 + [INF] * 200 + [FINITE] * 300:
    ls, _ = ls.update(grads)
    value = float(ls())
    assert np.isfinite(value) and value >= 1


@hypothesis.settings(deadline=None, max_examples=60)
@hypothesis.given(
    finite=st.lists(st.booleans(), min_size=1, max_size=60),
    period=st.integers(1, 5),
    multiplier=st.sampled_from([1.5, 2.0, 3.0]),
    backoff=st.sampled_from([None, 0.5, 0.7]),
    minimum=st.sampled_from([0.0, 1.0, 3.0]),
    maximum=st.sampled_from([None, 100.0]),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
)
def test_matches_reference_model_on_random_sequences(
    finite, period, multiplier, backoff, minimum, maximum, hysteresis, consecutive
):
  kwargs = dict(backoff=backoff, minimum=minimum, maximum=maximum, hysteresis=hysteresis,
                consecutive=consecutive)
  model = reference_models.Documented(16.0, period, multiplier, **kwargs)
  ls = jls.DynamicLossScale(
      16.0, period, multiplier, backoff_factor=backoff, min_loss_scale=minimum,
      max_loss_scale=maximum, hysteresis=hysteresis, consecutive_hysteresis=consecutive,
  )
  update = jax.jit(lambda ls, f: ls.update(flagged(f)))
  for f in finite:
    expected_apply = model.step(f)
    ls, should_apply = update(ls, f)
    assert bool(should_apply) == expected_apply
    assert np.float32(ls()) == model.scale
    assert int(ls.num_good_steps) == model.good
    assert int(ls.hysteresis_left) == model.left


def test_defaults_match_tensorflow_dynamic_loss_scale():
  rng = np.random.default_rng(0)
  # Long clean runs (growth), overflow storms (backoff to the floor), and noise.
  finite = np.concatenate([np.ones(4100, bool), np.zeros(20, bool), rng.random(3000) > 0.01,
                           np.ones(2500, bool)])
  tf = reference_models.TensorFlowDynamic()
  ls = jls.DynamicLossScale()
  scan = jax.jit(lambda ls, fs: jax.lax.scan(lambda c, f: _scan_step(c, f), ls, fs))
  scales, applied, good = (np.asarray(a) for a in scan(ls, finite)[1])
  for i, f in enumerate(finite):
    assert tf.step(bool(f)) == bool(applied[i])
    assert tf.scale == scales[i] and tf.good == good[i], i


def _scan_step(ls, finite):
  ls, should_apply = ls.update(flagged(finite))
  return ls, (ls(), should_apply, ls.num_good_steps)


# --- FixedLossScale and NoOpLossScale ----------------------------------------------


def test_fixed_loss_scale_never_changes_and_always_applies(maybe_jit):
  scales, applied, ls = trajectory(jls.FixedLossScale(128), [FINITE, INF, NAN], maybe_jit)
  assert scales == [128, 128, 128]
  assert applied == [True, True, True]
  assert ls().dtype == jnp.float32


@pytest.mark.parametrize(
    "value, match",
    [(0.5, ">= 1"), (0, ">= 1"), (-3, ">= 1"), (float("inf"), "finite"),
     (float("nan"), "finite"), ("128", "real number"), (True, "real number"),
     (None, "real number"), ([2.0], "real number")],
)
def test_fixed_loss_scale_rejects_bad_values(value, match):
  with pytest.raises(ValueError, match=f"loss_scale_value.*{match}"):
    jls.FixedLossScale(value)


def test_noop_loss_scale_is_one_and_changes_nothing():
  ls = jls.NoOpLossScale()
  tree = {"w": jnp.arange(3.0), "i": jnp.arange(2)}
  assert float(ls()) == 1.0 and ls().dtype == jnp.float32
  assert ls.scale(tree) is tree and ls.unscale(tree) is tree
  new, should_apply = ls.update(INF)
  assert new is ls and bool(should_apply)


# --- scale and unscale -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_scale_and_unscale_keep_the_leaf_dtype(dtype):
  ls = jls.FixedLossScale(2.0**10)
  x = jnp.array([1.5, -0.25], dtype)
  scaled = ls.scale(x)
  assert scaled.dtype == dtype
  chex.assert_trees_all_equal(scaled, (x.astype(jnp.float32) * 1024).astype(dtype))
  chex.assert_trees_all_equal(ls.unscale(scaled), x)


def test_scale_computes_in_float32_so_a_float16_product_survives():
  # 2**16 is not a float16 number, but 2**-4 * 2**16 = 4096 is.
  ls = jls.FixedLossScale(2.0**16)
  assert float(ls.scale(jnp.array(2.0**-4, jnp.float16))) == 4096.0
  # unscale divides in float32 and rounds once: 2**-20 is a float16 subnormal.
  assert float(ls.unscale(jnp.array(2.0**-4, jnp.float16))) == 2.0**-20


def test_unscale_divides_by_the_largest_scales_exactly_under_jit():
  loss_scale = jls.DynamicLossScale(2.0**127, min_loss_scale=0)
  x = jnp.array([2.0**127, -2.0**100, 3.0], jnp.float32)
  got = jax.jit(lambda ls, x: ls.unscale(x))(loss_scale, x)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(x) / np.float32(2.0**127))


@pytest.mark.parametrize("dtype", NARROW, ids=lambda d: jnp.dtype(d).name)
def test_scale_and_unscale_narrow_leaves_in_float32(dtype):
  # They raised TypePromotionError: float8 types do not promote implicitly.
  x = jnp.array([1.0, 2.0, 0.5], dtype)
  loss_scale = jls.FixedLossScale(2.0)
  scaled = loss_scale.scale(x)
  assert scaled.dtype == dtype
  np.testing.assert_array_equal(np.float32(scaled), [2.0, 4.0, 1.0])
  np.testing.assert_array_equal(np.float32(loss_scale.unscale(scaled)), np.float32(x))


def test_python_numbers_are_scaled_like_arrays():
  # FixedLossScale(2.).scale(3.0) returned 3.0; jmp and Keras multiply.
  assert float(jls.FixedLossScale(2.0).scale(3.0)) == 6.0
  assert float(jls.FixedLossScale(2.0).unscale(3.0)) == 1.5
  assert jls.FixedLossScale(2.0).scale(3) == 3  # integers are not gradients


def test_scale_and_unscale_pass_none_and_non_floating_leaves_through():
  ls = jls.FixedLossScale(4)
  tree = {"w": jnp.ones(2), "none": None, "step": jnp.array(3), "name": "x"}
  for out in (ls.scale(tree), ls.unscale(tree)):
    assert out["none"] is None and out["name"] == "x"
    assert out["step"] is tree["step"]
  assert float(ls.scale(tree)["w"][0]) == 4 and float(ls.unscale(tree)["w"][0]) == 0.25


# --- pytree behaviour ----------------------------------------------------------------

NON_DEFAULT = jls.DynamicLossScale(
    256, 7, 3.0, backoff_factor=0.25, min_loss_scale=4, max_loss_scale=2.0**20,
    hysteresis=3, consecutive_hysteresis=True,
)


def assert_same_loss_scale(a, b):
  assert type(a) is type(b)
  assert a.get_config() == b.get_config()
  chex.assert_trees_all_equal(a, b)


@pytest.mark.parametrize("ls", [jls.NoOpLossScale(), jls.FixedLossScale(8), NON_DEFAULT],
                         ids=type)
def test_every_field_survives_flatten_unflatten_jit_and_tree_map(ls):
  leaves, treedef = jax.tree_util.tree_flatten(ls)
  assert_same_loss_scale(jax.tree_util.tree_unflatten(treedef, leaves), ls)
  assert_same_loss_scale(jax.jit(lambda x: x)(ls), ls)  # as argument and result
  assert_same_loss_scale(jax.tree.map(lambda x: x, ls), ls)


def test_a_jitted_update_backs_off_to_min_loss_scale_not_to_one():
  # jmp's hand-written flatten forgot `min_loss_scale`: after any jit it became 1.
  ls = jls.DynamicLossScale(8, min_loss_scale=4)
  ls, _ = jax.jit(lambda x: x.update(INF))(ls)
  ls, _ = jax.jit(lambda x: x.update(INF))(ls)
  assert float(ls()) == 4


def test_every_field_survives_tree_map():
  doubled = jax.tree.map(lambda x: x * 2, NON_DEFAULT)
  assert doubled.get_config() == NON_DEFAULT.get_config()
  assert float(doubled()) == 512 and int(doubled.hysteresis_left) == 6


def test_state_leaves_have_readable_key_paths():
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(NON_DEFAULT)]
  assert paths == [".current_loss_scale", ".num_good_steps", ".hysteresis_left"]


def test_vmap_over_a_batch_of_loss_scales():
  batch = dataclasses.replace(
      NON_DEFAULT, current_loss_scale=jnp.array([8.0, 64.0, 256.0]),
      num_good_steps=jnp.zeros(3, jnp.int32), hysteresis_left=jnp.ones(3, jnp.int32),
  )
  finite = jnp.array([True, False, False])
  new, should_apply = jax.vmap(lambda ls, f: ls.update(flagged(f)))(batch, finite)
  chex.assert_trees_all_equal(should_apply, finite)
  chex.assert_trees_all_equal(new.current_loss_scale, jnp.array([8.0, 16.0, 64.0]))
  chex.assert_trees_all_equal(new.num_good_steps, jnp.array([1, 0, 0], jnp.int32))
  assert new.get_config() == NON_DEFAULT.get_config()


def test_jitted_update_traces_once():
  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(ls, grads):
    return ls.update(grads)

  ls = jls.DynamicLossScale()
  for grads in [FINITE, INF, FINITE, NAN, FINITE]:
    ls, _ = step(ls, grads)


def test_constructing_a_loss_scale_does_not_create_jax_arrays():
  # Building one (at the import of a training script, before jax.distributed.initialize)
  # must not start a JAX backend.
  ls = jls.DynamicLossScale()
  assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(ls))


def test_equality_compares_config_and_state():
  assert jls.DynamicLossScale(8) == jls.DynamicLossScale(8)
  assert jls.DynamicLossScale(8) != jls.DynamicLossScale(16)
  assert jls.DynamicLossScale(8) != jls.DynamicLossScale(8).update(INF)[0]
  assert jls.FixedLossScale(8) != jls.DynamicLossScale(8)


def test_repr_shows_config_and_state():
  text = repr(jls.DynamicLossScale(8, 10))
  assert text.startswith("DynamicLossScale(initial_loss_scale=8.0, increment_period=10,")
  assert "current_loss_scale=8.0" in text and "num_good_steps=0" in text
  assert repr(jls.FixedLossScale(4)) == "FixedLossScale(loss_scale_value=4.0)"
  assert repr(jls.NoOpLossScale()) == "NoOpLossScale()"


# --- config ------------------------------------------------------------------------


@pytest.mark.parametrize("ls", [jls.NoOpLossScale(), jls.FixedLossScale(8), NON_DEFAULT,
                                jls.DynamicLossScale()], ids=repr)
def test_config_round_trips_through_json(ls):
  config = json.loads(json.dumps(ls.get_config()))
  assert type(ls).from_config(config) == ls


def test_config_holds_the_initial_hyperparameters_not_the_state():
  ls, _ = jls.DynamicLossScale(8).update(INF)
  assert ls.get_config()["initial_loss_scale"] == 8.0
  assert float(type(ls).from_config(ls.get_config())()) == 8.0


# --- constructor errors ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(initial_loss_scale=0), "initial_loss_scale"),
        (dict(initial_loss_scale=-1), "initial_loss_scale"),
        (dict(initial_loss_scale=float("inf")), "initial_loss_scale"),
        (dict(initial_loss_scale=float("nan")), "initial_loss_scale"),
        (dict(initial_loss_scale="big"), "initial_loss_scale"),
        (dict(initial_loss_scale=0.5), "initial_loss_scale"),  # below the floor of 1
        (dict(initial_loss_scale=64, max_loss_scale=32), "initial_loss_scale"),
        (dict(increment_period=0), "increment_period"),
        (dict(increment_period=2.5), "increment_period"),
        (dict(increment_period=True), "increment_period"),
        (dict(multiplier=1.0), "multiplier"),
        (dict(multiplier=0.5), "multiplier"),
        (dict(multiplier=float("inf")), "multiplier"),
        (dict(backoff_factor=0.0), "backoff_factor"),
        (dict(backoff_factor=1.0), "backoff_factor"),
        (dict(backoff_factor=1.5), "backoff_factor"),
        (dict(min_loss_scale=-1), "min_loss_scale"),
        (dict(min_loss_scale=float("nan")), "min_loss_scale"),
        (dict(min_loss_scale=4, max_loss_scale=2, initial_loss_scale=4), "max_loss_scale"),
        (dict(max_loss_scale=float("inf")), "max_loss_scale"),
        (dict(hysteresis=0), "hysteresis"),
        (dict(hysteresis=1.5), "hysteresis"),
        (dict(consecutive_hysteresis=1), "consecutive_hysteresis"),
    ],
)
def test_dynamic_loss_scale_rejects_nonsense_naming_the_argument(kwargs, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    jls.DynamicLossScale(**kwargs)
