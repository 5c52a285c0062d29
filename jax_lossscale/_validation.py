"""Checks of hyperparameters and state given to constructors, and of a probe's arguments
(a step's own are checked in `_transform`): every error names the argument, the value and
what is allowed.

A loss scale keeps its scale in float32 and its counters in int32, so every number is
checked as that dtype will see it: a value that is finite as a Python float but inf in
float32, a factor that rounds to 1, a floor that rounds (or flushes, as XLA flushes
float32 subnormals) to 0, a period that overflows int32 is refused when the object is
built. Python numbers, NumPy scalars and concrete 0-d JAX arrays are accepted alike;
booleans are not numbers here.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _jax_internals
from jax_lossscale._numerics import FLOAT32_MAX
from jax_lossscale._numerics import FLOAT32_TINY
from jax_lossscale._numerics import INT32_MAX


def _f32(number: float) -> float:
  with np.errstate(over="ignore"):
    return float(np.float32(number))


def _describe(value: Any) -> str:
  return f"{value!r} ({type(value).__name__})"


@contextlib.contextmanager
def renamed(**names: str):
  """Re-raises the `ValueError`s of the block with arguments renamed: `names` maps the
  library's argument names to the caller's own (a preset's, `loss_scaling`'s)."""
  try:
    yield
  except ValueError as error:
    message = re.sub(r"`(\w+)`", lambda m: f"`{names.get(m.group(1), m.group(1))}`",
                     str(error))
    raise ValueError(message) from None


def python_number(value: Any) -> int | float | None:
  """A Python int/float from any concrete real scalar (not a bool); `None` otherwise."""
  if isinstance(value, (bool, np.bool_)) or _jax_internals.is_tracer(value):
    return None
  if isinstance(value, (np.ndarray, np.generic, jax.Array)):
    if value.ndim != 0 or not (np.issubdtype(value.dtype, np.integer)
                               or np.issubdtype(value.dtype, np.floating)):
      return None
    value = value.item()
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  return None


def _number(name: str, value: Any, kind: str) -> int | float:
  if _jax_internals.is_tracer(value):
    raise ValueError(
        f"`{name}` must be a concrete {kind}, not a traced value: it is a hyperparameter, "
        f"fixed when the object is built (got {value.aval.str_short()}).")
  number = python_number(value)
  if number is None:
    article = "an" if kind[0] in "aeiou" else "a"
    raise ValueError(f"`{name}` must be {article} {kind}, got {_describe(value)}.")
  return number


def real(name: str, value: Any) -> float:
  """A finite real number as a Python float."""
  number = float(_number(name, value, "real number"))
  if not math.isfinite(number):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return number


def clip_norm(value: Any) -> float:
  """`clip_by_global_norm`: finite in float32, and large enough that its clip factor stays
  normal in float32 for every norm float32 holds (below 2**64, where the squares
  overflow) under a loss scale of at least 1 (below 1, so may optax's own clip's)."""
  number = real("clip_by_global_norm", value)
  if not 2.0**-62 <= number <= FLOAT32_MAX:
    raise ValueError(
        "`clip_by_global_norm` must be at least 2**-62 (about 2.2e-19: below, the clip factor "
        "of a large norm is a float32 subnormal, flushed to 0 with the clipped gradients) "
        f"and at most about 3.4e38 (finite in float32), got {value!r}.")
  return number


def integer(name: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> int:
  """An integer in `[minimum, maximum]`; by default at most the largest int32."""
  number = _number(name, value, "integer")
  if isinstance(number, float):
    raise ValueError(f"`{name}` must be an integer, got {_describe(value)}.")
  if number < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}.")
  if number > maximum:
    raise ValueError(f"`{name}` must be <= {maximum} (it is counted in int32), got {value!r}.")
  return number


def float32(name: str, value: Any) -> float:
  """A real number that stays finite when rounded to float32."""
  number = real(name, value)
  if not math.isfinite(_f32(number)):
    raise ValueError(
        f"`{name}` must be at most {FLOAT32_MAX:.8g}, the largest float32 (it is used in "
        f"float32), got {value!r}, which is inf in float32.")
  return number


def scale(name: str, value: Any, minimum: float = 0.0) -> float:
  """A loss scale: a positive float32 normal number, at least `minimum`."""
  number = float32(name, value)
  if number <= 0 or number < minimum:
    allowed = f">= {minimum:g}" if minimum > 0 else "positive"
    raise ValueError(f"`{name}` must be {allowed}, got {value!r}.")
  _refuse_flushed(name, value, number, "")
  return number


def floor(name: str, value: Any) -> float:
  """A floor for a loss scale: 0 (no floor) or a positive float32 normal number."""
  number = float32(name, value)
  if number == 0:
    return 0.0
  if number < 0:
    raise ValueError(f"`{name}` must be >= 0, got {value!r}.")
  _refuse_flushed(name, value, number, "0 (no floor) or ")
  return number


def _refuse_flushed(name: str, value: Any, number: float, alternative: str) -> None:
  if _f32(number) < FLOAT32_TINY:
    raise ValueError(
        f"`{name}` must be {alternative}at least {FLOAT32_TINY:.8g}, the smallest normal "
        f"float32: {value!r} rounds to a subnormal or to 0 in float32, which a loss scale "
        "flushes to 0.")


def growth_factor(name: str, value: Any) -> float:
  """A factor > 1 that still exceeds 1 once rounded to float32."""
  number = float32(name, value)
  if number <= 1:
    raise ValueError(f"`{name}` must be > 1, got {value!r}.")
  if _f32(number) <= 1:
    raise ValueError(
        f"`{name}` must exceed 1 by at least float32's rounding (2**-24): {value!r} rounds "
        "to 1.0, so the loss scale would never grow.")
  return number


def shrink_factor(name: str, value: Any) -> float:
  """A factor in (0, 1) that stays in (0, 1), and normal, once rounded to float32."""
  number = real(name, value)
  if not 0 < number < 1:
    raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
  if _f32(number) >= 1:
    raise ValueError(
        f"`{name}` must be below 1 by at least float32's rounding (2**-25): {value!r} "
        "rounds to 1.0, so the loss scale would never back off.")
  if _f32(number) < FLOAT32_TINY:
    raise ValueError(
        f"`{name}` must be at least {FLOAT32_TINY:.8g}, the smallest normal float32: "
        f"{value!r} rounds (or is flushed by XLA) to 0, so one backoff would zero the scale.")
  return number


def boolean(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"`{name}` must be a bool, got {_describe(value)}.")
  return bool(value)


def not_a_flag(value: Any) -> str | None:
  """What keeps `value` from being a boolean scalar (a Python/NumPy bool or a boolean 0-d
  array, traced or not), as "got ..."; `None` if it is one."""
  if isinstance(value, (bool, np.bool_)):
    return None
  if not isinstance(value, (jax.Array, np.ndarray)) or value.dtype != np.bool_:
    return (f"got an array of dtype {value.dtype}" if hasattr(value, "dtype")
            else f"got {_describe(value)}")
  if value.shape != ():
    return f"got shape {tuple(value.shape)}"
  return None


def flag(name: str, value: Any) -> jax.Array:
  """A boolean scalar: a Python/NumPy bool or a boolean 0-d array (traced or not)."""
  problem = not_a_flag(value)
  if problem is None:
    return jnp.asarray(value)
  if getattr(value, "dtype", None) == np.bool_:  # a boolean array of another shape
    raise ValueError(f"`{name}` must be a boolean scalar, {problem}; to keep one loss "
                     "scale per model, vmap the update instead.")
  raise ValueError(
      f"`{name}` must be a boolean scalar (e.g. jax_lossscale.all_finite(grads)), {problem}.")


def concrete_values(value: Any) -> np.ndarray | None:
  """`value` as a NumPy array, or `None` if it is traced (or otherwise abstract)."""
  if _jax_internals.is_tracer(value) or not isinstance(
      value, (jax.Array, np.ndarray, np.generic, numbers.Number)):
    return None
  return np.asarray(value)


def state_values(name: str, value: Any, dtype, low: float, high: float,
                 shape: tuple[int, ...] = ()) -> Any:
  """A state array given to a constructor, checked against `[low, high]` and its trailing
  axes against `shape` when concrete.

  Traced and abstract values (under `jit`, `jax.eval_shape`) pass unchecked; integer
  state must hold whole numbers; booleans, strings and lists are refused. Returns
  `value` in `dtype`.
  """
  if _jax_internals.is_tracer(value) or isinstance(value, jax.ShapeDtypeStruct):
    return value
  values = concrete_values(value)
  if values is None or not (jnp.issubdtype(values.dtype, jnp.integer)
                            or jnp.issubdtype(values.dtype, jnp.floating)):  # bfloat16 too
    raise ValueError(f"`{name}` must be a real number or an array of them, got "
                     f"{_describe(value)}.")
  if values.shape[values.ndim - len(shape):] != shape:  # leading axes: a batch, for vmap
    raise ValueError(f"`{name}` must have shape {shape} (after any batch axes), got shape "
                     f"{values.shape}.")
  wide = values.astype(np.float64)  # a float16 compared with float32's max overflows
  lowest, highest = low, high
  if not np.issubdtype(dtype, np.integer):
    # As held and as the updates clamp it: in `dtype`, within the bounds rounded to it
    # (max_loss_scale=1e30 caps a float32 scale at 1.0000000150474662e30).
    with np.errstate(over="ignore"):
      wide = values.astype(dtype).astype(np.float64)
      lowest, highest = (float(np.asarray(b, dtype)) for b in (low, high))
  ok = np.isfinite(wide) & (wide >= lowest) & (wide <= highest)
  if np.issubdtype(dtype, np.integer):
    ok &= np.round(wide) == wide
    allowed = f"an integer in [{low}, {high}]"
  else:
    allowed = f"finite, within [{low!r}, {high!r}]"
  if not np.all(ok):
    shown = values.item() if values.ndim == 0 else f"{values.dtype}{list(values.shape)}"
    raise ValueError(f"`{name}` must be {allowed}, got {shown!r}.")
  return value.astype(dtype) if isinstance(value, jax.Array) else np.asarray(values, dtype)


def config_keys(cls: type, config: Any, allowed: list[str]) -> None:
  """A `from_config` dict holds only constructor arguments, not state."""
  if not isinstance(config, dict):
    raise ValueError(f"`config` must be a dict, got {config!r}.")
  unknown = sorted(set(config) - set(allowed))
  if unknown:
    raise ValueError(
        f"Unknown {cls.__name__} config keys {unknown}; a config holds only {allowed} (the "
        "state is restored from checkpoints, not configs).")


def dynamic_config(config: dict[str, Any]) -> dict[str, Any]:
  """The checked hyperparameters of a `DynamicLossScale`, by name."""
  precision = config["factor_precision"]
  if precision not in ("float32", "float64"):
    raise ValueError(f"`factor_precision` must be 'float32' or 'float64', got {precision!r}.")
  checked = {
      "increment_period": integer("increment_period", config["increment_period"], 1),
      "multiplier": growth_factor("multiplier", config["multiplier"]),
      "min_loss_scale": floor("min_loss_scale", config["min_loss_scale"]),
      "hysteresis": integer("hysteresis", config["hysteresis"], 1),
      "consecutive_hysteresis": boolean("consecutive_hysteresis",
                                        config["consecutive_hysteresis"]),
      "factor_precision": precision, "backoff_factor": None, "max_loss_scale": None,
  }
  backoff = config["backoff_factor"]
  if backoff is not None:
    checked["backoff_factor"] = shrink_factor("backoff_factor", backoff)
    if precision == "float64" and checked["backoff_factor"] > 1 - 2.0**-24:
      raise ValueError(
          f"`backoff_factor` must be at most 1 - 2**-24 with factor_precision='float64', got "
          f"{backoff!r}: some float32 scales times it round back to themselves.")
  elif precision == "float64":
    raise ValueError("factor_precision='float64' needs an explicit `backoff_factor` (PyTorch's "
                     "GradScaler multiplies by it; there is no division by the multiplier).")
  low, high = checked["min_loss_scale"], config["max_loss_scale"]
  if high is not None:
    high = checked["max_loss_scale"] = scale("max_loss_scale", high)
    if high < low:
      raise ValueError(f"`max_loss_scale` ({config['max_loss_scale']!r}) must be >= "
                       f"`min_loss_scale` ({config['min_loss_scale']!r}).")
  initial = checked["initial_loss_scale"] = scale("initial_loss_scale",
                                                  config["initial_loss_scale"])
  if initial < low:
    raise ValueError(f"`initial_loss_scale` must be >= `min_loss_scale` ({low!r}), got "
                     f"{config['initial_loss_scale']!r}.")
  if high is not None and initial > high:
    raise ValueError(f"`initial_loss_scale` must be <= `max_loss_scale` ({high!r}), got "
                     f"{config['initial_loss_scale']!r}.")
  return checked


def probe_args(x: Any, name: Any, index: Any, length: Any) -> None:
  """`diagnostics.probe`'s arguments: a str name, a row `index` in `[0, length)` (checked
  when concrete) given with a positive int `length`, and an array (or a number) `x`."""
  if not isinstance(name, str):
    raise TypeError(f"probe: `name` must be a str, got {name!r}.")
  if (index is None) != (length is None):
    raise ValueError(f"probe {name!r}: index={index!r} and length={length!r} go together: "
                     "the row of this hit and the number of rows.")
  if length is not None and (type(length) is not int or length <= 0):
    raise ValueError(f"probe {name!r}: length={length!r} must be a positive int.")
  concrete = None if index is None or _jax_internals.is_tracer(index) else np.asarray(index)
  if concrete is not None and not (concrete.ndim == 0 and np.issubdtype(
      concrete.dtype, np.integer) and 0 <= concrete < length):
    raise ValueError(f"probe {name!r}: index={index!r} must be an int in [0, length={length}).")
  if not (hasattr(x, "dtype") or isinstance(x, (int, float, complex))):
    raise TypeError(f"probe {name!r}: `x` must be an array, got {type(x).__name__}.")
