"""Checks of user-facing arguments, in the dtypes that will hold them.

A loss scale keeps its scale in float32 and its counters in int32, so every number is
checked as that dtype will see it: a value that is finite as a Python float but inf in
float32, a factor that rounds to 1, a floor that rounds (or flushes, as XLA flushes
float32 subnormals) to 0, a period that overflows int32: each is refused when the object
is built, with the argument's name. Python numbers, NumPy scalars and concrete 0-d JAX
arrays are accepted alike; booleans are not numbers here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import jax
import numpy as np

FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal; XLA flushes below it
INT32_MAX = int(np.iinfo(np.int32).max)


def _f32(number: float) -> float:
  """`number` rounded to float32 (inf where it overflows), without NumPy's warning."""
  with np.errstate(over="ignore"):
    return float(np.float32(number))


def _describe(value: Any) -> str:
  return f"{value!r} ({type(value).__name__})"


def _as_python_number(name: str, value: Any, kind: str) -> Any:
  """A Python int/float from any concrete real scalar; `None` if it is not one."""
  if isinstance(value, jax.core.Tracer):
    raise ValueError(
        f"`{name}` must be a concrete {kind}, not a traced value: it is a "
        "hyperparameter, fixed when the object is built (got "
        f"{value.aval.str_short()}).")
  if isinstance(value, (bool, np.bool_)):
    return None
  if isinstance(value, (np.ndarray, jax.Array)):
    if value.ndim != 0 or value.dtype == np.bool_ or not (
        np.issubdtype(value.dtype, np.integer) or np.issubdtype(value.dtype, np.floating)):
      return None
    value = value.item()
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  return None


def real(name: str, value: Any) -> float:
  """A finite real number (Python, NumPy or concrete JAX scalar) as a Python float."""
  number = _as_python_number(name, value, "real number")
  if number is None:
    raise ValueError(f"`{name}` must be a real number, got {_describe(value)}.")
  number = float(number)
  if not math.isfinite(number):
    raise ValueError(f"`{name}` must be finite, got {value!r}.")
  return number


def integer(name: str, value: Any, minimum: int, maximum: int = INT32_MAX) -> int:
  """An integer in `[minimum, maximum]`; by default at most the largest int32."""
  number = _as_python_number(name, value, "integer")
  if number is None or isinstance(number, float):
    raise ValueError(f"`{name}` must be an integer, got {_describe(value)}.")
  if number < minimum:
    raise ValueError(f"`{name}` must be >= {minimum}, got {value!r}.")
  if number > maximum:
    raise ValueError(
        f"`{name}` must be <= {maximum} (it is counted in int32), got {value!r}.")
  return number


def float32(name: str, value: Any) -> float:
  """A real number that stays finite when rounded to float32; returned as given."""
  number = real(name, value)
  if not math.isfinite(_f32(number)):
    raise ValueError(
        f"`{name}` must be at most {FLOAT32_MAX:.8g}, the largest float32 (it is used "
        f"in float32), got {value!r}, which is inf in float32.")
  return number


def scale(name: str, value: Any, minimum: float = 0.0) -> float:
  """A loss scale: a positive float32 normal number, at least `minimum`."""
  number = float32(name, value)
  if number < minimum:
    raise ValueError(f"`{name}` must be >= {minimum:g}, got {value!r}.")
  if number <= 0:
    raise ValueError(f"`{name}` must be positive, got {value!r}.")
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
        f"`{name}` must exceed 1 by at least float32's rounding (2**-24): {value!r} "
        "rounds to 1.0, so the loss scale would never grow.")
  return number


def shrink_factor(name: str, value: Any) -> float:
  """A factor in (0, 1) that stays in (0, 1), and normal, once rounded to float32."""
  number = real(name, value)
  if not 0 < number < 1:
    raise ValueError(f"`{name}` must be in (0, 1), got {value!r}.")
  rounded = _f32(number)
  if rounded >= 1:
    raise ValueError(
        f"`{name}` must be below 1 by at least float32's rounding (2**-25): {value!r} "
        "rounds to 1.0, so the loss scale would never back off.")
  if rounded < FLOAT32_TINY:
    raise ValueError(
        f"`{name}` must be at least {FLOAT32_TINY:.8g}, the smallest normal float32: "
        f"{value!r} rounds (or is flushed by XLA) to 0, so one backoff would zero "
        "the loss scale.")
  return number


def boolean(name: str, value: Any) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"`{name}` must be a bool, got {_describe(value)}.")
  return bool(value)


def flag(name: str, value: Any) -> jax.Array:
  """A boolean scalar: a Python/NumPy bool or a boolean 0-d array (traced or not)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  if isinstance(value, (bool, np.bool_)):
    return jnp.asarray(value)
  dtype, shape = getattr(value, "dtype", None), getattr(value, "shape", None)
  if dtype is None or shape is None or not isinstance(value, (jax.Array, np.ndarray)):
    raise ValueError(
        f"`{name}` must be a boolean scalar (e.g. jax_lossscale.all_finite(grads)), got "
        f"{_describe(value)}.")
  if dtype != np.bool_:
    raise ValueError(
        f"`{name}` must be a boolean scalar (e.g. jax_lossscale.all_finite(grads)), got "
        f"an array of dtype {dtype}.")
  if shape != ():
    raise ValueError(
        f"`{name}` must be a boolean scalar, got shape {tuple(shape)}; to keep one "
        "loss scale per model, vmap the update instead.")
  return jnp.asarray(value)


def concrete_values(value: Any) -> np.ndarray | None:
  """`value` as a NumPy array, or `None` if it is traced (or otherwise abstract)."""
  if isinstance(value, jax.core.Tracer) or not isinstance(
      value, (jax.Array, np.ndarray, np.generic, numbers.Number)):
    return None
  return np.asarray(value)
