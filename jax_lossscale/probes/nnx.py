"""Probes on the output of every flax NNX module of a model, named by its path.

Stacked layers run by a scan (an `nnx.scan` over a module whose params all carry a
leading layer axis) get one row per layer: such a module gets a row index
(`outputs.row_index`), which the scan slices with the params. In a stack of stacks
(scanned twice) the layers are summed instead (`core.stacked_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from jax_lossscale import _trees
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import core
from jax_lossscale.probes.outputs import probe_output
from jax_lossscale.probes.outputs import row_index
from jax_lossscale.probes.outputs import stack_of
from jax_lossscale.probes.outputs import while_probing


def nnx_probes(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun(model, ...)` with a probe on the output of every NNX module in `model`.

  Probes are named by the module's path in `model` (`"blocks/linear"`); `model`
  itself by its class name. `fun` is given a copy of `model` (NNX's split and merge:
  it shares `model`'s Variables, so that what `fun` changes in them, a batch norm's
  statistics, reaches `model`), in which each layer is of a probed subclass of its
  class, named for the call and, when its params share a leading axis, given a row
  index `nnx.Variable` that `nnx.scan` slices with the params (inside `fun`,
  `nnx.state(model)` without a filter shows it). `model`, its classes and every other
  class are left as they are.

  Args:
    fun: a loss taking the model first.

  Returns:
    The probed `fun`.
  """
  def probed(model, *args, **kwargs):
    with _intercept.nnx_probed(model, _probed_call, _annotations) as copy:
      return fun(copy, *args, **kwargs)

  return while_probing(fun, probed)


def _annotations(modules: dict) -> list[tuple[Any, dict[str, Any]]]:
  """Each module's name, and the row index and shape of the stack it is in, if any."""
  from flax import nnx

  stacks = {path: stack_of(p) if p else None for path, p in (
      (path, jax.tree.leaves(nnx.state(module, nnx.Param))) for path, module in modules.items())}
  annotations = []
  for path, module in modules.items():
    stack = next((stacks[path[:i]] for i in range(len(path), -1, -1)
                  if stacks.get(path[:i]) is not None), None)
    values = {"name": _trees.path_name(path) or type(module).__name__}
    if stack is not None and core.stacked_rows():
      values.update(index=row_index(stack), stack=stack)
    annotations.append((module, values))
  return annotations


def _probed_call(module, call, args, kwargs):
  out = call(*args, **kwargs)
  name = _intercept.nnx_annotation(module, "name")
  if name is None:  # not named for this pass
    return out
  return probe_output(out, name, _intercept.nnx_annotation(module, "index"),
                      _intercept.nnx_annotation(module, "stack"))
