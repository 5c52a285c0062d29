"""Specification of the optax transformation `loss_scaling`."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_lossscale as jls

PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "bias": jnp.zeros(3)}}


def loss_fn(params, x, y):
  pred = x @ params["dense"]["kernel"] + params["dense"]["bias"]
  return jnp.mean((pred - y) ** 2)


def batches(n, seed=0, outputs=3):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
           jnp.asarray(rng.normal(size=(8, outputs)), jnp.float32)) for _ in range(n)]


def kernel_loss(params, x, y):
  return jnp.mean((x @ params["kernel"] - y) ** 2)


def one_leaf(outputs):
  return {"kernel": jnp.linspace(-1.0, 1.0, 4 * outputs).reshape(4, outputs)}


# (params, loss, outputs): the compiler fuses a one-leaf optimizer step differently.
MODELS = {
    "dense": (PARAMS, loss_fn, 3),
    "one_leaf": (one_leaf(12), kernel_loss, 12),
    "one_wide_leaf": (one_leaf(1025), kernel_loss, 1025),
}


def poison(batch):
  x, y = batch
  return x.at[0, 0].set(jnp.inf), y


def make_step(tx, loss=loss_fn, **jit_kwargs):
  grad_fn = jls.scaled_value_and_grad(loss)

  def step(params, opt_state, batch):
    value, grads = grad_fn(opt_state, params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value

  return jax.jit(step, **jit_kwargs)


def plain_step(tx, loss=loss_fn):
  @jax.jit
  def step(params, opt_state, batch):
    grads = jax.grad(loss)(params, *batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state
  return step


def run(tx, data, params=PARAMS, loss=loss_fn):
  step, opt_state = make_step(tx, loss), tx.init(params)
  for batch in data:
    params, opt_state, _ = step(params, opt_state, batch)
  return params, opt_state


# --- PyTorch's harness: a control run that skips the same batch -----------------------


def run_poisoned(tx, init_params, loss, data, k, fused):
  """Runs `tx` over `data` with batch `k` poisoned; checks params stay finite."""
  grad_fn = jls.scaled_value_and_grad(loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def step(params, opt_state, batch):
    _, grads = grad_fn(opt_state, params, *batch)
    if fused:
      return tx.apply_gradients(grads, opt_state, params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  params, opt_state = jax.tree.map(jnp.copy, init_params), tx.init(init_params)
  for batch in data[:k] + [poison(data[k])] + data[k + 1:]:
    params, opt_state = step(params, opt_state, batch)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))
  return params, opt_state


def control_run(inner, init_params, loss, data):
  """`inner` without loss scaling over `data`: `(params, inner_state)`."""
  step, params, state = plain_step(inner, loss), init_params, inner.init(init_params)
  for batch in data:
    params, state = step(params, state, batch)
  return params, state


def clipped_control_run(inner, max_norm, init_params, loss, data):
  params, state = control_run(optax.chain(optax.clip_by_global_norm(max_norm), inner),
                              init_params, loss, data)
  return params, state[1]




@pytest.mark.parametrize("inner", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2),
                                   optax.adamw(1e-2, weight_decay=1e-3)],
                         ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize("model", MODELS)
def test_overflowed_step_is_skipped_exactly_like_a_control_run_without_that_batch(
    inner, model):
  params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  loss_scale = jls.DynamicLossScale(2.0**10, increment_period=3)
  scaled_params, scaled_state = run(jls.loss_scaling(inner, loss_scale),
                                    data[:k] + [poison(data[k])] + data[k + 1:], params, loss)

  control_step, control_params, control_state = plain_step(inner, loss), params, inner.init(params)
  for batch in data[:k] + data[k + 1:]:
    control_params, control_state = control_step(control_params, control_state, batch)

  # Power-of-two scales make scaling and unscaling exact in float32.
  chex.assert_trees_all_equal(scaled_params, control_params)
  chex.assert_trees_all_equal(scaled_state.inner_state, control_state)
  # 5 finite steps (1 growth at step 3), 1 backoff, 6 finite steps (2 growths).
  growths, backoffs = 1 + 2, 1
  assert float(scaled_state.loss_scale()) == 2.0**10 * 2.0**growths * 0.5**backoffs
  assert int(scaled_state.skipped_steps) == 1


@pytest.mark.parametrize("inner", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2),
                                   optax.adamw(1e-2, weight_decay=1e-3)],
                         ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize("model", MODELS)
def test_apply_gradients_skips_exactly_like_a_control_run_without_that_batch(inner, model):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**10, increment_period=3))
  grad_fn = jls.scaled_value_and_grad(loss)

  @functools.partial(jax.jit, donate_argnums=(0, 1))
  def fused_step(params, opt_state, batch):
    _, grads = grad_fn(opt_state, params, *batch)
    return tx.apply_gradients(grads, opt_state, params)

  params, opt_state = jax.tree.map(jnp.copy, init_params), tx.init(init_params)
  for batch in data[:k] + [poison(data[k])] + data[k + 1:]:
    params, opt_state = fused_step(params, opt_state, batch)

  control_step = plain_step(inner, loss)
  control_params, control_state = init_params, inner.init(init_params)
  for batch in data[:k] + data[k + 1:]:
    control_params, control_state = control_step(control_params, control_state, batch)
  chex.assert_trees_all_equal(params, control_params)
  chex.assert_trees_all_equal(opt_state.inner_state, control_state)
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1 and int(opt_state.consecutive_skips) == 0


@pytest.mark.parametrize("inner", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2),
                                   optax.adamw(1e-2, weight_decay=1e-3)],
                         ids=["sgd", "adam", "adamw"])
@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_fuse_unscale_skips_like_a_control_run_and_agrees_to_the_last_bits(
    inner, model, fused):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**10, increment_period=3),
                        fuse_unscale=True)
  params, opt_state = run_poisoned(tx, init_params, loss, data, k, fused)

  control_params, control_state = control_run(inner, init_params, loss, data[:k] + data[k + 1:])
  # The same steps are skipped and the scale follows the same trajectory; the
  # values differ at most by how the compiler contracted multiply-adds.
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1
  chex.assert_trees_all_close(params, control_params, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(opt_state.inner_state, control_state, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("fuse_unscale", [False, True])
@pytest.mark.parametrize("check_updates", [False, True])
def test_apply_gradients_keeps_params_and_state_on_a_skipped_step(check_updates,
                                                                   fuse_unscale):
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0),
                        check_updates=check_updates, fuse_unscale=fuse_unscale)
  state = tx.init(PARAMS)
  bad = jax.tree.map(jnp.ones_like, PARAMS)
  bad["dense"]["bias"] = bad["dense"]["bias"].at[1].set(jnp.nan)

  params, new_state = jax.jit(tx.apply_gradients)(bad, state, PARAMS)

  chex.assert_trees_all_equal(params, PARAMS)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale()) == 4.0 and int(new_state.skipped_steps) == 1
  assert not bool(new_state.last_applied)


def test_apply_gradients_takes_the_loss_and_extra_args_like_update():
  tx = jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  params, new_state = jax.jit(tx.apply_gradients)(grads, state, PARAMS, loss=jnp.nan)
  chex.assert_trees_all_equal(params, PARAMS)
  assert int(new_state.nonfinite_loss_steps) == 1
  assert float(new_state.loss_scale()) == float(state.loss_scale())


def test_apply_gradients_with_none_leaves_as_in_filtered_equinox_modules():
  params = {"w": jnp.ones(3), "activation": None}
  tx = jls.loss_scaling(optax.sgd(0.5), jls.FixedLossScale(4))
  state = tx.init(params)
  grads = {"w": jnp.full(3, 4.0), "activation": None}
  new_params, state = jax.jit(tx.apply_gradients)(grads, state, params)
  assert new_params["activation"] is None
  chex.assert_trees_all_equal(new_params["w"], jnp.full(3, 0.5))
  bad = {"w": jnp.array([1.0, jnp.inf, 1.0]), "activation": None}
  same_params, state = jax.jit(tx.apply_gradients)(bad, state, new_params)
  chex.assert_trees_all_equal(same_params, new_params)


def test_apply_gradients_under_vmap_skips_per_member():
  # Under vmap the branch becomes a select: each member skips on its own.
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2))
  params = {"w": jnp.zeros((2, 3))}
  states = jax.vmap(tx.init)(params)
  grads = {"w": jnp.array([[2.0, 2.0, 2.0], [2.0, jnp.nan, 2.0]])}
  new_params, states = jax.vmap(tx.apply_gradients)(grads, states, params)
  chex.assert_trees_all_equal(new_params["w"], jnp.array([[-1.0] * 3, [0.0] * 3]))
  assert states.skipped_steps.tolist() == [0, 1]


def test_loss_scaling_is_still_a_plain_optax_transformation():
  tx = jls.loss_scaling(optax.sgd(0.1))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  init, update = tx
  assert init is tx.init and update is tx.update


# --- skipped steps -----------------------------------------------------------------


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_single_bad_element_skips_with_zero_updates_and_untouched_inner_state(bad):
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0))
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  _, state = tx.update(grads, state, PARAMS)
  bad_grads = jax.tree.map(jnp.ones_like, PARAMS)
  bad_grads["dense"]["bias"] = bad_grads["dense"]["bias"].at[1].set(bad)

  updates, new_state = jax.jit(tx.update)(bad_grads, state, PARAMS)

  chex.assert_trees_all_equal(updates, jax.tree.map(jnp.zeros_like, PARAMS))
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale()) == 4.0
  assert int(new_state.skipped_steps) == 1
  assert int(new_state.consecutive_skips) == 1
  assert not bool(new_state.last_applied)
  chex.assert_tree_all_finite(optax.apply_updates(PARAMS, updates))


@pytest.mark.parametrize("options", [{}, {"fuse_unscale": True}, {"clip_by_global_norm": 1.0}],
                         ids=["default", "fuse_unscale", "clip_by_global_norm"])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_nan_in_a_large_float32_leaf_skips_the_step(options, fused):
  # XLA:CPU drops NaN from float32 max-reductions of 4096 elements or more.
  params = {"w": jnp.zeros((128, 128)), "b": jnp.zeros(8)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0), **options)
  state = tx.init(params)
  grads = {"w": jnp.ones((128, 128)).at[77, 3].set(jnp.nan), "b": jnp.ones(8)}
  if fused:
    new_params, new_state = jax.jit(tx.apply_gradients)(grads, state, params)
  else:
    updates, new_state = jax.jit(tx.update)(grads, state, params)
    new_params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.skipped_steps) == 1 and float(new_state.loss_scale()) == 4.0


def test_counters_track_total_and_consecutive_skips():
  data = batches(7)
  poisoned = [data[0], poison(data[1]), poison(data[2]), data[3], poison(data[4]), data[5]]
  tx = jls.loss_scaling(optax.sgd(0.1))
  step, state, params = make_step(tx), tx.init(PARAMS), PARAMS
  history = []
  for batch in poisoned:
    params, state, _ = step(params, state, batch)
    history.append((int(state.skipped_steps), int(state.consecutive_skips),
                    bool(state.last_applied)))
  assert history == [(0, 0, True), (1, 1, False), (2, 2, False), (2, 0, True),
                     (3, 1, False), (3, 0, True)]
  chex.assert_tree_all_finite(params)


def test_fixed_loss_scale_still_never_lets_nan_reach_the_parameters():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(128))
  params, state = run(tx, [poison(b) for b in batches(3)])
  chex.assert_trees_all_equal(params, PARAMS)
  assert int(state.skipped_steps) == 3 and float(state.loss_scale()) == 128


def test_skip_nonfinite_false_leaves_the_decision_to_the_loss_scale():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(128), skip_nonfinite=False)
  params, state = run(tx, [poison(batches(1)[0])])
  assert not bool(jls.all_finite(params))
  assert int(state.skipped_steps) == 0


def test_updates_are_chosen_with_where_so_inf_updates_do_not_become_nan():
  # A mask multiply would give 0 * inf = NaN; `jnp.where` gives exact zeros.
  tx = jls.loss_scaling(optax.identity(), jls.FixedLossScale(1))
  updates, _ = tx.update({"w": jnp.array([jnp.inf, 1.0])}, tx.init({"w": jnp.zeros(2)}))
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2)})


def test_gradients_are_unscaled_with_the_scale_that_produced_them():
  seen = []
  record = optax.GradientTransformation(
      lambda p: optax.EmptyState(),
      lambda g, s, p=None: (seen.append(g) or g, s))
  tx = jls.loss_scaling(record, jls.DynamicLossScale(8.0, increment_period=1))
  state = tx.init({"w": jnp.zeros(1)})
  for _ in range(3):
    scale = float(state.loss_scale())
    _, state = tx.update({"w": jnp.array([scale * 0.5])}, state)
  assert [float(g["w"][0]) for g in seen] == [0.5, 0.5, 0.5]
  assert float(state.loss_scale()) == 64.0


# --- clipping that shares the finiteness check's reduction ---------------------------


CLIP_INNERS = pytest.mark.parametrize(
    "inner", [optax.sgd(0.1, momentum=0.9), optax.adam(1e-2)], ids=["sgd", "adam"])
MAX_NORMS = pytest.mark.parametrize("max_norm", [0.05, 1e3], ids=["clipping", "not_clipping"])


@CLIP_INNERS
@pytest.mark.parametrize("model", MODELS)
@MAX_NORMS
def test_apply_gradients_with_clip_by_global_norm_equals_a_clipped_control_run_bit_for_bit(
    inner, model, max_norm):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**10, increment_period=3),
                        clip_by_global_norm=max_norm)
  params, opt_state = run_poisoned(tx, init_params, loss, data, k, fused=True)

  control_params, control_state = clipped_control_run(
      inner, max_norm, init_params, loss, data[:k] + data[k + 1:])
  chex.assert_trees_all_equal(params, control_params)
  chex.assert_trees_all_equal(opt_state.inner_state, control_state)
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1


@CLIP_INNERS
@pytest.mark.parametrize("model", MODELS)
@MAX_NORMS
def test_update_with_clip_by_global_norm_equals_clipping_first_in_inner_bit_for_bit(
    inner, model, max_norm):
  # `update` selects the updates with `jnp.where`, which the compiler fuses into
  # the clipping arithmetic: with the clip inside `inner` or not, the result is the
  # same, and within rounding of an unscaled run.
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  loss_scale = jls.DynamicLossScale(2.0**10, increment_period=3)
  params, opt_state = run_poisoned(
      jls.loss_scaling(inner, loss_scale, clip_by_global_norm=max_norm),
      init_params, loss, data, k, fused=False)
  inside_params, inside_state = run_poisoned(
      jls.loss_scaling(optax.chain(optax.clip_by_global_norm(max_norm), inner), loss_scale),
      init_params, loss, data, k, fused=False)
  chex.assert_trees_all_equal(params, inside_params)
  chex.assert_trees_all_equal(opt_state.inner_state, inside_state.inner_state[1])
  chex.assert_trees_all_equal(opt_state.loss_scale, inside_state.loss_scale)

  control_params, _ = clipped_control_run(
      inner, max_norm, init_params, loss, data[:k] + data[k + 1:])
  chex.assert_trees_all_close(params, control_params, rtol=1e-6, atol=1e-7)


@CLIP_INNERS
@pytest.mark.parametrize("model", MODELS)
@MAX_NORMS
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_clip_by_global_norm_with_fuse_unscale_agrees_to_the_last_bits(
    inner, model, max_norm, fused):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**10, increment_period=3),
                        fuse_unscale=True, clip_by_global_norm=max_norm)
  params, opt_state = run_poisoned(tx, init_params, loss, data, k, fused)

  control_params, control_state = clipped_control_run(
      inner, max_norm, init_params, loss, data[:k] + data[k + 1:])
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1
  chex.assert_trees_all_close(params, control_params, rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(opt_state.inner_state, control_state, rtol=1e-5, atol=1e-9)


def test_clipping_really_clips():
  # The harness above would pass trivially if no step were ever clipped.
  data = batches(3)
  clipped, _ = clipped_control_run(optax.sgd(0.1), 0.05, PARAMS, loss_fn, data)
  free, _ = clipped_control_run(optax.sgd(0.1), 1e3, PARAMS, loss_fn, data)
  assert not np.allclose(clipped["dense"]["kernel"], free["dense"]["kernel"])


@pytest.mark.parametrize("fuse_unscale", [False, True])
@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_global_norm_beyond_float32_counts_as_non_finite(fuse_unscale, fused):
  # Every gradient is finite (1e30), but their norm overflows float32, where optax's
  # clipping would divide by inf: the step is skipped, like an overflow.
  params = {"w": jnp.ones(4)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(4.0),
                        fuse_unscale=fuse_unscale, clip_by_global_norm=1.0)
  state = tx.init(params)
  grads = {"w": jnp.full(4, 4e30)}
  assert bool(jls.all_finite(grads))
  if fused:
    new_params, new_state = tx.apply_gradients(grads, state, params)
  else:
    updates, new_state = tx.update(grads, state, params)
    chex.assert_trees_all_equal(updates, {"w": jnp.zeros(4)})
    new_params = optax.apply_updates(params, updates)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.skipped_steps) == 1 and float(new_state.loss_scale()) == 2.0


@pytest.mark.parametrize("fuse_unscale", [False, True])
def test_clipping_float16_gradients_squares_them_in_float32(fuse_unscale):
  # Unscaled float16 gradients of 300: their squares overflow float16, not the norm.
  params = {"w": jnp.zeros(64, jnp.float16)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(4.0),
                        fuse_unscale=fuse_unscale, clip_by_global_norm=1.0)
  updates, state = tx.update({"w": jnp.full(64, 1200.0, jnp.float16)}, tx.init(params), params)
  assert bool(state.last_applied)
  np.testing.assert_allclose(np.asarray(updates["w"], np.float64), -300 / np.sqrt(64 * 300**2),
                             rtol=2**-10)


def test_clip_by_global_norm_under_vmap_clips_and_skips_per_member():
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2.0), clip_by_global_norm=1.0)
  params = {"w": jnp.zeros((3, 2))}
  grads = {"w": jnp.array([[0.6, 0.8], [6.0, 8.0], [jnp.nan, 1.0]])}
  states = jax.vmap(tx.init)(params)
  updates, states = jax.vmap(tx.update)(grads, states, params)
  np.testing.assert_allclose(updates["w"], [[-0.3, -0.4], [-0.6, -0.8], [0.0, 0.0]], rtol=1e-6)
  assert list(np.asarray(states.skipped_steps)) == [0, 0, 1]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1", jnp.ones(2)])
def test_clip_by_global_norm_rejects_a_bad_value(bad):
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    jls.loss_scaling(optax.sgd(0.1), clip_by_global_norm=bad)


# --- composition -------------------------------------------------------------------


def test_clipping_inside_sees_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0))
  data = batches(4)
  params, _ = run(jls.loss_scaling(inner, jls.DynamicLossScale(2.0**12)), data)
  control, state, step = PARAMS, inner.init(PARAMS), plain_step(inner)
  for batch in data:
    control, state = step(control, state, batch)
  chex.assert_trees_all_close(params, control, rtol=1e-6)


def test_inject_hyperparams_can_still_be_changed_between_steps():
  tx = jls.loss_scaling(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
  step, state = make_step(tx), tx.init(PARAMS)
  batch = batches(1)[0]
  params, state, _ = step(PARAMS, state, batch)
  state.inner_state.hyperparams["learning_rate"] = jnp.asarray(0.0)
  params_after, state, _ = step(params, state, batch)
  chex.assert_trees_all_equal(params_after, params)
  # A skipped step does not advance the schedule's count.
  count = int(state.inner_state.count)
  _, state, _ = step(params, state, poison(batch))
  assert int(state.inner_state.count) == count


def test_schedules_do_not_advance_on_skipped_steps():
  schedule = optax.linear_schedule(1.0, 0.0, 10)
  tx = jls.loss_scaling(optax.sgd(schedule))
  data = batches(4)
  _, state = run(tx, [data[0], poison(data[1]), poison(data[2]), data[3]])
  assert int(state.inner_state[-1].count) == 2


def test_multi_transform_inside():
  inner = optax.multi_transform(
      {"fast": optax.sgd(0.1), "frozen": optax.set_to_zero()},
      {"dense": {"kernel": "fast", "bias": "frozen"}},
  )
  data = batches(3)
  params, state = run(jls.loss_scaling(inner), [data[0], poison(data[1]), data[2]])
  chex.assert_trees_all_equal(params["dense"]["bias"], PARAMS["dense"]["bias"])
  assert int(state.skipped_steps) == 1
  assert float(jls.get_loss_scale(state)()) == 2.0**14


def test_multisteps_inside_skips_only_the_overflowed_micro_step():
  # Recommended order: each micro-batch is checked and unscaled with its own scale.
  k = 2
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jls.DynamicLossScale(4.0))
  data = batches(5)
  params, state = run(tx, [data[0], poison(data[1]), data[2], data[3], data[4]])
  control_inner = optax.MultiSteps(optax.sgd(0.1), k)
  control, control_state, step = PARAMS, control_inner.init(PARAMS), plain_step(control_inner)
  for batch in [data[0], data[2], data[3], data[4]]:
    control, control_state = step(control, control_state, batch)
  chex.assert_trees_all_equal(params, control)
  chex.assert_trees_all_equal(state.inner_state, control_state)
  assert float(jls.get_loss_scale(state)()) == 2.0


def test_multisteps_outside_equals_inside_on_a_clean_run():
  data = batches(6)
  inside, _ = run(jls.loss_scaling(optax.MultiSteps(optax.adam(1e-2), 3)), data)
  outside, state = run(optax.MultiSteps(jls.loss_scaling(optax.adam(1e-2)), 3), data)
  chex.assert_trees_all_close(inside, outside, rtol=1e-6)
  assert int(jls.metrics(state)["skipped_steps"]) == 0


def test_multisteps_outside_never_lets_an_overflow_reach_the_parameters():
  # In this order optax's accumulator is reset with `(1 - emit) * acc`, so a NaN in
  # it stays: every later macro step is skipped (see README). Safety still holds.
  data = batches(6)
  tx = optax.MultiSteps(jls.loss_scaling(optax.adam(1e-2)), 2)
  params, state = run(tx, [data[0], poison(data[1])] + data[2:])
  chex.assert_tree_all_finite(params)
  chex.assert_tree_all_finite(state.inner_opt_state.inner_state)
  assert int(jls.metrics(state)["skipped_steps"]) >= 1


def test_extra_args_are_passed_to_the_inner_transformation():
  seen = {}

  def update(updates, state, params=None, *, temperature):
    seen["temperature"] = temperature
    return updates, state

  inner = optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(), update)
  tx = jls.loss_scaling(inner)
  tx.update({"w": jnp.ones(1)}, tx.init({"w": jnp.ones(1)}), temperature=0.5)
  assert seen == {"temperature": 0.5}


# --- dtypes and tree shapes --------------------------------------------------------


def mixed_loss(params, x):
  h = (x.astype(jnp.float16) @ params["w"].astype(jnp.float16)).astype(jnp.float32)
  return jnp.mean(h**2) * 1e-6 + jnp.sum(params["h"].astype(jnp.float32)) * 1e-3


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
def test_low_precision_compute_and_parameters(param_dtype):
  params = {"w": jnp.full((16, 4), 0.01, param_dtype), "h": jnp.ones(3, jnp.bfloat16)}
  # eps=1e-8 is 0 in float16 and bfloat16 rounds it poorly: use a low-precision-safe eps.
  tx = jls.loss_scaling(optax.adam(1e-3, eps=1e-3))
  state = tx.init(params)
  grad_fn = jls.scaled_value_and_grad(mixed_loss)
  x = jnp.ones((8, 16))
  loss, grads = grad_fn(state, params, x)
  assert grads["w"].dtype == param_dtype and grads["h"].dtype == jnp.bfloat16
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert new["w"].dtype == param_dtype and new["h"].dtype == jnp.bfloat16
  assert bool(state.last_applied) and bool(jls.all_finite(new))
  # The unscaled loss comes back, not the scaled one.
  assert float(loss) == pytest.approx(float(mixed_loss(params, x)), rel=1e-6)


def test_check_updates_catches_nan_made_by_the_inner_optimizer():
  # Adam on float16 parameters: eps=1e-8 underflows to 0, a zero gradient gives 0/0.
  params = {"w": jnp.ones(2, jnp.float16)}
  grads = {"w": jnp.zeros(2, jnp.float16)}
  unchecked = jls.loss_scaling(optax.adam(1e-3), jls.FixedLossScale(1))
  updates, _ = unchecked.update(grads, unchecked.init(params), params)
  assert not bool(jls.all_finite(updates))
  checked = jls.loss_scaling(optax.adam(1e-3), jls.FixedLossScale(1), check_updates=True)
  updates, state = jax.jit(checked.update)(grads, checked.init(params), params)
  chex.assert_trees_all_equal(updates, {"w": jnp.zeros(2, jnp.float16)})
  assert int(state.skipped_steps) == 1


def test_none_leaves_as_in_filtered_equinox_modules():
  params = {"w": jnp.ones(3), "activation": None, "frozen": None}
  tx = jls.loss_scaling(optax.sgd(0.5), jls.FixedLossScale(4))
  state = tx.init(params)
  grads = {"w": jnp.full(3, 4.0), "activation": None, "frozen": None}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["activation"] is None
  chex.assert_trees_all_equal(updates["w"], jnp.full(3, -0.5))


def test_non_array_leaves_pass_through_as_in_equinox_modules():
  # An equinox module's tree holds static leaves (names, activation functions).
  grads = {"w": jnp.full(2, 4.0), "name": "mlp", "activation": jax.nn.gelu}
  tx = jls.loss_scaling(optax.identity(), jls.FixedLossScale(4))
  state = tx.init(grads)
  updates, state = tx.update(grads, state)
  assert updates["name"] == "mlp" and updates["activation"] is jax.nn.gelu
  chex.assert_trees_all_equal(updates["w"], jnp.ones(2))
  bad = dict(grads, w=jnp.array([jnp.nan, 1.0]))
  updates, state = tx.update(bad, state)
  assert updates["name"] == "mlp" and int(state.skipped_steps) == 1
  chex.assert_trees_all_equal(updates["w"], jnp.zeros(2))


# --- jit, donation, tracing --------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"fuse_unscale": True, "clip_by_global_norm": 1.0}],
                         ids=["default", "fuse_unscale_and_clip"])
def test_donated_step_runs_without_any_host_transfer(options):
  tx = jls.loss_scaling(optax.adam(1e-3), **options)
  step = make_step(tx, donate_argnums=(0, 1))
  params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
  data = batches(4)
  data.append(poison(data[0]))  # all inputs are on the device before the guard
  params, state, _ = step(params, state, data[0])  # compile outside the guard
  with jax.transfer_guard("disallow"):
    for batch in data[1:]:
      params, state, _ = step(params, state, batch)
  assert int(state.skipped_steps) == 1


def test_jitted_step_compiles_once_over_ten_steps():
  tx = jls.loss_scaling(optax.adam(1e-3))
  grad_fn = jls.scaled_value_and_grad(loss_fn)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch):
    _, grads = grad_fn(state, params, *batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  params, state = PARAMS, tx.init(PARAMS)
  data = batches(10)
  for i, batch in enumerate(data):
    params, state = step(params, state, poison(batch) if i == 4 else batch)


# --- finding the state, metrics, stuck runs ----------------------------------------


@pytest.mark.parametrize(
    "wrap",
    [
        lambda tx: tx,
        lambda tx: optax.chain(optax.identity(), tx),
        lambda tx: optax.MultiSteps(tx, 2),
        lambda tx: optax.multi_transform({"a": tx, "b": optax.set_to_zero()},
                                         {"dense": {"kernel": "a", "bias": "b"}}),
    ],
    ids=["bare", "chain", "multisteps", "multi_transform"],
)
def test_get_loss_scale_finds_the_scale_in_nested_states(wrap):
  tx = wrap(jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(64.0)))
  state = tx.init(PARAMS)
  assert isinstance(jls.get_loss_scale(state), jls.DynamicLossScale)
  assert float(jls.get_loss_scale(state)()) == 64.0


def test_get_loss_scale_inside_inject_hyperparams():
  tx = optax.inject_hyperparams(
      lambda learning_rate: jls.loss_scaling(optax.sgd(learning_rate), 32.0)
  )(learning_rate=0.1)
  assert float(jls.get_loss_scale(tx.init(PARAMS))()) == 32.0


def test_get_loss_scale_without_loss_scaling_says_what_is_wrong():
  with pytest.raises(ValueError, match="found 0"):
    jls.get_loss_scale(optax.adam(1e-3).init(PARAMS))


def test_metrics_are_scalars_ready_for_logging():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))
  _, state = run(tx, [poison(batches(1)[0])])
  metrics = jax.jit(jls.metrics)(state)
  assert {k: v.item() for k, v in metrics.items()} == {
      "loss_scale": 8.0, "skipped_steps": 1, "consecutive_skips": 1,
      "last_applied": False, "nonfinite_loss_steps": 0,
  }


def test_raise_if_stuck_fails_fast_with_a_clear_message():
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(4.0))
  _, state = run(tx, [poison(b) for b in batches(5)])
  jls.raise_if_stuck(state, max_consecutive_skips=6)
  with pytest.raises(jls.LossScaleStuckError,
                     match=r"last 5 steps were all skipped.*already at its minimum 1"):
    jls.raise_if_stuck(state, max_consecutive_skips=5)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_raise_if_stuck_rejects_a_bad_threshold(bad):
  with pytest.raises(ValueError, match="max_consecutive_skips"):
    jls.raise_if_stuck(None, max_consecutive_skips=bad)


def test_loss_scaling_accepts_identifiers_and_rejects_nonsense():
  assert jls.get_loss_scale(jls.loss_scaling(optax.sgd(1), 256).init(PARAMS)) \
      == jls.FixedLossScale(256)
  with pytest.raises(ValueError, match="Could not interpret"):
    jls.loss_scaling(optax.sgd(1), "static")
  with pytest.raises(ValueError, match="skip_nonfinite"):
    jls.loss_scaling(optax.sgd(1), skip_nonfinite="yes")
  with pytest.raises(ValueError, match="fuse_unscale"):
    jls.loss_scaling(optax.sgd(1), fuse_unscale=1)


# --- scaled_value_and_grad ---------------------------------------------------------


def test_scaled_value_and_grad_returns_unscaled_value_and_scaled_grads():
  loss_scale = jls.FixedLossScale(8.0)
  batch = batches(1)[0]
  value, grads = jls.scaled_value_and_grad(loss_fn)(loss_scale, PARAMS, *batch)
  ref_value, ref_grads = jax.value_and_grad(loss_fn)(PARAMS, *batch)
  assert float(value) == float(ref_value)
  chex.assert_trees_all_equal(grads, jax.tree.map(lambda g: g * 8.0, ref_grads))


def test_scaled_value_and_grad_with_aux_and_argnums():
  def f(a, b):
    return a * b, {"ab": a * b}

  (value, aux), grads = jls.scaled_value_and_grad(f, argnums=(0, 1), has_aux=True)(
      jls.FixedLossScale(4.0), 2.0, 3.0)
  assert float(value) == 6.0 and float(aux["ab"]) == 6.0
  assert (float(grads[0]), float(grads[1])) == (12.0, 8.0)


# --- checkpoints and flax ----------------------------------------------------------


def test_flax_serialization_round_trip():
  from flax import serialization

  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(64.0, hysteresis=2))
  _, state = run(tx, [batches(1)[0], poison(batches(1)[0])])
  restored = serialization.from_bytes(tx.init(PARAMS), serialization.to_bytes(state))
  chex.assert_trees_all_equal(restored, state)
  assert restored.loss_scale.get_config() == state.loss_scale.get_config()


def test_orbax_checkpoint_resume_continues_bit_identically(tmp_path):
  import orbax.checkpoint as ocp

  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**8, increment_period=2))
  data = batches(10)
  data[3], data[7] = poison(data[3]), poison(data[7])
  step = make_step(tx)

  params, state = PARAMS, tx.init(PARAMS)
  for batch in data:
    params, state, _ = step(params, state, batch)

  resumed_params, resumed_state = PARAMS, tx.init(PARAMS)
  for batch in data[:5]:
    resumed_params, resumed_state, _ = step(resumed_params, resumed_state, batch)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", {"params": resumed_params, "opt": resumed_state})
  abstract = jax.eval_shape(lambda: {"params": PARAMS, "opt": tx.init(PARAMS)})
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
  resumed_params, resumed_state = restored["params"], restored["opt"]
  assert isinstance(resumed_state.loss_scale, jls.DynamicLossScale)
  for batch in data[5:]:
    resumed_params, resumed_state, _ = step(resumed_params, resumed_state, batch)

  chex.assert_trees_all_equal(resumed_params, params)
  chex.assert_trees_all_equal(resumed_state, state)


def test_flax_train_state_example():
  from flax import linen as nn
  from flax.training import train_state

  model = nn.Dense(3)
  x = jnp.ones((4, 5))
  variables = model.init(jax.random.key(0), x)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=variables["params"],
      tx=jls.loss_scaling(optax.adam(1e-2)),
  )

  @jax.jit
  def train_step(state, x):
    def loss(params):
      return jnp.mean(state.apply_fn({"params": params}, x) ** 2)
    value, grads = jls.scaled_value_and_grad(loss)(state.opt_state, state.params)
    return state.apply_gradients(grads=grads), value

  losses = []
  for _ in range(5):
    state, value = train_step(state, x)
    losses.append(float(value))
  assert losses[-1] < losses[0]
  assert int(jls.metrics(state.opt_state)["skipped_steps"]) == 0

