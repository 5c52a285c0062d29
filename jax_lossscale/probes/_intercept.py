"""Framework interception: every way the probe adapters reach inside flax and equinox.

The adapters decide what to probe and how to name it; the mechanisms that let them see a
module's call, and what each relies on in its framework, are here. Each is undone when
its context exits, and tests/test_probe_intercept.py pins what it relies on, on every
supported flax and equinox version.

* flax linen, `linen_calls`: linen's own hook, `nn.intercept_methods`. Relies on the
  interceptor being given `(next_fun, args, kwargs, context)`, with the module called and
  the method's name in `context.module` and `context.method_name`.
* flax NNX and equinox, `calls_wrapped`: a class's `__call__` replaced while a pass runs
  (as `nnx.capture(method_outputs=...)` does); neither framework has a hook that can change
  every module's output. Relies on a module's call going through `type(module).__call__`,
  set on the class after it was made.
* flax NNX, `nnx_annotated`: values set as attributes of the model's modules for the pass.
  Relies on an `nnx.Variable` attribute being part of the module's state, which `nnx.scan`
  and `nnx.vmap` slice with its params (a row index rides along with a stacked layer), and
  on deleting the attributes giving back the model's graph as it was.
* equinox, `equinox_view_class`: a module that wraps a layer of a view of the model, whose
  attributes read through to the layer and whose `__class__` is the layer's, so that the
  loss's `isinstance` checks and attribute reads see the model. Relies on equinox leaving
  `__getattr__` and a `__class__` property of a `Module` subclass in place.
* equinox, `equinox_calls`: where the loss cannot take a view, the model's modules are
  found when called, by the `id()` of their arrays: an equinox module is a pytree, rebuilt
  by every `tree_map` or `combine`, and its arrays are the one identity it keeps.
* `first_pass`: the first pass retried without the adapters' options (a row index,
  equinox's view) when it fails after using one (why, in its docstring).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import NamedTuple

import jax

# On a wrapping `__call__`; set by hand, it leaves a class's calls as they are (the probes
# benchmark leaves groups of classes unprobed so).
MARK = "_probes_output"

_PATCHED: dict[type, list] = {}  # class -> [contexts inside, its own `__call__` or None]
_PATCHING = threading.Lock()

OnCall = Callable[[Any, Callable[..., Any], tuple, dict], Any]


@contextlib.contextmanager
def calls_wrapped(classes, on_call: OnCall) -> Iterator[None]:
  """Inside it, calling an instance `module` of one of `classes` runs
  `on_call(module, call, args, kwargs)`, `call(*args, **kwargs)` being its own call.

  Through `super().__call__`, only the outermost class's call is hooked. A class whose
  `__call__` is marked (`MARK`: a subclass of a wrapped class, or one left unprobed) is
  left as it is. Threads tracing at once share the patch: the first context in patches a
  class, the last out restores it; `on_call` must tell its own context's modules (the
  first context's `on_call` serves them all).
  """
  entered = []
  with _PATCHING:
    for cls in classes:
      if cls in _PATCHED:
        _PATCHED[cls][0] += 1
      elif getattr(cls.__call__, MARK, False):
        continue
      else:
        _PATCHED[cls] = [1, cls.__dict__.get("__call__")]
        cls.__call__ = _wrapped(cls.__call__, on_call)
      entered.append(cls)
  try:
    yield
  finally:
    with _PATCHING:
      for cls in entered:
        _PATCHED[cls][0] -= 1
        if not _PATCHED[cls][0]:
          own = _PATCHED.pop(cls)[1]
          if own is None:
            del cls.__call__
          else:
            cls.__call__ = own


def _wrapped(call: Callable[..., Any], on_call: OnCall) -> Callable[..., Any]:
  @functools.wraps(call)
  def __call__(self, *args, **kwargs):
    if type(self).__call__ is not __call__:  # through super().__call__: its own call
      return call(self, *args, **kwargs)
    return on_call(self, functools.partial(call, self), args, kwargs)

  setattr(__call__, MARK, True)
  return __call__


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


@contextlib.contextmanager
def nnx_annotated(annotations: list[tuple[Any, dict[str, Any]]]) -> Iterator[None]:
  """For each `(module, {key: value})`, the values set on the NNX module for the pass
  (read by `nnx_annotation`), deleted on exit. An array is held in an `nnx.Variable`:
  `nnx.scan` slices it with the module's params, so a stacked layer's index reads as its
  own row."""
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
  """The value `nnx_annotated` set on `module` under `key` (an array's row, inside a
  scan over its stack), or None."""
  value = getattr(module, _ANNOTATION.format(key), None)
  return value.get_value() if hasattr(value, "get_value") else value


# --- equinox ------------------------------------------------------------------------


@functools.cache  # one class, made when equinox is first needed
def equinox_view_class() -> type:
  """`View(module, index, tag, on_output)`: an equinox module whose call is
  `on_output(module(*args, **kwargs), index, tag)`.

  `index` (an array or None) is a field like the module's own, sliced with its arrays by
  a scan over a stack; `tag` and `on_output` are static. Attributes read through to
  `module`, and its `__class__` is `module`'s: `isinstance(view, type(module))` holds.
  """
  import equinox as eqx

  class View(eqx.Module):
    module: Any
    index: jax.Array | None
    tag: Any = eqx.field(static=True)
    on_output: Callable[..., Any] = eqx.field(static=True)

    def __call__(self, *args, **kwargs):
      return self.on_output(self.module(*args, **kwargs), self.index, self.tag)

    def __getattr__(self, attribute):
      if attribute == "module":  # not set yet: no recursion
        raise AttributeError(attribute)
      return getattr(self.module, attribute)

    @property
    def __class__(self):
      return type(self.module)

  return View


_FOUND = contextvars.ContextVar("probes_equinox_calls", default=None)


@contextlib.contextmanager
def equinox_calls(model: Any, on_call: Callable[[Any, tuple], Callable[..., Any]]):
  """Inside it, a call of one of `model`'s layers (callable modules) runs as
  `on_call(module, path)(*args, **kwargs)`, `path` its key path in `model`; what that
  calls runs as it is (its own wrappers probe inside it).

  A module is one of `model`'s if its arrays are `model`'s own at its path: not another
  model's of the same class, nor arrays made anew inside the loss (by a jit or checkpoint,
  or the slices of a stack it scans).
  """
  found = _ArrayPaths(model, on_call)
  token = _FOUND.set(found)
  try:
    with calls_wrapped(found.classes, _found_call):
      yield
  finally:
    _FOUND.reset(token)


class _ArrayPaths:
  """Where each module and array of `model` is, to find the modules the loss calls."""

  def __init__(self, model, on_call):
    import equinox as eqx

    self.on_call = on_call
    self.inside = False  # in a found module's call, whose own wrappers probe
    modules = [((), model)]
    for path, module in modules:  # and the submodules appended as it goes
      sub = lambda x, module=module: isinstance(x, eqx.Module) and x is not module
      modules += [(path + key, child) for key, child in jax.tree_util.tree_flatten_with_path(
          module, is_leaf=sub)[0] if sub(child)]
    self.classes = {type(m) for _, m in modules if callable(m)}
    self.paths = {id(leaf): path for path, leaf in jax.tree_util.tree_leaves_with_path(
        model) if eqx.is_array(leaf)}

  def find(self, module) -> tuple | None:
    """`module`'s path in the model, found by its arrays; None if not the model's."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(module):
      at = self.paths.get(id(leaf))
      if at is not None and at[len(at) - len(path):] == path:
        return at[:len(at) - len(path)]
    return None


def _found_call(module, call, args, kwargs):
  found = _FOUND.get()
  path = None if found is None or found.inside else found.find(module)
  if path is None:
    return call(*args, **kwargs)
  found.inside = True
  try:
    return found.on_call(module, path)(*args, **kwargs)
  finally:
    found.inside = False


# --- the first pass -----------------------------------------------------------------


class Options(NamedTuple):
  """What the adapters add to the model the loss sees in the first pass.

  Attributes:
    rows: stacked modules carry a row index, for a row per layer (`stacked_rows`).
    views: an equinox model reaches the loss as a probed view (`equinox_views`).
  """
  rows: bool
  views: bool


_FALLBACKS = (Options(True, True), Options(False, True), Options(True, False),
              Options(False, False))


def first_pass(attempt: Callable[[Options, set], Any]) -> tuple[Options, Any]:
  """`(options, attempt(options, used))` for the first `options` it returns with: all
  on, then each option that the failed attempts used (`attempt` adds its name to
  `used`) turned off. If none works, the last error is raised: the loss's own, once no
  option is in the way.

  Retried on any exception, because the options change the model the loss is given and
  the loss's own code, or the framework's, may fail with them: a stack of stacks scanned
  twice slices the row index twice (an IndexError, from the scan), a loss that
  `eqx.combine`s the view with a static part of its own finds wrappers where it had
  modules (a ValueError, from the trees' structure check). Nothing tells these apart
  from the loss's own errors before it runs, and their types are the frameworks', which
  change between versions. An attempt that used no option is not retried.
  """
  errors, used = [], set()
  for options in _FALLBACKS:
    if any(not on and name not in used for name, on in zip(Options._fields, options,
                                                           strict=True)):
      continue  # turning off an option that was not used changes nothing
    tried = set()
    try:
      return options, attempt(options, tried)
    except Exception as error:  # retried, or raised below: see above
      errors.append(error)
      used |= tried
      if not tried:
        break
  if len(errors) > 1:
    errors[-1].add_note(f"probes: the first pass also failed with the adapters' stacked "
                        f"rows or equinox views: {type(errors[0]).__name__}: {str(errors[0]):.300}")
  raise errors[-1]
