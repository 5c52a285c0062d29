"""Specification of `jax_lossscale.jmp`: jmp's own tests, then what they leave out.

jmp's test files ship inside the installed jmp package. They run here against
`jax_lossscale.jmp` with only their import line rewritten, collected as the unittest
cases they are (`LossScaleTest`, `PolicyTest`).
"""

import dataclasses
import importlib.util
import pathlib
import re
import types
import warnings

import chex
import jax
import jax.numpy as jnp
import jmp as real_jmp
import numpy as np
import optax
import pytest

import jax_lossscale as jls
import jax_lossscale.jmp as jmp

# --- jmp's own tests -----------------------------------------------------------------

# jmp's test files before the 0.0.4 wheel (its repository's included) call
# `jax.tree_leaves` and `jax.tree_map`, aliases JAX has since removed. Their module sees
# a `jax` that still has them; JAX itself and the library are left alone.
_REMOVED_JAX_ALIASES = {
    name: getattr(jax.tree_util, name)
    for name in ("tree_leaves", "tree_map", "tree_flatten", "tree_unflatten", "tree_structure")
}
_REMOVED_JAX_ALIASES["tree_multimap"] = jax.tree_util.tree_map


class _JaxWithRemovedAliases(types.ModuleType):
  """`jax`, plus the aliases above."""

  def __getattr__(self, name):
    return _REMOVED_JAX_ALIASES[name] if name in _REMOVED_JAX_ALIASES else getattr(jax, name)


def _jmp_test_module(name: str) -> types.ModuleType:
  """jmp's `jmp/_src/{name}_test.py`, importing `jax_lossscale.jmp` as `jmp`."""
  path = pathlib.Path(importlib.util.find_spec("jmp").origin).parent / "_src" / f"{name}_test.py"
  source, count = re.subn(rf"^from jmp\._src import {name} as jmp$",
                          "import jax_lossscale.jmp as jmp", path.read_text(), flags=re.M)
  # Exactly one rewrite and no other jmp import, or these would test jmp itself.
  assert count == 1 and not re.search(r"^\s*(from|import) jmp\b", source, re.M), path
  module = types.ModuleType(f"jmp_{name}_test")
  exec(compile(source, str(path), "exec"), module.__dict__)
  module.jax = _JaxWithRemovedAliases("jax")  # looked up when each test runs
  return module


LossScaleTest = _jmp_test_module("loss_scale").LossScaleTest
PolicyTest = _jmp_test_module("policy").PolicyTest


def test_jmps_test_files_run_against_this_module():
  assert LossScaleTest.test_select_tree.__globals__["jmp"] is jmp
  assert PolicyTest.test_half_dtype.__globals__["jmp"] is jmp


# --- what jmp's tests leave out --------------------------------------------------------


def assert_bitwise_equal(a, b):
  """Same structure, and every leaf the same dtype, shape and bits."""
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    x, y = np.asarray(x), np.asarray(y)
    assert (x.dtype, x.shape, x.tobytes()) == (y.dtype, y.shape, y.tobytes())


def test_the_public_names_are_jmps():
  assert set(real_jmp.__all__) <= set(jmp.__all__)
  assert set(jmp.__all__) == set(real_jmp.__all__) | {"dtype_to_names"}


def test_min_loss_scale_survives_jit_and_tree_map_and_a_jitted_adjust_backs_off_to_it():
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=2.0**8)
  assert jax.jit(lambda s: s)(loss_scale).min_loss_scale == 2.0**8
  assert jax.tree.map(lambda x: x, loss_scale).min_loss_scale == 2.0**8
  adjust = jax.jit(lambda s: s.adjust(jnp.bool_(False)))
  scales = []
  for _ in range(4):
    loss_scale = adjust(loss_scale)
    scales.append(float(loss_scale.loss_scale))
  assert scales == [2.0**9, 2.0**8, 2.0**8, 2.0**8]


def test_a_traced_min_loss_scale_is_refused_naming_it():
  with pytest.raises(ValueError, match="`min_loss_scale`"):
    jax.jit(lambda m: jmp.DynamicLossScale(jnp.float32(2.0), min_loss_scale=m))(1.0)


@pytest.mark.parametrize("dtype", [jnp.float16, np.float16, jnp.bfloat16, jnp.float32],
                         ids=["jnp.float16", "np.float16", "bfloat16", "float32"])
def test_a_dynamic_scale_is_held_in_float32_whatever_dtype_it_is_given(dtype):
  dynamic = jmp.DynamicLossScale(jnp.asarray(2.0**15, dtype), period=1)
  assert dynamic.loss_scale.dtype == jnp.float32 and not dynamic.loss_scale.weak_type
  assert dynamic.min_loss_scale.dtype == jnp.float32
  assert dynamic.adjust(jnp.bool_(True)).loss_scale.dtype == jnp.float32
  # A static scale never grows: it is kept as given, as jmp keeps it.
  static = jmp.StaticLossScale(np.asarray(2.0**15, dtype))
  assert static.loss_scale.dtype == real_jmp.StaticLossScale(np.asarray(2.0**15, dtype)
                                                             ).loss_scale.dtype == dtype


def test_a_float16_scale_grows_past_what_float16_can_hold(maybe_jit):
  loss_scale = jmp.DynamicLossScale(jnp.float16(2.0**15), period=1)
  adjust = maybe_jit(lambda s: s.adjust(jnp.bool_(True)))
  scales = []
  for _ in range(3):
    loss_scale = adjust(loss_scale)
    scales.append(float(loss_scale.loss_scale))
  assert scales == [2.0**16, 2.0**17, 2.0**18]  # jmp's float16 scale stays at 2**15


@pytest.mark.parametrize("scale", [jnp.int32(4), 4], ids=["int32", "python-int"])
def test_an_integer_scale_warns_as_jmp_does_and_then_works_in_float32(scale):
  with pytest.warns(UserWarning, match="Expected floating type for loss_scale, got int32"):
    loss_scale = jmp.DynamicLossScale(scale)
  assert loss_scale.loss_scale.dtype == jnp.float32
  assert loss_scale.adjust(jnp.bool_(False)).loss_scale == 2.0


def test_a_float_scale_does_not_warn():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    jmp.DynamicLossScale(jnp.float16(2.0**15), min_loss_scale=np.float16(1))
    jmp.StaticLossScale(2)


def test_a_static_loss_scale_passes_into_jit_as_static_data():
  loss_scale = jmp.StaticLossScale(jnp.float32(128))
  assert jax.tree.leaves(loss_scale) == []
  assert jax.jit(lambda s, x: s.scale(x))(loss_scale, jnp.float32(2)) == 256


@pytest.mark.parametrize("fields, shown", [
    ({"period": 0}, "`loss_scale.period` must be >= 1, got 0"),
    ({"factor": 1}, "`loss_scale.factor` must be > 1, got 1"),
])
@pytest.mark.parametrize("module", [real_jmp, jmp])
def test_a_bad_jmp_dynamic_scale_given_to_loss_scaling_is_refused_naming_jmps_field(
    module, fields, shown):
  with pytest.raises(ValueError, match=re.escape(shown)):
    jls.loss_scaling(optax.sgd(0.1), module.DynamicLossScale(jnp.float32(2.0**15), **fields))


def test_a_jmp_checkpoint_restores_into_this_dynamic_loss_scale():
  theirs = real_jmp.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(7), period=100, factor=3)
  ours = jmp.DynamicLossScale(jnp.float32(1), period=100, factor=3, min_loss_scale=4.0)
  paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(theirs)[0]]
  assert [p for p, _ in jax.tree_util.tree_flatten_with_path(ours)[0]] == paths
  restored = jax.tree.unflatten(jax.tree.structure(ours), jax.tree.leaves(theirs))
  assert (restored.loss_scale, restored.counter) == (2.0**12, 7)
  assert (restored.period, restored.factor, restored.min_loss_scale) == (100, 3, 4.0)


def test_an_orbax_checkpoint_of_jmps_leaves_restores_into_this_dynamic_loss_scale(tmp_path):
  ocp = pytest.importorskip("orbax.checkpoint")
  theirs = real_jmp.DynamicLossScale(jnp.float32(2.0**12), jnp.int32(7), period=100)
  ours = jmp.DynamicLossScale(jnp.float32(1), period=100, min_loss_scale=4.0)
  # jmp's class itself cannot be saved by orbax: its `__post_init__` chokes on the
  # placeholders orbax maps over the leaves. So the checkpoint holds jmp's leaves
  # under the names its flatten gives them, the positions 0 and 1.
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(tmp_path / "jmp", {"scale": tuple(jax.tree.leaves(theirs))})
    checkpointer.save(tmp_path / "ours", {"scale": ours})
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "jmp", {"scale": ours})["scale"]
    round_trip = checkpointer.restore(tmp_path / "ours", jax.eval_shape(lambda: {"scale": ours}))
  assert type(restored) is jmp.DynamicLossScale
  assert (restored.loss_scale, restored.counter, restored.min_loss_scale) == (2.0**12, 7, 4.0)
  assert (round_trip["scale"].loss_scale, round_trip["scale"].min_loss_scale) == (1.0, 4.0)


def test_adjust_follows_jmps_trajectory_under_jit(maybe_jit):
  loss_scale = jmp.DynamicLossScale(jnp.float32(8), period=2, min_loss_scale=2.0)
  adjust = maybe_jit(lambda s, finite: s.adjust(finite))
  scales, counters = [], []
  for finite in [True, True, True, False, False, False, True, True]:
    loss_scale = adjust(loss_scale, jnp.bool_(finite))
    scales.append(float(loss_scale.loss_scale))
    counters.append(int(loss_scale.counter))
  assert scales == [8, 16, 16, 8, 4, 2, 2, 4]
  assert counters == [1, 0, 1, 0, 0, 0, 1, 0]
  assert loss_scale.counter.dtype == jnp.int32 and loss_scale.min_loss_scale == 2


def test_a_jmp_scale_converted_or_its_preset_backs_off_as_jmp_under_jit():
  # jmp divides by its static factor, which `jit` compiles as a multiplication by its
  # float32 reciprocal: 5 / 3 is not 5 * float32(1/3) in float32.
  from jax_lossscale import presets
  from jax_lossscale import tensorflow as jls_tf

  theirs = real_jmp.DynamicLossScale(jnp.float32(5.0), period=2, factor=3)
  converted = jls_tf.get(theirs)
  preset = presets.jmp(5.0, period=2, factor=3.0)
  adjust_theirs = jax.jit(lambda s, finite: s.adjust(finite))
  adjust_ours = jax.jit(lambda s, finite: s.adjust(finite))
  for finite in [False, True, True, False, True, True, True, True, False, False]:
    theirs = adjust_theirs(theirs, jnp.bool_(finite))
    converted, preset = (adjust_ours(s, jnp.bool_(finite)) for s in (converted, preset))
    assert converted() == preset() == theirs.loss_scale, finite


@pytest.mark.parametrize("factor", [2.0, 2.0**127, 1e38])
def test_a_jmp_factor_whose_reciprocal_is_exact_or_tiny_backs_off_by_dividing(factor):
  # A power of two divides exactly as it multiplies, and a factor past about 8.5e37 has
  # no normal float32 reciprocal: the preset keeps the division (and accepts the factor).
  from jax_lossscale import presets
  from jax_lossscale import tensorflow as jls_tf

  preset = presets.jmp(2.0**100, period=2, factor=factor)
  converted = jls_tf.get(real_jmp.DynamicLossScale(jnp.float32(2.0**100), period=2,
                                                   factor=factor))
  for scale in (preset, converted):
    assert scale.backoff_factor is None
    expected = max(np.float32(2.0**100) / np.float32(factor), 1.0)
    assert float(scale.adjust(jnp.bool_(False))()) == expected


def test_adjust_under_vmap_updates_each_loss_scale_on_its_own_flag():
  loss_scales = jmp.DynamicLossScale(jnp.float32([4, 8, 16]), jnp.int32([1, 1, 0]), period=2)
  adjusted = jax.vmap(lambda s, f: s.adjust(f))(loss_scales, jnp.array([True, False, True]))
  np.testing.assert_array_equal(adjusted.loss_scale, [8, 4, 16])
  np.testing.assert_array_equal(adjusted.counter, [0, 0, 1])


@pytest.mark.parametrize("pred", [jnp.ones([1], bool), jnp.float32(1), None])
def test_select_tree_and_adjust_refuse_a_predicate_that_is_not_a_boolean_scalar(pred):
  with pytest.raises(ValueError, match="select_tree expected boolean scalar `pred`"):
    jmp.select_tree(pred, {"a": jnp.ones(2)}, {"a": jnp.zeros(2)})
  with pytest.raises(AssertionError, match="adjust expected boolean scalar `grads_finite`"):
    jmp.DynamicLossScale(2.0).adjust(pred)


def test_select_tree_refuses_leaves_of_two_dtypes_as_jmps_does():
  a, b = {"w": jnp.ones(2, jnp.float16)}, {"w": jnp.zeros(2, jnp.float32)}
  with pytest.raises(TypeError):
    real_jmp.select_tree(jnp.bool_(True), a, b)
  with pytest.raises(TypeError, match=r"one dtype, got float16 and float32 at \['w'\]"):
    jmp.select_tree(jnp.bool_(True), a, b)


def test_all_finite_catches_a_nan_that_a_cpu_max_reduction_drops():
  grads = {"w": jnp.ones(8192).at[5000].set(jnp.nan), "e4m3": jnp.ones(3, jnp.float8_e4m3fn)}
  assert not jmp.all_finite(grads)
  assert jmp.all_finite({"w": jnp.ones(8192), "step": jnp.int32(3), "none": None})


def test_a_haiku_style_step_skips_an_overflowed_step_bit_identically():
  policy = jmp.get_policy("p=f32,c=f16,o=f32")
  optimizer = optax.adam(1e-2)

  @jax.jit
  def train_step(params, opt_state, loss_scale, x):
    def loss_fn(params):
      w, x16 = policy.cast_to_compute((params["w"], x))
      return loss_scale.scale(policy.cast_to_output(jnp.sum((w * x16) ** 2)))

    grads = policy.cast_to_param(loss_scale.unscale(jax.grad(loss_fn)(params)))
    grads_finite = jmp.all_finite(grads)
    loss_scale = loss_scale.adjust(grads_finite)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    params, opt_state = jmp.select_tree(
        grads_finite, (optax.apply_updates(params, updates), new_opt_state), (params, opt_state))
    return params, opt_state, loss_scale

  params = {"w": jnp.linspace(0.5, 1.0, 4)}
  opt_state = optimizer.init(params)
  loss_scale = jmp.DynamicLossScale(jnp.float32(2.0**10), min_loss_scale=1.0)
  small, large = jnp.full(4, 0.25), jnp.full(4, 64.0)
  # Once, so that the optimizer state is not its initial one.
  params, opt_state, loss_scale = train_step(params, opt_state, loss_scale, small)
  assert int(loss_scale.counter) == 1
  # The float16 cotangent 2 * w * x * 2**10 of w * x is finite for x = 0.25, inf for 64.
  skipped = train_step(params, opt_state, loss_scale, large)
  assert_bitwise_equal(skipped[:2], (params, opt_state))
  assert (skipped[2].loss_scale, skipped[2].counter) == (2.0**9, 0)
  applied = train_step(params, opt_state, loss_scale, small)
  assert not np.array_equal(applied[0]["w"], params["w"])
  assert int(applied[1][0].count) == 2 and int(applied[2].counter) == 2


def test_half_dtype_makes_a_half_precision_scalar_as_jmps():
  # jmp's README: jmp.DynamicLossScale(jmp.half_dtype()(2 ** 15)); it was a NumPy dtype.
  assert float(jmp.DynamicLossScale(jmp.half_dtype()(2**15)).loss_scale) == 2**15


GIVEN = {"python-int": lambda: 2**15, "python-float": lambda: 2.0**15,
         "float16": lambda: jnp.float16(2**15), "weak-float32": lambda: jnp.asarray(2.0**15),
         "float32": lambda: jnp.float32(2**15), "np.float16": lambda: np.float16(2**15),
         "np.float64": lambda: np.float64(2**15), "weak-int32": lambda: jnp.asarray(2**15),
         "int32": lambda: jnp.int32(2**15), "np.int32": lambda: np.int32(2**15)}
HALF_AND_FULL = {"h": jnp.full(3, 0.5, jnp.float16), "f": jnp.full(3, 0.5, jnp.float32),
                 # integer leaves: jmp keeps them integer times an int, exact and wrapping
                 "i": jnp.array([2**24 + 1, 7, -3], jnp.int32), "i8": jnp.int8([3, -5])}


def assert_scaled_alike(ours, theirs):
  for method in ("scale", "unscale"):
    got, want = (getattr(s, method)(HALF_AND_FULL) for s in (ours, theirs))
    assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
    chex.assert_trees_all_equal(got, want)


@pytest.mark.parametrize("given", GIVEN.values(), ids=GIVEN)
def test_a_static_scale_returns_jmps_dtypes(given):
  # Held in float32, but a float16 leaf times a Python number or a float16 scale stays
  # float16, so a fori_loop carrying float16 parameters through jmp code keeps its types.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jmp's warning for an integer scale
    ours, theirs = jmp.StaticLossScale(given()), real_jmp.StaticLossScale(given())
  assert_scaled_alike(ours, theirs)
  if all(getattr(theirs, m)(HALF_AND_FULL)["h"].dtype == jnp.float16  # jmp's loop works,
         for m in ("scale", "unscale")):  # so must ours
    step = lambda _, p: ours.unscale(jax.grad(lambda p: ours.scale(jnp.sum(p * p)))(p))
    assert jax.lax.fori_loop(0, 2, step, HALF_AND_FULL["h"]).dtype == jnp.float16


@pytest.mark.parametrize("given", [lambda: 2**24 + 1, lambda: jnp.int32(2**24 + 1),
                                   lambda: jnp.asarray(2**24 + 1)])
def test_an_integer_scale_float32_cannot_hold_scales_integer_leaves_exactly(given):
  leaves = {"i": jnp.int32([2**24 + 1, 7, -3]), "i8": jnp.int8([3, -5])}
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jmp's warning for an integer scale
    ours, theirs = jmp.StaticLossScale(given()), real_jmp.StaticLossScale(given())
  got, want = ours.scale(leaves), theirs.scale(leaves)
  assert jax.tree.map(lambda x: x.dtype, got) == jax.tree.map(lambda x: x.dtype, want)
  chex.assert_trees_all_equal(got, want)


def test_a_replaced_integer_scale_scales_by_the_new_value_and_a_vector_scale_broadcasts():
  replaced = dataclasses.replace(jmp.StaticLossScale(2), loss_scale=4)
  chex.assert_trees_all_equal(replaced.scale({"i": jnp.int32([1])}), {"i": jnp.int32([4])})
  assert replaced == jmp.StaticLossScale(4)
  kept = dataclasses.replace(jmp.StaticLossScale(2**24 + 1))  # float32 holds 2**24 only
  chex.assert_trees_all_equal(kept.scale({"i": jnp.int32([1])}), {"i": jnp.int32([2**24 + 1])})
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jmp's warning for an integer scale
    for scale in (np.array([2, 3]), jnp.array([2, 3])):
      chex.assert_trees_all_equal(jmp.StaticLossScale(scale).scale({"f": jnp.ones(2)}),
                                  real_jmp.StaticLossScale(scale).scale({"f": jnp.ones(2)}))


@pytest.mark.parametrize("given", ["python-float", "weak-float32", "float32", "np.float64"])
def test_a_dynamic_scale_returns_float32_products_as_jmps_does_once_adjusted(given):
  # jmp's adjust promotes the scale with its float32 min_loss_scale; unscaled in
  # float16, gradients below 2**-24 would be lost. Ours is float32 from the start, and
  # a fori_loop adjusting it keeps one type, as jmp's does.
  ours = jmp.DynamicLossScale(GIVEN[given](), period=10)
  theirs = real_jmp.DynamicLossScale(GIVEN[given](), period=10).adjust(jnp.bool_(True))
  assert_scaled_alike(ours, theirs)
  looped = jax.lax.fori_loop(0, 3, lambda _, s: s.adjust(jnp.bool_(True)), ours)
  assert int(looped.counter) == 3


def kind(x):
  """A leaf's type as jmp's users meet it: Python, NumPy or JAX, dtype, weak or strong."""
  if isinstance(x, jax.Array):
    return f"jax.Array[{x.dtype}{', weak' if x.weak_type else ''}]"
  if isinstance(x, (np.ndarray, np.generic)):
    return f"{type(x).__name__}[{x.dtype}]"
  return type(x).__name__


LEAVES = {"python-float": 0.5, "python-int": 3, "np.float32": np.float32(0.5),
          "np.float16": np.float16(0.5), "np.ndarray": np.ones(2, np.float32),
          "weak-float32": jnp.asarray(0.5), "float32": jnp.ones(2),
          "float16": jnp.ones(2, jnp.float16)}


@pytest.mark.parametrize("given", GIVEN.values(), ids=GIVEN)
def test_a_static_scale_returns_jmps_types_python_numpy_or_jax_weak_or_strong(given):
  # A Python float scale times a Python float is a Python float, a JAX scale times a
  # NumPy array a JAX array, a Python number times a weak array stays weak: as jmp's.
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # jmp's warning for an integer scale
    ours, theirs = jmp.StaticLossScale(given()), real_jmp.StaticLossScale(given())
  assert kind(ours.loss_scale) == kind(theirs.loss_scale)
  for method in ("scale", "unscale"):
    got, want = (getattr(s, method)(LEAVES) for s in (ours, theirs))
    assert jax.tree.map(kind, got) == jax.tree.map(kind, want)
    chex.assert_trees_all_equal(jax.tree.map(np.asarray, got), jax.tree.map(np.asarray, want))


@pytest.mark.parametrize("given", ["python-float", "weak-float32", "float32", "np.float64"])
def test_a_dynamic_scale_returns_jax_arrays_as_jmps_does_once_adjusted(given):
  ours = jmp.DynamicLossScale(GIVEN[given]())
  theirs = real_jmp.DynamicLossScale(GIVEN[given]()).adjust(jnp.bool_(True))
  assert kind(ours.loss_scale) == kind(theirs.loss_scale) == "jax.Array[float32]"
  floats = {k: v for k, v in LEAVES.items() if "16" not in k}  # float16 stays float32 here
  for method in ("scale", "unscale"):
    got, want = (getattr(s, method)(floats) for s in (ours, theirs))
    assert jax.tree.map(kind, got) == jax.tree.map(kind, want)


def test_casts_leave_numpy_scalars_and_python_numbers_alone_as_jmps_do():
  for name in ("p=f32,c=f16,o=f32", "half", "p=f16,c=f32"):
    ours, theirs = jmp.get_policy(name), real_jmp.get_policy(name)
    for cast in ("cast_to_param", "cast_to_compute", "cast_to_output"):
      got, want = getattr(ours, cast)(LEAVES), getattr(theirs, cast)(LEAVES)
      assert jax.tree.map(kind, got) == jax.tree.map(kind, want)
  for cast in ("cast_to_full", "cast_to_half"):
    got, want = getattr(jmp, cast)(LEAVES), getattr(real_jmp, cast)(LEAVES)
    assert jax.tree.map(kind, got) == jax.tree.map(kind, want)
  assert jmp.cast_to_half({"x": np.float32(0.5)})["x"].dtype == np.float32


def test_select_tree_returns_jax_arrays_as_jmps_does():
  a = {"f": 1.0, "i": 2, "n": np.float32(3.0), "w": jnp.asarray(4.0), "h": jnp.ones(2, jnp.float16)}
  b = {**jax.tree.map(lambda x: x * 2, a), "f": 1.0, "n": np.float32(3.0)}  # equal ones too
  for pred in (jnp.bool_(True), jnp.bool_(False)):
    got, want = jmp.select_tree(pred, a, b), real_jmp.select_tree(pred, a, b)
    assert jax.tree.map(kind, got) == jax.tree.map(kind, want)
    chex.assert_trees_all_equal(got, want)
