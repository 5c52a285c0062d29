"""How a decided step is emitted: by `lax.cond` on CPU, by a select on GPU and TPU.

On CPU a `lax.cond` runs nothing on a skipped step and lets XLA update donated buffers in
place, where a select would make it copy them; on GPU and TPU a select fuses into the
optimizer's own kernels, where a `cond` would split them (benchmarks/RESULTS.md, "Why
`cond` on CPU and `where` elsewhere"). `lax.platform_dependent` picks the branch when
the program is lowered, so an exported program takes the one of the platform it runs on.

Every function here takes argument-free functions whose outputs may hold static leaves
(strings, functions of equinox modules): `static` names them, see `_trees.arrays_of`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _trees


def on_platform(*, cpu: Callable[[], Any], default: Callable[[], Any], static: Any) -> Any:
  """`lax.platform_dependent(cpu=cpu, default=default)` for outputs with static leaves."""
  out = jax.lax.platform_dependent(cpu=_trees.arrays_of(cpu, static),
                                   default=_trees.arrays_of(default, static))
  return _trees.combine(out, static)


def cond(pred: jax.Array, true_fn: Callable[[], Any], false_fn: Callable[[], Any],
         static: Any) -> Any:
  """`lax.cond(pred, true_fn, false_fn)` for outputs with static leaves."""
  out = jax.lax.cond(pred, _trees.arrays_of(true_fn, static), _trees.arrays_of(false_fn, static))
  return _trees.combine(out, static)


def emit(should_apply: jax.Array, run: Callable[[], Any], skipped: Any, kept: Any) -> Any:
  """The step's result: what `run()` gives if it is applied, else `(skipped, kept)`.

  Args:
    should_apply: bool scalar, the decision taken before running the inner optimizer.
    run: `() -> (out, inner_state, updates_finite)`: the inner optimizer's step, where
      `updates_finite` is a bool scalar, or `None` when nothing needed checking.
    skipped: what a skipped step gives instead of `out` (`-0.0` updates, or the params).
    kept: the inner state a skipped step keeps.

  Returns:
    `(out, inner_state, applied, updates_finite)`: `applied` is the final verdict,
    `updates_finite` False when finite gradients gave non-finite updates.
  """
  static = (_trees.partition(skipped)[1], _trees.partition(kept)[1], None, None)
  return on_platform(cpu=lambda: by_cond(should_apply, run, skipped, kept, static),
                     default=lambda: by_where(should_apply, run, skipped, kept), static=static)


def by_cond(should_apply, run, skipped, kept, static):
  """CPU: a skipped step runs nothing, and donated buffers are updated in place."""
  yes, no = jnp.array(True), jnp.array(False)

  def applied():
    out, state, finite = run()
    if finite is None:
      return out, state, yes, yes
    out, state = cond(finite, lambda: (out, state), lambda: (skipped, kept), static[:2])
    return out, state, finite, finite

  return cond(should_apply, applied, lambda: (skipped, kept, no, yes), static)


def by_where(should_apply, run, skipped, kept):
  """GPU and TPU: one select per leaf, fused into the optimizer's own loop."""
  out, state, finite = run()
  finite = jnp.array(True) if finite is None else finite | ~should_apply  # checked if run
  applied = should_apply & finite
  return (_trees.select_tree(applied, out, skipped), _trees.select_tree(applied, state, kept),
          applied, finite)
