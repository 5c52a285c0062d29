"""Loss scaling as an optax `GradientTransformation`.

One step, in the order a reader meets it below: `decide` (one check of the scaled
gradients, agreed across devices with one collective, and the next loss scale),
`unscale` (a multiplication by the reciprocal of the scale, with any clipping folded
into the same factor, traced inside the inner optimizer's own pass), `run_inner` (the
wrapped optimizer, and the check of low-precision updates), then one of the two ways
of emitting the result (`emit_by_cond` on CPU, `emit_by_where` elsewhere), and
`next_state`.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_lossscale import _loss_scale
from jax_lossscale import _serialization
from jax_lossscale import _tree
from jax_lossscale import _validation


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
    nonfinite_loss_steps: int32 scalar, the steps skipped because the (unscaled)
      loss passed as `loss=` was itself inf or NaN: a forward-pass problem that no
      loss scale can cause or cure, so the scale is left alone.
    nonfinite_update_steps: int32 scalar, the steps skipped because the inner
      optimizer turned finite gradients into inf or NaN updates of low-precision
      parameters (for example Adam's `eps=1e-8`, which is 0 in float16); the scale
      is left alone.
    consecutive_nonfinite_loss: int32 scalar, how many of the `consecutive_skips`
      had a non-finite loss.
    consecutive_nonfinite_updates: int32 scalar, how many of the `consecutive_skips`
      had non-finite updates from finite gradients.
  """

  loss_scale: _loss_scale.LossScale
  inner_state: optax.OptState
  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  last_applied: jax.Array
  nonfinite_loss_steps: jax.Array
  nonfinite_update_steps: jax.Array
  consecutive_nonfinite_loss: jax.Array
  consecutive_nonfinite_updates: jax.Array


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
  """What `loss_scaling` returns: an optax transformation with a fused step.

  A plain `optax.GradientTransformationExtraArgs` of two functions, `init` and
  `update`; it composes like one (`optax.chain`, flax's `TrainState`,
  `nnx.Optimizer`). `apply_gradients` also applies the updates, in one pass.
  """

  @property
  def init(self):
    """`init(params) -> LossScalingState`: the initial state, around `inner.init`.

    Raises:
      ValueError: if the inner optimizer already contains a `loss_scaling`.
    """
    return tuple.__getitem__(self, 0)

  @property
  def update(self):
    """`update(grads, state, params=None, *, loss=None, **extra_args)`.

    Returns `(updates, new_state)` for the gradients of the scaled loss; see
    `loss_scaling`. Updates of a skipped step are `-0.0`, so `optax.apply_updates`
    leaves every parameter bit-identical.
    """
    return tuple.__getitem__(self, 1)

  def apply_gradients(self, grads, state, params, **extra_args):
    """`update` followed by `optax.apply_updates`, fused.

    The fastest way to train: on CPU a skipped step does no work and the donated
    parameters and optimizer state are updated in place.

    Args:
      grads: gradients of the scaled loss, as for `update`.
      state: the `LossScalingState`.
      params: the parameters to update.
      **extra_args: as for `update`, including `loss=`.

    Returns:
      `(new_params, new_state)`: what `update` and `optax.apply_updates` give (to
      float rounding), in one pass over the parameters and the optimizer state.
    """
    update = self.update
    if isinstance(update, LossScaledUpdate):
      return update.apply_gradients(grads, state, params, **extra_args)
    updates, state = update(grads, state, params, **extra_args)
    return optax.apply_updates(params, updates), state


def loss_scaling(
    inner: optax.GradientTransformation,
    # Loss scales are immutable, so a shared default instance is safe.
    loss_scale: _loss_scale.LossScale | float | str | dict = _loss_scale.DynamicLossScale(),  # noqa: B008
    *,
    axis_name: _tree.AxisName = None,
    clip_by_global_norm: float | None = None,
) -> LossScalingTransformation:
  """Wraps `inner` so that it receives unscaled gradients and skips overflowed steps.

  `update(grads, state, params=None, *, loss=None, **extra_args)` takes the
  gradients of the **scaled** loss (computed with the state's loss scale, e.g. by
  `scaled_value_and_grad`). It checks once whether they are finite once divided by
  that scale, updates the loss scale, and runs `inner` on the unscaled gradients,
  which are multiplied by the reciprocal of the scale inside `inner`'s own pass.
  `apply_gradients(grads, state, params)` also applies the updates, in one pass.

  A step is skipped when the unscaled gradients are not finite (whatever the loss
  scale: even with a `FixedLossScale` no NaN ever reaches the parameters), when the
  loss scale says so, when `loss=` (the unscaled loss) is given and is not finite,
  and when `inner` turns finite gradients into inf or NaN updates of parameters
  narrower than float32 (float16, bfloat16: for example Adam's `eps=1e-8` is 0 in
  float16); that last check costs nothing for float32 parameters. A skipped step
  returns updates of `-0.0` (the additive identity: `optax.apply_updates` then
  leaves every parameter, even a `-0.0`, bit-identical) and leaves `inner_state`
  exactly as it was, so moments are not poisoned and step counts and schedules do
  not advance. Only an overflow changes the loss scale.

  Args:
    inner: the optimizer to wrap: an optax transformation such as
      `optax.adam(1e-3)`, an `optax.chain` or `optax.MultiSteps`.
    loss_scale: a `LossScale`, or an identifier accepted by `jax_lossscale.get`
      (a number for a fixed scale, `"dynamic"`, or a serialized dict).
    axis_name: for `shard_map`/`pmap` training steps, where each device holds its
      own gradients (ZeRO/FSDP): the mapped axis name (or tuple of names) over which
      finiteness is agreed with one collective, so every device skips the same
      steps. Not needed under SPMD `jit` with global arrays.
    clip_by_global_norm: for models trained with gradient clipping: a positive
      `max_norm` to clip the unscaled gradients to, as
      `optax.clip_by_global_norm(max_norm)` first in `inner` would (to float
      rounding), but cheaper: the norm's one reduction is also the finiteness
      check, and the clip factor joins the unscaling multiplication. A step then
      also counts as an overflow when finite gradients have a global norm beyond
      float32's range (above about 1.8e19), which optax's clip would turn into zero
      updates; float16 and bfloat16 gradients are squared in float32. Inside
      `shard_map` or `pmap` the norm is of this device's gradients, as optax's
      would be. Around `optax.MultiSteps` it clips each micro-batch, whereas a clip
      inside `MultiSteps` clips their average once per macro step.

  Returns:
    A `LossScalingTransformation`; extra keyword arguments other than `loss` are
    passed on to `inner`.

  Raises:
    TypeError: if `inner` is not an optax transformation, or already is a
      `loss_scaling`.
    ValueError: for a bad `loss_scale` or `clip_by_global_norm`.
  """
  inner = _check_inner(inner)
  initial = _serialization.get(loss_scale)
  if not isinstance(initial, _loss_scale.LossScale):
    raise ValueError(f"loss_scaling: `loss_scale` must not be None, got {loss_scale!r}.")
  max_norm = None
  if clip_by_global_norm is not None:
    max_norm = _validation.real("clip_by_global_norm", clip_by_global_norm)
    if max_norm <= 0:
      raise ValueError(
          f"`clip_by_global_norm` must be None or positive, got {clip_by_global_norm!r}.")
  step = LossScaledUpdate(inner, initial, axis_name, max_norm)
  return LossScalingTransformation(step.init, step)


def _check_inner(inner: Any) -> optax.GradientTransformationExtraArgs:
  if isinstance(inner, LossScalingTransformation) or isinstance(
      getattr(inner, "update", None), LossScaledUpdate):
    raise TypeError(
        "loss_scaling: `inner` is already a loss_scaling transformation; wrapping it "
        "again would unscale the gradients twice. Wrap the optimizer once: "
        "loss_scaling(optax.adam(1e-3)).")
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    hint = ""
    if callable(inner):
      name = getattr(inner, "__qualname__", repr(inner))
      hint = f" {name} is a function: did you forget to call it, e.g. optax.adam(1e-3)?"
    raise TypeError(
        "loss_scaling: `inner` must be an optax GradientTransformation (with `init` "
        f"and `update`), such as optax.adam(1e-3), got {inner!r}.{hint}")
  return optax.with_extra_args_support(inner)


class LossScaledUpdate:
  """The `update` of a `loss_scaling` transformation (and its fused form).

  `update(grads, state, params=None, *, loss=None, **extra_args) -> (updates,
  new_state)`:

  Args:
    grads: gradients of the **scaled** loss, computed with `state.loss_scale`.
    state: the `LossScalingState` returned by `init` or the previous `update`.
    params: the parameters, if `inner` needs them.
    loss: optional, the unscaled loss of this step (any shape): a non-finite loss
      skips the step without changing the loss scale and is counted in
      `nonfinite_loss_steps`.
    **extra_args: passed on to the inner transformation.

  Returns:
    `(updates, new_state)`; updates are `-0.0` on a skipped step.
  """

  def __init__(self, inner, initial, axis_name, max_norm):
    self.inner, self.initial = inner, initial
    self.axis_name, self.max_norm = axis_name, max_norm

  def init(self, params) -> LossScalingState:
    """The initial `LossScalingState`; `inner.init(params)` is its `inner_state`."""
    inner_state = self.inner.init(params)
    if any(isinstance(x, LossScalingState) for x in jax.tree.leaves(
        inner_state, is_leaf=lambda x: isinstance(x, LossScalingState))):
      raise TypeError(
          "loss_scaling: the inner optimizer already contains a loss_scaling "
          "transformation; wrapping it again would unscale the gradients twice.")
    # Separate buffers for every field: a donated state must not alias itself.
    zero = lambda: jnp.zeros([], jnp.int32)  # noqa: E731
    return LossScalingState(
        loss_scale=jax.tree.map(jnp.array, self.initial),
        inner_state=inner_state,
        skipped_steps=zero(),
        consecutive_skips=zero(),
        last_applied=jnp.ones([], jnp.bool_),
        nonfinite_loss_steps=zero(),
        nonfinite_update_steps=zero(),
        consecutive_nonfinite_loss=zero(),
        consecutive_nonfinite_updates=zero(),
    )

  def __call__(self, grads, state, params=None, *, loss=None, **extra_args):
    return self._step(grads, state, params, loss, extra_args, apply=False)

  def apply_gradients(self, grads, state, params, *, loss=None, **extra_args):
    """`(new_params, new_state)`: `__call__` and `optax.apply_updates`, fused."""
    return self._step(grads, state, params, loss, extra_args, apply=True)

  def _step(self, grads, state, params, loss, extra_args, apply):
    _check_state(state)
    decision = decide(grads, state, loss, self.axis_name, self.max_norm)

    if apply:
      result, skipped = lambda updates: optax.apply_updates(params, updates), params
    else:
      result, skipped = lambda updates: updates, None

    def run():
      updates, inner_state = self.inner.update(
          unscale(grads, decision.factors), state.inner_state, params, **extra_args)
      return result(updates), inner_state, narrow_updates_finite(updates, self.axis_name)

    # Traced once, however many branches call it (see `_tree.traced_once`).
    run = _tree.traced_once(run, grads, state, params, extra_args)
    if skipped is None:
      skipped = _tree.negative_zeros_like(_tree.shapes_of(run)[0], like=grads)

    def by(emit):
      return lambda: emit(decision.should_apply, run, skipped, state.inner_state)

    out, inner_state, updates_finite = _tree.on_platform(
        cpu=by(emit_by_cond), default=by(emit_by_where))
    return out, next_state(state, decision, inner_state, updates_finite)


def _check_state(state: Any) -> None:
  if not isinstance(state, LossScalingState):
    raise TypeError(
        "`state` must be the LossScalingState returned by tx.init(params) (or by the "
        f"previous update), got {type(state).__name__}: {state!r:.200}")


class Decision(NamedTuple):
  """What `decide` found out about one step, before the inner optimizer runs.

  Attributes:
    should_apply: bool scalar: the gradients (and the loss) are finite and the loss
      scale agrees to apply them.
    loss_scale: the next loss scale if the updates turn out fine.
    loss_finite: bool scalar, or `None` when no loss was given.
    factors: the float32 scalars to multiply the scaled gradients by: the
      reciprocal of the scale (see `_loss_scale.reciprocal`), times the clip factor.
  """

  should_apply: jax.Array
  loss_scale: _loss_scale.LossScale
  loss_finite: jax.Array | None
  factors: tuple[jax.Array, ...]


def decide(grads, state: LossScalingState, loss, axis_name, max_norm) -> Decision:
  """Checks the scaled gradients once and chooses the next loss scale."""
  loss_scale = state.loss_scale
  factors = loss_scale.unscale_factors()
  if max_norm is None:
    # Finite after unscaling exactly when each dtype's largest magnitude is.
    grads_finite = _tree.finite_after(_tree.largest_magnitudes(grads), *factors)
  else:
    # The clip's norm is also the check. It is taken of the scaled gradients (the
    # kernel optax's clip uses; a factor inside it would make XLA:CPU write the
    # factor out as an array) and unscaled as a scalar: for a power-of-two scale,
    # exactly the norm of the unscaled gradients.
    norm = _tree.multiply(_tree.global_norm(grads), *factors)
    grads_finite = jnp.isfinite(norm)
    # float16 and float8 gradients can overflow their dtype when unscaled by a
    # scale below 1 while the float32 norm stays finite: check those exactly.
    short = [x for x in _tree.float_leaves(grads) if _tree.has_short_range(x.dtype)]
    if short:
      grads_finite &= _tree.finite_after(_tree.largest_magnitudes(short), *factors)
    clip = jnp.where(norm < max_norm, 1, max_norm / norm).astype(jnp.float32)
    factors = (*factors[:-1], factors[-1] * clip) if factors else (clip,)
  flags = [grads_finite] if loss is None else [grads_finite, _loss_finite(loss)]
  grads_finite, *loss_finite = _tree.agree(flags, axis_name)
  loss_finite = loss_finite[0] if loss_finite else None

  new_loss_scale, should_apply = loss_scale.adjust(grads_finite)
  should_apply = should_apply & grads_finite
  if loss_finite is not None:
    # Scaling cannot cause or cure a non-finite forward pass: keep the scale.
    new_loss_scale = _tree.select_tree(loss_finite, new_loss_scale, loss_scale)
    should_apply = should_apply & loss_finite
  return Decision(should_apply, new_loss_scale, loss_finite, factors)


def _loss_finite(loss: Any) -> jax.Array:
  if not _tree.is_array(loss):
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
      raise TypeError(
          "`loss` must be the unscaled loss of the step (a number or an array), got "
          f"{type(loss).__name__}: {loss!r:.100}")
    loss = jnp.asarray(loss, jnp.float32)
  return _tree.finite_after(_tree.largest_magnitudes(loss))


def unscale(grads: Any, factors: tuple[jax.Array, ...]) -> Any:
  """The gradients times `factors`, leaf by leaf in each leaf's compute dtype.

  The one unscaling mechanism: traced where the inner optimizer consumes it, so XLA
  fuses the multiplication into the optimizer's own loop and writes no unscaled copy.
  """
  if not factors:
    return grads
  return _tree.map_float_leaves(lambda x: _tree.multiply(x, *factors), grads)


def narrow_updates_finite(updates: Any, axis_name) -> jax.Array | None:
  """Whether the updates of leaves narrower than float32 are finite; `None` if none.

  Adam's `eps=1e-8` is 0 in float16, so finite gradients can give 0/0 there.
  float32 and wider updates are not checked, so they cost nothing.
  """
  narrow = [x for x in _tree.float_leaves(updates) if _tree.is_narrow(x.dtype)]
  if not narrow:
    return None
  return _tree.agree([_tree.finite_after(_tree.largest_magnitudes(narrow))], axis_name)[0]


def emit_by_cond(should_apply, run, skipped, inner_state):
  """CPU: a skipped step runs nothing, and donated buffers are updated in place.

  `jnp.where` would make XLA:CPU copy the donated parameters and optimizer state
  (benchmarks/RESULTS.md). `run()` gives `(updates or new params, new inner state,
  whether the narrow updates are finite or None)`; returns the chosen ones.
  """

  def applied():
    out, new_inner_state, finite = run()
    if finite is None:
      return out, new_inner_state, jnp.array(True)
    return (*_tree.cond(finite, lambda: (out, new_inner_state),
                        lambda: (skipped, inner_state)), finite)

  return _tree.cond(should_apply, applied, lambda: (skipped, inner_state, jnp.array(True)))


def emit_by_where(should_apply, run, skipped, inner_state):
  """GPU and TPU: select with `jnp.where`, fused into the optimizer's loop.

  A `lax.cond` there would split the step into kernels on either side of it; the
  select joins the optimizer's own kernels (benchmarks/RESULTS.md).
  """
  out, new_inner_state, finite = run()
  applied = should_apply if finite is None else should_apply & finite
  out = _tree.select_tree(applied, out, skipped)
  new_inner_state = _tree.select_tree(applied, new_inner_state, inner_state)
  return out, new_inner_state, jnp.array(True) if finite is None else finite


def next_state(state: LossScalingState, decision: Decision, inner_state,
               updates_finite) -> LossScalingState:
  """The new `LossScalingState` after one step."""
  applied = decision.should_apply & updates_finite
  updates_bad = decision.should_apply & ~updates_finite
  loss_bad = jnp.array(False) if decision.loss_finite is None else ~decision.loss_finite

  def add(count, flag):
    return jnp.where(flag, optax.safe_increment(count), count)

  def streak(count, flag):
    return jnp.where(applied, 0, add(count, flag))

  return LossScalingState(
      # An optimizer that makes inf/NaN from finite gradients is not an overflow.
      loss_scale=_tree.select_tree(updates_bad, state.loss_scale, decision.loss_scale),
      inner_state=inner_state,
      skipped_steps=add(state.skipped_steps, ~applied),
      consecutive_skips=streak(state.consecutive_skips, ~applied),
      last_applied=applied,
      nonfinite_loss_steps=add(state.nonfinite_loss_steps, loss_bad),
      nonfinite_update_steps=add(state.nonfinite_update_steps, updates_bad),
      consecutive_nonfinite_loss=streak(state.consecutive_nonfinite_loss, loss_bad),
      consecutive_nonfinite_updates=streak(state.consecutive_nonfinite_updates, updates_bad),
  )
