"""Before switching a model to float8: what each float8 recipe would do to each matmul.

`fp8_readiness(loss_fn, params, batch)` runs `loss_fn` and its gradient once under
`autocast(..., compute_dtype)`, its matmuls in `compute_dtype` as they would run without
float8, and measures, for every matmul a recipe would take, what casting its operands and
incoming gradient to float8 under each recipe would do: the values flushed to zero, the
values saturated, and the relative error of the float8 product against the
`compute_dtype` one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _fp8
from jax_lossscale import _policy
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale._autocast import autocast

TENSORS = ("lhs", "rhs", "gradient for lhs", "gradient for rhs")
# The product each tensor enters, whose error its row reports.
_PRODUCT = {"lhs": "forward", "rhs": "forward", "gradient for lhs": "lhs gradient",
            "gradient for rhs": "rhs gradient"}
_PRODUCTS = tuple(dict.fromkeys(_PRODUCT.values()))  # in a fixed order, each once
_FORWARD = ("lhs", "rhs", "forward")  # measured by the forward pass


@dataclasses.dataclass(frozen=True)
class Fp8TensorReadiness:
  """One tensor of one matmul a float8 recipe would take, and what each recipe does to it.

  Counts and sums are over every time the matmul ran: a loop body's at each iteration
  (its operands that do not change in the loop too), a checkpointed one's once though its
  forward pass runs again in the backward pass. A convolution,
  measured with `convolutions=True`, is a matmul here: its input is `"lhs"`, its kernel
  `"rhs"`.

  Attributes:
    matmul: the matmul's index, in the order the forward pass met them.
    name_scope: the matmul's name scope (a flax module's path), "" if none.
    lhs_shape: its left operand's shape.
    rhs_shape: its right operand's shape.
    tensor: `"lhs"` or `"rhs"` (a forward operand), or `"gradient for lhs"` / `"gradient
      for rhs"` (the incoming gradient, as scaled for the backward matmul giving that
      operand's gradient: per tensor it is the same, per row its rows differ).
    size: how many values it held.
    amax: its largest magnitude.
    flushed: per recipe, how many of its non-zero values become zero in float8.
    saturated: per recipe, how many scale past the format's largest value (non-finite
      values included).
    error: per recipe, the relative error of the product this tensor enters (the forward
      product for `"lhs"` and `"rhs"`, the gradient of that operand for a gradient) in
      float8, against the same product in `compute_dtype`: the root mean square over the
      product's rows (along its last axis) of each row's relative error, so that a row
      flushed to zero beside an outlier counts as much as any other.
    recommended: the recipe recommended for this matmul (the first of the recipes asked
      whose errors on all its products are within `error_limit`), or None: keep it in
      `compute_dtype`.
  """
  matmul: int
  name_scope: str
  lhs_shape: tuple[int, ...]
  rhs_shape: tuple[int, ...]
  tensor: str
  size: int
  amax: float
  flushed: dict[str, int]
  saturated: dict[str, int]
  error: dict[str, float]
  recommended: str | None

  def flushed_fraction(self, recipe: str) -> float:
    """The fraction of its values that `recipe` flushes to zero."""
    return self.flushed[recipe] / self.size

  def saturated_fraction(self, recipe: str) -> float:
    """The fraction of its values that `recipe` saturates."""
    return self.saturated[recipe] / self.size


@dataclasses.dataclass(frozen=True)
class Fp8Readiness:
  """`fp8_readiness`'s report: `print` it for the table.

  Attributes:
    recipes: the names of the recipes measured.
    rows: one `Fp8TensorReadiness` per tensor of each matmul, by matmul.
  """
  recipes: tuple[str, ...]
  rows: tuple[Fp8TensorReadiness, ...]

  def recommended(self) -> dict[int, str | None]:
    """The recipe recommended for each matmul, by index."""
    return {row.matmul: row.recommended for row in self.rows}

  def __str__(self) -> str:
    scope = max([len(row.name_scope) for row in self.rows] + [10])
    header = f"{'#':>3}  {'name scope':<{scope}}  {'tensor':<16}  {'shape':<16}  {'amax':>9}"
    for name in self.recipes:
      header += f"  {name + ' flushed/saturated/error':>36}"
    lines = [header + "  recommended"]
    for row in self.rows:
      shape = "x".join(map(str, row.lhs_shape if row.tensor == "lhs" else row.rhs_shape
                           if row.tensor == "rhs" else ()))
      line = (f"{row.matmul:>3}  {row.name_scope:<{scope}}  {row.tensor:<16}  "
              f"{shape or '(gradient)':<16}  {row.amax:9.3g}")
      for name in self.recipes:
        line += (f"  {100 * row.flushed_fraction(name):10.3f}% "
                 f"{100 * row.saturated_fraction(name):10.3f}% {100 * row.error[name]:10.2f}%")
      lines.append(line + f"  {row.recommended}")
    return "\n".join(lines)


def fp8_readiness(fun: Callable[..., Any], *args: Any, compute_dtype: Any = jnp.bfloat16,
                  recipes: Sequence[str] = ("tensorwise", "rowwise"),
                  error_limit: float = 0.1, convolutions: bool = False) -> Fp8Readiness:
  """What each float8 recipe would do to each matmul of `fun(*args)`, forward and backward.

  Runs `fun` (a loss function) and its gradient once, its matmuls in `compute_dtype` (as
  `autocast(fun, compute_dtype)` runs them), and for every matmul the first recipe would
  take, measures each of its operands and its incoming gradient (`Fp8TensorReadiness`)::

    print(jls.diagnostics.fp8_readiness(loss_fn, params, batch))

  Args:
    fun: the function; the gradient measured is that of the sum of its floating outputs
      (its loss) with respect to its floating array arguments.
    *args: its arguments.
    compute_dtype: the dtype its other matmuls would run in (`jnp.bfloat16`).
    recipes: the names of the recipes to measure, cheapest first (`"tensorwise"` is
      faster than `"rowwise"` on GPUs); the first decides which matmuls are measured.
    error_limit: the largest relative error of a matmul's products for a recipe to be
      recommended for it: float8's own error on N(0,1) values is about 0.04 with e4m3
      operands and 0.06 with an e5m2 gradient.
    convolutions: whether convolutions are measured too, as the recipes with
      `convolutions=True` would run them (a convolution's "lhs" is its input, its "rhs"
      its kernel; with `"tensorwise"` its backward convolutions' error is about 0.075,
      both operands in e5m2).

  Returns:
    An `Fp8Readiness`.

  Raises:
    ValueError: for `recipes` that are not a non-empty list or tuple of recipe names, an
      `error_limit` that is not a finite number at least 0, or a `compute_dtype` that is
      not floating or is a float8 one.
    TypeError: for `convolutions` that is not True or False.
  """
  dtype = _policy.as_dtype(compute_dtype, "compute_dtype")
  if dtype.itemsize == 1:
    raise ValueError(f"`compute_dtype` must be the dtype float8 is measured against, not a "
                     f"float8 one (float16, bfloat16, float32 or float64), got {compute_dtype!r}.")
  names = _recipe_names(recipes)
  error_limit = _validation.real("error_limit", error_limit)
  if error_limit < 0:
    raise ValueError(f"`error_limit` must be at least 0, got {error_limit!r}.")
  totals: dict = {}

  def record(index: int, kind: str, stats: dict) -> None:
    for i, value in stats.items():
      total = totals.setdefault((index, kind, names[i]), {"calls": 0})
      total["calls"] += 1
      for field, number in (value._asdict() if isinstance(value, _fp8.TensorStats)
                            else {"squared": value[0], "rows": value[1]}).items():
        combine = np.max if field == "amax" else np.sum
        number = combine(np.asarray(number, np.float64))
        total[field] = number if field not in total else combine([total[field], number])

  measurement = _fp8.Measurement(tuple(_fp8.Float8Recipe.from_name(n, convolutions=convolutions)
                                       for n in names), record)
  measured = autocast(fun, dtype, fp8=measurement)
  wrt, replace = _trees.replaceable(
      (args, {}), lambda leaf: _trees.is_float(leaf) and not isinstance(leaf, float))

  def loss(arrays):
    a, k = replace(arrays)
    out = measured(*a, **k)
    floating = [x for x in jax.tree.leaves(out) if _trees.is_float(x)]
    if not floating:
      raise TypeError(
          f"fp8_readiness measures the gradient of `fun`'s floating outputs (its loss): "
          f"{getattr(fun, '__name__', 'fun')} returned none, got "
          f"{jax.tree.map(lambda x: getattr(x, 'dtype', type(x).__name__), out)}.")
    return sum(jnp.sum(x.astype(jnp.float32)) for x in floating)

  jax.block_until_ready(jax.jit(jax.grad(loss))(wrt))
  jax.effects_barrier()
  return Fp8Readiness(names, _rows(measurement.matmuls, totals, names, error_limit))


def _recipe_names(recipes: Any) -> tuple[str, ...]:
  names = tuple(recipes) if isinstance(recipes, (list, tuple)) else ()
  if (not names or any(not isinstance(name, str) or name not in _fp8.RECIPES for name in names)
      or len(set(names)) < len(names)):
    raise ValueError(f"`recipes` must be a non-empty list or tuple of distinct names from "
                     f"{tuple(_fp8.RECIPES)}, got {recipes!r}.")
  return names


def _once_per_run(totals: dict, names: tuple) -> dict:
  """`totals` with each forward measurement counted once for each time its matmul ran
  (with a gradient, each backward pass of it; else each forward product). Inside
  `jax.checkpoint` (`nnx.remat`, a rematerialized loop body) the forward pass runs again
  in the backward pass, measurements and all, on the same values; and JAX may measure an
  operand that does not change in a loop once, outside it, where the loop's recomputed
  forward pass measures it at every iteration. Each forward measurement's sums are
  therefore taken as their mean over its calls times the number of runs: exact wherever
  the calls beyond the runs repeat the same values, as in both cases."""
  runs = {}
  for (index, kind, name), total in totals.items():
    if kind == "forward" and name == names[0]:
      backward = totals.get((index, "lhs gradient", name), {"calls": 0})["calls"]
      runs[index] = backward or total["calls"]
  return {(index, kind, name): total if kind not in _FORWARD else {
      field: number if field in ("amax", "calls") else number / total["calls"] * runs[index]
      for field, number in total.items()} for (index, kind, name), total in totals.items()}


def _rows(matmuls: list, totals: dict, names: tuple, error_limit: float) -> tuple:
  totals = _once_per_run(totals, names)

  def error(index, product, name):
    sums = totals[index, product, name]
    return float(np.sqrt(sums["squared"] / sums["rows"])) if sums["rows"] else 0.0

  rows = []
  for index, matmul in enumerate(matmuls):
    if (index, "lhs", names[0]) not in totals:
      continue  # traced, never run (a branch not taken)
    # A NaN error (an operand that held inf or NaN) is the worst: never within the limit.
    worst = {name: max((error(index, product, name) for product in _PRODUCTS
                        if (index, product, name) in totals),
                       key=lambda e: (math.isnan(e), e)) for name in names}
    recommended = next((name for name in names if worst[name] <= error_limit), None)
    for tensor in TENSORS:
      if (index, tensor, names[0]) not in totals:
        continue  # no gradient came back through it
      stats = {name: totals[index, tensor, name] for name in names}
      first = stats[names[0]]
      rows.append(Fp8TensorReadiness(
          index, matmul.name_scope, matmul.lhs_shape, matmul.rhs_shape, tensor,
          round(first["size"]), float(first["amax"]),
          {name: round(stats[name]["flushed"]) for name in names},
          {name: round(stats[name]["saturated"]) for name in names},
          {name: error(index, _PRODUCT[tensor], name) for name in names}, recommended))
  return tuple(rows)
