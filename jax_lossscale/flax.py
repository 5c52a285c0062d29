"""flax: a linen `TrainState` whose `apply_gradients` takes the loss and keeps everything
but the call counter `step` on a skipped step, and loss scales known to `flax.serialization`.

Importing this module imports flax; `import jax_lossscale` does not.

    from jax_lossscale.flax import TrainState

    state = TrainState.create(apply_fn=model.apply, params=params,
                              tx=jax_lossscale.loss_scaling(optax.adam(1e-3)))
    loss, grads = jax_lossscale.scaled_value_and_grad(loss_fn)(state.opt_state, state.params, x)
    state = state.apply_gradients(grads=grads, loss=loss)

For a `MeasuredLossScale`, pass what `scaled_value_and_grad(..., probes=True)` measured as
`apply_gradients(grads=grads, loss=loss, probes=probes)`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import serialization
from flax.core import FrozenDict
from flax.training import train_state

from jax_lossscale import _loss_scale
from jax_lossscale import _monitoring
from jax_lossscale import _transform

__all__ = ("TrainState",)

OVERWRITE_WITH_GRADIENT = "_overwrite_with_gradient"


class TrainState(train_state.TrainState):
  """flax's `TrainState`, for a `loss_scaling` transformation.

  `create`, `replace`, checkpointing and the fields (`step`, `apply_fn`, `params`, `tx`,
  `opt_state`) are flax's. `apply_gradients` differs: it takes the unscaled loss, updates
  `params` and `opt_state` in one fused pass, and on a skipped step keeps everything the
  step would have changed but `step`, which counts calls as flax's does (schedules read
  optax's own count in `opt_state`, which is kept).
  """

  @classmethod
  def create(cls, *, apply_fn, params, tx, **kwargs) -> TrainState:
    """flax's `create`, refusing a `tx` without `loss_scaling` outermost (use flax's own
    `TrainState` for an optimizer without loss scaling)."""
    state = super().create(apply_fn=apply_fn, params=params, tx=tx, **kwargs)
    try:
      _monitoring.find_state(state.opt_state)
    except ValueError as error:
      raise TypeError(
          f"jax_lossscale.flax.TrainState: `tx` must be a jax_lossscale.loss_scaling "
          f"transformation, such as loss_scaling(optax.adam(1e-3)): {error} For an optimizer "
          "without loss scaling, use flax.training.train_state.TrainState.") from None
    return state

  def apply_gradients(self, *, grads: Any, loss: Any = None, probes: Any = None,
                      **kwargs) -> TrainState:
    """Applies one step of gradients of the scaled loss.

    Args:
      grads: gradients of the scaled loss (`jax_lossscale.scaled_value_and_grad`), with
        the structure of `params`. As in flax, the collection `"_overwrite_with_gradient"`
        (fp8 scales and amax histories) is set to its gradient, not optimized, but only
        on an applied step: an overflowed step's inf never reaches it.
      loss: optional, the unscaled loss: a non-finite loss skips the step without
        changing the loss scale (see `jax_lossscale.loss_scaling`).
      probes: optional, what the backward pass measured (`scaled_value_and_grad(...,
        probes=True)`), for a `MeasuredLossScale` to set the next scale from, as
        `tx.apply_gradients(..., probes=probes)` takes them.
      **kwargs: other fields to `replace`, as in flax (`batch_stats=...`). They follow
        the step's decision too: on a skipped step the old values are kept.

    Returns:
      The new state. `step` counts calls, as flax's does; the optimizer's own count and
      schedules advance only on applied steps.
    """
    overwrite = isinstance(grads, (dict, FrozenDict)) and OVERWRITE_WITH_GRADIENT in grads
    params, grads_to_optimize = (self.params["params"], grads["params"]) if overwrite \
        else (self.params, grads)
    extra = {name: value for name, value in (("loss", loss), ("probes", probes))
             if value is not None}
    new_params, opt_state = _transform.apply_gradients(
        self.tx, grads_to_optimize, self.opt_state, params, **extra)
    if overwrite:
      new_params = {"params": new_params, OVERWRITE_WITH_GRADIENT: _monitoring.if_applied(
          opt_state, grads[OVERWRITE_WITH_GRADIENT], self.params[OVERWRITE_WITH_GRADIENT])}
    for name, value in kwargs.items():
      try:
        kwargs[name] = _monitoring.if_applied(opt_state, value, _like(value, getattr(self, name)))
      except (TypeError, ValueError) as error:
        raise type(error)(f"TrainState.apply_gradients: `{name}` must keep the structure, "
                          f"shapes and dtypes of the state's `{name}` (a skipped step keeps "
                          f"the old values): {error}") from None
    return self.replace(step=self.step + 1, params=new_params, opt_state=opt_state, **kwargs)


def _like(new: Any, old: Any) -> Any:
  """`old` in `new`'s containers where only the containers differ (flax returns dicts
  where a state may hold FrozenDicts); else `old` as it is."""
  paths = lambda tree: [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  if paths(new) != paths(old):
    return old
  return jax.tree.unflatten(jax.tree.structure(new), jax.tree.leaves(old))


def _register(cls: type) -> None:
  """`cls` (a loss scale) with `flax.serialization`, as a dict of its state fields."""

  def to_state_dict(loss_scale):
    return {name: serialization.to_state_dict(getattr(loss_scale, name))
            for name in cls._state_names}

  def from_state_dict(target, state):
    # Through the pytree's own unflatten: no constructor runs, so classes with
    # TensorFlow-style constructor arguments restore as well.
    names = set(cls._state_names)
    if set(state) != names:
      raise ValueError(
          f"Cannot restore a {cls.__name__}: the checkpoint's loss scale has the fields "
          f"{sorted(state)}, a {cls.__name__} has {sorted(names)}. Restore into a target "
          "made with the loss scale the checkpoint was saved with.")
    leaves = []
    for name in cls._state_names:
      leaves.append(serialization.from_state_dict(getattr(target, name), state[name]))
      if np.shape(leaves[-1]) != np.shape(getattr(target, name)):
        raise ValueError(
            f"Cannot restore a {cls.__name__}: the checkpoint's `{name}` has shape "
            f"{np.shape(leaves[-1])}, the target's {np.shape(getattr(target, name))} (made "
            f"with another configuration: {target.get_config()}).")
    try:  # the constructor's checks of the state against this configuration's limits
      type(target)(**target.get_config(), **dict(zip(cls._state_names, leaves, strict=True)))
    except ValueError as error:
      raise ValueError(
          f"Cannot restore a {cls.__name__}: the checkpoint's state does not fit the "
          f"target's configuration {target.get_config()}: {error} Restore into a target "
          "made with the loss scale the checkpoint was saved with.") from error
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)

  serialization.register_serialization_state(cls, to_state_dict, from_state_dict,
                                             override=True)


# Every loss-scale class, those defined after this import included.
_loss_scale.for_each_class(_register)
