"""Tree helpers shared by every loss scale and by the optax transformation.

A gradient tree may hold more than floating arrays: `None` for parameters without
gradients, integer or boolean arrays, and, in equinox-style modules, strings, functions
or other static Python objects. Only floating (inexact) arrays take part in loss
scaling; everything else passes through untouched.

Finiteness is decided in one place, `largest_magnitudes`: the largest magnitude of
each dtype's leaves, with NaN counted as +inf, from one streaming reduction per leaf
(small leaves are concatenated first, so a tree of thousands of biases compiles one
reduction, not thousands).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

AxisName = Hashable | Sequence[Hashable] | None

# Leaves below _SMALL elements are checked together, from concatenations of at most
# _CHUNK elements and _OPERANDS leaves: each reduction XLA:CPU compiles costs about as
# much as the optimizer's own kernel for that leaf, and a concatenation's compile time
# grows faster than its operand count (benchmarks/RESULTS.md, "Compile time").
_SMALL = 1 << 12
_CHUNK = 1 << 20
_OPERANDS = 64
# Leaves of at least _SPLIT elements are reduced in _SPLIT_ROWS independent rows.
_SPLIT = 1 << 20
_SPLIT_ROWS = 4


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_float_array(x: Any) -> bool:
  """Whether `x` is an array (concrete or traced) with a floating or complex dtype."""
  return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def float_leaves(tree: Any) -> list[jax.Array]:
  """The floating array leaves of `tree`, in `jax.tree.leaves` order."""
  return [x for x in jax.tree.leaves(tree) if is_float_array(x)]


def map_float_leaves(fn, tree: Any) -> Any:
  """Applies `fn` to every floating array leaf; other leaves and `None` pass through."""
  return jax.tree.map(lambda x: fn(x) if is_float_array(x) else x, tree)


def is_narrow(dtype) -> bool:
  """Whether a floating dtype is narrower than float32 (float16, bfloat16, float8...)."""
  return jnp.dtype(dtype).itemsize < 4


def has_short_range(dtype) -> bool:
  """Whether a floating dtype has a narrower exponent range than float32.

  float16 and the float8 types do; bfloat16 has float32's (a value it cannot hold
  squares to inf in float32).
  """
  return jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp


def compute_dtype(dtype) -> jnp.dtype:
  """The dtype a leaf of `dtype` is scaled in: float32, or its own if at least as wide.

  float8 and float4 types do not promote implicitly, so they are converted here.
  """
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.float32) if is_narrow(dtype) else dtype


def multiply(x: jax.Array, *factors: jax.Array) -> jax.Array:
  """`x * factor * ...` computed in `compute_dtype(x.dtype)`, in order, cast back.

  `factors` are real scalars. Written with `lax` primitives: it runs once per leaf
  when a step is traced, where `jnp`'s dispatch would cost more than the rest.
  """
  x = jnp.asarray(x)
  wide_dtype = compute_dtype(x.dtype)
  wide = x if x.dtype == wide_dtype else jax.lax.convert_element_type(x, wide_dtype)
  real = jnp.finfo(wide_dtype).dtype
  for factor in factors:
    factor = jax.lax.convert_element_type(factor, real)
    if real != wide_dtype:  # complex leaves: a real factor scales both parts
      factor = jax.lax.convert_element_type(factor, wide_dtype)
    wide = jax.lax.mul(wide, jax.lax.broadcast_in_dim(factor, wide.shape, ()))
  return wide if wide.dtype == x.dtype else jax.lax.convert_element_type(wide, x.dtype)


# --- finiteness --------------------------------------------------------------------


def _max_min(a, b):
  return jax.lax.max(a[0], b[0]), jax.lax.min(a[1], b[1])


def largest_magnitude(x: jax.Array) -> jax.Array:
  """`max |x|` over one array, read once, with NaN counted as +inf.

  Finite exactly when every element of `x` is. The result is real, in
  `compute_dtype(x.dtype)` (a complex array gives the largest magnitude of its real
  and imaginary parts, so no finite array overflows in `|z|`). A real array's largest
  magnitude is `max(max x, -min x)`, both from one variadic reduction, which XLA:CPU
  streams faster than `max(abs(x))` (benchmarks/RESULTS.md).

  A max-reduction must not be trusted to propagate NaN: XLA:CPU (jax 0.10.2) drops NaN
  from float32 max-reductions of 4096 elements or more. NaN becomes +inf inside the
  same pass, and +inf survives any max.
  """
  return _combine(*_partials(x))


def _partials(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Vectors of partial maxima and minima of `x` (NaN as +inf), real, >= float32."""
  if jnp.iscomplexobj(x):
    parts = [_partials(x.real), _partials(x.imag)]
    return tuple(jnp.concatenate(p) for p in zip(*parts, strict=True))
  x = x.astype(compute_dtype(x.dtype))
  inf = jnp.array(jnp.inf, x.dtype)
  x = jnp.where(jnp.isnan(x), inf, x)
  if x.ndim == 0:
    return x[None], x[None]
  if x.size < _SPLIT:
    largest, smallest = _reduce_max_min(x, tuple(range(x.ndim)))
    return largest[None], smallest[None]
  # Reduced as _SPLIT_ROWS rows (and a remainder), which XLA:CPU spreads over its
  # threads: a single scalar reduction of 10**7 values runs on one core.
  flat = x.reshape(-1)
  rows, rest = divmod(flat.size, _SPLIT_ROWS)
  parts = [_reduce_max_min(flat[:rows * _SPLIT_ROWS].reshape(_SPLIT_ROWS, rows), (1,))]
  if rest:
    parts.append(tuple(p[None] for p in _reduce_max_min(flat[rows * _SPLIT_ROWS:], (0,))))
  return tuple(jnp.concatenate(p) for p in zip(*parts, strict=True))


def _reduce_max_min(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """`(max x, min x)` over `axes` of a real array without NaN, one variadic reduction."""
  inf = jnp.array(jnp.inf, x.dtype)
  return jax.lax.reduce((x, x), (-inf, inf), _max_min, axes)


def _combine(largest: jax.Array, smallest: jax.Array) -> jax.Array:
  """The largest magnitude from vectors of partial maxima and minima.

  A variadic reduction again: XLA rewrites a plain max over a few stacked scalars into
  a chain of scalar maxima, and then copies that chain into every kernel that reads
  the result (7 copies in a training step, each compiled on its own).
  """
  if largest.shape[0] == 1:
    return jax.lax.max(largest[0], -smallest[0])
  inf = jnp.array(jnp.inf, largest.dtype)
  largest, smallest = jax.lax.reduce((largest, smallest), (-inf, inf), _max_min, (0,))
  return jax.lax.max(largest, -smallest)


def _groups(leaves: Sequence[jax.Array]) -> dict[Any, list[list[jax.Array]]]:
  """Per dtype, the reduction inputs: each large leaf alone, small ones in chunks."""
  groups: dict[Any, list[list[jax.Array]]] = {}
  chunks: dict[Any, list[jax.Array]] = {}
  for x in leaves:
    if not x.size:
      continue
    per_dtype = groups.setdefault(x.dtype, [])
    if x.size >= _SMALL or _explicitly_sharded(x):
      per_dtype.append([x])
      continue
    chunk = chunks.get(x.dtype)
    if chunk is None or len(chunk) == _OPERANDS or sum(y.size for y in chunk) + x.size > _CHUNK:
      chunk = chunks[x.dtype] = []
      per_dtype.append(chunk)
    chunk.append(x)
  return groups


@jax.jit
def _largest_magnitudes(leaves: list[jax.Array]) -> list[jax.Array]:
  largest = []
  for group in _groups(leaves).values():
    partials = [_partials(g[0] if len(g) == 1 else jnp.concatenate([y.ravel() for y in g]))
                for g in group]
    largest.append(_combine(*(jnp.concatenate(p) for p in zip(*partials, strict=True))))
  return largest


def largest_magnitudes(tree: Any) -> list[tuple[jnp.dtype, jax.Array]]:
  """`(dtype, largest magnitude)` for each floating dtype among the leaves of `tree`.

  One real scalar per dtype (see `largest_magnitude`), however many leaves. NaN counts
  as +inf, so an entry is finite exactly when all its leaves are; and multiplying the
  entry by a positive factor and casting it back to `dtype` is monotone, so the result
  is finite exactly when every leaf multiplied and cast the same way would be: the
  finiteness of unscaled gradients is decided without unscaling them. Compiled once
  per tree shape, also when called eagerly. Empty leaves are ignored.
  """
  leaves = float_leaves(tree)
  dtypes = list(_groups(leaves))
  return list(zip(dtypes, _largest_magnitudes(leaves), strict=True)) if dtypes else []


def finite_after(largest: list[tuple[jnp.dtype, jax.Array]], *factors: jax.Array) -> jax.Array:
  """Whether every leaf behind `largest` stays finite once multiplied by `factors`.

  The product is compared with the smallest magnitude that overflows the leaves'
  dtype, not cast to it and back: XLA may drop such a round trip through a narrower
  dtype (XLA:GPU does, with its default `xla_allow_excess_precision`), and then an
  overflow of float16 would go unseen.
  """
  flags = []
  for dtype, m in largest:
    product = multiply(m, *factors)  # m is already in the compute dtype
    # A complex leaf's largest magnitude is that of a component.
    limit = first_magnitude(product.dtype, jnp.finfo(dtype).dtype, "nonfinite")
    flags.append(jnp.isfinite(product) if limit is None else product < limit)
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


# Each true from some magnitude on (NaN counts as large: past the largest value).
_CONVERTED = {
    "nonzero": lambda y, finfo: y != 0,
    "normal": lambda y, finfo: not abs(y) < float(finfo.smallest_normal),
    "nonfinite": lambda y, finfo: not np.isfinite(y),
}


@functools.cache
def first_magnitude(source, target, kind: str) -> np.ndarray | None:
  """The smallest non-negative `source` value whose conversion to `target` is `kind`.

  `kind` is "nonzero", "normal" (at least `target`'s smallest normal) or "nonfinite";
  `None` when no finite `source` value converts so (a dtype at least as wide, or
  float4, which saturates). Found once per triple by bisection over `source`'s bit
  patterns, with NumPy's conversions, which round as XLA's do (to nearest even, to
  NaN past the largest value for the float8 types without inf). Comparing with it
  classifies a value as the conversion would, with no conversion in the program.
  """
  source, target = np.dtype(source), np.dtype(target)
  uint = np.dtype(f"uint{8 * source.itemsize}")
  finfo = jnp.finfo(target)
  holds = _CONVERTED[kind]

  def converts(bits: int) -> bool:
    value = np.array(bits, uint).view(source)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
      return bool(holds(value.astype(target).astype(np.float64), finfo))

  lo, hi = 0, int(np.array(np.finfo(source).max, source).view(uint))
  if not converts(hi):
    return None
  while lo < hi:  # invariant: converts(hi)
    mid = (lo + hi) // 2
    lo, hi = (lo, mid) if converts(mid) else (mid + 1, hi)
  return np.array(hi, uint).view(source)


def _axis_tuple(axis_name: AxisName) -> tuple[Hashable, ...]:
  if axis_name is None:
    return ()
  if isinstance(axis_name, (tuple, list)):
    return tuple(axis_name)
  return (axis_name,)


def agree(flags: Sequence[jax.Array], axis_name: AxisName) -> list[jax.Array]:
  """Each boolean flag, true only where it holds on every device of `axis_name`.

  One collective for all the flags (a `psum` of an int32 vector). Outside
  `shard_map`/`pmap` (no `axis_name`) the flags are returned unchanged: SPMD `jit`
  over global arrays already computes global reductions.
  """
  axes = _axis_tuple(axis_name)
  if not axes:
    return list(flags)
  failures = jnp.stack([jnp.logical_not(f) for f in flags]).astype(jnp.int32)
  failures = jax.lax.psum(failures, axes)
  return [failures[i] == 0 for i in range(len(flags))]


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Whether every floating value in `tree` is finite (no inf, no NaN).

  Works for every floating dtype, including float8 types without an inf (only NaN is
  non-finite there) and float64. `None` leaves and non-floating or non-array leaves
  (ints, bools, strings, functions) are ignored; an empty or all-`None` tree counts as
  finite. Compiled once per tree shape, also when called outside `jit`.

  Args:
    tree: any pytree, typically gradients.
    axis_name: inside `shard_map` or `pmap`, the mapped axis name (or a tuple of
      names) across which the answer is agreed; every device then gets the same
      answer, computed with a single collective on one scalar.

  Returns:
    A boolean scalar array.
  """
  return agree([finite_after(largest_magnitudes(tree))], axis_name)[0]


# --- clipping ----------------------------------------------------------------------


def global_norm(tree: Any) -> jax.Array:
  """The global L2 norm of the floating leaves of `tree`, in at least float32.

  `optax.tree.norm` of the leaves, each in its compute dtype: for float32 leaves the
  very computation of `optax.clip_by_global_norm`; float16 and bfloat16 leaves are
  squared in float32, where optax squares them in their own dtype (a float16 square
  overflows beyond 256). Any inf or NaN makes the norm inf or NaN. Other leaves are
  ignored; an empty tree has norm 0.
  """
  leaves = [x.astype(compute_dtype(x.dtype)) for x in float_leaves(tree)]
  if not leaves:
    return jnp.zeros([], jnp.float32)
  return optax.tree.norm(leaves)


# --- choosing ----------------------------------------------------------------------


def negative_zeros_like(tree: Any, like: Any = None) -> Any:
  """`-0.0` in every array leaf: the additive identity (`x + -0.0 == x`, even for -0.0).

  The updates of a skipped step. `+0.0` would turn a `-0.0` parameter into `+0.0`.
  Takes arrays or `jax.ShapeDtypeStruct`s; non-array leaves pass through. Where
  `like` (a tree of the same structure, typically the gradients) has a leaf of the
  same shape, the zeros are made from it, so they share its sharding and, inside
  `shard_map`, the axes it varies over, as a branch of `lax.cond` must.
  """
  if like is None or jax.tree.structure(like) != jax.tree.structure(tree):
    like = jax.tree.map(lambda _: None, tree)

  def negative_zeros(x, template):
    if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
      return x
    if is_array(template) and template.shape == x.shape:
      zeros = -jnp.zeros_like(template, dtype=x.dtype)
    else:
      zeros = -jnp.zeros(x.shape, x.dtype)
    return _varying_like(zeros, x)

  return jax.tree.map(negative_zeros, tree, like, is_leaf=lambda x: x is None)


def _varying_axes(aval: Any) -> frozenset:
  """The manual (`shard_map`) axes an abstract value varies over; empty outside."""
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def _varying_like(x: jax.Array, target: Any) -> jax.Array:
  """`x`, made to vary over the manual (`shard_map`) axes that `target` varies over."""
  typeof = getattr(jax, "typeof", None)
  if typeof is None:  # older JAX: no varying-axis types to match
    return x
  want = _varying_axes(target if isinstance(target, jax.ShapeDtypeStruct) else typeof(target))
  missing = tuple(sorted(want - _varying_axes(typeof(x))))
  if not missing:
    return x
  pcast = getattr(jax.lax, "pcast", None)
  return pcast(x, missing, to="varying") if pcast else jax.lax.pvary(x, missing)


def _explicitly_sharded(x: jax.Array) -> bool:
  """Whether `x` has an explicit sharding over some mesh axis (`jax.sharding.AxisType.Explicit`).

  Such leaves are reduced on their own: concatenating differently sharded arrays is
  refused under explicit sharding, and would move data between devices.
  """
  typeof = getattr(jax, "typeof", None)
  spec = getattr(getattr(typeof(x), "sharding", None), "spec", None) if typeof else None
  return spec is not None and any(axis is not None for axis in spec)


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Chooses `on_true` or `on_false` leaf by leaf on a scalar boolean `pred`.

  Uses `jnp.where`, never a multiplication by a 0/1 mask, so a NaN in the branch
  that is not chosen never leaks into the result (0 × NaN is NaN).

  Args:
    pred: a boolean scalar (array or Python bool).
    on_true: a pytree.
    on_false: a pytree with the same structure, shapes and dtypes as `on_true`.
      Leaves that are not arrays (strings, functions) are taken from `on_true`.

  Returns:
    A pytree with the structure of `on_true`.

  Raises:
    ValueError: if `pred` is not a scalar.
    TypeError: if two array leaves differ in dtype or shape.
  """
  pred = jnp.asarray(pred)
  if pred.shape != ():
    raise ValueError(f"select_tree: `pred` must be a scalar, got shape {pred.shape}.")
  pred = pred.astype(jnp.bool_)

  def select(a, b):
    if not is_array(a):
      return a
    if not is_array(b) or a.shape != b.shape or a.dtype != b.dtype:
      raise TypeError(
          "select_tree: leaves must have the same shape and dtype, got "
          f"{jnp.shape(a)}/{jnp.result_type(a)} and {jnp.shape(b)}/{jnp.result_type(b)}."
      )
    return jax.lax.select_n(pred, b, a)  # jnp.where, without its per-call dispatch

  return jax.tree.map(select, on_true, on_false)


def _array_outputs(fn, record: list):
  """`fn` (no arguments) returning only its output's array leaves.

  Each call appends the output's `(treedef, leaves)` to `record`, from which
  `_rebuild` puts the static leaves (strings, functions: the non-array parts of
  equinox-style modules) back around arrays computed by a JAX transformation.
  """

  def arrays():
    leaves, treedef = jax.tree.flatten(fn())
    record.append((treedef, leaves))
    return [x for x in leaves if is_array(x)]

  return arrays


def _rebuild(structure, arrays) -> Any:
  treedef, leaves = structure
  arrays = iter(arrays)
  return jax.tree.unflatten(treedef, [next(arrays) if is_array(x) else x for x in leaves])


def through_arrays(combine, *fns) -> Any:
  """`combine(*fns)` for a JAX combinator whose branches may return static leaves.

  Combinators such as `jax.lax.cond` or `jax.lax.platform_dependent` accept only
  arrays as outputs. Each of `fns` takes no arguments and returns the same structure;
  only its array leaves go through `combine`, and the other leaves are taken from the
  first function that `combine` traced.
  """
  records = [[] for _ in fns]
  arrays = combine(*[_array_outputs(fn, r) for fn, r in zip(fns, records, strict=True)])
  # A combinator may trace only some branches (platform_dependent, outside jit).
  traced = [r[-1] for r in records if r]
  for other, _ in traced[1:]:
    if other != traced[0][0]:
      raise TypeError(f"Branches must return the same structure, got {traced[0][0]} and {other}.")
  return _rebuild(traced[0], arrays)


def cond(pred: jax.Array, true_fn, false_fn) -> Any:
  """`jax.lax.cond(pred, true_fn, false_fn)` for outputs that may hold static leaves.

  See `through_arrays`; both functions take no arguments.
  """
  return through_arrays(lambda t, f: jax.lax.cond(pred, t, f), true_fn, false_fn)


def traced_once(fn, *inputs: Any):
  """`fn` (no arguments) as a function that is traced at most once.

  Inside `jit` (when any of `inputs` is traced), `fn` is wrapped in a nested `jit`,
  whose trace is cached: calling the result in each branch of a `lax.cond` and of
  `platform_dependent` traces `fn` once, and XLA inlines the calls. Tracing an
  optimizer over a thousand leaves costs as much as compiling hundreds of them.
  Outside `jit`, `fn` itself is returned. Outputs may hold static leaves.
  """
  if not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(inputs)):
    return fn
  record = []
  arrays = jax.jit(_array_outputs(fn, record))

  def call():
    values = arrays()
    return _rebuild(record[-1], values)

  return call


def shapes_of(fn) -> Any:
  """`jax.eval_shape(fn)` for a function whose output may hold static leaves."""
  record = []
  shapes = jax.eval_shape(_array_outputs(fn, record))
  return _rebuild(record[-1], shapes)


# --- unwrapping --------------------------------------------------------------------


def unwrap(tree: Any, node_types: tuple[type, ...]) -> Any:
  """`tree` with every single-array wrapper below `node_types` replaced by its array.

  Frameworks keep optimizer state in wrappers that are pytree nodes around one array
  (flax NNX's `nnx.Variable`, for instance). This rebuilds the nodes of `node_types`
  (and containers between them) with plain arrays instead.
  """

  def wrapped(x):
    return not isinstance(x, node_types) and not is_array(x) and x is not None \
        and not isinstance(x, (tuple, list, dict)) and len(jax.tree.leaves(x)) == 1

  def plain(x):
    return jax.tree.leaves(x)[0] if wrapped(x) else x

  return jax.tree.map(plain, tree, is_leaf=wrapped)


# --- platform-dependent code -------------------------------------------------------

_FORCED_BRANCH: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jax_lossscale_forced_branch", default=None)


def on_platform(*, cpu, default) -> Any:
  """`jax.lax.platform_dependent(cpu=cpu, default=default)` for argument-free functions
  whose outputs may hold static leaves (see `through_arrays`).

  `forced_branch` makes the functions traced inside it take one branch whatever the
  platform, so the CPU test suite runs the GPU/TPU branch too.
  """
  forced = _FORCED_BRANCH.get()
  if forced is not None:
    return {"cpu": cpu, "default": default}[forced]()
  return through_arrays(
      lambda c, d: jax.lax.platform_dependent(cpu=c, default=d), cpu, default)


@contextlib.contextmanager
def forced_branch(name: str):
  """Within this context, `on_platform` traces only branch `name` ("cpu" or "default").

  A testing aid: jitted functions must be traced inside the context (a function
  compiled before keeps the branch it was compiled with).
  """
  if name not in ("cpu", "default"):
    raise ValueError(f"`name` must be 'cpu' or 'default', got {name!r}.")
  token = _FORCED_BRANCH.set(name)
  try:
    yield
  finally:
    _FORCED_BRANCH.reset(token)
