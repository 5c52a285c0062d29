"""Operation-level mixed precision: `autocast` runs each primitive at a precision chosen for it.

`autocast(fun)` traces `fun` and runs its program again, primitive by primitive, casting
operands on the way in, as PyTorch's `torch.autocast` does for its operators:

- **Matmul-class primitives** (`MATMUL`: `dot_general`, `conv_general_dilated`,
  `ragged_dot`, `ragged_dot_general`) take their floating operands in `compute_dtype` and
  return it: PyTorch's CUDA float16 list (`mm`, `matmul`, `linear`, `conv*`, `bmm`,
  `baddbmm`, ...) and TensorFlow's allow list (`MatMul`, `BatchMatMul`, `Conv2D`, ...).
- **Precision-sensitive primitives** (`FLOAT32`) run in float32:
  - PyTorch's CUDA float32 list, mapped to primitives: `exp`, `expm1`, `log`, `log1p`,
    `pow`, `rsqrt`, `erf_inv`, `acos`, `asin`, `cosh`, `sinh`, `tan` (its `log10`/`log2`/
    `reciprocal` are `log` and `div` here), and its sums and products (`sum`, `prod`,
    `cumsum`, `cumprod`, `logsumexp`, the norms and losses, which are sums here):
    `reduce_sum`, `reduce_prod`, `cumsum`, `cumprod`, `cumlogsumexp`, and `psum`, a sum
    over devices;
  - TensorFlow's deny list (`Exp`, `Expm1`, `Pow`, `Sum`, `Mean`, `L2Loss`, the softmax
    cross-entropies), which adds nothing new;
  - `integer_pow`, `square` and a `mul` of a value by itself (`jnp.linalg.norm`, an RMS
    norm's `mean(h * h)`: squares of a few hundred overflow float16),
    `exp2`, `logistic` (PyTorch's `binary_cross_entropy_with_logits`, `softplus`), and the
    special functions that overflow or cancel in float16 (`lgamma`, `digamma`, `igamma`,
    `erfc`, ...). TensorFlow runs `Log`, `Softmax` and `Sigmoid` in float16 when their
    input is: its kernels compute them internally in float32, which JAX's primitives do
    not promise;
  - `reduce_max` and `reduce_min`, whose derivative counts the ties with a sum.
- **A bias added to a matmul's result** (`x @ w + b`: an `add` of a matmul's or
  convolution's result and a smaller operand broadcast over it along every axis but the
  free axes of one of its operands, the weight's; not an attention mask, which varies
  over the queries and the keys) runs in the matmul's
  dtype, as PyTorch's `linear` adds its bias; its derivative broadcasts in float32, so
  that the sum over the rows that differentiates it runs in float32, as does that of any
  value an `add` or `sub` in float16 or bfloat16 broadcasts (`_bind_summing_in_float32`).
- **Activation functions** (`ACTIVATIONS`: `jax.nn.gelu`, `silu`, `mish`, `elu`,
  `celu`, whose value never exceeds their operand's magnitude by more than a constant) on
  a float16 or bfloat16 value run as one operation, as PyTorch's fused `F.gelu` and
  `F.silu` do: in float32 inside (GELU's `x ** 3` included), the result rounded to the
  operand's dtype, and computed again from the operand by the backward pass, which keeps
  only the operand.
- **Everything else** runs at the widest floating dtype of its operands (Python scalars
  and the program's scalar constants do not widen), PyTorch's type promotion for ops on no list:
  adding a float32 residual to a float16 matmul's result gives float32. A constant whose
  value does not keep its magnitude in that dtype (`x / 1e5`, `x + 1e-8` in float16:
  overflowing, or below its normal range) widens it to the constant's dtype, whether a
  literal, a `jnp.float32(...)` scalar or a closed-over array; and so are the elementwise
  operations that compute its operand from the last matmul (`jnp.maximum(x @ w, 0.0)` in
  `log(maximum(x @ w, 0) + 1e-8)`), so that their derivatives run in float32 too.
- **Explicit casts** (`astype`, `convert_element_type`) run as written. Integers,
  booleans and keys are never cast; float64 and 8-bit floats are not cast either (they
  are deliberate), only float32, float16 and bfloat16: an operation on them runs as traced.
- **An inner autocast** to float32 (`autocast(part, jnp.float32)` inside `fun`) runs its
  operations as it chose, in float32, forward and backward: "this part in float32".
- **At traced precision** (`AS_TRACED`): primitives whose meaning depends on the dtype
  (`bitcast_convert_type`, `reduce_precision`), scatters and generic reductions (their
  combiner is a program typed by the traced dtype), host callbacks, and linear solves
  (`custom_linear_solve`: `jnp.linalg.solve`, `jnp.linalg.inv`,
  `jax.scipy.sparse.linalg.cg`: a solve's factorization or iterations would lose their
  accuracy in float16), and the factorizations and Fourier transforms that JAX
  implements for float32 and wider only (`eigh`, `svd`, `qr`, `lu`, `fft`, `complex`...),
  and JAX's high-level primitives (with jax 0.12: `ldexp`, `frexp`, `searchsorted`).

A gather reads its table as it is: an embedding lookup from a float32 table gathers
float32 rows, and its backward pass scatter-adds float32 cotangents.

A jitted function and a `checkpoint` are autocast as if inlined: their programs are
traced again for the dtypes their operands have (a `jnp.where` or `jax.nn.relu` on a
float16 activation stays float16). A `custom_jvp` function runs on its operands as they
are, autocast in turn, and so does its rule's program (traced on the traced dtypes).
Where JAX checks types, values keep the dtypes they were traced with: the inputs and
outputs of a loop body, a branch, a `custom_vjp` function and a `shard_map` are cast
back to their traced dtypes, and the programs inside are autocast in turn (a
`custom_vjp`'s rules run as the user wrote them). A primitive holding programs that
`autocast` does not know (a `pallas_call`), and a call to foreign code (`ffi_call`),
runs at its traced precision, with a warning naming it at the user's line that calls it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import warnings
from collections.abc import Callable
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_lossscale import _eager
from jax_lossscale import _fp8
from jax_lossscale import _jax_internals as internals
from jax_lossscale import _numerics
from jax_lossscale import _policy
from jax_lossscale import _trees

MATMUL = frozenset({"dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general"})

FLOAT32 = frozenset({
    "exp", "exp2", "expm1", "log", "log1p", "pow", "integer_pow", "square", "rsqrt",
    "logistic", "erf_inv", "erfc", "acos", "asin", "cosh", "sinh", "tan", "lgamma",
    "digamma", "polygamma", "zeta", "igamma", "igammac", "igamma_grad_a",
    "random_gamma_grad", "regularized_incomplete_beta", "bessel_i0e", "bessel_i1e",
    "reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp", "psum",
    "psum_invariant", "reduce_scatter", "reduce_max", "reduce_min",
})

AS_TRACED = frozenset({
    "bitcast_convert_type", "reduce_precision", "scatter", "scatter-add", "scatter_add",
    "scatter-sub", "scatter_sub", "scatter-mul", "scatter_mul", "scatter-min",
    "scatter_min", "scatter-max", "scatter_max", "reduce", "reduce_window",
    "select_and_scatter", "pure_callback", "io_callback", "debug_callback",
    "custom_linear_solve",
    # Linear algebra and Fourier transforms, which JAX implements for float32 and wider
    # only (float16 operands are refused deep inside JAX): in float32, as traced.
    "cholesky", "cholesky_update", "eig", "eigh", "svd", "qr", "geqrf", "geqp3",
    "householder_product", "lu", "schur", "hessenberg", "tridiagonal", "tridiagonal_solve",
    "triangular_solve", "symmetric_product", "fft", "complex",
    # jax 0.12's high-level primitives (`jnp.ldexp`, `jnp.frexp`, `jnp.searchsorted` and
    # so `interp`, `digitize`, `histogram`): each keeps the types it was traced with.
    "call_hi_primitive",
})

# Activation functions whose value never exceeds their operand's magnitude by more than a
# constant, so that it always fits the operand's dtype: each runs as one operation, in
# float32 inside and its result in its operand's dtype, as PyTorch's fused activations
# (`F.gelu`, `F.silu`) run under its autocast (`jax.nn.gelu` is traced inline, the others
# are jitted functions of these names).
ACTIVATIONS = frozenset({"gelu", "silu", "mish", "elu", "celu"})

# Elementwise operations through which a constant that widens an operation reaches back to
# where its operand was computed (`log(max(x @ w, 0) + 1e-8)`: the `max` runs in float32
# too, so that its derivative masks the float32 gradient of the `log`).
_CARRIES_FLOAT32 = frozenset({
    "add", "sub", "mul", "div", "max", "min", "neg", "abs", "sign", "select_n", "clamp",
    "copy", "copy_p", "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims",
    "rev"})

# Sums whose derivative with respect to a broadcast operand (a bias) is a sum over the rows.
_BIAS_LIKE = frozenset({"add", "sub"})

FOREIGN = frozenset({"ffi_call", "custom_call", "pallas_call", "tpu_custom_call",
                     "mosaic_gpu_call", "triton_kernel_call"})

_CASTABLE = frozenset(map(np.dtype, (jnp.float32, jnp.float16, jnp.bfloat16)))

# The name scope an autocast to float32 (or wider) runs in: an enclosing autocast runs the
# operations inside as that one chose (`jls.autocast(part, jnp.float32)`: `part` in float32).
_KEPT_SCOPES = frozenset({"autocast_float32", "autocast_float64"})


def autocast(fun: Callable[..., Any], compute_dtype: Any = jnp.float16,
             fp8: Any = None) -> Callable[..., Any]:
  """`fun`, with its matmuls in `compute_dtype` and its precision-sensitive operations in
  float32, without editing it.

  For float16 training, together with loss scaling::

    grad_fn = jls.scaled_value_and_grad(jls.autocast(loss_fn))  # matmuls in float16
    loss, grads = grad_fn(opt_state, params, batch)  # opt_state of jls.loss_scaling(...)

  Each primitive of `fun`'s program runs at the precision chosen for it (`MATMUL` in
  `compute_dtype`; `FLOAT32`, such as `exp`, `log`, squares, `rsqrt` and sums, in
  float32; the rest at the widest dtype of its operands; explicit casts as written).
  Outputs have the dtypes `fun`'s would have; gradients with respect to float32 inputs
  are float32. Works under and around `jit`, `grad`, `vmap`, loops, `cond`,
  `checkpoint`, custom derivatives and `shard_map`; `precision_summary` shows what ran
  where.

  `fun` is traced as `jax.jit` traces it (Python control flow on array values is not
  possible: the error names `fun`, its line and the arguments the value depends on, as
  `jax.jit`'s does), then run operation by operation. Called outside any transformation,
  it runs as one program compiled once per signature of its arguments (their structure,
  shapes and dtypes, their leaves that are not arrays), as `jax.jit` would; inside one
  (`grad`, `vmap`, a jitted step), it is traced again at each trace of that one. What
  `fun` changes in flax NNX modules it is given (batch statistics, RNG counts) is written
  back to them.
  A custom derivative rule (`custom_jvp`, `custom_vjp`) is kept: under differentiation,
  its rule replaces its autocast function (a `custom_jvp` rule's operations autocast in
  turn, a `custom_vjp`'s at their traced precision). The operations that
  differentiation adds run at the precision of what they differentiate (a matmul's in
  `compute_dtype`); `autocast(jax.value_and_grad(loss))` chooses theirs too (their sums
  in float32).

  Args:
    fun: the function; its array arguments (also inside pytrees, flax NNX modules and
      equinox modules) are traced, its other arguments are passed as they are.
    compute_dtype: the dtype of matmuls' operands: `jnp.float16` (GPU), `jnp.bfloat16`
      (TPU), or a name of the policy grammar (`"f16"`, `"half"`, `"bf16"`).
    fp8: `None`, or a recipe for float8 matmuls (`"tensorwise"`, `"rowwise"` or a
      `Float8Recipe`): each `dot_general` it takes runs on scaled float8 operands, in the
      forward pass and both matmuls of its backward pass, and returns `compute_dtype` (the
      float32 product where its operands are in `compute_dtype` already and it asks for
      a float32 `preferred_element_type`); convolutions too with
      `Float8Recipe.from_name(..., convolutions=True)`, otherwise they run in
      `compute_dtype` (see `docs/fp8.md`).

  Returns:
    A function with `fun`'s signature, whose outputs have `fun`'s dtypes.

  Raises:
    TypeError: if `fun` is not callable, or `fp8` is neither None, a name nor a
      `Float8Recipe`.
    ValueError: if `compute_dtype` is not a floating dtype or is a float8 one, or is
      wider than float32 with `fp8`, or `fp8` names no recipe.
  """
  if not callable(fun):
    raise TypeError(f"autocast's `fun` must be callable, got {fun!r} of type "
                    f"{type(fun).__name__}.")
  dtype = _policy.as_dtype(compute_dtype, "compute_dtype")
  recipe = _fp8.as_recipe(fp8, dtype)

  def interpreted(args, kwargs):
    arrays, replace = _trees.replaceable((args, kwargs), _trees.is_array)

    def traced(*new_arrays):
      copy = replace(new_arrays)
      return fun(*copy[0], **copy[1]), _nnx_state(copy)

    # JAX's tracing errors name `fun` and its arguments, not `traced` and `new_arrays`.
    named = internals.Named("autocast", fun, args, kwargs, tuple(arrays))
    program, out_tree = internals.trace(traced, arrays, named)
    interpreter = _Interpreter(dtype, fp8=recipe)
    with _scope(dtype):
      results = interpreter.run_program(program, arrays)
    interpreter.warn_if_no_float8()
    out, state = jax.tree.unflatten(out_tree, results)
    for module, module_state in zip(_trees.nnx_objects((args, kwargs)), state, strict=True):
      _trees.nnx().update(module, module_state)  # batch statistics, RNG counts
    return out

  # Called outside any transformation, as one program compiled once per signature of the
  # arguments: interpreted anew, the jitted functions inside (`jax.nn.relu`) would be new
  # programs, compiled again at every call.
  compiled = _eager.CompiledBySignature(
      interpreted, f"autocast({getattr(fun, '__name__', type(fun).__name__)})")

  @functools.wraps(fun)
  def autocast_fun(*args, **kwargs):
    if _eager.traced((args, kwargs)):
      return interpreted(args, kwargs)
    return compiled(args, kwargs)

  autocast_fun._jls_autocast_dtype = dtype  # read by `compute_dtype_of`
  return autocast_fun


def compute_dtype_of(fun: Any) -> np.dtype | None:
  """The `compute_dtype` of the `autocast` function `fun` is or wraps (through `jax.jit`,
  `functools.partial` and `functools.wraps`), or None: `scaled_value_and_grad` warns
  where it differentiates float16 under a loss scale of 1."""
  for _ in range(100):  # a chain of wrappers, not a cycle
    dtype = getattr(fun, "_jls_autocast_dtype", None)
    if isinstance(dtype, np.dtype):
      return dtype
    fun = fun.func if isinstance(fun, functools.partial) else getattr(fun, "__wrapped__", None)
    if fun is None:
      return None
  return None


def _scope(dtype: np.dtype) -> Any:
  """The name scope an autocast to `dtype` runs its operations in: one that an enclosing
  autocast keeps for float32 and wider, none for a narrow dtype."""
  if _numerics.is_narrow(dtype):
    return contextlib.nullcontext()
  return jax.named_scope(f"autocast_{dtype.name}")


def _nnx_state(tree: Any) -> list:
  """The state of each flax NNX module in `tree`: what `fun` changed in them returns
  as outputs (the modules `fun` sees are copies holding the traced arrays)."""
  return [_trees.nnx().state(module) for module in _trees.nnx_objects(tree)]


@dataclasses.dataclass(frozen=True, eq=False)
class _Interpreter:
  """Runs programs with `compute_dtype` matmuls, float8 ones where the recipe `fp8` takes
  them; warns once per primitive it cannot handle (`warned`)."""
  compute_dtype: np.dtype
  fp8: Any = None
  warned: set = dataclasses.field(default_factory=set)
  # The float8 recipe's matmuls: those that ran in float8 (an inner autocast's too), and
  # where and which it refused for their sizes.
  float8: list = dataclasses.field(default_factory=list)
  refused: list = dataclasses.field(default_factory=list)

  def warn_if_no_float8(self) -> None:
    """Warns where no matmul ran in float8 and the recipe refused some for their sizes:
    under `jax.vmap`, autocast sees one example's shapes, where a dense layer's rows are
    one."""
    if not isinstance(self.fp8, _fp8.Float8Recipe) or self.float8 or not self.refused:
      return
    shapes = ", ".join(f"{'x'.join(map(str, m.lhs_shape))} by {'x'.join(map(str, m.rhs_shape))}"
                       for _, m in self.refused[:4])
    _warn_at(self.refused[0][0], (
        f"autocast(..., fp8=...) ran no matmul in float8; it refused "
        f"{len(self.refused)} for their sizes ({shapes}"
        f"{', ...' if len(self.refused) > 4 else ''}): float8 takes a matmul "
        f"whose rows, columns and contraction are each a multiple of 16 and at least "
        f"`min_size` ({self.fp8.min_size}); they ran in "
        f"{self.compute_dtype.name}. Under jax.vmap, autocast sees one example's shapes: "
        f"put autocast outside the vmap (`jls.autocast(lambda xs: jax.vmap(f)(xs), ...)`)."))

  def run_program(self, program: Any, args: list) -> list:
    """`program` on `args` (of its input types), its outputs cast to its output types."""
    outs = self._evaluate(program, args)
    return [_cast(out, kind.dtype) for out, kind in zip(
        outs, internals.output_types(program), strict=True)]

  def _evaluate(self, program: Any, args: list) -> list:
    """`program` on `args` of any dtypes, its outputs of the dtypes they come out in."""
    ops = internals.operations(program)
    run = functools.partial(self.run, wide=_widened_by_constants(ops, self.compute_dtype))
    return internals.evaluate(program, args, run, ops)

  def run(self, op: internals.Operation | internals.Call, operands: list,
          wide: frozenset = frozenset()) -> list:
    """`op`'s results on `operands`, run at the precision chosen for it; `wide`: the
    operations that run in float32 for a constant that a later one reads."""
    kept = _KEPT_SCOPES.intersection(op.scopes)  # an inner autocast to float32 chose already
    if isinstance(op, internals.Call):
      run = functools.partial(self.run, wide=wide)
      return op.evaluate(operands, run) if kept else self._activation(op, operands, run)
    if kept:
      return op.bind(_as_traced(op, operands))
    if op.retypable and op.param("name") in ACTIVATIONS and len(operands) == 1:
      outs = self._activation(op, operands, None)
      if outs is not None:
        return outs
    name = op.name
    if name == "convert_element_type":
      return op.bind(operands)
    if name in AS_TRACED:  # a scatter's or reduction's combiner is a program, typed as traced
      return op.bind(_as_traced(op, operands))
    if name == "custom_jvp_call":
      return self._custom_jvp(op, operands)
    if op.holds_programs:
      if op.rewritable and op.retypable:  # a jitted function: autocast as if inlined
        outs = op.bind_rewritten(operands, self._evaluate, retyped=True)
        if outs is not None:
          return outs
      if op.rewritable:
        outs = op.bind_rewritten(_as_traced(op, operands), self.run_program)
        if outs is not None:
          return outs
      return self._unknown(op, operands)
    if name in FOREIGN:
      return self._unknown(op, operands)
    if name in MATMUL:
      return self._matmul(op, operands)
    if name in FLOAT32 or _is_square(op):
      return op.bind([_cast(x, np.dtype(jnp.float32)) if _castable(x) else x
                      for x in operands])
    if op.multiple_results:  # each result its operand's own (a barrier, a sort)
      return op.bind(operands)
    if op in wide:
      operands = [_cast(x, np.dtype(jnp.float32)) if _castable(x) else x for x in operands]
    return _bind_summing_in_float32(op, *_saturated_and_widest(op, operands))

  def _activation(self, op: internals.Operation | internals.Call, operands: list,
                  run: Callable | None) -> list | None:
    """An activation function (`ACTIVATIONS`) on a float16 or bfloat16 operand, as one
    operation: computed in float32, its result rounded to the operand's dtype, and
    computed again from the operand by the backward pass (`jax.checkpoint`), so that what
    the backward pass keeps is the operand alone; None where it cannot run so (a jitted
    one whose program cannot be traced again). `run` runs a `Call`'s operations."""
    (x,) = operands
    if isinstance(op, internals.Call):
      inner = lambda args: op.evaluate(args, run)
    else:
      inner = lambda args: op.bind_rewritten(args, self._evaluate, retyped=True)
    if not (_castable(x) and _numerics.is_narrow(_dtype(x))):
      return inner(operands)
    dtype = _dtype(x)

    def activation(x):
      outs = inner([_cast(x, np.dtype(jnp.float32))])
      return None if outs is None else [_cast(y, dtype) if _castable(y) else y for y in outs]

    return jax.checkpoint(activation)(x)  # None where `activation` gives None

  def _matmul(self, op: internals.Operation, operands: list) -> list:
    floating = [x for x in operands if _is_floating(x)]
    if not floating or not all(map(_castable, floating)):
      if any(_dtype(x).itemsize == 1 for x in floating):  # an inner autocast's float8
        self.float8.append(op.name)
      return op.bind(_widest(op, operands))
    target = self.compute_dtype
    if len({_dtype(x) for x in floating}) == 1 and _numerics.is_narrow(_dtype(floating[0])):
      target = _dtype(floating[0])  # cast by hand, or by an inner autocast: kept
    traced = {kind.dtype for x, kind in zip(operands, op.inputs, strict=True)
              if _is_floating(x)}
    preferred = op.param("preferred_element_type")
    preferred = (np.dtype(preferred) if preferred is not None
                 and jnp.issubdtype(preferred, jnp.floating) else None)
    # A result in `target`, as PyTorch's; in the program's own wider `preferred_element_type`
    # where its operands were traced in `target` already (cast by hand).
    result = preferred if preferred is not None and traced == {target} else target
    if self.fp8 is not None and target == self.compute_dtype:
      refused = []
      out = _fp8.matmul(self.fp8, op, operands, target, result, refused)
      self.refused.extend((op.source, matmul) for matmul in refused)
      if out is not None:
        self.float8.append(op.name)
        return [out]
    params = {} if preferred is None else {"preferred_element_type": result}
    return op.bind([_cast(x, target) if _is_floating(x) else x for x in operands], **params)

  def _custom_jvp(self, op: internals.Operation, operands: list) -> list:
    """A `custom_jvp` function (`jax.nn.relu`) on its operands as they are, autocast like
    any other code (a float16 activation stays float16); its rule's program, traced on the
    traced dtypes, autocast on the primals and tangents as they are (what it keeps for the
    backward pass stays float16 too), its tangents cast to the function's results' dtypes.
    The rule's matmuls run in `compute_dtype`, not float8: reverse mode transposes the
    rule's tangent matmuls, and a float8 matmul (a `custom_vjp`) cannot be transposed."""
    program = op.param("call_jaxpr")
    in_rule = self if self.fp8 is None else dataclasses.replace(self, fp8=None,
                                                                warned=self.warned)
    original = lambda *args: op.bind(_as_traced(op, list(args)))
    # JAX traces `fun` and `rule` again when it differentiates them, scopes starting over.
    scopes = internals.current_scopes()

    @jax.custom_jvp
    def fun(*args):
      with internals.enclosed_by(scopes):
        return self._evaluate(program, list(args))

    @fun.defjvp
    def rule(primals, tangents):
      outs = fun(*primals)
      args = _as_traced(op, list(primals)), _as_traced(op, list(tangents))
      derivative, _ = internals.trace(lambda p, t: jax.jvp(original, p, t)[1], list(args))
      with internals.enclosed_by(scopes):
        traced = in_rule._evaluate(derivative, [*primals, *tangents])
      return outs, [_cast(t, _dtype(out)) if _is_floating(t) else t  # not an integer's float0
                    for t, out in zip(traced, outs, strict=True)]

    return fun(*operands)

  def _unknown(self, op: internals.Operation, operands: list) -> list:
    if op.name not in self.warned:
      self.warned.add(op.name)
      _warn_at(op.source, f"autocast does not know how to run `{op.name}` at other "
               "precisions; it runs at the precision it was traced with.")
    return op.bind(_as_traced(op, operands))


def _warn_at(source: internals.Source, message: str) -> None:
  """A `UserWarning` pointing at the user's line that wrote the operation (this module's
  own line where JAX did not record it); shown once per line, as `warnings.warn`'s."""
  if not source.file:
    warnings.warn(message, stacklevel=3)
    return
  warnings.warn_explicit(message, UserWarning, source.file, source.line,
                         registry=globals().setdefault("__warningregistry__", {}))


def _dtype(x: Any) -> np.dtype | None:
  """`x`'s dtype; None for a non-array and for keys (their dtypes are no NumPy dtypes)."""
  dtype = getattr(x, "dtype", None)
  return dtype if isinstance(dtype, np.dtype) else None


def _is_floating(x: Any) -> bool:
  dtype = _dtype(x)
  return dtype is not None and _floating(dtype)


@functools.cache
def _floating(dtype: np.dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.floating))


def _castable(x: Any) -> bool:
  return _dtype(x) in _CASTABLE


def _cast(x: Any, dtype: np.dtype | None) -> Any:
  """`x` as `dtype`; a constant of the program (a NumPy scalar) stays a constant."""
  if dtype is None or _dtype(x) is None or _dtype(x) == dtype:
    return x
  if isinstance(x, (np.ndarray, np.generic)):
    return np.asarray(x).astype(dtype)[()]
  return lax.convert_element_type(x, dtype)


def _as_traced(op: internals.Operation, operands: list) -> list:
  """`operands` cast back to the floating dtypes they were traced with."""
  return [_cast(x, kind.dtype) if _is_floating(x) else x
          for x, kind in zip(operands, op.inputs, strict=True)]


def _widest(op: internals.Operation, operands: list) -> list:
  """Floating `operands` cast to the widest floating dtype among them; weakly typed ones,
  scalar constants (`x * 2.0`) and a matmul's bias (`_is_bias`) left out of the choice
  unless all are, but a constant whose value does not keep its magnitude in that dtype
  (`x / 1e5` in float16) widens it to its own. Operations on other floating dtypes
  (8-bit floats, float64) run as traced."""
  floating = [i for i, x in enumerate(operands) if _is_floating(x)]
  if not all(_castable(operands[i]) for i in floating):
    return _as_traced(op, operands)
  if not floating:
    return operands
  yielding = [i for i in floating if op.inputs[i].weak or op.inputs[i].scalar_constant
              or _is_filled(op, operands, i) or _is_bias(op, operands, i)]
  strong = [_dtype(operands[i]) for i in floating if i not in yielding]
  target = functools.reduce(jnp.promote_types, strong or [_dtype(operands[i]) for i in floating])
  for i in yielding:
    traced, constant = op.inputs[i].dtype, op.origin(i).constant
    if traced != target and constant is not None and not _keeps_magnitude(constant, target):
      target = jnp.promote_types(target, traced)
  fill = op.param("fill_value") if op.name == "gather" else None
  if fill is not None and not _keeps_magnitude(fill, target):  # a gather's -1e9 padding
    target = jnp.promote_types(target, op.inputs[0].dtype)
  return [_cast(x, target) if _is_floating(x) else x for x in operands]


def _saturated_and_widest(op: internals.Operation, operands: list) -> tuple[list, list]:
  """`(operands, _widest(op, operands))`, a bias whose values are not constants (`_is_bias`)
  saturated in both where it is cast to a dtype of shorter range (`_saturated`)."""
  cast = _widest(op, operands)
  unseen = [i for i, x in enumerate(operands) if op.name == "add" and _is_floating(x)
            and op.origin(i).constant is None and _is_bias(op, operands, i)]
  if not unseen:
    return operands, cast
  operands, cast = list(operands), list(cast)
  for i in unseen:
    target = _dtype(cast[i])
    operands[i] = _saturated(operands[i], target)
    cast[i] = _cast(operands[i], target)
  return operands, cast


def _saturated(bias: jax.Array, dtype: np.dtype) -> jax.Array:
  """A bias that is not a constant (whose values autocast cannot see) with its finite
  values clipped to half of `dtype`'s largest, where `dtype` has the shorter range: an
  additive mask given as an input that looks like a bias (broadcast along an input's
  free axes) keeps its -1e9 as float16's -32752, not -inf (a row of which softmax makes
  NaN), with room for the scores added to it; a real bias is far inside."""
  if not _numerics.has_short_range(dtype) or _numerics.has_short_range(_dtype(bias)):
    return bias
  half = np.asarray(float(jnp.finfo(dtype).max) / 2, _dtype(bias))
  return jnp.where(jnp.isinf(bias), bias, jnp.clip(bias, -half, half))


def _widened_by_constants(ops: list, dtype: np.dtype) -> frozenset:
  """The elementwise operations of a program (`_CARRIES_FLOAT32`) that run in float32
  because a constant whose magnitude `dtype` does not keep widens them (`x + 1e-8` in
  float16), or widens an operation that reads their result through such operations only:
  the float32 reaches back to the matmul whose result they compute on, so that the
  backward pass runs in float32 there too (the derivative of a `max` masking the `log`'s
  1e8 before it is rounded to float16)."""
  if not _numerics.is_narrow(dtype):
    return frozenset()
  flat = [o for op in ops for o in (op.operations if isinstance(op, internals.Call) else [op])]
  wide = set()
  for op in reversed(flat):
    if op.name in _CARRIES_FLOAT32 and (
        any(user in wide for user, _ in op.users)
        or any(_widening_constant(origin.constant, dtype) for origin in op.origins)):
      wide.add(op)
  return frozenset(wide)


def _widening_constant(constant: Any, dtype: np.dtype) -> bool:
  """Whether `constant` (an operand's `Origin.constant`, or None) is a floating constant
  wider than `dtype` whose magnitude `dtype` does not keep."""
  if constant is None:
    return False
  kind = np.asarray(constant).dtype
  return (kind in _CASTABLE and jnp.promote_types(kind, dtype) != dtype
          and not _keeps_magnitude(constant, dtype))


def _bind_summing_in_float32(op: internals.Operation, operands: list, cast: list) -> list:
  """`op` on `cast` (its `operands` as it runs them); for an `add` or `sub` in float16 or
  bfloat16 that broadcasts a value (a bias `[1, n]` over `[rows, n]`), with a derivative
  that broadcasts that value's tangent in float32, so that the sum over the rows that
  differentiates it (JAX's transpose of the broadcast) runs in float32 and is rounded to
  the value's own dtype once.

  JAX's own derivative sums in the operation's dtype: in float16 exact to 2,048 rows and
  inf past 65,504; in bfloat16 a percent or more off over thousands of rows (5% for a
  convolution's bias over 2,048 positions, measured on XLA:CPU). The values, and what the
  forward pass computes and keeps, are the operation's own (the bias is added as
  broadcast by the operation, never as a full-sized copy). The tangent passes an
  `optimization_barrier`, so that the incoming gradient is computed once and read by the
  float32 sum and by the matmuls' gradients alike: without it XLA:CPU computed a GELU's
  derivative again inside the sum (a residual GELU MLP's step 1.9x slower, its
  temporaries 10% higher). Constants have no derivative and are left as they are."""
  if op.name not in _BIAS_LIKE or not all(_is_floating(x) for x in cast):
    return op.bind(cast)
  dtypes = [_dtype(x) for x in cast]
  shape = jnp.broadcast_shapes(*(jnp.shape(x) for x in cast))
  wide = [_numerics.is_narrow(dtypes[i]) and dtypes[i] in _CASTABLE and jnp.shape(x) != shape
          and op.origin(i).constant is None for i, x in enumerate(cast)]
  if not any(wide):
    return op.bind(cast)

  @jax.custom_jvp
  def combine(*args):
    return op.bind([_cast(x, dtype) for x, dtype in zip(args, dtypes, strict=True)])[0]

  @combine.defjvp
  def rule(primals, tangents):
    full = [jnp.broadcast_to(t.astype(jnp.float32) if w else t, shape).astype(dtype)
            for t, w, dtype in zip(tangents, wide, dtypes, strict=True)]
    return combine(*primals), lax.optimization_barrier(op.bind(full)[0])

  return [combine(*(x if w else c for x, c, w in zip(operands, cast, wide, strict=True)))]


def _is_bias(op: internals.Operation, operands: list, i: int) -> bool:
  """Whether operand `i` is a bias added to a matmul's result (`x @ w + b`, a convolution's
  too): broadcast over it along every axis but the free axes of one of the matmul's
  operands (the weight's: flax computes `x @ w`, equinox `w @ x`; the last axis where a
  reshape merged axes since), and so part of the matmul, as PyTorch's `linear`. An
  attention mask added to the scores (`q @ k.T + mask`, varying over the queries and the
  keys, the free axes of both operands, or over the batch) is not one: added in float16,
  its -1e9 would be -inf, and a row of them NaN after the softmax. Nor is a value the
  program computes (a key-padding mask `where(keep, 0, -1e9)[None, :]`, which varies
  over the keys alone): a bias is a parameter, an input of the program or a constant,
  possibly cast; and it varies along a weight's free axes, not along those of an
  operand that is a matmul's result (attention's projected keys, beside which a
  key-padding mask given as an input varies)."""
  if op.name != "add" or len(operands) != 2:
    return False
  if op.origin(i).computed:
    return False
  result, origin = operands[1 - i], op.origin(1 - i)
  if origin.primitive not in MATMUL or not _is_floating(result):
    return False
  shape, full = jnp.shape(operands[i]), jnp.shape(result)
  if len(shape) != len(full) or math.prod(shape) >= math.prod(full):
    return False
  if origin.features is None:  # a reshape merged or split its axes: the last, as flax's
    groups = ((len(full) - 1,),)
  else:  # a weight's free axes: an activation's are not a bias's (attention's keys)
    groups = tuple(group for group, projected in zip(
        origin.features, origin.projected_features, strict=True) if not projected)
  varying = {axis for axis, size in enumerate(shape) if size != 1}
  return any(varying <= set(group) for group in groups)


def _is_square(op: internals.Operation) -> bool:
  """Whether `op` multiplies a value by itself (`x * x`: `jnp.linalg.norm`'s squares, an
  RMS norm's `mean(h * h)`), a square as `square` and `integer_pow` are: in float32."""
  if op.name != "mul" or len(op.eqn.invars) != 2:
    return False
  a, b = op.eqn.invars
  return a is b and not internals.is_literal(a)


def _is_filled(op: internals.Operation, operands: list, i: int) -> bool:
  """Whether operand `i` is a scalar constant broadcast to another operand's shape
  (`jnp.zeros_like(g)` in a derivative rule): a scalar constant, which does not widen."""
  constant = op.origin(i).constant
  return constant is not None and np.ndim(constant) == 0 and any(
      j != i and _is_floating(x) and jnp.shape(x) == jnp.shape(operands[i])
      and op.origin(j).constant is None for j, x in enumerate(operands))


def _keeps_magnitude(value: Any, dtype: np.dtype) -> bool:
  """Whether every element of `value` keeps its magnitude in `dtype`: zero, infinite, NaN
  or in its normal range (not overflowing to inf, nor flushed to 0 or a subnormal)."""
  magnitude = np.abs(np.asarray(value, np.float64))
  info = jnp.finfo(dtype)
  ordinary = np.isfinite(magnitude) & (magnitude != 0)
  return bool(np.all(~ordinary | ((magnitude >= float(info.smallest_normal))
                                  & (magnitude <= float(info.max)))))


class Location(NamedTuple):
  """Where operations were written, in a precision summary.

  Attributes:
    scope: their name scope (`jax.named_scope`, a flax linen module path such as
      `MLP/hidden`, equinox's module names), its parts joined by `/`; empty where none.
    file: the source file of the innermost line of your code that made them (outside
      JAX, the standard library and installed packages, unless all lines are in one);
      empty where JAX did not record it.
    line: that line's number (0 where unknown).
    function: the function that line is in.
  """
  scope: str
  file: str
  line: int
  function: str

  def __str__(self) -> str:
    function = self.function.rpartition("<locals>.")[2]  # a nested function by its name
    line = f"{os.path.basename(self.file)}:{self.line} ({function})" if self.file else ""
    return ": ".join(part for part in (self.scope, line) if part) or "unknown"


class Site(NamedTuple):
  """How many operations of a precision summary's row were written at one location.

  Attributes:
    primitive: the row's primitive.
    dtype: the row's dtype name.
    location: where they were written.
    forward: how many of them are in the forward pass.
    backward: how many in the backward pass.
  """
  primitive: str
  dtype: str
  location: Location
  forward: int
  backward: int


@dataclasses.dataclass(frozen=True)
class PrecisionSummary:
  """What ran in which dtype: for each primitive that computed on floating values, how
  many times it occurs in the program in each dtype, forward and backward, and where.

  `print(summary)` shows it as a table, each row followed by its locations (up to
  `SHOWN`, the most frequent first); a loop body's operations count once.

  Attributes:
    rows: `(primitive, dtype name, forward count, backward count)`, by primitive name.
    sites: each row's locations, with their counts (`Site`), row by row.
  """
  rows: tuple[tuple[str, str, int, int], ...]
  sites: tuple[Site, ...] = ()

  SHOWN: ClassVar[int] = 4

  def count(self, primitive: str, dtype: Any, backward: bool = False) -> int:
    """How many times `primitive` ran in `dtype` in the forward (or backward) pass
    (`dtype` read as `autocast` reads one: `"f16"` is float16, not NumPy's float128)."""
    name = _policy.as_any_dtype(dtype, "dtype").name
    return sum(b if backward else f for p, d, f, b in self.rows if (p, d) == (primitive, name))

  def locations(self, primitive: str, dtype: Any, backward: bool = False) -> dict[Location, int]:
    """Where `primitive` ran in `dtype` in the forward (or backward) pass: each `Location`
    (a named tuple: `scope`, `file`, `line`, `function`) with how many times it ran
    there, in the order of the program. A backward operation is located where the
    operation it differentiates was written."""
    name = _policy.as_any_dtype(dtype, "dtype").name
    found = {}
    for site in self.sites:
      count = site.backward if backward else site.forward
      if (site.primitive, site.dtype) == (primitive, name) and count:
        found[site.location] = count
    return found

  def __str__(self) -> str:
    width = max([len(p) for p, *_ in self.rows] + [9])
    dtype_width = max([len(d) for _, d, *_ in self.rows] + [8])  # float8_e4m3fn is 13
    lines = [f"{'primitive':<{width}}  {'dtype':<{dtype_width}}  {'forward':>7}  {'backward':>8}"
             "  location"]
    for p, d, f, b in self.rows:
      lines.append(f"{p:<{width}}  {d:<{dtype_width}}  {f:>7}  {b:>8}")
      sites = sorted((site for site in self.sites if (site.primitive, site.dtype) == (p, d)),
                     key=lambda site: -(site.forward + site.backward))  # stable: program order
      blank = f"{'':<{width}}  {'':<{dtype_width}}"
      lines += [f"{blank}  {site.forward:>7}  {site.backward:>8}  {site.location}"
                for site in sites[:self.SHOWN]]
      if len(sites) > self.SHOWN:
        lines.append(f"{blank}  {'':>7}  {'':>8}  "
                     f"... {len(sites) - self.SHOWN} more (summary.locations({p!r}, {d!r}))")
    return "\n".join(lines)


def precision_summary(fun: Callable[..., Any], *args: Any, **kwargs: Any) -> PrecisionSummary:
  """Which dtype each primitive of `fun(*args, **kwargs)` ran in, forward and backward,
  and where in your code.

  Any function: an `autocast` one, to check that nothing precision-sensitive ran in
  float16 and that the matmuls did; a hand-cast one, to compare. The backward pass is
  that of the floating outputs with respect to the floating array arguments, with what
  only the gradients need (a max's count of ties, a `sin`'s `cos`); a custom derivative
  rule's primal function is replaced by its rule there. Each row lists where its
  operations were written: their name scope (`jax.named_scope`, a flax linen module path)
  and the line of your code; a backward operation is located where the operation it
  differentiates was::

    print(jls.precision_summary(jls.autocast(loss_fn), params, batch))
    # primitive     dtype     forward  backward  location
    # dot_general   float16         2         4
    #                               1         2  model.py:12 (loss_fn)
    #                               1         2  model.py:13 (loss_fn)
    # exp           float32         1         1
    #                               1         1  model.py:14 (loss_fn)

  Args:
    fun: the function.
    *args: its positional arguments.
    **kwargs: its keyword arguments.

  Returns:
    A `PrecisionSummary`; `print` it for the table, `locations` for where a row ran.

  Warns:
    UserWarning: if `fun` cannot be differentiated in reverse mode (a `while_loop` on
      its floating arguments): the summary then has no backward pass. Any other error
      while tracing `fun` or its derivative is raised.
  """
  if not callable(fun):
    raise TypeError(f"precision_summary's `fun` must be callable, got {fun!r:.200} of type "
                    f"{type(fun).__name__}.")
  wrt, replace = _trees.replaceable(
      (args, kwargs), lambda leaf: _trees.is_array(leaf) and _is_floating(leaf))

  def forward(arrays):
    a, k = replace(arrays)
    return [out for out in jax.tree.leaves(fun(*a, **k)) if _is_floating(out)]

  named = internals.Named("precision_summary", fun, args, kwargs, tuple(wrt))
  shapes = jax.eval_shape(internals.with_names(forward, named), wrt)

  def forward_and_backward(arrays, cotangents):
    outs, pullback = jax.vjp(forward, arrays)
    return outs, pullback(cotangents)

  try:
    program, _ = internals.trace(forward_and_backward, [wrt, shapes])
    cotangents = range(len(wrt), len(wrt) + len(shapes))
  except (ValueError, NotImplementedError) as error:
    if not internals.not_reverse_differentiable(error):
      raise
    warnings.warn(f"precision_summary: `fun` cannot be differentiated in reverse mode "
                  f"({error}); the summary has no backward pass.", stacklevel=2)
    program, _ = internals.trace(forward, [wrt])
    cotangents = range(0)
  ran = internals.operations_ran(program, cotangents, forward_outputs=len(shapes))
  counts = collections.Counter((r.name, r.dtype.name, r.backward) for r in ran)
  keys = sorted({(name, dtype) for name, dtype, _ in counts})
  at = collections.Counter((r.name, r.dtype.name, Location(
      r.source.scope, r.source.file, r.source.line, r.source.function), r.backward) for r in ran)
  locations = collections.defaultdict(dict)  # each row's locations, in the program's order
  for name, dtype, location, _ in at:
    locations[name, dtype][location] = None
  return PrecisionSummary(
      tuple((name, dtype, counts[name, dtype, False], counts[name, dtype, True])
            for name, dtype in keys),
      tuple(Site(name, dtype, location, at[name, dtype, location, False],
                 at[name, dtype, location, True])
            for name, dtype in keys for location in locations[name, dtype]))
