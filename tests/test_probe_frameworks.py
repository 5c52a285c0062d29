"""Probes placed automatically on every module's output: flax linen and flax NNX.

Each stack trains a small float16 model with probes, names the layers by their paths,
gives stacked (scanned) layers one row each where the framework lets an index ride
along, and locates an overflow injected into one layer's backward pass.
"""

import threading

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx
from helpers import assert_trees_close
from helpers import float16_normal
from helpers import hits_like_unprobed
from helpers import mse
from helpers import scale_backward

from jax_lossscale import diagnostics
from jax_lossscale import probes as pr

F16 = jnp.float16
X, Y = float16_normal(0, (16, 4)), float16_normal(1, (16, 2))


# --- flax linen ---------------------------------------------------------------------


class LinenBlock(linen.Module):
  overflow: bool = False

  @linen.compact
  def __call__(self, x):
    h = linen.relu(linen.Dense(8, dtype=F16, name="dense")(x))
    return scale_backward(h, jnp.float32(jnp.inf if self.overflow else 1.0))


class LinenMLP(linen.Module):
  overflow_at: int = -1

  @linen.compact
  def __call__(self, x):
    for i in range(3):
      x = LinenBlock(overflow=i == self.overflow_at, name=f"layer_{i}")(x)
    return linen.Dense(2, dtype=F16, name="out")(x)


def linen_loss(params, model, x, y):
  return mse(model.apply({"params": params}, x), y)


def test_linen_trains_with_a_probe_on_every_module_named_by_its_path():
  model = LinenMLP()
  params = model.init(jax.random.key(0), X)["params"]
  tx = optax.adam(1e-2)
  grad_fn = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(linen_loss))

  @jax.jit
  def step(params, opt_state):
    loss, grads, probes = grad_fn(params, model, X, Y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, probes, grads

  opt_state, losses = tx.init(params), []
  for _ in range(10):
    params, opt_state, loss, probes, grads = step(params, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  # The model's own output is its `out` layer's: measured once, as "out".
  assert list(probes) == ["layer_0/dense", "layer_0", "layer_1/dense", "layer_1",
                          "layer_2/dense", "layer_2", "out"]
  assert all(int(probes[name].hits) == 1 for name in probes)


def test_linen_a_module_output_that_is_not_an_array_is_passed_on_unmeasured():
  class Tagged(linen.Module):
    @linen.compact
    def __call__(self, x):
      return jnp.tanh(linen.Dense(2, dtype=F16, name="dense")(x)), "tag"

  class Model(linen.Module):
    @linen.compact
    def __call__(self, x):
      y, tag = Tagged(name="tagged")(x)
      assert tag == "tag"
      return y

  model = Model()
  params = model.init(jax.random.key(0), X)["params"]
  probed = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(linen_loss))
  _, grads, probes = probed(params, model, X, Y)
  assert list(probes) == ["tagged/dense", "tagged/0"] and int(probes["tagged/0"].hits) == 1
  chex.assert_trees_all_equal(grads, jax.grad(linen_loss)(params, model, X, Y))


def test_linen_an_overflow_in_layer_1_backward_pass_is_named_layer_1():
  model = LinenMLP(overflow_at=1)
  params = model.init(jax.random.key(0), X)["params"]
  grad_fn = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(linen_loss))
  probes = grad_fn(params, model, X, Y)[2]
  assert diagnostics.backward_overflow_origin(probes) == "layer_1"


def test_linen_modules_under_lifted_transforms_are_named_by_their_path_in_the_params():
  # A module cloned by a lifted transform has a Scope for parent: it was taken for a model
  # of its own, and the model applied for a second one ("M/Dense_0", "Dense/..."). A
  # scanned module sums its layers into one row: linen's scan carries no index.
  class Lifted(linen.Module):
    @linen.compact
    def __call__(self, x):
      body = lambda block, h, _: (block(h), None)
      scan = linen.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=2)
      h = scan(LinenBlock(name="blocks"), x, None)[0]
      h = linen.remat(linen.Dense)(8, dtype=F16)(h)
      return linen.Dense(8, dtype=F16)(linen.tanh(h))

  model, x = Lifted(), jnp.ones((2, 8), F16)
  params = model.init(jax.random.key(0), x)["params"]
  probes = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(linen_loss))(
      params, model, x, x)[2]
  assert list(probes) == ["blocks/dense", "blocks", "CheckpointDense_0", "Dense_0"]
  assert int(probes["blocks"].hits) == 2 and probes["blocks"].hits.shape == ()
  assert set(params) == {"blocks", "CheckpointDense_0", "Dense_0"}


class LinenInner(linen.Module):
  @linen.compact
  def __call__(self, x):
    return jnp.tanh(linen.Dense(4, name="d2")(jnp.tanh(linen.Dense(4, name="d1")(x))))


class LinenShared(linen.Module):
  def setup(self):
    self.inner = LinenInner()
    linen.share_scope(self, self.inner)
    self.head = linen.Dense(4)

  def __call__(self, x):
    return self.head(jnp.tanh(self.inner(x)))


class LinenEncoderDecoder(linen.Module):
  def setup(self):
    self.encoder, self.decoder = LinenInner(), LinenInner()

  def __call__(self, x):
    return self.decoder(jnp.tanh(self.encoder(x)))


def test_linen_a_shared_scope_or_a_method_given_as_a_function_keeps_the_param_paths():
  # A module sharing its parent's scope has an empty path too, and was taken for a second
  # model ("LinenShared/head"); a model applied through `method=lambda m, x: ...` had none
  # called, and each submodule was taken for a model of its own ("LinenInner/encoder").
  x = jnp.ones((2, 4))
  for model, method, expected in [
      (LinenShared(), None, ["d1", "d2", "LinenInner", "head"]),  # the inner: no path
      (LinenEncoderDecoder(), lambda m, x: m.decoder(jnp.tanh(m.encoder(x))),
       ["encoder/d1", "encoder/d2", "encoder", "decoder/d1", "decoder/d2", "decoder"])]:
    params = model.init(jax.random.key(0), x, method=method)["params"]
    loss = lambda p, x, model=model, method=method: jnp.sum(
        model.apply({"params": p}, x, method=method) ** 2)
    probes = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(loss))(
        params, x)[2]
    assert [name for name, _ in diagnostics.layers(probes)] == expected


def test_linen_probes_change_neither_the_unmeasured_program_nor_the_gradients():
  model = LinenMLP()
  params = model.init(jax.random.key(0), X)["params"]
  jaxpr = lambda f: str(jax.make_jaxpr(jax.grad(f), static_argnums=1)(params, model, X, Y))
  assert jaxpr(pr.linen_probes(linen_loss)) == jaxpr(linen_loss)
  _, grads, _ = pr.value_and_grad_with_probes(jax.value_and_grad, pr.linen_probes(linen_loss))(
      params, model, X, Y)
  chex.assert_trees_all_equal(grads, jax.grad(linen_loss)(params, model, X, Y))



class LinenGenerator(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(2, dtype=F16)(linen.tanh(linen.Dense(8, dtype=F16)(x)))


class LinenCritic(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(1, dtype=F16)(linen.relu(linen.Dense(8, dtype=F16)(x)))


def test_linen_a_second_model_in_the_loss_is_named_under_its_class():
  # A generator and a discriminator both have a `Dense_0`: their probes were summed under
  # one name, mixing two unrelated tensors.
  generator, critic = LinenGenerator(), LinenCritic()
  g_params = generator.init(jax.random.key(0), X)
  c_params = critic.init(jax.random.key(1), jnp.ones((16, 2), F16))
  loss = lambda g, c, x: jnp.mean(critic.apply(c, generator.apply(g, x)).astype(jnp.float32))
  value, grads, probes = pr.value_and_grad_with_probes(
      jax.value_and_grad, pr.linen_probes(loss), argnums=(0, 1))(g_params, c_params, X)
  chex.assert_trees_all_equal((value, grads), jax.value_and_grad(loss, (0, 1))(
      g_params, c_params, X))
  assert [(name, int(s.hits)) for name, s in diagnostics.layers(probes)] == [
      ("Dense_1", 1), ("Dense_0", 1), ("LinenCritic/Dense_1", 1), ("LinenCritic/Dense_0", 1)]

# --- flax NNX -----------------------------------------------------------------------


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, dtype=F16, rngs=rngs)
    self.factor = nnx.Variable(jnp.ones(()))  # inf: an overflow in this layer

  def __call__(self, x):
    return scale_backward(nnx.relu(self.linear(x)), self.factor[...])


class NnxModel(nnx.Module):
  """An embedding, three stacked blocks run by nnx.scan, and an output layer."""

  def __init__(self, rngs):
    self.embed = nnx.Linear(4, 8, dtype=F16, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return NnxBlock(rngs)

    self.blocks = blocks(rngs)
    self.out = nnx.Linear(8, 2, dtype=F16, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return block(h)

    return self.out(run(self.embed(x), self.blocks))


def nnx_loss(model, x, y):
  return mse(model(x), y)


@nnx.jit
def nnx_step(model, optimizer, x, y):
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(nnx_loss))
  loss, grads, probes = grad_fn(model, x, y)
  optimizer.update(model, grads)
  return loss, probes


def test_nnx_trains_with_a_probe_on_every_module_and_one_row_per_stacked_block():
  model = NnxModel(nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  graphdef = nnx.graphdef(model)
  losses = []
  for _ in range(10):
    loss, probes = nnx_step(model, optimizer, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert list(probes) == ["embed", "blocks/linear", "blocks", "out"]  # the model's is out's
  assert list(np.asarray(probes["blocks"].hits)) == [1, 1, 1]
  assert probes.lengths == (None, 3, 3, None)
  # Nothing of the probes is left on the model or its classes.
  assert nnx.graphdef(model) == graphdef
  assert not hasattr(NnxBlock.__call__, "_probes_output")


def test_nnx_an_overflow_in_the_second_stacked_block_is_named_by_its_row():
  model = NnxModel(nnx.Rngs(0))
  model.blocks.factor[...] = jnp.array([1.0, jnp.inf, 1.0])
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(nnx_loss))
  _, grads, probes = grad_fn(model, X, Y)
  chex.assert_trees_all_equal_structs(grads, nnx.state(model, nnx.Param))
  assert diagnostics.backward_overflow_origin(probes) == "blocks[1]"


class NnxEncoderDecoder(nnx.Module):
  """Two stacks of three blocks each (the decoder's rematerialized), one after the other."""

  def __init__(self, rngs):
    self.embed = nnx.Linear(4, 8, dtype=F16, rngs=rngs)
    stack = nnx.split_rngs(splits=3)(nnx.vmap(in_axes=(0,), out_axes=0)(NnxBlock))
    self.encoder, self.decoder = stack(rngs), stack(rngs)

  def __call__(self, x):
    run = lambda call: nnx.scan(lambda h, b: call(b, h), in_axes=(nnx.Carry, 0),
                                out_axes=nnx.Carry)
    h = run(lambda b, h: b(h))(self.embed(x), self.encoder)
    return run(nnx.remat(lambda b, h: b(h)))(h, self.decoder)


def test_nnx_two_stacks_of_one_depth_are_read_in_forward_order():
  # Consecutive stacked probes of one length were taken for one scan's: encoder and
  # decoder rows interleaved, and the decoder's first block was named encoder[1].
  model = NnxEncoderDecoder(nnx.Rngs(0))
  model.decoder.factor[...] = jnp.array([jnp.inf, 1.0, 1.0])
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(nnx_loss))
  _, _, probes = grad_fn(model, X, jnp.zeros((16, 8)))
  rows = lambda stack: [f"{stack}{p}[{i}]" for i in range(3) for p in ("/linear", "")]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      "embed", *rows("encoder"), *rows("decoder"), "NnxEncoderDecoder"]
  assert diagnostics.backward_overflow_origin(probes) == "decoder[0]"


class NnxLayer(nnx.Module):
  def __init__(self, rngs):
    self.linear = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.linear(x))


def nnx_stack(cls, n, rngs):
  return nnx.split_rngs(splits=n)(nnx.vmap(in_axes=(0,), out_axes=0)(cls))(rngs)


def nnx_run(stack, h):
  return nnx.scan(lambda h, m: m(h), in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(h, stack)


class NnxGroup(nnx.Module):
  def __init__(self, rngs):
    self.layers = nnx_stack(NnxLayer, 2, rngs)

  def __call__(self, x):
    return nnx_run(self.layers, x)


def test_nnx_a_stack_of_stacks_is_probed_with_its_layers_summed():
  # It failed with IndexError: the outer scan sliced the inner modules' row index,
  # which the inner scan then sliced again.
  model = nnx_stack(NnxGroup, 3, nnx.Rngs(0))
  loss = lambda m, x: jnp.sum(nnx_run(m, x))
  assert hits_like_unprobed(nnx.value_and_grad, pr.nnx_probes, loss, model,
                            jnp.ones((4, 8))) == [
      ("layers/linear", 6), ("layers", 6), ("NnxGroup", 3)]


class NnxCell(nnx.Module):
  """An RNN over time: one square `nnx.Linear` (its kernel and bias share a leading axis,
  as a stack's would), broadcast to every step by `nnx.StateAxes({nnx.Param: None})`."""

  def __init__(self, rngs):
    self.cell = nnx.Linear(4, 4, rngs=rngs)

  def __call__(self, xs):
    @nnx.scan(in_axes=(nnx.StateAxes({nnx.Param: None}), nnx.Carry, 0),
              out_axes=(nnx.Carry, 0))
    def step(cell, h, x):
      h = jnp.tanh(cell(h) + x)
      return h, h

    return step(self.cell, jnp.zeros(xs.shape[1:]), xs)[0]


class NnxNormedStack(nnx.Module):
  """Three stacked blocks with batch statistics, scanned with the `nnx.StateAxes` of the
  flax guide's scan over layers, naming the model's own Variable types."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def blocks(rngs):
      return nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs))

    self.blocks = blocks(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.StateAxes({nnx.Param: 0, nnx.BatchStat: 0}), nnx.Carry),
              out_axes=nnx.Carry)
    def run(block, h):
      return jnp.tanh(block(h))

    return run(self.blocks, x)


@pytest.mark.parametrize("make, x", [(NnxCell, jnp.linspace(0, 1, 24).reshape(3, 2, 4)),
                                     (NnxNormedStack, jnp.linspace(0, 1, 8).reshape(2, 4))],
                         ids=["broadcast cell", "stack with batch statistics"])
def test_nnx_a_scan_whose_state_axes_name_the_models_variables_runs_probed(make, x):
  # The probes' row index of a stacked module is a Variable those filters do not place:
  # NNX refused the scan (ValueError: No axis found for path=('_probe_index',)). The
  # stack's layers are summed instead, as in a stack of stacks.
  loss = lambda m: jnp.mean(m(x) ** 2)
  model, reference = make(nnx.Rngs(0)), make(nnx.Rngs(0))
  value, grads, probes = pr.value_and_grad_with_probes(
      nnx.value_and_grad, pr.nnx_probes(loss))(model)
  expected_value, expected_grads = nnx.value_and_grad(loss)(reference)
  # Equal up to float32 rounding, relative to the largest gradient: a batch norm's bias
  # gradient is a cancellation (1e-9 beside gradients of 1e-2), which the probed
  # program's fusions round otherwise.
  np.testing.assert_allclose(value, expected_value, rtol=1e-6)
  flat = lambda tree: np.concatenate([np.ravel(x) for x in jax.tree.leaves(tree)])
  largest = np.max(np.abs(flat(expected_grads)))
  np.testing.assert_allclose(flat(grads), flat(expected_grads), atol=1e-6 * largest, rtol=0)
  assert_trees_close(nnx.state(model), nnx.state(reference))  # the statistics too
  assert len(diagnostics.layers(probes)) >= 2


def test_nnx_gradients_equal_those_without_probes():
  model = NnxModel(nnx.Rngs(0))
  _, grads, _ = pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(nnx_loss))(
      model, X, Y)
  chex.assert_trees_all_equal(grads, nnx.grad(nnx_loss)(model, X, Y))


def test_nnx_a_module_held_under_two_names_is_one_row_hit_at_each_call():
  # Tied weights: the first pass copied the model as a pytree, which made `c` a module of
  # its own, and the table showed a row `c` "not measured" beside `a`, hit twice.
  class Tied(nnx.Module):
    def __init__(self, rngs):
      self.a, self.b = nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 2, rngs=rngs)
      self.c = self.a

    def __call__(self, x):
      return self.b(self.c(self.a(x)))

  hits = hits_like_unprobed(nnx.value_and_grad, pr.nnx_probes,
                            lambda m, x: m(x).sum(), Tied(nnx.Rngs(0)), jnp.ones((2, 3)))
  assert hits == [("a", 2), ("b", 1)]


def test_nnx_inside_the_probed_loss_every_module_is_of_its_own_type_and_no_class_changes():
  # The probed copy's modules are subclasses of the layers' classes, and no class's
  # `__call__` is replaced, in the loss's thread or in another.
  model = NnxModel(nnx.Rngs(0))
  classes = {path: type(m) for path, m in nnx.iter_modules(model)}
  calls = {cls: vars(cls)["__call__"] for cls in (nnx.Linear, NnxBlock, NnxModel)}
  seen = []

  def unchanged():
    return all(vars(cls)["__call__"] is call for cls, call in calls.items())

  def loss(model, x, y):
    modules = dict(nnx.iter_modules(model))
    seen.append(all(type(m) is m.__class__ and type(m).__name__ == f"Probed{cls.__name__}"
                    and isinstance(m, cls) for path, cls in classes.items()
                    for m in [modules[path]]))
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(unchanged()))
    thread.start()
    thread.join()
    seen.append(elsewhere == [True] and unchanged())
    return nnx_loss(model, x, y)

  pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(loss))(model, X, Y)
  assert seen == [True] * 4  # each pass: the first and the measuring one
  assert {path: type(m) for path, m in nnx.iter_modules(model)} == classes


def test_nnx_an_error_of_the_loss_in_the_first_pass_is_raised_at_once():
  # Not traced again without the stacked blocks' row index: the error is the loss's.
  traces = []

  def loss(model, x, y):
    traces.append(model)
    raise ValueError("the loss's own")

  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pr.nnx_probes(loss))
  with pytest.raises(ValueError, match="the loss's own"):
    grad_fn(NnxModel(nnx.Rngs(0)), X, Y)
  assert len(traces) == 1
