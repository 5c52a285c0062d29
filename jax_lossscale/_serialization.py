"""Serialising loss scales: TensorFlow's `serialize` / `deserialize` / `get` rules.

Also registers every loss scale with `flax.serialization` when flax is installed, so
an optimizer state holding one round-trips through `flax.serialization.to_bytes`.
"""

from __future__ import annotations

import importlib.util
import numbers
from typing import Any

import jax
import numpy as np

from jax_lossscale import _loss_scale

_CLASSES: dict[str, type[_loss_scale.LossScale]] = {}


def register(cls: type[_loss_scale.LossScale]) -> type[_loss_scale.LossScale]:
  """Makes a `LossScale` subclass known to `deserialize` (and to flax.serialization)."""
  _CLASSES[cls.__name__] = cls
  _register_with_flax(cls)
  return cls


def serialize(loss_scale: _loss_scale.LossScale) -> dict[str, Any]:
  """Returns `{"class_name": ..., "config": {...}}`, JSON-serialisable."""
  if not isinstance(loss_scale, _loss_scale.LossScale):
    raise ValueError(f"serialize expects a LossScale, got {loss_scale!r}.")
  return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> _loss_scale.LossScale:
  """Rebuilds a loss scale from the dict returned by `serialize`.

  Raises:
    ValueError: if the dict is malformed or names an unknown class.
  """
  if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
    raise ValueError(
        "deserialize expects a dict with keys 'class_name' and 'config', got "
        f"{config!r}."
    )
  name = config["class_name"]
  if name not in _CLASSES:
    raise ValueError(
        f"Unknown loss scale class_name {name!r}; known: {sorted(_CLASSES)}."
    )
  return _CLASSES[name].from_config(config["config"])


def get(identifier: Any) -> _loss_scale.LossScale | None:
  """Turns an identifier into a loss scale, with TensorFlow's rules.

  * a real number → `FixedLossScale(number)`;
  * `"dynamic"` → `DynamicLossScale()`;
  * a `LossScale` → itself; `None` → `None`;
  * a dict → `deserialize(dict)`.

  Raises:
    ValueError: "Could not interpret loss scale identifier: ..." for anything else.
  """
  if identifier is None or isinstance(identifier, _loss_scale.LossScale):
    return identifier
  if _is_real_scalar(identifier):
    return _loss_scale.FixedLossScale(identifier)
  if isinstance(identifier, str) and identifier == "dynamic":
    return _loss_scale.DynamicLossScale()
  if isinstance(identifier, dict):
    return deserialize(identifier)
  raise ValueError(f"Could not interpret loss scale identifier: {identifier!r}")


def _is_real_scalar(x: Any) -> bool:
  """A real number: Python, NumPy, or a concrete 0-d JAX/NumPy array (not a bool)."""
  if isinstance(x, (bool, np.bool_)):
    return False
  if isinstance(x, (np.ndarray, jax.Array)) and not isinstance(x, jax.core.Tracer):
    return x.ndim == 0 and (np.issubdtype(x.dtype, np.integer)
                            or np.issubdtype(x.dtype, np.floating))
  return isinstance(x, numbers.Real)


def _register_with_flax(cls: type[_loss_scale.LossScale]) -> None:
  if importlib.util.find_spec("flax") is None:
    return
  from flax import serialization  # pylint: disable=g-import-not-at-top

  def to_state_dict(loss_scale):
    return {
        name: serialization.to_state_dict(getattr(loss_scale, name))
        for name in cls._state_names
    }

  def from_state_dict(target, state):
    # Rebuilt through the pytree's own unflatten: no constructor is called, so
    # classes with TensorFlow-style constructor arguments restore as well.
    leaves = [
        serialization.from_state_dict(getattr(target, name), state[name])
        for name in cls._state_names
    ]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(target), leaves)

  serialization.register_serialization_state(
      cls, to_state_dict, from_state_dict, override=True
  )


for _cls in (
    _loss_scale.NoOpLossScale, _loss_scale.FixedLossScale, _loss_scale.DynamicLossScale
):
  register(_cls)
