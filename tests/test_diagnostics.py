"""Specification of the diagnostics: forward NaNs, overflow sources, underflow, advice."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

# float16 landmarks: smallest subnormal 2**-24, smallest normal 2**-14, largest 65504.
SUB, NORMAL, MAX = 2.0**-24, 2.0**-14, 65504.0


# --- a non-finite loss is not an overflow --------------------------------------------


def test_nonfinite_loss_skips_without_backing_off():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(64.0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  nan_grads = {"w": jnp.full(2, jnp.nan)}
  updates, state = jax.jit(tx.update)(nan_grads, state, params, loss=jnp.array(jnp.nan))
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})
  assert float(state.loss_scale()) == 64.0
  assert int(state.nonfinite_loss_steps) == 1 and int(state.skipped_steps) == 1
  # The same gradients without a loss are an overflow: the scale backs off.
  _, state = tx.update(nan_grads, state, params)
  assert float(state.loss_scale()) == 32.0 and int(state.nonfinite_loss_steps) == 1


def test_finite_loss_changes_nothing():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(64.0, increment_period=1))
  params = {"w": jnp.ones(2)}
  grads = {"w": jnp.full(2, 64.0)}
  with_loss = tx.update(grads, tx.init(params), params, loss=jnp.array(1.5))
  without = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_equal(with_loss, without)


def test_finite_loss_with_overflowing_gradients_backs_off():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(64.0))
  params = {"w": jnp.ones(2)}
  _, state = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init(params), params,
                       loss=jnp.array(0.3))
  assert float(state.loss_scale()) == 32.0 and int(state.nonfinite_loss_steps) == 0


def test_stuck_message_blames_the_forward_pass_when_the_loss_is_nan():
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  for _ in range(3):
    _, state = tx.update({"w": jnp.full(2, jnp.nan)}, state, params, loss=jnp.array(jnp.nan))
  with pytest.raises(jls.LossScaleStuckError, match="loss itself"):
    jls.raise_if_stuck(state, max_consecutive_skips=3)


# --- where did it overflow? ----------------------------------------------------------


def test_nonfinite_leaves_flags_exactly_the_bad_leaves(maybe_jit):
  grads = {"params": {"decoder": {"layer_3": {"mlp": {"kernel": jnp.ones((2, 2)).at[1, 1].set(
      jnp.inf), "bias": jnp.ones(2)}}, "embed": jnp.array([jnp.nan])}}, "step": jnp.array(3)}
  flags = maybe_jit(jls.diagnostics.nonfinite_leaves)(grads)
  assert jax.tree.structure(flags) == jax.tree.structure(grads)
  assert all(f.dtype == jnp.bool_ and f.shape == () for f in jax.tree.leaves(flags))
  assert bool(flags["params"]["decoder"]["layer_3"]["mlp"]["kernel"])
  assert not bool(flags["params"]["decoder"]["layer_3"]["mlp"]["bias"])
  assert not bool(flags["step"])
  assert jls.diagnostics.nonfinite_leaf_paths(flags) == ["params/decoder/embed",
                                             "params/decoder/layer_3/mlp/kernel"]


def test_nonfinite_leaf_paths_of_lists_and_dataclasses():
  tree = [jnp.ones(1), {"w": jnp.array([jnp.nan])}, jls.DynamicLossScale()]
  paths = jls.diagnostics.nonfinite_leaf_paths
  assert paths(jls.diagnostics.nonfinite_leaves(tree)) == ["1/w"]
  assert paths(jls.diagnostics.nonfinite_leaves({"a": jnp.ones(3), "b": None})) == []


@pytest.mark.parametrize("flags", [{"w": jnp.ones(2)}, {"w": jnp.array([True, False])}],
                         ids=["the_gradients", "a_vector_of_flags"])
def test_nonfinite_leaf_paths_needs_the_flags(flags):
  with pytest.raises(ValueError, match="nonfinite_leaf_paths"):
    jls.diagnostics.nonfinite_leaf_paths(flags)


# --- underflow and headroom ----------------------------------------------------------


def landmark_grads():
  # Each value chosen against float16's boundaries (in float32, unscaled).
  return {
      "underflow": jnp.array([2.0**-25, 2.0**-26, 1e-12], jnp.float32),  # all round to 0
      # 1.5 * 2**-25 rounds up to 2**-24; NORMAL - SUB is the largest subnormal.
      "subnormal": jnp.array([SUB, 1.5 * 2.0**-25, NORMAL - SUB], jnp.float32),
      "normal": jnp.array([NORMAL, 1.0, MAX, 65519.0], jnp.float32),  # 65519 rounds to 65504
      "overflow": jnp.array([65520.0, 1e6], jnp.float32),
      "ignored": jnp.array([0.0, jnp.inf, jnp.nan, -0.0], jnp.float32),
  }


def test_gradient_stats_counts_each_float16_boundary_exactly(maybe_jit):
  stats = maybe_jit(jls.diagnostics.gradient_stats)(landmark_grads())
  assert int(stats["nonzero"]) == 12
  assert float(stats["underflow_fraction"]) == pytest.approx(3 / 12)
  assert float(stats["subnormal_fraction"]) == pytest.approx(3 / 12)
  assert float(stats["overflow_fraction"]) == pytest.approx(2 / 12)
  assert float(stats["max_abs"]) == 1e6
  assert float(stats["min_abs"]) == np.float32(1e-12)


def test_gradient_stats_of_more_values_than_int32_counts_are_counted_in_float32():
  # Three leaves of 2**30 values (a model of 3.2e9 parameters): int32 totals wrapped.
  big = jax.ShapeDtypeStruct((2**30,), jnp.float32)
  stats = jax.eval_shape(jls.diagnostics.gradient_stats, {"a": big, "b": big, "c": big})
  assert stats["nonzero"].dtype == jnp.float32
  small = jax.eval_shape(jls.diagnostics.gradient_stats, {"a": big})
  assert small["nonzero"].dtype == jnp.int32


def test_gradient_stats_casts_nothing_to_the_target_dtype():
  # XLA:GPU drops a cast that is cast back (excess precision): the boundaries are
  # compared as thresholds, so the counts are the same on every platform.
  jaxpr = str(jax.make_jaxpr(jls.diagnostics.gradient_stats)(landmark_grads()))
  assert "new_dtype=float16" not in jaxpr, jaxpr


def test_gradient_stats_with_a_scale_shifts_the_boundaries():
  grads = {"g": jnp.array([2.0**-25, 2.0**-20, 2.0**10], jnp.float32)}
  stats = jls.diagnostics.gradient_stats(grads, loss_scale=2.0**6)  # → 2**-19, 2**-14, 2**16
  assert float(stats["underflow_fraction"]) == 0
  assert float(stats["subnormal_fraction"]) == pytest.approx(1 / 3)
  assert float(stats["overflow_fraction"]) == pytest.approx(1 / 3)


def test_gradient_stats_takes_a_loss_scale_at_its_current_scale():
  # `loss_scale` names a LossScale everywhere else: it failed inside float().
  grads = {"g": jnp.array([2.0**-25, 2.0**-20, 2.0**10], jnp.float32)}
  chex.assert_trees_all_equal(
      jls.diagnostics.gradient_stats(grads, "f16", jls.DynamicLossScale(2.0**6)),
      jls.diagnostics.gradient_stats(grads, "f16", 2.0**6))
  with pytest.raises(ValueError, match="`loss_scale`.*'x'"):
    jls.diagnostics.gradient_stats(grads, "f16", "x")


@pytest.mark.parametrize(
    "dtype, value, expected",
    [
        # bfloat16 has float32's exponent range: its subnormals are float32 subnormals,
        # which XLA flushes to zero, so only its overflow edge is reachable here.
        (jnp.bfloat16, float(np.finfo(np.float32).max), "overflow"),
        (jnp.float8_e4m3fn, 500.0, "overflow"),  # largest e4m3fn is 448; no inf, NaN
        (jnp.float8_e4m3fn, 2.0**-9, "subnormal"),
        (jnp.float8_e4m3fn, 2.0**-11, "underflow"),
        (jnp.float8_e5m2, 2.0**-16, "subnormal"),
        (jnp.float8_e5m2, 70000.0, "overflow"),
    ],
)
def test_gradient_stats_for_other_dtypes(dtype, value, expected):
  stats = jls.diagnostics.gradient_stats({"g": jnp.array([value], jnp.float32)}, dtype=dtype)
  assert float(stats[f"{expected}_fraction"]) == 1.0, stats


def test_gradient_stats_of_an_empty_tree_is_zero():
  stats = jls.diagnostics.gradient_stats({})
  assert int(stats["nonzero"]) == 0 and float(stats["underflow_fraction"]) == 0
  assert float(stats["min_abs"]) == 0 and float(stats["max_abs"]) == 0


# --- scale advisor -------------------------------------------------------------------


def test_advisor_finds_the_power_of_two_range_and_keeps_headroom():
  grads = {"g": jnp.array([2.0**-30, 2.0**-10, 4.0], jnp.float32)}
  advice = jls.diagnostics.recommend_loss_scale(grads)
  assert advice.max_scale == 2.0**13  # 4 * 2**13 = 32768 fits, 4 * 2**14 = 65536 does not
  assert advice.min_scale == 2.0**6  # 2**-30 * 2**6 = 2**-24, the smallest subnormal
  assert advice.recommended == 2.0**10  # max_scale / headroom 8
  assert advice.underflow_fraction == 0 and advice.overflow_fraction == 0


def test_advisor_bounds_round_as_the_conversion_does():
  # float16 rounds [2**-25, 2**-24) up to its smallest subnormal and (65504, 65520) down to
  # its largest value: each bound was one doubling off (min_scale 2, max_scale 1).
  advise = lambda *g: jls.diagnostics.recommend_loss_scale({"g": jnp.array(g)}, headroom=1)
  assert advise(1.5 * 2.0**-25, 1.0).min_scale == 1.0
  assert advise(32755.0).max_scale == 2.0


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_advisor_bounds_are_the_scales_where_gradient_stats_sees_the_first_loss(dtype):
  rng = np.random.default_rng(0)
  for _ in range(20):
    grads = {"g": jnp.asarray(np.exp(rng.uniform(-20, 5, size=5)), jnp.float32)}
    advice = jls.diagnostics.recommend_loss_scale(grads, dtype, headroom=1)
    at = lambda scale, grads=grads: jls.diagnostics.gradient_stats(grads, dtype, scale)
    assert float(at(advice.max_scale)["overflow_fraction"]) == 0
    if advice.max_scale < 2.0**127:  # else the largest float32 power of two
      assert float(at(2 * advice.max_scale)["overflow_fraction"]) > 0
    if advice.min_scale > 2.0**-126:
      assert float(at(advice.min_scale)["underflow_fraction"]) == 0
      if dtype != jnp.bfloat16:  # whose subnormals (float32's) XLA flushes: kept above them
        assert float(at(advice.min_scale / 2)["underflow_fraction"]) > 0


def test_advisor_when_the_range_is_empty_prefers_no_overflow():
  grads = {"g": jnp.array([2.0**-40, 1.0], jnp.float32)}
  advice = jls.diagnostics.recommend_loss_scale(grads)
  assert advice.min_scale > advice.max_scale
  assert advice.recommended == advice.max_scale == 2.0**15
  assert advice.overflow_fraction == 0 and advice.underflow_fraction == 0.5


def test_advisor_recommendation_is_a_valid_fixed_loss_scale():
  grads = {"g": jnp.array([1e4, 1.0], jnp.float32)}  # max_scale 4, 4 / headroom 8 < 1
  advice = jls.diagnostics.recommend_loss_scale(grads)
  assert advice.max_scale == 4.0 and advice.recommended == 1.0
  assert float(jls.FixedLossScale(advice.recommended)()) == 1.0


def test_advisor_for_bfloat16_recommends_finite_float32_powers_of_two():
  # With small gradients it used to recommend about 2e40, which is inf in float32.
  grads = {"g": jnp.array([2.0**-30, 2.0**-20, 1e-3], jnp.float32)}
  advice = jls.diagnostics.recommend_loss_scale(grads, jnp.bfloat16)
  for value in (advice.max_scale, advice.min_scale, advice.recommended):
    assert np.isfinite(np.float32(value)) and np.log2(value).is_integer()
  assert 1 <= advice.recommended <= advice.max_scale
  assert advice.overflow_fraction == 0 and advice.underflow_fraction == 0
  assert float(jls.FixedLossScale(advice.recommended)()) == advice.recommended


def test_advisor_when_even_unscaled_gradients_overflow_the_dtype():
  # It recommended 0.5 (its max_scale), which FixedLossScale and DynamicLossScale refuse:
  # advice is always a scale every loss scale accepts, with the overflow said.
  advice = jls.diagnostics.recommend_loss_scale({"g": jnp.array([1e5, 1.0], jnp.float32)})
  assert advice.max_scale == 0.5 and advice.recommended == 1.0
  assert advice.overflow_fraction == 0.5
  for loss_scale in (jls.FixedLossScale, jls.DynamicLossScale):
    assert float(loss_scale(advice.recommended)()) == 1.0


def test_advisor_for_float64_needs_no_scale():
  # It recommended 0.5: finfo(float64).max / max_abs overflowed to inf.
  advice = jls.diagnostics.recommend_loss_scale({"g": jnp.array([1e-3, 1.0])}, jnp.float64)
  assert advice.recommended == 1.0 and advice.max_scale == 2.0**127


@pytest.mark.parametrize("name, dtype", [("f16", jnp.float16), ("bf16", jnp.bfloat16),
                                         ("half", jnp.float16), ("float16", jnp.float16)])
def test_dtype_names_of_the_policy_grammar_mean_the_same_everywhere(name, dtype):
  # "f16" is float128 to NumPy: gradient_stats reported 0% underflow where float16 loses
  # 50%, and recommend_loss_scale recommended 0.5.
  grads = {"g": jnp.array([2.0**-30, 1.0], jnp.float32)}
  chex.assert_trees_all_equal(jls.diagnostics.gradient_stats(grads, name),
                              jls.diagnostics.gradient_stats(grads, dtype))
  assert (jls.diagnostics.recommend_loss_scale(grads, name)
          == jls.diagnostics.recommend_loss_scale(grads, dtype))


@pytest.mark.parametrize("dtype", ["f8", "e", None, jnp.int8, "float"])
def test_a_dtype_that_is_not_a_floating_dtype_or_a_policy_name_is_refused(dtype):
  with pytest.raises(ValueError, match="`dtype`"):
    jls.diagnostics.gradient_stats({"g": jnp.ones(2)}, dtype)


@pytest.mark.parametrize("headroom", [0.5, -1, float("nan")])
def test_advisor_rejects_bad_headroom(headroom):
  with pytest.raises(ValueError, match="headroom"):
    jls.diagnostics.recommend_loss_scale({"g": jnp.ones(2)}, headroom=headroom)


def test_advisor_needs_some_signal():
  with pytest.raises(ValueError, match="no finite non-zero value"):
    jls.diagnostics.recommend_loss_scale({"g": jnp.zeros(3)})


def test_probe_read_outs_keep_the_forward_order():
  # `jax.device_get` of a dict sorts its keys: "zeta" came before "alpha".
  def loss_fn(x):
    return jnp.sum(jls.diagnostics.probe(jls.diagnostics.probe(x, "zeta") * 2, "alpha"))

  state = jls.loss_scaling(optax.sgd(0.1)).init({})
  _, _, probes = jls.scaled_value_and_grad(loss_fn, probes=True)(state, jnp.ones(3))
  assert list(jls.diagnostics.summarize(probes)) == ["zeta", "alpha"]
  assert [name for name, _ in jls.diagnostics.layers(probes)] == ["zeta", "alpha"]
  lines = jls.diagnostics.table(probes).splitlines()[2:]
  assert [line.split()[0] for line in lines] == ["zeta", "alpha"]


def test_a_probe_no_gradient_reached_is_marked_not_measured_not_finite():
  # A target network's output, used only through stop_gradient, gets no backward pass:
  # its probe saw nothing, even forward, so the table must not pass it as finite.
  def loss_fn(x):
    target = jls.diagnostics.probe(jnp.log(x - 2.0), "target")  # NaN forward
    online = jls.diagnostics.probe(x * 3.0, "online")
    return jnp.sum(online) + jnp.nan_to_num(jnp.sum(jax.lax.stop_gradient(target)))

  state = jls.loss_scaling(optax.sgd(0.1)).init({})
  _, _, probes = jls.scaled_value_and_grad(loss_fn, probes=True)(state, jnp.ones(3))
  assert int(probes["target"].hits) == 0 and int(probes["online"].hits) == 1
  target, online = jls.diagnostics.table(probes).splitlines()[2:]
  assert target.split()[0] == "target" and "not measured" in target
  assert "not measured" not in online


def test_a_probe_of_an_empty_activation_measures_fractions_of_zero():
  def loss_fn(x):
    return jnp.sum(jls.diagnostics.probe(x[:0] * 2.0, "empty")) + jnp.sum(x)

  state = jls.loss_scaling(optax.sgd(0.1)).init({})
  _, _, probes = jls.scaled_value_and_grad(loss_fn, probes=True)(state, jnp.ones(3))
  summary = probes["empty"]
  assert int(summary.hits) == 1
  assert float(summary.forward.zero_fraction) == float(summary.backward.zero_fraction) == 0.0


@pytest.mark.parametrize("read_out", ["summarize", "headroom", "table", "layers",
                                      "backward_overflow_origin", "forward_nonfinite_origin"])
def test_probe_read_outs_given_gradients_are_refused_naming_probes(read_out):
  with pytest.raises(TypeError, match=r"`probes`.*probes=True.*\bdict\b"):
    getattr(jls.diagnostics, read_out)({"w": jnp.ones(3)})
