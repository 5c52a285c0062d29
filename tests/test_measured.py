"""Specification of `MeasuredLossScale`: the scale set from what the backward pass measured."""

import json

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import benchmark_script

import jax_lossscale as jls
from jax_lossscale import tensorflow as jls_tf

MAX16 = 65504.0


def scales(loss_scale, maxima):
  """The scale after each step whose largest unscaled gradient is given (None: an
  overflow); the backward pass sees it times the scale."""
  out = []
  for maximum in maxima:
    seen = 0.0 if maximum is None else maximum * float(loss_scale())
    loss_scale = loss_scale.adjust(jnp.array(maximum is not None), jnp.float32(seen))
    out.append(float(loss_scale()))
  return out, loss_scale


def test_the_scale_is_the_largest_power_of_two_that_keeps_the_maximum_below_float16_max():
  # An unscaled maximum of 3e-3: the largest p with p * 3e-3 <= 65504 is 2**24.
  got, _ = scales(jls.MeasuredLossScale(2.0**10, margin=0, max_loss_scale=2.0**30), [3e-3])
  assert got == [2.0**24] and 2.0**24 * 3e-3 <= MAX16 < 2.0**25 * 3e-3


def test_margin_keeps_that_many_doublings_of_headroom():
  free, _ = scales(jls.MeasuredLossScale(1.0, margin=0), [1.0])
  kept, _ = scales(jls.MeasuredLossScale(1.0, margin=2), [1.0])
  assert kept[0] == free[0] / 4 == 2.0**13


def test_the_largest_maximum_of_the_history_rules():
  # A spike of 8 keeps the scale down for `history` steps, then it is forgotten.
  got, _ = scales(jls.MeasuredLossScale(1.0, margin=0, history=3), [1.0, 8.0, 1.0, 1.0, 1.0])
  assert got == [2.0**15, 2.0**12, 2.0**12, 2.0**12, 2.0**15]


def test_by_default_a_spike_is_remembered_for_16_steps():
  got, _ = scales(jls.MeasuredLossScale(1.0, margin=0), [8.0] + [1.0] * 16)
  assert got[:16] == [2.0**12] * 16 and got[16] == 2.0**15


def test_an_overflow_drops_the_scale_below_what_it_implies_at_once():
  # An overflow at scale s means an unscaled maximum above 65504 / s: half the scale.
  got, _ = scales(jls.MeasuredLossScale(2.0**10, margin=0, history=4), [None, None, 1e-4])
  assert got == [2.0**9, 2.0**8, 2.0**8]
  got, _ = scales(jls.MeasuredLossScale(2.0**10, history=4, margin=1), [None])
  assert got == [2.0**8]


def test_an_overflow_in_a_probed_activation_gradient_backs_off_like_one_in_the_parameters():
  # The probe's gradient (w times the scale) overflows float16; the parameter gradient
  # (x times the scale) stays finite, so the step applies, and the scale must still halve.
  def loss_fn(w, x):
    h = jls.diagnostics.probe(x.astype(jnp.float16), "input")
    return jnp.sum((h * w.astype(jnp.float16)).astype(jnp.float32))

  w, x = jnp.full(4, 100.0), jnp.ones(4)
  tx = jls.loss_scaling(optax.sgd(1e-3), jls.MeasuredLossScale(2.0**10, margin=0, history=2))
  state = tx.init(w)
  grad_fn = jls.scaled_value_and_grad(loss_fn, probes=True)
  loss, grads, probes = grad_fn(state, w, x)  # 100 * 1024 overflows
  assert not bool(probes["input"].backward.finite) and jls.all_finite(grads)
  w, state = tx.apply_gradients(grads, state, w, loss=loss, probes=probes)
  assert float(state.loss_scale()) == 2.0**9
  assert bool(jnp.isfinite(state.loss_scale.maxima).all())
  loss, grads, probes = grad_fn(state, w, x)  # 100 * 512 fits: the scale stays there
  assert bool(probes["input"].backward.finite)
  w, state = tx.apply_gradients(grads, state, w, loss=loss, probes=probes)
  assert float(state.loss_scale()) == 2.0**9


def test_a_probe_hit_several_times_costs_one_doubling_of_margin_at_most():
  # Under a vmap inside the loss the probe keeps its maximum's binade, taken at its top.
  def loss_fn(w, x, batched):
    f = lambda x: jls.diagnostics.probe((x * w).astype(jnp.float16), "h").astype(
        jnp.float32) * 1.5
    return jnp.sum(jax.vmap(f)(x) if batched else f(x))

  w, x = jnp.ones(2), jnp.full((4, 2), 1e-3)
  scales = []
  for batched in (False, True):
    tx = jls.loss_scaling(optax.sgd(0.0), jls.MeasuredLossScale(margin=0))
    state = tx.init(w)
    loss, grads, probes = jls.scaled_value_and_grad(loss_fn, probes=True)(state, w, x, batched)
    scales.append(float(tx.apply_gradients(grads, state, w, loss=loss, probes=probes)[1]
                        .loss_scale()))
  assert scales == [2.0**15, 2.0**14]  # 1.5 * 2**15 fits below 65504; 2 * 2**15 would not


def test_zero_gradients_take_the_scale_to_its_cap_and_the_floor_holds():
  got, _ = scales(jls.MeasuredLossScale(4.0, max_loss_scale=2.0**20), [0.0])
  assert got == [2.0**20]
  got, _ = scales(jls.MeasuredLossScale(4.0, min_loss_scale=2.0, history=1), [MAX16, None])
  assert got == [2.0, 2.0]


def test_config_round_trips_and_state_survives_jit():
  loss_scale = jls.MeasuredLossScale(2.0**8, margin=1, history=5, dtype="f16")
  assert loss_scale.dtype == "float16"
  again = jls_tf.deserialize(json.loads(json.dumps(jls_tf.serialize(loss_scale))))
  assert again == loss_scale
  jitted = jax.jit(lambda ls: ls.adjust(jnp.array(True), jnp.float32(1.0)))(loss_scale)
  assert jitted.maxima.shape == (5,) and jitted.history == 5


@pytest.mark.parametrize("kwargs, name", [
    (dict(margin=-1), "margin"), (dict(history=0), "history"), (dict(dtype="f8"), "dtype"),
    (dict(initial_loss_scale=2.0**30), "initial_loss_scale"),
    (dict(min_loss_scale=0), "min_loss_scale")])
def test_bad_arguments_are_refused_naming_them(kwargs, name):
  with pytest.raises(ValueError, match=f"`{name}`"):
    jls.MeasuredLossScale(**kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_dtype_with_float32s_range_is_refused(dtype):
  # Its limit times two overflowed float32: one overflow pinned the scale at its floor.
  with pytest.raises(ValueError, match=rf"`dtype`.*'{dtype}'"):
    jls.MeasuredLossScale(dtype=dtype)
  assert jls.MeasuredLossScale(dtype="float8_e5m2").dtype == "float8_e5m2"


def test_inside_loss_scaling_the_parameter_gradients_are_measured_without_probes():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.MeasuredLossScale(2.0**4, margin=0, history=2))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  _, state = jax.jit(tx.update)({"w": jnp.array([2.0**4 * 3, 1.0])}, state, params)
  assert float(state.loss_scale()) == 2.0 ** np.floor(np.log2(MAX16 / 3))


def test_update_measures_the_unscaled_gradients_it_is_given_as_a_step_does():
  # `LossScale.update` takes unscaled gradients: a largest magnitude of 100 allows 2**9.
  grads = {"w": jnp.full((4,), 100.0), "b": jnp.array([-3.0], jnp.float16)}
  new, should_apply = jax.jit(jls.MeasuredLossScale(2.0**4, margin=0).update)(grads)
  assert float(new()) == 2.0**9 == 2.0 ** np.floor(np.log2(MAX16 / 100)) and bool(should_apply)
  assert float(new.maxima[0]) == 100.0
  tx = jls.loss_scaling(optax.sgd(0.0), jls.MeasuredLossScale(2.0**4, margin=0))
  _, state = tx.update(jax.tree.map(lambda g: g * 2.0**4, grads), tx.init(grads))
  assert float(state.loss_scale()) == float(new())
  overflowed, should_apply = jls.MeasuredLossScale(2.0**4, margin=0).update(
      {"w": jnp.array([jnp.nan])})
  assert float(overflowed()) == 2.0**3 and not bool(should_apply)


def test_probes_measured_inside_the_backward_pass_set_the_scale():
  # The activation gradient, 1000 times the parameter gradient here, bounds the scale.
  def loss_fn(params, x):
    h = jls.diagnostics.probe(x * 1e-3, "small")
    return jnp.sum(params["w"] * h) * 1e3

  tx = jls.loss_scaling(optax.sgd(0.1), jls.MeasuredLossScale(1.0, margin=0, history=1))
  params, x = {"w": jnp.ones(4)}, jnp.ones(4)
  state = tx.init(params)
  loss, grads, probes = jls.scaled_value_and_grad(loss_fn, probes=True)(state, params, x)
  _, with_probes = tx.update(grads, state, params, loss=loss, probes=probes)
  _, without = tx.update(grads, state, params, loss=loss)
  assert float(with_probes.loss_scale()) == 2.0**6  # 64 * 1000 <= 65504
  assert float(without.loss_scale()) == 2.0**15  # parameter gradients of 1
  assert float(with_probes.loss_scale()) < float(without.loss_scale())


def test_a_gradient_nothing_measures_costs_skipped_steps_that_grow_with_the_log_of_the_run():
  # The measurements allow 2**15, but something unmeasured overflows from 2**14 up (an
  # intermediate inside a layer). The scale that overflowed becomes a ceiling, held for
  # `history` steps, then tried again: each overflow there doubles how long the next is
  # held. DynamicLossScale would skip once every growth period.
  def run(overflows_until):
    loss_scale, skipped = jls.MeasuredLossScale(2.0**15, margin=0, history=4), []
    for step in range(200):
      overflow = float(loss_scale()) >= 2.0**14 and step < overflows_until
      skipped += [step] if overflow else []
      seen = 0.0 if overflow else float(loss_scale())  # an unscaled maximum of 1
      loss_scale = loss_scale.adjust(jnp.array(not overflow), jnp.float32(seen))
    return skipped, float(loss_scale())

  assert run(200) == ([0, 1, 6, 15, 32, 65, 130], 2.0**13)
  assert run(100) == ([0, 1, 6, 15, 32, 65], 2.0**15)  # gone: the measured scale again


def test_under_multisteps_every_micro_batch_is_measured():
  # Two micro-batches per optimizer step, unscaled maxima 4 then 0.25: the scale must
  # respect the 4 (2**13 * 4 fits below 65504), not only the last micro-batch's 0.25.
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 2),
                        jls.MeasuredLossScale(2.0**4, margin=0))
  params = {"w": jnp.ones(2)}
  state = tx.init(params)
  for maximum in (4.0, 0.25):
    grads = {"w": jnp.array([maximum, 0.0]) * state.loss_scale()}
    _, state = jax.jit(tx.update)(grads, state, params)
  assert float(state.loss_scale()) == 2.0**13 and bool(state.last_applied)


def test_nans_no_scale_avoids_do_not_drive_the_scale_down():
  # A NaN gradient every 6 steps whatever the scale (a rare bad example, with a finite
  # loss): each skips its step and halves the scale for `history` steps, as any overflow
  # does, but does not lower the ceiling (nor lengthen its wait); once they stop, the
  # scale is back within `history` steps.
  loss_scale, scales = jls.MeasuredLossScale(2.0**15, margin=0, history=4), []
  for step in range(150):
    nan = step % 6 == 5 and step < 120
    seen = 0.0 if nan else float(loss_scale())  # an unscaled maximum of 1: 2**15 fits
    loss_scale = loss_scale.adjust(jnp.array(not nan), jnp.float32(seen))
    scales.append(float(loss_scale()))
  assert min(scales) == 2.0**14 and scales[120 + 4:] == [2.0**15] * (150 - 124)


def test_with_the_defaults_a_nan_drops_the_scale_one_plus_margin_doublings_for_history_steps():
  # The overflow's record (twice float16's largest over the scale) and the margin of 2:
  # 8 times lower for 16 steps, then back. NaNs closer together than 16 steps lower it at
  # each one, down to the floor (docs/backward-pass.md says so).
  loss_scale = jls.MeasuredLossScale(2.0**10)
  for _ in range(20):  # an unscaled maximum of 1: 2**13 keeps 2 doublings of margin
    loss_scale = loss_scale.adjust(jnp.array(True), jnp.float32(loss_scale()))
  assert float(loss_scale()) == 2.0**13
  loss_scale = loss_scale.adjust(jnp.array(False), jnp.float32(jnp.nan))
  scales = []
  for _ in range(40):
    loss_scale = loss_scale.adjust(jnp.array(True), jnp.float32(loss_scale()))
    scales.append(float(loss_scale()))
  assert scales == [2.0**10] * 15 + [2.0**13] * 25
  for step in range(120):
    nan = step % 6 == 5
    seen = float("nan") if nan else float(loss_scale())
    loss_scale = loss_scale.adjust(jnp.array(not nan), jnp.float32(seen))
  assert float(loss_scale()) == 1.0


def test_an_overflow_at_a_tiny_scale_keeps_the_history_finite_so_it_restores():
  # Below about 4e-34 the overflow's record, twice float16's maximum over the scale, was
  # inf, and a flax checkpoint of the state was refused as not finite.
  from flax import serialization

  import jax_lossscale.flax  # noqa: F401 (registers the loss scales)

  scale = jls.MeasuredLossScale(initial_loss_scale=2.0**-120, min_loss_scale=2.0**-126,
                                max_loss_scale=2.0**-100)
  after, _ = scale.update({"g": jnp.array([jnp.inf])})
  assert np.isfinite(np.asarray(after.maxima)).all()
  restored = serialization.from_bytes(scale, serialization.to_bytes(after))
  chex.assert_trees_all_equal(restored, after)


def skipped_steps_with_an_unmeasured_overflow(loss_scale, steps=3000):
  """The steps skipped when the measurements allow 2**15 (an unscaled maximum of 1) but
  something unmeasured (inside a layer, between probes) overflows from 2**10 up."""
  def step(loss_scale, _):
    overflow = loss_scale() >= 2.0**10
    seen = jnp.where(overflow, 0.0, loss_scale())
    return loss_scale.adjust(~overflow, seen), overflow

  _, overflows = jax.lax.scan(step, loss_scale, None, length=steps)
  return np.flatnonzero(np.asarray(overflows)).tolist()


@pytest.mark.parametrize("margin, history", [(1, 16), (2, 16), (1, 4)])
def test_with_a_margin_an_unmeasured_overflow_costs_no_more_steps_than_without(margin, history):
  # A margin drops the scale two or more doublings at an overflow; the scale then climbs
  # back to the doubling below the ceiling only once the overflow leaves the history. An
  # overflow there, at a scale not yet run finite under the ceiling, lowers the ceiling:
  # taken for a NaN that no scale avoids, it would leave the ceiling a doubling too high
  # and skip a step every history + 1 steps (benchmarks/RESULTS.md).
  with_margin = skipped_steps_with_an_unmeasured_overflow(
      jls.MeasuredLossScale(margin=margin, history=history))
  without = skipped_steps_with_an_unmeasured_overflow(
      jls.MeasuredLossScale(margin=0, history=history))
  assert len(with_margin) <= len(without) <= 22


def test_with_a_margin_the_skipped_steps_grow_with_the_log_of_the_run():
  # Each overflow at the ceiling doubles the wait before the next try.
  assert skipped_steps_with_an_unmeasured_overflow(jls.MeasuredLossScale(margin=1)) == [
      0, 1, 2, 19, 36, 69, 134, 263, 520, 1033, 2058]


def skipped_on_noisy_gradients(loss_scale, seed):
  """The steps `loss_scaling` skips in 3,000 steps of `benchmarks/margins.py`'s noisy
  gradients (log-normal maxima, sigma 1): the noise of real gradient maxima, which no
  history of maxima foresees."""
  skipped, _ = benchmark_script("margins").noisy_gradients(loss_scale, seed, 3000, 1.0)
  return skipped


def test_by_default_noisy_gradients_skip_no_more_steps_than_under_the_dynamic_scale():
  # With margin 0 the next step's maximum beats the last 16 steps' by more than the
  # rounding to a power of two once every 30 to 40 steps: about 90 of 3,000 skipped,
  # against 5 for DynamicLossScale (its initial descent, then one every growth period).
  # Four runs of 3,000 steps, summed (one run's count varies by a few).
  measured = [skipped_on_noisy_gradients(jls.MeasuredLossScale(), seed) for seed in range(4)]
  dynamic = [skipped_on_noisy_gradients(jls.DynamicLossScale(), seed) for seed in range(4)]
  assert sum(measured) <= sum(dynamic), (measured, dynamic)
