"""Functions called outside `jit`, run as one program compiled once per signature.

Called eagerly, a function that builds `lax.cond`s, `custom_vjp`s or user contexts makes
new programs on every call: each is compiled again and kept in JAX's caches, so an
eager training loop slows down and grows. `CompiledBySignature` traces it once per
signature of its inputs (the structure, the shapes and dtypes of its arrays and its
other leaves, which are static), as `jax.jit` would, and keeps nothing else.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax

from jax_lossscale import _trees


def traced(tree: Any) -> bool:
  """Whether a leaf of `tree` is a tracer: called inside a transformation."""
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


class CompiledBySignature:
  """`fn(*inputs)`, run under one `jax.jit` compiled once per signature of `inputs`.

  Leaves that are not arrays (strings, functions, Python numbers of an equinox module,
  keyword values) are part of the signature, as static arguments of `jit` are; where one
  is unhashable, or `inputs` hold flax NNX objects (mutated in place, which a `jit`
  boundary would not carry back), `fn` is called as is. The output may hold static
  leaves too: those of a signature's first trace are returned with its arrays.
  """

  def __init__(self, fn: Callable[..., Any]):
    self._fn = fn
    self._jitted = jax.jit(self._arrays_of, static_argnums=0)
    self._static_outputs: dict = {}

  def __call__(self, *inputs: Any) -> Any:
    leaves, treedef = jax.tree.flatten(inputs)
    static = tuple(None if _trees.is_array(x) else x for x in leaves)
    try:
      hash(static)
    except TypeError:
      return self._fn(*inputs)
    if _holds_nnx_objects(inputs):
      return self._fn(*inputs)
    signature = (treedef, static)
    arrays = self._jitted(signature, [x if _trees.is_array(x) else None for x in leaves])
    return _trees.combine(arrays, self._static_outputs[signature])

  def _arrays_of(self, signature, arrays):
    treedef, static = signature
    inputs = jax.tree.unflatten(treedef, [s if a is None else a for a, s in zip(
        arrays, static, strict=True)])
    arrays, self._static_outputs[signature] = _trees.partition(self._fn(*inputs))
    return arrays


def _holds_nnx_objects(tree: Any) -> bool:
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return False
  kinds = (nnx.Pytree, nnx.Variable)
  is_kind = lambda x: isinstance(x, kinds)  # noqa: E731
  return any(map(is_kind, jax.tree.leaves(tree, is_leaf=is_kind)))
