"""What the probes' framework interception relies on in flax linen, flax NNX and equinox.

Each test pins one behaviour of a framework that `probes._intercept` hooks, on the versions
this suite runs with; a failure names the framework and what changed.
"""

import equinox as eqx
import flax
import jax
import jax.numpy as jnp
import pytest
from flax import linen
from flax import nnx
from jax import lax

from jax_lossscale.probes import _intercept as intercept

FLAX = f"flax {flax.__version__}"
EQUINOX = f"equinox {eqx.__version__}"


# --- flax linen ---------------------------------------------------------------------


class LinenInner(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(2, name="dense")(x)


class LinenOuter(linen.Module):
  @linen.compact
  def __call__(self, x):
    return LinenInner(name="inner")(x) + 1


def test_linen_intercept_methods_gives_each_call_its_module_and_method_and_can_change_it():
  model = LinenOuter()
  x = jnp.ones((1, 2))
  params = model.init(jax.random.key(0), x)
  seen = []

  def on_call(module, method_name, call):
    seen.append((module.path, method_name, type(module.parent).__name__))
    out = call()
    return out * 2 if method_name == "__call__" and module.path == ("inner",) else out

  plain = model.apply(params, x)
  with intercept.linen_calls(on_call):
    hooked = model.apply(params, x)
  assert ("inner", "dense") in [path for path, _, _ in seen], (
      f"{FLAX}: nn.intercept_methods no longer reaches submodules with their `path`, "
      f"which the linen adapter names probes by: {seen}")
  assert ((), "__call__", "Scope") in seen and (("inner",), "__call__", "LinenOuter") in seen, (
      f"{FLAX}: a module's `parent` (a Scope for the model applied) changed: {seen}")
  assert jnp.allclose(hooked - 1, 2 * (plain - 1)), (
      f"{FLAX}: the interceptor's return value no longer replaces the method's output")
  assert jnp.array_equal(model.apply(params, x), plain)  # nothing left after the context


# --- flax NNX -----------------------------------------------------------------------


class NnxLayer(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(2, 2, rngs=rngs)

  def __call__(self, x):
    return self.linear(x)


class NnxScaled(NnxLayer):
  def __call__(self, x):
    return 3 * super().__call__(x)


def stack(rngs, n=3):
  return nnx.split_rngs(splits=n)(nnx.vmap(in_axes=(0,), out_axes=0)(NnxLayer))(rngs)


def test_nnx_calls_go_through_the_class_call_set_for_the_pass_inside_its_transforms():
  model = stack(nnx.Rngs(0))
  calls = []

  def on_call(module, call, args, kwargs):
    calls.append(type(module).__name__)
    return call(*args, **kwargs)

  run = nnx.scan(lambda h, m: m(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  jitted = nnx.jit(lambda m, x: run(x, m))
  before = nnx.graphdef(model)
  with intercept.calls_wrapped({NnxLayer, NnxScaled}, on_call):
    jitted(model, jnp.ones((1, 2)))
    NnxScaled(nnx.Rngs(1))(jnp.ones((1, 2)))  # once, not again through super().__call__
  assert calls == ["NnxLayer", "NnxScaled"], (
      f"{FLAX}: an NNX module's call under nnx.jit and nnx.scan no longer goes through "
      f"type(module).__call__, which the NNX adapter replaces: {calls}")
  assert "__call__" in vars(NnxLayer) and not hasattr(NnxLayer.__call__, intercept.MARK)
  assert nnx.graphdef(model) == before


def test_nnx_an_array_set_on_a_stacked_module_is_sliced_with_its_params_and_leaves_no_trace():
  model = stack(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rows = []

  def body(h, m):
    rows.append(intercept.nnx_annotation(m, "index"))
    return m(h) + intercept.nnx_annotation(m, "index"), None

  with intercept.nnx_annotated([(model, {"index": jnp.arange(3), "name": "layers"})]):
    assert intercept.nnx_annotation(model, "name") == "layers"
    params = nnx.state(model, nnx.Param)
    out = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
        jnp.zeros((1, 2)), model)[0]
  assert [jnp.shape(row) for row in rows] == [()], (
      f"{FLAX}: an nnx.Variable set as a module's attribute is no longer sliced by nnx.scan "
      "with the module's params, which gives a stacked layer its row index")
  assert jax.tree.structure(params) == jax.tree.structure(nnx.state(model, nnx.Param))
  plain = nnx.scan(lambda h, m: (m(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
      jnp.zeros((1, 2)), model)[0]
  assert out.shape == plain.shape
  assert nnx.graphdef(model) == graphdef, (
      f"{FLAX}: deleting the attributes no longer gives back the module's graph")
  assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state)


def test_overlapping_probing_contexts_keep_a_class_patched_until_the_last_one_leaves():
  # Two threads tracing at once: the first to finish restored the class while the other
  # still traced, whose probes then went unreached or unmeasured.
  class Layer(nnx.Module):
    def __call__(self, x):
      return x

  original = Layer.__call__
  def on_call(module, call, args, kwargs):
    return call(*args, **kwargs)

  first = intercept.calls_wrapped({Layer}, on_call)
  second = intercept.calls_wrapped({Layer}, on_call)
  first.__enter__()
  second.__enter__()
  first.__exit__(None, None, None)
  assert Layer.__call__ is not original and getattr(Layer.__call__, intercept.MARK)
  second.__exit__(None, None, None)
  assert Layer.__call__ is original


# --- equinox ------------------------------------------------------------------------


def test_equinox_calls_go_through_the_class_call_set_for_the_pass():
  mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
  calls = []

  def on_call(module, call, args, kwargs):
    calls.append(type(module).__name__)
    return call(*args, **kwargs)

  with intercept.calls_wrapped({eqx.nn.MLP, eqx.nn.Linear}, on_call):
    jax.vmap(mlp)(jnp.ones((3, 2)))
  assert calls == ["MLP", "Linear", "Linear"], (
      f"{EQUINOX}: a module's call no longer goes through type(module).__call__ set on the "
      f"class after it was made, which the equinox adapter replaces: {calls}")
  assert "__call__" in vars(eqx.nn.Linear) and not hasattr(eqx.nn.Linear.__call__, intercept.MARK)


def test_equinox_a_view_reads_as_its_module_and_its_index_is_sliced_by_a_scan():
  View = intercept.equinox_view_class()
  layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))(jax.random.split(
      jax.random.key(0), 3))
  seen = []

  def on_output(out, index, tag):
    seen.append((jnp.shape(index), tag))
    return out

  view = View(layers, jnp.arange(3), "layers", on_output)
  assert isinstance(view, eqx.nn.Linear) and view.in_features == 2, (
      f"{EQUINOX}: a Module's `__class__` property or `__getattr__` no longer reads through")
  dynamic, static = eqx.partition(view, eqx.is_array)
  lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), jnp.ones(2), dynamic)
  eqx.filter_jit(lambda v, x: v(x))(
      jax.tree.map(lambda a: a[0], view), jnp.ones(2))
  assert seen == [((), "layers"), ((), "layers")], (
      f"{EQUINOX}: a view's fields no longer split, scan and jit as a module's: {seen}")


def test_equinox_modules_of_the_model_are_found_at_call_time_by_their_arrays():
  mlp = eqx.nn.MLP(2, 2, 4, 1, key=jax.random.key(0))
  other = eqx.nn.Linear(2, 2, key=jax.random.key(1))
  found = []

  def on_call(module, path):
    found.append(tuple(str(key) for key in path))
    return module

  with intercept.equinox_calls(mlp, on_call):
    mlp.layers[1](mlp.layers[0](jnp.ones(2)))
    other(jnp.ones(2))
  assert found == [(".layers", "[0]"), (".layers", "[1]")], (
      f"{EQUINOX}: a module's arrays no longer keep their identity in its tree, or its "
      f"layers' key paths changed: {found}")


# --- the first pass -----------------------------------------------------------------


def test_the_first_pass_is_retried_only_without_options_that_a_failed_attempt_used():
  tried = []

  def attempt(options, used):
    tried.append(options)
    if options.views:
      used.add("views")
      raise ValueError("the view")
    return "found"

  assert intercept.first_pass(attempt) == (intercept.Options(True, False), "found")
  assert tried == [intercept.Options(True, True), intercept.Options(True, False)]

  def failing(options, used):
    del options, used
    raise KeyError("the loss's own")

  with pytest.raises(KeyError, match="the loss's own"):
    intercept.first_pass(failing)
