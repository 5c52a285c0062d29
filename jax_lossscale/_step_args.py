"""Checks of a step's arguments: gradients shaped like the parameters, the loss, the
update's keywords and `axis_name`. Every error names the argument, the value and what is
allowed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_lossscale import _trees


def loss(value: Any) -> jax.Array:
  """The unscaled loss passed as `loss=`: a number or an array, as an array."""
  if isinstance(value, (jax.Array, np.ndarray, np.generic)):
    return jnp.asarray(value)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise TypeError(
        "`loss` must be the unscaled loss of the step (a number or an array), got "
        f"{type(value).__name__}: {value!r:.100}")
  try:
    value = float(value)  # float64 under x64: 1e300 is a finite loss there
  except OverflowError:  # an int beyond any float: not a finite loss
    value = math.inf if value > 0 else -math.inf
  return jnp.asarray(value)


def grads_like_params(grads: Any, params: Any) -> None:
  """`grads` has the structure of `params` and a leaf of its shape for each array
  (`None` and leaves that are not arrays, as in equinox's filtered trees, are not
  compared), floating-point where the parameter is (only those are unscaled: without
  `params`, an integer gradient cannot be told from an integer parameter's and passes
  as it is); a Python float in `params` (not trained, as in equinox) has no gradient.
  `optax.lookahead`'s gradients are those of its fast params."""
  if params is None:
    return
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  is_none = lambda x: x is None
  ours = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
  theirs = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_none)[0]
  if len(ours) != len(theirs):
    raise ValueError(f"`grads` must have the structure of `params`: {len(ours)} leaves "
                     f"against {len(theirs)}; grads: {str(jax.tree.structure(grads)):.300}.")
  for (grad_path, g), (path, p) in zip(ours, theirs, strict=True):
    where = jax.tree_util.keystr(path)
    if jax.tree_util.keystr(grad_path) != where:
      raise ValueError(f"`grads` must have the structure of `params`: `grads` has "
                       f"{jax.tree_util.keystr(grad_path)} where `params` has {where}.")
    if hasattr(g, "shape") and hasattr(p, "shape") and jnp.shape(g) != jnp.shape(p):
      raise ValueError(f"`grads{where}` has shape {jnp.shape(g)}, its parameter "
                       f"`params{where}` {jnp.shape(p)}.")
    if isinstance(p, float) and g is not None:
      raise TypeError(
          f"`params{where}` is the Python float {p!r}, which is not trained (as in "
          f"equinox, only arrays are), but `grads{where}` is a gradient for it: make the "
          "parameter an array (jnp.asarray) to train it, or give it no gradient (None).")
    if _trees.is_float(p) and hasattr(g, "dtype") and not _trees.is_float(g):
      raise TypeError(f"`grads{where}` is {jnp.result_type(g)}, but a gradient of the "
                      f"{jnp.result_type(p)} `params{where}` must be floating-point (it "
                      "would reach the optimizer unscaled).")
  structures = [jax.tree.structure(t, is_leaf=is_none) for t in (grads, params)]
  if structures[0] != structures[1]:  # the same paths, other containers (a tuple, a list)
    raise ValueError("`grads` must have the structure of `params`: grads "
                     f"{str(structures[0]):.200}, params {str(structures[1]):.200}.")


def no_more_positional(args: tuple, function: str) -> None:
  """`loss=` and `probes=` are keyword-only: a loss passed positionally is refused in the
  caller's words (not as an internal class's signature)."""
  if args:
    raise TypeError(
        f"loss_scaling's {function} takes the gradients, the state and the parameters "
        f"positionally, and `loss=` and `probes=` by keyword only: "
        f"{function}(grads, state, params, loss=loss). Got {len(args)} more positional "
        f"argument{'s' if len(args) > 1 else ''}: "
        f"{', '.join(type(a).__name__ for a in args)}.")


def missing_gradients(grads: Any, params: Any) -> list[str]:
  """The paths where `grads` has `None` and `params` a floating-point array: a gradient
  that an optimizer keeping state per parameter (Adam's moments) cannot do without."""
  if params is None:
    return []
  if isinstance(params, optax.LookaheadParams):
    params = params.fast
  is_none = lambda x: x is None
  ours = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]
  theirs = jax.tree_util.tree_leaves(params, is_leaf=is_none)
  if len(ours) != len(theirs):
    return []
  return [jax.tree_util.keystr(path) for (path, g), p in zip(ours, theirs, strict=True)
          if g is None and hasattr(p, "dtype") and _trees.is_float(p)]


def update_keywords(extra_args: dict) -> None:
  """A misspelt `loss=` or `probes=` would go to the inner optimizer, which ignores it.

  Only a typo is refused (a case variant, a letter dropped or doubled, two swapped, and
  `probe`), not a word an inner transformation may take (`losses`, `lost`, `probs`).
  """
  for key in extra_args:
    meant = next((word for word in ("loss", "probes") if key != word and (
        key.lower() in _typos(word) or key.lower() == word)), None)
    if meant:
      raise TypeError(f"loss_scaling's update got `{key}=`: did you mean `{meant}=`? Other "
                      "keyword arguments go to the inner optimizer, which ignores unknown ones.")


def _typos(word: str) -> set[str]:
  """`word` with one letter dropped or doubled, or two neighbours swapped."""
  cut = range(len(word))
  return ({word[:i] + word[i + 1:] for i in cut} | {word[:i] + word[i] + word[i:] for i in cut}
          | {word[:i] + word[i + 1] + word[i] + word[i + 2:] for i in cut[:-1]}) - {
              "probs", word}


def axis_name(value: Any) -> Any:
  """`axis_name`: None, a mapped axis name (hashable), or a tuple or list of them."""
  names = value if isinstance(value, (tuple, list)) else () if value is None else (value,)
  if not all(isinstance(name, Hashable) for name in names):
    raise TypeError(f"`axis_name` must be an axis name (a string), or a tuple or list of "
                    f"them, got {value!r}.")
  return value
