"""TensorFlow's `serialize`, `deserialize` and `get` for loss scales."""

from __future__ import annotations

from typing import Any

import numpy as np

from jax_lossscale import _managers  # noqa: F401 (known to `deserialize` by their names)
from jax_lossscale import _policy
from jax_lossscale import _validation
from jax_lossscale import presets
from jax_lossscale._loss_scale import REGISTRY
from jax_lossscale._loss_scale import DynamicLossScale
from jax_lossscale._loss_scale import FixedLossScale
from jax_lossscale._loss_scale import LossScale
from jax_lossscale._loss_scale import NoOpLossScale
from jax_lossscale._loss_scale import qualified_name

_PACKAGE_PREFIX = "jax_lossscale."


def serialize(loss_scale: LossScale) -> dict[str, Any]:
  """Returns `{"class_name": ..., "config": {...}}`, JSON-serialisable.

  `class_name` is TensorFlow's bare class name for the package's own classes
  (`"DynamicLossScale"`), and the qualified name `"module.QualName"` for any other
  `loss_scale_dataclass`, so a class of your own named like one of ours stays yours.
  """
  if not isinstance(loss_scale, LossScale):
    raise ValueError(f"serialize expects a LossScale, got {loss_scale!r}.")
  name = qualified_name(type(loss_scale))
  return {"class_name": name.removeprefix(_PACKAGE_PREFIX), "config": loss_scale.get_config()}


def deserialize(config: dict[str, Any]) -> LossScale:
  """Rebuilds a loss scale from the dict returned by `serialize`.

  The class is looked up by its qualified name; a bare name (TensorFlow's, and every
  class's before qualified names) is one of the package's own classes.

  Raises:
    ValueError: if the dict is malformed or names an unknown class.
  """
  if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
    raise ValueError(
        f"deserialize expects a dict with keys 'class_name' and 'config', got {config!r}.")
  name = config["class_name"]
  cls = None
  if isinstance(name, str):
    cls = REGISTRY.get(name if "." in name else _PACKAGE_PREFIX + name)
  if cls is None:
    known = sorted(key.removeprefix(_PACKAGE_PREFIX) for key in REGISTRY)
    raise ValueError(f"Unknown loss scale class_name {name!r}; known: {known}.")
  return cls.from_config(config["config"])


def get(identifier: Any) -> LossScale | None:
  """Turns an identifier into a loss scale, with TensorFlow's rules.

  * a real number → `FixedLossScale(number)`;
  * `"dynamic"` → `DynamicLossScale()`;
  * a `LossScale` → itself; `None` → `None`;
  * a dict → `deserialize(dict)`;
  * jmp's loss scales (DeepMind jmp's or `jax_lossscale.jmp`'s) → the same scale here:
    `DynamicLossScale(loss_scale, increment_period=period, multiplier=factor,
    min_loss_scale=...)` from its current state, `FixedLossScale`, `NoOpLossScale`;
  * a precision `Policy` (ours or jmp's) → the loss scale its compute dtype calls for
    (`get_policy(policy).loss_scale()`).

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
  if isinstance(identifier, _policy.Policy) or _policy._is_jmp_policy(identifier):
    return _policy.get_policy(identifier).loss_scale()
  from_jmp = _from_jmp(identifier, argument)
  if from_jmp is not None:
    return from_jmp
  raise ValueError(
      f"Could not interpret loss scale identifier {identifier!r} given as `{argument}`: "
      "use a LossScale, a number >= 1 (a FixedLossScale), 'dynamic' (a DynamicLossScale), "
      "a dict from serialize(), a jmp loss scale or a precision Policy.")


def _from_jmp(value: Any, argument: str) -> LossScale | None:
  """The loss scale here that DeepMind jmp's (or `jax_lossscale.jmp`'s) `value` is, or
  None if it is none of jmp's: a `DynamicLossScale` from its current scale and counter."""
  cls = type(value)
  if cls.__module__.split(".")[0] not in ("jmp", "jax_lossscale") or cls.__name__ not in (
      "NoOpLossScale", "StaticLossScale", "DynamicLossScale") or isinstance(value, LossScale):
    return None
  if cls.__name__ == "NoOpLossScale":
    return NoOpLossScale()
  try:
    scale = float(np.asarray(value.loss_scale, np.float32))
  except TypeError:
    raise ValueError(f"`{argument}`: a jmp {cls.__name__} with a traced or non-scalar scale "
                     f"cannot become a loss_scaling loss scale, got {value!r:.200}.") from None
  if cls.__name__ == "StaticLossScale":
    with _validation.renamed(loss_scale_value=argument):
      return FixedLossScale(scale)
  min_scale = float(np.asarray(value.min_loss_scale, np.float32))
  jmp_names = {ours: f"{argument}.{theirs}" for ours, theirs in (
      ("initial_loss_scale", "loss_scale"), ("increment_period", "period"),
      ("multiplier", "factor"), ("min_loss_scale", "min_loss_scale"),
      ("num_good_steps", "counter"))}
  with _validation.renamed(**jmp_names):  # jmp's fields, as the caller wrote them
    converted = DynamicLossScale(
        scale, increment_period=int(value.period), multiplier=float(value.factor),
        min_loss_scale=min_scale, num_good_steps=np.int32(value.counter))
  return presets._backing_off_as_jmp(converted)  # as `jit` compiles jmp's division
