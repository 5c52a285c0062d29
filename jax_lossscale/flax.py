"""flax linen: a `TrainState` whose `apply_gradients` takes the loss and fuses the step.

Importing this module imports flax; the rest of `jax_lossscale` does not need it.

    from jax_lossscale.flax import TrainState

    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=jax_lossscale.loss_scaling(optax.adam(1e-3)))
    loss, grads = jax_lossscale.scaled_value_and_grad(loss_fn)(state.opt_state, state.params, x)
    state = state.apply_gradients(grads=grads, loss=loss)
"""

from __future__ import annotations

from typing import Any

import optax
from flax.core import FrozenDict
from flax.training import train_state

__all__ = ("TrainState",)

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class TrainState(train_state.TrainState):
  """flax's `TrainState`, for a `loss_scaling` transformation.

  `create`, `replace`, checkpointing and the fields (`step`, `apply_fn`, `params`,
  `tx`, `opt_state`) are flax's. Only `apply_gradients` differs: it takes the
  unscaled loss, and updates `params` and `opt_state` with the transformation's
  fused `apply_gradients`, in one pass (flax's calls `tx.update` and
  `optax.apply_updates`).
  """

  def apply_gradients(self, *, grads: Any, loss: Any = None, **kwargs) -> TrainState:
    """Applies one step of gradients of the scaled loss.

    Args:
      grads: gradients of the scaled loss (`jax_lossscale.scaled_value_and_grad`),
        with the structure of `params`. As in flax, the collection
        `"_overwrite_with_gradient"` (fp8 scaling factors) is set to its gradient,
        not optimized.
      loss: optional, the unscaled loss: a non-finite loss skips the step without
        changing the loss scale (see `jax_lossscale.loss_scaling`).
      **kwargs: other fields to `replace`, as in flax.

    Returns:
      The new state, `step` incremented (also on a skipped step: it counts calls;
      the optimizer's own count and schedules do not advance on a skipped step).
    """
    overwrite = isinstance(grads, (dict, FrozenDict)) and OVERWRITE_WITH_GRADIENT in grads
    params, grads_with_opt = (self.params["params"], grads["params"]) if overwrite \
        else (self.params, grads)
    extra = {} if loss is None else {"loss": loss}
    if hasattr(self.tx, "apply_gradients"):
      new_params, opt_state = self.tx.apply_gradients(grads_with_opt, self.opt_state, params,
                                                      **extra)
    else:
      updates, opt_state = self.tx.update(grads_with_opt, self.opt_state, params, **extra)
      new_params = optax.apply_updates(params, updates)
    if overwrite:
      new_params = {"params": new_params,
                    OVERWRITE_WITH_GRADIENT: grads[OVERWRITE_WITH_GRADIENT]}
    return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **kwargs)
