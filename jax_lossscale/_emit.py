"""How a decided step is emitted: by `lax.cond` on CPU, by a select on GPU and TPU.

On CPU a `lax.cond` runs nothing on a skipped step and lets XLA update donated buffers in
place, where a select would make it copy them; on GPU and TPU a select fuses into the
optimizer's own kernels, where a `cond` would split them (benchmarks/RESULTS.md, "Why
`cond` on CPU and `where` elsewhere").

Both are one program: a `lax.cond` whose predicate is forced true off CPU, around a
select that is forced to its first operand on CPU. `on_cpu` is a constant once the
program is lowered for one platform, so XLA removes the cond or the select; a program
exported for several platforms reads it when it runs. The step is traced once.

What a step gives may hold static leaves (strings, functions of equinox modules); a
skipped step's are those of the running step, see `_trees.arrays_of`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _trees


def on_cpu() -> jax.Array:
  """Bool scalar: whether the program runs on CPU (`lax.platform_dependent`)."""
  return jax.lax.platform_dependent(cpu=lambda: jnp.array(True), default=lambda: jnp.array(False))


def run_or_pass(pred: jax.Array, fn: Callable[[], Any], passed: Any) -> Any:
  """`fn()` if `pred` else `passed`, by `lax.cond`; the outputs may hold static leaves,
  which must be `passed`'s. The skipping branch returns its operands as they came, so
  XLA makes it no computation at all (rebuilding them cost a thousand-leaf
  `apply_gradients` about 0.2 s more to compile: benchmarks/RESULTS.md)."""
  arrays, static = _trees.partition(passed)
  out = jax.lax.cond(pred, lambda _: _trees.arrays_of(fn, static)(), lambda ops: ops, arrays)
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
  cpu = on_cpu()

  def ran():
    out, state, finite = run()
    checked = finite is not None
    finite = finite if checked else jnp.array(True)
    keep = (should_apply & finite) | cpu  # the select is forced to `(out, state)` on CPU
    chosen = lambda: (_trees.select_tree(keep, out, skipped),
                      _trees.select_tree(keep, state, kept))
    if checked:  # on CPU a second cond, for updates found not finite
      out, state = run_or_pass(finite | ~cpu, chosen, (skipped, kept))
    else:
      out, state = chosen()
    return out, state, finite

  # On a skipped step `finite` is `~should_apply`: True.
  out, state, finite = run_or_pass(should_apply | ~cpu, ran, (skipped, kept, ~should_apply))
  return out, state, should_apply & finite, finite | ~should_apply
