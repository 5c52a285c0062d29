"""Every JAX training stack: flax NNX and equinox (flax linen's TrainState: test_flax.py).

Each trains a small model with the real library, skips an overflowed step exactly, and
gets plain arrays from `metrics`.
"""

from collections.abc import Callable

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import overflow_in_backward

import jax_lossscale as jls

X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)


# --- flax NNX ------------------------------------------------------------------------


class NnxModel(nnx.Module):
  """Linear, BatchNorm (running statistics) and Dropout (an RNG stream)."""

  def __init__(self, rngs):
    self.linear = nnx.Linear(4, 8, rngs=rngs)
    self.norm = nnx.BatchNorm(8, rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(8, 2, rngs=rngs)

  def __call__(self, x):
    return self.out(self.dropout(nnx.relu(self.norm(self.linear(x)))))


@nnx.jit
def nnx_step(model, optimizer, x, y, overflow):
  def loss_fn(model):
    return overflow_in_backward(jnp.mean((model(x) - y) ** 2), overflow)

  stats = jax.tree.map(lambda s: s, nnx.state(model, nnx.BatchStat))  # as README's
  grad_fn = jls.scaled_value_and_grad(loss_fn, value_and_grad=nnx.value_and_grad)
  loss, grads = grad_fn(optimizer.opt_state, model)
  optimizer.update(model, grads, loss=loss)
  nnx.update(model, jls.if_applied(optimizer, nnx.state(model, nnx.BatchStat), stats))
  return loss, jls.metrics(optimizer.opt_state)


def test_flax_nnx_batchnorm_statistics_follow_the_step_decision():
  # A NaN in the forward pass would write NaN into the running statistics.
  model = NnxModel(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, jls.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)
  nnx_step(model, optimizer, X, Y, 1.0)
  before = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  _, metrics = nnx_step(model, optimizer, X.at[0, 0].set(jnp.nan), Y, 1.0)
  assert not bool(metrics["last_applied"])
  chex.assert_trees_all_equal(jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat)), before)
  nnx_step(model, optimizer, X, Y, 1.0)
  after = jax.tree.map(np.asarray, nnx.state(model, nnx.BatchStat))
  assert not np.array_equal(jax.tree.leaves(after)[0], jax.tree.leaves(before)[0])


def test_flax_nnx_statistics_not_copied_before_the_forward_pass_are_refused():
  # nnx.state gives the live variables: without README's copy, `old` already holds the
  # forward pass's values, and a NaN batch would leave NaN in them on a skipped step.
  model = NnxModel(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, jls.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)

  @nnx.jit
  def forgetful_step(model, optimizer, x, y):
    stats = nnx.state(model, nnx.BatchStat)  # no copy
    grad_fn = jls.scaled_value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2),
                                        value_and_grad=nnx.value_and_grad)
    loss, grads = grad_fn(optimizer.opt_state, model)
    optimizer.update(model, grads, loss=loss)
    nnx.update(model, jls.if_applied(optimizer, nnx.state(model, nnx.BatchStat), stats))

  with pytest.raises(ValueError, match="nnx.Variable.*`new`"):
    forgetful_step(model, optimizer, X.at[0, 0].set(jnp.nan), Y)


def test_flax_nnx_optimizer_step_counts_calls_and_the_schedule_count_is_kept():
  model = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
  tx = jls.loss_scaling(optax.adam(optax.linear_schedule(1e-2, 0.0, 10)))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def train_step(model, optimizer, x):
    grad_fn = jls.scaled_value_and_grad(lambda m: jnp.mean(m(x) ** 2),
                                        value_and_grad=nnx.value_and_grad)
    loss, grads = grad_fn(optimizer.opt_state, model)
    optimizer.update(model, grads, loss=loss)

  train_step(model, optimizer, jnp.ones((2, 3)))
  params = jax.tree.map(jnp.copy, nnx.state(model, nnx.Param))
  train_step(model, optimizer, jnp.full((2, 3), jnp.nan))
  assert int(optimizer.step[...]) == 2  # nnx.Optimizer counts calls, as flax's does
  assert int(optimizer.opt_state.inner_state[0].count[...]) == 1  # the schedule's count
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), params)


def test_flax_nnx_optimizer_with_batchnorm_and_dropout():
  model = NnxModel(nnx.Rngs(0, dropout=1))
  optimizer = nnx.Optimizer(model, jls.loss_scaling(optax.adam(1e-2)), wrt=nnx.Param)
  losses = [float(nnx_step(model, optimizer, X, Y, 1.0)[0]) for _ in range(20)]
  assert losses[-1] < losses[0]

  params = nnx.state(model, nnx.Param)
  _, metrics = nnx_step(model, optimizer, X, Y, jnp.inf)
  chex.assert_trees_all_equal(nnx.state(model, nnx.Param), params)  # skipped exactly
  assert not bool(metrics["last_applied"]) and int(metrics["skipped_steps"]) == 1

  # Plain arrays, outside and inside nnx.jit, whatever nnx wraps the state in.
  for metrics in (jls.metrics(optimizer.opt_state), nnx_step(model, optimizer, X, Y, 1.0)[1]):
    assert all(isinstance(v, jax.Array) for v in metrics.values())
  assert f"{jls.metrics(optimizer.opt_state)['skipped_steps']:d}" == "1"
  assert float(jls.metrics(optimizer)["loss_scale"]) == 2.0**14  # backed off once


# --- equinox ---------------------------------------------------------------------------


class EqxModel(eqx.Module):
  """An equinox module with non-array fields: a function and a string."""

  layers: list
  activation: Callable
  name: str

  def __init__(self, key):
    k1, k2 = jax.random.split(key)
    self.layers = [eqx.nn.Linear(4, 8, key=k1), eqx.nn.Linear(8, 2, key=k2)]
    self.activation = jax.nn.gelu
    self.name = "mlp"

  def __call__(self, x):
    return self.layers[1](self.activation(self.layers[0](x)))


def eqx_loss(model, x, y):
  return jnp.mean((jax.vmap(model)(x) - y) ** 2)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_equinox_module_with_static_fields(fused):
  model = EqxModel(jax.random.key(0))
  tx = jls.loss_scaling(optax.adam(1e-2))
  state = tx.init(eqx.filter(model, eqx.is_array))
  grad_fn = jls.scaled_value_and_grad(eqx_loss, value_and_grad=eqx.filter_value_and_grad)

  @eqx.filter_jit
  def step(model, state, x, y):
    loss, grads = grad_fn(state, model, x, y)
    if fused:
      params, state = tx.apply_gradients(grads, state, eqx.filter(model, eqx.is_array),
                                         loss=loss)
      return eqx.combine(params, model), state, loss
    updates, state = tx.update(grads, state, eqx.filter(model, eqx.is_array), loss=loss)
    return eqx.apply_updates(model, updates), state, loss

  losses = []
  for _ in range(20):
    model, state, loss = step(model, state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0]
  assert model.name == "mlp" and model.activation is jax.nn.gelu
  before = eqx.filter(model, eqx.is_array)
  model, state, _ = step(model, state, X.at[0, 0].set(jnp.inf), Y)
  chex.assert_trees_all_equal(eqx.filter(model, eqx.is_array), before)
  assert int(jls.metrics(state)["skipped_steps"]) == 1


def test_equinox_module_with_an_integer_buffer_is_trained_from_its_trainable_arrays():
  # Given the whole module, init gives Adam moments for the int32 buffer, which
  # filter_value_and_grad gives no gradient: the error says what to give init instead.
  class Gathered(eqx.Module):
    w: jax.Array
    positions: jax.Array  # an int32 buffer, not trained

    def __call__(self, x):
      return jnp.tanh(x @ self.w)[self.positions]

  model, x = Gathered(jnp.ones((3, 4)) / 3, jnp.arange(2)), jnp.ones(3)
  loss = lambda m: jnp.sum(m(x))
  tx = jls.loss_scaling(optax.adam(1e-2))
  grad_fn = jls.scaled_value_and_grad(loss, value_and_grad=eqx.filter_value_and_grad)
  whole = tx.init(model)
  with pytest.raises(ValueError) as info:
    tx.apply_gradients(grad_fn(whole, model)[1], whole, model)
  assert ("`params.positions` is an array of int32 with no gradient"
          in " ".join(info.value.__notes__))
  assert "eqx.filter(module, eqx.is_inexact_array)" in " ".join(info.value.__notes__)
  state = tx.init(eqx.filter(model, eqx.is_inexact_array))
  loss_value, grads = grad_fn(state, model)
  unscaled = {"w": grads.w / state.loss_scale()}
  trained, state = eqx.filter_jit(tx.apply_gradients)(grads, state, model, loss=loss_value)
  expected = optax.adam(1e-2).update(unscaled, optax.adam(1e-2).init({"w": model.w}))[0]
  np.testing.assert_allclose(trained.w, model.w + expected["w"], rtol=1e-6)
  assert trained.positions is not None and (trained.positions == model.positions).all()


def test_equinox_module_is_accepted_whole_by_init_and_apply_gradients():
  # apply_gradients(grads, state, module) failed with "unsupported operand + :
  # custom_jvp and NoneType"; now the module is taken as eqx.apply_updates takes it.
  model = EqxModel(jax.random.key(0))
  tx = jls.loss_scaling(optax.adam(1e-2))
  state = tx.init(model)
  grad_fn = jls.scaled_value_and_grad(eqx_loss, value_and_grad=eqx.filter_value_and_grad)

  @eqx.filter_jit
  def step(model, state, x, y):
    loss, grads = grad_fn(state, model, x, y)
    return *tx.apply_gradients(grads, state, model, loss=loss), loss

  losses = []
  for _ in range(10):
    model, state, loss = step(model, state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and model.activation is jax.nn.gelu and model.name == "mlp"
