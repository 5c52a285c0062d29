"""Probes on the output of every module of an equinox model, named by its path.

Two ways to place them, tried in this order (`core.equinox_views`):

* A probed view: the loss gets the model with every layer wrapped. Works through
  anything the loss does with the model (a jit or checkpoint inside it, a scan over a
  stack: one row per layer), except combining it with a static part of its own.
* Found at call time: the loss gets the model itself, and the module classes' calls
  are wrapped to find which of the model's modules runs (by its arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jax_lossscale import _trees
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import core
from jax_lossscale.probes.outputs import probe_output
from jax_lossscale.probes.outputs import stacked_length
from jax_lossscale.probes.outputs import while_probing


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
    if core.equinox_views():
      return fun(_view(model, ()), *args, **kwargs)
    with _intercept.equinox_calls(model, _view):
      return fun(model, *args, **kwargs)

  return while_probing(fun, probed)


def _view(module, path, inherited: int | None = None):
  """`module`, its layers probed: named by their `path` in the model, with a row index
  where their arrays are stacked (or the stack they are in, `inherited`, is)."""
  import equinox as eqx

  arrays = jax.tree.leaves(eqx.filter(module, eqx.is_inexact_array))
  length = stacked_length(arrays) if arrays else inherited
  is_submodule = lambda x: isinstance(x, eqx.Module) and x is not module
  children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_submodule)
  view = jax.tree.unflatten(treedef, [
      _view(child, path + key, length) if is_submodule(child) else child
      for key, child in children])
  if not callable(module):  # not a layer (a StateIndex, found by its type)
    return view
  if length is not None and not core.stacked_rows():
    length = None
  index = None if length is None else jnp.arange(length)
  tag = _Tag(_trees.path_name(path) or type(module).__name__, length)
  return _intercept.equinox_view_class()(view, index, tag, _probed_output)


class _Tag(NamedTuple):
  """What a layer's view knows of it: its `name` in the model and its stack's `length`
  (`None` outside a stack)."""

  name: str
  length: int | None


def _probed_output(out, index, tag: _Tag):
  """A layer's output probed: `out` of a stateful layer's `(out, state)`."""
  import equinox as eqx

  name, length = tag.name, tag.length
  stateful = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)
  probed = probe_output(out[0] if stateful else out, name, index, length)
  return (probed, out[1]) if stateful else probed
