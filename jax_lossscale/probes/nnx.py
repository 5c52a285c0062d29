"""Probes on the output of every flax NNX module of a model, named by its path.

Stacked layers run by a scan (an `nnx.scan` over a module whose params all carry a
leading layer axis) get one row per layer: such a module gets an index `arange(layers)`,
which the scan slices with the params. In a stack of stacks (scanned twice) the layers
are summed instead (`core.stacked_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _trees
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import core
from jax_lossscale.probes.outputs import probe_output
from jax_lossscale.probes.outputs import stacked_length
from jax_lossscale.probes.outputs import while_probing


def nnx_probes(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun(model, ...)` with a probe on the output of every NNX module in `model`.

  Probes are named by the module's path in `model` (`"blocks/linear"`); `model`
  itself by its class name. For the call, each module gets its name and, when its
  params share a leading axis, an index `nnx.Variable(arange(n))` that `nnx.scan`
  slices with the params; both are removed before `fun` returns, so `nnx.state`,
  `nnx.Optimizer(wrt=nnx.Param)` and the gradients see the model unchanged (inside
  `fun`, `nnx.state(model)` without a filter shows the index). The `__call__` of the
  model's module classes is wrapped for the call, as `nnx.capture(method_outputs=...)`
  does; other threads' modules pass through it unprobed.

  Args:
    fun: a loss taking the model first.

  Returns:
    The probed `fun`.
  """
  def probed(model, *args, **kwargs):
    from flax import nnx

    modules = dict(nnx.iter_modules(model))
    with _intercept.nnx_annotated(_annotations(modules)), \
        _intercept.calls_wrapped({type(m) for m in modules.values()}, _probed_call):
      return fun(model, *args, **kwargs)

  return while_probing(fun, probed)


def _annotations(modules: dict) -> list[tuple[Any, dict[str, Any]]]:
  """Each module's name, and the row index and length of the stack it is in, if any."""
  from flax import nnx

  params = {path: jax.tree.leaves(nnx.state(module, nnx.Param))
            for path, module in modules.items()}
  lengths = {path: stacked_length(p) if p else None for path, p in params.items()}
  annotations = []
  for path, module in modules.items():
    length = next((lengths[path[:i]] for i in range(len(path), -1, -1)
                   if lengths.get(path[:i]) is not None), None)
    values = {"name": _trees.path_name(path) or type(module).__name__}
    if length is not None and core.stacked_rows():
      values.update(index=jnp.arange(length), length=length)
    annotations.append((module, values))
  return annotations


def _probed_call(module, call, args, kwargs):
  out = call(*args, **kwargs)
  name = _intercept.nnx_annotation(module, "name")
  if name is None:  # another thread's model, in a class both patch
    return out
  return probe_output(out, name, _intercept.nnx_annotation(module, "index"),
                      _intercept.nnx_annotation(module, "length"))
