"""Specification of `loss_scaling(..., rounding=, state_dtype=)`: parameters and optimizer
state narrower than float32, written to nearest, stochastically or with compensation."""

import collections
import re
import warnings
from typing import Any

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from helpers import force_branch

import jax_lossscale as jls
from jax_lossscale import _jax_internals
from jax_lossscale import _rounding

ROUNDINGS = ("nearest", "stochastic", "compensated")


def sgd_step(rounding, params, update, steps=1):
  """`params` after `steps` steps of `params + update` (SGD at 1 on the gradient -update)."""
  tx = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding=rounding)
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  grads = jax.tree.map(lambda u: -u, update)
  for _ in range(steps):
    params, state = step(grads, state, params)
  return params, state


# --- arguments -----------------------------------------------------------------------------


def test_an_unknown_rounding_is_refused_naming_the_argument_and_the_value():
  with pytest.raises(ValueError, match=r"`rounding`.*'up'"):
    jls.loss_scaling(optax.adam(1e-3), rounding="up")


@pytest.mark.parametrize("state_dtype, shown", [(jnp.int32, "int32"), ("bits", "'bits'"),
                                                (jnp.bool_, "bool")])
def test_a_state_dtype_that_is_not_floating_is_refused(state_dtype, shown):
  with pytest.raises(ValueError, match=rf"`state_dtype`.*got {shown}"):
    jls.loss_scaling(optax.adam(1e-3), state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype", ["f8", float, "float"])
def test_a_state_dtype_numpy_would_read_as_float64_is_refused(state_dtype):
  # NumPy reads "f8" and Python's float as float64, which x64 off makes float32: nothing
  # would be narrowed, silently.
  with pytest.raises(ValueError, match=r"`state_dtype` must be a floating dtype"):
    jls.loss_scaling(optax.adam(1e-3), state_dtype=state_dtype)


@pytest.mark.parametrize("state_dtype", [jnp.float64, "float64", "f64"])
def test_a_float64_state_dtype_is_refused_while_x64_is_off(state_dtype):
  # JAX would keep the state in float32, silently.
  with pytest.raises(ValueError, match=r"`state_dtype`.*float64.*jax_enable_x64"):
    jls.loss_scaling(optax.adam(1e-3), state_dtype=state_dtype)


def test_a_state_dtype_is_read_as_every_dtype_argument_is():
  # "bf16" as autocast reads it; "f16" is float16 (refused for its range), not NumPy's
  # float128.
  params = {"w": jnp.ones(4)}
  state = jls.loss_scaling(optax.adam(1e-3), state_dtype="bf16").init(params)
  assert state.inner_state[0].mu["w"].dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"`state_dtype`.*jnp.bfloat16.*got float16"):
    jls.loss_scaling(optax.adam(1e-3), state_dtype="f16")


@pytest.mark.parametrize("state_dtype", [jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_a_state_dtype_without_float32s_range_is_refused(state_dtype):
  # Adam's nu squares the gradients: in float16 those below about 2.4e-4 are zero there.
  name = jnp.dtype(state_dtype).name
  with pytest.raises(ValueError, match=rf"`state_dtype`.*jnp.bfloat16.*got {name}"):
    jls.loss_scaling(optax.adam(1e-3), state_dtype=state_dtype)


# A 0-d parameter's moments were taken for scalars (hyperparameters) and written back in
# float16, where Adam's steps grew (-0.438 after 300 steps against float32's -0.300).
@pytest.mark.parametrize("shape", [(8,), ()], ids=["vector", "0-d"])
@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_float16_moments_that_a_rounding_would_write_are_refused_at_init(rounding, shape):
  params = {"w": jnp.ones(shape, jnp.float16), "b": jnp.ones(2)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding=rounding)
  with pytest.raises(ValueError, match=r"float16 state.*`state_dtype=jnp.bfloat16`"):
    tx.init(params)
  # In bfloat16 the moments train (a gradient of 1e-4 squared is 1e-8, zero in float16).
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=jnp.bfloat16)
  state = tx.init(params)
  _, state = jax.jit(tx.apply_gradients)(
      {"w": jnp.full(shape, 1e-4, jnp.float16), "b": jnp.ones(2)}, state, params)
  nu = state.inner_state[0].nu["w"]
  assert nu.dtype == jnp.bfloat16
  assert float(nu.ravel()[0]) == pytest.approx(1e-3 * 1e-8, rel=2**-7)
  # No state to write: float16 parameters under SGD are taken.
  jls.loss_scaling(optax.sgd(1e-3), jls.NoOpLossScale(), rounding=rounding).init(params)


def test_state_dtype_keeps_a_0d_parameters_moments_in_it_and_other_scalars_as_they_were():
  # A 0-d parameter's moments are moments; an injected learning rate is not.
  params = {"t": jnp.ones([]), "w": jnp.ones(4)}
  inner = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  tx = jls.loss_scaling(inner, jls.NoOpLossScale(), state_dtype=jnp.bfloat16)
  state = tx.init(params)
  _, state = jax.jit(tx.apply_gradients)(jax.tree.map(jnp.ones_like, params), state, params)
  adam = state.inner_state.inner_state[0]
  assert adam.mu["t"].dtype == adam.nu["t"].dtype == adam.mu["w"].dtype == jnp.bfloat16
  assert state.inner_state.hyperparams["learning_rate"].dtype == jnp.float32


@pytest.mark.parametrize("name, inner, ratio", [
    ("mechanize", optax.contrib.mechanize(optax.adam(1e-2)), (10, 20)),
    ("prodigy", optax.contrib.prodigy(1.0), (0.99, 1.01))])
def test_state_dtype_rounds_an_optimizers_copy_of_its_starting_point(name, inner, ratio):
  # docs/bfloat16.md: mechanize's `x0`, rounded to bfloat16, is a point it does not start
  # from, and it barely trains (14.9 against 1.06, the least loss); prodigy trains as it
  # would without.
  ka, kb, kw = jax.random.split(jax.random.key(0), 3)
  a, b = jax.random.normal(ka, (64, 16)), jax.random.normal(kb, (64,))
  loss = lambda p: jnp.mean((a @ p["w"] - b) ** 2)

  def final_loss(state_dtype):
    tx = jls.loss_scaling(inner, jls.NoOpLossScale(), state_dtype=state_dtype)
    params = {"w": jax.random.normal(kw, (16,))}
    step = jax.jit(lambda p, s: tx.apply_gradients(jax.grad(loss)(p), s, p))
    state = tx.init(params)
    for _ in range(300):
      params, state = step(params, state)
    return float(loss(params))

  least = float(loss({"w": jnp.linalg.lstsq(a, b)[0]}))
  assert final_loss(None) == pytest.approx(least, rel=0.01), name
  low, high = ratio
  assert low < final_loss(jnp.bfloat16) / final_loss(None) < high, name


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_metrics_read_the_same_whatever_the_rounding_and_state_dtype(rounding, state_dtype):
  params = {"w": jnp.linspace(-1, 1, 8).astype(jnp.bfloat16), "b": jnp.zeros(2)}
  poisoned = {"w": jnp.full(8, jnp.inf, jnp.bfloat16), "b": jnp.ones(2)}

  def logged(**options):
    tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**15, increment_period=2),
                          grad_norm=True, **options)
    p, state = params, tx.init(params)
    for grads in (jax.tree.map(jnp.ones_like, params), poisoned,
                  jax.tree.map(jnp.ones_like, params)):
      p, state = jax.jit(tx.apply_gradients)(grads, state, p)
    return jax.device_get(jls.metrics(state))

  chex.assert_trees_all_equal(logged(rounding=rounding, state_dtype=state_dtype), logged())


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_float16_scalars_of_a_state_wrapped_without_its_parameters_are_refused(rounding):
  # wrap_state(inner_state), as a restore does, cannot tell a 0-d parameter's moments:
  # a float16 scalar is refused as a float16 moment would be.
  params = {"t": jnp.zeros([], jnp.float16), "w": jnp.zeros(3)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding=rounding)
  with pytest.raises(ValueError, match=r"float16 state.*`state_dtype=jnp.bfloat16`"):
    tx.wrap_state(optax.adam(1e-3).init(params), params if rounding == "compensated" else None)


def test_an_optimizers_own_scalars_keep_their_dtype_beside_a_parameter_of_their_name():
  # A parameter field named `scale` is not reduce_on_plateau's `scale`, though both are
  # reached by the attribute `scale`.
  params = collections.namedtuple("Params", "w scale")(jnp.ones(4), jnp.ones([]))
  inner = optax.chain(optax.adam(1e-2), optax.contrib.reduce_on_plateau())
  tx = jls.loss_scaling(inner, jls.NoOpLossScale(), state_dtype=jnp.bfloat16)
  state = tx.init(params)
  assert state.inner_state[0][0].mu.scale.dtype == jnp.bfloat16
  assert state.inner_state[1].scale.dtype == jnp.float32


def test_an_optimizers_own_float16_scalars_keep_their_dtype_when_init_has_the_parameters():
  # Schedule-free's b1 is a hyperparameter: in bfloat16, 0.8984 instead of float16's 0.8999.
  params = {"w": jnp.ones(4, jnp.float16), "t": jnp.ones([], jnp.float16)}
  tx = jls.loss_scaling(optax.contrib.schedule_free_adamw(1e-2), jls.NoOpLossScale(),
                        state_dtype=jnp.bfloat16)
  state = tx.init(params).inner_state
  assert state.b1.dtype == state.weight_sum.dtype == jnp.float16
  assert state.base_optimizer_state[0].nu["t"].dtype == jnp.bfloat16


def test_every_scalar_of_the_state_keeps_the_dtype_init_gave_it():
  # init widened a 0-d parameter's bfloat16 moment to state_dtype=float32; optax's
  # mu_dtype made it bfloat16 again at the step, and the next step traced anew.
  inner = optax.adam(1e-2, mu_dtype=jnp.bfloat16)
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(8.0), state_dtype=jnp.float32)
  params = {"t": jnp.ones([], jnp.bfloat16), "w": jnp.ones(4, jnp.bfloat16)}
  state = tx.init(params)
  dtypes = jax.tree.map(lambda x: x.dtype, state)
  _, stepped = jax.jit(tx.apply_gradients)(jax.tree.map(jnp.ones_like, params), state, params)
  assert jax.tree.map(lambda x: x.dtype, stepped) == dtypes
  assert stepped.inner_state[0].mu["t"].dtype == jnp.float32


@pytest.mark.parametrize("name", ["masked", "multi_transform", "adafactor"])
def test_state_dtype_finds_a_0d_parameters_moments_where_other_places_differ(name):
  # Masked-out places hold no leaf and adafactor's factored ones other shapes: the
  # moments of "t" stayed float32 where a subtree had to have the parameters' shapes.
  params = {"w": jnp.ones((16, 16)), "t": jnp.ones([]), "b": jnp.ones(4)}
  inner = {
      "masked": optax.masked(optax.adam(1e-2), {"w": True, "t": True, "b": False}),
      "multi_transform": optax.multi_transform(
          {"a": optax.adam(1e-2), "s": optax.sgd(1e-2, momentum=0.9)},
          {"w": "a", "t": "a", "b": "s"}),
      "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=8),
  }[name]
  state = jls.loss_scaling(inner, jls.NoOpLossScale(), state_dtype=jnp.bfloat16).init(params)
  at_t = [x for path, x in jax.tree_util.tree_leaves_with_path(state.inner_state)
          if path[-1] == jax.tree_util.DictKey("t") and jnp.issubdtype(x.dtype, jnp.floating)]
  assert at_t and all(x.dtype == jnp.bfloat16 for x in at_t), at_t


def test_state_dtype_finds_a_0d_parameters_moments_given_a_whole_equinox_module():
  # init gives the inner optimizer the module's arrays; the moments were matched against
  # the whole module, whose activation and Python float are leaves too.
  class Model(eqx.Module):
    linear: eqx.nn.Linear
    temperature: jax.Array
    activation: Any
    scale: float

  model = Model(eqx.nn.Linear(3, 2, key=jax.random.key(0)), jnp.ones([]), jax.nn.relu, 2.0)
  state = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(),
                           state_dtype=jnp.bfloat16).init(model)
  assert state.inner_state[0].mu.temperature.dtype == jnp.bfloat16
  assert state.inner_state[0].nu.linear.weight.dtype == jnp.bfloat16


def test_state_dtype_keeps_complex_moments_whole():
  # They were cast to bfloat16, dropping the imaginary part (JAX only warned).
  params = {"z": jnp.ones(4, jnp.complex64), "w": jnp.ones(4)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(), state_dtype=jnp.bfloat16)
  state = tx.init(params)
  grads = {"z": jnp.full(4, 1j, jnp.complex64), "w": jnp.ones(4)}
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # JAX's "casting complex to real"
    _, state = jax.jit(tx.apply_gradients)(grads, state, params)
  adam = state.inner_state[0]
  assert adam.mu["z"].dtype == jnp.complex64 and adam.mu["w"].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(adam.mu["z"]), np.full(4, 0.1j), rtol=1e-6)


@pytest.mark.parametrize("rounding", ["stochastic", "compensated"])
def test_update_refuses_a_rounding_that_apply_updates_would_not_honour(rounding):
  # optax.apply_updates rounds to nearest: the rounding asked for would silently not happen.
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  tx = jls.loss_scaling(optax.sgd(0.1), rounding=rounding)
  with pytest.raises(ValueError, match=rf"rounding='{rounding}'.*`params\['w'\]`"):
    tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)
  with pytest.raises(ValueError, match=r"`params` is None"):
    tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params))


def test_update_with_float32_params_takes_any_rounding():
  params = {"w": jnp.ones(3)}
  tx = jls.loss_scaling(optax.sgd(0.1), jls.NoOpLossScale(), rounding="stochastic",
                        state_dtype=jnp.bfloat16)
  updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(params), params)
  assert updates["w"].tolist() == [float(np.float32(-0.1))] * 3


def test_a_state_of_another_rounding_is_refused_naming_restore_state():
  params = {"w": jnp.ones(3, jnp.bfloat16)}
  state = jls.loss_scaling(optax.sgd(0.1)).init(params)
  tx = jls.loss_scaling(optax.sgd(0.1), rounding="compensated")
  with pytest.raises(ValueError, match="another `rounding`.*restore_state"):
    tx.apply_gradients({"w": jnp.ones(3, jnp.bfloat16)}, state, params)


@pytest.mark.parametrize("made_from, applied_to, message", [
    (jnp.float32, jnp.bfloat16,
     r"`state.compensation\['w'\]` is None, but `params\['w'\]` \(bfloat16\[3\]\) needs a "
     r"bfloat16\[3\] buffer.*tx.init"),
    (jnp.bfloat16, jnp.float16,
     r"`state.compensation\['w'\]` is bfloat16\[3\], but `params\['w'\]` \(float16\[3\]\) "
     r"needs a float16\[3\] buffer"),
    (jnp.bfloat16, jnp.float32, r"`params\['w'\]` \(float32\[3\]\) has none"),
])
def test_a_compensated_state_made_from_other_parameters_is_refused(made_from, applied_to,
                                                                   message, maybe_jit):
  # Else a float32 model's state, its parameters then cast to bfloat16, would fail deep in
  # the write, and a bfloat16 buffer would keep a float16 parameter's residuals rounded.
  tx = jls.loss_scaling(optax.sgd(0.1), rounding="compensated")
  state = tx.init({"w": jnp.ones(3, made_from)})
  params = {"w": jnp.ones(3, applied_to)}
  step = maybe_jit(tx.apply_gradients)
  with pytest.raises(ValueError, match=message):
    step({"w": jnp.ones(3, applied_to)}, state, params)
  other = {"w": params["w"], "b": jnp.ones(2, applied_to)}
  with pytest.raises(ValueError, match=r"`state.compensation` does not match `params`"):
    step(jax.tree.map(jnp.ones_like, other), state, other)


# --- what each rounding writes ----------------------------------------------------------------


@pytest.mark.parametrize("dtype, update", [(jnp.bfloat16, 1e-3), (jnp.bfloat16, -1e-3),
                                           (jnp.float16, 3e-4), (jnp.float16, -3e-4),
                                           (jnp.float8_e5m2, 3e-2), (jnp.float8_e5m2, -3e-2),
                                           # no inf to round toward
                                           (jnp.float8_e4m3fn, 1e-2), (jnp.float8_e4m3fn, -1e-2)])
def test_stochastic_rounding_is_unbiased_over_entries(dtype, update):
  n = 16384
  params, _ = sgd_step("stochastic", {"w": jnp.ones(n, dtype)}, {"w": jnp.full(n, update)})
  written = np.asarray(params["w"], np.float64)
  exact = 1.0 + float(np.float32(update))
  neighbours = np.unique(written)
  assert len(neighbours) == 2  # each entry rounded up or down, nothing else
  gap = neighbours[1] - neighbours[0]
  p = (exact - neighbours[0]) / gap
  standard_error = gap * np.sqrt(p * (1 - p) / n)
  assert abs(written.mean() - exact) < 4 * standard_error, (written.mean(), exact)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_a_finite_sum_past_the_largest_value_is_never_rounded_to_inf_by_chance(dtype):
  # Between the largest finite value and inf there is no number to round up to: the
  # write rounds to nearest there, inf only where nearest gives inf. Rounded up by
  # chance, a quarter of the entries became inf and the step was skipped.
  largest = float(jnp.finfo(dtype).max)
  spacing = largest - float(jnp.nextafter(jnp.asarray(largest, dtype), jnp.zeros((), dtype)))
  params = {"w": jnp.full(4096, largest, dtype)}
  written, state = sgd_step("stochastic", params, {"w": jnp.full(4096, spacing / 4)})
  assert bool(state.last_applied)
  np.testing.assert_array_equal(np.asarray(written["w"], np.float32), largest)
  # At or past the half-way point, nearest gives inf: every entry, by no chance either.
  for past in (spacing / 2, 0.75 * spacing):
    exact = jnp.full(4096, largest + past, jnp.float32)
    out = _rounding.stochastic(exact, exact.astype(dtype), _rounding.seeds(
        jnp.uint32(0), 1, 1)[0])
    assert bool(jnp.all(jnp.isinf(out.astype(jnp.float32)))) == bool(
        jnp.isinf(exact.astype(dtype)[0])), (past, out)


def test_stochastic_rounding_accumulates_updates_that_nearest_rounds_away():
  update = {"w": jnp.full(4096, 1e-4)}  # an eightieth of bfloat16's spacing at 1.0
  nearest, _ = sgd_step("nearest", {"w": jnp.ones(4096, jnp.bfloat16)}, update, steps=100)
  stochastic, state = sgd_step("stochastic", {"w": jnp.ones(4096, jnp.bfloat16)}, update,
                               steps=100)
  assert np.all(np.asarray(nearest["w"], np.float32) == 1.0)
  mean = float(jnp.mean(stochastic["w"].astype(jnp.float32)))
  assert abs(mean - 1.01) < 1e-3, mean
  assert int(state.rounding_counter) == 100


def test_stochastic_rounding_draws_other_bits_at_each_step():
  params = {"w": jnp.ones(4096, jnp.bfloat16)}
  first, state = sgd_step("stochastic", params, {"w": jnp.full(4096, 2e-3)})
  tx = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding="stochastic")
  again, _ = tx.apply_gradients({"w": jnp.full(4096, -2e-3)}, state, params)  # from 1.0 again
  assert not np.array_equal(np.asarray(first["w"]), np.asarray(again["w"]))


def test_leaves_whose_seeds_differ_by_less_than_their_size_draw_independent_bits():
  # Seeds that differ by 962: had the seed been added to the position alone, the second
  # leaf's entry k would round as the first's entry k + 962, every time.
  n, exact = 4096, jnp.full(4096, 1.0 + 2**-9)  # a quarter of the way to the next value
  up = [np.asarray(_rounding.stochastic(exact, jnp.ones(n, jnp.bfloat16), jnp.uint32(seed)),
                   np.float32) > 1.0 for seed in (1000, 1000 + 962)]
  agree = np.mean(up[1][:n - 962] == up[0][962:])
  independent = 0.25**2 + 0.75**2
  standard_error = np.sqrt(independent * (1 - independent) / (n - 962))
  assert abs(agree - independent) < 4 * standard_error, agree


def test_compensated_writes_reach_the_bfloat16_nearest_the_exact_sum():
  update = {"w": jnp.full(4, 1e-4)}  # an eightieth of bfloat16's spacing at 1.0
  params, state = sgd_step("compensated", {"w": jnp.ones(4, jnp.bfloat16)}, update, steps=1000)
  exact = 1.0 + 1000 * np.float64(np.float32(1e-4))
  assert params["w"].dtype == jnp.bfloat16 and state.compensation["w"].dtype == jnp.bfloat16
  assert np.all(np.asarray(params["w"], np.float64) == float(jnp.bfloat16(exact)))  # 1.1016


def test_the_compensated_sum_follows_the_exact_sum_of_random_updates():
  steps, n = 1000, 1024
  updates = jax.random.uniform(jax.random.key(0), (steps, n), maxval=2e-4)
  tx = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding="compensated")

  @jax.jit
  def run(params):
    step = lambda carry, u: (tx.apply_gradients({"w": -u}, *carry[::-1]), None)
    return jax.lax.scan(step, (params, tx.init(params)), updates)[0]

  params, state = run({"w": jnp.ones(n, jnp.bfloat16)})
  exact = 1.0 + np.asarray(updates, np.float64).sum(axis=0)  # about 1.1
  compensated = np.asarray(params["w"], np.float64) + np.asarray(state.compensation["w"],
                                                                 np.float64)
  # An eighth of bfloat16's spacing there (the buffer's own rounding, 8 bits, random walks).
  np.testing.assert_allclose(compensated, exact, rtol=0, atol=2**-10)
  np.testing.assert_allclose(np.asarray(params["w"], np.float64), exact, rtol=0,
                             atol=2**-8 + 2**-10)  # within half a spacing, and that


def test_float32_parameters_are_written_alike_by_every_rounding():
  params, grads = {"w": jnp.linspace(-1.0, 1.0, 64)}, {"w": jnp.linspace(0.0, 1e-3, 64)}
  written = [sgd_step(r, params, grads)[0] for r in ROUNDINGS]
  for other in written[1:]:
    chex.assert_trees_all_equal(other, written[0])
  assert sgd_step("compensated", params, grads)[1].compensation == {"w": None}


def test_state_dtype_keeps_the_moments_in_it_and_integer_counts_as_they_were():
  params = {"w": jnp.ones(8)}
  tx = jls.loss_scaling(optax.adam(1e-3), state_dtype=jnp.bfloat16)
  state = tx.init(params)
  _, state = tx.apply_gradients({"w": jnp.ones(8)}, state, params)
  adam = state.inner_state[0]
  assert adam.mu["w"].dtype == adam.nu["w"].dtype == jnp.bfloat16
  assert adam.count.dtype == jnp.int32 and int(adam.count) == 1


def test_state_dtype_halves_the_bytes_of_adams_state():
  params = {"w": jnp.ones((256, 256))}
  nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
  full = jls.loss_scaling(optax.adam(1e-3)).init(params).inner_state
  half = jls.loss_scaling(optax.adam(1e-3), state_dtype=jnp.bfloat16).init(params).inner_state
  assert nbytes(half) - 4 == (nbytes(full) - 4) // 2  # the int32 count unchanged


def adams_second_moment(dtype, steps=2200, **options):
  """Adam's mean `nu` after a gradient of 1 for 200 steps, then 0.01: it must decay."""
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), **options)
  params = {"w": jnp.ones(256, dtype)}

  def step(carry, t):
    params, state = carry
    grads = {"w": jnp.full(256, jnp.where(t < 200, 1.0, 0.01), dtype)}
    return tx.apply_gradients(grads, state, params), None

  (_, state), _ = jax.lax.scan(step, (params, tx.init(params)), jnp.arange(steps))
  return float(jnp.mean(state.inner_state[0].nu["w"].astype(jnp.float32)))


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_a_line_search_storing_its_gradient_trains_bfloat16_parameters(rounding, state_dtype):
  # optax's line search computes its new gradient at `params + updates`, beside zeros like
  # the parameters, in one `lax.cond`: where the step widens the gradients and the state
  # to float32, it widens the parameters and `grad=` too.
  target = jnp.linspace(-1.0, 1.0, 16)

  def value_fn(params):
    return jnp.sum((params["w"].astype(jnp.float32) - target) ** 2)

  inner = optax.chain(optax.sgd(0.3), optax.scale_by_backtracking_linesearch(
      max_backtracking_steps=8, store_grad=True))
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**10), rounding=rounding,
                        state_dtype=state_dtype)

  @jax.jit
  def step(params, state):
    value, grad = jax.value_and_grad(lambda p: state.loss_scale.scale(value_fn(p)))(params)
    return tx.apply_gradients(grad, state, params, value=state.loss_scale.unscale(value),
                              grad=grad, value_fn=value_fn)

  params = {"w": jnp.zeros(16, jnp.bfloat16)}
  state = tx.init(params)
  for _ in range(3):
    params, state = step(params, state)
  assert params["w"].dtype == jnp.bfloat16
  assert state.inner_state[1].grad["w"].dtype == jnp.bfloat16  # kept as the parameters are
  assert float(value_fn(params)) < 1e-2 * float(value_fn({"w": jnp.zeros(16)}))


@pytest.mark.parametrize("dtype, options", [
    (jnp.float32, {"state_dtype": jnp.bfloat16}),
    (jnp.bfloat16, {"rounding": "compensated"}),
    (jnp.bfloat16, {"rounding": "stochastic"}),
    (jnp.bfloat16, {"rounding": "compensated", "state_dtype": jnp.bfloat16}),
])
def test_a_moment_kept_in_bfloat16_decays_as_in_float32(dtype, options):
  # 0.001 * nu is below half a bfloat16 spacing: written to nearest, nu would stay 8x too
  # large (0.195 against 0.0246) and Adam's steps 2.8x too small.
  exact = adams_second_moment(jnp.float32)
  assert adams_second_moment(dtype, **options) == pytest.approx(exact, rel=0.05)


def test_the_moments_of_a_scalar_parameter_are_computed_in_float32():
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding="stochastic")
  params = {"t": jnp.ones([], jnp.bfloat16), "w": jnp.ones(64, jnp.bfloat16)}
  state = tx.init(params)
  step = jax.jit(tx.apply_gradients)
  for _ in range(2000):
    params, state = step(jax.tree.map(jnp.ones_like, params), state, params)
  exact = 1 - 0.999**2000  # 0.8648: in bfloat16, 0.999 is 1.0 and nu stays at 0.5
  assert float(state.inner_state[0].nu["t"]) == pytest.approx(exact, rel=0.03)


def test_a_bfloat16_gradient_enters_the_moments_in_float32():
  # optax would take (1 - b1) * g and g * g in the gradient's dtype: 0.1 * 0.30078125 is
  # 0.030078125, and in bfloat16 0.030029296875 (1.6e-3 off).
  tx = jls.loss_scaling(optax.scale_by_adam(), jls.NoOpLossScale(), state_dtype=jnp.float32)
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  grads = {"w": jnp.full(8, 0.3, jnp.bfloat16)}
  _, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  g = np.float32(grads["w"][0])
  adam = state.inner_state  # scale_by_adam's own state, not a chain's
  np.testing.assert_allclose(adam.mu["w"], np.float32(0.1) * g, rtol=1e-6)
  np.testing.assert_allclose(adam.nu["w"], np.float32(0.001) * (g * g), rtol=1e-6)


def test_rounding_to_the_nearest_bfloat16_by_integers_matches_the_convert_bit_for_bit():
  bits = np.random.default_rng(0).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
  special = [0, 0x80000000, 0x00000001, 0x00007FFF, 0x00008000, 0x00018000,  # subnormal ties
             0x3F808000, 0x3F818000, 0x3F807FFF,  # ties to even, down and up; below a tie
             0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # to the largest bfloat16, to inf
             0x7F800000, 0xFF800000, 0x7F800001, 0x7FC00000, 0xFFFFFFFF]  # inf and NaNs
  exact = jax.lax.bitcast_convert_type(jnp.asarray(np.append(bits, special), jnp.uint32),
                                       jnp.float32)
  rounded, wide = jax.jit(_rounding.to_nearest, static_argnums=1)(exact, jnp.bfloat16)
  converted = exact.astype(jnp.bfloat16)
  nan = np.isnan(np.asarray(exact))
  as_bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))
  np.testing.assert_array_equal(as_bits(rounded)[~nan], as_bits(converted)[~nan])
  assert np.all(np.isnan(np.asarray(rounded, np.float32)[nan]))
  np.testing.assert_array_equal(np.asarray(wide), np.asarray(rounded, np.float32))


def test_stochastic_bfloat16_by_integers_matches_the_convert_of_its_upper_half(monkeypatch):
  # The two forms of `stochastic`'s last step: the float32 upper half taken by integer
  # operations, or cleared below and converted (where `after` is a data dependency). A NaN
  # stays one, whatever its bits, though the random carry out of its mantissa overflows.
  monkeypatch.setattr(_jax_internals, "BARRIERS_ORDER_IN_PLACE_WRITES", False)
  bits = np.random.default_rng(1).integers(0, 2**32, 2**20, dtype=np.uint64).astype(np.uint32)
  special = [0, 0x80000000, 0x00000001, 0x0000FFFF, 0x3F80FFFF, 0x7F7FFFFF, 0xFF7FFFFF,
             0x7F800000, 0xFF800000, 0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF]  # inf and NaNs
  exact = jax.lax.bitcast_convert_type(jnp.asarray(np.append(bits, special), jnp.uint32),
                                       jnp.float32)
  old = exact.astype(jnp.bfloat16)
  seed = jnp.uint32(12345)
  write = jax.jit(_rounding.stochastic, static_argnames="read_after")
  by_integers = write(exact, old, seed, read_after=False)
  converted = write(exact, old, seed, read_after=True)
  nan = np.isnan(np.asarray(exact))
  as_bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16))
  np.testing.assert_array_equal(as_bits(by_integers)[~nan], as_bits(converted)[~nan])
  assert np.all(np.isnan(np.asarray(by_integers, np.float32)[nan]))
  assert np.all(np.isnan(np.asarray(converted, np.float32)[nan]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float32])
def test_arrays_computed_by_one_loop_come_back_bit_for_bit(dtype):
  width = jnp.dtype(dtype).itemsize * 8
  unsigned = jnp.dtype(f"uint{width}")
  every = np.random.default_rng(2).integers(0, 2**width, (3, 4096), dtype=np.uint64)
  arrays = [jax.lax.bitcast_convert_type(jnp.asarray(x.astype(unsigned)), dtype) for x in every]
  back = jax.jit(_rounding.in_one_loop)(*arrays)
  for x, y in zip(arrays, back, strict=True):
    assert y.dtype == x.dtype and y.shape == x.shape
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(y, unsigned)),
                                  np.asarray(jax.lax.bitcast_convert_type(x, unsigned)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn,
                                   jnp.float4_e2m1fn])
def test_each_branch_writes_compensated_parameters_of_every_narrow_dtype_alike(dtype):
  # The CPU branch writes in place (a float4 leaf, 4 bits in a byte, not by `in_one_loop`).
  params = {"w": jnp.linspace(-1.0, 1.0, 64).astype(dtype), "v": jnp.full((3,), 0.5, dtype)}
  grads = jax.tree.map(lambda p: jnp.linspace(-0.3, 0.2, p.size, dtype=jnp.float32), params)
  # The moments in bfloat16: kept in float16 or float8 they are refused (their range).
  tx = jls.loss_scaling(optax.adam(1e-1), jls.NoOpLossScale(), rounding="compensated",
                        state_dtype=jnp.bfloat16)
  written = []
  for name in ("cpu", "default"):
    with force_branch(name):
      step = jax.jit(lambda g, s, p: tx.apply_gradients(g, s, p))
      state, out = tx.init(params), params
      for _ in range(3):
        out, state = step(grads, state, out)
      written.append((out, state.compensation))
  chex.assert_trees_all_equal(*written)


def test_after_with_a_data_dependency_changes_no_value(monkeypatch):
  # jax 0.10.2's form: whatever the first entries it reads (NaN, inf, complex), the values
  # come back bit for bit, and a value reads no array that varies where it does not.
  monkeypatch.setattr(_jax_internals, "BARRIERS_ORDER_IN_PLACE_WRITES", False)
  arrays = (jnp.array([jnp.nan, 1.0]), jnp.array([-jnp.inf], jnp.bfloat16),
            jnp.array([complex(np.nan, np.inf)], jnp.complex64), jnp.zeros((0,)))
  values = (jnp.uint32(7), jnp.array([-0.0, jnp.nan, 3.0], jnp.bfloat16))
  ordered = jax.jit(_rounding.after)(arrays, values)
  as_bits = lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8)
  for x, y in zip(values, ordered, strict=True):
    np.testing.assert_array_equal(as_bits(x), as_bits(y))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's loops")
def test_on_cpu_a_compensated_leafs_parameter_and_buffer_come_out_of_one_loop():
  # XLA:CPU gives a loop one output, but a variadic reduction: else the float32 sum would
  # be written out once and read back by two loops.
  n = 2**16
  params = {"w": jnp.linspace(-1.0, 1.0, n).astype(jnp.bfloat16)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding="compensated")
  step = jax.jit(lambda p, s, g: tx.apply_gradients(g, s, p), donate_argnums=(0, 1))
  text = step.lower(params, tx.init(params), params).compile().as_text()
  loops = re.findall(rf"= \(u16\[{n}\]\{{0\}}, u16\[{n}\]\{{0\}}\) fusion\(", text)
  assert len(loops) == 1, text


def test_a_compensated_infinite_entry_stays_infinite_and_leaves_no_nan():
  params = {"b": jnp.array([0.5, -jnp.inf, 0.25], jnp.bfloat16)}  # a masked logit's bias
  update = {"b": jnp.array([-1e-2, 0.0, 1e-2], jnp.bfloat16)}
  written, state = sgd_step("compensated", params, update, steps=2)
  assert float(written["b"][1]) == -np.inf
  assert np.all(np.isfinite(np.asarray(state.compensation["b"], np.float32)))
  assert np.all(np.isfinite(np.asarray(written["b"], np.float32)[[0, 2]]))


@pytest.mark.parametrize("rounding", ROUNDINGS)
def test_an_infinite_entry_that_its_update_would_make_nan_skips_the_step(rounding, branch):
  # adamw's weight decay of a masked logit's -inf bias is an update of +inf: -inf + inf is
  # NaN, from finite gradients. The step is skipped, as any other non-finite write is.
  params = {"b": jnp.array([-jnp.inf, 1.0], jnp.bfloat16)}
  tx = jls.loss_scaling(optax.adamw(1e-3, weight_decay=0.1), jls.NoOpLossScale(),
                        rounding=rounding)
  grads = {"b": jnp.array([0.0, 0.5], jnp.bfloat16)}
  written, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(written, params)
  assert int(state.nonfinite_update_steps) == 1 and not bool(state.last_applied)
  if rounding == "nearest":  # `update` writes nothing: only nearest's updates are its own
    _, state = jax.jit(tx.update)(grads, tx.init(params), params)
    assert int(state.nonfinite_update_steps) == 1


# --- a skipped step never happened ----------------------------------------------------------


@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_a_poisoned_run_equals_the_clean_run_bit_for_bit(rounding, state_dtype, branch):
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=state_dtype)
  start = {"w": jnp.linspace(-1.0, 1.0, 256).astype(jnp.bfloat16), "b": jnp.zeros(4)}
  step = jax.jit(tx.apply_gradients)
  grads = [{"w": jnp.full(256, g, jnp.bfloat16), "b": jnp.full(4, g)} for g in (0.3, -0.2, 0.1)]
  poison = {"w": jnp.full(256, 0.5, jnp.bfloat16).at[7].set(jnp.nan), "b": jnp.ones(4)}

  def run(sequence):
    params, state = start, tx.init(start)
    for g in sequence:
      params, state = step(g, state, params)
    return params, state

  clean_params, clean = run(grads)
  poisoned_params, poisoned = run([grads[0], poison, grads[1], grads[2]])
  assert int(poisoned.skipped_steps) == 1 and int(clean.skipped_steps) == 0
  chex.assert_trees_all_equal(poisoned_params, clean_params)
  chex.assert_trees_all_equal(
      (poisoned.inner_state, poisoned.compensation, poisoned.rounding_counter),
      (clean.inner_state, clean.compensation, clean.rounding_counter))


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float32_parameters_with_bfloat16_state_step_alike_in_every_platforms_form(rounding):
  # Float32 parameters' updates need no check: on an NVIDIA GPU such a step is a
  # `lax.cond` that runs the not-in-place form, whose state writes are not reordered.
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=jnp.bfloat16)
  start = {"w": jnp.linspace(-1.0, 1.0, 256)}
  grads = [{"w": jnp.full(256, g)} for g in (0.3, -0.2, 0.1)]
  poison = {"w": jnp.full(256, 0.5).at[7].set(jnp.nan)}
  results = {}
  for name in ("cpu", "cuda", "default"):
    with force_branch(name):
      step = jax.jit(tx.apply_gradients)
      for label, sequence in (("clean", grads), ("poisoned", [grads[0], poison, *grads[1:]])):
        params, state = start, tx.init(start)
        for g in sequence:
          params, state = step(g, state, params)
        results[name, label] = (params, state.inner_state, state.rounding_counter)
  first = results["cpu", "clean"]
  for result in results.values():
    chex.assert_trees_all_equal(result, first)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="XLA:CPU's buffers")
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("state_dtype", [None, jnp.bfloat16])
def test_on_cpu_a_donated_step_writes_the_parameters_and_the_state_in_place(
    dtype, rounding, state_dtype):
  # Four leaves of 2**16: no temporary of a leaf's size, but the compensated write's new
  # parameter and buffer, of one leaf at a time, before they are copied over the old ones
  # (`_rounding.in_one_loop`), and with jax 0.10.2 (no barrier) the stochastic write's
  # new parameter, one leaf at a time.
  n = 2**16
  params = {f"w{i}": jnp.linspace(-1.0, 1.0, n).astype(dtype) for i in range(4)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding=rounding,
                        state_dtype=state_dtype)
  step = jax.jit(lambda p, s, g: tx.apply_gradients(g, s, p), donate_argnums=(0, 1))
  memory = step.lower(params, tx.init(params), params).compile().memory_analysis()
  summed = 0
  if dtype == jnp.bfloat16 and rounding == "compensated":
    summed = 4 * n
  elif (dtype == jnp.bfloat16 and rounding == "stochastic"
        and not _jax_internals.BARRIERS_ORDER_IN_PLACE_WRITES):
    summed = 2 * n
  smallest_leaf = 2 * n  # a bfloat16 moment
  assert memory.temp_size_in_bytes < summed + smallest_leaf, memory.temp_size_in_bytes


@pytest.mark.parametrize("rounding, state_dtype", [("stochastic", None),
                                                   ("nearest", jnp.bfloat16),
                                                   ("compensated", jnp.bfloat16)])
def test_the_writes_of_leaves_of_one_shape_compile_to_the_same_kernels(rounding, state_dtype):
  # XLA compiles each distinct loop apart (on CPU 10 to 20 ms each): were a leaf's index a
  # constant in its stochastic write, each leaf's loops would be distinct, and a model of
  # hundreds of leaves would take minutes to compile.
  def distinct_kernels(leaves):
    params = {f"w{i:02d}": jnp.ones((16, 16), jnp.bfloat16) for i in range(leaves)}
    tx = jls.loss_scaling(optax.adam(1e-3), jls.NoOpLossScale(), rounding=rounding,
                          state_dtype=state_dtype)
    step = jax.jit(lambda p, s, g: tx.apply_gradients(g, s, p), donate_argnums=(0, 1))
    text = step.lower(params, tx.init(params), params).compile().as_text()
    bodies = re.findall(r"^%fused_computation[^\n]*\{\n(.*?)^\}", text, re.M | re.S)
    assert len(bodies) > 4 * leaves
    return len({re.sub(r"%[\w.\-]+|, metadata=\{[^}]*\}", "", body) for body in bodies})

  # Only the seeds' own kernels (a hash and a reduction, for the parameters and for the
  # state) are sized by the number of leaves. With the index in the writes: 36 and 75.
  assert distinct_kernels(16) <= distinct_kernels(8) + 4


# --- the small model: a regression MLP, Adam at 3e-4, 300 steps ------------------------------


def regression_loss(params, x, y):
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"].astype(jnp.float32) + layer["b"].astype(jnp.float32)
    h = jnp.tanh(h) if i < len(params) - 1 else h
  return jnp.mean((h - y) ** 2)


def train_regression(dtype, steps=300, **options):
  """The final loss of an MLP (16-64-64-1, parameters in `dtype`) fitting
  sin(x @ w) + noise with Adam at 3e-4: updates about a tenth of bfloat16's spacing
  at the weights' magnitudes."""
  kx, kw, kn, *layers = jax.random.split(jax.random.key(0), 6)
  x = jax.random.normal(kx, (512, 16))
  y = jnp.sin(x @ jax.random.normal(kw, (16, 1))) + 0.1 * jax.random.normal(kn, (512, 1))
  params = [{"w": (jax.random.normal(k, shape) / np.sqrt(shape[0])).astype(dtype),
             "b": jnp.zeros(shape[1], dtype)}
            for k, shape in zip(layers, [(16, 64), (64, 64), (64, 1)], strict=False)]
  tx = jls.loss_scaling(optax.adam(3e-4), jls.NoOpLossScale(), **options)

  @jax.jit
  def train(params):
    def step(carry, _):
      params, state = carry
      grads = jax.grad(regression_loss)(params, x, y)
      return tx.apply_gradients(grads, state, params), None
    return jax.lax.scan(step, (params, tx.init(params)), None, length=steps)[0][0]

  return float(regression_loss(train(params), x, y))


def test_bfloat16_training_with_each_rounding_against_float32_masters():
  reference = train_regression(jnp.float32)
  relative = {name: train_regression(dtype, **options) / reference - 1 for name, dtype, options in [
      ("nearest", jnp.bfloat16, {}),
      ("stochastic", jnp.bfloat16, {"rounding": "stochastic"}),
      ("compensated", jnp.bfloat16, {"rounding": "compensated"}),
      ("bfloat16 state", jnp.float32, {"state_dtype": jnp.bfloat16})]}
  assert relative["nearest"] > 0.2, relative  # the model is one where rounding matters
  assert abs(relative["compensated"]) < 0.01, relative
  assert abs(relative["stochastic"]) < 0.03, relative
  assert abs(relative["bfloat16 state"]) < 0.03, relative


# --- checkpoints ----------------------------------------------------------------------------


def test_an_orbax_checkpoint_of_a_nearest_run_restores_into_a_compensated_bfloat16_state(
    tmp_path):
  params = {"w": jnp.linspace(-1.0, 1.0, 8).astype(jnp.bfloat16), "b": jnp.zeros(2)}
  grads = {"w": jnp.ones(8, jnp.bfloat16), "b": jnp.ones(2)}
  old = jls.loss_scaling(optax.adam(1e-2))
  params, state = old.apply_gradients(grads, old.init(params), params)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "checkpoint", state)
  with ocp.StandardCheckpointer() as checkpointer:
    saved = checkpointer.restore(tmp_path / "checkpoint")
  tx = jls.loss_scaling(optax.adam(1e-2), rounding="compensated", state_dtype=jnp.bfloat16)
  restored = jls.restore_state(saved, like=tx.init(params))
  assert restored.compensation["w"].dtype == jnp.bfloat16
  assert not np.any(np.asarray(restored.compensation["w"], np.float32))
  assert restored.compensation["b"] is None
  assert restored.inner_state[0].mu["b"].dtype == jnp.bfloat16
  assert int(restored.inner_state[0].count) == 1
  chex.assert_trees_all_equal(restored.loss_scale, state.loss_scale)
  params, after = tx.apply_gradients(grads, restored, params)  # and the run continues
  assert bool(after.last_applied)


def test_a_stochastic_state_round_trips_through_orbax_with_its_counter(tmp_path):
  params = {"w": jnp.ones(8, jnp.bfloat16)}
  params, state = sgd_step("stochastic", params, {"w": jnp.full(8, 1e-3)}, steps=3)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "checkpoint", state)
  like = jls.loss_scaling(optax.sgd(1.0), jls.NoOpLossScale(), rounding="stochastic").init(
      params)
  abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "checkpoint", abstract)
  chex.assert_trees_all_equal(restored, state)
  assert int(restored.rounding_counter) == 3
