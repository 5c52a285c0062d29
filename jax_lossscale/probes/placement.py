"""Probes on every module output of whichever frameworks a loss is called with.

Each adapter wraps a loss function; nothing in the model changes:

    grad_fn = value_and_grad_with_probes(nnx.value_and_grad, placed(loss_fn))
    loss, grads, probes = grad_fn(model, x, y)  # probes["blocks/linear"], ...

Outside a measuring context the wrapped loss is the loss: no interception, no probes.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from jax_lossscale.probes.equinox import equinox_probes
from jax_lossscale.probes.linen import linen_probes
from jax_lossscale.probes.nnx import nnx_probes


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
      adapted = equinox_probes(adapted)
    if "flax.linen" in sys.modules:
      adapted = linen_probes(adapted)
    return adapted(*args, **kwargs)

  return probed
