"""`scaled_value_and_grad`: the gradients of the scaled loss, for any autodiff API."""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax

from jax_lossscale import _loss_scale
from jax_lossscale import _monitoring


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
    *,
    value_and_grad: Callable[..., Callable[..., Any]] = jax.value_and_grad,
) -> Callable[..., tuple[Any, Any]]:
  """Like `jax.value_and_grad`, for a loss that must be multiplied by the loss scale.

  The returned function takes the **optimizer state** first, then `fun`'s own
  arguments. It looks the current loss scale up in that state, differentiates
  `loss_scale.scale(fun(...))`, and returns the **unscaled** loss (and aux) with the
  gradients of the **scaled** loss, ready for the `update` of the `loss_scaling`
  transformation that owns the state, which unscales them with that same scale::

      grad_fn = jax_lossscale.scaled_value_and_grad(loss_fn)
      loss, grads = grad_fn(opt_state, params, batch)
      params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss)

  Args:
    fun: the loss function; returns a scalar (or `(scalar, aux)` with `has_aux`).
    argnums: which of `fun`'s arguments to differentiate, counted among `fun`'s
      own arguments (negative values count from the end), as in `jax.value_and_grad`.
    has_aux: as in `jax.value_and_grad`.
    value_and_grad: the differentiation transform: `jax.value_and_grad` (default),
      `flax.nnx.value_and_grad` (models holding `BatchNorm` or `Dropout` state), or
      `equinox.filter_value_and_grad` (modules with non-array fields; it takes no
      `argnums` and differentiates the first argument). It is called as
      `value_and_grad(f, has_aux=True)`, plus `argnums=argnums` when `argnums` is
      not 0.

  Returns:
    A function `(opt_state, *args, **kwargs) -> (value, grads)`.

  Raises:
    TypeError: (when called) if it is given a `LossScale` instead of the optimizer
      state: a loss scale kept apart from the optimizer goes stale as soon as the
      scale moves, and the gradients would be unscaled by another scale.
  """
  name = getattr(fun, "__name__", type(fun).__name__)
  extra = {} if argnums == 0 and value_and_grad is not jax.value_and_grad \
      else {"argnums": argnums}

  def scaled_value_and_grad_fn(opt_state, *args, **kwargs):
    if isinstance(opt_state, _loss_scale.LossScale):
      raise TypeError(
          f"scaled_value_and_grad({name}) takes the optimizer state first, got a "
          f"{type(opt_state).__name__}. Pass the state returned by tx.init / "
          "tx.update: the loss scale moves with every step, and only the state's own "
          "scale is the one tx.update unscales by. (To scale a loss by hand, use "
          "loss_scale.scale(loss).)")
    loss_scale = _monitoring.get_loss_scale(opt_state)

    def scaled(*a, **k):
      out = fun(*a, **k)
      loss, aux = out if has_aux else (out, None)
      return loss_scale.scale(loss), (loss, aux)

    (_, (loss, aux)), grads = value_and_grad(scaled, has_aux=True, **extra)(*args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  scaled_value_and_grad_fn.__name__ = scaled_value_and_grad_fn.__qualname__ = (
      f"scaled_value_and_grad({name})")
  return scaled_value_and_grad_fn
