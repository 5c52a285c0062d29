"""What the library reads from JAX's internals, in one place and in the library's terms.

JAX promises nothing about a traced program's equations (a primitive's parameters, how a
loop keeps its invariant operands), about `jax._src`, or about which named axes are in
scope. The library needs a few of those facts; this module is the only one that reads
them, each with a fallback where JAX moved, and `tests/test_jax_internals.py` pins what is
read on every supported JAX (0.10.2 on Python 3.11, 0.12 on Python 3.12 and newer), so a
change of JAX fails one focused test. A fallback is not silent: its first use warns, once,
naming what stops working (a JAX outside `SUPPORTED_JAX`, which pyproject.toml states).

What is read, and why:

- `axis_names_in_scope`: the named axes of an enclosing `vmap(..., axis_name=)`, which
  stands in for `pmap` on one device; JAX lists them only in `jax._src.core`.
- `varying_axes`: the `shard_map` axes an abstract value varies over (`aval.vma`, or
  `aval.manual_axis_type.varying` where JAX kept them there).
- `reverse_differentiable_here`: whether a value traced by an enclosing transformation
  can be used where the code runs now and differentiated in reverse there (not in a
  custom rule's own trace, nor under forward mode); JAX's stack of traces is only
  private. The probes measure only there.
- `programs`, `loop`, `is_literal`, `literal_value`: a traced program's equations, the
  programs inside an equation (a loop's body, a branch, a jitted function), a loop's
  body with its loop-invariant operands and direction (scan's parameters changed in
  jax 0.11: `num_consts` became the first part of `ft_in`), and literal operands; the
  probes read them to find the loop a probe's row index comes from.
- `is_tracer`, `user_context`: whether a value is traced (`jax.core.Tracer`), and a
  context value that is part of `jit`'s cache key (`jax.make_user_context`), which the
  probes' two passes set.
- `trace`, `evaluate`, `Operation`, `output_types`, `operations_ran`: a program re-run
  operation by operation, each operation bound again (with new parameters, or with the
  programs inside it traced again from a function: `jax._src`'s `trace_to_jaxpr_dynamic`,
  the one way to trace for exact input types), in its name scope (`source_info_util`,
  private), for `autocast` and its precision summary (a jitted function or checkpoint
  traced again for other operand dtypes: `Operation.retypable`); `trace` names the user's function
  and arguments in JAX's errors (`with_names`: `jax.api_util.debug_info`, read by JAX's
  tracing through the function's `__fun_debug_info__`, which only the private
  `save_wrapped_fun_debug_info` sets).
- `operations`, `Operation.users`, `Call`: a program's operations with the later ones that
  read each result, and each call of a function of `jax.nn` that JAX traces inline
  (`INLINED`: `jax.nn.gelu`, no named `jit` around it from jax 0.10 to 0.12) as one
  `Call`, found by that function's frame in its operations' tracebacks
  (`source_info.traceback.frames`); where JAX keeps no traceback, its operations run one
  by one.
- `Source`, `Operation.source`, `Operation.scopes`, `Operation.name_scope`,
  `current_scopes`, `enclosed_by`: where an operation was written: its name scopes
  (`source_info_util`'s name stack, private, read in one place, `_scopes`; JAX traces a
  loop body's or a jitted function's program with it starting over, so the scopes around
  are carried by a context variable) and the user's line (`source_info_util`'s frames).
- `not_reverse_differentiable`: whether an error means that a program cannot be
  differentiated in reverse mode (a `while_loop`; JAX raises a plain `ValueError` or
  `NotImplementedError`, told apart by its message).
- `register_export_serialization`: `jax.export`'s registration of a pytree class, where
  a class defined again under the same name (a notebook cell run twice) replaces the
  earlier class; `jax.export` refuses a second registration of a name, and its
  registries are only private.
- `Origin`, `Operation.origin`: where each operand comes from (the operation that
  computed it, or the constant it is).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import pathlib
import warnings
from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import api_util as _api_util
from jax.extend import core as _core
from jax.extend import linear_util as _linear_util

# The JAX versions the library is tested on (pyproject.toml's requirement): outside them,
# what is read here may have moved.
SUPPORTED_JAX = ">=0.10.2,<0.13"

# Whether XLA:CPU updates donated buffers in place behind a `lax.optimization_barrier`
# that orders two loops (jax 0.12's XLA does). jax 0.10.2's copies the buffers the barrier
# passes instead, so there `_rounding.after` orders the writes by a data dependency: with
# barriers its compensated bfloat16 step took 87 ms instead of 68 ms at 10**7 parameters
# (benchmarks/bf16_writes.py). Pinned by
# tests/test_rounding.py::test_on_cpu_a_donated_step_writes_the_parameters_and_the_state_in_place.
BARRIERS_ORDER_IN_PLACE_WRITES = tuple(
    int(part) for part in jax.__version__.split(".")[:2]) >= (0, 12)


@functools.cache
def degraded(private_name: str, consequence: str) -> None:
  """Warns, once per process, that JAX no longer has `private_name` and what the library
  does without it (`consequence`)."""
  warnings.warn(
      f"jax_lossscale: this JAX ({jax.__version__}) has no `{private_name}`, which the "
      f"library reads from JAX's internals; without it {consequence}. jax_lossscale is "
      f"tested on jax{SUPPORTED_JAX}.", RuntimeWarning, stacklevel=3)


try:  # Tracing a function for exact input types (a shard_map body's varying axes).
  from jax._src.interpreters import partial_eval as _partial_eval
except ImportError:  # pragma: no cover (a JAX that moved it: sub-programs run as traced)
  _partial_eval = None

try:  # The named axes in scope, `vmap`'s included: only private.
  from jax._src.core import unsafe_get_axis_names as _unsafe_get_axis_names
except ImportError:  # pragma: no cover (a JAX that moved it: no vmap axis is seen)
  _unsafe_get_axis_names = None

Program = Any  # a `jax.extend.core.Jaxpr` (or `ClosedJaxpr` before jax 0.11)
Equation = Any  # one of its equations (`JaxprEqn`)
Operand = Any  # an equation's input: a variable or a literal


# Named axes and varying values.


def axis_names_in_scope() -> tuple[Hashable, ...]:
  """The named axes in scope where this is traced (an enclosing `vmap(axis_name=)`'s,
  `pmap`'s, `shard_map`'s); empty where JAX does not tell."""
  if _unsafe_get_axis_names is None:
    degraded("jax._src.core.unsafe_get_axis_names",
             "no vmap axis is seen: replicas under a named vmap stop agreeing (each member "
             "decides its own steps and loss scale)")
    return ()
  return tuple(_unsafe_get_axis_names())


def varying_axes(aval: Any) -> frozenset:
  """The manual (`shard_map`) axes an abstract value varies over; empty outside."""
  manual = getattr(aval, "manual_axis_type", None)
  if manual is not None:
    return frozenset(manual.varying)
  return frozenset(getattr(aval, "vma", None) or ())


def transposed_sharding(x: Any, axes: tuple[int, ...]) -> Any:
  """The sharding of a `dot_general` result that `jnp.transpose(result, axes)` takes to
  `x`'s sharding, as JAX's own transpose of `dot_general` gives its backward matmuls; None
  where `x` is sharded over no explicit mesh axis (JAX infers it then). A backward matmul
  contracting an explicitly sharded axis (the weight's gradient of a batch-sharded
  matmul) must be told its result's sharding."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if explicit not in getattr(getattr(sharding, "mesh", None), "axis_types", ()):
    return None
  spec = tuple(sharding.spec) + (None,) * (len(axes) - len(sharding.spec))
  return sharding.update(spec=sharding.spec.update(
      partitions=tuple(spec[a] for a in np.argsort(axes))))


# The transformations being traced.

try:  # The stack of traces, innermost last, and forward mode's trace: only private.
  from jax._src.core import unsafe_get_current_trace as _current_trace
  from jax._src.core import unsafe_get_trace_stack as _trace_stack
  from jax._src.interpreters.ad import JVPTrace as _ForwardTrace
except ImportError:  # pragma: no cover (a JAX that moved them: every value is usable)
  _current_trace = None


def reverse_differentiable_here(value: Any) -> bool:
  """Whether `value`, made by an enclosing transformation, can be used where the code
  runs now, in a function that is differentiated in reverse (a `custom_vjp`).

  Not where no trace of its differentiation encloses the current one: a `custom_vjp`'s or
  `custom_jvp`'s function and rules are traced apart from the transformations around
  them, and `value` would escape there. Nor where a forward-mode trace (`jax.jvp`,
  `jax.jacfwd`) runs inside its own: a `custom_vjp` has no forward-mode rule. True for a
  value that is no tracer, and where JAX does not tell.
  """
  if not is_tracer(value):
    return True
  if _current_trace is None:
    degraded("jax._src.core.unsafe_get_trace_stack",
             "probes measure everywhere: a probe inside a custom_vjp's rule or under "
             "forward-mode differentiation (jax.jvp, jax.jacfwd) may fail with a leaked tracer")
    return True
  owner = getattr(value, "_trace", None)
  tag = getattr(owner, "tag", None)  # a differentiation's traces share its tag (shard_map's)
  stack = _trace_stack(_current_trace())
  depths = [depth for depth, trace in enumerate(stack)
            if trace is owner or (tag is not None and getattr(trace, "tag", None) is tag)]
  return bool(depths) and not any(
      isinstance(inner, _ForwardTrace) for inner in stack[depths[-1] + 1:])


def is_tracer(value: Any) -> bool:
  """Whether `value` is being traced (under `jit`, `grad`, `vmap`, ...), not concrete."""
  return isinstance(value, jax.core.Tracer)


def user_context(default: Any) -> Any:
  """A context variable that is part of `jit`'s cache key (`jax.make_user_context`):
  set with `with context(value):`, read as `context.value`."""
  return jax.make_user_context(default)


# Serialization by `jax.export`.

try:  # `jax.export`'s registries of pytree classes, by class and by name: only private.
  from jax._src.export import _export as _export_registries
except ImportError:  # pragma: no cover (a JAX that moved them: a class defined again is not)
  _export_registries = None


def register_export_serialization(cls: type, name: str, serialize_auxdata: Callable,
                                  deserialize_auxdata: Callable) -> None:
  """`jax.export.register_pytree_node_serialization(cls, serialized_name=name, ...)`; a
  class registered under `name` before (`cls` defined again) gives its entry to `cls`."""
  by_name = getattr(_export_registries, "deserialization_registry", None)
  by_class = getattr(_export_registries, "serialization_registry", None)
  known = by_name is not None and by_class is not None
  if known and name in by_name:
    if by_name[name][0] is cls:
      return
    by_class.pop(by_name.pop(name)[0], None)
  try:
    jax.export.register_pytree_node_serialization(
        cls, serialized_name=name, serialize_auxdata=serialize_auxdata,
        deserialize_auxdata=deserialize_auxdata)
  except ValueError:  # `name` registered before: the class is defined again
    if known:
      raise
    degraded("jax._src.export._export.deserialization_registry",
             "a loss-scale class defined again (a notebook cell run twice) is not known "
             "to jax.export: exporting a function that takes it fails")


# Traced programs.


def jaxpr_of(program: Program) -> Any:
  """The open program (its `invars`, `eqns`, `outvars`) of a closed or open one."""
  return getattr(program, "jaxpr", program)


def is_program(value: Any) -> bool:
  return isinstance(value, (_core.ClosedJaxpr, _core.Jaxpr))


def equations(program: Program) -> list[Equation]:
  """The equations of `program`, in order."""
  return list(jaxpr_of(program).eqns)


def inputs(program: Program) -> list[Any]:
  """The input variables of `program` (its constants' variables not included)."""
  return list(jaxpr_of(program).invars)


def primitive_name(eqn: Equation) -> str:
  return eqn.primitive.name


def operands(eqn: Equation) -> list[Operand]:
  return list(eqn.invars)


def results(eqn: Equation) -> list[Any]:
  return list(eqn.outvars)


def is_literal(operand: Operand) -> bool:
  """Whether an operand is a constant written into the program (not a variable)."""
  return isinstance(operand, _core.Literal)


def literal_value(operand: Operand) -> Any:
  """A literal operand's value."""
  return operand.val


def dtype_of(operand: Operand) -> Any:
  return operand.aval.dtype


def programs(eqn: Equation) -> Iterator[Program]:
  """The programs inside `eqn` (a jitted function's, each branch of a `cond`, a custom
  rule's), in the order of its parameters; none for a first-order primitive."""
  leaves = jax.tree.leaves(dict(eqn.params), is_leaf=is_program)
  return (leaf for leaf in leaves if is_program(leaf))


@dataclasses.dataclass(frozen=True)
class Loop:
  """A loop equation (`lax.scan`, `lax.while_loop`, `fori_loop`) in the library's terms.

  Attributes:
    body: the program run at each iteration.
    invariant: the loop's operands that the body reads unchanged at every iteration, in
      the order of the body's first inputs; the body's other inputs change with the loop.
    reverse: whether the iterations run last to first (`scan(..., reverse=True)`).
    carried: how many of the loop's results are its carry, passed from one iteration to
      the next; a scan's other results are stacked, one row per iteration.
  """
  body: Program
  invariant: tuple[Operand, ...]
  reverse: bool
  carried: int


def loop(eqn: Equation) -> Loop | None:
  """`eqn` as a `Loop`, or `None` if it is no loop."""
  name, params, args = primitive_name(eqn), eqn.params, operands(eqn)
  if name == "scan":
    consts, carried = _scan_sizes(params)
    return Loop(params["jaxpr"], tuple(args[:consts]), bool(params.get("reverse", False)),
                carried)
  if name == "while":
    start = params["cond_nconsts"]
    return Loop(params["body_jaxpr"], tuple(args[start:start + params["body_nconsts"]]), False,
                len(results(eqn)))
  return None


def _scan_sizes(params: dict) -> tuple[int, int]:
  """How many of a scan's operands are its loop invariants and its carry: `num_consts`
  and `num_carry` up to jax 0.10, from jax 0.11 the sizes of the first two parts
  (consts, carry, xs) of its `ft_in`."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


# Running a program with other precisions (autocast).
#
# `autocast` re-runs a traced program operation by operation, binding each primitive on
# operands it may have cast. What it reads: a program's inputs, outputs and constants, each
# operation's name, operand and result types, and whether it holds programs; what it does:
# binds an operation as traced, with changed parameters, or with each program inside it
# re-traced from a function that runs it (the same input and output types, so the
# operation's type is unchanged). Sub-programs are plain `Jaxpr`s from jax 0.11 on (closed
# ones before); scan's parameters changed in 0.11, but only its program is replaced here.

# The parameters holding the programs `Operation.bind_rewritten` replaces, by primitive.
_PROGRAM_PARAMS = {
    "jit": ("jaxpr",), "pjit": ("jaxpr",), "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",), "remat2": ("jaxpr",), "checkpoint": ("jaxpr",),
    "scan": ("jaxpr",), "while": ("cond_jaxpr", "body_jaxpr"), "cond": ("branches",),
    "custom_jvp_call": ("call_jaxpr",), "custom_vjp_call": ("call_jaxpr",),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
}


# Those whose programs JAX types by their operands alone (no rule or carry is typed by
# them): `Operation.bind_rewritten(..., retyped=True)` traces them for other dtypes.
_RETYPABLE = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat2"})

# Those whose programs are closed (hold their constants): `ClosedJaxpr`s up to jax 0.10,
# `Jaxpr`s with `consts` since. A re-traced program that needs constants (an array the
# function closes over) is given them here; elsewhere (a checkpoint's open program) it
# cannot be replaced.
_CLOSED = frozenset({"jit", "pjit", "closed_call", "scan", "while", "cond", "custom_jvp_call",
                     "custom_vjp_call", "custom_vjp_call_jaxpr"})


try:  # An operation's name scope and traceback, for the programs it is bound into.
  from jax._src import source_info_util as _source_info
except ImportError:  # pragma: no cover (a JAX that moved it: operations lose their scopes)
  _source_info = None

_NO_SOURCE_INFO = (
    "operations lose their name scopes (jax.named_scope, flax's module paths) and lines: "
    "those autocast binds again in profiles and compiled programs, in precision summaries, "
    "for autocast's float32 scopes and for the float8 recipe's filter_fn")


def _scopes(eqn: Equation | None = None) -> tuple[str, ...]:
  """The names of `eqn`'s name scopes (without `eqn`, of those being traced in now),
  outermost first, without the marks of the transformations around them (`jvp(...)`,
  `transpose(...)`); empty where JAX does not tell. The one reader of name scopes:
  `Operation.scopes`, `Operation.name_scope` and `Source.scope` are made from it."""
  if _source_info is None:
    degraded("jax._src.source_info_util", _NO_SOURCE_INFO)
    return ()
  stack = _source_info.current_name_stack() if eqn is None else eqn.source_info.name_stack
  segments = [[]]  # the scopes between transformations' marks that follow a scope
  for part in getattr(stack, "stack", ()):
    if isinstance(part, _source_info.Scope) and part.name != _RECOMPUTED:
      segments[-1].append(part.name)
    elif not isinstance(part, _source_info.Scope) and segments[-1]:
      segments.append([])
  scopes = []
  for segment in segments:  # a checkpoint's derivative repeats the scopes it was bound in
    if segment != scopes[-len(segment):]:
      scopes.extend(segment)
  return tuple(scopes)


# The name scope JAX gives the operations a checkpoint computes again in the backward pass.
_RECOMPUTED = "rematted_computation"

# The name scopes of the operation whose program `bind_rewritten` is tracing again: JAX
# traces a loop body, a branch or a jitted function's program with its name scopes
# starting over, relative to the operation that holds it.
_ENCLOSING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
    "jax_lossscale_enclosing_scopes", default=())


def current_scopes() -> tuple[str, ...]:
  """The names of the name scopes being traced in now, outermost first, those of the
  operations whose programs hold this one included (`enclosed_by`)."""
  outer, inner = _ENCLOSING.get(), _scopes()
  if inner[:len(outer)] == outer:  # a checkpoint's program: scoped as a whole
    return inner
  return (*outer, *inner)


@contextlib.contextmanager
def enclosed_by(scopes: tuple[str, ...]) -> Iterator[None]:
  """A context in which what is traced counts as traced inside the name scopes `scopes`
  (`current_scopes`): for a program JAX traces with its name scopes starting over (a loop
  body, a branch, a jitted function, a `custom_jvp` function and its rule, traced when
  JAX differentiates them)."""
  token = _ENCLOSING.set(scopes)
  try:
    yield
  finally:
    _ENCLOSING.reset(token)


def _source_of(eqn: Equation) -> Any:
  """Binds in `eqn`'s name scope (`jax.named_scope`, flax's module paths: profiles and
  compiled programs name operations by it), with its traceback (what is bound there is
  located at the user's line, the casts in front of it too) and its context (a mesh,
  metadata)."""
  if _source_info is None:
    degraded("jax._src.source_info_util", _NO_SOURCE_INFO)
    return eqn.ctx.manager
  scope = _source_info.current_name_stack() + eqn.source_info.name_stack
  stack = contextlib.ExitStack()
  stack.enter_context(_source_info.user_context(eqn.source_info.traceback, name_stack=scope))
  stack.enter_context(eqn.ctx.manager)
  return stack


def _located_at(eqn: Equation) -> contextlib.AbstractContextManager:
  """Binds with `eqn`'s traceback, in the name scope of the code around."""
  if _source_info is None:
    return contextlib.nullcontext()
  return _source_info.user_context(eqn.source_info.traceback)


# Operations that only move or repeat the elements of their first operand: `Origin` looks
# through them (and through a constant's casts).
_REARRANGING = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim",
                          "copy", "copy_p", "rev"})


@dataclasses.dataclass(frozen=True)
class Origin:
  """Where a value of a program comes from, looking through operations that only reshape,
  transpose or broadcast it (and through a constant's casts).

  Attributes:
    primitive: the primitive of the operation that computed it in the same program; None
      for the program's inputs and constants.
    constant: for a constant of the program (a literal such as `x * 1e5`, a closed-over
      array, a `jnp.float32(...)` scalar) its value, a concrete array; else None.
    features: for a matmul's or convolution's result (followed through transposes,
      squeezes and broadcasts), its groups of feature axes: `dot_general`'s free axes of
      its left-hand operand and those of its right-hand one, a convolution's output
      feature axis; else None (also where a reshape merged or split them).
    computed: whether the program computed it from other values (by anything but
      reshaping, transposing, broadcasting and casting an input or a constant).
    projected_features: for each group of `features`, whether the operand whose free
      axes they are is itself a matmul's or convolution's result (an activation, as
      attention's projected keys are), not a weight (an input, a constant, or a value
      computed from them elementwise: LoRA's `w + a @ b`, a dequantized `q * s`); None
      where `features` is.
  """
  primitive: str | None = None
  constant: Any = None
  features: tuple[tuple[int, ...], ...] | None = None
  computed: bool = False
  projected_features: tuple[bool, ...] | None = None


def _moved_axes(eqn: Any, groups: tuple[tuple[int, ...], ...] | None
                ) -> tuple[tuple[int, ...], ...] | None:
  """Where each group of axes of a rearranging operation's (`eqn`'s) operand is in its
  result (axes of size 1 it drops left out); None where unknown (a reshape that merges or
  splits axes)."""
  if groups is None:
    return None
  name, shape = eqn.primitive.name, eqn.invars[0].aval.shape
  if name in ("copy", "copy_p", "rev"):
    where = {axis: axis for axis in range(len(shape))}
  elif name == "transpose":
    where = {old: new for new, old in enumerate(eqn.params["permutation"])}
  elif name == "broadcast_in_dim":
    where = dict(enumerate(eqn.params["broadcast_dimensions"]))
  elif name in ("squeeze", "reshape", "expand_dims"):  # axes of size 1 dropped or added
    new_shape = eqn.outvars[0].aval.shape
    kept = [i for i, size in enumerate(shape) if size != 1]
    new_kept = [i for i, size in enumerate(new_shape) if size != 1]
    if [shape[i] for i in kept] != [new_shape[i] for i in new_kept]:
      return None
    where = dict(zip(kept, new_kept, strict=True))
  else:
    return None
  return tuple(tuple(sorted(where[axis] for axis in group if axis in where))
               for group in groups)


_MATMULS = frozenset({"dot_general", "conv_general_dilated", "ragged_dot",
                      "ragged_dot_general"})


def output_features(eqn: Any) -> tuple[tuple[int, ...], ...] | None:
  """The groups of feature axes of a matmul's or convolution's result (`eqn`'s): the free
  axes of `dot_general`'s left-hand operand and those of its right-hand one (the layout of
  its result: batch, left free, right free); a convolution's output feature axis. None
  for other primitives."""
  name = eqn.primitive.name
  if name not in _MATMULS:  # some have no results (flax's nn.scan binds one with jax 0.10)
    return None
  out = eqn.outvars[0].aval.ndim
  if name == "dot_general":
    (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
    first = len(lhs_batch)
    right = first + eqn.invars[0].aval.ndim - len(lhs_contract) - len(lhs_batch)
    return (tuple(range(first, right)), tuple(range(right, out)))
  if name == "conv_general_dilated":
    return ((eqn.params["dimension_numbers"].out_spec[1],),)
  return ((out - 1,),)  # a ragged dot's


@dataclasses.dataclass(frozen=True)
class Source:
  """Where an operation was written.

  Attributes:
    scope: its name scope (`jax.named_scope`, a flax linen module path), its parts joined
      by `/`; differentiation's and other transformations' names left out. Empty where
      none.
    file: the source file of the innermost line of the user's code that made it: outside
      JAX, the standard library and installed packages (where every line is in one, the
      innermost outside JAX). Empty where JAX did not record it.
    line: that line's number (0 where unknown).
    function: the function that line is in (its qualified name).
  """
  scope: str = ""
  file: str = ""
  line: int = 0
  function: str = ""


def _source(eqn: Equation, outer: Source = Source()) -> Source:
  """`eqn`'s `Source`, inside a program run by an operation written at `outer` (a jitted
  function's or a loop body's equations are scoped relative to the operation that holds
  them, and located at its line where JAX recorded none of the user's, as in a jitted
  `jnp` function)."""
  inner = _scopes(eqn)
  outer_parts = tuple(filter(None, outer.scope.split("/")))
  if inner[:len(outer_parts)] == outer_parts:  # a checkpoint's program: scoped as a whole
    outer_parts = ()
  scope = "/".join((*outer_parts, *inner))
  frames = ([] if _source_info is None
            else list(_source_info.user_frames(eqn.source_info.traceback)))
  frame = next((f for f in frames if not _installed(f.file_name)), frames[0] if frames else None)
  if frame is None:
    return dataclasses.replace(outer, scope=scope)
  return Source(scope, frame.file_name, frame.start_line, frame.function_name)


@functools.cache
def _installed(file: str) -> bool:
  """Whether `file` is part of an installed package (not the user's own code)."""
  return not {"site-packages", "dist-packages"}.isdisjoint(pathlib.PurePath(file).parts)


@dataclasses.dataclass(frozen=True)
class ValueType:
  """The type a value had when its program was traced.

  Attributes:
    dtype: its dtype (None for a value that is not an array, such as a token).
    weak: whether it was weakly typed (a Python scalar's type, which yields in promotion).
    scalar_constant: whether it is a scalar written into the program (`x * 2.0` once
      promoted: weakly typed no more).
  """
  dtype: np.dtype | None
  weak: bool
  scalar_constant: bool = False


def _value_type(atom: Any) -> ValueType:
  aval = atom.aval
  return ValueType(getattr(aval, "dtype", None), bool(getattr(aval, "weak_type", False)),
                   isinstance(atom, _core.Literal) and getattr(aval, "shape", None) == ())


@dataclasses.dataclass(frozen=True)
class Named:
  """How JAX's errors name a traced function: the user's function, called with `args`
  and `kwargs`, of whose leaves `traced` are traced.

  Attributes:
    traced_for: what traces it (JAX's errors say "while tracing ... for `traced_for`").
    fun: the user's function: its name and line.
    args: its positional arguments.
    kwargs: its keyword arguments.
    traced: the leaves of `(args, kwargs)` that are traced, in the order the traced
      function takes them (flax NNX modules' arrays as their state's leaves).
  """
  traced_for: str
  fun: Callable[..., Any]
  args: tuple
  kwargs: dict
  traced: tuple


def trace(fun: Callable[..., Any], args: list, named: Named | None = None
          ) -> tuple[Program, Any]:
  """`(program, out_tree)`: the program of `fun(*args)` and the tree of its outputs.

  With `named`, an error while tracing (Python control flow on a traced value) names the
  user's function and its arguments (`params['w']`), as `jax.jit`'s do, instead of `fun`
  and its positions in `args`.
  """
  if named is not None:
    fun = with_names(fun, named)
  program, shapes = jax.make_jaxpr(fun, return_shape=True)(*args)
  return program, jax.tree.structure(shapes)


try:  # Sets the debug information JAX's tracing reads from a function: only private.
  from jax._src.api_util import save_wrapped_fun_debug_info as _save_debug_info
except ImportError:  # pragma: no cover (a JAX that moved it: errors name the library's wrapper)
  _save_debug_info = None


def with_names(fun: Callable[..., Any], named: Named) -> Callable[..., Any]:
  """`fun`, which JAX's tracing (`jax.make_jaxpr`, `jax.eval_shape`) names as `named`
  says in its errors: it reads a function's debug information from `__fun_debug_info__`
  (private, both JAX versions). Each traced leaf is named by its path in the user's
  arguments (`params['w']`); none is named where one is not a leaf of them. `fun` itself
  where JAX no longer tells how."""
  if _save_debug_info is None:
    degraded("jax._src.api_util.save_wrapped_fun_debug_info",
             "autocast's tracing errors name its own function and argument positions "
             "instead of the user's function and arguments (params['w'])")
    return fun
  info = _api_util.debug_info(named.traced_for, named.fun, named.args, named.kwargs)
  flat = jax.tree.leaves((named.args, named.kwargs))
  position = {}
  for i, leaf in enumerate(flat):
    position.setdefault(id(leaf), i)
  names = info.arg_names
  if (names is not None and len(names) == len(flat)
      and all(id(leaf) in position for leaf in named.traced)):
    names = tuple(names[position[id(leaf)]] for leaf in named.traced)
  else:
    names = None

  def named_fun(*args):
    return fun(*args)

  _save_debug_info(named_fun, info._replace(arg_names=names))
  return named_fun


def output_types(program: Program) -> tuple[ValueType, ...]:
  """The types of `program`'s outputs, as traced."""
  return tuple(map(_value_type, jaxpr_of(program).outvars))


def _constants(program: Program) -> list:
  return list(getattr(program, "consts", None) or [])


def evaluate(program: Program, args: list, run: Callable[[Any, list], list],
             ops: Sequence[Operation | Call] | None = None) -> list:
  """`program`'s outputs on `args`, each of its `operations` (or `ops`, made by it) computed
  by `run(operation, operands)`, which returns its results (a list, one per result); a
  `Call` is run as one operation (its `evaluate` runs its own)."""
  jaxpr = jaxpr_of(program)
  ops = operations(program) if ops is None else ops
  env = dict(zip(jaxpr.constvars, _constants(program), strict=True))
  env.update(zip(jaxpr.invars, args, strict=True))
  read = lambda atom: atom.val if isinstance(atom, _core.Literal) else env[atom]
  last_use = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.invars
              if not isinstance(v, _core.Literal)}
  last_use.update({v: len(jaxpr.eqns) for v in jaxpr.outvars if not isinstance(v, _core.Literal)})
  done = 0
  for op in ops:
    if isinstance(op, Call):  # in the call's name scope, as its operations are
      with _source_of(op.operations[0].eqn):
        outs = run(op, [read(v) for v in op.invars])
    else:
      with _source_of(op.eqn):  # what `run` binds, its casts included, is located at `eqn`
        outs = run(op, [read(v) for v in op.eqn.invars])
    env.update(zip(op.outvars, outs, strict=True))
    for eqn in op.equations:  # a value no later operation reads is let go (eager arrays)
      for v in eqn.invars:
        if not isinstance(v, _core.Literal) and last_use.get(v, -1) <= done:
          env.pop(v, None)
      done += 1
  # An output that is a literal of the program (`jnp.array(False)` returned as is) as an
  # array, as `jax.jit` returns it, not a Python scalar or JAX's private literal types.
  return [jnp.asarray(v.val) if isinstance(v, _core.Literal) else env[v]
          for v in jaxpr.outvars]


def operations(program: Program) -> list[Operation | Call]:
  """`program`'s equations as `Operation`s, in order, each knowing where its operands come
  from (`origin`) and which later operations read its results (`users`); the operations of
  one call of a function that JAX traced inline (`INLINED`: `jax.nn.gelu`) are one `Call`,
  where that call reads one value and returns one."""
  jaxpr = jaxpr_of(program)
  origins = {v: Origin(constant=value) for v, value in zip(
      jaxpr.constvars, _constants(program), strict=True) if not is_tracer(value)}
  origin = lambda atom: (Origin(constant=atom.val) if isinstance(atom, _core.Literal)
                         else origins.get(atom, Origin()))
  made, producer = [], {}
  for eqn in jaxpr.eqns:
    sources = tuple(map(origin, eqn.invars))
    op = Operation(eqn, sources)
    for i, v in enumerate(eqn.invars):
      if not isinstance(v, _core.Literal) and v in producer:
        producer[v].users.append((op, i))
    producer.update((v, op) for v in eqn.outvars)
    made.append(op)
    name = eqn.primitive.name
    rearranged = sources and (name in _REARRANGING or (
        name == "convert_element_type" and sources[0].constant is not None))
    if rearranged:  # its axes moved: a matmul's feature axes with them, where known
      features = _moved_axes(eqn, sources[0].features)
      result = dataclasses.replace(sources[0], features=features, projected_features=(
          None if features is None else sources[0].projected_features))
    else:
      cast = name == "convert_element_type" and not sources[0].computed
      features = output_features(eqn)
      # dot_general's groups are its operands' (left, right); the others' the right's.
      owners = sources[:2] if name == "dot_general" else sources[1:2]
      result = Origin(name, features=features, computed=not cast, projected_features=None
                      if features is None else tuple(o.primitive in _MATMULS for o in owners))
    origins.update((v, result) for v in eqn.outvars)
  return _calls(made, {v for v in jaxpr.outvars if not isinstance(v, _core.Literal)})


# Functions of `jax.nn` that JAX traces inline, with no named `jit` around them (jax 0.10 to
# 0.12): their operations are found by the function's frame in each one's traceback.
INLINED = frozenset({"gelu"})
_NN_FILE = ("_src", "nn", "functions.py")
# An operation one of them always makes (`x ** 3`, or `erfc` where exact): only around
# those are tracebacks read.
_INLINED_MARKS = frozenset({"integer_pow", "erfc"})


@dataclasses.dataclass(frozen=True, eq=False)
class Call:
  """One call of a function that JAX traced inline (`INLINED`), its operations together.

  Attributes:
    function: the function's name (`"gelu"`).
    operations: its operations, in order.
    invars: the one value it reads from the program around it.
    outvars: the one value it returns to it.
  """
  function: str
  operations: tuple[Operation, ...]
  invars: tuple[Any, ...]
  outvars: tuple[Any, ...]

  @property
  def name(self) -> str:
    return self.function

  @property
  def equations(self) -> list[Equation]:
    return [op.eqn for op in self.operations]

  @property
  def source(self) -> Source:
    return self.operations[0].source

  @property
  def scopes(self) -> tuple[str, ...]:
    """The name scopes it was called in (its first operation's)."""
    return self.operations[0].scopes

  def evaluate(self, args: list, run: Callable[[Any, list], list]) -> list:
    """Its result on `args`, each of its operations computed by `run`, as `evaluate`."""
    env = dict(zip(self.invars, args, strict=True))
    read = lambda atom: atom.val if isinstance(atom, _core.Literal) else env[atom]
    for op in self.operations:  # each at its line, in the call's name scope (`evaluate`'s)
      with _located_at(op.eqn):
        env.update(zip(op.eqn.outvars, run(op, [read(v) for v in op.eqn.invars]), strict=True))
    return [env[v] for v in self.outvars]


def _calls(ops: list[Operation], outvars: set) -> list[Operation | Call]:
  """`ops`, each call of an `INLINED` function among them as one `Call`: the longest run of
  operations around one it always makes whose tracebacks hold the same call of it (the
  same frames outside it); left as they are where the call reads or returns more than one
  value."""
  out, i = [], 0
  while i < len(ops):
    key = _inlined_call(ops[i].eqn) if ops[i].name in _INLINED_MARKS else None
    if key is None:
      out.append(ops[i])
      i += 1
      continue
    start, end = i, i + 1
    while (i - start < len(out) and out[-(i - start) - 1] is ops[start - 1]
           and _inlined_call(ops[start - 1].eqn) == key):  # not in an earlier call
      start -= 1
    while end < len(ops) and _inlined_call(ops[end].eqn) == key:
      end += 1
    call = _call(key[0], ops[start:end], outvars)
    if call is None:
      out.append(ops[i])
      i += 1
      continue
    del out[len(out) - (i - start):]
    out.append(call)
    i = end
  return out


def _call(function: str, ops: list[Operation], outvars: set) -> Call | None:
  made = {v for op in ops for v in op.eqn.outvars}
  read = list(dict.fromkeys(v for op in ops for v in op.eqn.invars
                            if not isinstance(v, _core.Literal) and v not in made))
  inside = set(map(id, ops))
  returned = [v for op in ops for v in op.eqn.outvars
              if v in outvars or any(id(user) not in inside for user, _ in op.users_of(v))]
  if len(read) != 1 or len(returned) != 1:
    return None
  return Call(function, tuple(ops), tuple(read), tuple(returned))


def _inlined_call(eqn: Equation) -> tuple | None:
  """`(function, the frames outside it)` of the `INLINED` function whose call made `eqn`,
  or None (also where JAX keeps no traceback)."""
  traceback = getattr(eqn.source_info, "traceback", None)
  frames = list(getattr(traceback, "frames", None) or ())
  for k, frame in enumerate(frames):
    if frame.function_name in INLINED and _nn_file(frame.file_name):
      return frame.function_name, tuple((f.file_name, f.line_num) for f in frames[k + 1:])
  return None


@functools.cache
def _nn_file(file: str) -> bool:
  return pathlib.PurePath(file).parts[-3:] == _NN_FILE


@dataclasses.dataclass(frozen=True, eq=False)
class Operation:
  """One operation (equation) of a program: a primitive bound to operands.

  Attributes:
    eqn: its equation.
    origins: where each operand comes from in the program it is part of (`Origin()`, of
      unknown origin, where it was not given).
    users: the later operations of its program that read its results, each with the
      position it reads one at (`operations` fills it in).
  """
  eqn: Equation
  origins: tuple[Origin, ...] = ()
  users: list = dataclasses.field(default_factory=list, repr=False)

  def origin(self, i: int) -> Origin:
    """Where its operand `i` comes from."""
    return self.origins[i] if i < len(self.origins) else Origin()

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def equations(self) -> list[Equation]:
    return [self.eqn]

  @property
  def outvars(self) -> list[Any]:
    return list(self.eqn.outvars)

  def users_of(self, result: Any) -> list[tuple[Operation, int]]:
    """The later operations of its program that read `result` (one of its results), each
    with the position it reads it at."""
    return [(user, i) for user, i in self.users if user.eqn.invars[i] is result]

  @property
  def inputs(self) -> tuple[ValueType, ...]:
    """Its operands' types, as traced."""
    return tuple(map(_value_type, self.eqn.invars))

  @property
  def outputs(self) -> tuple[ValueType, ...]:
    return tuple(map(_value_type, self.eqn.outvars))

  @property
  def multiple_results(self) -> bool:
    return self.eqn.primitive.multiple_results

  def param(self, key: str, default: Any = None) -> Any:
    return self.eqn.params.get(key, default)

  @property
  def source(self) -> Source:
    """Where it was written (its name scope relative to its program's)."""
    return _source(self.eqn)

  @property
  def scopes(self) -> tuple[str, ...]:
    """The names of the `jax.named_scope`s it was traced in, outermost first (those around
    a jitted function's call are not among its operations'); transformations (`jvp`,
    `transpose`) keep their operations' scopes."""
    return _scopes(self.eqn)

  @property
  def holds_programs(self) -> bool:
    """Whether programs run inside it (a loop's body, a branch, a jitted function)."""
    return next(programs(self.eqn), None) is not None

  @property
  def rewritable(self) -> bool:
    """Whether `bind_rewritten` can replace every program inside it."""
    if self.name == "shard_map":
      return True
    keys = _PROGRAM_PARAMS.get(self.name)
    return keys is not None and all(
        key in keys for key, value in self.eqn.params.items()
        if any(map(is_program, jax.tree.leaves(value, is_leaf=is_program))))

  @property
  def name_scope(self) -> str:
    """Its name scope (`jax.named_scope`s, flax's module paths) without the marks of the
    transformations around it (`jvp(...)`, `transpose(...)`), "" if none."""
    return "/".join(current_scopes())  # `evaluate` runs it in its scope

  def in_scope(self) -> contextlib.AbstractContextManager:
    """A context in which what is traced takes its name scope and source, as `bind`'s:
    `evaluate` runs each operation in it already."""
    return contextlib.nullcontext()

  def bind(self, operands: list, **params: Any) -> list:
    """Its results on `operands`, with `params` replacing its parameters of those names
    (in its name scope: called by `evaluate`'s `run`)."""
    eqn = self.eqn
    out = eqn.primitive.bind(*operands, **eqn.primitive.get_bind_params({**eqn.params, **params}))
    return list(out) if eqn.primitive.multiple_results else [out]

  @property
  def retypable(self) -> bool:
    """Whether the programs inside it can run on operands of other dtypes than traced (a
    jitted function's, a checkpoint's: no derivative rule or loop carry is typed by them)."""
    return self.name in _RETYPABLE

  def bind_rewritten(self, operands: list, interpret: Callable[[Program, list], list],
                     retyped: bool = False) -> list | None:
    """Its results on `operands` (of the traced types) with each program inside it run by
    `interpret(program, args)`, which must return values of the program's output types;
    None where a program cannot be replaced (it would need new constants). `retyped`
    (where `retypable`): `operands` of any dtypes, each program traced for theirs, and its
    results of the dtypes `interpret` returns.

    A `shard_map` is applied anew through `jax.shard_map` (its program is traced in the
    manual axes' context); other operations bind with re-traced programs.
    """
    with enclosed_by(current_scopes()):  # its programs' name scopes start over
      return self._bind_rewritten(operands, interpret, retyped)

  def _bind_rewritten(self, operands: list, interpret: Callable[[Program, list], list],
                      retyped: bool) -> list | None:
    params = self.eqn.params
    if self.name == "shard_map":
      body = lambda *args: tuple(interpret(params["jaxpr"], list(args)))
      return list(jax.shard_map(
          body, mesh=params["mesh"], in_specs=params["in_specs"],
          out_specs=params["out_specs"], axis_names=set(params["newly_manual_axes"]),
          check_vma=params["check_vma"])(*operands))
    new = {}
    for key in _PROGRAM_PARAMS[self.name]:
      value = params[key]
      many = isinstance(value, (tuple, list))
      types = [jax.typeof(x) for x in operands] if retyped else None
      traced = [_retrace(program, interpret, types, closed=self.name in _CLOSED)
                for program in (value if many else [value])]
      if any(program is None for program in traced):
        return None
      new[key] = type(value)(traced) if many else traced[0]
    return self.bind(operands, **new)


def _retrace(program: Program, interpret: Callable[[Program, list], list],
             types: list | None = None, closed: bool = False) -> Program | None:
  """`program` traced again from `interpret(program, args)`, for the same input types
  (a loop body inside `shard_map` keeps its varying axes); None if it needs constants
  that the kind of `program` cannot hold (an open program: not `closed`), or where JAX
  no longer offers the tracing."""
  if _partial_eval is None:
    degraded("jax._src.interpreters.partial_eval.trace_to_jaxpr_dynamic",
             "autocast stops casting inside loops, conditionals and nested jits (their "
             "operations run in the precision they were traced in)")
    return None
  jaxpr = jaxpr_of(program)
  fun = _linear_util.wrap_init(lambda *args: interpret(program, list(args)),
                               debug_info=jaxpr.debug_info)
  types = [v.aval for v in jaxpr.invars] if types is None else types
  new, _, consts = _partial_eval.trace_to_jaxpr_dynamic(fun, types)
  if _core.ClosedJaxpr is not _core.Jaxpr and isinstance(program, _core.ClosedJaxpr):
    return _core.ClosedJaxpr(new, consts)  # up to jax 0.10: a closed program holds them
  if consts and closed and hasattr(new, "with_consts"):  # since jax 0.11: a Jaxpr does
    return new.with_consts(consts)
  return None if consts else new


@dataclasses.dataclass(frozen=True)
class Ran:
  """One operation that computed on floating values, for a precision summary.

  Attributes:
    name: its primitive.
    dtype: the widest floating dtype among its operands (its results', for one with no
      floating operand).
    backward: whether it depends on the cotangents (it belongs to the backward pass).
    source: where it was written (its name scope within the whole program).
  """
  name: str
  dtype: np.dtype
  backward: bool
  source: Source = Source()


def operations_ran(program: Program, backward_inputs: Sequence[int],
                   forward_outputs: int | None = None) -> list[Ran]:
  """The floating operations of `program` and of every program inside it, once per
  occurrence in the program (a loop body's once); those that depend on the inputs at
  positions `backward_inputs` (the cotangents) are in the backward pass.

  With `forward_outputs`, the first that many outputs of `program` are the forward pass's
  and the others the backward pass's: an operation that only the backward pass's outputs
  need is in the backward pass too, though it reads only forward values (the count of a
  max's ties, the `cos` of a `sin`'s derivative).
  """
  jaxpr = jaxpr_of(program)
  outputs = len(jaxpr.outvars)
  forward = outputs if forward_outputs is None else forward_outputs
  found: list[Ran] = []
  _ran(jaxpr, {jaxpr.invars[i] for i in backward_inputs}, False, Source(), found,
       [i < forward for i in range(outputs)], [i >= forward for i in range(outputs)])
  return found


def _needed(jaxpr: Any, wanted: Sequence[bool]) -> tuple[dict[int, list[bool]], set]:
  """`(results, values)`: for each equation of `jaxpr` that its outputs marked in `wanted`
  need, by position, which of its results they need; and every value they need."""
  values = {v for v, w in zip(jaxpr.outvars, wanted, strict=True)
            if w and not isinstance(v, _core.Literal)}
  results = {}
  for i in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[i]
    needs = [v in values for v in eqn.outvars]
    if any(needs):
      results[i] = needs
      values.update(v for v in eqn.invars if not isinstance(v, _core.Literal))
  return results, values


def _inner_wanted(eqn: Equation, sub: Any, wanted: list[bool] | None) -> list[bool]:
  """Which outputs of `sub`, a program inside `eqn`, are needed where `wanted` of `eqn`'s
  results are: the same positions (a loop body's carry also where the next iteration
  reads it); all where they do not correspond (a while loop's condition)."""
  if wanted is None or not any(wanted):
    return [False] * len(sub.outvars)
  if len(sub.outvars) != len(wanted):
    return [True] * len(sub.outvars)
  inner = list(wanted)
  body = loop(eqn)
  if body is not None and jaxpr_of(body.body) is sub:
    start = len(body.invariant)
    while True:  # a carry the body reads is needed at the iteration before
      _, values = _needed(sub, inner)
      more = [k for k in range(body.carried)
              if not inner[k] and sub.invars[start + k] in values]
      if not more:
        return inner
      for k in more:
        inner[k] = True
  return inner


def _ran(jaxpr: Any, tainted: set, inside_backward: bool, outer: Source, found: list,
         forward: Sequence[bool], backward_only: Sequence[bool]) -> None:
  floating = lambda atoms: [a.aval.dtype for a in atoms if jnp.issubdtype(
      getattr(a.aval, "dtype", np.bool_), jnp.floating)]
  for_forward, _ = _needed(jaxpr, forward)
  for_backward, _ = _needed(jaxpr, backward_only)
  for i, eqn in enumerate(jaxpr.eqns):
    backward = inside_backward or any(
        not isinstance(v, _core.Literal) and v in tainted for v in eqn.invars) or (
            i not in for_forward and i in for_backward)
    if backward:
      tainted.update(eqn.outvars)
    source = _source(eqn, outer)
    for program in programs(eqn):
      sub = jaxpr_of(program)
      _ran(sub, set(sub.invars) if backward else set(), backward, source, found,
           _inner_wanted(eqn, sub, for_forward.get(i)),
           _inner_wanted(eqn, sub, for_backward.get(i)))
    dtypes = floating(eqn.invars) or floating(eqn.outvars)
    container = eqn.primitive.name in _PROGRAM_PARAMS or eqn.primitive.name == "shard_map"
    if dtypes and not container:  # a scatter's combiner program is part of its operation
      found.append(Ran(eqn.primitive.name, _widest(dtypes), backward, source))


def _widest(dtypes: list[np.dtype]) -> np.dtype:
  """The widest of `dtypes`; 8-bit floats do not promote: a float8 matmul of two formats
  (a gradient in e5m2 times e4m3) counts under its first operand's."""
  if all(dtype.itemsize == 1 for dtype in dtypes):
    return dtypes[0]
  return functools.reduce(jnp.promote_types, dtypes)


# Differentiation.


def not_reverse_differentiable(error: BaseException) -> bool:
  """Whether `error`, raised while differentiating a function in reverse mode, means that
  it has no reverse-mode derivative: a `while_loop` (or a `fori_loop` with traced bounds)
  on a differentiated value, or a primitive with no transpose rule. JAX raises a plain
  `ValueError` or `NotImplementedError` for them, told apart by their messages."""
  message = str(error)
  return ((isinstance(error, ValueError)
           and "Reverse-mode differentiation does not work for lax.while_loop" in message)
          or (isinstance(error, NotImplementedError)
              and "Transpose rule (for reverse-mode differentiation)" in message))

