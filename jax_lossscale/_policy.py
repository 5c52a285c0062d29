"""Mixed-precision policies: jmp's `Policy` and `get_policy`, and the loss scale each needs.

A policy names three dtypes: parameters are stored in `param_dtype`, the forward and
backward passes compute in `compute_dtype`, and the model's outputs are returned in
`output_dtype`. The string grammar is jmp's: `"params=float32,compute=float16,
output=float32"`, with the keys shortened to `p`, `c`, `o` and dtypes to `f32`, `f16`,
`bf16`, `f64`, `full` (float32) or `half` (bfloat16 on TPU, float16 elsewhere).
Unlike jmp, a policy also says which loss scale its compute dtype calls for, so one
string switches an experiment between bfloat16 on TPU and float16 on GPU.

`as_dtype` is the one reading of a dtype argument, here and wherever the library takes
a dtype: a grammar name means what it means in a policy string (`"f16"` is float16,
where NumPy reads float128), and nothing ambiguous (`None`, `"f8"`) is guessed at.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _loss_scale
from jax_lossscale import _numerics

# Each dtype's names in the policy grammar, the one `str(policy)` prints first: jmp's
# `dtype_to_names`, keyed by scalar type as jmp keys it (a `np.dtype` finds its entry
# through `.type`).
DTYPE_NAMES = {
    jnp.bfloat16: ("bf16", "bfloat16"),
    jnp.float16: ("f16", "float16"),
    jnp.float32: ("full", "f32", "float32"),
    jnp.float64: ("f64", "float64"),
}
_BY_NAME = {name: jnp.dtype(dtype) for dtype, names in DTYPE_NAMES.items() for name in names}
_GRAMMAR = sorted(_BY_NAME) + ["half"]
_KEYS = {"p": "param_dtype", "params": "param_dtype", "c": "compute_dtype",
         "compute": "compute_dtype", "o": "output_dtype", "output": "output_dtype"}


def half_dtype() -> Any:
  """The half-precision type of this backend, as jmp gives it: `jnp.bfloat16` on TPU,
  `jnp.float16` elsewhere (a scalar type: `half_dtype()(2**15)` makes a number)."""
  return jnp.bfloat16 if jax.local_devices()[0].platform == "tpu" else jnp.float16


def _named_dtype(name: str) -> jnp.dtype | None:
  """The dtype a name of the policy grammar means, or `None` for another string."""
  return jnp.dtype(half_dtype()) if name == "half" else _BY_NAME.get(name)


def _dtype_or_none(value: Any) -> jnp.dtype | None:
  """The dtype `value` unambiguously names, or `None`.

  A string is a name of the grammar or a dtype's exact name ("float8_e4m3fn"), never
  one of NumPy's abbreviations ("f8" is float64, "f16" float128). `None` and Python's
  `float` name no dtype: NumPy reads both as float64, JAX `float` as float32.
  """
  if isinstance(value, str):
    named = _named_dtype(value)
    if named is not None:
      return named
  elif value is None or value is float:
    return None
  elif isinstance(value, (np.ndarray, np.generic, jax.Array)):  # a value, not a dtype
    return None  # (NumPy would read its `dtype`: `Policy(jnp.ones(3, jnp.float16), ...)`)
  try:
    dtype = jnp.dtype(value)
  except TypeError:
    return None
  return None if isinstance(value, str) and dtype.name != value else dtype


def as_dtype(value: Any, argument: str) -> jnp.dtype:
  """`value` as a real floating dtype, reading policy names as `get_policy` does.

  The one reading of a dtype argument, for every function that takes one: `"f16"` is
  float16 here as in a policy string (NumPy would read it as float128), `"half"` is
  `half_dtype()`, and `None` (which NumPy reads as float64) is refused.

  Args:
    value: a real floating dtype (`jnp.float16`, `np.dtype("float16")`, the exact
      name `"float8_e4m3fn"`) or a name of the policy grammar (`"f16"`, `"bf16"`,
      `"f32"`, `"full"`, `"half"`, `"f64"`...).
    argument: the name of the argument `value` was given as, for the error message.

  Returns:
    The dtype.

  Raises:
    ValueError: naming `argument`, for anything else: `None`, Python's `float` (float64
      to NumPy, float32 to JAX), NumPy abbreviations such as `"f8"`, and integer,
      boolean or complex dtypes.
  """
  dtype = _dtype_or_none(value)
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating) or not hasattr(jnp, dtype.name):
    raise ValueError(
        f"`{argument}` must be a floating dtype (jnp.float16, jnp.bfloat16, 'float32', ...) or one "
        f"of the names {_GRAMMAR}, got {value!r}.")
  return dtype


def as_any_dtype(value: Any, argument: str) -> jnp.dtype:
  """`value` as a dtype of any kind (integer and boolean too), read as `as_dtype` reads
  one: `"f16"` is float16, `"int32"` int32, and NumPy's abbreviations and `None` are
  refused with a `ValueError` naming `argument`."""
  dtype = _dtype_or_none(value)
  if dtype is None:
    raise ValueError(
        f"`{argument}` must be a dtype (jnp.float16, jnp.int32, 'bfloat16', ...) or one of "
        f"the names {_GRAMMAR}, got {value!r}.")
  return dtype


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
  """Casts the real floating array leaves of `tree` (JAX or NumPy arrays, as jmp does);
  everything else is untouched, NumPy scalars and Python numbers included, as in jmp."""
  def cast(x):
    if isinstance(x, (jax.Array, np.ndarray)) and jnp.issubdtype(x.dtype, jnp.floating):
      return x.astype(dtype)
    return x
  return jax.tree.map(cast, tree)


def _is_jmp_policy(value: Any) -> bool:
  """Whether `value` is DeepMind jmp's `Policy` (what configs parsed by jmp give)."""
  cls = type(value)
  return cls.__name__ == "Policy" and cls.__module__.split(".")[0] == "jmp"


def _dtypes(policy: Any) -> tuple[Any, Any, Any]:
  return policy.param_dtype, policy.compute_dtype, policy.output_dtype


@dataclasses.dataclass(frozen=True)
class Policy:
  """Which dtype parameters, computation and outputs use (jmp's `Policy`).

  Each dtype may be a real floating dtype or a name of the policy grammar (read by
  `as_dtype`), so `Policy(jnp.float32, "f16", jnp.float32)` computes in float16, as
  `get_policy("p=f32,c=f16,o=f32")` does. They are stored as JAX's scalar types, as
  jmp's are (`jnp.float16`: a dtype that also casts, `policy.compute_dtype(2.0)`).

  Args:
    param_dtype: the dtype parameters are stored (and optimized) in.
    compute_dtype: the dtype of the forward and backward passes.
    output_dtype: the dtype the model's outputs are returned in.

  Raises:
    ValueError: naming the field, for anything `as_dtype` refuses (`None` included).
  """

  param_dtype: Any
  compute_dtype: Any
  output_dtype: Any

  def __post_init__(self):
    for field in dataclasses.fields(self):
      dtype = as_dtype(getattr(self, field.name), field.name)
      object.__setattr__(self, field.name, getattr(jnp, dtype.name))  # jnp.float16, ...

  def __eq__(self, other: object) -> bool:
    """Equal to a policy, ours or jmp's, with the same three dtypes."""
    if isinstance(other, Policy) or _is_jmp_policy(other):
      return tuple(jnp.dtype(d) for d in _dtypes(self)) == tuple(
          jnp.dtype(d) for d in _dtypes(other))
    return NotImplemented

  def __hash__(self) -> int:
    return hash(_dtypes(self))  # jmp's: its frozen dataclass hashes the same tuple

  def cast_to_param(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `param_dtype`; other leaves pass through."""
    return cast_floating(tree, self.param_dtype)

  def cast_to_compute(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `compute_dtype`; other leaves pass through."""
    return cast_floating(tree, self.compute_dtype)

  def cast_to_output(self, tree: Any) -> Any:
    """Casts the floating leaves of `tree` to `output_dtype`; other leaves pass through."""
    return cast_floating(tree, self.output_dtype)

  def with_output_dtype(self, output_dtype: Any) -> Policy:
    """This policy with another `output_dtype`."""
    return dataclasses.replace(self, output_dtype=output_dtype)

  def loss_scale(self) -> _loss_scale.LossScale:
    """The loss scale this policy's `compute_dtype` calls for.

    A `DynamicLossScale()` when gradients computed in `compute_dtype` can underflow
    where float32's would not (float16 and the float8 types: a narrower exponent
    range); a `NoOpLossScale()` for float32, float64 and bfloat16, which has
    float32's range. Pass it to `loss_scaling`.

    Under `autocast` the compute dtype that counts is autocast's: a policy switched to
    float32 so that `autocast(fun, jnp.float16)` does the casting calls for a
    `NoOpLossScale`, where float16 needs `loss_scaling(tx, "dynamic")`
    (`scaled_value_and_grad` warns when it sees that pair).
    """
    if _numerics.has_short_range(self.compute_dtype):
      return _loss_scale.DynamicLossScale()
    return _loss_scale.NoOpLossScale()

  def __str__(self) -> str:
    names = [DTYPE_NAMES.get(d, (jnp.dtype(d).name,))[0]
             for d in (self.param_dtype, self.compute_dtype, self.output_dtype)]
    return "p={},c={},o={}".format(*names)


def _parse_dtype(value: str, policy_name: str) -> jnp.dtype:
  dtype = _named_dtype(value)
  if dtype is None:
    raise ValueError(f"Unknown dtype {value!r} in policy {policy_name!r}: use one of {_GRAMMAR}.")
  return dtype


def get_policy(policy_name: str | Policy) -> Policy:
  """A `Policy` from jmp's string grammar, giving the same dtypes as `jmp.get_policy`.

  A policy object is taken too: ours as it is, DeepMind jmp's (what a config parsed
  with jmp gives) as ours with its dtypes, so `get_policy(policy).loss_scale()` works
  for both.

  `"c=f16"` means params float32, compute and output float16: unspecified params are
  float32, compute follows params, output follows compute. A single dtype name
  (`"half"`, `"f32"`) sets all three. Keys may repeat; the last wins.

  Args:
    policy_name: e.g. `"params=float32,compute=float16,output=float32"` or `"p=f32,c=half"`;
      or a `Policy`, ours or jmp's.

  Returns:
    The `Policy`.

  Raises:
    ValueError: for an unknown key or dtype, or a part that is not `key=dtype`.
  """
  if isinstance(policy_name, Policy):
    return policy_name
  if _is_jmp_policy(policy_name):
    return Policy(*_dtypes(policy_name))
  if not isinstance(policy_name, str):
    raise ValueError(f"`policy_name` must be a string such as 'p=f32,c=f16' or a Policy "
                     f"(ours or jmp's), got {policy_name!r}.")
  if "=" not in policy_name:
    dtype = _parse_dtype(policy_name, policy_name)
    return Policy(dtype, dtype, dtype)
  chosen = {"param_dtype": jnp.dtype(jnp.float32)}
  for part in policy_name.split(","):
    key, sep, value = part.partition("=")
    if not sep or "=" in value:
      raise ValueError(f"Each part of policy {policy_name!r} must be key=dtype, got {part!r}.")
    if key not in _KEYS:
      raise ValueError(
          f"Unknown key {key!r} in policy {policy_name!r}: use 'params', 'compute' or "
          "'output' (or 'p', 'c', 'o').")
    chosen[_KEYS[key]] = _parse_dtype(value, policy_name)
  chosen.setdefault("compute_dtype", chosen["param_dtype"])
  chosen.setdefault("output_dtype", chosen["compute_dtype"])
  return Policy(**chosen)
