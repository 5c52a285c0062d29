"""Every JAX training stack: flax NNX, flax linen's TrainState, equinox, plain optax.

Each trains a small model with the real library, skips an overflowed step exactly,
and gets plain arrays from `metrics` and `get_loss_scale`.
"""

from collections.abc import Callable

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen
from flax import nnx

import jax_lossscale as jls
from jax_lossscale.flax import TrainState

X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)


@jax.custom_vjp
def overflow_in_backward(x, factor):
  """The identity, whose gradient is multiplied by `factor` (inf: a backward overflow)."""
  return x


overflow_in_backward.defvjp(lambda x, factor: (x, factor),
                            lambda factor, g: (g * factor, jnp.zeros_like(factor)))


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

  grad_fn = jls.scaled_value_and_grad(loss_fn, value_and_grad=nnx.value_and_grad)
  loss, grads = grad_fn(optimizer.opt_state, model)
  optimizer.update(model, grads, loss=loss)
  return loss, jls.metrics(optimizer.opt_state)


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
  loss_scale = jls.get_loss_scale(optimizer.opt_state)
  assert isinstance(loss_scale.current_loss_scale, jax.Array)
  assert float(loss_scale()) == 2.0**14  # backed off once


# --- flax linen -----------------------------------------------------------------------


class LinenModel(linen.Module):
  @linen.compact
  def __call__(self, x):
    return linen.Dense(2)(linen.relu(linen.Dense(8)(x)))


def linen_state(state_class, tx):
  model = LinenModel()
  params = model.init(jax.random.key(0), X)["params"]
  return state_class.create(apply_fn=model.apply, params=params, tx=tx)


def linen_loss(params, apply_fn, x, y):
  return jnp.mean((apply_fn({"params": params}, x) - y) ** 2)


@jax.jit
def linen_step(state, x, y):
  grad_fn = jls.scaled_value_and_grad(linen_loss)
  loss, grads = grad_fn(state.opt_state, state.params, state.apply_fn, x, y)
  return state.apply_gradients(grads=grads, loss=loss), loss


def test_flax_linen_train_state_takes_the_loss_and_fuses_the_step():
  tx = jls.loss_scaling(optax.MultiSteps(optax.adam(1e-2), 2), clip_by_global_norm=1.0)
  state = linen_state(TrainState, tx)
  losses = []
  for _ in range(20):
    state, loss = linen_step(state, X, Y)
    losses.append(float(loss))
  assert losses[-1] < losses[0] and int(state.step) == 20
  # A NaN loss skips the step: params unchanged, the loss scale left alone.
  before = state.params
  state, _ = linen_step(state, X * jnp.nan, Y)
  chex.assert_trees_all_equal(state.params, before)
  assert int(jls.metrics(state.opt_state)["nonfinite_loss_steps"]) == 1


def test_flax_linen_train_state_equals_flax_own_to_float_rounding():
  from flax.training import train_state

  tx = jls.loss_scaling(optax.adam(1e-2))
  ours, theirs = linen_state(TrainState, tx), linen_state(train_state.TrainState, tx)

  @jax.jit
  def their_step(state, x, y):
    _, grads = jls.scaled_value_and_grad(linen_loss)(state.opt_state, state.params,
                                                     state.apply_fn, x, y)
    return state.apply_gradients(grads=grads)

  for _ in range(5):
    ours, _ = linen_step(ours, X, Y)
    theirs = their_step(theirs, X, Y)
  chex.assert_trees_all_close(ours.params, theirs.params, rtol=1e-6, atol=1e-7)


def test_train_state_overwrite_with_gradient_collection_is_set_not_optimized():
  tx = jls.loss_scaling(optax.sgd(1.0), jls.FixedLossScale(1.0))
  params = {"params": {"w": jnp.ones(2)}, "_overwrite_with_gradient": {"scale": jnp.ones(1)}}
  state = TrainState.create(apply_fn=None, params=params, tx=tx)
  grads = {"params": {"w": jnp.full(2, 0.5)},
           "_overwrite_with_gradient": {"scale": jnp.full(1, 7.0)}}
  state = state.apply_gradients(grads=grads)
  chex.assert_trees_all_equal(state.params["params"]["w"], jnp.full(2, 0.5))
  chex.assert_trees_all_equal(state.params["_overwrite_with_gradient"]["scale"], jnp.full(1, 7.0))


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
