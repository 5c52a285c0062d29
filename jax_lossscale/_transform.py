"""`loss_scaling`: loss scaling as an optax `GradientTransformation`.

A step, in the order it runs and in the order of this module's sections: its arguments
are checked, `decide` takes the decision (one check of the scaled gradients and of the loss,
agreed across devices), the inner optimizer runs on the gradients times the scale divided
out, `emit` gives its result or the skipped step's (a `lax.cond` on CPU and, where no
update is checked, on an NVIDIA GPU; a select elsewhere), and `next_state` gives the
next loss scale and the counters.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale import _eager
from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import _numerics
from jax_lossscale import _rounding
from jax_lossscale import _serialization
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale._loss_scale import LossScale
from jax_lossscale.probes import Probes
from jax_lossscale.probes import largest_gradient

# --- the state ---------------------------------------------------------------------------

class StepCounts(NamedTuple):
  """The step counts of `LossScalingState`, one int32 scalar each (saturating at the
  int32 maximum, as `optax.safe_increment`).

  Attributes:
    skipped_steps: steps skipped so far.
    consecutive_skips: steps skipped in a row up to now.
    nonfinite_loss_steps: steps skipped because the unscaled loss passed as `loss=` was
      inf or NaN (a forward-pass problem, so the scale is left alone).
    nonfinite_update_steps: steps skipped because the inner optimizer turned finite
      gradients into inf or NaN updates of low-precision parameters (e.g. Adam's
      `eps=1e-8`, which is 0 in float16) or, with `apply_gradients`, into updates that
      overflow such a parameter.
    consecutive_nonfinite_loss: how many of the `consecutive_skips` were for a non-finite
      loss.
    consecutive_nonfinite_updates: how many of the `consecutive_skips` were for non-finite
      updates.
  """

  skipped_steps: jax.Array
  consecutive_skips: jax.Array
  nonfinite_loss_steps: jax.Array
  nonfinite_update_steps: jax.Array
  consecutive_nonfinite_loss: jax.Array
  consecutive_nonfinite_updates: jax.Array


COUNTS = StepCounts._fields
# The counts that restart from 0 after an applied step.
_STREAKS = ("consecutive_skips", "consecutive_nonfinite_loss", "consecutive_nonfinite_updates")


class LossScalingState(NamedTuple):
  """State of `loss_scaling`.

  Attributes:
    loss_scale: the current `LossScale`: the scale the *next* step's loss must be
      multiplied by, with its counters.
    inner_state: the state of the wrapped transformation; left exactly as it was on a
      skipped step.
    counts: the `StepCounts`, one int32 scalar per count; each is also a property of
      the state (`state.skipped_steps`).
    last_applied: bool scalar, whether the last step was applied.
    last_loss_scale: float32 scalar, the scale the last step's gradients were computed
      with (`unscale` divides by it; `loss_scale` may already hold the next one); the
      initial scale before any step.
    grad_norm: with `loss_scaling(..., grad_norm=True)`, the global L2 norm of the
      last step's unscaled gradients (before any clipping), float32
      (float64 for float64 gradients), also on a skipped step: inf or NaN when they
      overflowed, NaN before any step; else None.
    compensation: with `loss_scaling(..., rounding="compensated")`, the compensation
      buffers: for each parameter narrower than float32 an array of its dtype and shape
      holding what the last write rounded away (`None` for the other leaves); else None.
    rounding_counter: with `loss_scaling(..., rounding="stochastic")` or `"compensated"`,
      or a `state_dtype` narrower than float32, a uint32 scalar: the applied steps counted
      for the stochastic rounding's bits (a skipped step leaves it as it was); else None.

  A checkpoint written before the counts had names, or by another configuration, restores
  with `restore_state`.
  """

  loss_scale: LossScale
  inner_state: optax.OptState
  counts: StepCounts
  last_applied: jax.Array
  last_loss_scale: jax.Array | None = None
  grad_norm: jax.Array | None = None
  compensation: Any = None
  rounding_counter: jax.Array | None = None

  def count(self, name: str) -> jax.Array:
    """The count called `name` (one of `COUNTS`, the fields of `StepCounts`), an int32
    array: `state.count("skipped_steps")` is `state.counts.skipped_steps`."""
    if name not in COUNTS:
      raise ValueError(f"`name` must be one of {', '.join(COUNTS)}, got {name!r}.")
    return getattr(self.counts, name)

  @property
  def skipped_steps(self) -> jax.Array:
    """Steps skipped so far (`counts.skipped_steps`)."""
    return self.counts.skipped_steps

  @property
  def consecutive_skips(self) -> jax.Array:
    """Steps skipped in a row up to now (`counts.consecutive_skips`)."""
    return self.counts.consecutive_skips

  @property
  def nonfinite_loss_steps(self) -> jax.Array:
    """Steps skipped because the unscaled loss passed as `loss=` was inf or NaN."""
    return self.counts.nonfinite_loss_steps

  @property
  def nonfinite_update_steps(self) -> jax.Array:
    """Steps skipped because the inner optimizer turned finite gradients into inf or NaN
    updates of low-precision parameters."""
    return self.counts.nonfinite_update_steps

  @property
  def consecutive_nonfinite_loss(self) -> jax.Array:
    """How many of the `consecutive_skips` were for a non-finite loss."""
    return self.counts.consecutive_nonfinite_loss

  @property
  def consecutive_nonfinite_updates(self) -> jax.Array:
    """How many of the `consecutive_skips` were for non-finite updates."""
    return self.counts.consecutive_nonfinite_updates

  @property
  def hyperparams(self) -> dict[str, Any]:
    """The `hyperparams` of the `optax.inject_hyperparams` inside, where code that logs
    them reads them (`opt_state.hyperparams["learning_rate"]`, as levanter does;
    `optax.tree_utils.tree_get(opt_state, "learning_rate")` also finds them).

    Raises:
      AttributeError: without exactly one `inject_hyperparams` inside (so `hasattr` is
        False), naming how many there are.
    """
    kinds = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)
    is_kind = lambda x: isinstance(x, kinds)
    found = [x for x in jax.tree.leaves(self.inner_state, is_leaf=is_kind) if is_kind(x)]
    if len(found) != 1:
      raise AttributeError(
          f"LossScalingState.hyperparams: the inner optimizer state holds {len(found)} "
          "optax.inject_hyperparams states, not one; read a hyperparameter with "
          "optax.tree_utils.tree_get(opt_state, 'learning_rate').")
    return found[0].hyperparams


# The fields a checkpoint may lack (of another configuration, or written before they
# existed), and the value `init` fills each with: `restore_state` starts them so, in the
# shapes and dtypes of its target.
RESTARTED = {"grad_norm": np.nan, "compensation": 0, "rounding_counter": 0}
# Fields of a loss scale's state added after its class was released, and the value its
# constructor starts each with: a checkpoint written before may lack them.
RESTARTED_LOSS_SCALE = {"proven": 0.0}  # MeasuredLossScale's proven scale

jax.export.register_namedtuple_serialization(
    StepCounts, serialized_name="jax_lossscale.StepCounts")
jax.export.register_namedtuple_serialization(
    LossScalingState, serialized_name="jax_lossscale.LossScalingState")


# --- the checks of a step's arguments ----------------------------------------------------
# Gradients shaped like the parameters, the loss and the update's keywords (`axis_name`:
# `_finite.axis_tuple`). Every error names the argument, the value and what is allowed.


def _check_inner(inner: Any) -> None:
  if isinstance(getattr(inner, "update", None), _Step):
    raise TypeError(
        "loss_scaling: `inner` is already a loss_scaling transformation; wrapping it again "
        "would unscale the gradients twice. Wrap the optimizer once: "
        "loss_scaling(optax.adam(1e-3)).")
  if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
    hint = ""
    if callable(inner):
      hint = (f" {getattr(inner, '__qualname__', repr(inner))} is a function: did you forget "
              "to call it, e.g. optax.adam(1e-3)?")
    raise TypeError(
        "loss_scaling: `inner` must be an optax GradientTransformation (with `init` and "
        f"`update`), such as optax.adam(1e-3), got {inner!r}.{hint}")


def _loss_array(value: Any) -> jax.Array:
  """The unscaled loss passed as `loss=`: a number or an array, as an array."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return jnp.asarray(value)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(
        "`loss` must be the unscaled loss of the step (a number or an array), got "
        f"{type(value).__name__}: {value!r:.100}")
  try:
    value = float(value)  # float64 under x64: 1e300 is a finite loss there
  except OverflowError:  # an int beyond any float: not a finite loss
    value = math.inf if value > 0 else -math.inf
  return jnp.asarray(value)


def _check_grads_like_params(grads: Any, params: Any) -> None:
  """`grads` has the structure of `params` and a leaf of its shape for each array
  (`None` and leaves that are not arrays, as in equinox's filtered trees, are not
  compared), floating-point where the parameter is (only those are unscaled: without
  `params`, an integer gradient cannot be told from an integer parameter's and passes
  as it is) and not where it is an integer array (its update would be truncated); a
  Python float in `params` (not trained, as in equinox) has no gradient.
  `optax.lookahead`'s gradients are those of its fast params."""
  if params is None:
    return
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  is_none = lambda x: x is None
  ours = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
  theirs = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  if len(ours) != len(theirs):
    raise ValueError(f"`grads` must have the structure of `params`: {len(ours)} leaves "
                     f"against {len(theirs)}; grads: {str(jax.tree.structure(grads)):.300}.")
  for (grad_path, g), (path, p) in zip(ours, theirs, strict=True):
    where = jax.tree_util.keystr(path)
    if jax.tree_util.keystr(grad_path) != where:
      raise ValueError(f"`grads` must have the structure of `params`: `grads` has "
                       f"{jax.tree_util.keystr(grad_path)} where `params` has {where}.")
    if hasattr(g, "shape") and hasattr(p, "shape") and jnp.shape(g) != jnp.shape(p):
      raise ValueError(f"`grads{where}` has shape {jnp.shape(g)}, its parameter "
                       f"`params{where}` {jnp.shape(p)}.")
    if isinstance(p, float) and g is not None:
      raise TypeError(
          f"`params{where}` is the Python float {p!r}, which is not trained (as in "
          f"equinox, only arrays are), but `grads{where}` is a gradient for it: make the "
          "parameter an array (jnp.asarray) to train it, or give it no gradient (None).")
    if _trees.is_float(p) and hasattr(g, "dtype") and not _trees.is_float(g):
      raise TypeError(f"`grads{where}` is {jnp.result_type(g)}, but a gradient of the "
                      f"{jnp.result_type(p)} `params{where}` must be floating-point (it "
                      "would reach the optimizer unscaled).")
    if _trees.is_array(p) and not _trees.is_float(p) and _trees.is_float(g):
      raise TypeError(
          f"`grads{where}` is {jnp.result_type(g)}, but `params{where}` is "
          f"{jnp.result_type(p)}: its update would be cast back to {jnp.result_type(p)}, "
          "truncated ([1, 5] minus 0.5 gives [0, 4]). Give an integer parameter no "
          "floating-point gradient (None, or the float0 of jax.grad(..., allow_int=True)), "
          "or make it floating-point to train it.")
  structures = [jax.tree.structure(t, is_leaf=is_none) for t in (grads, params)]
  if structures[0] != structures[1]:  # the same paths, other containers (a tuple, a list)
    raise ValueError("`grads` must have the structure of `params`: grads "
                     f"{str(structures[0]):.200}, params {str(structures[1]):.200}.")


def _check_compensation(compensation: Any, params: Any) -> None:
  """`compensation` (`rounding="compensated"`'s buffers) holds a buffer of each narrow
  parameter's dtype and shape, and none elsewhere: as `init` made it from these
  parameters. A state made from other parameters (float32 ones, then cast to bfloat16)
  would leave a parameter uncompensated or keep its residuals in another format."""
  is_none = lambda x: x is None
  arrays = _trees.partition(params)[0]
  ours = jax.tree_util.tree_flatten_with_path(arrays, is_leaf=is_none)[0]
  try:
    theirs = jax.tree.structure(arrays, is_leaf=is_none).flatten_up_to(compensation)
  except (TypeError, ValueError):
    theirs = None
  if theirs is None or len(theirs) != len(ours):
    raise ValueError(
        "`state.compensation` does not match `params`: the state was made by tx.init from "
        f"other parameters (its buffers {str(jax.tree.structure(compensation)):.200}). Call "
        "tx.init with the parameters the step writes.")
  describe = lambda x: "None" if x is None else f"{jnp.result_type(x)}{list(jnp.shape(x))}"
  for (path, p), have in zip(ours, theirs, strict=True):
    want = p if p is not None and _rounding.is_narrow(p) else None  # its buffer's dtype, shape
    if (have is None) != (want is None) or (want is not None and (
        jnp.result_type(have) != jnp.result_type(want) or jnp.shape(have) != jnp.shape(want))):
      where = jax.tree_util.keystr(path)
      needs = (f"needs a {describe(want)} buffer" if want is not None else
               "has none (only parameters narrower than float32 are compensated)")
      raise ValueError(
          f"`state.compensation{where}` is {describe(have)}, but `params{where}` "
          f"({describe(p)}) {needs}: the state was made by tx.init from other parameters. "
          "Call tx.init with the parameters the step writes, in their dtypes.")


def _check_no_more_positional(args: tuple, function: str) -> None:
  """`loss=` and `probes=` are keyword-only: a loss passed positionally is refused in the
  caller's words (not as an internal class's signature)."""
  if args:
    raise TypeError(
        f"loss_scaling's {function} takes the gradients, the state and the parameters "
        f"positionally, and `loss=` and `probes=` by keyword only: "
        f"{function}(grads, state, params, loss=loss). Got {len(args)} more positional "
        f"argument{'s' if len(args) > 1 else ''}: "
        f"{', '.join(type(a).__name__ for a in args)}.")


def _check_update_keywords(extra_args: dict) -> None:
  """A misspelt `loss=` or `probes=` would go to the inner optimizer, which ignores it.

  Only a typo is refused (a case variant, a letter dropped or doubled, two swapped, and
  `probe`), not a word an inner transformation may take (`losses`, `lost`, `probs`).
  """
  for key in extra_args:
    meant = next((word for word in ("loss", "probes") if key != word and (
        key.lower() in _typos(word) or key.lower() == word)), None)
    if meant:
      raise TypeError(f"loss_scaling's update got `{key}=`: did you mean `{meant}=`? Other "
                      "keyword arguments go to the inner optimizer, which ignores unknown ones.")


def _typos(word: str) -> set[str]:
  """`word` with one letter dropped or doubled, or two neighbours swapped."""
  cut = range(len(word))
  return ({word[:i] + word[i + 1:] for i in cut} | {word[:i] + word[i] + word[i:] for i in cut}
          | {word[:i] + word[i + 1] + word[i] + word[i + 2:] for i in cut[:-1]}) - {
              "probs", word}


def _without_gradients(grads: Any, params: Any) -> list[tuple[str, Any]]:
  """`(path, parameter)` where `grads` has `None` and `params` an array: a floating one
  needs a gradient for an optimizer keeping state per parameter (Adam's moments); another
  (an equinox module's integer buffer, which `eqx.filter_value_and_grad` gives none)
  should not have been given to that optimizer's `init`."""
  if params is None:
    return []
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  is_none = lambda x: x is None
  ours = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
  theirs = jax.tree_util.tree_leaves(params, is_leaf=is_none)
  if len(ours) != len(theirs):
    return []
  return [(jax.tree_util.keystr(path), p) for (path, g), p in zip(ours, theirs, strict=True)
          if g is None and hasattr(p, "dtype")]


def _warn_of_narrow_hyperparameters(inner_state: Any) -> None:
  """Warns where `optax.inject_hyperparams` keeps a hyperparameter in a dtype narrower than
  float32 (the parameters', its default) that rounded it to 1 (Adam's `b2=0.999` in
  bfloat16: every update NaN, every step skipped), at any depth of `inner_state`."""
  injected = optax.InjectStatefulHyperparamsState
  found, pending = [], [inner_state]
  while pending:
    states = jax.tree.leaves(pending.pop(), is_leaf=lambda x: isinstance(x, injected))
    for state in (x for x in states if isinstance(x, injected)):
      pending.append(state.inner_state)
      found += [(name, value) for name, value in state.hyperparams.items()
                if hasattr(value, "dtype") and jnp.issubdtype(value.dtype, jnp.floating)
                and _numerics.is_narrow(value.dtype)
                and not _jax_internals.is_tracer(value) and np.asarray(value == 1).all()]
  if found:
    names = ", ".join(f"`{name}` (1.0 in {jnp.result_type(value)})" for name, value in found)
    warnings.warn(
        f"loss_scaling: optax.inject_hyperparams keeps its hyperparameters in the "
        f"parameters' dtype, where {names} rounded to 1: Adam's b2=0.999 in bfloat16 makes "
        "every update NaN and every step skipped. Pass "
        "`optax.inject_hyperparams(..., hyperparam_dtype=jnp.float32)`.", stacklevel=4)


def _inner_failure_note(grads: Any, params: Any) -> str:
  """What to do about an error the inner optimizer raised, as far as the trees tell."""
  gradientless = _without_gradients(grads, params)
  floating = [(path, p) for path, p in gradientless if _trees.is_float(p)]
  if floating:
    path = floating[0][0]
    return (f"loss_scaling: raised by the inner optimizer. `grads{path}` is None "
            f"where `params{path}` is a floating-point array that the optimizer "
            "state has a slot for: give it a gradient (zeros leave it unchanged), or leave "
            "it out of the parameters given to tx.init and to the step.")
  if gradientless:
    path, param = gradientless[0]
    return (f"loss_scaling: raised by the inner optimizer. `params{path}` is an "
            f"array of {jnp.result_type(param)} with no gradient, "
            "and the optimizer state has a slot for it: give tx.init the trainable arrays "
            "only, `tx.init(eqx.filter(module, eqx.is_inexact_array))` for an equinox "
            "module (the step still takes the whole module).")
  return ("loss_scaling: raised by the inner optimizer. If `state` was made by another "
          "optimizer's init, pass this transformation's (tx.init).")


# --- the decision ------------------------------------------------------------------------
# Are the gradients finite once unscaled, is the loss, and what do the scaled gradients get
# multiplied by: one check of the scaled gradients (or, with clipping, the clip's own norm),
# agreed across devices with one collective before anything is decided, so every replica
# takes the same decision.


class Decision(NamedTuple):
  """What is known of one step before the inner optimizer runs.

  Attributes:
    grads_finite: bool scalar: the gradients stay finite once unscaled (and clipped).
    loss_finite: bool scalar: the loss passed as `loss=` is finite (True without one).
    unscaling: what the scaled gradients are multiplied by: the reciprocal of the loss
      scale, times the clip factor when clipping.
    measured: float32 scalar, the largest magnitude of the scaled gradients and of the
      probed activation gradients, for a loss scale that measures; else None.
    grad_norm: the global L2 norm of the unscaled gradients (before clipping; inf or NaN
      where they are not finite; the largest of the devices'), when asked for; else None.
  """

  grads_finite: jax.Array
  loss_finite: jax.Array
  unscaling: _numerics.Rescale
  measured: jax.Array | None = None
  grad_norm: jax.Array | None = None

  @property
  def should_apply(self) -> jax.Array:
    return self.grads_finite & self.loss_finite


def decide(grads: Any, loss_scale: LossScale, loss: Any, axis_name: _finite.AxisName,
           max_norm: float | None, probes: Any = None, norm: bool = False) -> Decision:
  """Checks the scaled gradients and the loss once, agreed across devices; with `norm`,
  also takes the unscaled gradients' global norm (free when clipping: the clip's own),
  the largest of the devices' (one `pmax`), so replicas keep one state."""
  unscaling = loss_scale._unscaling()
  largest = _finite.largest_magnitudes(grads)
  grad_norm = None
  if max_norm is None:
    grads_finite = _finite.finite_after(largest, unscaling)
    if norm:
      grad_norm = _unscaled_norm(grads, unscaling)
  else:
    grads_finite, grad_norm, unscaling = _clipped(grads, unscaling, max_norm)
  grad_norm = _finite.agree_max(grad_norm, axis_name) if norm else None
  if probes is not None and not isinstance(probes, Probes):
    raise TypeError("`probes` must be what `scaled_value_and_grad(..., probes=True)` "
                    f"returned (a diagnostics.Probes), got {type(probes).__name__}.")
  measured = None
  if loss_scale.measures:
    measured = _finite.agree_max(_measured(largest, probes), axis_name)
  flags = [grads_finite]
  if loss is not None:
    flags.append(_finite.finite(_loss_array(loss)))
  flags = _finite.agree(flags, axis_name)
  return Decision(flags[0], flags[1] if loss is not None else jnp.array(True), unscaling,
                  measured, grad_norm)


def _measured(largest: list, probes: Any) -> jax.Array:
  """The largest gradient magnitude seen: of the parameter gradients, and of every probed
  activation gradient (its binade's top where a probe was hit several times)."""
  measured = _finite.largest_of(largest)
  if probes:
    measured = jnp.maximum(measured, largest_gradient(probes.encoded))
  return measured


class _Clipped(NamedTuple):
  """The check and the unscaling of clipped gradients.

  Attributes:
    finite: bool scalar: the gradients stay finite once unscaled and clipped.
    norm: the global L2 norm of the unscaled gradients, before clipping.
    unscaling: the reciprocal of the loss scale times the clip factor.
  """

  finite: jax.Array
  norm: jax.Array
  unscaling: _numerics.Rescale


def _clipped(grads: Any, unscaling: _numerics.Rescale, max_norm: float) -> _Clipped:
  """The clip's norm doubles as the check; the clip factor joins the unscaling.

  The norm is taken of the scaled gradients (the kernel optax's clip uses) and unscaled
  as a scalar: for a power-of-two scale, exactly the norm of the unscaled gradients.
  """
  norm = _unscaled_norm(grads, unscaling)
  finite = jnp.isfinite(norm)
  # float16 and float8 gradients can overflow their own dtype when unscaled by a scale
  # below 1 while the float32 norm stays finite: those are checked exactly.
  short = [x for x in _trees.float_leaves(grads) if _numerics.has_short_range(x.dtype)]
  if short:
    finite &= _finite.finite(short, unscaling)
  clip = jnp.where(norm < max_norm, 1, max_norm / norm)  # float64 for float64 norms
  return _Clipped(finite, norm, unscaling.times(clip))


def _unscaled_norm(grads: Any, unscaling: _numerics.Rescale) -> jax.Array:
  """The global norm of the unscaled gradients: `unscaling(global_norm(grads))`, taken of
  the scaled ones. Where that sum of squares overflows (a norm beyond about 1.8e19 in
  float32) though every gradient is finite, it is taken again, only then (a `lax.cond`),
  of each leaf divided by a power of two at its largest magnitude, exactly: the norm of
  finite gradients is finite wherever float32 holds it unscaled."""
  norm = unscaling(global_norm(grads))
  if not _trees.float_leaves(grads):
    return norm

  def rescaled():
    # Each leaf divided by a power of two at its own largest magnitude (one scalar per
    # leaf, fused into its loop: one shared by leaves of one shape XLA made an array),
    # its norm then brought to the largest leaf's power of two, and the sum to its own.
    one = jnp.ones([], norm.dtype)
    leaves = [x.astype(_numerics.compute_dtype(x.dtype)) for x in _trees.float_leaves(grads)]
    exponents = [jnp.frexp(jnp.max(jnp.abs(x), initial=0).astype(norm.dtype))[1]
                 for x in leaves]  # largest = f * 2**exponent, 0.5 <= f < 1
    top = functools.reduce(jnp.maximum, exponents)
    parts = [global_norm([x * jnp.ldexp(jnp.ones([], x.real.dtype), -e)]).astype(norm.dtype)
             * jnp.ldexp(one, e - top) for x, e in zip(leaves, exponents, strict=True)]
    return unscaling(jnp.sqrt(sum(p * p for p in parts))) * jnp.ldexp(one, top)

  return jax.lax.cond(jnp.isinf(norm), rescaled, lambda: norm)


def global_norm(tree: Any) -> jax.Array:
  """The global L2 norm of the floating leaves of `tree`, in at least float32.

  `optax.tree.norm` of the leaves, each in its compute dtype: for float32 leaves the very
  computation of `optax.clip_by_global_norm`; float16 and bfloat16 leaves are squared in
  float32 (a float16 square overflows beyond 256). Any inf or NaN makes the norm inf or
  NaN; an empty tree has norm 0.
  """
  leaves = [x.astype(_numerics.compute_dtype(x.dtype)) for x in _trees.float_leaves(tree)]
  return optax.tree.norm(leaves) if leaves else jnp.zeros([], jnp.float32)


# --- emitting the step -------------------------------------------------------------------
# By `lax.cond` on CPU and on NVIDIA GPUs, by a select on TPU and elsewhere. On CPU a
# `lax.cond` runs nothing on a skipped step and lets XLA update donated buffers in place,
# where a select would make it copy them (benchmarks/RESULTS.md, "Why `cond` on CPU and
# `where` elsewhere"). On an H200 the `cond` was faster than the select as well ("The
# step's form on an H200"), except where the step checks the updates it writes: the
# select computes them once for the check and the write. TPU keeps the select, which
# fuses into the optimizer's own kernels.
#
# All are one program: `lax.platform_dependent` holds each platform's form, and a program
# lowered for one platform keeps that platform's alone; one exported for several chooses
# when it runs. The inner optimizer is traced once for each form, and once in all where
# its two forms are one (`_traced_once`).
#
# What a step gives may hold static leaves (strings, functions of equinox modules); a
# skipped step's are those of the running step, see `_trees.arrays_of`.


class InnerStep(NamedTuple):
  """What the inner optimizer's step gives, before the step is emitted.

  Attributes:
    out: the updates, or with `apply_gradients` the new parameters.
    inner_state: the inner optimizer's new state.
    updates_finite: bool scalar, whether the updates of parameters narrower than float32
      (or their new values) are finite; `None` when nothing needed checking.
  """

  out: Any
  inner_state: Any
  updates_finite: jax.Array | None


class Emitted(NamedTuple):
  """The step's result, applied or skipped.

  Attributes:
    out: `InnerStep.out` if the step was applied, else what a skipped step gives.
    inner_state: the inner optimizer's new state if applied, else the kept one.
    applied: bool scalar, the final verdict.
    updates_finite: bool scalar, False when finite gradients gave non-finite updates.
  """

  out: Any
  inner_state: Any
  applied: jax.Array
  updates_finite: jax.Array


def run_or_pass(pred: jax.Array, fn: Callable[[bool], Any], passed: Any,
                elsewhere: Callable[[], Any], cond_on_cuda: bool = False) -> Any:
  """On CPU, `fn(True)` if `pred` else `passed`, by `lax.cond`; on an NVIDIA GPU the same
  with `fn(False)` where `cond_on_cuda`, else `elsewhere()`, as on every other platform
  (a program that holds no conditional). The outputs may hold static leaves, which must
  be `passed`'s. The skipping branch returns its operands as they came, so XLA makes it
  no computation at all (rebuilding them cost a thousand-leaf `apply_gradients` about
  0.2 s more to compile: benchmarks/RESULTS.md)."""
  arrays, static = _trees.partition(passed)
  run_elsewhere = _trees.arrays_of(elsewhere, static)

  def cond(in_place):
    run = _trees.arrays_of(lambda: fn(in_place), static)
    return lambda ops: jax.lax.cond(pred, lambda _: run(), lambda ops: ops, ops)

  out = _finite.by_platform(arrays, cpu=cond(True),
                            cuda=cond(False) if cond_on_cuda else None,
                            default=lambda ops: run_elsewhere())
  return _trees.combine(out, static)


def emit(should_apply: jax.Array, run: Callable[[bool], InnerStep], skipped: Any,
         kept: Any, checked: bool) -> Emitted:
  """The step's result: what `run` gives if it is applied, else `(skipped, kept)`.

  On CPU the step is a conditional whose branch runs `run(True)` (the form whose results
  replace the donated inputs in place, see `LossScalingTransformation._traced_step`); on
  an NVIDIA GPU, where it checks no updates, a conditional whose branch runs `run(False)`
  (faster there than the select: benchmarks/RESULTS.md, "The step's form on an H200");
  elsewhere a select of `run(False)`'s results. Where the step checks the updates it
  gives (`checked`: narrow parameters or updates), the check decides too. On CPU it is
  computed before the conditional from the inputs, by a `run(False)` of which XLA keeps
  only the reduction (the optimizer fused into it), and the branch runs the optimizer
  again. Checked inside the branch instead (a second conditional on the written results),
  every new array was a temporary of its own, copied out after the check: at 10**7
  bfloat16 parameters 60 to 120 MB of temporaries a step, which XLA:CPU allocates afresh
  and the machine faults in page by page (benchmarks/RESULTS.md, "bfloat16 parameters and
  optimizer state").

  Args:
    should_apply: bool scalar, the decision taken before running the inner optimizer.
    run: `in_place -> InnerStep`, the inner optimizer's step, traced once for each form.
    skipped: what a skipped step gives instead of `out` (`-0.0` updates, or the params).
    kept: the inner state a skipped step keeps.
    checked: whether `run` gives an `updates_finite`.

  Returns:
    An `Emitted`.
  """
  if checked:
    out, state, finite = run(False)  # on CPU, only `finite` is kept
    # A skipped step's check is of non-finite gradients: no fault of the updates.
    apply, updates_finite = should_apply & finite, finite | ~should_apply
  else:
    apply, updates_finite = should_apply, jnp.array(True)

  def ran(in_place):
    new_out, new_state, _ = run(in_place)
    return new_out, new_state

  def selected():
    new_out, new_state, _ = (out, state, None) if checked else run(False)
    return (_trees.select_tree(apply, new_out, skipped),
            _trees.select_tree(apply, new_state, kept))

  out, state = run_or_pass(apply, ran, (skipped, kept), elsewhere=selected,
                           cond_on_cuda=not checked)
  return Emitted(out, state, apply, updates_finite)


# --- the transformation ------------------------------------------------------------------


class LossScalingTransformation(optax.GradientTransformationExtraArgs):
  """What `loss_scaling` returns: an optax transformation (`init`, `update`) with a fused
  `apply_gradients`, the wrapped transformation as `inner`, and `wrap_state`."""

  @property
  def inner(self) -> Any:
    """The wrapped transformation, as given (`tx.inner.has_updated(state.inner_state)`
    for an `optax.MultiSteps`, for instance)."""
    return self.update.inner

  def apply_gradients(self, grads: optax.Updates, state: LossScalingState,
                      params: optax.Params, *args: Any,
                      **extra_args: Any) -> tuple[optax.Params, LossScalingState]:
    """`update` and `optax.apply_updates`, fused into one pass; see `loss_scaling`.

    `loss=` and `probes=` are keyword-only, as in `update`.

    Returns:
      `(new_params, new_state)`. `params` may be a whole equinox module: only its
      arrays are updated, as `eqx.apply_updates` does.
    """
    return apply_gradients(self, grads, state, params, *args, **extra_args)

  def wrap_state(self, inner_state: optax.OptState, params: Any = None) -> LossScalingState:
    """A fresh `LossScalingState` around an existing state of the inner transformation.

    For a run checkpointed without loss scaling that resumes with it; the way back is
    `state.inner_state`. With `rounding="compensated"`, `params` gives the compensation
    buffers' shapes and dtypes (they start at zero); with `state_dtype`, the inner state
    is cast to it.
    """
    return self.update.wrap_state(inner_state, params)


def apply_gradients(tx, grads, state, params, *args, **extra_args):
  """`tx.update` then `optax.apply_updates`, fused when `tx.update` is `loss_scaling`'s."""
  if isinstance(tx.update, _Step):
    return tx.update.apply(grads, state, params, *args, **extra_args)
  updates, state = tx.update(grads, state, params, *args, **extra_args)
  return _trees.apply_updates(params, updates), state


def loss_scaling(
    inner: optax.GradientTransformation,
    loss_scale: LossScale | float | str | dict = "dynamic",
    *,
    axis_name: _finite.AxisName = None,
    clip_by_global_norm: float | None = None,
    grad_norm: bool = False,
    rounding: str = "nearest",
    state_dtype: Any = None,
) -> LossScalingTransformation:
  """Wraps `inner` so that it receives unscaled gradients and skips overflowed steps.

  `update(updates, state, params=None, *, loss=None, **extra_args)` takes the gradients
  of the **scaled** loss (computed with the state's loss scale, e.g. by
  `scaled_value_and_grad`). It checks once whether they are finite once divided by that
  scale, runs `inner` on the unscaled gradients (the division happens inside `inner`'s
  own pass) and updates the loss scale.
  `apply_gradients(grads, state, params)` also applies the updates, in one pass.
  Called outside `jit`, both run as one program compiled once per signature of their
  arguments (non-array leaves are static, as under `jit`): an eager loop compiles
  nothing after its first step.

  A step is skipped when the unscaled gradients are not finite (whatever the loss
  scale: even with a `FixedLossScale` no NaN ever reaches the parameters), when `loss=`
  (the unscaled loss) is given and is not finite, and when `inner` turns finite
  gradients into inf or NaN updates of parameters narrower than float32 (free for
  float32 parameters). A skipped step returns updates of `-0.0` (the additive identity:
  every parameter, even a `-0.0`, stays bit-identical; but for a subnormal float32 or
  bfloat16 parameter, which XLA:CPU flushes to zero in any sum, as the next applied step
  would: `apply_gradients` hands the parameters back untouched) and keeps `inner_state`
  as it was, so moments are not poisoned and step counts and schedules do not advance. Only
  an overflow changes the loss scale at once; finite steps count towards a growth only
  when `inner` takes an optimizer step (`optax.MultiSteps` takes one every k calls). A
  step skipped for a non-finite `loss=` (or for non-finite updates of finite gradients)
  leaves the loss scale exactly as it was, growth counter included: the counter neither
  resets nor advances, so the finite steps on either side of it count as one run.

  Everything that changes the parameters goes inside: `loss_scaling(optax.chain(...))`.
  A transformation chained before it would see scaled gradients; one chained after it
  would still run on skipped steps. `scaled_value_and_grad` and `metrics` refuse such
  compositions.

  Args:
    inner: the optimizer to wrap: an optax transformation such as `optax.adam(1e-3)`,
      an `optax.chain` or `optax.MultiSteps`.
    loss_scale: a `LossScale`, or what `jax_lossscale.tensorflow.get` accepts: a number
      >= 1 for a `FixedLossScale`, `"dynamic"` (the default: `DynamicLossScale()`), a dict
      from `serialize`, a precision `Policy` (ours or jmp's: the loss scale its compute dtype
      calls for) or one of jmp's loss scales.
    axis_name: for `shard_map`/`pmap` steps: the mapped axis name (or names) over which
      every decision is agreed. By default every `shard_map` and `pmap` axis in scope
      (with no such axis, every named `vmap` axis), so replicas never disagree; give it to
      restrict the agreement to some axes, `()` for none (independent models under a
      named `vmap`).
    clip_by_global_norm: for models trained with gradient clipping: the `max_norm`
      (at least 2**-62) to clip the unscaled gradients to, as `optax.clip_by_global_norm`
      first in `inner` would (to float rounding), but cheaper: the norm's one reduction
      is also the check, and the clip factor joins the unscaling. The norm of finite
      gradients is taken exactly wherever float32 holds it unscaled (beyond about 1.8e19
      before unscaling, of the gradients divided by a power of two, then only); a step
      whose unscaled norm float32 does not hold is skipped like an overflow, where
      optax's clip would give zero updates. Inside `shard_map` or `pmap` the norm is of
      this device's gradients, as optax's would be. Around `optax.MultiSteps` it clips
      each micro-batch. With `grad_norm=True`, its norm is the one recorded, at no
      further cost.
    grad_norm: for gradient-norm logging (what most trainers log): record the global L2
      norm of each step's unscaled gradients in the state, read by
      `metrics(opt_state)["grad_norm"]`. Costs one more read of the gradients per step
      (the check takes their largest magnitude, not their squares); free with
      `clip_by_global_norm`. Inside `shard_map` or `pmap`, the largest of the devices'
      norms (one more scalar collective), so every replica keeps the same state: the
      global norm where the gradients are averaged before the step.
      `unscale(grads, opt_state)` gives the gradients themselves.
    rounding: for parameters narrower than float32 (bfloat16 on TPU, without float32
      master weights), how `apply_gradients` writes them: `"nearest"` (the default, as
      `optax.apply_updates`: an update below half a unit in the last place, 2**-8 at 1.0
      in bfloat16, is lost), `"stochastic"` (rounded up or down with probability
      proportional to the distance, independently per entry: the expected parameter is
      the exact sum) or `"compensated"` (Kahan summation: a buffer of each such
      parameter's dtype, in the state, keeps what the write rounded away and adds it
      back at the next step). With either, the optimizer's state kept in the parameters'
      dtype is computed in float32 too, from float32 gradients (in bfloat16, Adam's decay
      0.999 is 1.0), and written back in it stochastically (to nearest, a moving average
      whose change is below half a spacing, Adam's `nu` decaying by 0.001, would never
      move). That state is refused in float16 or float8 (the moments of float16
      parameters: squared gradients underflow there): give those a `state_dtype`.
      float32 parameters are written as they are. `update` returns updates,
      which `optax.apply_updates` would round to nearest: with `"stochastic"` or
      `"compensated"` it refuses parameters narrower than float32 (and `params=None`);
      use `apply_gradients`. See docs/bfloat16.md.
    state_dtype: for optimizer state in half the bytes (optax's `mu_dtype`, for every
      moment): the dtype the inner optimizer's real floating arrays (Adam's `mu` and
      `nu`, momentum, the moments of 0-d arrays in a tree of parameters; not other
      scalars such as injected hyperparameters, nor integer counts or complex moments)
      are kept in, e.g. `jnp.bfloat16`; one with float32's exponent range (float16 and
      float8 are refused: a second moment holds squared gradients), float64 only with
      `jax_enable_x64` on. Every such array: an optimizer that keeps a copy of the
      parameters in its state (`optax.contrib.mechanize`'s `x0`, `prodigy`'s) keeps it
      in `state_dtype` too, rounded (mechanize then barely trains in bfloat16): leave
      those at None. The
      optimizer computes in float32 inside the step, narrower gradients widened (so the
      updates `update` returns are float32; `optax.apply_updates` casts them to each
      parameter's dtype); its new state is written back stochastically, whatever
      `rounding` (to nearest, a moment's decay below half a spacing would be lost). None
      (the default) keeps the optimizer's own dtypes.

  Returns:
    A `LossScalingTransformation`; extra keyword arguments other than `loss` and `probes`
    go to `inner` (`grad=`, for optax's line searches, unscaled like the gradients).

  Raises:
    TypeError: if `inner` is not an optax transformation, or already a `loss_scaling`.
    ValueError: for a bad `loss_scale`, `clip_by_global_norm`, `grad_norm`, `rounding`
      or `state_dtype`.
  """
  _check_inner(inner)
  initial = _serialization.parse(loss_scale, "loss_scale")
  if initial is None:
    raise ValueError("`loss_scale` must be a LossScale or an identifier such as 'dynamic', "
                     "got None.")
  max_norm = None if clip_by_global_norm is None else _validation.clip_norm(
      clip_by_global_norm)
  if not isinstance(grad_norm, bool):
    raise ValueError(f"`grad_norm` must be True or False, got {grad_norm!r}.")
  _finite.axis_tuple(axis_name)  # refused here, not at the first step
  rounding = _rounding.check_rounding(rounding)
  state_dtype = _rounding.check_state_dtype(state_dtype)
  step = _Step(inner, initial, axis_name, max_norm, grad_norm, rounding, state_dtype)
  return LossScalingTransformation(step.init, step)


class _Step:
  """`update(updates, state, params=None, *, loss=None, **extra_args)` of `loss_scaling`.

  Args:
    updates: gradients of the **scaled** loss, computed with `state.loss_scale` (optax's
      name for them).
    state: the `LossScalingState` returned by `init` or the previous `update`.
    params: the parameters, if `inner` needs them (a whole equinox module is fine).
    loss: optional, the unscaled loss of this step (any shape): a non-finite loss skips
      the step without changing the loss scale (`nonfinite_loss_steps`).
    probes: optional, what the backward pass measured (`scaled_value_and_grad(...,
      probes=True)`), for a `MeasuredLossScale` to set the next scale from (others ignore them).
    **extra_args: passed on to the inner transformation; `grad=` (line searches) unscaled.

  Returns:
    `(updates, new_state)`; the updates are `-0.0` on a skipped step.
  """

  def __init__(self, inner, initial: LossScale, axis_name, max_norm, norm: bool = False,
               rounding: str = "nearest", state_dtype: Any = None):
    self.inner, self.initial = inner, initial  # `inner` as given: `tx.inner`
    self._inner = optax.with_extra_args_support(inner)
    self.axis_name, self.max_norm, self.norm = axis_name, max_norm, norm
    self.rounding, self.state_dtype = rounding, state_dtype
    # A counter for stochastic writes: of the parameters, and of any state kept narrower
    # than float32 (nearest would freeze slow moving averages such as Adam's nu).
    self.counted = rounding != "nearest" or (
        state_dtype is not None and _numerics.is_narrow(state_dtype))
    self._eager_step = _eager.CompiledBySignature(
        self._traced_step, "loss_scaling's update or apply_gradients")

  def init(self, params) -> LossScalingState:
    """The initial `LossScalingState`; `inner.init(params)` is its `inner_state`."""
    return self.wrap_state(self._inner.init(_trees.partition(params)[0]), params)

  def wrap_state(self, inner_state, params=None) -> LossScalingState:
    nested = jax.tree.leaves(inner_state, is_leaf=lambda x: isinstance(x, LossScalingState))
    if any(isinstance(x, LossScalingState) for x in nested):
      raise TypeError(
          "loss_scaling: the inner optimizer state already contains a loss_scaling state "
          "(a loss_scaling inside the optimizer, or a LossScalingState given to wrap_state); "
          "wrapping it again would unscale the gradients twice.")
    compensation = None
    if self.rounding == "compensated":
      if params is None:
        raise TypeError("wrap_state: with rounding='compensated', `params` must be the "
                        "parameters (their compensation buffers start at zero), got None.")
      compensation = _rounding.compensation_buffers(_trees.partition(params)[0])
    inner_state = _rounding.store_state(inner_state, None, self.state_dtype, "nearest", None,
                                        params)
    _rounding.check_state_kept(inner_state, self.rounding, self.state_dtype, params)
    _warn_of_narrow_hyperparameters(inner_state)
    # Separate buffers for every field: a donated state must not alias itself.
    return LossScalingState(
        loss_scale=jax.tree.map(jnp.array, self.initial), inner_state=inner_state,
        counts=StepCounts(*(jnp.zeros([], jnp.int32) for _ in COUNTS)),
        last_applied=jnp.ones([], jnp.bool_),
        last_loss_scale=jnp.array(self.initial()),
        grad_norm=jnp.full([], jnp.nan, jnp.float32) if self.norm else None,
        compensation=compensation,
        rounding_counter=jnp.zeros([], jnp.uint32) if self.counted else None)

  def __call__(self, updates, state, params=None, *args, loss=None, probes=None,
               **extra_args):
    _check_no_more_positional(args, "update")
    return self._step(updates, state, params, loss, probes, extra_args, apply=False)

  def apply(self, grads, state, params, *args, loss=None, probes=None, **extra_args):
    """`(new_params, new_state)`: `__call__` and `optax.apply_updates`, fused."""
    _check_no_more_positional(args, "apply_gradients")
    if params is None:
      raise TypeError("apply_gradients: `params` must be the parameters to update, got None.")
    return self._step(grads, state, params, loss, probes, extra_args, apply=True)

  def _step(self, grads, state, params, loss, probes, extra_args, apply):
    self._check_state(state)
    if not apply:
      self._check_update_rounding(params)
    elif self.rounding == "compensated":
      _check_compensation(state.compensation, params)
    _check_update_keywords(extra_args)
    _check_grads_like_params(grads, params)
    grads = _trees.map_float_leaves(lambda x: x, grads)  # Python floats become arrays
    loss = None if loss is None else _loss_array(loss)
    inputs = (grads, state, params, loss, probes, extra_args)
    # Outside jit, traced afresh, the step's `lax.cond`s would compile on every call.
    step = self._traced_step if _eager.traced(inputs) else self._eager_step
    return step(*inputs, apply)

  def _traced_step(self, grads, state, params, loss, probes, extra_args, apply):
    decision = decide(grads, state.loss_scale, loss, self.axis_name, self.max_norm, probes,
                      self.norm)
    arrays = None if params is None else _trees.partition(params)[0]

    def run(in_place):
      # The parameters and a line search's `grad=` are widened as the gradients are: optax's
      # line search computes its new gradient at `params + updates` and puts it in a
      # `lax.cond` beside `grad` and zeros like the parameters. `grad=` is unscaled, not
      # clipped, as optax's chain passes it.
      (wide_grads, wide_grad, wide_params), wide_state = _rounding.load(
          (grads, extra_args.get("grad"), arrays), state.inner_state, self.state_dtype,
          self.rounding)
      unscaled = {k: _trees.rescale_floats(wide_grad, state.loss_scale._unscaling())
                  if k == "grad" else v for k, v in extra_args.items()}
      try:
        updates, inner_state = self._inner.update(
            _trees.rescale_floats(wide_grads, decision.unscaling), wide_state, wide_params,
            **unscaled)
      except (AttributeError, TypeError, ValueError) as error:
        error.add_note(_inner_failure_note(grads, params))
        raise
      out, compensation = updates, state.compensation
      if apply:
        out, compensation = _rounding.write_params(params, updates, self.rounding,
                                                   state.compensation, state.rounding_counter,
                                                   in_place)
      counter = state.rounding_counter
      if in_place and counter is not None:
        # The state's stochastic writes recompute the new moments from the old ones,
        # which the parameters' writes read too: made to wait for those (by the counter
        # they hash), they may overwrite the old state in place; else XLA copies it.
        counter = _rounding.after((_trees.partition(out)[0], compensation), counter)
      inner_state = _rounding.store_state(inner_state, state.inner_state, self.state_dtype,
                                          self.rounding, counter)
      # The compensation buffers travel with the inner state: kept alike on a skipped step.
      return InnerStep(out, (inner_state, compensation), _narrow_finite(
          updates, self.axis_name, params, out if apply else None))

    static = InnerStep(
        _trees.partition(params if apply else _trees.updates_like(grads, params))[1],
        _trees.partition((state.inner_state, state.compensation))[1], None)
    # Without a rounding counter both forms are one program: traced once.
    reordered = state.rounding_counter is not None
    run, shapes = _traced_once(run, static, (grads, state, params, extra_args), reordered)
    skipped = params if apply else _trees.combine(
        _trees.negative_zeros_like(shapes.out, like=_trees.partition(grads)[0]), static.out)
    kept = (_trees.cast_like(state.inner_state, shapes.inner_state[0]), state.compensation)
    emitted = emit(decision.should_apply, run, skipped, kept,
                   checked=shapes.updates_finite is not None)
    inner_state, compensation = emitted.inner_state
    emitted = emitted._replace(inner_state=inner_state)
    stepped = _optimizer_stepped(state.inner_state, inner_state)
    return emitted.out, next_state(state, decision, emitted, stepped)._replace(
        compensation=compensation)

  def _check_state(self, state: Any) -> None:
    if not isinstance(state, LossScalingState):
      raise TypeError(
          "`state` must be the LossScalingState returned by tx.init(params) (or by the "
          f"previous update), got {type(state).__name__}: {state!r:.200}")
    ours, theirs = self.initial, state.loss_scale
    if type(theirs) is not type(ours) or theirs.get_config() != ours.get_config():
      raise ValueError(
          f"`state` belongs to another loss_scaling: its loss scale is "
          f"{type(theirs).__name__}({theirs.get_config()}), this transformation's is "
          f"{type(ours).__name__}({ours.get_config()}). Pass the state returned by this "
          "transformation's init (tx.wrap_state(state.inner_state) keeps the optimizer's).")
    if (state.grad_norm is not None) != self.norm:
      raise ValueError(
          "`state` belongs to a loss_scaling that "
          + ("does not record" if self.norm else "records")
          + " the gradients' norm (grad_norm=True), this one "
          + ("does" if self.norm else "does not")
          + ": pass tx.wrap_state(state.inner_state) to keep the optimizer's state.")
    for field, expected in (("compensation", self.rounding == "compensated"),
                            ("rounding_counter", self.counted)):
      if (getattr(state, field) is not None) != expected:
        raise ValueError(
            f"`state` belongs to a loss_scaling with another `rounding` (its `{field}` is "
            f"{'set' if getattr(state, field) is not None else 'None'}), this one has "
            f"rounding={self.rounding!r}: restore a checkpoint with jls.restore_state(saved, "
            "like=tx.init(params)).")

  def _check_update_rounding(self, params: Any) -> None:
    """`update` returns updates, which `optax.apply_updates` rounds to nearest: refused
    with another `rounding`, for the parameters it would apply to."""
    if self.rounding == "nearest":
      return
    narrow = [] if params is None else [
        jax.tree_util.keystr(path) for path, p in jax.tree_util.tree_leaves_with_path(params)
        if _rounding.is_narrow(p)]
    if params is None or narrow:
      what = ("`params` is None" if params is None else
              f"`params{narrow[0]}` is narrower than float32")
      raise ValueError(
          f"loss_scaling(..., rounding={self.rounding!r}): `update` returns updates, which "
          f"optax.apply_updates would round to nearest, and {what}. Use "
          "tx.apply_gradients(grads, opt_state, params), which writes the parameters with "
          "this rounding, or rounding='nearest'.")


def _traced_once(run, static, inputs, reordered):
  """`in_place -> run(in_place)`, each form traced at most once, and the shapes of the
  output's arrays. Inside `jit` each form is a nested `jit`, whose cached trace
  `eval_shape` and the `lax.cond` reuse: tracing an optimizer over a thousand leaves costs
  as much as compiling hundreds of them. Where not `reordered`, `run(True)` is `run(False)`.

  The nested `jit` is inlined by JAX (`inline=True`), so the program has no call in it:
  left as a call, which XLA inlines later, XLA:CPU ordered the optimizer's loops by kind
  (every leaf's first moment, then every second moment) instead of leaf by leaf, and each
  gradient's second read no longer came from cache (benchmarks/RESULTS.md, "The
  optimizer's loops leaf by leaf").
  """
  nested = any(_jax_internals.is_tracer(x) for x in jax.tree.leaves(inputs))
  forms = {}

  def form(in_place):
    in_place = in_place and reordered
    if in_place not in forms:
      arrays = _trees.arrays_of(lambda: run(in_place), static)
      forms[in_place] = jax.jit(arrays, inline=True) if nested else arrays
    return forms[in_place]

  return (lambda in_place: _trees.combine(form(in_place)(), static)), jax.eval_shape(
      form(False))


def _narrow_finite(updates, axis_name, params=None, new_params=None) -> jax.Array | None:
  """Whether updates narrower than float32 are finite (Adam's `eps=1e-8` is 0 in float16),
  `None` if none. A narrow parameter's new value (`new_params`', else `apply_updates`')
  is checked instead (60000 + 10000 is inf in float16): everywhere but where the old
  value was inf and the new one is not NaN (a masked logit's -inf bias, kept as it is by
  a finite update) or was NaN already. An infinite update of an infinite entry (weight
  decay of -inf) would write NaN: checked."""
  def leaf(p, u, n):
    if u is None or not _trees.is_float(p):
      return None
    if not _rounding.is_narrow(p):
      return u if _rounding.is_narrow(u) else None
    n = _trees.apply_updates(p, u) if n is None else n
    if jnp.dtype(n.dtype).itemsize == 1:
      # On CPU the check is a reduction with the optimizer fused into it. For float8
      # parameters that is a chain of emulated float8 conversions, on which LLVM's loop
      # vectorizer (jax 0.12) never finishes: reduced from a float8 array instead.
      n = _finite.by_platform(n, cpu=jax.lax.optimization_barrier, default=lambda n: n)
    return jnp.where(jnp.isfinite(p) | (jnp.isnan(n) & ~jnp.isnan(p)), n, 0)

  if params is None:
    checked = [x for x in _trees.float_leaves(updates) if _rounding.is_narrow(x)]
  else:
    if new_params is None:
      new_params = jax.tree.map(lambda _: None, updates)
    checked = jax.tree.leaves(jax.tree.map(leaf, params, updates, new_params,
                                           is_leaf=lambda x: x is None))
  if not checked:
    return None
  return _finite.agree([_finite.finite(checked)], axis_name)[0]


def _optimizer_stepped(old: Any, new: Any) -> jax.Array:
  """Whether `inner` took an optimizer step: not for a micro-batch that
  `optax.MultiSteps` only accumulated (its `gradient_step` did not advance)."""
  is_state = lambda x: isinstance(x, optax.MultiStepsState)
  before, after = ([x for x in jax.tree.leaves(tree, is_leaf=is_state) if is_state(x)]
                   for tree in (old, new))
  return after[0].gradient_step != before[0].gradient_step if before else jnp.array(True)


def next_state(state: LossScalingState, decision: Decision, emitted: Emitted,
               stepped: jax.Array) -> LossScalingState:
  """The new `LossScalingState` after one step: `emitted` as `emit` gave it, `stepped`
  whether the inner optimizer took an optimizer step."""
  applied = emitted.applied
  loss_bad = ~decision.loss_finite
  updates_bad = decision.should_apply & ~emitted.updates_finite
  # An overflow moves the scale at once, a finite step when the optimizer steps (every micro-
  # batch, for a measuring scale); a bad loss, or bad updates of finite gradients, do not.
  moved = (~decision.grads_finite & decision.loss_finite) | (
      applied & (stepped | state.loss_scale.measures))
  candidate = state.loss_scale.adjust(decision.grads_finite, decision.measured)
  loss_scale = _trees.select_tree(moved, candidate, state.loss_scale)
  skipped = ~applied
  increments = StepCounts(skipped, skipped, loss_bad, updates_bad, loss_bad, updates_bad)
  counts = StepCounts(*(_counted(count, increment, applied & (name in _STREAKS))
                        for name, count, increment in zip(COUNTS, state.counts, increments,
                                                                strict=True)))
  counter = state.rounding_counter
  if counter is not None:  # the stochastic rounding's bits change with applied steps only
    counter = jnp.where(applied, counter + jnp.uint32(1), counter)
  return LossScalingState(loss_scale, emitted.inner_state, counts, applied,
                          state.loss_scale(), decision.grad_norm, state.compensation, counter)


def _counted(count: jax.Array, increment: jax.Array, reset: jax.Array) -> jax.Array:
  """`count` plus `increment`, saturating as `optax.safe_increment`; 0 where `reset`."""
  count = jnp.asarray(count, jnp.int32)
  count = jnp.where(count < jnp.iinfo(jnp.int32).max, count + increment.astype(jnp.int32),
                    count)
  return jnp.where(reset, 0, count)
