"""`restore_state`: a checkpoint of a `loss_scaling` state, written by this version or an
earlier one, restored into a state of today's layout.

A checkpoint read without a target is a tree of plain containers: orbax gives a
NamedTuple as a dict keyed by its fields and a tuple as a list, flax's msgpack both as
dicts (a tuple's entries keyed "0", "1", ...). The target (`like`) names every leaf by its
key path, and each is looked up along that path. Earlier layouts are read besides today's:
the six step counts in one int32 vector, in the order of `COUNTS`, with or without the
last step's scale after them; a `MeasuredLossScale` without its proven scale.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _transform
from jax_lossscale import _trees
from jax_lossscale._transform import COUNTS
from jax_lossscale._transform import LossScalingState

_MISSING = object()
_SCALARS = (bool, int, float, complex)  # Python numbers in `like` (a TrainState's step)


def restore_state(saved: Any, like: Any) -> Any:
  """A checkpoint's values in the layout, dtypes and shardings of `like`.

  The one call that restores a checkpoint written by an earlier version of the library
  (where the step counts were one int32 vector `counts`) or by another configuration of
  `loss_scaling` (other `rounding` or `state_dtype`, `grad_norm` on or off)::

    saved = ocp.StandardCheckpointer().restore(directory)  # no target: plain containers
    opt_state = jls.restore_state(saved, like=tx.init(params))

  flax's msgpack is read the same way: `serialization.msgpack_restore(data)`.

  Args:
    saved: the checkpoint as read without a target (orbax's `restore(directory)`, flax's
      `serialization.msgpack_restore`), or a tree of today's layout.
    like: what to restore into: `tx.init(params)`, or a larger tree holding it
      (`{"params": params, "opt_state": tx.init(params)}`); arrays or
      `jax.ShapeDtypeStruct` values. Its configuration is the one restored: the loss scale's
      hyperparameters and the dtypes of the inner state come from it.

  Returns:
    `like`'s tree holding the checkpoint's values, cast to `like`'s dtypes where both are
    floating (a float32 moment into a `state_dtype=jnp.bfloat16` state, rounded to
    nearest), on `like`'s shardings. What a checkpoint may lack starts as `init` makes it:
    the compensation buffers (zeros), the stochastic rounding's counter, `grad_norm` and
    a `MeasuredLossScale`'s proven scale (0); the last step's scale, where the checkpoint
    predates it, as the restored scale.

  Raises:
    ValueError: naming the path, where the checkpoint has no value for a leaf of `like`
      or one of another shape or kind (an integer for a float).
  """
  is_state = lambda x: isinstance(x, LossScalingState)

  def restore(path, target):
    if not is_state(target):
      return _restore_tree(saved, path, target)
    fields = {}
    for name in LossScalingState._fields:
      field_path = (*path, jax.tree_util.GetAttrKey(name))
      missing = _find(saved, field_path) is _MISSING
      if name in _transform.RESTARTED and missing:
        fields[name] = jax.tree.map(functools.partial(_as_init_makes_it, name),
                                    getattr(target, name))
      elif name == "last_loss_scale" and missing:  # written before it was kept: the scale
        fields[name] = _like(fields["loss_scale"](), target.last_loss_scale)
      else:
        fields[name] = _restore_tree(saved, field_path, getattr(target, name))
    return LossScalingState(**fields)

  return jax.tree_util.tree_map_with_path(restore, like, is_leaf=is_state)


def _as_init_makes_it(name: str, target: Any) -> jax.Array:
  """A leaf of the field `name` of `RESTARTED` as `init` makes it, of `target`'s shape,
  dtype and sharding: an array of its own, where `target` may be abstract (a
  `ShapeDtypeStruct`) or an array that a donating step would delete."""
  return _like(_transform.RESTARTED[name], target)


def _like(value: Any, target: Any) -> jax.Array:
  """`value` broadcast to `target`'s shape, in its dtype, on its sharding."""
  value = jnp.broadcast_to(jnp.asarray(value, target.dtype), target.shape)
  sharding = getattr(target, "sharding", None)
  return value if sharding is None else jax.device_put(value, sharding)


def _restore_tree(saved: Any, path: tuple, like: Any) -> Any:
  """`like`'s subtree at `path`, every leaf read from `saved` along its key path."""
  def leaf(subpath, target):
    full = (*path, *subpath)
    value = _find(saved, full)
    where = jax.tree_util.keystr(full)
    name = _trees.key_entry(full[-1]) if full else None
    if (value is _MISSING and name in _transform.RESTARTED_LOSS_SCALE
        and jax.tree_util.GetAttrKey("loss_scale") in full):
      return _like(_transform.RESTARTED_LOSS_SCALE[name], target)
    if value is _MISSING:
      held = (repr(target) if isinstance(target, _SCALARS) else
              f"{target.dtype}{list(target.shape)}")
      raise ValueError(f"restore_state: the checkpoint has no value at `{where}`, which "
                       f"`like` holds ({held}).")
    if isinstance(target, _SCALARS):  # a Python number (flax TrainState's `step`)
      return _scalar_like(np.asarray(value), target, where)
    return _leaf_like(jnp.asarray(value), target, where)
  return jax.tree_util.tree_map_with_path(leaf, like)


def _scalar_like(value: np.ndarray, target: Any, where: str) -> Any:
  """The checkpoint's 0-d `value` as a Python number of `target`'s type."""
  if value.shape != ():
    raise ValueError(f"restore_state: the checkpoint's `{where}` has shape {value.shape}, "
                     f"`like`'s is a Python {type(target).__name__}.")
  kind = {bool: "b", int: "biu", float: "biuf", complex: "biufc"}[type(target)]
  if value.dtype.kind not in kind:
    raise ValueError(f"restore_state: the checkpoint's `{where}` is {value.dtype}, "
                     f"`like`'s a Python {type(target).__name__}.")
  return type(target)(value.item())


def _find(node: Any, path: tuple) -> Any:
  for key in path:
    if node is _MISSING or node is None:
      return _MISSING
    node = _child(node, key)
  return _MISSING if node is None else node


def _child(node: Any, key: Any) -> Any:
  entry = _trees.key_entry(key)
  if hasattr(node, "shape") and entry in COUNTS:  # the counts as one vector, as written
    return node[..., COUNTS.index(entry)]         # before they had names
  if isinstance(node, dict):
    return next((node[k] for k in (entry, str(entry)) if k in node), _MISSING)
  if isinstance(node, (list, tuple)) and isinstance(entry, int):
    return node[entry] if entry < len(node) else _MISSING
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name, _MISSING)
  children = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
  return next((child for (k, *_), child in children if k == key), _MISSING)


def _leaf_like(value: jax.Array, target: Any, where: str) -> jax.Array:
  if value.shape != target.shape:
    raise ValueError(f"restore_state: the checkpoint's `{where}` has shape {value.shape}, "
                     f"`like`'s {target.shape}.")
  floats = [jnp.issubdtype(x.dtype, jnp.inexact) for x in (value, target)]
  if value.dtype != target.dtype and not all(floats):
    raise ValueError(f"restore_state: the checkpoint's `{where}` is {value.dtype}, "
                     f"`like`'s {target.dtype}.")
  value = value.astype(target.dtype)
  sharding = getattr(target, "sharding", None)
  return value if sharding is None else jax.device_put(value, sharding)
