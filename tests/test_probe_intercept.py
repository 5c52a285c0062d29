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


def named(modules):
  return [(module, {"name": "/".join(map(str, path))}) for path, module in modules.items()]


def test_nnx_the_copys_layers_keep_their_probed_class_inside_nnx_jit_and_nnx_scan():
  model = stack(nnx.Rngs(0))
  calls = []

  def on_call(module, call, args, kwargs):
    calls.append((type(module).__name__, intercept.nnx_annotation(module, "name")))
    return call(*args, **kwargs)

  run = nnx.scan(lambda h, m: m(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
  jitted = nnx.jit(lambda m, x: run(x, m))
  before, call = nnx.graphdef(model), NnxLayer.__call__
  with intercept.nnx_probed(model, on_call, named) as copy:
    assert type(copy) is copy.__class__ and isinstance(copy, NnxLayer)
    assert NnxLayer.__call__ is call
    jitted(copy, jnp.ones((1, 2)))
    scaled = NnxScaled(nnx.Rngs(1))
    with intercept.nnx_probed(scaled, on_call, named) as scaled_copy:
      scaled_copy(jnp.ones((1, 2)))  # once, not again through super().__call__
  assert calls == [("ProbedNnxLayer", ""), ("ProbedLinear", "linear"),
                   ("ProbedNnxScaled", ""), ("ProbedLinear", "linear")], (
      f"{FLAX}: a module of a subclass, made by assigning its `__class__`, is no longer "
      f"remade of that subclass, with its attributes, by nnx.jit and nnx.scan: {calls}")
  assert type(copy) is NnxLayer and nnx.graphdef(model) == before


def test_nnx_an_array_set_on_a_stacked_module_is_sliced_with_its_params_and_leaves_no_trace():
  model = stack(nnx.Rngs(0))
  graphdef, state = nnx.split(model)
  rows = []

  def body(h, m):
    rows.append(intercept.nnx_annotation(m, "index"))
    return m(h) + intercept.nnx_annotation(m, "index"), None

  def annotations(modules):
    return [(modules[()], {"index": jnp.arange(3), "name": "layers"})]

  with intercept.nnx_probed(model, lambda m, call, a, k: call(*a, **k), annotations) as copy:
    assert intercept.nnx_annotation(copy, "name") == "layers"
    params = nnx.state(copy, nnx.Param)
    out = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
        jnp.zeros((1, 2)), copy)[0]
  assert [jnp.shape(row) for row in rows] == [()], (
      f"{FLAX}: an nnx.Variable set as a module's attribute is no longer sliced by nnx.scan "
      "with the module's params, which gives a stacked layer its row index")
  assert jax.tree.structure(params) == jax.tree.structure(nnx.state(model, nnx.Param))
  plain = nnx.scan(lambda h, m: (m(h), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))(
      jnp.zeros((1, 2)), model)[0]
  assert out.shape == plain.shape
  assert nnx.graphdef(model) == graphdef, (
      f"{FLAX}: the copy's attributes reached the model")
  assert jax.tree.structure(nnx.state(model)) == jax.tree.structure(state)


def test_nnx_what_the_loss_changes_in_the_copy_reaches_the_model():
  class Normed(nnx.Module):
    def __init__(self, rngs):
      self.norm = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
      return self.norm(x)

  model = Normed(nnx.Rngs(0))
  with intercept.nnx_probed(model, lambda m, call, a, k: call(*a, **k), named) as copy:
    copy(jnp.arange(6.0).reshape(3, 2))
    copy.norm.calls = nnx.Variable(jnp.ones(()))
  assert jnp.allclose(model.norm.mean[...], 0.01 * jnp.array([2.0, 3.0])), (  # momentum 0.99
      f"{FLAX}: nnx.split and nnx.merge no longer share the model's Variables")
  assert model.norm.calls[...] == 1, (
      f"{FLAX}: nnx.update no longer gives the model a Variable added to the copy")
  assert type(model.norm) is nnx.BatchNorm and not hasattr(model.norm, "_probe_name")


# --- equinox ------------------------------------------------------------------------


def test_equinox_a_probed_module_reads_as_its_module_and_its_index_is_sliced_by_a_scan():
  layers = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))(jax.random.split(
      jax.random.key(0), 3))
  seen = []

  def on_output(out, module):
    seen.append((jnp.shape(module.probe_index), module.probe_tag))
    return out

  probed = intercept.equinox_probed(layers, jnp.arange(3), "layers", on_output)
  assert type(probed) is probed.__class__ and isinstance(probed, eqx.nn.Linear)
  assert probed.in_features == 2 and probed.weight is layers.weight, (
      f"{EQUINOX}: a Module subclass's instance made by setting its fields lost them")
  dynamic, static = eqx.partition(probed, eqx.is_array)
  lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), jnp.ones(2), dynamic)
  eqx.filter_jit(lambda v, x: v(x))(jax.tree.map(lambda a: a[0], probed), jnp.ones(2))
  assert seen == [((), "layers"), ((), "layers")], (
      f"{EQUINOX}: a probed module's fields no longer split, scan and jit as a module's: "
      f"{seen}")
  assert "probe_index" not in vars(eqx.nn.Linear) and not hasattr(
      eqx.nn.Linear.__call__, intercept.MARK)


def test_equinox_combining_a_probed_module_with_its_modules_static_part_is_recognized():
  # The first pass gives the probed copy up on this error only.
  linear = eqx.nn.Linear(2, 2, key=jax.random.key(0))
  probed = intercept.equinox_probed(linear, None, "linear", lambda out, module: out)
  static = eqx.partition(linear, eqx.is_array)[1]
  with pytest.raises(ValueError) as raised:
    eqx.combine(probed, static)
  assert intercept.refuses_probed_modules(raised.value), (
      f"{EQUINOX}, jax {jax.__version__}: the pytree structure error no longer names the "
      f"probed class: {raised.value}")
  assert not intercept.refuses_probed_modules(ValueError("a loss's own"))


# --- the first pass -----------------------------------------------------------------


def test_the_first_pass_gives_up_the_probed_copy_only_when_the_loss_refuses_it():
  tried = []
  linear = eqx.nn.Linear(2, 2, key=jax.random.key(0))
  probed = intercept.equinox_probed(linear, None, "linear", lambda out, module: out)

  def attempt(options):
    tried.append(options)
    if options.probed_copy:
      eqx.combine(probed, eqx.partition(linear, eqx.is_array)[1])
    return "found", intercept.Found()

  assert intercept.first_pass(attempt) == (intercept.Options(True, False), "found")
  assert tried == [intercept.Options(True, True), intercept.Options(True, False)]


def test_the_first_pass_raises_any_other_error_at_once():
  tried = []

  def failing(options):
    tried.append(options)
    raise ValueError("the loss's own")

  with pytest.raises(ValueError, match="the loss's own"):
    intercept.first_pass(failing)
  assert tried == [intercept.Options(True, True)]


def test_the_first_pass_is_traced_again_without_rows_after_a_stack_of_stacks():
  tried = []

  def attempt(options):
    tried.append(options)
    return "found", intercept.Found(nested=options.rows)

  assert intercept.first_pass(attempt) == (intercept.Options(False, True), "found")
  assert tried == [intercept.Options(True, True), intercept.Options(False, True)]


def test_the_first_pass_gives_equinox_layers_row_indices_only_after_finding_a_scanned_stack():
  # The index is an integer array the loss would see in every layer whose arrays share a
  # leading axis (a Linear's weight and bias): it is added only where a scan needs it.
  tried = []

  def attempt(options):
    tried.append(options)
    return "found", intercept.Found(scanned=frozenset({"blocks", "blocks/linear"}))

  indexed = intercept.Options(True, True, frozenset({"blocks", "blocks/linear"}))
  assert intercept.first_pass(attempt) == (indexed, "found")
  assert tried == [intercept.Options(True, True), indexed]
  tried.clear()
  assert intercept.first_pass(lambda options: (tried.append(options), ("found", intercept.Found()))[
      1]) == (intercept.Options(True, True), "found")
  assert tried == [intercept.Options(True, True)]
