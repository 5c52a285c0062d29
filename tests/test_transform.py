"""Specification of the optax transformation `loss_scaling`.

Every behaviour is checked on each platform's form of the step, forced on CPU by the
`branch` fixture: `lax.cond` (the CPU branch), a select (TPU's branch), and an NVIDIA
GPU's (the `lax.cond` around the not-in-place step where no update is checked, else the
select).
Products of options are covered pairwise: each pair of values meets in some case.
"""

import functools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import TRACED
from helpers import assert_trees_close
from helpers import count_compiles
from helpers import force_branch

import jax_lossscale as jls
from jax_lossscale import presets
from jax_lossscale._transform import LossScalingTransformation

PARAMS = {"dense": {"kernel": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "bias": jnp.zeros(3)}}


def loss_fn(params, x, y):
  pred = x @ params["dense"]["kernel"] + params["dense"]["bias"]
  return jnp.mean((pred - y) ** 2)


def kernel_loss(params, x, y):
  return jnp.mean((x @ params["kernel"] - y) ** 2)


def one_leaf(outputs):
  return {"kernel": jnp.linspace(-1.0, 1.0, 4 * outputs).reshape(4, outputs)}


def batches(n, seed=0, outputs=3):
  rng = np.random.default_rng(seed)
  return [(jnp.asarray(rng.normal(size=(8, 4)), jnp.float32),
           jnp.asarray(rng.normal(size=(8, outputs)), jnp.float32)) for _ in range(n)]


def poison(batch):
  x, y = batch
  return x.at[0, 0].set(jnp.inf), y


# (params, loss, outputs): the compiler fuses a one-leaf optimizer step differently.
MODELS = {
    "dense": (PARAMS, loss_fn, 3),
    "one_leaf": (one_leaf(12), kernel_loss, 12),
    "one_wide_leaf": (one_leaf(1025), kernel_loss, 1025),
}
INNERS = {"sgd": optax.sgd(0.1, momentum=0.9), "adam": optax.adam(1e-2),
          "adamw": optax.adamw(1e-2, weight_decay=1e-3)}
FUSED = pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])


def make_step(tx, loss=loss_fn, fused=False, **jit_kwargs):
  """A jitted training step `(params, opt_state, batch) -> (params, opt_state, loss)`."""
  grad_fn = jls.scaled_value_and_grad(loss)

  def step(params, opt_state, batch):
    value, grads = grad_fn(opt_state, params, *batch)
    if fused:
      return *tx.apply_gradients(grads, opt_state, params), value
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


def run(tx, data, params=PARAMS, loss=loss_fn, fused=False):
  step, opt_state = make_step(tx, loss, fused), tx.init(params)
  for batch in data:
    params, opt_state, _ = step(params, opt_state, batch)
  return params, opt_state


def run_poisoned(tx, init_params, loss, data, k, fused):
  """Runs `tx` over `data` with batch `k` poisoned, donated; checks params stay finite."""
  step = make_step(tx, loss, fused, donate_argnums=(0, 1))
  params, opt_state = jax.tree.map(jnp.copy, init_params), tx.init(init_params)
  for batch in data[:k] + [poison(data[k])] + data[k + 1:]:
    params, opt_state, _ = step(params, opt_state, batch)
    assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(params))
  return params, opt_state


def control_run(inner, init_params, loss, data):
  """`inner` without loss scaling over `data`: `(params, inner_state)`."""
  step, params, state = plain_step(inner, loss), init_params, inner.init(init_params)
  for batch in data:
    params, state = step(params, state, batch)
  return params, state


def applied_step(tx, fused, transform=jax.jit):
  """`(grads, state, params) -> (new params, new state)` by either path, transformed."""
  if fused:
    return transform(tx.apply_gradients)
  update = transform(tx.update)

  def step(grads, state, params):
    updates, state = update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return step


# --- a skipped step never happened: PyTorch's harness, a control run without that batch ---


def control_cases():
  """Every (inner, model) pair on the CPU branch, both paths alternating; each inner on
  the select branch."""
  cases = [pytest.param(inner, model, "cpu", (i + m) % 2 == 1, id=f"{inner}-{model}-cond")
           for i, inner in enumerate(INNERS) for m, model in enumerate(MODELS)]
  cases += [pytest.param(inner, "dense", "default", i % 2 == 0, id=f"{inner}-dense-where")
            for i, inner in enumerate(INNERS)]
  return cases


@functools.cache
def control_run_without_batch(inner, model, k):
  """`control_run` of `INNERS[inner]` on `MODELS[model]` over 12 batches less batch `k`,
  computed once for the cases on either branch."""
  init_params, loss, outputs = MODELS[model]
  data = batches(12, outputs=outputs)
  return control_run(INNERS[inner], init_params, loss, data[:k] + data[k + 1:])


@pytest.mark.parametrize("inner, model, branch_name, fused", control_cases())
def test_overflowed_step_is_skipped_like_a_control_run_without_that_batch(
    inner, model, branch_name, fused):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(INNERS[inner], jls.DynamicLossScale(2.0**10, increment_period=3))
  with force_branch(branch_name):
    params, opt_state = run_poisoned(tx, init_params, loss, data, k, fused)
  control_params, control_state = control_run_without_batch(inner, model, k)
  assert_trees_close(params, control_params)
  assert_trees_close(opt_state.inner_state, control_state)
  # 5 finite steps (1 growth at step 3), 1 backoff, 6 finite steps (2 growths).
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1 and int(opt_state.consecutive_skips) == 0


CLIP = {"clip_by_global_norm": 0.5}


@pytest.mark.parametrize("param_dtype, branch_name, fused, options", [
    (jnp.float32, "cpu", False, {}), (jnp.float32, "default", True, CLIP),
    (jnp.float16, "cpu", True, CLIP), (jnp.float16, "default", False, {}),
    (jnp.bfloat16, "cpu", False, CLIP), (jnp.bfloat16, "default", True, {}),
    (jnp.float8_e4m3fn, "cpu", True, {}), (jnp.float8_e5m2, "default", False, CLIP),
    (jnp.float32, "cuda", True, {}), (jnp.float32, "cuda", False, CLIP)],
    ids=lambda v: getattr(v, "__name__", str(v)))
def test_a_skipped_step_leaves_params_and_inner_state_bit_identical(
    param_dtype, branch_name, fused, options):
  # Signed zeros included: `+0.0` updates would turn a `-0.0` parameter into `+0.0`.
  params = {"w": jnp.array([-0.0, 0.0, -1.5, 2.0], param_dtype), "b": jnp.array(-0.0)}
  tx = jls.loss_scaling(optax.adam(1e-2, eps=1e-3), jls.DynamicLossScale(8.0), **options)
  grads = {"w": jnp.ones(4, param_dtype), "b": jnp.array(1.0)}
  with force_branch(branch_name):
    step = jax.jit(tx.apply_gradients if fused else tx.update)
    state = step(grads, tx.init(params), params)[1]  # moments not all zero
    bad = dict(grads, w=grads["w"].at[2].set(jnp.nan))
    out, new_state = step(bad, state, params)
  if fused:
    new_params = out
  else:
    new_params = optax.apply_updates(params, out)
    chex.assert_trees_all_equal(out, jax.tree.map(lambda p: -jnp.zeros_like(p), params))
  chex.assert_trees_all_equal(new_params, params)
  for new, old in zip(jax.tree.leaves(new_params), jax.tree.leaves(params), strict=True):
    np.testing.assert_array_equal(np.signbit(new), np.signbit(old))
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale()) == 4.0 and int(new_state.skipped_steps) == 1
  assert not bool(new_state.last_applied)


@FUSED
def test_every_platforms_branch_gives_the_same_steps(fused):
  data = batches(8)
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**10, increment_period=2))
  results = {}
  for name in ("cpu", "cuda", "default"):
    with force_branch(name):
      results[name] = run(tx, [data[0], poison(data[1])] + data[2:], fused=fused)
  p_cpu, s_cpu = results["cpu"]
  for name in ("cuda", "default"):
    p_other, s_other = results[name]
    assert_trees_close(p_cpu, p_other)
    assert_trees_close(s_cpu.inner_state, s_other.inner_state)
    chex.assert_trees_all_equal(s_cpu.loss_scale, s_other.loss_scale)
    assert int(s_cpu.skipped_steps) == int(s_other.skipped_steps) == 1


# --- the transformation object ---------------------------------------------------------


def test_apply_gradients_without_params_is_refused_naming_params():
  tx = jls.loss_scaling(optax.sgd(0.1))
  params = {"w": jnp.ones(2)}
  with pytest.raises(TypeError, match=r"`params`.*\bNone\b"):
    tx.apply_gradients(params, tx.init(params), None)


@pytest.mark.parametrize("inner, grads, params", [
    (optax.adam(1e-3, eps=0.0), 0.0, 1.0),  # 0 / 0: NaN from finite gradients
    (optax.sgd(-1.0), 20000.0, 60000.0)],  # 60000 + 20000 overflows float16
    ids=["nan_update", "overflowing_parameter"])
def test_update_checks_narrow_parameters_as_apply_gradients_does(inner, grads, params):
  # Through `update` (and nnx.Optimizer, which calls it) float32 updates of float16
  # parameters were not checked: the step applied, and the parameters became NaN or inf.
  tx = jls.loss_scaling(inner, jls.NoOpLossScale())
  params = {"w": jnp.full(3, params, jnp.float16)}
  updates, state = tx.update({"w": jnp.full(3, grads, jnp.float32)}, tx.init(params), params)
  assert not bool(state.last_applied) and int(state.nonfinite_update_steps) == 1
  np.testing.assert_array_equal(optax.apply_updates(params, updates)["w"], params["w"])


def test_a_state_made_by_another_inner_optimizer_is_named_as_the_likely_cause():
  params = {"w": jnp.ones(2)}
  state = jls.loss_scaling(optax.sgd(0.1), 4.0).init(params)  # the same loss scale
  with pytest.raises(AttributeError) as info:
    jls.loss_scaling(optax.adam(0.1), 4.0).update(params, state, params)
  assert "If `state` was made by another optimizer's init" in " ".join(info.value.__notes__)


def test_apply_gradients_takes_the_loss_and_extra_args_like_update(branch):
  seen = []

  def update(updates, state, params=None, *, temperature):
    seen.append(temperature)
    return jax.tree.map(lambda u: -0.1 * u, updates), state

  tx = jls.loss_scaling(optax.GradientTransformationExtraArgs(lambda p: optax.EmptyState(),
                                                              update))
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  params, new_state = jax.jit(tx.apply_gradients)(grads, state, PARAMS, temperature=0.5,
                                                 loss=jnp.nan)
  chex.assert_trees_all_equal(params, PARAMS)
  assert int(new_state.nonfinite_loss_steps) == 1 and seen
  assert float(new_state.loss_scale()) == float(state.loss_scale())


def test_apply_gradients_is_a_method_that_survives_replace_and_reconstruction():
  tx = jls.loss_scaling(optax.sgd(0.5), jls.FixedLossScale(4))
  params, grads = {"w": jnp.ones(2)}, {"w": jnp.full(2, 4.0)}
  expected = jnp.full(2, 0.5)
  for same in (tx, tx._replace(init=tx.init), LossScalingTransformation(*tx),
               LossScalingTransformation(tx.init, tx.update)):
    new_params, _ = same.apply_gradients(grads, same.init(params), params)
    chex.assert_trees_all_equal(new_params["w"], expected)
  # With another `update`, apply_gradients follows it.
  doubled = tx._replace(update=lambda g, s, p=None, **kw: (
      jax.tree.map(lambda u: 2 * u, tx.update(g, s, p, **kw)[0]), s))
  new_params, _ = doubled.apply_gradients(grads, tx.init(params), params)
  chex.assert_trees_all_equal(new_params["w"], jnp.zeros(2))


def test_loss_scaling_is_a_plain_optax_transformation():
  tx = jls.loss_scaling(optax.sgd(0.1))
  assert isinstance(tx, optax.GradientTransformationExtraArgs)
  init, update = tx
  assert init == tx.init and update is tx.update and tx._fields == ("init", "update")


def test_update_and_apply_gradients_are_documented_where_help_finds_them():
  tx = jls.loss_scaling(optax.sgd(0.1))
  assert "loss=None" in type(tx.update).__doc__ and "skipped step" in type(tx.update).__doc__
  assert "LossScalingState" in tx.init.__doc__ and "fused" in tx.apply_gradients.__doc__


def test_the_wrapped_transformation_is_reachable_as_inner():
  # MultiSteps.has_updated needs it.
  multisteps = optax.MultiSteps(optax.sgd(1.0), 2)
  tx = jls.loss_scaling(multisteps, jls.FixedLossScale(1.0))
  assert tx.inner is multisteps
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  for expected in (False, True):
    _, state = tx.update(grads, state, PARAMS)
    assert bool(tx.inner.has_updated(state.inner_state)) == expected


# --- hard to misuse ------------------------------------------------------------------


def test_wrapping_loss_scaling_in_loss_scaling_is_refused():
  with pytest.raises(TypeError, match="`inner`.*loss_scaling"):
    jls.loss_scaling(jls.loss_scaling(optax.sgd(0.1)))
  nested = jls.loss_scaling(optax.chain(optax.identity(), jls.loss_scaling(optax.sgd(0.1))))
  with pytest.raises(TypeError, match="loss_scaling state"):
    nested.init(PARAMS)


@pytest.mark.parametrize("inner, hint", [(optax.adam, "forget to call it"), ("adam", ""),
                                         (None, ""), (3, "")])
def test_an_inner_that_is_not_a_transformation_is_refused_naming_inner(inner, hint):
  with pytest.raises(TypeError, match=f"`inner`.*GradientTransformation.*{hint}"):
    jls.loss_scaling(inner)


@pytest.mark.parametrize("state", [None, {}, optax.EmptyState()])
def test_update_without_a_loss_scaling_state_says_what_to_pass(state):
  tx = jls.loss_scaling(optax.sgd(0.1))
  with pytest.raises(TypeError, match="`state`.*LossScalingState"):
    tx.update(PARAMS, state, PARAMS)


def test_the_state_of_another_loss_scaling_is_refused():
  # A dynamic-scale state given to loss_scaling(sgd, 8.0) was accepted, and used 32768.
  state = jls.loss_scaling(optax.sgd(0.1)).init(PARAMS)
  with pytest.raises(ValueError, match="`state`.*FixedLossScale"):
    jls.loss_scaling(optax.sgd(0.1), 8.0).update(PARAMS, state, PARAMS)


@pytest.mark.parametrize("loss_scale", ["dynamic", jls.MeasuredLossScale()])
def test_an_axis_name_under_plain_jit_is_refused_naming_axis_name(loss_scale):
  tx = jls.loss_scaling(optax.sgd(0.1), loss_scale, axis_name="data")
  with pytest.raises(ValueError, match="`axis_name`.*'data'"):
    jax.jit(tx.update)(PARAMS, tx.init(PARAMS), PARAMS)


@functools.cache
def sgd_for_losses(branch_name):
  """One `loss_scaling(sgd)` per branch: its step, called without jit, is compiled once per
  signature, so losses of the same type share it (traced in the first test of the branch)."""
  return jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(16.0))


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), np.float32("nan"),
                                  jnp.array([1.0, jnp.nan])])
def test_a_nonfinite_loss_of_any_kind_skips_the_step(loss, branch):
  tx = sgd_for_losses(branch)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  updates, state = tx.update(grads, tx.init(PARAMS), PARAMS, loss=loss)
  assert int(state.nonfinite_loss_steps) == 1 and int(state.skipped_steps) == 1
  assert float(state.loss_scale()) == 16.0
  chex.assert_trees_all_equal(optax.apply_updates(PARAMS, updates), PARAMS)


@pytest.mark.parametrize("loss", ["x", None.__class__, [1.0], True])
def test_a_loss_that_is_not_a_number_is_refused_naming_loss(loss):
  tx = jls.loss_scaling(optax.sgd(0.1))
  with pytest.raises(TypeError, match="`loss`"):
    tx.update(PARAMS, tx.init(PARAMS), PARAMS, loss=loss)


def test_a_python_float_nan_among_the_gradients_skips_the_step():
  # It reached the parameters although the step was "applied".
  params = {"w": jnp.ones(2), "s": jnp.array(1.0)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2.0))
  updates, state = tx.update({"w": jnp.ones(2), "s": float("nan")}, tx.init(params), params)
  assert not bool(state.last_applied)
  chex.assert_trees_all_equal(optax.apply_updates(params, updates), params)
  updates, state = tx.update({"w": jnp.ones(2), "s": 4.0}, tx.init(params), params)
  assert bool(state.last_applied) and float(updates["s"]) == -2.0  # unscaled like an array


@FUSED
def test_float16_parameters_with_default_adam_never_get_nan(fused, branch):
  # Adam's eps=1e-8 is 0 in float16: a zero gradient gives 0/0. Finite gradients,
  # non-finite updates: the step is skipped, and the loss scale is left alone.
  params = {"w": jnp.ones(2, jnp.float16), "f32": jnp.ones(3)}
  tx = jls.loss_scaling(optax.adam(1e-3), jls.DynamicLossScale(4.0, increment_period=1))
  grads = {"w": jnp.zeros(2, jnp.float16), "f32": jnp.ones(3)}
  state = tx.init(params)
  new_params, state = applied_step(tx, fused)(grads, state, params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(state.nonfinite_update_steps) == 1 and int(state.skipped_steps) == 1
  assert float(state.loss_scale()) == 4.0  # not a growth, not a backoff


def test_float16_parameters_with_an_eps_float16_can_hold_take_the_same_step(branch):
  params = {"w": jnp.ones(2, jnp.float16), "f32": jnp.ones(3)}
  tx = jls.loss_scaling(optax.adam(1e-3, eps=1e-4), jls.DynamicLossScale(4.0))
  grads = {"w": jnp.zeros(2, jnp.float16), "f32": jnp.ones(3)}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_applied) and bool(jls.all_finite(updates))


def test_apply_gradients_skips_a_step_that_would_overflow_a_float16_parameter(branch):
  # 60000 + 20000 is inf in float16: finite gradients, finite updates, an inf parameter.
  # The fused step sees the new parameters, so it skips instead; a parameter that was
  # already inf (a constant the model keeps) does not block the step.
  params = {"w": jnp.array([60000.0, 1.0], jnp.float16),
            "mask": jnp.array([-jnp.inf, 0.0], jnp.float16), "f32": jnp.ones(2)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.DynamicLossScale(2.0))
  grads = {"w": jnp.array([-20000.0, 0.0], jnp.float16) * 2,
           "mask": jnp.ones(2, jnp.float16), "f32": jnp.ones(2)}
  new_params, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(state.nonfinite_update_steps) == 1 and float(state.loss_scale()) == 2.0
  grads["w"] = jnp.array([-2048.0, 0.0], jnp.float16) * 2
  new_params, state = jax.jit(tx.apply_gradients)(grads, state, params)
  assert bool(state.last_applied) and float(new_params["w"][0]) == 62048.0
  assert float(new_params["mask"][0]) == -np.inf


@FUSED
def test_bfloat16_parameters_with_non_finite_updates_from_finite_gradients_are_skipped(
    fused, branch):
  params = {"w": jnp.ones(2, jnp.bfloat16), "f32": jnp.ones(3)}
  tx = jls.loss_scaling(optax.adam(1e-3, eps=0.0), jls.DynamicLossScale(4.0))  # 0/0
  grads = {"w": jnp.zeros(2, jnp.bfloat16), "f32": jnp.ones(3)}
  new_params, state = applied_step(tx, fused)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(state.nonfinite_update_steps) == 1 and float(state.loss_scale()) == 4.0


@FUSED
def test_no_op_loss_scale_still_skips_non_finite_steps(fused, branch):
  params = {"w": jnp.ones(3)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.NoOpLossScale())
  state = tx.init(params)
  new_params, state = applied_step(tx, fused)({"w": jnp.array([1.0, jnp.nan, 1.0])}, state,
                                              params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(state.skipped_steps) == 1 and float(state.loss_scale()) == 1.0


@pytest.mark.parametrize("max_norm", [None, 1.0], ids=["unclipped", "clipped"])
def test_lbfgs_given_the_scaled_gradients_as_grad_steps_like_plain_optax(max_norm):
  # optax's line searches take `grad=` beside `value=` and `value_fn=`; it reached them
  # still scaled, and lbfgs took other steps than optax's own (a 1e-3 relative error).
  # With clipping, optax's chain clips the updates only: `grad=` is unclipped.
  def rosenbrock(p):
    x = p["w"]
    return jnp.sum(100 * (x[1:] - x[:-1] ** 2) ** 2 + (1 - x[:-1]) ** 2)

  start, inner = {"w": jnp.array([-1.2, 1.0, 0.5])}, optax.lbfgs()
  clipped = inner if max_norm is None else optax.chain(optax.clip_by_global_norm(max_norm), inner)
  theirs, their_state = start, clipped.init(start)
  # Compiled once, as our step is: run eagerly, the line search compiles on every call.
  their_update = jax.jit(clipped.update, static_argnames="value_fn")
  for _ in range(3):
    value, grads = jax.value_and_grad(rosenbrock)(theirs)
    updates, their_state = their_update(grads, their_state, theirs, value=value, grad=grads,
                                        value_fn=rosenbrock)
    theirs = optax.apply_updates(theirs, updates)
  tx = jls.loss_scaling(inner, jls.FixedLossScale(1024.0), clip_by_global_norm=max_norm)
  ours, state = start, tx.init(start)
  for _ in range(3):
    loss, grads = jls.scaled_value_and_grad(rosenbrock)(state, ours)
    ours, state = tx.apply_gradients(grads, state, ours, loss=loss, value=loss, grad=grads,
                                     value_fn=rosenbrock)
  assert_trees_close(ours, theirs)


def test_integer_parameters_with_float0_gradients_pass_through_both_paths(maybe_jit):
  # jax.grad(allow_int=True) gives an integer parameter a float0 gradient, which
  # optax.masked passes through; update raised a NumPy ufunc error making the skipped
  # step's -0.0 of it, and apply_gradients JAX's "Called add with a float0 array".
  params = {"w": jnp.ones(3), "n": jnp.array(3, jnp.int32)}
  inner = optax.masked(optax.adam(1e-2), {"w": True, "n": False})
  loss = lambda p: jnp.sum(p["w"]) * p["n"]
  tx = jls.loss_scaling(inner, jls.FixedLossScale(8.0))
  grads = jax.grad(lambda p: 8.0 * loss(p), allow_int=True)(params)
  assert grads["n"].dtype == jax.dtypes.float0
  expected, _ = inner.update(jax.grad(loss, allow_int=True)(params), inner.init(params), params)
  updates, state = maybe_jit(tx.update)(grads, tx.init(params), params)
  assert_trees_close(updates["w"], expected["w"])
  assert updates["n"].dtype == jax.dtypes.float0
  stepped, _ = maybe_jit(tx.apply_gradients)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(stepped, {"w": params["w"] + expected["w"], "n": params["n"]})
  overflowed = dict(grads, w=grads["w"].at[0].set(jnp.inf))
  updates, state = maybe_jit(tx.update)(overflowed, state, params)
  chex.assert_trees_all_equal(updates["w"], jnp.full(3, -0.0))
  assert updates["n"].dtype == jax.dtypes.float0 and int(state.skipped_steps) == 1


# --- mixed dtypes: narrow parameters, float32 gradients ---------------------------------

MIXED_INNERS = {"adam": optax.adam(1e-2), "sgd_momentum": optax.sgd(0.1, momentum=0.9),
                "lion": optax.lion(1e-3), "rmsprop": optax.rmsprop(1e-2)}


@pytest.mark.parametrize("inner, param_dtype, branch_name, fused", [
    ("adam", jnp.bfloat16, "cpu", False), ("adam", jnp.float16, "default", True),
    ("sgd_momentum", jnp.float16, "cpu", True), ("sgd_momentum", jnp.bfloat16, "default", False),
    ("lion", jnp.bfloat16, "cpu", True), ("rmsprop", jnp.float16, "cpu", False)])
def test_narrow_parameters_with_float32_gradients_train_exactly_like_plain_optax(
    inner, param_dtype, branch_name, fused):
  # optax promotes the moments to float32 after one step; loss_scaling crashed on both
  # paths with "cond branches must have equal output types".
  params = {"w": jnp.linspace(-1, 1, 8).astype(param_dtype), "b": jnp.zeros(2, param_dtype)}
  rng = np.random.default_rng(0)
  grads = [{"w": jnp.asarray(rng.normal(size=8), jnp.float32),
            "b": jnp.asarray(rng.normal(size=2), jnp.float32)} for _ in range(4)]
  optimizer, skip = MIXED_INNERS[inner], 0 if fused else 2  # the kept state is widened too
  tx = jls.loss_scaling(optimizer, jls.FixedLossScale(1.0))
  with force_branch(branch_name):
    step = applied_step(tx, fused)
    ours, state = params, tx.init(params)
    for i, g in enumerate(grads):
      ours, state = step(dict(g, b=g["b"].at[0].set(jnp.inf)) if i == skip else g, state, ours)
  theirs, their_state = params, optimizer.init(params)
  for g in grads[:skip] + grads[skip + 1:]:
    updates, their_state = optimizer.update(g, their_state, theirs)
    theirs = optax.apply_updates(theirs, updates)
  assert int(state.skipped_steps) == 1
  chex.assert_trees_all_equal_dtypes(state.inner_state, their_state)
  assert_trees_close(ours, theirs)
  assert_trees_close(state.inner_state, their_state)


@pytest.mark.parametrize("param_dtype, large, beyond", [
    (jnp.float8_e4m3fn, 400.0, 100.0), (jnp.float8_e5m2, 50000.0, 20000.0)],
    ids=["float8_e4m3fn", "float8_e5m2"])
def test_float8_parameters_with_float32_gradients_step_in_float32_and_round_back(
    param_dtype, large, beyond):
  # float8 has no implicit promotion: both paths raised JAX's TypePromotionError.
  params = {"w": jnp.array([-1.0, -0.4, 0.3, large]).astype(param_dtype)}
  grads = {"w": jnp.full(4, 2.0, jnp.float32)}  # scaled by 4: the gradient is 0.5
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(4.0))
  updates, _ = tx.update(grads, tx.init(params), params)
  chex.assert_trees_all_equal(updates, {"w": jnp.full(4, -0.05, jnp.float32)})
  stepped, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  expected = (params["w"].astype(jnp.float32) - 0.05).astype(param_dtype)
  chex.assert_trees_all_equal(stepped, {"w": expected})
  # A step past the largest float8 value (448, 57344) is skipped, not applied as NaN or inf.
  stepped, state = tx.apply_gradients({"w": jnp.full(4, -40.0 * beyond)}, state, params)
  chex.assert_trees_all_equal(stepped, params)
  assert int(state.nonfinite_update_steps) == 1


# --- skipped steps -----------------------------------------------------------------


@functools.cache
def adam_update(branch_name):
  """`loss_scaling(adam)` and its jitted `update`, one per branch (traced in its first test
  under that branch), shared by cases that differ only in values."""
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0))
  return tx, jax.jit(tx.update)


@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_a_single_bad_element_skips_with_negative_zero_updates_and_untouched_inner_state(
    bad, branch):
  tx, update = adam_update(branch)
  state = tx.init(PARAMS)
  grads = jax.tree.map(jnp.ones_like, PARAMS)
  _, state = update(grads, state, PARAMS)
  bad_grads = jax.tree.map(jnp.ones_like, PARAMS)
  bad_grads["dense"]["bias"] = bad_grads["dense"]["bias"].at[1].set(bad)
  updates, new_state = update(bad_grads, state, PARAMS)
  chex.assert_trees_all_equal(updates, jax.tree.map(lambda p: -jnp.zeros_like(p), PARAMS))
  assert all(np.signbit(u).all() for u in jax.tree.leaves(updates))
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert float(new_state.loss_scale()) == 4.0
  assert int(new_state.skipped_steps) == 1 and int(new_state.consecutive_skips) == 1
  assert not bool(new_state.last_applied)


@pytest.mark.parametrize("options, fused, branch_name", [
    ({}, False, "cpu"), ({}, True, "default"), (CLIP, True, "cpu"), (CLIP, False, "default"),
    ({}, True, "cuda"), (CLIP, False, "cuda")])
def test_a_nan_in_a_large_float32_leaf_skips_the_step(options, fused, branch_name):
  # XLA:CPU drops NaN from float32 max-reductions of 4096 elements or more.
  params = {"w": jnp.zeros((128, 128)), "b": jnp.zeros(8)}
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0), **options)
  state = tx.init(params)
  grads = {"w": jnp.ones((128, 128)).at[77, 3].set(jnp.nan), "b": jnp.ones(8)}
  with force_branch(branch_name):
    new_params, new_state = applied_step(tx, fused)(grads, state, params)
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


def test_fixed_loss_scale_still_never_lets_nan_reach_the_parameters(branch):
  tx = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(128))
  params, state = run(tx, [poison(b) for b in batches(3)])
  chex.assert_trees_all_equal(params, PARAMS)
  assert int(state.skipped_steps) == 3 and float(state.loss_scale()) == 128


def test_updates_are_chosen_with_a_select_so_inf_updates_do_not_become_nan(branch):
  # A mask multiply would give 0 * inf = NaN.
  tx = jls.loss_scaling(optax.identity(), jls.FixedLossScale(1))
  updates, _ = jax.jit(tx.update)({"w": jnp.array([jnp.inf, 1.0])}, tx.init({"w": jnp.zeros(2)}))
  chex.assert_trees_all_equal(updates, {"w": -jnp.zeros(2)})


def test_gradients_are_unscaled_with_the_scale_that_produced_them():
  # optax.identity() passes on the unscaled gradients it receives.
  tx = jls.loss_scaling(optax.identity(), jls.DynamicLossScale(8.0, increment_period=1))
  state, seen = tx.init({"w": jnp.zeros(1)}), []
  for _ in range(3):
    scale = float(state.loss_scale())
    updates, state = tx.update({"w": jnp.array([scale * 0.5])}, state)
    seen.append(float(updates["w"][0]))
  assert seen == [0.5, 0.5, 0.5]
  assert float(state.loss_scale()) == 64.0


@pytest.mark.parametrize("scale", [3.0, 1000.0, 2.0**127])
def test_unscaling_by_any_scale_is_within_one_rounding(scale):
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(scale))
  grads = {"w": jnp.asarray(np.random.default_rng(0).uniform(-1, 1, size=64), jnp.float32)}
  scaled = jax.tree.map(lambda g: g * np.float32(scale), grads)
  updates, _ = jax.jit(tx.update)(scaled, tx.init(grads), grads)
  chex.assert_trees_all_close(updates, jax.tree.map(lambda g: -g, grads), rtol=2.0**-22)


# --- clipping that shares the finiteness check's reduction ---------------------------


@pytest.mark.parametrize("inner, model, max_norm, fused", [
    ("sgd", "dense", 0.05, False), ("sgd", "one_leaf", 1e3, True),
    ("sgd", "one_wide_leaf", 0.05, True), ("adam", "dense", 1e3, True),
    ("adam", "one_leaf", 0.05, False), ("adam", "one_wide_leaf", 1e3, False)])
def test_clip_by_global_norm_is_a_clipped_control_run_without_the_skipped_batch(
    inner, model, max_norm, fused):
  init_params, loss, outputs = MODELS[model]
  data, k = batches(12, outputs=outputs), 5
  tx = jls.loss_scaling(INNERS[inner], jls.DynamicLossScale(2.0**10, increment_period=3),
                        clip_by_global_norm=max_norm)
  params, opt_state = run_poisoned(tx, init_params, loss, data, k, fused)
  clipped = optax.chain(optax.clip_by_global_norm(max_norm), INNERS[inner])
  control_params, control_state = control_run(clipped, init_params, loss,
                                              data[:k] + data[k + 1:])
  assert_trees_close(params, control_params)
  assert_trees_close(opt_state.inner_state, control_state[1])
  assert float(opt_state.loss_scale()) == 2.0**10 * 2.0**3 * 0.5
  assert int(opt_state.skipped_steps) == 1


@FUSED
def test_a_norm_float32_holds_only_unscaled_is_taken_exactly_and_one_it_cannot_skips(
    fused, branch):
  # Every gradient is finite (4e30) and their squares overflow float32, but the unscaled
  # norm (2e30) is a float32: it is taken of the gradients divided by a power of two, and
  # the step is clipped to it (optax's own clip would divide by an inf norm: zeros).
  params = {"w": jnp.ones(4)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.DynamicLossScale(4.0), clip_by_global_norm=1.0,
                        grad_norm=True)
  state = tx.init(params)
  new_params, new_state = applied_step(tx, fused)({"w": jnp.full(4, 4e30)}, state, params)
  assert bool(new_state.last_applied) and float(new_state.loss_scale()) == 4.0
  np.testing.assert_allclose(new_params["w"], 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(new_state.grad_norm), 2e30, rtol=1e-6)
  # A norm beyond float32 even unscaled (3e38 / 4 * 2 at scale 1) is not finite: skipped,
  # like an overflow.
  tx = jls.loss_scaling(optax.sgd(1.0), jls.DynamicLossScale(1.0), clip_by_global_norm=1.0)
  state = tx.init(params)
  new_params, new_state = applied_step(tx, fused)({"w": jnp.full(4, 3e38)}, state, params)
  chex.assert_trees_all_equal(new_params, params)
  chex.assert_trees_all_equal(new_state.inner_state, state.inner_state)
  assert int(new_state.skipped_steps) == 1


@pytest.mark.parametrize("clip", [None, 1.0], ids=["recorded", "clipped"])
@pytest.mark.parametrize("norm", [1.7e19, 1.9e19, 2e15 * 2.0**15])
def test_the_norm_of_finite_gradients_is_the_unscaled_norm_beyond_float32s_square_root(
    norm, clip):
  # The scaled gradients' squares overflow float32 from a norm of about 1.8e19: the norm
  # recorded was inf on an applied step, and the clip skipped a step that optax clips.
  scale = 2.0**15
  params = {"w": jnp.ones(4)}
  unscaled = {"w": jnp.full(4, norm / 2 / scale, jnp.float32)}
  grads = {"w": unscaled["w"] * scale}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(scale), clip_by_global_norm=clip,
                        grad_norm=True)
  new_params, state = jax.jit(tx.apply_gradients)(grads, tx.init(params), params)
  assert bool(state.last_applied)
  np.testing.assert_allclose(float(state.grad_norm), float(optax.tree.norm(unscaled)),
                             rtol=1e-6)
  reference = optax.chain(*([optax.clip_by_global_norm(clip)] if clip else []), optax.sgd(1.0))
  updates, _ = reference.update(unscaled, reference.init(params), params)
  np.testing.assert_allclose(new_params["w"], optax.apply_updates(params, updates)["w"],
                             rtol=1e-6)


def test_clipping_float16_gradients_squares_them_in_float32():
  # Unscaled float16 gradients of 300: their squares overflow float16, not the norm.
  params = {"w": jnp.zeros(64, jnp.float16)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(4.0), clip_by_global_norm=1.0)
  updates, state = tx.update({"w": jnp.full(64, 1200.0, jnp.float16)}, tx.init(params), params)
  assert bool(state.last_applied)
  np.testing.assert_allclose(np.asarray(updates["w"], np.float64), -300 / np.sqrt(64 * 300**2),
                             rtol=2**-10)


@FUSED
def test_float16_gradients_that_overflow_only_once_unscaled_are_caught_when_clipping(fused):
  # A scale below 1 (a floorless scale after many backoffs) makes unscaled float16
  # gradients larger than the scaled ones: 40000 / 0.5 is inf in float16, though the
  # float32 norm of the scaled gradients is finite.
  params = {"w": jnp.zeros(2, jnp.float16)}
  loss_scale = jls.DynamicLossScale(0.5, min_loss_scale=0)
  tx = jls.loss_scaling(optax.sgd(1.0), loss_scale, clip_by_global_norm=1e6)
  grads = {"w": jnp.array([40000.0, 1.0], jnp.float16)}
  new_params, state = applied_step(tx, fused)(grads, tx.init(params), params)
  chex.assert_trees_all_equal(new_params, params)
  assert int(state.skipped_steps) == 1 and float(state.loss_scale()) == 0.25


def test_clip_by_global_norm_under_vmap_clips_and_skips_per_member():
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2.0), clip_by_global_norm=1.0)
  params = {"w": jnp.zeros((3, 2))}
  grads = {"w": jnp.array([[0.6, 0.8], [6.0, 8.0], [jnp.nan, 1.0]])}
  states = jax.vmap(tx.init)(params)
  # Not under jit: the step must see the batch tracers of a vmap called eagerly.
  updates, states = jax.vmap(tx.update)(grads, states, params)
  np.testing.assert_allclose(updates["w"], [[-0.3, -0.4], [-0.6, -0.8], [0.0, 0.0]], rtol=1e-6)
  assert list(np.asarray(states.skipped_steps)) == [0, 0, 1]


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "1", jnp.ones(2),
                                 1e39, 1e-50])  # inf and 0 in float32
def test_clip_by_global_norm_rejects_a_bad_value(bad):
  with pytest.raises(ValueError, match="clip_by_global_norm"):
    jls.loss_scaling(optax.sgd(0.1), clip_by_global_norm=bad)


def test_clip_by_global_norm_too_small_for_a_normal_clip_factor_is_refused():
  # max_norm / norm fell below float32's smallest normal for large finite norms, was
  # flushed to 0, and the step applied zero updates where optax's clip gives 7e-26.
  with pytest.raises(ValueError, match=r"`clip_by_global_norm`.*2\*\*-62"):
    jls.loss_scaling(optax.sgd(1.0), 1.0, clip_by_global_norm=1e-25)
  tx = jls.loss_scaling(optax.sgd(1.0), 1.0, clip_by_global_norm=2.0**-62)
  params, grads = {"w": jnp.zeros(2)}, {"w": jnp.array([1e18, -1e18])}
  clipped = optax.clip_by_global_norm(2.0**-62).update(grads, optax.EmptyState())[0]
  new_params, _ = tx.apply_gradients(grads, tx.init(params), params)
  np.testing.assert_allclose(new_params["w"], -clipped["w"], rtol=1e-6)


def test_clip_by_global_norm_clips_float64_gradients_beyond_float32_under_x64():
  # The clip factor was cast to float32, where 7e-51 is 0: a zero step counted as applied.
  with jax.enable_x64(True):
    tx = jls.loss_scaling(optax.sgd(1.0), 1.0, clip_by_global_norm=1.0)
    params, grads = {"w": jnp.ones(2)}, {"w": jnp.array([1e50, -1e50])}
    new_params, state = tx.apply_gradients(grads, tx.init(params), params)
    assert bool(state.last_applied)
    np.testing.assert_allclose(new_params["w"], 1 - np.array([1, -1]) / np.sqrt(2), rtol=1e-12)


def test_wrap_state_refuses_a_state_that_is_already_wrapped():
  tx = jls.loss_scaling(optax.adam(0.1))
  with pytest.raises(TypeError, match="loss_scaling state"):
    tx.wrap_state(tx.init(PARAMS))


@pytest.mark.parametrize("value", [np.float32(1.0), np.int64(2), jnp.float32(0.5)])
def test_clip_by_global_norm_accepts_numpy_and_jax_scalars(value):
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0), clip_by_global_norm=value)
  updates, _ = tx.update({"w": jnp.full(4, 10.0)}, tx.init({"w": jnp.zeros(4)}))
  np.testing.assert_allclose(np.linalg.norm(updates["w"]), float(value), rtol=1e-6)


# --- composition -------------------------------------------------------------------


def test_clipping_inside_sees_unscaled_gradients():
  inner = optax.chain(optax.clip_by_global_norm(0.1), optax.sgd(1.0))
  data = batches(4)
  params, _ = run(jls.loss_scaling(inner, jls.DynamicLossScale(2.0**12)), data)
  control, _ = control_run(inner, PARAMS, loss_fn, data)
  assert_trees_close(params, control)


def test_inject_hyperparams_inside_can_still_be_changed_between_steps():
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


def test_inject_hyperparams_in_bfloat16_is_warned_of_at_init():
  # optax keeps injected hyperparameters in the parameters' dtype: b2=0.999 is 1.0 in
  # bfloat16, every update NaN, every step skipped, counted but silent.
  params = {"w": jnp.linspace(-1, 1, 4).astype(jnp.bfloat16)}
  narrow = optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)
  with pytest.warns(UserWarning, match=r"`b2` \(1.0 in bfloat16\) rounded to 1.*"
                    r"hyperparam_dtype=jnp.float32"):
    jls.loss_scaling(narrow, jls.NoOpLossScale()).init(params)
  nested = optax.inject_hyperparams(lambda learning_rate: optax.chain(narrow),
                                    hyperparam_dtype=jnp.float32)(learning_rate=1.0)
  with pytest.warns(UserWarning, match=r"`b2` \(1.0 in bfloat16\)"):
    jls.loss_scaling(nested, jls.NoOpLossScale()).init(params)
  wide = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.float32)(learning_rate=1e-2)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jls.loss_scaling(wide, jls.NoOpLossScale()).init(params)
    jls.loss_scaling(narrow, jls.NoOpLossScale()).init({"w": jnp.ones(4)})  # float32
    sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.1, momentum=0.9)
    jls.loss_scaling(sgd, jls.NoOpLossScale()).init(params)  # nothing rounded to 1
    jax.eval_shape(jls.loss_scaling(narrow, jls.NoOpLossScale()).init, params)


def test_schedules_do_not_advance_on_skipped_steps():
  tx = jls.loss_scaling(optax.sgd(optax.linear_schedule(1.0, 0.0, 10)))
  data = batches(4)
  _, state = run(tx, [data[0], poison(data[1]), poison(data[2]), data[3]])
  assert int(state.inner_state[-1].count) == 2


def test_multi_transform_inside():
  inner = optax.multi_transform(
      {"fast": optax.sgd(0.1), "frozen": optax.set_to_zero()},
      {"dense": {"kernel": "fast", "bias": "frozen"}})
  data = batches(3)
  params, state = run(jls.loss_scaling(inner), [data[0], poison(data[1]), data[2]])
  chex.assert_trees_all_equal(params["dense"]["bias"], PARAMS["dense"]["bias"])
  assert int(state.skipped_steps) == 1 and float(state.loss_scale()) == 2.0**14


def test_multisteps_inside_drops_only_the_overflowed_micro_batch():
  # Each micro-batch is checked and unscaled with its own scale; the macro step waits
  # for one more, so it averages k clean micro-batches.
  k = 2
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), jls.DynamicLossScale(4.0))
  data = batches(5)
  params, state = run(tx, [data[0], poison(data[1]), data[2], data[3], data[4]])
  control, control_state = control_run(optax.MultiSteps(optax.sgd(0.1), k), PARAMS, loss_fn,
                                       [data[0], data[2], data[3], data[4]])
  assert_trees_close(params, control)
  assert_trees_close(state.inner_state, control_state)
  assert float(state.loss_scale()) == 2.0



@FUSED
def test_lookahead_inside_steps_as_plain_lookahead_and_a_skip_leaves_both_weights(fused, branch):
  # optax.lookahead takes the gradients of params.fast; its params and its updates are
  # LookaheadParams, the fast and the slow weights.
  inner = optax.lookahead(optax.adam(1e-2), sync_period=2, slow_step_size=0.5)
  tx = jls.loss_scaling(inner, jls.DynamicLossScale(2.0**4))
  params = plain = optax.LookaheadParams.init_synced(PARAMS)
  state, plain_state, step = tx.init(params), inner.init(params), applied_step(tx, fused)
  for i, batch in enumerate(batches(5)):
    grads = jax.grad(loss_fn)(params.fast, *(poison(batch) if i == 2 else batch))
    scale = state.loss_scale()
    new_params, new_state = step(jax.tree.map(lambda g, s=scale: g * s, grads), state, params)
    if i == 2:
      chex.assert_trees_all_equal((new_params, new_state.inner_state), (params, state.inner_state))
    else:
      updates, plain_state = inner.update(grads, plain_state, plain)
      plain = optax.apply_updates(plain, updates)
    params, state = new_params, new_state
  assert_trees_close(params, plain)
  assert_trees_close(state.inner_state, plain_state)
  assert int(state.skipped_steps) == 1

def scale_per_call(tx, n, overflow_at=()):
  params, update = {"w": jnp.ones(2)}, jax.jit(tx.update)
  state, scales = tx.init(params), []
  for i in range(n):
    grads = {"w": jnp.full(2, jnp.inf if i in overflow_at else 1.0)}
    _, state = update(grads, state, params)
    scales.append(state.loss_scale())  # read at the end: no host transfer per step
  return [float(s) for s in scales]


def test_with_gradient_accumulation_growth_counts_optimizer_steps():
  # Period 2 and k=4: the scale doubled 8 times in 16 clean micro-batches; GradScaler,
  # jmp and flax, which update once per optimizer step, double twice.
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), 4),
                        jls.DynamicLossScale(8.0, increment_period=2))
  assert scale_per_call(tx, 16) == [8.0] * 7 + [16.0] * 8 + [32.0]
  # An overflowed micro-batch backs off at once and is dropped.
  assert scale_per_call(tx, 5, overflow_at=(1,)) == [8.0, 4.0, 4.0, 4.0, 4.0]


@pytest.mark.parametrize("preset, kwargs", [
    (presets.pytorch, dict(init_scale=4.0, growth_interval=2)),
    (presets.jmp, dict(loss_scale=4.0, period=3)),
    (presets.flax, dict(scale=4.0, growth_interval=1)),
    (presets.deepspeed, dict(init_scale=4.0, scale_window=2))])
def test_every_preset_keeps_its_parity_with_accumulation(preset, kwargs):
  # With k micro-batches per optimizer step, the scale after each optimizer step is the
  # preset's after as many finite steps.
  k, steps = 3, 7
  tx = jls.loss_scaling(optax.MultiSteps(optax.sgd(0.1), k), preset(**kwargs))
  per_optimizer_step = scale_per_call(tx, k * steps)[k - 1::k]
  alone = scale_per_call(jls.loss_scaling(optax.sgd(0.1), preset(**kwargs)), steps)
  assert per_optimizer_step == alone and len(set(alone)) > 1


def test_clip_around_multisteps_clips_each_micro_batch_not_their_mean():
  # As documented: clip_by_global_norm= sees each micro-batch, a clip inside MultiSteps
  # sees their mean. With micro-batch gradients of norm 3 and -1, the first clips each
  # to 1 and -1 (mean 0), the second clips the mean 1 to 1.
  params = {"w": jnp.zeros(1)}
  outside = jls.loss_scaling(optax.MultiSteps(optax.sgd(1.0), 2), jls.FixedLossScale(1),
                             clip_by_global_norm=1.0)
  inside = jls.loss_scaling(optax.MultiSteps(
      optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0)), 2), jls.FixedLossScale(1))
  results = []
  for tx in (outside, inside):
    p, state = params, tx.init(params)
    for g in (3.0, -1.0):
      p, state = tx.apply_gradients({"w": jnp.array([g])}, state, p)
    results.append(float(p["w"][0]))
  assert results == [0.0, -1.0]


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
  tx = jls.loss_scaling(optax.adam(1e-3, eps=1e-3))
  state = tx.init(params)
  x = jnp.ones((8, 16))
  loss, grads = jls.scaled_value_and_grad(mixed_loss)(state, params, x)
  assert grads["w"].dtype == param_dtype and grads["h"].dtype == jnp.bfloat16
  updates, state = jax.jit(tx.update)(grads, state, params)
  new = optax.apply_updates(params, updates)
  assert new["w"].dtype == param_dtype and new["h"].dtype == jnp.bfloat16
  assert bool(state.last_applied) and bool(jls.all_finite(new))
  # The unscaled loss comes back, not the scaled one.
  assert float(loss) == pytest.approx(float(mixed_loss(params, x)), rel=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3fnuz])
def test_float8_gradients_are_unscaled_and_checked(dtype):
  params = {"w": jnp.zeros(4, jnp.float32)}
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(8.0))
  grads = {"w": jnp.array([8.0, 16.0, -4.0, 2.0], dtype)}
  updates, state = jax.jit(tx.update)(grads, tx.init(params), params)
  assert bool(state.last_applied) and updates["w"].dtype == dtype
  np.testing.assert_array_equal(np.float32(updates["w"]), [-1.0, -2.0, 0.5, -0.25])
  bad = {"w": grads["w"].at[1].set(jnp.nan)}
  updates, state = jax.jit(tx.update)(bad, tx.init(params), params)
  assert not bool(state.last_applied)


def test_none_leaves_as_in_filtered_equinox_modules(branch):
  params = {"w": jnp.ones(3), "activation": None, "frozen": None}
  tx = jls.loss_scaling(optax.sgd(0.5), jls.FixedLossScale(4))
  state = tx.init(params)
  grads = {"w": jnp.full(3, 4.0), "activation": None, "frozen": None}
  updates, state = jax.jit(tx.update)(grads, state, params)
  assert updates["activation"] is None
  chex.assert_trees_all_equal(updates["w"], jnp.full(3, -0.5))
  new_params, state = jax.jit(tx.apply_gradients)(grads, state, params)
  assert new_params["activation"] is None
  chex.assert_trees_all_equal(new_params["w"], jnp.full(3, 0.5))
  bad = dict(grads, w=jnp.array([1.0, jnp.inf, 1.0]))
  same_params, state = jax.jit(tx.apply_gradients)(bad, state, new_params)
  chex.assert_trees_all_equal(same_params, new_params)


def test_non_array_leaves_pass_through_as_in_equinox_modules(branch):
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
  chex.assert_trees_all_equal(updates["w"], -jnp.zeros(2))


# --- jit, vmap, donation, tracing ----------------------------------------------------


@FUSED
def test_under_vmap_each_member_skips_on_its_own(fused):
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(2))
  params = {"w": jnp.zeros((2, 3))}
  states = jax.vmap(tx.init)(params)
  grads = {"w": jnp.array([[2.0, 2.0, 2.0], [2.0, jnp.nan, 2.0]])}
  new_params, states = applied_step(tx, fused, jax.vmap)(grads, states, params)
  chex.assert_trees_all_equal(new_params["w"], jnp.array([[-1.0] * 3, [0.0] * 3]))
  assert states.skipped_steps.tolist() == [0, 1]


@FUSED
def test_under_a_named_vmap_replicas_agree_as_under_pmap(fused):
  # vmap(..., axis_name="b") as the single-device stand-in for pmap, one replica's
  # loss NaN: every replica skips for the loss, none blames an overflow.
  tx = jls.loss_scaling(optax.sgd(1.0))
  params = {"w": jnp.zeros((4, 3))}
  states = jax.vmap(tx.init)(params)
  grads = {"w": jnp.ones((4, 3))}
  loss = jnp.array([1.0, jnp.nan, 1.0, 1.0])

  def step(grads, state, params, loss):
    if fused:
      return tx.apply_gradients(grads, state, params, loss=loss)
    updates, state = tx.update(grads, state, params, loss=loss)
    return optax.apply_updates(params, updates), state

  new_params, states = jax.jit(jax.vmap(step, axis_name="b"))(grads, states, params, loss)
  chex.assert_trees_all_equal(new_params, params)
  assert states.loss_scale().tolist() == [2.0**15] * 4
  assert states.nonfinite_loss_steps.tolist() == [1] * 4


@pytest.mark.parametrize("axis_type, axis_name, skipped", [
    ("Auto", None, [1] * 4),  # an Auto mesh in context changes nothing
    ("Explicit", None, [0, 1, 0, 0]),  # the mesh's devices are the replicas there
    ("Explicit", "batch", [1] * 4)])  # unless the vmap's axis is named
def test_a_named_vmap_under_a_mesh_agrees_unless_the_mesh_is_explicit(axis_type, axis_name,
                                                                      skipped):
  tx = jls.loss_scaling(optax.sgd(1.0), axis_name=axis_name)
  params = {"w": jnp.zeros((4, 2))}
  grads = {"w": jnp.ones((4, 2)).at[1, 0].set(jnp.inf)}
  mesh = jax.make_mesh((1,), ("data",), axis_types=(getattr(jax.sharding.AxisType, axis_type),))
  with jax.set_mesh(mesh):
    _, states = jax.jit(jax.vmap(tx.apply_gradients, axis_name="batch"))(
        grads, jax.vmap(tx.init)(params), params)
  assert states.skipped_steps.tolist() == skipped


def test_axis_name_empty_keeps_an_ensemble_under_a_named_vmap_independent():
  # The vmap's axis named only to average metrics: member 1's overflow is its own.
  tx = jls.loss_scaling(optax.sgd(1.0), axis_name=())
  params = {"w": jnp.zeros((3, 2))}
  grads = {"w": jnp.ones((3, 2)).at[1, 0].set(jnp.inf)}

  def step(grads, state, params):
    params, state = tx.apply_gradients(grads, state, params)
    return params, state, jax.lax.pmean(state.loss_scale(), "ensemble")

  _, states, _ = jax.jit(jax.vmap(step, axis_name="ensemble"))(
      grads, jax.vmap(tx.init)(params), params)
  assert states.skipped_steps.tolist() == [0, 1, 0]
  assert states.loss_scale().tolist() == [2.0**15, 2.0**14, 2.0**15]


@pytest.mark.parametrize("options, fused, branch_name", [
    ({}, False, "cpu"), ({}, True, "default"), (CLIP, True, "cpu"), (CLIP, False, "default"),
    ({}, True, "cuda")])
def test_donated_step_runs_without_any_host_transfer(options, fused, branch_name):
  tx = jls.loss_scaling(optax.adam(1e-3), **options)
  with force_branch(branch_name):
    step = make_step(tx, fused=fused, donate_argnums=(0, 1))
    params, state = jax.tree.map(jnp.copy, PARAMS), tx.init(PARAMS)
    data = batches(4)
    data.append(poison(data[0]))  # all inputs are on the device before the guard
    params, state, _ = step(params, state, data[0])  # compile outside the guard
  with jax.transfer_guard("disallow"):
    for batch in data[1:]:
      params, state, _ = step(params, state, batch)
  assert int(state.skipped_steps) == 1


@FUSED
def test_jitted_step_compiles_once_over_ten_steps(fused):
  chex.clear_trace_counter()
  tx = jls.loss_scaling(optax.adam(1e-3))
  grad_fn = jls.scaled_value_and_grad(loss_fn)

  @jax.jit
  @chex.assert_max_traces(n=1)
  def step(params, state, batch):
    _, grads = grad_fn(state, params, *batch)
    return applied_step(tx, fused, lambda f: f)(grads, state, params)

  params, state = PARAMS, tx.init(PARAMS)
  for i, batch in enumerate(batches(10)):
    params, state = step(params, state, poison(batch) if i == 4 else batch)


def test_loss_scaling_accepts_identifiers_and_rejects_nonsense():
  assert jls.loss_scaling(optax.sgd(1), 256).init(PARAMS).loss_scale == jls.FixedLossScale(256)
  assert (jls.loss_scaling(optax.sgd(1), jnp.float32(2**15)).init(PARAMS).loss_scale
          == jls.FixedLossScale(2**15))
  with pytest.raises(ValueError, match="'static'.*`loss_scale`"):
    jls.loss_scaling(optax.sgd(1), "static")


# --- checkpoints and export ------------------------------------------------------------


@pytest.mark.parametrize("overflow", [False, True], ids=["clean", "overflowed"])
def test_an_orbax_checkpoint_restored_into_tighter_limits_follows_them_from_the_next_step(
    tmp_path, overflow):
  # orbax restores the leaves unchecked: a scale of 2**20 with hysteresis 2 left, restored
  # into a scale capped at 2**12 with hysteresis 1, stayed at 2**20 and did not back off.
  import orbax.checkpoint as ocp

  saved = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(2.0**20, hysteresis=2))
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "ckpt", saved.init(PARAMS))
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(2.0**10, max_loss_scale=2.0**12))
  with ocp.StandardCheckpointer() as checkpointer:
    state = checkpointer.restore(tmp_path / "ckpt", jax.eval_shape(tx.init, PARAMS))
  grads = jax.tree.map(lambda p: jnp.full_like(p, jnp.inf if overflow else 1.0), PARAMS)
  _, state = jax.jit(tx.apply_gradients)(grads, state, PARAMS)
  # As one capped at 2**12 with hysteresis 1 does: an overflow backs off at once.
  assert float(state.loss_scale()) == (2.0**11 if overflow else 2.0**12)
  assert int(state.loss_scale.hysteresis_left) == (0 if overflow else 1)


@FUSED
def test_orbax_checkpoint_resume_continues_bit_identically(tmp_path, fused):
  import orbax.checkpoint as ocp

  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(2.0**8, increment_period=2))
  data = batches(10)
  data[3], data[7] = poison(data[3]), poison(data[7])
  step = make_step(tx, fused=fused)
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


def test_a_run_checkpointed_without_loss_scaling_resumes_with_it_and_back(tmp_path):
  # Wrapping an optimizer moves its state under `inner_state`: wrap_state does that
  # for a restored state, and `.inner_state` undoes it.
  import orbax.checkpoint as ocp

  adam, data = optax.adam(1e-2), batches(6)
  params, adam_state = control_run(adam, PARAMS, loss_fn, data[:3])
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "plain", {"params": params, "opt": adam_state})
  abstract = jax.eval_shape(lambda: {"params": PARAMS, "opt": adam.init(PARAMS)})
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(tmp_path / "plain", abstract)
  tx = jls.loss_scaling(adam)
  state, params = tx.wrap_state(restored["opt"]), restored["params"]
  step = make_step(tx, fused=True)
  for batch in data[3:]:
    params, state, _ = step(params, state, batch)
  expected, expected_state = control_run(adam, PARAMS, loss_fn, data)
  assert_trees_close(params, expected)
  assert_trees_close(state.inner_state, expected_state)


def test_an_exported_training_step_serializes_without_registering_the_library_types():
  from jax import export

  for optax_type in (optax.ScaleByAdamState, optax.EmptyState):  # optax's: the user's job
    try:
      export.register_namedtuple_serialization(optax_type, serialized_name=optax_type.__name__)
    except ValueError:
      pass  # registered by an earlier test in this process
  tx = jls.loss_scaling(optax.adam(1e-2), jls.DynamicLossScale(8.0))
  state, grads = tx.init(PARAMS), jax.tree.map(jnp.ones_like, PARAMS)
  exported = export.export(jax.jit(tx.apply_gradients))(grads, state, PARAMS)
  restored = export.deserialize(exported.serialize())
  chex.assert_trees_all_equal(restored.call(grads, state, PARAMS),
                              tx.apply_gradients(grads, state, PARAMS))


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_step_called_without_jit_compiles_and_traces_only_on_its_first_call(fused):
  tx = jls.loss_scaling(optax.adam(1e-3))
  grads = jax.tree.map(jnp.ones_like, PARAMS)

  def step(params, state):
    if fused:
      return tx.apply_gradients(grads, state, params, loss=1.0)
    updates, state = tx.update(grads, state, params, loss=1.0)
    return optax.apply_updates(params, updates), state

  params, state = step(PARAMS, tx.init(PARAMS))
  with count_compiles() as compiles, count_compiles(TRACED) as traces:
    for _ in range(50):
      params, state = step(params, state)
  assert compiles == [] and traces == []
  assert int(state.skipped_steps) == 0 and int(state.inner_state[0].count) == 51


def test_a_step_skipped_for_a_nonfinite_loss_neither_resets_nor_advances_the_growth_counter():
  # increment_period=3: two finite steps, a NaN loss, one more finite step: the third
  # finite step grows the scale, as if the skipped step had not happened.
  tx = jls.loss_scaling(optax.sgd(0.1), jls.DynamicLossScale(4.0, increment_period=3))
  params = {"w": jnp.ones(2)}
  state, update, good = tx.init(params), jax.jit(tx.update), {"w": jnp.ones(2)}
  scales, counters = [], []
  for loss in (1.0, 1.0, jnp.nan, 1.0):
    _, state = update(good, state, params, loss=loss)
    scales.append(float(state.loss_scale()))
    counters.append(int(state.loss_scale.num_good_steps))
  assert scales == [4.0, 4.0, 4.0, 8.0] and counters == [1, 2, 2, 0]
  assert int(state.nonfinite_loss_steps) == 1
