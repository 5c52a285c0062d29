"""Finiteness: one check for every dtype, agreed by every device.

`largest_magnitudes` reads each floating leaf once and gives, per dtype, the largest
magnitude with NaN counted as +inf; `finite` compares it, rescaled as the leaves would
be (by the reciprocal of the loss scale), with the first magnitude that overflows the dtype. So
whether gradients stay finite once unscaled is known without unscaling them. `agree`
makes every replica of a `shard_map`, `pmap` or named `vmap` see the same answer with one
collective.
The reduction has two forms, chosen by `by_platform`: on CPU, small leaves concatenated
and large ones reduced in rows (tuned for XLA:CPU); elsewhere one reduction per leaf, as
jmp's check. Why: benchmarks/RESULTS.md, "A NaN that a max-reduction loses", "One
decision, compiled once" and "The step's GPU form".
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _jax_internals
from jax_lossscale import _numerics
from jax_lossscale import _trees

AxisName = Hashable | Sequence[Hashable] | None

# On CPU, leaves below _SMALL elements are checked together, from concatenations of at
# most _CHUNK elements and _OPERANDS leaves (compile time: benchmarks/RESULTS.md). Leaves
# of at least _SPLIT elements are reduced in _SPLIT_ROWS rows, which XLA:CPU runs in
# parallel.
_SMALL = 1 << 12
_CHUNK = 1 << 20
_OPERANDS = 64
_SPLIT = 1 << 18
_SPLIT_ROWS = 4
_IDENTITY = _numerics.Rescale()


def by_platform(*args: Any, cpu: Callable[..., Any], default: Callable[..., Any],
                cuda: Callable[..., Any] | None = None) -> Any:
  """`cpu(*args)` in a program run on CPU, `cuda(*args)` on an NVIDIA GPU (`default`'s
  where `cuda` is None), `default(*args)` elsewhere.

  `lax.platform_dependent`: a program lowered for one platform holds that platform's
  form only (behind a conditional on a constant, which XLA removes); one exported for
  several chooses when it runs. The one place where the step's form depends on the
  platform (`tests/helpers.force_branch` replaces it to trace any form anywhere).
  """
  if cuda is None:
    return jax.lax.platform_dependent(*args, cpu=cpu, default=default)
  return jax.lax.platform_dependent(*args, cpu=cpu, cuda=cuda, default=default)


def _max_min(a, b):
  return jax.lax.max(a[0], b[0]), jax.lax.min(a[1], b[1])


def _reduce_max_min(x: jax.Array, axes: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
  """`(max x, min x)` over `axes` of a real array without NaN, one variadic reduction."""
  inf = jnp.array(jnp.inf, x.dtype)
  return jax.lax.reduce((x, x), (-inf, inf), _max_min, axes)


def _partials(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Vectors of partial maxima and minima of `x` (NaN as +inf), real, >= float32."""
  if jnp.iscomplexobj(x):
    parts = [_partials(x.real), _partials(x.imag)]
    return tuple(jnp.concatenate(p) for p in zip(*parts, strict=True))
  x = x.astype(_numerics.compute_dtype(x.dtype))
  # XLA:CPU drops NaN from large float32 max-reductions: NaN becomes +inf in the pass.
  x = jnp.where(jnp.isnan(x), jnp.array(jnp.inf, x.dtype), x)
  if x.ndim == 0:
    return x[None], x[None]
  if x.size < _SPLIT:
    largest, smallest = _reduce_max_min(x, tuple(range(x.ndim)))
    return largest[None], smallest[None]
  flat = x.reshape(-1)
  rows, rest = divmod(flat.size, _SPLIT_ROWS)
  parts = [_reduce_max_min(flat[:rows * _SPLIT_ROWS].reshape(_SPLIT_ROWS, rows), (1,))]
  if rest:
    parts.append(tuple(p[None] for p in _reduce_max_min(flat[rows * _SPLIT_ROWS:], (0,))))
  return tuple(jnp.concatenate(p) for p in zip(*parts, strict=True))


def _combine(largest: jax.Array, smallest: jax.Array) -> jax.Array:
  """The largest magnitude from vectors of partial maxima and minima, in one reduction."""
  if largest.shape[0] == 1:
    return jax.lax.max(largest[0], -smallest[0])
  inf = jnp.array(jnp.inf, largest.dtype)
  largest, smallest = jax.lax.reduce((largest, smallest), (-inf, inf), _max_min, (0,))
  return jax.lax.max(largest, -smallest)


def largest_magnitude(x: jax.Array) -> jax.Array:
  """`max |x|` over one array, read once, with NaN counted as +inf.

  Finite exactly when every element is. Real, in `compute_dtype(x.dtype)` (a complex
  array gives the largest magnitude of its components, so no finite array overflows).
  """
  return _combine(*_partials(jnp.asarray(x)))


def explicitly_sharded(x: jax.Array) -> bool:
  """Whether `x` is sharded over an explicit mesh axis: then it is reduced on its own
  (concatenating differently sharded arrays is refused there, and would move data)."""
  spec = getattr(jax.typeof(x).sharding, "spec", None)
  return spec is not None and any(axis is not None for axis in spec)


def _groups(leaves: Sequence[jax.Array]) -> dict[Any, list[list[jax.Array]]]:
  """Per dtype, the reduction inputs: each large leaf alone, small ones in chunks."""
  groups: dict[Any, list[list[jax.Array]]] = {}
  chunks: dict[Any, list[jax.Array]] = {}  # per dtype, the last chunk
  sizes: dict[Any, int] = {}  # and its elements
  for x in leaves:
    if not x.size:
      continue
    per_dtype = groups.setdefault(x.dtype, [])
    if x.size >= _SMALL or explicitly_sharded(x):
      per_dtype.append([x])
      continue
    chunk = chunks.get(x.dtype)
    if chunk is None or len(chunk) == _OPERANDS or sizes[x.dtype] + x.size > _CHUNK:
      chunk, sizes[x.dtype] = [], 0
      chunks[x.dtype] = chunk
      per_dtype.append(chunk)
    chunk.append(x)
    sizes[x.dtype] += x.size
  return groups


@jax.jit
def _largest_in_chunks(leaves: list[jax.Array]) -> list[jax.Array]:
  """Per dtype, the largest magnitude: small leaves concatenated, large ones in rows."""
  largest = []
  for group in _groups(leaves).values():
    partials = [_partials(g[0] if len(g) == 1 else jnp.concatenate([y.ravel() for y in g]))
                for g in group]
    largest.append(_combine(*(jnp.concatenate(p) for p in zip(*partials, strict=True))))
  return largest


def _largest_of_leaf(x: jax.Array) -> jax.Array:
  """`max |x|` of one array (NaN as +inf) in one reduction, in its compute dtype."""
  if jnp.iscomplexobj(x):
    return jax.lax.max(_largest_of_leaf(x.real), _largest_of_leaf(x.imag))
  x = jnp.abs(x.astype(_numerics.compute_dtype(x.dtype)))
  inf = jnp.array(jnp.inf, x.dtype)
  return jax.lax.reduce(jnp.where(jnp.isnan(x), inf, x), -inf, jax.lax.max,
                        tuple(range(x.ndim)))


@jax.jit
def _largest_per_leaf(leaves: list[jax.Array]) -> list[jax.Array]:
  """Per dtype, the largest magnitude: one reduction per leaf, then one over the leaves
  (a variadic one, as `_combine`'s: XLA keeps it a reduction, not a chain of maxima)."""
  largest = []
  for group in _groups(leaves).values():
    per_leaf = jnp.stack([_largest_of_leaf(x) for chunk in group for x in chunk])
    largest.append(_combine(per_leaf, -per_leaf))
  return largest


def largest_magnitudes(tree: Any) -> list[tuple[jnp.dtype, jax.Array]]:
  """`(dtype, largest magnitude)` for each floating dtype among the leaves of `tree`.

  One real scalar per dtype however many leaves, NaN counted as +inf. Compiled once per
  tree shape, also when called eagerly. Empty leaves are ignored.
  """
  leaves = _trees.float_leaves(tree)
  dtypes = list(_groups(leaves))
  if not dtypes:
    return []
  largest = by_platform(leaves, cpu=_largest_in_chunks, default=_largest_per_leaf)
  return list(zip(dtypes, largest, strict=True))


def largest_of(largest: list[tuple[jnp.dtype, jax.Array]]) -> jax.Array:
  """The largest of `largest_magnitudes`' values, as a float32 scalar; 0 for none."""
  values = [m.astype(jnp.float32) for _, m in largest]
  return jnp.max(jnp.stack(values)) if values else jnp.zeros([], jnp.float32)


def finite_after(largest: list[tuple[jnp.dtype, jax.Array]],
                 rescale: _numerics.Rescale = _IDENTITY) -> jax.Array:
  """Whether every leaf behind `largest` stays finite once rescaled.

  Rescaling a largest magnitude by a positive value and casting it back is monotone, so
  the result is compared with the smallest magnitude that overflows the dtype (no cast
  in the program: XLA:GPU may drop a round trip through float16).
  """
  flags = []
  for dtype, m in largest:
    product = rescale(m)  # m is already in the compute dtype
    limit = _numerics.first_magnitude(product.dtype, jnp.finfo(dtype).dtype, "nonfinite")
    flags.append(jnp.isfinite(product) if limit is None else product < limit)
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def finite(tree: Any, rescale: _numerics.Rescale = _IDENTITY) -> jax.Array:
  """Whether every floating leaf of `tree`, rescaled, is finite."""
  return finite_after(largest_magnitudes(tree), rescale)


def manual_axes(value: Any) -> tuple[Hashable, ...]:
  """The replica axes in scope where `value` was computed: the manual mesh axes
  (`shard_map`, `pmap`); where no mesh axis is Manual or Explicit, the named axes of an
  enclosing `vmap(..., axis_name=)`, pmap's one-device stand-in."""
  mesh = getattr(jax.typeof(value).sharding, "mesh", None)
  if mesh is None or not mesh.axis_names:  # a constant's type carries no mesh
    mesh = jax.sharding.get_abstract_mesh()
  types = mesh.axis_types
  if all(t == jax.sharding.AxisType.Auto for t in types):
    return _jax_internals.axis_names_in_scope()  # (vmap's, pmap's one-device stand-in)
  manual = jax.sharding.AxisType.Manual
  return tuple(n for n, t in zip(mesh.axis_names, types, strict=True) if t == manual)


def axis_tuple(axis_name: AxisName) -> tuple[Hashable, ...]:
  """`axis_name` as a tuple of axis names: `()` for None, `(name,)` for one name.

  Raises:
    TypeError: if `axis_name` is neither None, a mapped axis name (hashable), nor a tuple
      or list of them.
  """
  if axis_name is None:
    return ()
  names = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
  if not all(isinstance(name, Hashable) for name in names):
    raise TypeError(f"`axis_name` must be an axis name (a string), or a tuple or list of "
                    f"them, got {axis_name!r}.")
  return names


def agree(flags: Sequence[jax.Array], axis_name: AxisName = None) -> list[jax.Array]:
  """Each boolean flag, true only where it holds on every device.

  The devices are those of `axis_name` if given (`()`: none, each keeps its own), else
  of every replica axis in scope (`manual_axes`: of `shard_map`, `pmap` or, where no
  mesh axis is Manual or Explicit, a named `vmap`): a replicated state then stays
  replicated, whatever varies between replicas. One collective for all the flags (a
  `psum` of an int32 vector); without axes the flags are returned unchanged.
  """
  if not flags:
    return []
  axes = manual_axes(flags[0]) if axis_name is None else axis_tuple(axis_name)
  if not axes:
    return list(flags)
  failures = jnp.stack([jnp.logical_not(f) for f in flags]).astype(jnp.int32)
  failures = collective(jax.lax.psum, failures, axes, axis_name)
  return [failures[i] == 0 for i in range(len(flags))]


def collective(op, x: Any, axes: Any, axis_name: AxisName) -> Any:
  """`op(x, axes)` (`lax.psum`, `lax.pmean`, ...), refusing an `axis_name` that names no
  axis of the `shard_map` or `pmap` the step runs in."""
  try:
    if _vmap_axes_under_an_explicit_mesh(axes):
      return _over_gathered(op, x, axes)
    return op(_varying_over(x, axes), axes)
  except (NameError, AssertionError, ValueError) as error:
    if axis_name is None and not isinstance(error, NameError):
      raise
    raise ValueError(
        f"`axis_name` must name axes of the shard_map or pmap the step runs in, got "
        f"{axis_name!r} ({type(error).__name__}: {str(error)[:300]}). Under jit with sharded "
        "arrays, leave it out: the check is already global. Inside shard_map, a vmap's "
        "axis cannot be agreed over with check_vma on.") from None


def _varying_over(x: Any, axes: tuple[Hashable, ...]) -> Any:
  """`x`, made to vary over each of `axes` that is a manual mesh axis. A value equal on
  every device of an axis (a flag from gradients already averaged over "data", on a
  "data" by "model" mesh) is agreed over that axis too, where JAX's collectives refuse an
  axis their operand does not vary over."""
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  return jax.tree.map(lambda v: _trees.varying_over(v, [a for a in axes if a in manual]), x)


# Each collective as a reduction of what `all_gather` stacks along a new first axis.
_GATHERED = {jax.lax.psum: jnp.sum, jax.lax.pmean: jnp.mean, jax.lax.pmax: jnp.max}


def _vmap_axes_under_an_explicit_mesh(axes: tuple[Hashable, ...]) -> bool:
  """Whether `axes` are named `vmap` axes (no mesh axis) with an Explicit mesh in context."""
  mesh = jax.sharding.get_abstract_mesh()
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  return explicit and not set(axes) & set(mesh.axis_names)


def _over_gathered(op, x: Any, axes: tuple[Hashable, ...]) -> Any:
  """`op(x, axes)` over named `vmap` axes as a reduction of their `all_gather`: under an
  Explicit mesh, jax 0.12 fails to batch `psum`, `pmean` and `pmax` over a vmap's axis
  (a sharding of one rank more than the value), where `all_gather` batches correctly
  (`tests/test_transform.py`, a named vmap under an Explicit mesh)."""
  return jax.tree.map(lambda v: _GATHERED[op](jax.lax.all_gather(v, axes), axis=0), x)


def agree_max(value: jax.Array, axis_name: AxisName = None) -> jax.Array:
  """`value`'s maximum over the devices `agree` agrees over (one `pmax`)."""
  axes = manual_axes(value) if axis_name is None else axis_tuple(axis_name)
  return collective(jax.lax.pmax, value, axes, axis_name) if axes else value


def all_finite(tree: Any, axis_name: AxisName = None) -> jax.Array:
  """Whether every floating value in `tree` is finite (no inf, no NaN).

  Works for every floating dtype, float8 types without an inf included (only NaN is
  non-finite there), and for Python floats. `None`, non-floating and non-array leaves
  (ints, bools, strings, functions) are ignored; an empty tree counts as finite.
  Compiled once per tree shape, also when called outside `jit`.

  Args:
    tree: any pytree, typically gradients.
    axis_name: the mapped axis name (or names) across which the answer is agreed,
      `()` for none; by default every `shard_map` and `pmap` axis in scope (where no
      mesh axis is Manual or Explicit, every named `vmap` axis), so every replica gets
      the same answer (one collective on one scalar).

  Returns:
    A boolean scalar array.
  """
  return agree([finite(tree)], axis_name)[0]
