"""Probes placed automatically on every module's output: flax linen, flax NNX, equinox.

Each stack trains a small float16 model with probes, names the layers by their paths,
gives stacked (scanned) layers one row each where the framework lets an index ride
along, and locates an overflow injected into one layer's backward pass.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen
from flax import nnx
from jax import lax

from jax_lossscale import _probe_equinox as pe
from jax_lossscale import _probe_frameworks as pf
from jax_lossscale import _probes as pr
from jax_lossscale import diagnostics

F16 = jnp.float16
X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), F16)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), F16)


@jax.custom_vjp
def scale_backward(x, factor):
  """The identity, whose gradient is multiplied by `factor` (inf: a backward overflow)."""
  return x


scale_backward.defvjp(lambda x, factor: (x, factor),
                      lambda factor, g: (g * factor.astype(g.dtype), jnp.zeros_like(factor)))


def mse(prediction, target):
  return jnp.mean((prediction.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)


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
  grad_fn = pr.value_and_grad_with_probes(jax.value_and_grad, pf.linen_probes(linen_loss))

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


def test_linen_an_overflow_in_layer_1_backward_pass_is_named_layer_1():
  model = LinenMLP(overflow_at=1)
  params = model.init(jax.random.key(0), X)["params"]
  grad_fn = pr.value_and_grad_with_probes(jax.value_and_grad, pf.linen_probes(linen_loss))
  probes = grad_fn(params, model, X, Y)[2]
  assert diagnostics.backward_overflow_origin(probes) == "layer_1"


def test_linen_a_scanned_module_sums_its_layers_into_one_row():
  class Scanned(linen.Module):
    @linen.compact
    def __call__(self, x):
      body = lambda block, h, _: (block(h), None)
      scan = linen.scan(body, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)
      return scan(LinenBlock(name="blocks"), x, None)[0]

  model = Scanned()
  params = model.init(jax.random.key(0), jnp.ones((2, 8), F16))["params"]
  probes = pr.value_and_grad_with_probes(jax.value_and_grad, pf.linen_probes(linen_loss))(
      params, model, jnp.ones((2, 8), F16), jnp.ones((2, 8), F16))[2]
  assert int(probes["blocks"].hits) == 3 and probes["blocks"].hits.shape == ()


def test_linen_probes_change_neither_the_unmeasured_program_nor_the_gradients():
  model = LinenMLP()
  params = model.init(jax.random.key(0), X)["params"]
  jaxpr = lambda f: str(jax.make_jaxpr(jax.grad(f), static_argnums=1)(params, model, X, Y))
  assert jaxpr(pf.linen_probes(linen_loss)) == jaxpr(linen_loss)
  _, grads, _ = pr.value_and_grad_with_probes(jax.value_and_grad, pf.linen_probes(linen_loss))(
      params, model, X, Y)
  chex.assert_trees_all_equal(grads, jax.grad(linen_loss)(params, model, X, Y))


def hits_like_unprobed(value_and_grad, adapter, loss, model, x) -> list[tuple[str, int]]:
  """Each layer's hits, after checking that the probed value and gradients are the
  unprobed ones."""
  value, grads, probes = pr.value_and_grad_with_probes(value_and_grad, adapter(loss))(model, x)
  chex.assert_trees_all_equal((value, grads), value_and_grad(loss)(model, x))
  return [(name, int(s.hits)) for name, s in diagnostics.layers(probes)]


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
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pf.nnx_probes(nnx_loss))
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
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pf.nnx_probes(nnx_loss))
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
  grad_fn = pr.value_and_grad_with_probes(nnx.value_and_grad, pf.nnx_probes(nnx_loss))
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
  assert hits_like_unprobed(nnx.value_and_grad, pf.nnx_probes, loss, model,
                            jnp.ones((4, 8))) == [
      ("layers/linear", 6), ("layers", 6), ("NnxGroup", 3)]


def test_nnx_gradients_equal_those_without_probes():
  model = NnxModel(nnx.Rngs(0))
  _, grads, _ = pr.value_and_grad_with_probes(nnx.value_and_grad, pf.nnx_probes(nnx_loss))(
      model, X, Y)
  chex.assert_trees_all_equal(grads, nnx.grad(nnx_loss)(model, X, Y))


# --- equinox ------------------------------------------------------------------------


class EqxBlock(eqx.Module):
  linear: eqx.nn.Linear
  factor: jax.Array  # inf: an overflow in this layer

  def __init__(self, key):
    self.linear = eqx.nn.Linear(8, 8, key=key)  # float32 weights, float16 activations
    self.factor = jnp.ones(())

  def __call__(self, x):
    return scale_backward(jax.nn.relu(self.linear(x)).astype(F16), self.factor)


class EqxModel(eqx.Module):
  """An embedding, three stacked blocks run by lax.scan, a function and an output."""

  embed: eqx.nn.Linear
  blocks: EqxBlock
  activation: callable
  out: eqx.nn.Linear

  def __init__(self, key):
    keys = jax.random.split(key, 5)
    self.embed = eqx.nn.Linear(4, 8, key=keys[0])
    self.blocks = eqx.filter_vmap(EqxBlock)(keys[1:4])
    self.activation = jax.nn.gelu
    self.out = eqx.nn.Linear(8, 2, key=keys[4])

  def __call__(self, x):
    dynamic, static = eqx.partition(self.blocks, eqx.is_array)
    h = self.embed(x).astype(F16)
    h, _ = lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), h, dynamic)
    return self.out(self.activation(h))


def eqx_loss(model, x, y):
  return mse(jax.vmap(model)(x), y)


def test_equinox_trains_with_a_probed_view_and_one_row_per_stacked_block():
  model = EqxModel(jax.random.key(0))
  tx = optax.adam(1e-2)
  opt_state = tx.init(eqx.filter(model, eqx.is_array))
  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad,
                                          pe.equinox_probes(eqx_loss))

  @eqx.filter_jit
  def step(model, opt_state):
    loss, grads, probes = grad_fn(model, X, Y)
    updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss, probes

  losses = []
  for _ in range(10):
    model, opt_state, loss, probes = step(model, opt_state)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and model.activation is jax.nn.gelu
  assert list(probes) == ["embed", "blocks/linear", "blocks", "out"]  # the model's is out's
  # vmap inside the loss: one hit per example, in each block's own row.
  assert list(np.asarray(probes["blocks"].hits)) == [16, 16, 16]
  assert int(probes["out"].hits) == 16


def test_equinox_an_overflow_in_the_third_stacked_block_is_named_by_its_row():
  model = EqxModel(jax.random.key(0))
  model = eqx.tree_at(lambda m: m.blocks.factor, model, jnp.array([1.0, 1.0, jnp.inf]))
  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad,
                                          pe.equinox_probes(eqx_loss))
  _, grads, probes = grad_fn(model, X, Y)
  chex.assert_trees_all_equal_structs(grads, eqx.filter(model, eqx.is_inexact_array))
  assert diagnostics.backward_overflow_origin(probes) == "blocks[2]"


def test_equinox_two_stacks_of_one_depth_are_read_in_forward_order():
  class TwoStacks(eqx.Module):
    encoder: EqxBlock
    decoder: EqxBlock

    def __call__(self, x):
      for stack in (self.encoder, self.decoder):
        dynamic, static = eqx.partition(stack, eqx.is_array)
        x, _ = lax.scan(lambda h, d, static=static: (eqx.combine(d, static)(h), None),
                        x, dynamic)
      return x

  keys = jax.random.split(jax.random.key(0), 6)
  model = TwoStacks(eqx.filter_vmap(EqxBlock)(keys[:3]), eqx.filter_vmap(EqxBlock)(keys[3:]))
  model = eqx.tree_at(lambda m: m.decoder.factor, model, jnp.array([jnp.inf, 1.0, 1.0]))
  loss = lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32))
  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pe.equinox_probes(loss))
  probes = grad_fn(model, jnp.ones((4, 8), F16))[2]
  rows = lambda stack: [f"{stack}{p}[{i}]" for i in range(3) for p in ("/linear", "")]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      *rows("encoder"), *rows("decoder"), "TwoStacks"]
  assert diagnostics.backward_overflow_origin(probes) == "decoder[0]"


def eqx_run(stack, h):
  dynamic, static = eqx.partition(stack, eqx.is_array)
  return lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), h, dynamic)[0]


class EqxGroup(eqx.Module):
  blocks: EqxBlock

  def __init__(self, key):
    self.blocks = eqx.filter_vmap(EqxBlock)(jax.random.split(key, 2))

  def __call__(self, x):
    return eqx_run(self.blocks, x)


def test_equinox_a_stack_of_stacks_is_probed_with_its_layers_summed():
  # It failed with IndexError, as for NNX.
  model = eqx.filter_vmap(EqxGroup)(jax.random.split(jax.random.key(0), 3))
  loss = lambda m, x: jnp.sum(eqx_run(m, x).astype(jnp.float32))
  assert hits_like_unprobed(eqx.filter_value_and_grad, pe.equinox_probes, loss, model,
                            jnp.ones(8, F16)) == [
      ("blocks/linear", 6), ("blocks", 6), ("EqxGroup", 3)]


def test_equinox_a_probed_view_reads_attributes_through_to_the_module():
  model = EqxModel(jax.random.key(0))

  def loss(model, x, y):
    assert model.embed.weight.shape == (8, 4)  # through the wrapper
    return eqx_loss(model, x, y)

  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pe.equinox_probes(loss))
  _, grads, _ = grad_fn(model, X, Y)
  chex.assert_trees_all_equal(grads, eqx.filter_grad(eqx_loss)(model, X, Y))


class EqxNormed(eqx.Module):
  """Batch norms inside a Sequential (which checks for stateful layers) and called
  directly (which reads its `StateIndex`)."""

  seq: eqx.nn.Sequential
  norm: eqx.nn.BatchNorm

  def __init__(self, key):
    self.seq = eqx.nn.Sequential([eqx.nn.Linear(4, 3, key=key),
                                  eqx.nn.BatchNorm(3, "batch", mode="batch")])
    self.norm = eqx.nn.BatchNorm(3, "batch", mode="batch")

  def __call__(self, x, state):
    return self.norm(*self.seq(x, state))


def test_equinox_stateful_layers_are_probed_and_change_nothing():
  # Sequential skipped its wrapped BatchNorm's state (TypeError), and a wrapped
  # StateIndex was refused as a state key (ValueError).
  model, state = eqx.nn.make_with_state(EqxNormed)(jax.random.key(0))

  def loss(model, state, x):
    out, state = jax.vmap(model, (0, None), (0, None), "batch")(x, state)
    return jnp.sum(out ** 2), state

  (value, new_state), grads, probes = pr.value_and_grad_with_probes(
      eqx.filter_value_and_grad, pe.equinox_probes(loss), has_aux=True)(model, state, X)
  chex.assert_trees_all_equal(((value, new_state), grads),
                              eqx.filter_value_and_grad(loss, has_aux=True)(model, state, X))
  # A batch norm's output is (out, state): `out` is probed, under the norm's own name.
  assert [(name, int(s.hits)) for name, s in diagnostics.layers(probes)] == [
      ("seq/layers/0", 16), ("seq/layers/1", 16), ("norm", 16)]


def test_equinox_a_model_partitioned_outside_the_loss_is_probed_when_combined_in_it():
  # The loss's eqx.combine(diff, static) failed: the probed view of `diff` had wrappers
  # where `static` had modules (ValueError: pytree structure error).
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  diff, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda diff, x: jnp.sum(jax.vmap(eqx.combine(diff, static))(x))
  assert hits_like_unprobed(jax.value_and_grad, pe.equinox_probes, loss, diff, X) == [
      ("layers/0", 16), ("layers/1", 16), ("MLP", 16)]
  assert not hasattr(eqx.nn.Linear.__call__, "_probes_output")  # the class restored


def test_equinox_a_jit_or_a_scan_in_the_loss_keeps_the_view_rows_and_all():
  # The probed view is tried first: a stack the loss scans itself keeps one row per
  # layer, and a model called under eqx.filter_jit in the loss is still probed (found
  # at call time, neither would be: the jit traces arrays anew, the scan slices them).
  stack = eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(0), 3))
  scanned = lambda m, x: jnp.sum(eqx_run(m, x).astype(jnp.float32))
  assert hits_like_unprobed(eqx.filter_value_and_grad, pe.equinox_probes, scanned, stack,
                            jnp.ones(8, F16)) == [
      ("linear[0]", 1), ("EqxBlock[0]", 1), ("linear[1]", 1), ("EqxBlock[1]", 1),
      ("linear[2]", 1), ("EqxBlock[2]", 1)]
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  jitted = lambda m, x: jnp.sum(eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(m, x))
  assert hits_like_unprobed(eqx.filter_value_and_grad, pe.equinox_probes, jitted, model, X) == [
      ("layers/0", 16), ("layers/1", 16), ("MLP", 16)]
