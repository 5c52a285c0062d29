"""What every framework adapter does with a module: its output probed under its name,
its stack's length, and the adapter active only while probes are measured."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _trees
from jax_lossscale.probes import core


def probe_output(out: Any, name: str, index: Any = None, length: int | None = None):
  """`probe` on each array of a module's output: `name`, or `name/key` for several."""
  leaves = jax.tree_util.tree_leaves_with_path(out)
  if index is not None and jnp.ndim(index) != 0:  # not sliced by a scan: no rows
    index = length = None

  def one(path, leaf):
    if not hasattr(leaf, "dtype"):  # a string, a Python number: not measured
      return leaf
    where = name if len(leaves) == 1 else f"{name}/{_trees.path_name(path)}"
    return core.probe(leaf, where, index=index, length=length)

  return jax.tree_util.tree_map_with_path(one, out)


def stacked_length(arrays) -> int | None:
  """The leading axis all `arrays` share (a stack of layers, maybe), or None."""
  leading = {a.shape[0] if a.ndim else None for a in arrays}
  return leading.pop() if len(leading) == 1 else None


def while_probing(fun: Callable[..., Any], probed: Callable[..., Any]) -> Callable[..., Any]:
  """`probed` while probes are measured, `fun` itself otherwise."""
  @functools.wraps(fun)
  def call(*args, **kwargs):
    return (probed if core.probing() else fun)(*args, **kwargs)
  return call
