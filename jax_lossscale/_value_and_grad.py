"""`scaled_value_and_grad`: the gradients of the scaled loss, for any autodiff API."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_lossscale import _autocast
from jax_lossscale import _eager
from jax_lossscale import _finite
from jax_lossscale import _monitoring
from jax_lossscale import _numerics
from jax_lossscale import _trees
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import NoOpLossScale
from jax_lossscale._transform import LossScalingState
from jax_lossscale.probes import all_reduce_probes
from jax_lossscale.probes import placed
from jax_lossscale.probes import value_and_grad_with_probes


class _Value(NamedTuple):
  """The unscaled loss and aux, carried as the aux of the differentiated function."""

  loss: Any
  aux: Any


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    axis_name: _finite.AxisName = None,
    value_and_grad: Callable[..., Callable[..., Any]] = jax.value_and_grad,
    probes: bool = False,
) -> Callable[..., tuple[Any, ...]]:
  """Like `jax.value_and_grad`, for a loss that must be multiplied by the loss scale.

  The returned function takes the **optimizer state** first, then `fun`'s own
  arguments. It finds the current loss scale in that state, differentiates
  `loss_scale.scale(fun(...))`, and returns the **unscaled** loss (and aux) with the
  gradients of the **scaled** loss, ready for the `update` of the `loss_scaling` that
  owns the state, which unscales them by that same scale::

      grad_fn = jax_lossscale.scaled_value_and_grad(loss_fn)
      loss, grads = grad_fn(opt_state, params, batch)
      params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss)

  Args:
    fun: the loss function; returns a scalar (or `(scalar, aux)` with `has_aux`).
    argnums: which of `fun`'s arguments to differentiate, counted among `fun`'s own
      arguments (negative values count from the end), as in `jax.value_and_grad`.
    has_aux: as in `jax.value_and_grad`.
    axis_name: for data-parallel steps under `pmap` or `shard_map` (flax's and haiku's
      examples): the mapped axis name(s) over which the loss and the gradients are
      averaged (`lax.pmean`, summed in at least float32, where float16's sum of finite
      values can overflow), so every replica gets the same loss and gradients
      (flax's `DynamicScale.value_and_grad(axis_name=...)` averages the gradients
      only).
    value_and_grad: the differentiation transform: `jax.value_and_grad` (default),
      `flax.nnx.value_and_grad` (models holding `BatchNorm` or `Dropout` state), or
      `equinox.filter_value_and_grad` (modules with non-array fields; it takes no
      `argnums` and differentiates the first argument). It is called as
      `value_and_grad(f, has_aux=True)`, plus `argnums=argnums` when `argnums` is not 0.
    probes: also measure the backward pass layer by layer: every module's output in
      flax linen, flax NNX (the model given first) and equinox (the model given first)
      is probed automatically, and `jax_lossscale.diagnostics.probe(x, name)` marks any
      other point. Each probe measures its activation and, in the backward pass, its
      gradient (largest magnitude, finite or not, zero and float16-subnormal
      fractions), reading each once, with no host callback. Called outside `jit`, the
      probed function runs as one program compiled once per signature of its
      arguments (their structure, shapes and dtypes; arguments that are not arrays
      are static, as under `jit`), so an eager loop compiles nothing after its first
      step; the loss's Python code then runs when it is traced, not on every call.

  Returns:
    A function `(opt_state, *args, **kwargs) -> (value, grads)`, or
    `(value, grads, probes)` with `probes=True`: a `diagnostics.Probes` for
    `diagnostics.table`, `tx.update(..., probes=probes)` and `raise_if_stuck`.

  Warns:
    UserWarning: once, where `fun` is a float16 (or float8) `autocast` function and the
      state's loss scale is a `NoOpLossScale` (what a policy computing in float32 calls
      for, as one switched to float32 for `autocast` to cast): its gradients would
      underflow unscaled.

  Raises:
    TypeError: (when called) if it is given a `LossScale` instead of the optimizer
      state (a loss scale kept apart from the optimizer goes stale as soon as the scale
      moves), or if `value_and_grad` does not return `(value, grads)`.
  """
  if not callable(fun):
    raise TypeError(f"scaled_value_and_grad's `fun` must be callable (the loss function), "
                    f"got {fun!r:.200} of type {type(fun).__name__}.")
  name = getattr(fun, "__name__", type(fun).__name__)
  measured_fun = placed(fun) if probes else fun
  extra = {} if argnums == 0 and value_and_grad is not jax.value_and_grad \
      else {"argnums": argnums}

  def differentiated(loss_scale, args, kwargs):
    def scaled(*a, **k):
      loss, aux = _loss_and_aux(measured_fun(*a, **k), has_aux, name)
      return loss_scale.scale(loss), _Value(loss, aux)

    if probes:
      *result, measurements = value_and_grad_with_probes(
          _checked(value_and_grad), scaled, argnums, has_aux=True)(*args, **kwargs)
    else:
      result = value_and_grad(scaled, has_aux=True, **extra)(*args, **kwargs)
    value, grads = _value_and_grads(tuple(result), value_and_grad)
    if axis_name is not None:  # the loss and the gradients, not the aux
      value = value._replace(loss=_mean(value.loss, axis_name))
      grads = _mean(grads, axis_name)
    value = (value.loss, value.aux) if has_aux else value.loss
    if not probes:
      return value, grads
    if axis_name is not None:
      measurements = all_reduce_probes(measurements, axis_name)
    return value, grads, measurements

  compiled = _eager.CompiledBySignature(differentiated, f"scaled_value_and_grad({name})")
  unscaled_autocast = _UnscaledAutocast(name, _autocast.compute_dtype_of(fun))

  def scaled_value_and_grad_fn(opt_state, *args, **kwargs):
    if isinstance(opt_state, LossScale):
      raise TypeError(
          f"scaled_value_and_grad({name}) takes the optimizer state first, got a "
          f"{type(opt_state).__name__}. Pass the state returned by tx.init / tx.update: the "
          "loss scale moves with every step, and only the state's own scale is the one "
          "tx.update unscales by. (To scale a loss by hand, use loss_scale.scale(loss).)")
    try:
      loss_scale = _monitoring.find_state(opt_state).loss_scale
    except ValueError as error:
      misplaced = _misplaced_state(args, kwargs)
      if misplaced is None:
        error.add_note(f"scaled_value_and_grad({name}) takes the optimizer state first: "
                       "grad_fn(opt_state, *args), opt_state from tx.init or tx.update "
                       "of tx = jax_lossscale.loss_scaling(...).")
        raise
      raise TypeError(
          f"scaled_value_and_grad({name}) takes the optimizer state first, then "
          f"{name}'s arguments: call it as grad_fn(opt_state, *args), got the optimizer "
          f"state as {misplaced} and a {type(opt_state).__name__} first.") from error
    unscaled_autocast.check(loss_scale)
    # Probes are found and measured in a context of their own on every trace: called
    # outside jit, the loss's every operation would compile again on every call.
    if probes and not _eager.traced((loss_scale, args, kwargs)):
      return compiled(loss_scale, args, kwargs)
    return differentiated(loss_scale, args, kwargs)

  scaled_value_and_grad_fn.__name__ = scaled_value_and_grad_fn.__qualname__ = (
      f"scaled_value_and_grad({name})")
  return scaled_value_and_grad_fn


class _UnscaledAutocast:
  """Warns once where a float16 `autocast` loss meets a `NoOpLossScale`: a policy
  switched to float32 so that `autocast` does the casting calls for no scale, and
  float16 would train unscaled without a word."""

  def __init__(self, name: str, compute_dtype: Any):
    self.name, self.compute_dtype = name, compute_dtype
    self.warned = compute_dtype is None or not _numerics.has_short_range(compute_dtype)

  def check(self, loss_scale: LossScale) -> None:
    if self.warned or not isinstance(loss_scale, NoOpLossScale):
      return
    self.warned = True
    warnings.warn(
        f"scaled_value_and_grad({self.name}): {self.name} runs under jls.autocast in "
        f"{self.compute_dtype.name}, but the optimizer state's loss scale is "
        "NoOpLossScale (what a policy computing in float32 or bfloat16 calls for, such as "
        "one switched to float32 for autocast to cast): its gradients are not scaled, and "
        f"those below {self.compute_dtype.name}'s smallest value become zero. Give the "
        "optimizer the scale autocast's dtype calls for: jls.loss_scaling(tx, 'dynamic') "
        "or a jls.MeasuredLossScale() (a policy's loss_scale() is that of the policy's "
        "own compute dtype, not autocast's).", stacklevel=3)


def _loss_and_aux(out: Any, has_aux: bool, name: str) -> tuple[Any, Any]:
  """`(loss, aux)` from what the loss function returned; a mistake in `has_aux` is named."""
  if has_aux and not (isinstance(out, (tuple, list)) and len(out) == 2):
    got = f"an array of shape {jnp.shape(out)}" if hasattr(out, "shape") else repr(out)
    raise TypeError(f"scaled_value_and_grad({name}, has_aux=True): {name} must return a "
                    f"pair (loss, aux), got {got:.100}.")
  if not has_aux and isinstance(out, (tuple, list)):
    raise TypeError(f"scaled_value_and_grad({name}): {name} returned a {type(out).__name__}, "
                    "not a scalar loss: pass has_aux=True if it returns (loss, aux).")
  return out if has_aux else (out, None)


def _misplaced_state(args: tuple, kwargs: dict) -> str | None:
  """Where an optimizer state was passed among the loss's own arguments, if it was."""
  def holds_state(x):
    x = getattr(x, "opt_state", x)  # nnx.Optimizer, flax's TrainState
    is_state = lambda y: isinstance(y, LossScalingState)
    return any(map(is_state, jax.tree.leaves(x, is_leaf=is_state)))
  where = [f"argument {i + 2}" for i, a in enumerate(args) if holds_state(a)]
  where += [f"`{k}=`" for k, v in kwargs.items() if holds_state(v)]
  return where[0] if where else None


def _checked(value_and_grad: Callable) -> Callable:
  """`value_and_grad`, whose result is checked before the probes' cotangents are read."""
  def checked(f, **kwargs):
    def call(*args, **kw):
      result = value_and_grad(f, **kwargs)(*args, **kw)
      _value_and_grads(result, value_and_grad)
      return result
    return call
  return checked if value_and_grad is not jax.value_and_grad else value_and_grad


def _value_and_grads(result: Any, value_and_grad: Callable) -> tuple[_Value, Any]:
  """`(value, grads)` from what `value_and_grad(f, has_aux=True)` returned."""
  if (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], tuple)
      and len(result[0]) == 2 and isinstance(result[0][1], _Value)):
    return result[0][1], result[1]
  transform = getattr(value_and_grad, "__name__", repr(value_and_grad))
  raise TypeError(
      f"`value_and_grad` must return ((value, aux), grads) when called with has_aux=True, "
      f"as jax.value_and_grad does; {transform} returned a {type(result).__name__}. "
      "(jax.grad returns only the gradients: pass value_and_grad=jax.value_and_grad.)")


def _mean(tree: Any, axis_name: _finite.AxisName) -> Any:
  """The mean over `axis_name`, summed in at least float32: 8 float16 gradients of 16384,
  each finite, sum to inf in float16."""
  def mean(x):
    wide = x.astype(_numerics.compute_dtype(x.dtype))
    return _finite.collective(jax.lax.pmean, wide, axis_name, axis_name).astype(x.dtype)
  return _trees.map_float_leaves(mean, tree)
