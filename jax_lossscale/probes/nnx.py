"""Probes on every module's output, named by its path, in flax linen, flax NNX, equinox.

Each adapter wraps a loss function; nothing in the model changes. Use the wrapped loss
with `value_and_grad_with_probes`:

    grad_fn = value_and_grad_with_probes(nnx.value_and_grad, nnx_probes(loss_fn))
    loss, grads, probes = grad_fn(model, x, y)  # probes["blocks/linear"], ...

Outside a measuring context the wrapped loss is the loss: no interception, no probes.
Stacked layers run by a scan (an `nnx.scan` or `lax.scan` over a module whose arrays
all carry a leading layer axis) get one row per layer: the NNX and equinox adapters
give such a module an index `arange(layers)`, which the scan slices with the weights
(equinox: a scan inside a module's call). In a stack of stacks (scanned twice) the layers
are summed instead (`_probes.stacked_rows`).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _probe_equinox
from jax_lossscale import _probe_intercept
from jax_lossscale import _probes
from jax_lossscale import _trees
from jax_lossscale._probe_outputs import probe_output
from jax_lossscale._probe_outputs import stacked_length
from jax_lossscale._probe_outputs import while_probing

# --- flax linen ---------------------------------------------------------------------


def linen_probes(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun` with a probe on the output of every linen `Module.__call__` it runs.

  Probes are named by module path, as in the params: `"Dense_0"`, `"encoder/layer_1"`;
  the top-level module by its class name. Inside `nn.scan`, a module's probe sums over
  the layers (one row, `hits` = layers): linen's lifted scan slices only the variable
  collections the model names, so no index can ride along. A model of another class
  applied in the same loss (a discriminator after a generator) has its paths under its
  class name (`"Disc/Dense_0"`); two models of one class share names (give `probe`
  names of your own there).

  Args:
    fun: a function that applies linen modules (a loss calling `model.apply`).

  Returns:
    `fun`, intercepting `__call__` while probes are measured.
  """
  from flax import linen

  def on_call(roots, applied, module, method_name, call):
    # The model applied is the module of empty path being called (a module cloned by a
    # lifted transform, `nn.remat(nn.Dense)`, has a Scope for parent but a path; one
    # sharing its parent's scope, `nn.share_scope`, a Module for parent).
    top = not module.path and not isinstance(module.parent, linen.Module)
    applied += [type(module)] if top else []
    try:
      out = call()
    finally:
      del applied[len(applied) - top:]
    if method_name != "__call__":
      return out
    root = applied[-1] if applied else parents_root(module)  # `method=lambda m: m.encoder`
    roots.setdefault(root, len(roots))  # in the order met, alike in both passes
    path = module.path if not roots[root] else (root.__name__, *module.path)
    return probe_output(out, _trees.path_name(path) or type(module).__name__)

  def parents_root(module):
    while isinstance(module.parent, linen.Module):
      module = module.parent
    return type(module)

  @functools.wraps(fun)
  def probed(*args, **kwargs):
    if not _probes.probing():
      return fun(*args, **kwargs)
    with _probe_intercept.linen_calls(functools.partial(on_call, {}, [])):
      return fun(*args, **kwargs)

  return probed


# --- flax NNX -----------------------------------------------------------------------


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
    with _probe_intercept.nnx_annotated(_annotations(modules)), \
        _probe_intercept.calls_wrapped({type(m) for m in modules.values()}, _probed_call):
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
    if length is not None and _probes.stacked_rows():
      values.update(index=jnp.arange(length), length=length)
    annotations.append((module, values))
  return annotations


def _probed_call(module, call, args, kwargs):
  out = call(*args, **kwargs)
  name = _probe_intercept.nnx_annotation(module, "name")
  if name is None:  # another thread's model, in a class both patch
    return out
  return probe_output(out, name, _probe_intercept.nnx_annotation(module, "index"),
                      _probe_intercept.nnx_annotation(module, "length"))


def placed(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun` with probes on every module output of the frameworks it is called with.

  flax linen modules are intercepted wherever `fun` applies them; a flax NNX or equinox
  model given first is probed through its adapter. Frameworks that were never imported
  are not looked for (nor imported).
  """
  @functools.wraps(fun)
  def probed(*args, **kwargs):
    adapted, first = fun, args[0] if args else None
    nnx, eqx = sys.modules.get("flax.nnx"), sys.modules.get("equinox")
    if nnx is not None and isinstance(first, nnx.Module):
      adapted = nnx_probes(adapted)
    elif eqx is not None and isinstance(first, eqx.Module):
      adapted = _probe_equinox.equinox_probes(adapted)
    if "flax.linen" in sys.modules:
      adapted = linen_probes(adapted)
    return adapted(*args, **kwargs)

  return probed
