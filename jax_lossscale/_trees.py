"""Tree utilities: which leaves take part in loss scaling, choosing between trees, copying
them, and naming a leaf by its key path.

A gradient tree may hold more than floating arrays: `None` for parameters without
gradients, integer or boolean arrays, and, in equinox-style modules, strings, functions
or other static Python objects. Floating leaves (arrays, and Python floats, which are
numbers like any other) take part in loss scaling; everything else passes through.

Static leaves cannot cross a JAX transformation (`lax.cond`, `jit`, `eval_shape`), so
trees are split into arrays and static leaves in equinox's `partition`/`combine` style.
"""

from __future__ import annotations

import dataclasses
import numbers
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale import _jax_internals
from jax_lossscale import _numerics


def is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def is_float(x: Any) -> bool:
  """Whether `x` is a floating number: an inexact array (traced or not) or Python float."""
  if isinstance(x, (float, complex)):
    return True
  return is_array(x) and jnp.issubdtype(x.dtype, jnp.inexact)


def float_leaves(tree: Any) -> list[jax.Array]:
  """The floating leaves of `tree` as arrays, in `jax.tree.leaves` order."""
  return [jnp.asarray(x) for x in jax.tree.leaves(tree) if is_float(x)]


def map_float_leaves(fn, tree: Any) -> Any:
  """Applies `fn` to every floating leaf (as an array); other leaves pass through."""
  return jax.tree.map(lambda x: fn(jnp.asarray(x)) if is_float(x) else x, tree)


def rescale_floats(tree: Any, rescale: _numerics.Rescale) -> Any:
  """Every floating leaf rescaled (see `_numerics.Rescale`); `tree` itself for none.

  The one (un)scaling mechanism: traced where the inner optimizer consumes the
  gradients, XLA fuses it into the optimizer's own loop and writes no unscaled copy.
  """
  return tree if rescale.identity else map_float_leaves(rescale, tree)


def key_entry(key: Any) -> Any:
  """What one key of a key path names: a dict's key, a sequence's index, an attribute's
  name. Any other key (a part of an NNX module path, a pytree's own key object) is its
  own entry, as `jax.tree_util.keystr` prints it."""
  if isinstance(key, (jax.tree_util.DictKey, jax.tree_util.FlattenedIndexKey)):
    return key.key
  if isinstance(key, jax.tree_util.GetAttrKey):
    return key.name
  if isinstance(key, jax.tree_util.SequenceKey):
    return key.idx
  return key


def path_name(path: Any) -> str:
  """A key path as a name, its entries joined by "/": `"params/layer_3/kernel"`."""
  return "/".join(str(key_entry(key)) for key in path)


def child(node: Any, key: Any) -> Any:
  """The child of `node` that `key` (a key of a path to it) leads to."""
  if isinstance(key, jax.tree_util.GetAttrKey):
    return getattr(node, key.name)
  return node[key_entry(key)]


def partition(tree: Any) -> tuple[Any, Any]:
  """`(arrays, static)`: two trees of `tree`'s structure, `None` where the other has a leaf."""
  arrays = jax.tree.map(lambda x: x if is_array(x) else None, tree)
  static = jax.tree.map(lambda x: None if is_array(x) else x, tree)
  return arrays, static


def nnx() -> Any:
  """The `flax.nnx` module if the program imported it, else None (never imported here)."""
  return sys.modules.get("flax.nnx")


def nnx_objects(tree: Any, kind: str = "Module") -> list:
  """The flax NNX objects of class `nnx.<kind>` in `tree` ("Module", "Pytree" for
  modules, `Rngs` and optimizers alike, "Variable"); none if flax NNX is not in use."""
  module = nnx()
  if module is None:
    return []
  cls = getattr(module, kind)
  is_object = lambda x: isinstance(x, cls)
  return [x for x in jax.tree.leaves(tree, is_leaf=is_object) if is_object(x)]


def copier(tree: Any) -> tuple[list, Callable[[list], Any]]:
  """`(leaves, rebuild)`: `tree`'s leaves, and `rebuild(new_leaves)`, a copy of `tree`
  holding them. With NNX modules in `tree`, by NNX's split and merge, which keep a
  module held twice (`self.c = self.a`) one object, as `nnx.value_and_grad` does."""
  if nnx_objects(tree):
    graphdef, state = nnx().split(tree)
    leaves, treedef = jax.tree.flatten(state)
    return leaves, lambda new: nnx().merge(graphdef, jax.tree.unflatten(treedef, new))
  leaves, treedef = jax.tree.flatten(tree)
  return leaves, lambda new: jax.tree.unflatten(treedef, new)


def replaceable(tree: Any, selected: Callable[[Any], bool]) -> tuple[list, Callable[[list], Any]]:
  """`(chosen, replace)`: the leaves of `tree` for which `selected(leaf)`, in order, and
  `replace(new)`, a copy of `tree` (as `copier` makes it) holding `new` in their places:
  a function's arguments as a function of some of their leaves."""
  leaves, rebuild = copier(tree)
  positions = [i for i, leaf in enumerate(leaves) if selected(leaf)]

  def replace(new: list) -> Any:
    filled = list(leaves)
    for i, value in zip(positions, new, strict=True):
      filled[i] = value
    return rebuild(filled)

  return [leaves[i] for i in positions], replace


def updates_like(grads: Any, params: Any) -> Any:
  """The tree the inner optimizer's updates are shaped like: the gradients, or, for
  `optax.lookahead` (whose gradients are those of `params.fast`), the params."""
  return params if isinstance(params, optax.LookaheadParams) else grads


def combine(arrays: Any, static: Any) -> Any:
  """The inverse of `partition`."""
  return jax.tree.map(lambda a, s: s if a is None else a, arrays, static,
                      is_leaf=lambda x: x is None)


def arrays_of(fn, static: Any):
  """`fn` (no arguments) returning only the arrays of its output.

  The static leaves of the output must be `static` (typically those of an input: the
  updates' are the gradients'), so they need not leave the transformation that traces
  `fn`; `combine(result, static)` rebuilds the output.
  """

  def arrays():
    out_arrays, out_static = partition(fn())
    if out_static != static:
      raise TypeError(
          "The inner transformation changed the non-array leaves of the tree it was given "
          f"(expected {static}, got {out_static}).")
    return out_arrays

  return arrays


def register_dataclass(cls: type, leaves: tuple[str, ...], keyed: bool = True) -> tuple[str, ...]:
  """Registers the dataclass `cls` as a pytree; returns the names of its static fields.

  The fields named in `leaves` are children, keyed by name (or by position, `keyed=False`,
  as jmp's are); every other field is static, read from the dataclass so that none can be
  forgotten (jmp's hand-written flatten forgot one). Unflattening skips `__init__`: JAX
  puts tracers, `None` or sentinels in leaves (`vmap`'s `in_axes`), which a constructor's
  checks would refuse, so `jax.tree_util.register_dataclass`, which calls it, does not do.
  """
  static = tuple(f.name for f in dataclasses.fields(cls) if f.name not in leaves)
  keys = tuple(jax.tree_util.GetAttrKey(n) for n in leaves)

  def flatten(obj):
    return tuple(getattr(obj, n) for n in leaves), tuple(getattr(obj, n) for n in static)

  def flatten_with_keys(obj):
    children, aux = flatten(obj)
    return tuple(zip(keys, children, strict=True)), aux

  def unflatten(aux, children):
    obj = object.__new__(cls)
    for name, value in zip(static + leaves, (*aux, *children), strict=True):
      object.__setattr__(obj, name, value)
    return obj

  if keyed:
    jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten, flatten)
  else:
    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
  return static


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
  """Chooses `on_true` or `on_false` leaf by leaf on a scalar boolean `pred`.

  Uses a select, never a multiplication by a 0/1 mask, so a NaN in the tree that is not
  chosen never leaks into the result (0 × NaN is NaN). Python numbers are chosen too
  (as arrays, with `jnp.where`'s promotion) where the two differ; equal ones, like
  equinox's static fields, are kept as they are.

  Args:
    pred: a boolean scalar (array or Python bool).
    on_true: a pytree.
    on_false: a pytree with the same structure, shapes and dtypes as `on_true`. Leaves
      that are neither arrays nor numbers (strings, functions) are taken from `on_true`.

  Returns:
    A pytree with the structure of `on_true`.

  Raises:
    ValueError: if `pred` is not a scalar.
    TypeError: if `pred` is not a boolean, or two array leaves differ in dtype or shape.
  """
  pred = jnp.asarray(pred)
  if pred.shape != ():
    raise ValueError(f"select_tree: `pred` must be a scalar, got shape {pred.shape}.")
  if pred.dtype != jnp.bool_:
    raise TypeError(f"select_tree: `pred` must be a boolean, got {pred.dtype} (a 0.5 would "
                    "count as True).")

  def select(a, b):
    if isinstance(a, numbers.Number) or isinstance(b, numbers.Number):
      if a is b or (type(a) is type(b) and a == b):
        return a
      if jnp.shape(a) != jnp.shape(b):  # a number for an array: no broadcasting
        raise TypeError(f"select_tree: leaves must have the same shape, got {jnp.shape(a)} "
                        f"and {jnp.shape(b)}.")
      return jnp.where(pred, a, b)
    if not is_array(a):
      return a
    if not is_array(b) or a.shape != b.shape or a.dtype != b.dtype:
      raise TypeError(
          "select_tree: leaves must have the same shape and dtype, got "
          f"{jnp.shape(a)}/{jnp.result_type(a)} and {jnp.shape(b)}/{jnp.result_type(b)}.")
    return jax.lax.select_n(pred, b, a)  # jnp.where, without its per-call dispatch

  return jax.tree.map(select, on_true, on_false)


def cast_like(tree: Any, like: Any) -> Any:
  """`tree`'s arrays cast to the dtypes of `like`'s (arrays or `ShapeDtypeStruct`s).

  bfloat16 parameters with float32 gradients get float32 moments from optax after one
  step; the state kept by a skipped step takes those dtypes too (exactly: it widens).
  """
  def cast(x, target):
    if is_array(x) and x.dtype != target.dtype:
      return jax.lax.convert_element_type(x, target.dtype)
    return x
  return jax.tree.map(cast, tree, like)


def negative_zeros_like(tree: Any, like: Any = None) -> Any:
  """`-0.0` in every array leaf: the additive identity (`x + -0.0 == x`, even for -0.0).

  The updates of a skipped step; `+0.0` would turn a `-0.0` parameter into `+0.0`. Takes
  arrays or `jax.ShapeDtypeStruct`s; non-array leaves pass through. Where `like` (a tree
  of the same structure, typically the gradients) has a leaf of the same shape, the
  zeros are made from it, so they share its sharding and, inside `shard_map`, the axes
  it varies over, as a branch of `lax.cond` must.
  """
  if like is None or jax.tree.structure(like) != jax.tree.structure(tree):
    like = jax.tree.map(lambda _: None, tree)

  def negative_zeros(x, template):
    if not (is_array(x) or isinstance(x, jax.ShapeDtypeStruct)):
      return x
    if x.dtype == jax.dtypes.float0:  # an integer's gradient: no value to skip
      return np.zeros(x.shape, x.dtype)
    fill = -np.zeros((), x.dtype)  # both parts of a complex; +0 where no -0 exists
    if is_array(template) and template.shape == x.shape:
      return varying_like(jax.lax.full_like(template, fill, x.dtype), x)
    return varying_like(jax.lax.full(x.shape, fill, x.dtype), x)

  return jax.tree.map(negative_zeros, tree, like, is_leaf=lambda x: x is None)


def varying_like(x: jax.Array, target: Any) -> jax.Array:
  """`x`, made to vary over the manual (`shard_map`) axes that `target` varies over."""
  aval = target if isinstance(target, jax.ShapeDtypeStruct) else jax.typeof(target)
  return varying_over(x, sorted(_jax_internals.varying_axes(aval)))


def varying_over(x: jax.Array, axes: Any) -> jax.Array:
  """`x`, made to vary over each of the manual (`shard_map`) `axes` it does not vary
  over already."""
  have = _jax_internals.varying_axes(jax.typeof(x))
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def apply_updates(params: Any, updates: Any) -> Any:
  """`optax.apply_updates` for every array leaf with an update; other leaves of `params`
  pass through, so a whole equinox module can be given, as to `eqx.apply_updates`."""

  def apply(p, u):
    if u is None or not is_array(p) or jnp.result_type(u) == jax.dtypes.float0:
      return p  # a float0 update: an integer parameter's gradient, no step
    p, u = jnp.asarray(p), jnp.asarray(u)
    narrowest = min(p.dtype.itemsize, u.dtype.itemsize)
    if p.dtype != u.dtype and narrowest == 1 and is_float(p) and is_float(u):  # float8: no
      wide = jnp.float64 if jnp.float64 in (p.dtype, u.dtype) else jnp.float32  # promotion
      return (p.astype(wide) + u.astype(wide)).astype(p.dtype)
    return jnp.asarray(p + u).astype(p.dtype)  # optax's own rule

  return jax.tree.map(apply, params, updates, is_leaf=lambda x: x is None)


def unwrap(tree: Any, node_types: tuple[type, ...]) -> Any:
  """`tree` with every single-array wrapper below `node_types` replaced by its array.

  Frameworks keep optimizer state in wrappers that are pytree nodes around one array
  (flax NNX's `nnx.Variable`, for instance).
  """

  def wrapped(x):
    return not isinstance(x, node_types) and not is_array(x) and x is not None \
        and not isinstance(x, (tuple, list, dict)) and len(jax.tree.leaves(x)) == 1

  return jax.tree.map(lambda x: jax.tree.leaves(x)[0] if wrapped(x) else x, tree,
                      is_leaf=wrapped)
