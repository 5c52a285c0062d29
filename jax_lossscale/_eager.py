"""Functions called outside `jit`, run as one program compiled once per signature.

Called eagerly, a function that builds `lax.cond`s, `custom_vjp`s or user contexts makes
new programs on every call: each is compiled again and kept in JAX's caches, so an
eager training loop slows down and grows. `CompiledBySignature` traces it once per
signature of its inputs (the structure, the shapes and dtypes of its arrays and its
other leaves, which are static), as `jax.jit` would, and keeps nothing else.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax

from jax_lossscale import _jax_internals
from jax_lossscale import _trees


def traced(tree: Any) -> bool:
  """Whether a leaf of `tree` is a tracer: called inside a transformation."""
  return any(_jax_internals.is_tracer(x) for x in jax.tree.leaves(tree))


class CompiledBySignature:
  """`fn(*inputs)`, run under one `jax.jit` compiled once per signature of `inputs`.

  Leaves that are not arrays (strings, functions, Python numbers of an equinox module,
  keyword values) are part of the signature, as static arguments of `jit` are; where one
  is unhashable, `fn` is called as is. flax NNX objects in `inputs` cross the `jit` by
  NNX's split and merge, as `nnx.jit` does, and what `fn` changed in them (batch
  statistics, random-number counts) is written back. The output may hold static leaves
  too: those of the trace for the inputs' signature and arrays' shapes and dtypes (the
  trace `jit` keeps for them) are returned with its arrays.
  """

  def __init__(self, fn: Callable[..., Any], name: str):
    self._fn, self._name = fn, name
    self._jitted = jax.jit(self._arrays_of, static_argnums=0)
    self._static_outputs: dict = {}
    self._warned = False

  def __call__(self, *inputs: Any) -> Any:
    graph = _nnx_objects(inputs)
    if graph is None:
      graphdef, (leaves, treedef) = None, jax.tree.flatten(inputs)
    else:
      graphdef, state = _trees.nnx().split(inputs)
      leaves, treedef = jax.tree.flatten(state)
    static = tuple(None if _trees.is_array(x) else _Static(x) for x in leaves)
    signature = (graphdef, treedef, static)
    try:
      hash(signature)
    except TypeError:
      self._warn_unhashable(static)
      return self._fn(*inputs)
    arrays = [x if _trees.is_array(x) else None for x in leaves]
    outputs, changed = self._jitted(signature, arrays)
    for obj, state in zip(graph or (), changed, strict=True):
      _trees.nnx().update(obj, state)
    return _trees.combine(outputs, self._static_outputs[signature, _avals(arrays)])

  def _arrays_of(self, signature, arrays):
    graphdef, treedef, static = signature
    inputs = jax.tree.unflatten(treedef, [s.value if a is None else a for a, s in zip(
        arrays, static, strict=True)])
    if graphdef is not None:
      inputs = _trees.nnx().merge(graphdef, inputs)
    # Keyed as `jit` keys its traces: one signature traces again for other shapes, whose
    # static outputs (a probe's sizes, a batch size in the aux) may differ.
    key = signature, _avals(arrays)
    outputs, self._static_outputs[key] = _trees.partition(self._fn(*inputs))
    graph = _nnx_objects(inputs) if graphdef is not None else ()
    return outputs, [_trees.nnx().state(obj) for obj in graph]

  def _warn_unhashable(self, static: tuple) -> None:
    if self._warned:
      return
    self._warned = True
    kinds = sorted({type(s.value).__name__ for s in static if s is not None
                    and not _hashable(s)})
    warnings.warn(
        f"{self._name} was called outside jit with "
        f"an argument that is neither an array nor hashable (a {', a '.join(kinds)}): "
        "it is not compiled once for its signature but run op by op, traced again at "
        "every call. Make it hashable (a frozen dataclass, a tuple) or mark it static "
        "in an enclosing jax.jit.", stacklevel=3)


def _hashable(x: Any) -> bool:
  try:
    hash(x)
  except TypeError:
    return False
  return True


def _avals(arrays: list) -> tuple:
  """What `jit` traces again for: each array's shape, dtype and weak type."""
  return tuple(None if x is None else
               (x.shape, jax.dtypes.canonicalize_dtype(x.dtype, allow_extended_dtype=True),
                bool(getattr(x, "weak_type", False))) for x in arrays)


class _Static:
  """A leaf that is not an array, as part of a signature: equal to another of its type
  and value only, as `jax.jit`'s static arguments are (`2`, `2.0` and `True` are equal in
  Python, and would share a program traced with the first), a float by its bits (`-0.0`
  is not `0.0`; a NaN is itself, not a new signature at every call)."""

  __slots__ = ("value", "_key")

  def __init__(self, value: Any):
    self.value = value
    self._key = (type(value), _bits(value))

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Static) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)


def _bits(value: Any) -> Any:
  """A float by its bits, a complex number by its parts' (`complex(1, -0.0)` is not
  `complex(1, 0.0)` across a branch cut), anything else as it is."""
  if isinstance(value, float):
    return value.hex()
  if isinstance(value, complex):
    return value.real.hex(), value.imag.hex()
  return value


def _nnx_objects(tree: Any) -> list | None:
  """The flax NNX objects (modules, `Rngs`, optimizers) in `tree`, or None for none."""
  return _trees.nnx_objects(tree, "Pytree") or None
