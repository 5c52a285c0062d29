"""Probes on the output of every flax linen module a loss applies, named by its path."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from jax_lossscale import _trees
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import core
from jax_lossscale.probes.outputs import probe_output


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
    if not core.probing():
      return fun(*args, **kwargs)
    with _intercept.linen_calls(functools.partial(on_call, {}, [])):
      return fun(*args, **kwargs)

  return probed
