"""Loss scaling as an optax `GradientTransformation`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_lossscale import _loss_scale
from jax_lossscale import _serialization
from jax_lossscale import _tree


class LossScalingState(NamedTuple):
  """State of `loss_scaling`.

  Attributes:
    loss_scale: the current `LossScale`: the scale the *next* step's loss must be
      multiplied by, with its counters.
    inner_state: the state of the wrapped transformation; left exactly as it was on
      a skipped step.
    skipped_steps: int32 scalar, the number of steps skipped so far.
    consecutive_skips: int32 scalar, the number of steps skipped in a row up to now
      (0 after an applied step).
    last_applied: bool scalar, whether the last step was applied.
    nonfinite_loss_steps: int32 scalar, the number of steps skipped because the
      (unscaled) loss passed as `loss=` was itself inf or NaN: a forward-pass
      problem that no loss scale can cause or cure, so the scale is left alone.
  """

  loss_scale: _loss_scale.LossScale
  inner_state: optax.OptState
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  last_applied: jax.Array
  nonfinite_loss_steps: jax.Array


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
  """What `loss_scaling` returns: an optax transformation with a fused step.

  It is an `optax.GradientTransformationExtraArgs` (`init`, `update`) and composes
  like one. `apply_gradients` also applies the updates, which lets a skipped step
  leave parameters and optimizer state untouched without copying either.
  """

  def apply_gradients(self, grads, state, params, **extra_args):
    """`update` followed by `optax.apply_updates`, fused.

    Args:
      grads: gradients of the scaled loss, as for `update`.
      state: the `LossScalingState`.
      params: the parameters to update.
      **extra_args: as for `update`, including `loss=`.

    Returns:
      `(new_params, new_state)`: what `update` and `optax.apply_updates` give (bit
      for bit unless `fuse_unscale` lets the compiler round differently), in one
      pass over the parameters and the optimizer state.
    """
    return self._apply_gradients(grads, state, params, **extra_args)


def loss_scaling(
    inner: optax.GradientTransformation,
    # Loss scales are immutable, so a shared default instance is safe.
    loss_scale: _loss_scale.LossScale | float | str | dict = _loss_scale.DynamicLossScale(),  # noqa: B008
    *,
    axis_name: _tree.AxisName = None,
    skip_nonfinite: bool = True,
    check_updates: bool = False,
    fuse_unscale: bool = False,
    clip_by_global_norm: float | None = None,
) -> LossScalingTransformation:
  """Wraps `inner` so that it receives unscaled gradients and skips overflowed steps.

  `update(grads, state, params=None, *, loss=None, **extra_args)` takes the
  gradients of the **scaled** loss (computed with `state.loss_scale`, e.g. by
  `scaled_value_and_grad`). It checks once whether they are finite once divided by
  that scale, updates the loss scale, and runs `inner` on the unscaled gradients.
  On a skipped step the updates are exactly zero and `inner_state` is returned
  unchanged, so moments are not poisoned and step counts and schedules do not
  advance. `apply_gradients(grads, state, params)` does the same and applies the
  updates, in one pass (see `LossScalingTransformation`).

  A step is skipped when the loss scale says so (`should_apply` False) and, with
  `skip_nonfinite=True`, whenever the unscaled gradients are not finite, whatever
  the loss scale: even with a `FixedLossScale` no NaN ever reaches the parameters.
  If `loss=` (the unscaled loss) is given and is not finite, the step is skipped,
  the loss scale is left as it was, and `nonfinite_loss_steps` counts it.

  Args:
    inner: the optimizer to wrap, e.g. `optax.adam(1e-3)` or an `optax.chain`.
    loss_scale: a `LossScale`, or an identifier accepted by `jax_lossscale.get`
      (a number for a fixed scale, `"dynamic"`, or a serialized dict).
    axis_name: inside `shard_map`/`pmap`, the mapped axis name (or tuple of names)
      over which finiteness is agreed with one collective, so every replica skips
      the same steps. Not needed under SPMD `jit` with global arrays.
    skip_nonfinite: also skip non-finite steps that the loss scale would apply.
    check_updates: also skip a step whose *updates* are not finite although the
      gradients were, i.e. when the inner optimizer itself produces inf/NaN (for
      example Adam on float16 parameters, whose `eps=1e-8` underflows to 0). Costs
      one more pass over the updates (and a second collective with `axis_name`),
      so it is off by default; the loss scale is not changed by such a step.
    fuse_unscale: unscale the gradients inside the inner optimizer's own pass, by
      multiplying with the reciprocal of the scale, instead of writing them out
      first. Saves a write and a read of the gradients and a gradient-sized
      temporary: with `apply_gradients` on CPU a step then reads the gradients
      only once more than plain optax. The compiler may contract the unscaling
      into the optimizer's multiply-adds, so results can differ from a run without
      loss scaling in the last bits (and, for a scale that is not a power of two,
      by the rounding of the reciprocal). Off by default, so that a run that skips
      a step equals, bit for bit, an unscaled run that never saw that batch.
    clip_by_global_norm: a positive `max_norm` to clip the unscaled gradients to
      their global norm before `inner` sees them, as an
      `optax.clip_by_global_norm(max_norm)` first in `inner` would, while the
      norm's one reduction also decides finiteness: a step reads the gradients no
      more often than plain clipped optax. A step then counts as non-finite when
      that norm is: whenever a gradient is inf or NaN, and also when finite
      gradients have a global norm beyond float32's range (above about 1.8e19),
      which optax's clipping would turn into zero updates. With float32 gradients,
      `apply_gradients` then equals, bit for bit, an unscaled run of
      `chain(clip_by_global_norm(max_norm), inner)` that never saw the skipped
      batches, and `update` equals clipping first inside `inner`; float16 and
      bfloat16 gradients are squared and divided in float32. With `fuse_unscale`
      the clip factor joins the unscaling multiplication. Inside `shard_map` or
      `pmap` the norm is of this device's gradients, as optax's would be.

  Returns:
    A `LossScalingTransformation`; extra keyword arguments other than `loss` are
    passed on to `inner`.
  """
  initial = _serialization.get(loss_scale)
  if not isinstance(initial, _loss_scale.LossScale):
    raise ValueError(f"loss_scaling: `loss_scale` must not be None, got {loss_scale!r}.")
  for name, flag in [("skip_nonfinite", skip_nonfinite), ("check_updates", check_updates),
                     ("fuse_unscale", fuse_unscale)]:
    if not isinstance(flag, bool):
      raise ValueError(f"loss_scaling: `{name}` must be a bool, got {flag!r}.")
  if clip_by_global_norm is not None:
    max_norm = clip_by_global_norm
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) \
        or not 0 < max_norm < float("inf"):
      raise ValueError(
          "loss_scaling: `clip_by_global_norm` must be None or a positive finite "
          f"number, got {max_norm!r}.")
    max_norm = float(max_norm)
  inner = optax.with_extra_args_support(inner)

  def init_fn(params):
    # Separate buffers for every field: a donated state must not alias itself.
    zero = lambda: jnp.zeros([], jnp.int32)
    return LossScalingState(
        loss_scale=jax.tree.map(jnp.array, initial),
        inner_state=inner.init(params),
        skipped_steps=zero(),
        consecutive_skips=zero(),
        last_applied=jnp.ones([], jnp.bool_),
        nonfinite_loss_steps=zero(),
    )

  def decide(grads, state, loss, norm):
    """`(should_apply, new_loss_scale, loss_finite)` from the scaled gradients.

    With clipping, `norm` is the global norm of the unscaled gradients, and its
    finiteness decides; otherwise the largest magnitudes do.
    """
    loss_scale_ = state.loss_scale
    if norm is not None:
      largest = [norm]
    else:
      # Finite after unscaling exactly when the largest magnitudes are, unscaled.
      largest = loss_scale_.unscale(_tree.max_magnitude_per_dtype(grads))
    if loss is None:
      (grads_finite,), loss_finite = _tree.agreed_all_finite([largest], axis_name), None
    else:
      grads_finite, loss_finite = _tree.agreed_all_finite([largest, loss], axis_name)

    new_loss_scale, should_apply = loss_scale_.adjust(grads_finite)
    if skip_nonfinite:
      should_apply = should_apply & grads_finite
    if loss_finite is not None:
      # Scaling cannot cause or cure a non-finite forward pass: keep the scale.
      new_loss_scale = _tree.select_tree(loss_finite, new_loss_scale, loss_scale_)
      should_apply = should_apply & loss_finite
    return should_apply, new_loss_scale, loss_finite

  def new_state(state, should_apply, new_loss_scale, new_inner_state, loss_finite):
    return LossScalingState(
        loss_scale=new_loss_scale,
        inner_state=new_inner_state,
        skipped_steps=jnp.where(
            should_apply, state.skipped_steps, optax.safe_increment(state.skipped_steps)
        ),
        consecutive_skips=jnp.where(
            should_apply, 0, optax.safe_increment(state.consecutive_skips)
        ),
        last_applied=should_apply,
        nonfinite_loss_steps=state.nonfinite_loss_steps
        + (0 if loss_finite is None else jnp.logical_not(loss_finite).astype(jnp.int32)),
    )

  def step(grads, state, params, loss, extra_args, apply):
    """The common step: updates (or new params when `apply`) and the new state."""
    if fuse_unscale:  # traced inside the branch that applies the step
      unscaled = lambda: _loss_scale.unscale_by_reciprocal(state.loss_scale, grads)  # noqa: E731
    else:
      # Unscaled outside any branch, so under `lax.cond` the optimizer reads them
      # from memory exactly as it reads unscaled gradients. Fused into its loop,
      # any extra operation changes how LLVM orders and contracts the optimizer's
      # own arithmetic into multiply-adds (its operand ranking counts the depth of
      # each operand), and the last bits of the result with it.
      outside = state.loss_scale.unscale(grads)
      unscaled = lambda: outside  # noqa: E731
    # The clip's norm, reduced once outside any branch, is also the check.
    norm = None if clip_by_global_norm is None else _tree.global_norm(unscaled())
    should_apply, new_loss_scale, loss_finite = decide(grads, state, loss, norm)

    def run_inner():
      if norm is None:
        gradients = unscaled()
      elif fuse_unscale:
        # One multiplication per element, by the reciprocal times the clip factor:
        # no divided copy of the gradients for XLA to write out.
        factor = jnp.where(norm < max_norm, 1, max_norm / norm).astype(jnp.float32)
        gradients = _loss_scale.unscale_by_reciprocal(state.loss_scale, grads, factor)
      else:
        gradients = _tree.clip_by_norm(unscaled(), norm, max_norm)
      return inner.update(gradients, state.inner_state, params, **extra_args)

    def by_cond():  # only for `apply`: the skipped branch keeps params and state
      def applied():
        updates, new_inner_state = run_inner()
        return optax.apply_updates(params, updates), new_inner_state
      return _tree.cond(should_apply, applied, lambda: (params, state.inner_state)), should_apply

    def by_where():
      updates, new_inner_state = run_inner()
      applied = should_apply
      if check_updates:
        applied = applied & _tree.all_finite(updates, axis_name)
      if apply:
        out = _tree.select_tree(applied, optax.apply_updates(params, updates), params)
      else:
        out = _tree.zeros_unless(applied, updates)
      new_inner_state = _tree.select_tree(applied, new_inner_state, state.inner_state)
      return (out, new_inner_state), applied

    if apply and not check_updates:
      # On CPU a branch lets the donated parameters and optimizer state be updated
      # in place; `jnp.where` would make XLA copy them. Elsewhere `jnp.where` needs
      # no branch on the device.
      (out, new_inner_state), should_apply = _tree.through_arrays(
          lambda cpu, default: jax.lax.platform_dependent(cpu=cpu, default=default),
          by_cond, by_where)
    else:
      (out, new_inner_state), should_apply = by_where()
    return out, new_state(state, should_apply, new_loss_scale, new_inner_state, loss_finite)

  def update_fn(grads, state, params=None, *, loss=None, **extra_args):
    return step(grads, state, params, loss, extra_args, apply=False)

  def apply_fn(grads, state, params, *, loss=None, **extra_args):
    return step(grads, state, params, loss, extra_args, apply=True)

  tx = LossScalingTransformation(init_fn, update_fn)
  tx._apply_gradients = apply_fn
  return tx


def find_state(opt_state: Any) -> LossScalingState:
  """Finds the one `LossScalingState` anywhere inside a (nested) optax state.

  Looks through chains, `MultiSteps`, `inject_hyperparams`, `multi_transform` and
  any other pytree of states.

  Raises:
    ValueError: if there is none, or more than one.
  """
  if isinstance(opt_state, LossScalingState):
    return opt_state
  found = [
      leaf
      for leaf in jax.tree.leaves(
          opt_state, is_leaf=lambda x: isinstance(x, LossScalingState)
      )
      if isinstance(leaf, LossScalingState)
  ]
  if len(found) != 1:
    raise ValueError(
        f"Expected exactly one loss_scaling state inside the optimizer state, found "
        f"{len(found)}. Is the optimizer wrapped with jax_lossscale.loss_scaling?"
    )
  return found[0]


def get_loss_scale(opt_state: Any) -> _loss_scale.LossScale:
  """Returns the current `LossScale` found anywhere inside a nested optax state."""
  return find_state(opt_state).loss_scale


def metrics(opt_state: Any) -> dict[str, jax.Array]:
  """Scalars for logging: `loss_scale`, `skipped_steps`, `consecutive_skips`,
  `last_applied`, `nonfinite_loss_steps`.

  Jittable; the values stay on device until the caller reads them.
  """
  state = find_state(opt_state)
  return {
      "loss_scale": state.loss_scale(),
      "skipped_steps": state.skipped_steps,
      "consecutive_skips": state.consecutive_skips,
      "last_applied": state.last_applied,
      "nonfinite_loss_steps": state.nonfinite_loss_steps,
  }


def scaled_value_and_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any]]:
  """Like `jax.value_and_grad`, for a loss that must be multiplied by the loss scale.

  The returned function takes the loss scale first: either a `LossScale` or an
  optimizer state containing a `loss_scaling` state (the scale is looked up in it).
  It differentiates `loss_scale.scale(fun(...))` and returns the **unscaled** loss
  (and aux) with the gradients of the **scaled** loss, ready for the `update` of a
  `loss_scaling` transformation, which unscales them::

      grad_fn = jax_lossscale.scaled_value_and_grad(loss_fn)
      loss, grads = grad_fn(opt_state, params, batch)
      updates, opt_state = tx.update(grads, opt_state, params)

  Args:
    fun: the loss function; returns a scalar (or `(scalar, aux)` with `has_aux`).
    argnums: as in `jax.value_and_grad`.
    has_aux: as in `jax.value_and_grad`.

  Returns:
    A function `(loss_scale_or_opt_state, *args, **kwargs) -> (value, grads)`.
  """

  def scaled(loss_scale, *args, **kwargs):
    out = fun(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    return loss_scale.scale(loss), (loss, aux)

  grad_fn = jax.value_and_grad(scaled, argnums=_shift(argnums), has_aux=True)

  @functools.wraps(fun)
  def wrapper(loss_scale_or_state, *args, **kwargs):
    loss_scale = (
        loss_scale_or_state
        if isinstance(loss_scale_or_state, _loss_scale.LossScale)
        else get_loss_scale(loss_scale_or_state)
    )
    (_, (loss, aux)), grads = grad_fn(loss_scale, *args, **kwargs)
    return ((loss, aux) if has_aux else loss), grads

  return wrapper


def _shift(argnums):
  if isinstance(argnums, int):
    return argnums + 1
  return tuple(a + 1 for a in argnums)


class LossScaleStuckError(RuntimeError):
  """Raised by `raise_if_stuck` when training makes no progress."""


def raise_if_stuck(opt_state: Any, max_consecutive_skips: int = 100) -> None:
  """Fails fast when every recent step was skipped.

  A host-side check: it reads three scalars from the device, so call it at your
  logging cadence (every N steps), not inside the jitted step.

  Args:
    opt_state: an optimizer state containing a `loss_scaling` state.
    max_consecutive_skips: how many skipped steps in a row count as stuck.

  Raises:
    LossScaleStuckError: with the scale, the floor and the likely cause.
    ValueError: if `max_consecutive_skips` is not a positive integer.
  """
  if isinstance(max_consecutive_skips, bool) or not isinstance(max_consecutive_skips, int) \
      or max_consecutive_skips < 1:
    raise ValueError(
        f"`max_consecutive_skips` must be a positive int, got {max_consecutive_skips!r}."
    )
  state = find_state(opt_state)
  consecutive = int(state.consecutive_skips)
  if consecutive < max_consecutive_skips:
    return
  scale = float(state.loss_scale())
  floor = getattr(state.loss_scale, "min_loss_scale", None)
  at_floor = floor is not None and scale <= floor
  nonfinite_loss = int(state.nonfinite_loss_steps)
  cause = (
      "the loss itself is inf/NaN (a forward-pass problem, not an overflow)"
      if nonfinite_loss and nonfinite_loss >= consecutive
      else "the unscaled gradients are inf/NaN even at this scale, so the model "
      "itself diverges or overflows in the forward pass"
      if at_floor
      else "the gradients keep overflowing"
  )
  raise LossScaleStuckError(
      f"Training is stuck: the last {consecutive} steps were all skipped "
      f"(max_consecutive_skips={max_consecutive_skips}). Current loss scale {scale:g}"
      + (f", already at its minimum {floor:g}" if at_floor else "")
      + f". Likely cause: {cause}. To find where: "
      "jax_lossscale.nonfinite_leaf_paths(jax_lossscale.nonfinite_leaves(grads))."
  )
