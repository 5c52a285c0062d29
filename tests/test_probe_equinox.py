"""Probes placed automatically on every equinox module's output: a probed copy of the
model, stacked layers with a row each, stateful layers, and a model combined in the loss.
"""

import threading

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import float16_normal
from helpers import hits_like_unprobed
from helpers import mse
from helpers import scale_backward
from jax import lax

import jax_lossscale as jls
from jax_lossscale import diagnostics
from jax_lossscale import probes as pr

F16 = jnp.float16
X, Y = float16_normal(0, (16, 4)), float16_normal(1, (16, 2))



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
                                          pr.equinox_probes(eqx_loss))

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
                                          pr.equinox_probes(eqx_loss))
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
  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pr.equinox_probes(loss))
  probes = grad_fn(model, jnp.ones((4, 8), F16))[2]
  rows = lambda stack: [f"{stack}{p}[{i}]" for i in range(3) for p in ("/linear", "")]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      *rows("encoder"), *rows("decoder"), "TwoStacks"]
  assert diagnostics.backward_overflow_origin(probes) == "decoder[0]"


def test_equinox_a_stack_sliced_by_a_python_loop_is_read_in_forward_order():
  # Each layer sliced with `t[i]` gets its row from a traced index: its probes' rows are
  # in the order they ran (linear[0], blocks[0], linear[1], ...), not a probe's all first,
  # which named the wrong layer as the overflow's origin.
  class Looped(eqx.Module):
    blocks: EqxBlock

    def __call__(self, x):
      for i in range(3):
        x = jax.tree.map(lambda t, i=i: t[i] if eqx.is_array(t) else t, self.blocks)(x)
      return x

  model = Looped(eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(0), 3)))
  model = eqx.tree_at(lambda m: m.blocks.factor, model, jnp.array([1.0, jnp.inf, 1.0]))
  loss = lambda m, x: jnp.sum(jax.vmap(m)(x).astype(jnp.float32))
  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pr.equinox_probes(loss))
  probes = grad_fn(model, jnp.ones((4, 8), F16))[2]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      *(f"blocks{p}[{i}]" for i in range(3) for p in ("/linear", ""))]
  assert diagnostics.backward_overflow_origin(probes) == "blocks[1]"


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
  assert hits_like_unprobed(eqx.filter_value_and_grad, pr.equinox_probes, loss, model,
                            jnp.ones(8, F16)) == [
      ("blocks/linear", 6), ("blocks", 6), ("EqxGroup", 3)]


def test_equinox_a_probed_view_reads_attributes_through_to_the_module():
  model = EqxModel(jax.random.key(0))

  def loss(model, x, y):
    assert model.embed.weight.shape == (8, 4)  # through the wrapper
    return eqx_loss(model, x, y)

  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pr.equinox_probes(loss))
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
      eqx.filter_value_and_grad, pr.equinox_probes(loss), has_aux=True)(model, state, X)
  chex.assert_trees_all_equal(((value, new_state), grads),
                              eqx.filter_value_and_grad(loss, has_aux=True)(model, state, X))
  # A batch norm's output is (out, state): `out` is probed, under the norm's own name.
  assert [(name, int(s.hits)) for name, s in diagnostics.layers(probes)] == [
      ("seq/layers/0", 16), ("seq/layers/1", 16), ("norm", 16)]


def test_equinox_a_model_partitioned_outside_the_loss_is_given_to_it_when_combined_in_it():
  # The loss's eqx.combine(diff, static) fails with the probed copy of `diff`, whose
  # layers' classes are not those of `static` (ValueError: pytree structure error): the
  # loss gets `diff` itself, whose modules it combines and calls unprobed.
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  diff, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda diff, x: jnp.sum(jax.vmap(eqx.combine(diff, static))(x))
  assert hits_like_unprobed(jax.value_and_grad, pr.equinox_probes, loss, diff, X) == []
  assert not hasattr(eqx.nn.Linear.__call__, "_probes_output")  # the class untouched


def test_equinox_a_jit_or_a_scan_in_the_loss_keeps_the_view_rows_and_all():
  # The probed copy is tried first: a stack the loss scans itself keeps one row per
  # layer, and a model called under eqx.filter_jit in the loss is still probed (found
  # at call time, neither would be: the jit traces arrays anew, the scan slices them).
  stack = eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(0), 3))
  scanned = lambda m, x: jnp.sum(eqx_run(m, x).astype(jnp.float32))
  assert hits_like_unprobed(eqx.filter_value_and_grad, pr.equinox_probes, scanned, stack,
                            jnp.ones(8, F16)) == [
      ("linear[0]", 1), ("EqxBlock[0]", 1), ("linear[1]", 1), ("EqxBlock[1]", 1),
      ("linear[2]", 1), ("EqxBlock[2]", 1)]
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  jitted = lambda m, x: jnp.sum(eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(m, x))
  assert hits_like_unprobed(eqx.filter_value_and_grad, pr.equinox_probes, jitted, model, X) == [
      ("layers/0", 16), ("layers/1", 16), ("MLP", 16)]


def test_equinox_another_model_of_the_same_class_in_the_loss_is_not_probed():
  # The loss combines a stack partitioned outside it (so it gets the model itself) and
  # also runs a teacher block of the same class and shapes as one layer: neither is the
  # probed copy, and nothing is probed (not the teacher as one of the stack's layers).
  stack = eqx.filter_vmap(EqxBlock)(jax.random.split(jax.random.key(0), 3))
  teacher = EqxBlock(jax.random.key(1))
  diff, static = eqx.partition(stack, eqx.is_array)

  def loss(diff, x):
    h = lax.scan(lambda h, d: (eqx.combine(d, static)(h), None), x, diff)[0]
    return jnp.sum((h + teacher(x)).astype(jnp.float32))

  assert hits_like_unprobed(jax.value_and_grad, pr.equinox_probes, loss, diff,
                            jnp.ones(8, F16)) == []


def test_a_loss_that_fails_with_every_placement_raises_its_own_error():
  # The probed copy fails first (eqx.combine with a static part of the loss's own); the loss's
  # own shape error, met once no option is in the way, is the one raised.
  model = eqx.nn.MLP(4, 2, 8, 1, key=jax.random.key(0))
  diff, static = eqx.partition(model, eqx.is_inexact_array)
  loss = lambda diff, x: jnp.sum(jax.vmap(eqx.combine(diff, static))(x[:, :3]))
  with pytest.raises(TypeError, match="dot_general") as raised:
    pr.value_and_grad_with_probes(jax.value_and_grad, pr.equinox_probes(loss))(diff, X)
  assert "probed copy of an equinox model" in "".join(getattr(raised.value, "__notes__", []))


def test_equinox_mlp_on_one_example_is_probed_layer_by_layer():
  # Its identity final activation, through filter_vmap, returned the tracer it was given
  # in the first pass (already probed: skipped) and a new one under differentiation: the
  # second pass reached a probe the first had not, and raised.
  model = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0))
  loss = lambda model, x: jnp.sum(model(x) ** 2)
  state = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(1.0)).init(
      eqx.filter(model, eqx.is_inexact_array))
  grad_fn = jls.scaled_value_and_grad(loss, value_and_grad=eqx.filter_value_and_grad,
                                      probes=True)
  value, grads, probes = eqx.filter_jit(grad_fn)(state, model, jnp.ones(4))
  assert list(probes) == ["layers/0", "layers/1", "layers/2"]
  assert all(int(probes[name].hits) == 1 for name in probes)
  chex.assert_trees_all_equal(
      (value, grads), eqx.filter_value_and_grad(loss)(model, jnp.ones(4)))


def test_equinox_a_layer_whose_arrays_merely_share_a_leading_axis_gets_no_array_field():
  # A Linear's weight (8, 4) and bias (8,) share their first axis: given a row index, the
  # layer held an int32 array that a loss reading the model's arrays saw (it added
  # `iota(8)` to an L2 penalty) and that a `jax.grad` of the model refused.
  model = eqx.nn.Linear(4, 8, key=jax.random.key(0))
  x = jnp.ones((2, 4))
  leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))

  def penalized(m, x):
    arrays = leaves(m)
    return jnp.mean(jax.vmap(m)(x) ** 2) + sum(jnp.sum(a.astype(jnp.float32) ** 2)
                                               for a in arrays) / len(arrays)

  def second_order(m, x):  # a MAML-style inner step
    inner = lambda m: jnp.mean(jax.vmap(m)(x) ** 2)
    return inner(jax.tree.map(lambda p, g: p - 0.1 * g, m, jax.grad(inner)(m)))

  state = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(1.0)).init(
      eqx.filter(model, eqx.is_inexact_array))
  for loss in (penalized, second_order):
    grad_fn = jls.scaled_value_and_grad(loss, value_and_grad=eqx.filter_value_and_grad,
                                        probes=True)
    value, grads, probes = grad_fn(state, model, x)
    assert list(probes) == ["Linear"] and int(probes["Linear"].hits) > 0
    chex.assert_trees_all_close((value, grads), eqx.filter_value_and_grad(loss)(model, x),
                                rtol=1e-6)


def test_equinox_only_the_scanned_stack_gets_a_row_index_in_a_model_with_one():
  # The other layers of a scan-over-layers model (its `embed` and `out` Linears) hold
  # nothing the model does not; the stacked block and its Linear hold their index.
  model = EqxModel(jax.random.key(0))
  seen = {}

  def loss(model, x, y):
    for name, layer in (("embed", model.embed), ("out", model.out), ("blocks", model.blocks),
                        ("blocks/linear", model.blocks.linear)):
      seen.setdefault(name, []).append(sorted(str(a.dtype) for a in jax.tree.leaves(
          eqx.filter(layer, eqx.is_array))))
    return eqx_loss(model, x, y)

  _, _, probes = pr.value_and_grad_with_probes(eqx.filter_value_and_grad,
                                               pr.equinox_probes(loss))(model, X, Y)
  assert probes.lengths[list(probes.names).index("blocks")] == 3  # a row per block
  measured = {name: hits[-1] for name, hits in seen.items()}  # the measuring pass's model
  assert measured["embed"] == measured["out"] == ["float32", "float32"]
  assert "int32" in measured["blocks"] and "int32" in measured["blocks/linear"]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_equinox_a_model_under_a_custom_jvp_of_the_loss_is_not_measured_and_changes_nothing(
    jit):
  def loss(model, x):  # a rule of the user's own that runs the model in forward mode
    params, static = eqx.partition(model, eqx.is_array)
    plain = lambda params, x: eqx.combine(params, static)(x)
    smooth = jax.custom_jvp(plain)
    smooth.defjvp(lambda primals, tangents: jax.jvp(plain, primals, tangents))
    return jnp.mean(jax.vmap(smooth, in_axes=(None, 0))(params, x) ** 2)

  model, x = eqx.nn.MLP(4, 2, 8, 2, key=jax.random.key(0)), jnp.ones((3, 4))
  state = jls.loss_scaling(optax.sgd(0.1), jls.FixedLossScale(1.0)).init(
      eqx.filter(model, eqx.is_inexact_array))
  transform = eqx.filter_jit if jit else (lambda f: f)
  value, grads, probes = transform(jls.scaled_value_and_grad(
      loss, value_and_grad=eqx.filter_value_and_grad, probes=True))(state, model, x)
  # Called eagerly, a probed gradient function runs compiled: compared with the compiled
  # unprobed one (XLA may round otherwise than operation by operation).
  chex.assert_trees_all_equal((value, grads), eqx.filter_jit(jls.scaled_value_and_grad(
      loss, value_and_grad=eqx.filter_value_and_grad))(state, model, x))
  assert len(probes) >= 3 and all(int(probes[name].hits) == 0 for name in probes)
  assert diagnostics.table(probes).count("not measured") == len(probes)


def test_equinox_inside_the_probed_loss_every_module_is_of_its_own_type_and_no_class_changes():
  # The probed copy's modules are subclasses of the layers' classes, and no class's
  # `__call__` is replaced, in the loss's thread or in another.
  model = EqxModel(jax.random.key(0))
  calls = {cls: vars(cls)["__call__"] for cls in (eqx.nn.Linear, EqxBlock, EqxModel)}
  seen = []

  def unchanged():
    return all(vars(cls)["__call__"] is call for cls, call in calls.items())

  def loss(model, x, y):
    modules = [model, model.embed, model.blocks, model.blocks.linear, model.out]
    seen.append(all(type(m) is m.__class__ for m in modules))
    seen.append([cls.__name__ for cls in map(type, modules) if cls not in calls] == [
        "ProbedEqxModel", "ProbedLinear", "ProbedEqxBlock", "ProbedLinear", "ProbedLinear"])
    seen.append(isinstance(model.embed, eqx.nn.Linear) and isinstance(model.blocks, EqxBlock))
    elsewhere = []
    thread = threading.Thread(target=lambda: elsewhere.append(unchanged()))
    thread.start()
    thread.join()
    seen.append(elsewhere == [True] and unchanged())
    return eqx_loss(model, x, y)

  pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pr.equinox_probes(loss))(
      model, X, Y)
  # Each pass: the first (twice: the scanned stack is found without row indices, then
  # traced with them) and the measuring one.
  assert seen == [True] * 12


def test_equinox_an_error_of_the_loss_in_the_first_pass_is_raised_at_once():
  # Not traced again without the probed copy: the error is the loss's, not the copy's.
  traces = []

  def loss(model, x, y):
    traces.append(model)
    raise ValueError("the loss's own")

  grad_fn = pr.value_and_grad_with_probes(eqx.filter_value_and_grad, pr.equinox_probes(loss))
  with pytest.raises(ValueError, match="the loss's own"):
    grad_fn(EqxModel(jax.random.key(0)), X, Y)
  assert len(traces) == 1
