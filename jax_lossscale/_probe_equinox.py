"""Probes on the output of every module of an equinox model, named by its path.

Two ways to place them, tried in this order (`_probes.equinox_views`):

* A probed view: the loss gets the model with every layer wrapped. Works through
  anything the loss does with the model (a jit or checkpoint inside it, a scan over a
  stack: one row per layer), except combining it with a static part of its own.
* Found at call time: the loss gets the model itself, and the module classes' calls
  are wrapped to find which of the model's modules runs (by its arrays).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jax_lossscale import _probes
from jax_lossscale import _trees
from jax_lossscale._probe_frameworks import calls_probed
from jax_lossscale._probe_frameworks import probe_output
from jax_lossscale._probe_frameworks import stacked_length
from jax_lossscale._probe_frameworks import while_probing


def equinox_probes(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun(model, ...)` with a probe on the output of every equinox module of `model`.

  Each module that is a layer (callable, unlike a `StateIndex`) probes its output
  (`out` of a stateful layer's `(out, state)`), named by its path in `model`
  (`"layers/0"`; `model` by its class name); attributes and `isinstance` reach through
  its wrapper. A module whose arrays share a leading axis (stacked by
  `eqx.filter_vmap`) carries an index `arange(n)`: split and scanned with
  `eqx.partition(..., eqx.is_array)`, each layer gets its row (with `is_inexact_array`
  the integer index stays unsliced, and the layers are summed into one row).

  `fun` gets a probed view of `model`, made inside `fun`, so the gradients have
  `model`'s structure. A loss that `eqx.combine`s the model with a static part of its
  own cannot take one: it gets `model` itself, and a module it calls is probed if its
  arrays are `model`'s own (not another model's of the same class, nor arrays made
  anew inside the loss: by a jit or checkpoint, or the slices of a stack it scans).

  Args:
    fun: a loss taking the model first.

  Returns:
    The probed `fun`.
  """
  def probed(model, *args, **kwargs):
    if _probes.equinox_views():
      return fun(_equinox_view(model, ()), *args, **kwargs)
    placement = _EquinoxPlacement(model)
    token = _EQUINOX.set(placement)
    try:
      with calls_probed(placement.classes, _equinox_call):
        return fun(model, *args, **kwargs)
    finally:
      _EQUINOX.reset(token)

  return while_probing(fun, probed)


_EQUINOX = contextvars.ContextVar("equinox_placement", default=None)


class _EquinoxPlacement:
  """Where each module and array of `model` is, to find the modules the loss calls."""

  def __init__(self, model):
    import equinox as eqx

    self.viewing = False  # inside a view, whose own wrappers probe
    modules = [((), model)]
    for path, module in modules:  # and the submodules appended as it goes
      sub = lambda x, module=module: isinstance(x, eqx.Module) and x is not module
      modules += [(path + key, child) for key, child in jax.tree_util.tree_flatten_with_path(
          module, is_leaf=sub)[0] if sub(child)]
    self.classes = {type(m) for _, m in modules if callable(m)}
    self.paths = {id(leaf): path for path, leaf in jax.tree_util.tree_leaves_with_path(
        model) if eqx.is_array(leaf)}

  def find(self, module) -> tuple | None:
    """`module`'s path in the model, found by its arrays; None if not the model's."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(module):
      at = self.paths.get(id(leaf))
      if at is not None and at[len(at) - len(path):] == path:
        return at[:len(at) - len(path)]
    return None


def _equinox_call(call):
  @functools.wraps(call)
  def __call__(self, *args, **kwargs):
    placement = _EQUINOX.get()
    # Inside a view, or through super().__call__: the module's own call.
    found = None if placement is None or placement.viewing or type(
        self).__call__ is not __call__ else placement.find(self)
    if found is None:
      return call(self, *args, **kwargs)
    placement.viewing = True
    try:
      return _equinox_view(self, found)(*args, **kwargs)
    finally:
      placement.viewing = False

  __call__._probes_output = True
  return __call__


def _equinox_view(module, path, inherited: int | None = None):
  import equinox as eqx

  arrays = jax.tree.leaves(eqx.filter(module, eqx.is_inexact_array))
  length = stacked_length(arrays) if arrays else inherited
  is_submodule = lambda x: isinstance(x, eqx.Module) and x is not module
  children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_submodule)
  view = jax.tree.unflatten(treedef, [
      _equinox_view(child, path + key, length) if is_submodule(child) else child
      for key, child in children])
  if not callable(module):  # not a layer (a StateIndex, found by its type)
    return view
  if length is not None and not _probes.stacked_rows():
    length = None
  index = None if length is None else jnp.arange(length)
  return _equinox_probed()(view, index, _trees.path_name(path) or type(module).__name__, length)


@functools.cache  # one class, made when equinox is first needed
def _equinox_probed():
  import equinox as eqx

  class Probed(eqx.Module):
    """A module probing its output; attributes and `isinstance` reach the module."""
    module: Any
    index: jax.Array | None
    name: str = eqx.field(static=True)
    length: int | None = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
      out = self.module(*args, **kwargs)
      stateful = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)
      probed = probe_output(out[0] if stateful else out, self.name, self.index, self.length)
      return (probed, out[1]) if stateful else probed

    def __getattr__(self, attribute):
      if attribute == "module":  # not set yet: no recursion
        raise AttributeError(attribute)
      return getattr(self.module, attribute)

    @property
    def __class__(self):
      return type(self.module)

  return Probed
