"""Reading a `loss_scaling` state: metrics, the step's decision, and stuck runs.

The state is found in whatever holds it (an optax state, `nnx.Optimizer`, flax's
`TrainState`; a framework may wrap each array, as NNX does in an `nnx.Variable`) and is
always read as plain arrays. It must be the outermost transformation's: the one place a
wrong composition shows is the path that leads to it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from jax_lossscale import _numerics
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale import diagnostics
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._transform import COUNTS
from jax_lossscale._transform import LossScalingState

_RULE = ("everything that changes the parameters goes inside loss_scaling, which is the "
         "outermost transformation: loss_scaling(optax.chain(...)), "
         "loss_scaling(optax.MultiSteps(...)), loss_scaling(optax.inject_hyperparams(...)(...))")
_WRONG = {
    optax.MultiStepsState: "optax.MultiSteps around loss_scaling accumulates scaled "
                           "gradients, and one overflowed micro-batch poisons its accumulator",
    optax.InjectHyperparamsState: "optax.inject_hyperparams around loss_scaling advances its "
                                  "count (and schedules) on skipped steps",
    optax.InjectStatefulHyperparamsState: "optax.inject_hyperparams around loss_scaling "
                                          "advances its count on skipped steps",
    optax.MultiTransformState: "the other transforms of an optax.multi_transform get scaled "
                               "gradients",
    optax.MaskedState: "optax.masked around loss_scaling",
    optax.ApplyIfFiniteState: "optax.apply_if_finite around loss_scaling keeps the loss "
                              "scale from backing off on overflowed steps",
}
_SIBLINGS = ("a transformation chained before loss_scaling sees scaled gradients, one "
             "chained after it still runs on skipped steps")


def find_state(opt_state: Any, function: str | None = None,
               argument: str = "opt_state") -> LossScalingState:
  """The one `LossScalingState` of an optimizer state, its arrays unwrapped.

  `opt_state` may also be anything with an `opt_state` attribute (`nnx.Optimizer`,
  flax's `TrainState`). Errors name the caller's `function` (if given) and `argument`.

  Raises:
    ValueError: if there is none, more than one, or it is not the outermost
      transformation's state.
  """
  if not isinstance(opt_state, LossScalingState) and hasattr(opt_state, "opt_state"):
    opt_state = opt_state.opt_state
  is_state = lambda x: isinstance(x, LossScalingState)
  found = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(
      opt_state, is_leaf=is_state) if is_state(leaf)]
  if len(found) != 1:
    hint = (" nnx.state(optimizer) keeps only arrays: pass optimizer.opt_state or the "
            "nnx.Optimizer itself." if _looks_flattened(opt_state) else
            " Is the optimizer wrapped with jax_lossscale.loss_scaling?")
    raise ValueError(
        f"{function + ': ' if function else ''}`{argument}` must be the state of a "
        "jax_lossscale.loss_scaling optimizer (or an nnx.Optimizer or flax TrainState "
        "holding it), with exactly one "
        f"loss_scaling state inside; found {len(found)} in a {type(opt_state).__name__}."
        f"{hint}")
  path, state = found[0]
  _check_outermost(opt_state, path)
  return state._replace(**{name: _trees.unwrap(getattr(state, name), (LossScale,))
                           for name in LossScalingState._fields if name != "inner_state"})


def _looks_flattened(tree: Any) -> bool:
  """Whether `tree` holds a state turned into dicts keyed by its fields (`nnx.state`)."""
  return any(any(getattr(key, "key", None) == "last_applied" for key in path)
             for path, _ in jax.tree_util.tree_leaves_with_path(tree))


def _wrapped_by(node: Any) -> str | None:
  """Why `node`, a state holding the loss_scaling state, breaks the rule; None if not."""
  why = next((text for kind, text in _WRONG.items() if isinstance(node, kind)), None)
  if why is None and (type(node) in (tuple, list) or isinstance(node, dict)) and len(node) > 1:
    why = _SIBLINGS  # optax.chain, optax.named_chain
  elif why is None and isinstance(node, tuple) and hasattr(node, "_fields"):
    why = (f"the transformation whose state is {type(node).__name__} runs around it, on "
           "scaled gradients or on skipped steps")  # any other optax wrapper
  else:
    return why
  return f"{why} (if this is a container of your own, pass the optimizer state in it)"


def _check_outermost(opt_state: Any, path) -> None:
  node = opt_state
  for key in path:
    why = _wrapped_by(node)
    if why is not None:
      raise ValueError(
          f"loss_scaling is not the outermost transformation (its state is at "
          f"opt_state{jax.tree_util.keystr(path)}): {why}. The rule: {_RULE}.")
    node = _trees.child(node, key)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars for logging, as plain arrays.

  `loss_scale` (the scale of the next step), `last_applied` and the counts of
  `LossScalingState`: `skipped_steps`, `consecutive_skips`, `nonfinite_loss_steps`,
  `nonfinite_update_steps`, `consecutive_nonfinite_loss`, `consecutive_nonfinite_updates`;
  with `loss_scaling(..., grad_norm=True)`, also `grad_norm`:
  the global L2 norm of the last step's unscaled gradients (before clipping; inf or NaN
  on a step skipped because they overflowed, NaN before any step). Jittable; the values
  stay on the device until read. `opt_state` may be any optimizer state holding a
  `loss_scaling` state, an `nnx.Optimizer` or a flax `TrainState`.
  """
  state = find_state(opt_state, "metrics", "opt_state")
  out = {"loss_scale": state.loss_scale(), "last_applied": state.last_applied}
  out.update({name: state.count(name) for name in COUNTS})
  if state.grad_norm is not None:
    out["grad_norm"] = state.grad_norm
  return out


def unscale(grads: Any, opt_state: Any) -> Any:
  """The unscaled gradients of the step that returned `opt_state`.

  For gradient logging and hooks (a gradient-norm hook given `grads` as they come from
  `scaled_value_and_grad` sees them times the loss scale). Divides by the scale the
  gradients were computed with, kept in the state as `last_loss_scale`: not by
  `opt_state.loss_scale`, which after the step already holds the next step's scale (half
  after an overflow, double after a growth).

      loss, grads = grad_fn(opt_state, params, batch)
      params, opt_state = tx.apply_gradients(grads, opt_state, params, loss=loss)
      log_grads(jls.unscale(grads, opt_state))

  Before the step, `opt_state.loss_scale.unscale(grads)` gives the same. Their norm
  alone costs nothing more with `loss_scaling(..., grad_norm=True)`: `metrics`'
  `grad_norm`.

  Args:
    grads: gradients of the scaled loss, any pytree (leaves that are not floating-point
      pass through).
    opt_state: what `metrics` takes, returned by the step that took `grads`.

  Returns:
    `grads` divided by that scale, each leaf in its own dtype.
  """
  state = find_state(opt_state, "unscale", "opt_state")
  return _trees.rescale_floats(grads, _numerics.Rescale.reciprocal(state.last_loss_scale))


def if_applied(opt_state: Any, new: Any, old: Any) -> Any:
  """`new` if the step that produced `opt_state` was applied, else `old`.

  The one line that makes any other state follow the step's decision, so that a
  skipped step never happened for it either: BatchNorm statistics, EMA weights, a step
  counter of your own. A select, leaf by leaf (no NaN in `new` leaks into the result).

      batch_stats = jls.if_applied(opt_state, new_batch_stats, batch_stats)
  """
  try:
    applied = find_state(opt_state, "if_applied", "opt_state").last_applied
  except ValueError:
    if not _holds_state(old):
      raise
    raise ValueError(
        "if_applied takes (opt_state, new, old): the optimizer state comes first, the new "
        "values second, the values to keep on a skipped step third; the third argument "
        "holds the loss_scaling state.") from None
  if _shares_variables(new, old):
    raise ValueError(
        "if_applied: `old` holds the very nnx.Variable objects of `new`, so it already has "
        "the new values and a skipped step's would be lost: nnx.state gives the live "
        "variables. Copy them before the forward pass: stats = jax.tree.map(lambda s: s, "
        "nnx.state(model, nnx.BatchStat)).")
  try:
    return _trees.select_tree(applied, new, old)
  except (TypeError, ValueError) as error:  # the structure, a shape or a dtype differs
    raise type(error)(f"if_applied: `new` and `old` must have the same structure, shapes "
                      f"and dtypes: {error}") from None


def _holds_state(tree: Any) -> bool:
  """Whether `tree` holds a loss_scaling state (an argument given in the wrong place)."""
  try:
    find_state(tree)
  except ValueError:
    return False
  return True


def _shares_variables(new: Any, old: Any) -> bool:
  """Whether `old` holds one of `new`'s mutable `nnx.Variable`s (if flax NNX is in use)."""
  olds = {id(x) for x in _trees.nnx_objects(old, "Variable")}
  return any(id(x) in olds for x in _trees.nnx_objects(new, "Variable"))


class LossScaleStuckError(RuntimeError):
  """Raised by `raise_if_stuck` when training makes no progress."""


_LOSS = "the loss itself is inf/NaN (a forward-pass problem, not an overflow)"
_UPDATES = (
    "the optimizer produced non-finite updates (or parameters) from finite gradients "
    "(low-precision parameters: Adam's eps=1e-8 is 0 in float16). Fix: a larger eps, e.g. "
    "optax.adam(1e-3, eps=1e-4), or keep parameters and optimizer state in float32 "
    "and compute in float16 (jax_lossscale.get_policy('p=f32,c=f16'))")
_DIVERGES = ("the unscaled gradients are inf/NaN even at this scale, so the model itself "
             "diverges or overflows in the forward pass")
_OVERFLOWS = "the gradients keep overflowing"


def raise_if_stuck(opt_state: Any, max_consecutive_skips: int = 100, probes: Any = None) -> None:
  """Fails fast when every recent step was skipped, saying why.

  A host-side check: it reads a few scalars from the device, so call it at your logging
  cadence, not inside the jitted step. The cause named is that of the current run of
  skipped steps: a non-finite loss, non-finite updates from finite gradients, or
  overflowing gradients (at the minimum scale, or at 1 or below: a model that diverges).

  Args:
    opt_state: what `metrics` takes.
    max_consecutive_skips: how many skipped steps in a row count as stuck.
    probes: optional, the last step's measurements (`scaled_value_and_grad(...,
      probes=True)`): the message then names the layer where the overflow began, or the
      first layer whose forward output was not finite.

  Raises:
    LossScaleStuckError: with the scale, the floor and the likely cause.
    ValueError: if `max_consecutive_skips` is not a positive integer.
  """
  max_consecutive_skips = _validation.integer(
      "max_consecutive_skips", max_consecutive_skips, 1)
  if probes is not None and not isinstance(probes, diagnostics.Probes):
    raise TypeError(
        "raise_if_stuck: `probes` must be what scaled_value_and_grad(..., probes=True) "
        f"returned (a diagnostics.Probes), or None, got {type(probes).__name__}: "
        f"{probes!r:.100}")
  state = find_state(opt_state, "raise_if_stuck", "opt_state")
  skips = np.asarray(state.consecutive_skips)
  # A pmap'd or vmapped state holds one copy per device or run: the most stuck one's.
  at = np.unravel_index(np.argmax(skips), skips.shape)
  # A loss scale with no array state (fixed, none) holds one scale for every copy.
  read = lambda x: np.asarray(x)[at] if np.ndim(x) else np.asarray(x)
  consecutive = int(read(skips))
  if consecutive < max_consecutive_skips:
    return
  scale = float(read(state.loss_scale()))
  floor = getattr(state.loss_scale, "min_loss_scale", None)
  at_floor = floor is not None and scale <= np.float32(floor)  # the floor as the scale holds it
  diverges = at_floor or scale <= 1  # unscaled gradients inf/NaN: a smaller scale rarely helps
  losses = int(read(state.consecutive_nonfinite_loss))
  updates = int(read(state.consecutive_nonfinite_updates))
  causes = [(losses, _LOSS), (updates, _UPDATES),
            (consecutive - losses - updates, _DIVERGES if diverges else _OVERFLOWS)]
  causes = [(n, text) for n, text in causes if n]
  if len(causes) == 1:
    cause = causes[0][1]
  else:
    cause = "; ".join(f"{n} of them: {text}" for n, text in sorted(causes, reverse=True))
  raise LossScaleStuckError(
      f"Training is stuck: the last {consecutive} steps were all skipped "
      f"(max_consecutive_skips={max_consecutive_skips}). Current loss scale {scale:g}"
      + (f", already at its minimum {floor:g}" if at_floor else "")
      + f". Likely cause: {cause}. " + _where(probes))


def _where(probes: Any) -> str:
  if probes is None:
    return ("To find where: scaled_value_and_grad(..., probes=True), or "
            "jax_lossscale.diagnostics.nonfinite_leaf_paths(nonfinite_leaves(grads)).")
  forward = diagnostics.forward_nonfinite_origin(probes)
  if forward is not None:
    return f"Where: the forward output of {forward!r} was the first that was not finite."
  backward = diagnostics.backward_overflow_origin(probes)
  if backward is not None:
    return f"Where: the overflow began in the backward pass of {backward!r}."
  return "Where: every probed activation gradient was finite; the parameter gradients were not."
