"""TensorFlow's `serialize`, `deserialize` and `get` for loss scales."""

from __future__ import annotations

from typing import Any

from jax_lossscale import _validation
from jax_lossscale._loss_scale import REGISTRY
from jax_lossscale._loss_scale import DynamicLossScale
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale


def serialize(loss_scale: LossScale) -> dict[str, Any]:
  """Returns `{"class_name": ..., "config": {...}}`, JSON-serialisable."""
  if not isinstance(loss_scale, LossScale):
    raise ValueError(f"serialize expects a LossScale, got {loss_scale!r}.")
  return {"class_name": type(loss_scale).__name__, "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
  """Rebuilds a loss scale from the dict returned by `serialize`.

  Raises:
    ValueError: if the dict is malformed or names an unknown class.
  """
  if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
    raise ValueError(
        f"deserialize expects a dict with keys 'class_name' and 'config', got {config!r}.")
  name = config["class_name"]
  if name not in REGISTRY:
    raise ValueError(f"Unknown loss scale class_name {name!r}; known: {sorted(REGISTRY)}.")
  return REGISTRY[name].from_config(config["config"])


def get(identifier: Any) -> LossScale | None:
  """Turns an identifier into a loss scale, with TensorFlow's rules.

  * a real number → `FixedLossScale(number)`;
  * `"dynamic"` → `DynamicLossScale()`;
  * a `LossScale` → itself; `None` → `None`;
  * a dict → `deserialize(dict)`.

  Raises:
    ValueError: "Could not interpret loss scale identifier ..." for anything else, and
      the loss scale's own errors for a bad number.
  """
  return parse(identifier, "identifier")


def parse(identifier: Any, argument: str) -> LossScale | None:
  """`get`, with errors naming the caller's `argument`."""
  if identifier is None or isinstance(identifier, LossScale):
    return identifier
  if _validation.python_number(identifier) is not None:
    with _validation.renamed(loss_scale_value=argument):
      return FixedLossScale(identifier)
  if isinstance(identifier, str) and identifier == "dynamic":
    return DynamicLossScale()
  if isinstance(identifier, dict):
    return deserialize(identifier)
  raise ValueError(
      f"Could not interpret loss scale identifier {identifier!r} given as `{argument}`: "
      "use a LossScale, a number >= 1 (a FixedLossScale), 'dynamic' (a DynamicLossScale) "
      "or a dict from serialize().")
