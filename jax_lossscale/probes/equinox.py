"""Probes on the output of every module of an equinox model, named by its path.

The loss is given a probed copy of the model (`core.equinox_probed_copy`): each layer remade
as an instance of a probed subclass of its class. A loss that combines the model with a
static part of its own cannot take one: it is given the model itself, unprobed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from typing import NamedTuple

import jax

from jax_lossscale import _trees
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import core
from jax_lossscale.probes.outputs import probe_output
from jax_lossscale.probes.outputs import row_index
from jax_lossscale.probes.outputs import stack_of
from jax_lossscale.probes.outputs import while_probing


def equinox_probes(fun: Callable[..., Any]) -> Callable[..., Any]:
  """`fun(model, ...)` with a probe on the output of every equinox module of `model`.

  Each module that is a layer (callable, unlike a `StateIndex`) probes its output
  (`out` of a stateful layer's `(out, state)`), named by its path in `model`
  (`"layers/0"`; `model` by its class name). A module whose arrays share a leading axis
  (stacked by `eqx.filter_vmap`) and that the loss calls sliced from its stack (by a
  `lax.scan`) carries a row index, an integer array: split and scanned with
  `eqx.partition(..., eqx.is_array)`, each layer gets its row (with `is_inexact_array`
  the index stays unsliced, and the layers are summed into one row). The first pass
  finds such a scan without indices and is traced again with them; a layer whose arrays
  merely share a leading axis (a `Linear`'s weight and bias) gets none.

  `fun` gets a probed copy of `model`, made inside `fun` (so the gradients have
  `model`'s structure), in which each layer is an instance of a probed subclass of its
  class: `isinstance` holds, its fields are the layer's own, and the layer's class and
  every other are left as they are. A loss that `eqx.combine`s the model with a static
  part of its own cannot take the copy (the trees' classes differ): it gets `model`
  itself, and its modules are not probed (`probe` placed in its code still measures).

  Args:
    fun: a loss taking the model first.

  Returns:
    The probed `fun`.
  """
  def probed(model, *args, **kwargs):
    if core.equinox_probed_copy():
      return fun(_probed_copy(model, ()), *args, **kwargs)
    return fun(model, *args, **kwargs)

  return while_probing(fun, probed)


def _probed_copy(module, path, inherited: tuple[int, ...] | None = None,
                 indexed: bool = False):
  """`module`, its layers probed: named by their `path` in the model, with a row index
  where their arrays are stacked (or the stack they are in, `inherited`, is) and the
  first pass found them (or a layer they are in: `indexed`) scanned."""
  import equinox as eqx

  name = _trees.path_name(path) or type(module).__name__
  # The index is an array the loss sees: given only to a stack found scanned.
  indexed = indexed or name in core.equinox_rows()
  arrays = _arrays(module)
  stack = stack_of(arrays) if arrays else inherited
  is_submodule = lambda x: isinstance(x, eqx.Module) and x is not module
  children, treedef = jax.tree_util.tree_flatten_with_path(module, is_leaf=is_submodule)
  copy = jax.tree.unflatten(treedef, [
      _probed_copy(child, path + key, stack, indexed) if is_submodule(child) else child
      for key, child in children])
  if not _intercept.probeable(module):  # not a layer (a StateIndex, found by its type)
    return copy
  if stack is not None and not core.stacked_rows():
    stack = None
  index = None if stack is None or not indexed else row_index(stack)
  tag = _Tag(name, stack, arrays[0].shape if stack is not None and arrays else None)
  return _intercept.equinox_probed(copy, index, tag, _probed_output)


def _arrays(module) -> list:
  import equinox as eqx

  return jax.tree.leaves(eqx.filter(module, eqx.is_inexact_array))


class _Tag(NamedTuple):
  """What a probed layer knows of itself: its `name` in the model, the shape of its row
  index (`stack_of` its stack's arrays; `None` outside a stack) and the shape of its
  first array in the stack (`None` outside a stack or for a layer with no array)."""

  name: str
  stack: tuple[int, ...] | None
  shape: tuple[int, ...] | None = None


def _probed_output(out, layer):
  """A layer's output probed: `out` of a stateful layer's `(out, state)`. A stacked
  layer called without a row index, its first array sliced from the stack's, tells the
  first pass (`core.scanned_stack`)."""
  import equinox as eqx

  index, tag = layer.probe_index, layer.probe_tag
  if index is None and tag.shape is not None:
    arrays = _arrays(layer)
    if arrays and arrays[0].shape == tag.shape[1:]:
      core.scanned_stack(tag.name)
  stateful = isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], eqx.nn.State)
  probed = probe_output(out[0] if stateful else out, tag.name, index, tag.stack)
  return (probed, out[1]) if stateful else probed
