"""The step's decision: are the gradients finite once unscaled, is the loss, and what do
the scaled gradients get multiplied by.

One check of the scaled gradients (or, with clipping, the clip's own norm), agreed
across devices with one collective before anything is decided, so every replica takes
the same decision.
"""

from __future__ import annotations

from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from jax_lossscale import _finite
from jax_lossscale import _numerics
from jax_lossscale import _probe_stats
from jax_lossscale import _probes
from jax_lossscale import _step_args
from jax_lossscale import _trees
from jax_lossscale._loss_scale import LossScale


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
      grad_norm = unscaling(global_norm(grads))
  else:
    grads_finite, grad_norm, unscaling = _clipped(grads, unscaling, max_norm)
  grad_norm = _finite.agree_max(grad_norm, axis_name) if norm else None
  if probes is not None and not isinstance(probes, _probes.Probes):
    raise TypeError("`probes` must be what `scaled_value_and_grad(..., probes=True)` "
                    f"returned (a diagnostics.Probes), got {type(probes).__name__}.")
  measured = None
  if loss_scale.measures:
    measured = _finite.agree_max(_measured(largest, probes), axis_name)
  flags = [grads_finite]
  if loss is not None:
    flags.append(_finite.finite(_step_args.loss(loss)))
  flags = _finite.agree(flags, axis_name)
  return Decision(flags[0], flags[1] if loss is not None else jnp.array(True), unscaling,
                  measured, grad_norm)


def _measured(largest: list, probes: Any) -> jax.Array:
  """The largest gradient magnitude seen: of the parameter gradients, and of every probed
  activation gradient (its binade's top where a probe was hit several times)."""
  measured = _finite.largest_of(largest)
  if probes:
    measured = jnp.maximum(measured, _probe_stats.largest_gradient(probes.encoded))
  return measured


def _clipped(grads: Any, unscaling: _numerics.Rescale, max_norm: float):
  """The clip's norm doubles as the check; the clip factor joins the unscaling. Returns
  `(finite, norm of the unscaled gradients, unscaling)`.

  The norm is taken of the scaled gradients (the kernel optax's clip uses) and unscaled
  as a scalar: for a power-of-two scale, exactly the norm of the unscaled gradients.
  """
  norm = unscaling(global_norm(grads))
  finite = jnp.isfinite(norm)
  # float16 and float8 gradients can overflow their own dtype when unscaled by a scale
  # below 1 while the float32 norm stays finite: those are checked exactly.
  short = [x for x in _trees.float_leaves(grads) if _numerics.has_short_range(x.dtype)]
  if short:
    finite &= _finite.finite(short, unscaling)
  clip = jnp.where(norm < max_norm, 1, max_norm / norm)  # float64 for float64 norms
  return finite, norm, unscaling.times(clip)


def global_norm(tree: Any) -> jax.Array:
  """The global L2 norm of the floating leaves of `tree`, in at least float32.

  `optax.tree.norm` of the leaves, each in its compute dtype: for float32 leaves the very
  computation of `optax.clip_by_global_norm`; float16 and bfloat16 leaves are squared in
  float32 (a float16 square overflows beyond 256). Any inf or NaN makes the norm inf or
  NaN; an empty tree has norm 0.
  """
  leaves = [x.astype(_numerics.compute_dtype(x.dtype)) for x in _trees.float_leaves(tree)]
  return optax.tree.norm(leaves) if leaves else jnp.zeros([], jnp.float32)

