"""Functions called outside `jit`, run as one program compiled once per signature.

Called eagerly, a function that builds `lax.cond`s, `custom_vjp`s or user contexts makes
new programs on every call: each is compiled again and kept in JAX's caches, so an
eager training loop slows down and grows. `CompiledBySignature` traces it once per
signature of its inputs (the structure, the shapes and dtypes of its arrays and its
other leaves, which are static), as `jax.jit` would, and keeps nothing else.
"""

from __future__ import annotations

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
  too: those of a signature's first trace are returned with its arrays.
  """

  def __init__(self, fn: Callable[..., Any]):
    self._fn = fn
    self._jitted = jax.jit(self._arrays_of, static_argnums=0)
    self._static_outputs: dict = {}

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
      return self._fn(*inputs)
    arrays, changed = self._jitted(signature, [
        x if _trees.is_array(x) else None for x in leaves])
    for obj, state in zip(graph or (), changed, strict=True):
      _trees.nnx().update(obj, state)
    return _trees.combine(arrays, self._static_outputs[signature])

  def _arrays_of(self, signature, arrays):
    graphdef, treedef, static = signature
    inputs = jax.tree.unflatten(treedef, [s.value if a is None else a for a, s in zip(
        arrays, static, strict=True)])
    if graphdef is not None:
      inputs = _trees.nnx().merge(graphdef, inputs)
    arrays, self._static_outputs[signature] = _trees.partition(self._fn(*inputs))
    graph = _nnx_objects(inputs) if graphdef is not None else ()
    return arrays, [_trees.nnx().state(obj) for obj in graph]


class _Static:
  """A leaf that is not an array, as part of a signature: equal to another of its type
  and value only, as `jax.jit`'s static arguments are (`2`, `2.0` and `True` are equal in
  Python, and would share a program traced with the first), a float by its bits (`-0.0`
  is not `0.0`; a NaN is itself, not a new signature at every call)."""

  __slots__ = ("value", "_key")

  def __init__(self, value: Any):
    self.value = value
    self._key = (type(value), value.hex() if isinstance(value, float) else value)

  def __eq__(self, other: Any) -> bool:
    return isinstance(other, _Static) and self._key == other._key

  def __hash__(self) -> int:
    return hash(self._key)


def _nnx_objects(tree: Any) -> list | None:
  """The flax NNX objects (modules, `Rngs`, optimizers) in `tree`, or None for none."""
  return _trees.nnx_objects(tree, "Pytree") or None
