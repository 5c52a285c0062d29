"""Framework interception: every way the probe adapters reach inside flax and equinox.

The adapters decide what to probe and how to name it; the mechanisms that let them see a
module's call, and what each relies on in its framework, are here. None changes a class
or a module the caller holds: the loss is given a copy of the model, whose layers are of
probed subclasses of their own classes. tests/test_probe_intercept.py pins what each
relies on, on every supported flax and equinox version.

* flax linen, `linen_calls`: linen's own hook, `nn.intercept_methods`. Relies on the
  interceptor being given `(next_fun, args, kwargs, context)`, with the module called and
  the method's name in `context.module` and `context.method_name`.
* flax NNX, `nnx_probed`: a copy of the model (NNX's split and merge, which share its
  Variables) whose callable modules are of a probed subclass of their class, with values
  set as attributes for the pass. Relies on an NNX module's class being assignable to a
  subclass, on `nnx.split`/`nnx.merge` inside the loss's transforms remaking a module of
  the class and attributes it has (a static attribute in its graph, an `nnx.Variable` in
  its state, which `nnx.scan` and `nnx.vmap` slice with its params), and on `nnx.update`
  giving the model what the loss changed in the copy.
* equinox, `equinox_probed`: a layer remade as an instance of a probed subclass of its
  class, with two more fields: a row index (sliced with the layer's arrays by a scan over
  a stack) and a static tag. Relies on a `Module` subclass adding fields that keep
  defaults, and on a module being made by setting its fields (as its unflattening does).
* `first_pass`: the options the first pass works with (why, in its docstring).

A module of a probed class is never probed again, nor is one whose class's `__call__`
carries `MARK`: set by hand, it leaves a class's calls as they are (the probes benchmark
leaves groups of classes unprobed so).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax

MARK = "_probes_output"

OnCall = Callable[[Any, Callable[..., Any], tuple, dict], Any]

_PROBED: dict[tuple, type] = {}  # (framework, class, hook) -> its probed subclass
_PROBED_LOCK = threading.Lock()


def probeable(module: Any) -> bool:
  """Whether `module` is a layer to probe: callable, of a class neither probed already
  nor marked to be left as it is (`MARK`)."""
  return callable(module) and not getattr(type(module).__call__, MARK, False)


def _probed_class(key: tuple, make: Callable[[], type]) -> type:
  """The probed subclass `make()` makes, made once per `key`: the loss's jits see one
  class, whose instances then hit their caches."""
  with _PROBED_LOCK:
    if key not in _PROBED:
      cls = make()
      setattr(cls.__call__, MARK, True)
      _PROBED[key] = cls
    return _PROBED[key]


def _name_after(probed: type, cls: type) -> type:
  probed.__name__ = probed.__qualname__ = f"Probed{cls.__name__}"
  return probed


# --- flax linen ---------------------------------------------------------------------


def linen_calls(on_call: Callable[[Any, str, Callable[[], Any]], Any]):
  """A context inside which every linen module method runs as
  `on_call(module, method_name, call)`, `call()` running the method."""
  from flax import linen

  def interceptor(next_fun, args, kwargs, context):
    return on_call(context.module, context.method_name, lambda: next_fun(*args, **kwargs))

  return linen.intercept_methods(interceptor)


# --- flax NNX -----------------------------------------------------------------------


_ANNOTATION = "_probe_{}"


def nnx_probed_class(cls: type, on_call: OnCall) -> type:
  """A subclass of NNX module class `cls` whose call of `module` runs
  `on_call(module, call, args, kwargs)`, `call` being `cls`'s call of `module`."""

  def make():
    class Probed(cls):
      def __call__(self, *args, **kwargs):
        return on_call(self, super().__call__, args, kwargs)

    return _name_after(Probed, cls)

  return _probed_class(("nnx", cls, on_call), make)


@contextlib.contextmanager
def nnx_probed(model: Any, on_call: OnCall,
               annotations: Callable[[dict], list[tuple[Any, dict[str, Any]]]]
               ) -> Iterator[Any]:
  """A copy of NNX `model` in which each layer (`probeable`) is of its probed subclass
  (`nnx_probed_class`) and `annotations(modules)` are set on the modules (a dict of the
  copy's modules by path; read by `nnx_annotation`).

  The copy shares `model`'s Variables. On exit its classes are restored and the
  annotations deleted; on a normal exit, what else the loss added to it (an
  `nnx.Module.sow`) is given to `model` with `nnx.update`.
  """
  from flax import nnx

  copy = nnx.merge(*nnx.split(model))
  modules = dict(nnx.iter_modules(copy))
  values = annotations(modules)
  classes = {id(module): (module, type(module)) for module in modules.values()
             if probeable(module)}
  try:
    for module, cls in classes.values():
      object.__setattr__(module, "__class__", nnx_probed_class(cls, on_call))
    with _nnx_annotated(values):
      yield copy
  finally:
    for module, cls in classes.values():
      object.__setattr__(module, "__class__", cls)
  nnx.update(model, nnx.state(copy))


@contextlib.contextmanager
def _nnx_annotated(annotations: list[tuple[Any, dict[str, Any]]]) -> Iterator[None]:
  """For each `(module, {key: value})`, the values set on the NNX module (read by
  `nnx_annotation`), deleted on exit. An array is held in an `nnx.Variable`: `nnx.scan`
  slices it with the module's params, so a stacked layer's index reads as its own row."""
  from flax import nnx

  try:
    for module, values in annotations:
      for key, value in values.items():
        setattr(module, _ANNOTATION.format(key),
                nnx.Variable(value) if isinstance(value, jax.Array) else value)
    yield
  finally:
    for module, values in annotations:
      for key in values:
        if _ANNOTATION.format(key) in vars(module):
          delattr(module, _ANNOTATION.format(key))


def nnx_annotation(module: Any, key: str) -> Any:
  """The value `nnx_probed` set on `module` under `key` (an array's row, inside a scan
  over its stack), or None."""
  value = getattr(module, _ANNOTATION.format(key), None)
  return value.get_value() if hasattr(value, "get_value") else value


# --- equinox ------------------------------------------------------------------------


def equinox_probed_class(cls: type, on_output: Callable[[Any, Any], Any]) -> type:
  """A subclass of equinox module class `cls`, with two more fields: `probe_index` (an
  array or None; sliced with the module's arrays by a scan over a stack) and
  `probe_tag` (static). Its call is `on_output(out, self)`, `out` being `cls`'s call."""
  import equinox as eqx

  def make():
    class Probed(cls):
      probe_index: jax.Array | None = None
      probe_tag: Any = eqx.field(static=True, default=None)

      def __call__(self, *args, **kwargs):
        return on_output(super().__call__(*args, **kwargs), self)

    return _name_after(Probed, cls)

  return _probed_class(("equinox", cls, on_output), make)


def equinox_probed(module: Any, index: jax.Array | None, tag: Any,
                   on_output: Callable[[Any, Any], Any]) -> Any:
  """`module` remade as an instance of its probed subclass (`equinox_probed_class`),
  its fields its own, with `index` and `tag`."""
  probed = object.__new__(equinox_probed_class(type(module), on_output))
  for name, value in vars(module).items():
    object.__setattr__(probed, name, value)
  object.__setattr__(probed, "probe_index", index)
  object.__setattr__(probed, "probe_tag", tag)
  return probed


def refuses_probed_modules(error: BaseException) -> bool:
  """Whether `error` is JAX's pytree structure error for a tree holding a probed
  equinox module where another tree holds its module (the loss `eqx.combine`s the
  model it is given with a static part of its own): a ValueError naming a probed
  class."""
  if not isinstance(error, ValueError):
    return False
  with _PROBED_LOCK:
    probed = [cls for (framework, _, _), cls in _PROBED.items() if framework == "equinox"]
  return any(repr(cls) in str(error) for cls in probed)


def refuses_row_index(error: BaseException) -> bool:
  """Whether `error` is flax NNX's error for a Variable that an `nnx.scan` or `nnx.vmap`
  cannot place: the row index given to a stacked module (`_nnx_annotated`), which the
  transform's `nnx.StateAxes` (naming the model's own Variable types) does not cover."""
  return isinstance(error, ValueError) and repr(_ANNOTATION.format("index")) in str(error)


# --- the first pass -----------------------------------------------------------------


class Options(NamedTuple):
  """What the adapters add to the model the loss sees in the first pass.

  Attributes:
    rows: stacked modules carry a row index, for a row per layer (`stacked_rows`).
    probed_copy: an equinox model reaches the loss as a probed copy (`equinox_probed_copy`).
    equinox_rows: the stacked equinox layers (by name) that carry their row index, with
      their sub-layers (`equinox_rows`).
  """
  rows: bool
  probed_copy: bool
  equinox_rows: frozenset = frozenset()


class Found(NamedTuple):
  """What an attempt of the first pass found of the stacks.

  Attributes:
    nested: a scan inside a scan sliced a stacked module's row index twice.
    scanned: the equinox layers (by name) called sliced from their stack without a row
      index.
  """
  nested: bool = False
  scanned: frozenset = frozenset()


def first_pass(attempt: Callable[[Options], tuple[Any, Found]]) -> tuple[Options, Any]:
  """`(options, result)` of the first `attempt(options)` whose stacks need no other
  options, starting with rows and the probed copy on and no equinox row index.

  Four outcomes change an option and try again, each at most once:

  * `scanned`: stacked equinox layers were sliced by a scan (or a vmap) without a row
    index. They are given their row indices, for a row per layer.
  * `nested`: a scan inside a scan sliced a stacked module's row index twice (a stack
    of stacks). Rows are turned off: the probes in the stack sum over its layers.
  * The attempt raised NNX's error of a row index that an `nnx.scan`'s `nnx.StateAxes`
    does not place (`refuses_row_index`: the filters name the model's own Variable
    types). Rows are turned off likewise.
  * The attempt raised the error of a loss that combines the probed equinox copy it is
    given with a static part of its own (`refuses_probed_modules`). The copy is turned
    off: the loss is given the model itself, its modules unprobed. If the loss then
    fails too, its error is raised, with a note of the first.

  Any other error is the loss's own (or the framework's), raised at once.
  """
  options = Options(rows=True, probed_copy=True)
  try:
    return _settled(attempt, options)
  except ValueError as error:
    if refuses_row_index(error):
      return _settled(attempt, options._replace(rows=False))
    if not refuses_probed_modules(error):
      raise
    refused = error
  try:
    return _settled(attempt, options._replace(probed_copy=False))
  except Exception as error:  # the loss's own: raised, with a note of the first
    error.add_note(f"probes: the first pass also failed with the probed copy of an "
                   f"equinox model: {type(refused).__name__}: "
                   f"{str(refused):.300}")
    raise


def _settled(attempt: Callable[[Options], tuple[Any, Found]], options: Options):
  """`(options, result)` of `attempt(options)`, tried again with equinox's row indices
  if it found a stacked equinox layer scanned without one, and without rows if it found
  a stack of stacks."""
  result, found = attempt(options)
  if found.scanned - options.equinox_rows and options.rows:
    options = options._replace(equinox_rows=options.equinox_rows | found.scanned)
    result, found = attempt(options)
  if found.nested and options.rows:
    options = options._replace(rows=False)
    result, _ = attempt(options)
  return options, result
