"""Diagnostics: why a step was skipped, where in the backward pass, and what scale fits.

Three failure modes look alike from the outside ("loss scale already at minimum"):

* a forward pass that produces inf/NaN by itself (no scale can fix it): pass the
  loss to `loss_scaling`'s update as `loss=` and watch `nonfinite_loss_steps`;
* one part of the model whose gradients explode: `nonfinite_leaves` inside the step
  and `nonfinite_leaf_paths` on the host name the parameters;
* a scale far too small, silently flushing gradients to zero: `gradient_stats`
  measures underflow and headroom, `recommend_loss_scale` turns that into a scale.
"""

from __future__ import annotations

import functools
import math
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import _numerics
from jax_lossscale import _policy
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._readiness import Fp8Readiness
from jax_lossscale._readiness import Fp8TensorReadiness
from jax_lossscale._readiness import fp8_readiness
from jax_lossscale.probes import LOSS
from jax_lossscale.probes import Probes
from jax_lossscale.probes import ProbeSummary
from jax_lossscale.probes import TensorSummary
from jax_lossscale.probes import probe

__all__ = ("LOSS", "Fp8Readiness", "Fp8TensorReadiness", "LossScaleAdvice", "ProbeSummary",
           "Probes", "TensorSummary", "backward_overflow_origin", "forward_nonfinite_origin",
           "fp8_readiness", "gradient_stats", "headroom",
           "layers", "nonfinite_leaf_paths", "nonfinite_leaves", "probe",
           "recommend_loss_scale", "summarize", "table")


def nonfinite_leaves(tree: Any) -> Any:
  """Per leaf, whether it holds an inf or NaN: a tree of boolean scalars.

  Jittable and cheap (one reduction per leaf); meant to be switched on while
  debugging, e.g. returned as an aux output of the training step. Non-floating
  leaves give False; `None` leaves stay `None`.
  """
  return jax.tree.map(
      lambda x: ~jnp.isfinite(_finite.largest_magnitude(x)) if _trees.is_float(x)
      else jnp.array(False),
      tree,
  )


def nonfinite_leaf_paths(flags: Any) -> list[str]:
  """Host side: the paths of the flagged leaves, as `"params/layer_3/kernel"` strings.

  Args:
    flags: the output of `nonfinite_leaves` (fetched from the device or not).

  Returns:
    The paths in tree order; empty when everything is finite.

  Raises:
    ValueError: if a leaf is not a boolean flag.
  """
  for leaf in jax.tree.leaves(flags):
    if jnp.result_type(leaf) != jnp.bool_ or jnp.shape(leaf) != ():
      raise ValueError(
          "nonfinite_leaf_paths expects the boolean scalar flags from "
          f"nonfinite_leaves(grads), got a leaf of dtype {jnp.result_type(leaf)} and shape "
          f"{jnp.shape(leaf)}.")
  return [
      _trees.path_name(path)
      for path, flag in jax.tree_util.tree_leaves_with_path(flags)
      if bool(flag)
  ]


def gradient_stats(grads: Any, dtype: Any = jnp.float16, loss_scale: Any = 1.0) -> dict:
  """What casting `grads * loss_scale` to `dtype` would do to the non-zero values.

  Jittable. Values are scaled in float32 (float64 for float64 leaves) and compared
  with the magnitudes where a cast to `dtype` first gives a non-zero, a normal and a
  non-finite value, so each boundary rounds exactly as the cast does (on every
  platform: XLA:GPU may skip a cast that is cast back). XLA flushes float32
  subnormals to zero on CPU and TPU, so there inputs below 2**-126 count as zero, and
  bfloat16, which shares float32's exponent range, shows no subnormal.

  Args:
    grads: float32 (or unscaled) gradients; inf/NaN values are left out.
    dtype: the target dtype: float16 (default), bfloat16, or a float8 type such as
      `jnp.float8_e4m3fn` / `jnp.float8_e5m2`; a dtype, or a policy name ("f16").
    loss_scale: the scale to try: a positive number or scalar array, finite in
      float32 (checked unless traced), or a `LossScale` (its current scale).

  Raises:
    ValueError: for a non-floating `dtype`, or a `loss_scale` that is not a positive
      float32 number.

  Returns:
    A dict of scalar arrays: `nonzero` (count of finite non-zero values; int32, or
    float32 for gradients of more than 2**31 - 1 values in all, which int32 cannot count),
    `underflow_fraction` (of those, the fraction that would become 0),
    `subnormal_fraction` (would land in the subnormal range), `overflow_fraction`
    (would become inf or NaN), `max_abs` and `min_abs` (largest and smallest
    non-zero finite magnitudes of `grads`, before scaling; 0 if there are none).
  """
  dtype = _policy.as_dtype(dtype, "dtype")
  if isinstance(loss_scale, LossScale):
    loss_scale = loss_scale()  # its current scale
  elif not _jax_internals.is_tracer(loss_scale):
    _validation.scale("loss_scale", loss_scale)
  return _gradient_stats(_trees.float_leaves(grads), dtype, loss_scale)


@functools.partial(jax.jit, static_argnums=1)
def _gradient_stats(leaves: list[jax.Array], dtype: jnp.dtype, loss_scale: Any) -> dict:
  # Compiled once per list of leaf types and dtype, also when called eagerly. Each leaf
  # counted in int32; the leaves' counts summed in float32 where int32 would wrap.
  wide = sum(x.size for x in leaves) > np.iinfo(np.int32).max
  total = jnp.float32 if wide else jnp.int32
  counts = {"nonzero": 0, "underflow": 0, "subnormal": 0, "overflow": 0}
  max_abs, min_abs = jnp.float32(0), jnp.float32(jnp.inf)
  for x in leaves:
    x = jnp.abs(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
    live = jnp.isfinite(x) & (x > 0)
    scaled = x * jnp.asarray(loss_scale, x.dtype)

    def below(kind, scaled=scaled):
      limit = _numerics.first_magnitude(scaled.dtype, dtype, kind)
      return jnp.ones(scaled.shape, bool) if limit is None else scaled < limit

    underflow, below_normal, finite = below("nonzero"), below("normal"), below("nonfinite")
    count = lambda flags: jnp.sum(flags, dtype=jnp.int32).astype(total)
    counts["nonzero"] += count(live)
    counts["underflow"] += count(live & underflow)
    counts["subnormal"] += count(live & ~underflow & below_normal)
    counts["overflow"] += count(live & ~(finite & jnp.isfinite(scaled)))
    max_abs = jnp.maximum(max_abs, jnp.max(jnp.where(live, x, 0), initial=0).astype(jnp.float32))
    min_abs = jnp.minimum(
        min_abs, jnp.min(jnp.where(live, x, jnp.inf), initial=jnp.inf).astype(jnp.float32))
  nonzero = jnp.asarray(counts["nonzero"], total)
  denominator = jnp.maximum(nonzero, 1).astype(jnp.float32)
  return {
      "nonzero": nonzero,
      "underflow_fraction": counts["underflow"] / denominator,
      "subnormal_fraction": counts["subnormal"] / denominator,
      "overflow_fraction": counts["overflow"] / denominator,
      "max_abs": max_abs,
      "min_abs": jnp.where(nonzero > 0, min_abs, 0.0),
  }


class LossScaleAdvice(NamedTuple):
  """The result of `recommend_loss_scale`. Every scale is a float32 power of two.

  Attributes:
    max_scale: the largest power of two that overflows nothing (at most 2**127).
    min_scale: the smallest power of two at which nothing underflows to zero; above
      `max_scale` when the gradients span more than `dtype` can hold.
    recommended: the scale to use, a power of two >= 1 that every loss scale accepts
      (`FixedLossScale`, `DynamicLossScale`): `max_scale / headroom`, raised towards
      `min_scale` where the range allows. For a dtype with float32's range (bfloat16)
      it is only as large as underflow needs. When even the unscaled gradients overflow
      `dtype` (`max_scale < 1`) no scale helps: it is 1, and `overflow_fraction` says
      how much overflows.
    underflow_fraction: the fraction of non-zero values lost to zero at
      `recommended`.
    overflow_fraction: the fraction that overflows at `recommended`.
  """

  max_scale: float
  min_scale: float
  recommended: float
  underflow_fraction: float
  overflow_fraction: float


def recommend_loss_scale(
    grads: Any, dtype: Any = jnp.float16, headroom: float = 8.0
) -> LossScaleAdvice:
  """Host side: which power-of-two scales suit these (unscaled, float32) gradients.

  Args:
    grads: representative float32 gradients (e.g. from a float32 step).
    dtype: the low-precision dtype the gradients will be computed in: float16,
      bfloat16 or a float8 type (a dtype, or a policy name such as "f16").
    headroom: a safety margin for gradients that grow later in training; the
      recommendation stays this factor below the overflow limit when it can.

  Returns:
    A `LossScaleAdvice`.

  Raises:
    ValueError: if `headroom` is not a finite number >= 1, or the gradients have
      no finite non-zero value.
  """
  headroom = _validation.real("headroom", headroom)
  if headroom < 1:
    raise ValueError(f"recommend_loss_scale: `headroom` must be >= 1, got {headroom!r}.")
  stats = jax.device_get(gradient_stats(grads, dtype))
  if int(stats["nonzero"]) == 0:
    raise ValueError("recommend_loss_scale: the gradients have no finite non-zero value.")
  dtype = _policy.as_dtype(dtype, "dtype")
  # The float32 magnitudes from which a conversion overflows, and survives (rounding to
  # nearest, as `gradient_stats` counts); below float32's smallest normal XLA flushes to
  # zero (bfloat16's subnormals are lost). A dtype as wide as float32 only bounds them.
  finfo = jnp.finfo(dtype)
  overflow = _numerics.first_magnitude(np.float32, dtype, "nonfinite")
  survives = _numerics.first_magnitude(np.float32, dtype, "nonzero")
  if overflow is None:
    max_exponent = _log2_floor_ratio(finfo.max, stats["max_abs"])
  else:  # the largest power of two strictly below the overflow
    max_exponent = _log2_ceil_ratio(overflow, stats["max_abs"]) - 1
  smallest = finfo.smallest_subnormal if survives is None else survives
  max_scale = _power_of_two(max_exponent)
  min_scale = _power_of_two(_log2_ceil_ratio(max(float(smallest), _numerics.FLOAT32_TINY),
                                             stats["min_abs"]))
  if not _numerics.has_short_range(dtype):
    recommended = max(min(min_scale, max_scale), 1.0)  # float32's range: raise only if needed
  else:
    recommended = max(min(max(max_scale / headroom, min(min_scale, max_scale)), max_scale), 1.0)
  at = jax.device_get(gradient_stats(grads, dtype, recommended))
  return LossScaleAdvice(max_scale, min_scale, recommended,
                         float(at["underflow_fraction"]), float(at["overflow_fraction"]))


def _log2_floor_ratio(a: Any, b: Any) -> int:
  """`floor(log2(a / b))` of two host numbers (any NumPy or ml_dtypes scalar)."""
  return int(_numerics.log2_floor_ratio(float(a), float(b)))


def _log2_ceil_ratio(a: Any, b: Any) -> int:
  """`ceil(log2(a / b))` of two host numbers."""
  return -_log2_floor_ratio(b, a)


def _power_of_two(exponent: int) -> float:
  """2**exponent, kept a normal, finite float32 (every advice is one)."""
  return math.ldexp(1.0, min(max(exponent, -126), 127))


# --- reading probes -------------------------------------------------------------------


def summarize(probes: Probes) -> dict[str, ProbeSummary]:
  """Each probe's `ProbeSummary`, in forward order, as numpy arrays on the host."""
  if not isinstance(probes, Probes):
    raise TypeError("`probes` must be what scaled_value_and_grad(..., probes=True) returned "
                    f"(a diagnostics.Probes), got {type(probes).__name__}.")
  # A list: `device_get` of a dict would sort the names.
  return dict(zip(probes.names, jax.device_get([probes[name] for name in probes]), strict=True))


def headroom(probes: Probes) -> dict[str, np.ndarray]:
  """Each probe's `ProbeSummary.headroom`: doublings of the loss scale left."""
  return {name: summary.headroom for name, summary in summarize(probes).items()}


def backward_overflow_origin(probes: Probes) -> str | None:
  """The probe whose backward pass made the first non-finite gradient, or None.

  Gradients flow from the loss back, so the first non-finite one is at the non-finite
  backward probe nearest the loss (the last in forward order). It was computed by the
  backward pass of what consumed that activation: the next probe in forward order,
  named here (`LOSS` after the last): the next that was hit (not one in a `lax.cond`
  branch that was not taken). A scanned probe's row is `"name[row]"`. Forward order
  stands in for the data flow: with branches side by side (separate query, key and
  value projections) the probe named may be a sibling of the one that overflowed.
  """
  order = layers(probes)
  bad = [i for i, (_, summary) in enumerate(order) if not summary.backward.finite.all()]
  if not bad:
    return None
  return next((where for where, summary in order[bad[-1] + 1:] if np.any(summary.hits > 0)),
              LOSS)


def forward_nonfinite_origin(probes: Probes) -> str | None:
  """The first probe, in forward order, whose activation was not finite, or None.

  Probes measure on the way back: one that no gradient reached (used only through
  `stop_gradient`) measured nothing, and cannot be named (`table` marks it).
  """
  return next((where for where, summary in layers(probes)
               if not summary.forward.finite.all()), None)


def layers(probes: Probes) -> list[tuple[str, ProbeSummary]]:
  """`(name, summary)` for every probe in forward order, one per row of a probe with rows
  (named `"name[row]"`), as numpy arrays on the host.

  The rows of the probes of one loop body interleave: a[0], b[0], a[1], b[1], ...
  (`Probes.order`; two scans one after the other give a[0], a[1], b[0], b[1]).
  """
  summaries = summarize(probes)
  return [(name, summaries[name]) if row is None else
          (f"{name}[{row}]", jax.tree.map(lambda a, r=row: a[..., r], summaries[name]))
          for name, row in probes.order]


def table(probes: Probes) -> str:
  """The probes' measurements, one line per layer in forward order, as text.

  Columns: the largest activation gradient (as the backward pass saw it, at the scale
  it ran with), the headroom (doublings of the scale before float16 overflows), the
  fractions of the gradient that are float16 subnormals and zeros, and the largest
  activation (forward). A probe that no gradient reached (its output used only through
  `stop_gradient`, in a branch not taken, inside a `custom_vjp`) measured nothing, even
  forward: its line says so.
  """
  header = (f"{'layer':<28s} {'max |grad|':>11s} {'headroom':>8s} {'subnormal':>9s} "
            f"{'zero':>6s} {'max |act|':>10s}")
  lines = [header, "-" * len(header)]
  for name, s in layers(probes):
    if not np.any(s.hits > 0):
      lines.append(f"{name[:28]:<28s} not measured: no gradient came back through it")
      continue
    g, f = s.backward, s.forward
    subnormal, zero = (100 * float(np.mean(x)) for x in (g.subnormal_fraction, g.zero_fraction))
    lines.append(f"{name[:28]:<28s} {float(np.max(g.max_abs)):11.3g} "
                 f"{float(np.min(s.headroom)):8.0f} {subnormal:8.1f}% {zero:5.1f}% "
                 f"{float(np.max(f.max_abs)):10.3g}")
  return "\n".join(lines)
