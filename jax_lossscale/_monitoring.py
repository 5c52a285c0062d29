"""Reading a `loss_scaling` state: the loss scale, metrics, and stuck runs.

The state may sit anywhere inside an optimizer state (`optax.chain`, `MultiSteps`,
`inject_hyperparams`, ...) and a framework may wrap its arrays (flax NNX keeps each in
an `nnx.Variable`): these functions find it and always return plain arrays.
"""

from __future__ import annotations

from typing import Any

import jax

from jax_lossscale import _loss_scale
from jax_lossscale import _tree
from jax_lossscale import _validation
from jax_lossscale._transform import LossScalingState


def find_state(opt_state: Any) -> LossScalingState:
  """Finds the one `LossScalingState` anywhere inside a (nested) optax state.

  Its arrays are returned plain, unwrapped from framework containers.

  Raises:
    ValueError: if there is none, or more than one.
  """
  found = [
      leaf for leaf in jax.tree.leaves(
          opt_state, is_leaf=lambda x: isinstance(x, LossScalingState))
      if isinstance(leaf, LossScalingState)
  ]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one loss_scaling state inside the optimizer state, found "
        f"{len(found)}. Is the optimizer wrapped with jax_lossscale.loss_scaling?"
    )
  state = found[0]
  return state._replace(**{
      name: _tree.unwrap(getattr(state, name), (_loss_scale.LossScale,))
      for name in LossScalingState._fields if name != "inner_state"})


def get_loss_scale(opt_state: Any) -> _loss_scale.LossScale:
  """Returns the current `LossScale` found anywhere inside a nested optax state."""
  return find_state(opt_state).loss_scale


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars for logging, as plain arrays.

  `loss_scale`, `skipped_steps`, `consecutive_skips`, `last_applied`,
  `nonfinite_loss_steps` and `nonfinite_update_steps` (see `LossScalingState`).
  Jittable; the values stay on device until the caller reads them.
  """
  state = find_state(opt_state)
  return {
      "loss_scale": state.loss_scale(),
      "skipped_steps": state.skipped_steps,
      "consecutive_skips": state.consecutive_skips,
      "last_applied": state.last_applied,
      "nonfinite_loss_steps": state.nonfinite_loss_steps,
      "nonfinite_update_steps": state.nonfinite_update_steps,
  }


class LossScaleStuckError(RuntimeError):
  """Raised by `raise_if_stuck` when training makes no progress."""


_LOSS = "the loss itself is inf/NaN (a forward-pass problem, not an overflow)"
_UPDATES = (
    "the optimizer produced non-finite updates from finite gradients (low-precision "
    "parameters: Adam's eps=1e-8 is 0 in float16). Fix: a larger eps, e.g. "
    "optax.adam(1e-3, eps=1e-4), or keep parameters and optimizer state in float32 "
    "and compute in float16 (jax_lossscale.get_policy('p=f32,c=f16'))")
_DIVERGES = ("the unscaled gradients are inf/NaN even at this scale, so the model itself "
             "diverges or overflows in the forward pass")
_OVERFLOWS = "the gradients keep overflowing"


def raise_if_stuck(opt_state: Any, max_consecutive_skips: int = 100) -> None:
  """Fails fast when every recent step was skipped, saying why.

  A host-side check: it reads a few scalars from the device, so call it at your
  logging cadence (every N steps), not inside the jitted step. The cause named is
  that of the current run of skipped steps: a non-finite loss, non-finite updates
  from finite gradients, or overflowing gradients (at the minimum scale: a model
  that diverges).

  Args:
    opt_state: an optimizer state containing a `loss_scaling` state.
    max_consecutive_skips: how many skipped steps in a row count as stuck.

  Raises:
    LossScaleStuckError: with the scale, the floor and the likely cause.
    ValueError: if `max_consecutive_skips` is not a positive integer.
  """
  max_consecutive_skips = _validation.integer(
      "max_consecutive_skips", max_consecutive_skips, 1)
  state = find_state(opt_state)
  consecutive = int(state.consecutive_skips)
  if consecutive < max_consecutive_skips:
    return
  scale = float(state.loss_scale())
  floor = getattr(state.loss_scale, "min_loss_scale", None)
  at_floor = floor is not None and scale <= floor
  losses = int(state.consecutive_nonfinite_loss)
  updates = int(state.consecutive_nonfinite_updates)
  overflows = consecutive - losses - updates
  causes = [(losses, _LOSS), (updates, _UPDATES),
            (overflows, _DIVERGES if at_floor else _OVERFLOWS)]
  causes = [(n, text) for n, text in causes if n]
  if len(causes) == 1:
    cause = causes[0][1]
  else:
    cause = "; ".join(f"{n} of them: {text}" for n, text in sorted(causes, reverse=True))
  raise LossScaleStuckError(
      f"Training is stuck: the last {consecutive} steps were all skipped "
      f"(max_consecutive_skips={max_consecutive_skips}). Current loss scale {scale:g}"
      + (f", already at its minimum {floor:g}" if at_floor else "")
      + f". Likely cause: {cause}. To find where: "
      "jax_lossscale.nonfinite_leaf_paths(jax_lossscale.nonfinite_leaves(grads))."
  )
