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

import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _probes
from jax_lossscale import _trees

_NAME, _INDEX, _LENGTH = "_probe_name", "_probe_index", "_probe_length"


def probe_output(out: Any, name: str, index: Any = None, length: int | None = None):
  """`probe` on each array of a module's output: `name`, or `name/key` for several."""
  leaves = jax.tree_util.tree_leaves_with_path(out)
  if index is not None and jnp.ndim(index) != 0:  # not sliced by a scan: no rows
    index = length = None

  def one(path, leaf):
    if not hasattr(leaf, "dtype"):  # a string, a Python number: not measured
      return leaf
    where = name if len(leaves) == 1 else f"{name}/{_trees.path_name(path)}"
    return _probes.probe(leaf, where, index=index, length=length)

  return jax.tree_util.tree_map_with_path(one, out)


def stacked_length(arrays) -> int | None:
  """The leading axis all `arrays` share (a stack of layers, maybe), or None."""
  leading = {a.shape[0] if a.ndim else None for a in arrays}
  return leading.pop() if len(leading) == 1 else None


def while_probing(fun: Callable[..., Any], probed: Callable[..., Any]) -> Callable[..., Any]:
  """`probed` while probes are measured, `fun` itself otherwise."""
  @functools.wraps(fun)
  def call(*args, **kwargs):
    return (probed if _probes.probing() else fun)(*args, **kwargs)
  return call


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

  def interceptor(roots, applied, next_fun, args, kwargs, context):
    # The model applied is the module of empty path being called (a module cloned by a
    # lifted transform, `nn.remat(nn.Dense)`, has a Scope for parent but a path; one
    # sharing its parent's scope, `nn.share_scope`, a Module for parent).
    module = context.module
    top = not module.path and not isinstance(module.parent, linen.Module)
    applied += [type(module)] if top else []
    try:
      out = next_fun(*args, **kwargs)
    finally:
      del applied[len(applied) - top:]
    if context.method_name != "__call__":
      return out
    root = applied[-1] if applied else parents_root(module)  # `method=lambda m: m.encoder`
    roots.setdefault(root, len(roots))  # in the order met, alike in both passes
    path = context.module.path if not roots[root] else (root.__name__, *context.module.path)
    return probe_output(out, _trees.path_name(path) or type(context.module).__name__)

  def parents_root(module):
    while isinstance(module.parent, linen.Module):
      module = module.parent
    return type(module)

  @functools.wraps(fun)
  def probed(*args, **kwargs):
    if not _probes.probing():
      return fun(*args, **kwargs)
    with linen.intercept_methods(functools.partial(interceptor, {}, [])):
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
    with _nnx_annotated(model) as classes, calls_probed(classes):
      return fun(model, *args, **kwargs)

  return while_probing(fun, probed)


@contextlib.contextmanager
def _nnx_annotated(model):
  from flax import nnx

  modules = dict(nnx.iter_modules(model))
  params = {path: jax.tree.leaves(nnx.state(module, nnx.Param))
            for path, module in modules.items()}
  lengths = {path: stacked_length(p) if p else None for path, p in params.items()}
  try:
    for path, module in modules.items():
      length = next((lengths[path[:i]] for i in range(len(path), -1, -1)
                     if lengths.get(path[:i]) is not None), None)
      setattr(module, _NAME, _trees.path_name(path) or type(module).__name__)
      if length is not None and _probes.stacked_rows():
        setattr(module, _INDEX, nnx.Variable(jnp.arange(length)))
        setattr(module, _LENGTH, length)
    yield {type(module) for module in modules.values()}
  finally:
    for module in modules.values():
      for attribute in (_NAME, _INDEX, _LENGTH):
        if attribute in vars(module):
          delattr(module, attribute)


_PATCHED: dict[type, list] = {}  # class -> [contexts inside, its own `__call__` or None]
_PATCHING = threading.Lock()


@contextlib.contextmanager
def calls_probed(classes, wrap=None):
  """Each class's `__call__`, wrapped by `wrap` (default: NNX's probing call), inside it.

  Threads tracing at once share the patch: the first context in patches a class, the
  last out restores it (the wrapper probes only for a context that measures).
  """
  entered = []
  with _PATCHING:
    for cls in classes:
      if cls in _PATCHED:
        _PATCHED[cls][0] += 1
      elif getattr(cls.__call__, "_probes_output", False):
        continue  # a subclass of a patched class, or marked unprobed
      else:
        _PATCHED[cls] = [1, cls.__dict__.get("__call__")]
        cls.__call__ = (wrap or _probing_call)(cls.__call__)
      entered.append(cls)
  try:
    yield
  finally:
    with _PATCHING:
      for cls in entered:
        _PATCHED[cls][0] -= 1
        if not _PATCHED[cls][0]:
          own = _PATCHED.pop(cls)[1]
          if own is None:
            del cls.__call__
          else:
            cls.__call__ = own


def _probing_call(call):
  @functools.wraps(call)
  def __call__(self, *args, **kwargs):
    out = call(self, *args, **kwargs)
    # Through super().__call__, only the outermost wrapper probes.
    if type(self).__call__ is not __call__ or not hasattr(self, _NAME):
      return out
    index = getattr(self, _INDEX, None)
    return probe_output(out, getattr(self, _NAME),
                         None if index is None else index.get_value(),
                         getattr(self, _LENGTH, None))

  __call__._probes_output = True
  return __call__


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
      from jax_lossscale import _probe_equinox
      adapted = _probe_equinox.equinox_probes(adapted)
    if "flax.linen" in sys.modules:
      adapted = linen_probes(adapted)
    return adapted(*args, **kwargs)

  return probed
