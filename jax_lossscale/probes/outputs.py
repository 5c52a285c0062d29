"""What every framework adapter does with a module: its output probed under its name,
a stacked module's row index, and the adapter active only while probes are measured."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_lossscale import _trees
from jax_lossscale.probes import core


def probe_output(out: Any, name: str, index: Any = None,
                 stack: tuple[int, ...] | None = None):
  """`probe` on each array of a module's output: `name`, or `name/key` for several.

  `index` is the module's `row_index(stack)` as the loss's scans left it: sliced once (by
  a scan over its stack), it gives a row per layer; not sliced, or sliced twice (by a
  scan inside a scan, `core.nested_stack`), no rows.
  """
  leaves = jax.tree_util.tree_leaves_with_path(out)
  length = None
  if index is not None:
    sliced = len(stack) - jnp.ndim(index)
    if sliced > 1:
      core.nested_stack(name)
    if sliced == 1:  # every entry is the layer's number
      index, length = index[(0,) * jnp.ndim(index)], stack[0]
    else:
      index = None

  def one(path, leaf):
    if not hasattr(leaf, "dtype"):  # a string, a Python number: not measured
      return leaf
    where = name if len(leaves) == 1 else f"{name}/{_trees.path_name(path)}"
    return core.probe(leaf, where, index=index, length=length)

  return jax.tree_util.tree_map_with_path(one, out)


# A stacked module's row index covers the leading axes its arrays share, up to this many
# elements: enough for a scan inside a scan over a stack of stacks to slice it as it
# slices the arrays, and small beside them.
_INDEX_ELEMENTS = 4096


def stack_of(arrays) -> tuple[int, ...] | None:
  """The leading axes all `arrays` share, if any (a stack of layers, maybe), as many as
  keep their product within `_INDEX_ELEMENTS` (the first always); None if none."""
  shapes = [a.shape for a in arrays]
  shared = []
  for sizes in zip(*shapes, strict=False):  # up to the fewest axes
    if len(set(sizes)) != 1 or shared and math.prod(shared) * sizes[0] > _INDEX_ELEMENTS:
      break
    shared.append(sizes[0])
  return tuple(shared) or None


def row_index(shape: tuple[int, ...]) -> jax.Array:
  """A stacked module's row index, of `shape` (`stack_of` its arrays): the layer's number
  along the first axis. A scan over the stack slices it as it slices the arrays."""
  return lax.broadcasted_iota(jnp.int32, shape, 0)


def while_probing(fun: Callable[..., Any], probed: Callable[..., Any]) -> Callable[..., Any]:
  """`probed` while probes are measured, `fun` itself otherwise."""
  @functools.wraps(fun)
  def call(*args, **kwargs):
    return (probed if core.probing() else fun)(*args, **kwargs)
  return call
