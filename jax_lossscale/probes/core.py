"""The probes' core: `probe`, `Probes`, and the two passes of `value_and_grad_with_probes`.

`probe(x, name)` is the identity; under `value_and_grad_with_probes` it measures `x`
and its gradient, which leave the backward pass as the cotangent of a zero "stats"
input of the probe (no host callback)::

    loss, grads, probes = value_and_grad_with_probes(jax.value_and_grad, loss_fn)(params, x)
    backward_overflow_origin(probes)  # "layer_2", or None
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Mapping
from collections.abc import Sequence
from typing import Any
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_lossscale import _jax_internals
from jax_lossscale import _trees
from jax_lossscale import _validation
from jax_lossscale.probes import _intercept
from jax_lossscale.probes import order as _order
from jax_lossscale.probes import stats as _stats

LOSS = "<loss>"  # where an overflow after the last probe began


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Probes(Mapping):
  """Probe name -> `ProbeSummary`, in forward order; a pytree (its tuples of names,
  lengths, sizes and order are static).

  Each probe's measurements are sums over its hits, kept as one array (split into
  fields inside a jitted step, they would cost a copy each) and summarized on access.

  Attributes:
    names: the probe names, in the order the forward pass first reached them.
    lengths: each probe's number of rows (`length` given to `probe`), or None.
    sizes: each probe's number of elements per hit, or None where its hits differ in
      size.
    order: `(name, row)` for every row of every probe (row None for a probe without
      rows), in forward order: the rows of the probes of one loop body interleave.
    encoded: per probe, float32 `[..., 2, 259]`: for the activation, then its gradient,
      the largest magnitude, the zero and subnormal counts (fractions where `sizes` is
      None: a count is divided by its size when read, so that the program's small
      kernels are alike for every size), and a one-hot of the largest magnitude's
      float32 exponent. Summed over hits, the one-hots count the hits and keep the
      largest maximum's binade on top.
  """
  names: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  lengths: tuple[int | None, ...] = dataclasses.field(metadata={"static": True})
  sizes: tuple[int | None, ...] = dataclasses.field(metadata={"static": True})
  order: tuple[tuple[str, int | None], ...] = dataclasses.field(metadata={"static": True})
  encoded: tuple[jax.Array, ...]

  def __getitem__(self, name: str) -> _stats.ProbeSummary:
    i = self.names.index(name)
    return _stats.summary(self.encoded[i], self.sizes[i])

  def __iter__(self) -> Iterator[str]:
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)


# Part of jit's cache key: a jit inside the loss is traced again for each pass.
_SESSION = _jax_internals.user_context(None)


@contextlib.contextmanager
def _pass(session: _Discovery | _Measurement) -> Iterator[None]:
  """`session` set while a pass traces the loss, and the tracers it holds dropped after:
  JAX's caches keep it, in the keys of the jits that the loss called."""
  try:
    with _SESSION(session):
      yield
  finally:
    session.returned.clear()
    if isinstance(session, _Measurement):
      session.stats.clear()


@dataclasses.dataclass(frozen=True, eq=False)
class _Discovery:
  """First pass: each probe's name, length and size, each hit in trace order (its index
  if a Python int), marked in the program to find the loops around it (`order`)."""
  lengths: dict[str, int | None]
  sizes: dict[str, int | None] = dataclasses.field(default_factory=dict, kw_only=True)
  hits: list[tuple[str, int | None]] = dataclasses.field(default_factory=list, kw_only=True)
  rows: bool = dataclasses.field(default=True, kw_only=True)  # see `stacked_rows`
  probed_copy: bool = dataclasses.field(default=True, kw_only=True)  # see `equinox_probed_copy`
  # The stacked equinox layers given a row index (see `equinox_rows`).
  equinox_rows: frozenset = dataclasses.field(default=frozenset(), kw_only=True)
  # Probes whose row index a scan inside a scan sliced twice (see `nested_stack`).
  nested: set = dataclasses.field(default_factory=set, kw_only=True)
  # Probes of equinox layers that a scan or vmap sliced with no index (`scanned_stack`).
  scanned: set = dataclasses.field(default_factory=set, kw_only=True)
  # What probes returned (by id, kept alive): not probed again (a module's last output).
  returned: dict = dataclasses.field(default_factory=dict, kw_only=True)
  skipped: set = dataclasses.field(default_factory=set, kw_only=True)  # names, for that

  def probe(self, x, name, index, length):
    if self.lengths.setdefault(name, length) != length:
      raise ValueError(f"probe {name!r} is used with length={length} and with "
                       f"length={self.lengths[name]}; one name, one length.")
    if self.sizes.setdefault(name, np.size(x)) != np.size(x):
      self.sizes[name] = None  # hits of several sizes: each hit's figures are fractions
    self.hits.append((name, _known_row(index)))
    return _order.marked(x, len(self.hits) - 1, index)


def _known_row(index: Any) -> int | None:
  """`index` as a Python int where it is known while tracing (an int, or a concrete
  integer scalar such as `jnp.int32(2)`); None where only the running program knows it."""
  if isinstance(index, (int, np.integer)):
    return int(index)
  if (isinstance(index, (jax.Array, np.ndarray)) and not _jax_internals.is_tracer(index)
      and np.size(index) == 1 and jnp.issubdtype(index.dtype, jnp.integer)):
    return int(np.asarray(index).reshape(()))
  return None


@dataclasses.dataclass(frozen=True, eq=False)
class _Measurement:
  """Second pass: each probe measures into its stats input."""
  stats: dict[str, jax.Array]
  sizes: Mapping[str, int | None]
  returned: dict = dataclasses.field(default_factory=dict, kw_only=True)
  rows: bool = dataclasses.field(default=True, kw_only=True)
  probed_copy: bool = dataclasses.field(default=True, kw_only=True)
  equinox_rows: frozenset = dataclasses.field(default=frozenset(), kw_only=True)
  skipped: set = dataclasses.field(default_factory=set, kw_only=True)

  def probe(self, x, name, index, length):
    if name not in self.stats:
      if name in self.skipped:  # the first pass saw `x` as probed already: an identity
        return x  # (equinox MLP's) returned the same tracer there, a new one under `grad`
      raise ValueError(f"probe {name!r} was not reached when the function was first "
                       "traced; a function must reach the same probes on every trace.")
    stats = self.stats[name]
    if not _jax_internals.reverse_differentiable_here(stats) or _sharded_apart(stats):
      return x  # a custom rule's own trace, forward mode: not measured, as if not probed
    # Inside shard_map, made to vary like `x`: the transpose then psums the stats.
    return _measure(length, self.sizes[name] is None, x, _trees.varying_like(stats, x),
                    None if length is None else jnp.asarray(index, jnp.int32))


def _sharded_apart(stats: jax.Array) -> bool:
  """Whether `stats` are made outside the `shard_map` this runs in, on a mesh with
  `Explicit` axes: JAX cannot close over such an array inside it (it can over `Auto`)."""
  mesh = getattr(jax.typeof(stats).sharding, "mesh", None)
  here = jax.sharding.get_abstract_mesh()
  return bool(here.manual_axes) and mesh is not None and mesh != here and any(
      kind == jax.sharding.AxisType.Explicit for kind in mesh.axis_types)


def probe(x: jax.Array, name: str, *, index: Any = None, length: int | None = None):
  """The identity; measures `x` and its gradient under `value_and_grad_with_probes`.

  Outside it, returns `x` itself and adds nothing to the program. A name reached
  several times (a layer applied twice, a `vmap` or `scan` inside the loss) sums its
  hits; a tensor a probe already returned is not measured again under another name. A
  probe is not measured (0 hits, "not measured" in `diagnostics.table`) inside a function
  with its own `custom_vjp` or `custom_jvp` (the backward pass there is that function's
  own), under forward-mode differentiation inside the loss (`jax.jvp`, `jax.jacfwd`), and
  inside a `shard_map` of the loss on a mesh with `Explicit` axes; the program computes
  what it computes without the probe.
  For one row per layer of a `lax.scan`, pass the layer's index and count::

      def body(h, layer):
        i, w = layer
        return probe(jnp.tanh(h @ w), "block", index=i, length=num_layers), None

  Args:
    x: a floating-point array (others are returned as is, unmeasured).
    name: the probe's name; the key of its `ProbeSummary`.
    index: this hit's row, in `[0, length)`; rows are in forward order. A concrete index
      outside is refused; a traced one outside drops its hit (no row counts it).
    length: the number of rows.

  Returns:
    `x`.
  """
  _validation.probe_args(x, name, index, length)
  session = _SESSION.value
  if session is None or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
    return x
  if id(x) in session.returned:
    session.skipped.add(name)
    return x
  out = session.probe(x, name, index, length)
  session.returned.update({id(x): x, id(out): out})  # the same in both passes
  return out


def probing() -> bool:
  """Whether probes are found or measured now (in `value_and_grad_with_probes`)."""
  return _SESSION.value is not None


def stacked_rows() -> bool:
  """Whether the framework adapters give stacked modules an index, for a row per layer.

  Off when the first pass found a stack of stacks (`nested_stack`): the probes then sum
  over the layers.
  """
  return _option("rows")


def nested_stack(name: str) -> None:
  """Tells the first pass that probe `name`'s row index was sliced by a scan inside a
  scan over its stack (a stack of stacks): it is traced again without rows."""
  session = _SESSION.value
  if isinstance(session, _Discovery):
    session.nested.add(name)


def equinox_rows() -> frozenset:
  """The names of the stacked equinox layers the adapter gives a row index (with
  `stacked_rows`), and to their sub-layers.

  An index is an integer array in the layer, where the loss sees it (a filter on
  `eqx.is_array`, a `jax.grad` of the model): given only to the stacked layers that the
  first pass found a scan (or a vmap) slicing (`scanned_stack`), which need it for a row
  per layer. A layer whose arrays merely share a leading axis (a `Linear`'s weight and
  bias) gets none, in a model with a scanned stack too.
  """
  session = _SESSION.value
  return frozenset() if session is None else session.equinox_rows


def scanned_stack(name: str) -> None:
  """Tells the first pass that the equinox layer probed as `name`, which has no row
  index, was called with its stack's leading axis sliced off: it is traced again with
  row indices."""
  session = _SESSION.value
  if isinstance(session, _Discovery):
    session.scanned.add(name)


def equinox_probed_copy() -> bool:
  """Whether the equinox adapter hands the loss a probed copy of the model.

  Off when the first pass failed with it: a loss that `eqx.combine`s the model with a
  static part of its own needs the model's own classes. The loss is then given the
  model itself, its modules unprobed.
  """
  return _option("probed_copy")


def _option(name: str) -> bool:
  session = _SESSION.value
  return session is not None and getattr(session, name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _measure(length, fractions, x, stats, index):
  del length, fractions, stats, index
  return x


def _measure_fwd(length, fractions, x, stats, index):
  """The activation is measured on the way forward: only its three values wait for the
  backward pass, with the row `index`, which a scan passes on from its inputs (a row of
  `stats` taken here, or a flag computed here, would be a residual stacked per layer).
  Inside `shard_map` they vary like `stats`, which may vary over more axes than `x` (a
  tensor replicated across devices), as the cotangent of `stats` must."""
  del length
  with _SESSION(None):  # out of jit's cache key: `values` is compiled once per shape
    forward = _stats.values(x, fractions)
  return x, (_trees.varying_like(forward, stats), index)


def _measure_bwd(length, fractions, residuals, g):
  """`g` passes on; the hit's measurements are the cotangent of `stats`: with rows, in
  row `index` only (in none for an index out of range: the hit is dropped), selected in
  the encoding's own kernel."""
  forward, index = residuals
  measured = _stats.measurements(forward, _trees.varying_like(g, forward), fractions)
  if length is not None:
    measured = _stats.in_row(measured, index, length)
  return g, measured, None


_measure.defvjp(_measure_fwd, _measure_bwd)


def value_and_grad_with_probes(
    value_and_grad: Callable[..., Callable[..., Any]],
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    has_aux: bool = False,
) -> Callable[..., tuple[Any, Any, Probes]]:
  """`value_and_grad(fun, argnums, has_aux)`, plus what `fun`'s probes measured.

  A `jax.eval_shape` pass finds the probes; their zero stats inputs then travel with
  the first differentiated argument, as `(arg, stats)`, which `jax.value_and_grad`,
  `nnx.value_and_grad` and `equinox.filter_value_and_grad` all differentiate.

  Args:
    value_and_grad: the differentiation transform, called with `has_aux`, and with
      `argnums` unless that is 0 and the transform is not `jax.value_and_grad`.
    fun: the function to differentiate.
    argnums: as in `jax.value_and_grad`; negative values count from the end.
    has_aux: as in `jax.value_and_grad`.

  Returns:
    A function `(*args, **kwargs) -> (value, grads, probes)`: `value` and `grads` as
    `value_and_grad` gives them without probes, `probes` a `Probes`.
  """
  extra = {} if argnums == 0 and value_and_grad is not jax.value_and_grad else {
      "argnums": argnums}

  def value_grads_and_probes(*args, **kwargs):
    if not args:
      raise TypeError(f"differentiating with respect to argnums={argnums!r} needs the "
                      "arguments passed positionally, got keyword arguments only "
                      f"({', '.join(kwargs)}).")
    options, found = _discover_with_fallbacks(fun, args, kwargs)
    stats, sizes, order = found.stats, found.sizes, found.order
    if not stats:
      value, grads = value_and_grad(fun, has_aux=has_aux, **extra)(*args, **kwargs)
      return value, grads, Probes((), (), (), (), ())
    single = isinstance(argnums, int) or hasattr(argnums, "argnum")  # nnx.DiffState
    lead = argnums if single else argnums[0]
    first = getattr(lead, "argnum", lead) % len(args)

    def measured(*packed, **kw):
      unpacked = list(packed)
      unpacked[first], stats = packed[first]
      with _pass(_Measurement(dict(stats), sizes, **options)):
        return fun(*unpacked, **kw)

    packed = list(args)
    packed[first] = (args[first], stats)
    value, grads = value_and_grad(measured, has_aux=has_aux, **extra)(*packed, **kwargs)
    (first_grads, cotangents), *rest = (grads,) if single else grads
    grads = first_grads if single else (first_grads, *rest)
    lengths = tuple(v.shape[0] if v.ndim == 3 else None for v in stats.values())
    return value, grads, Probes(tuple(stats), lengths, tuple(map(sizes.get, stats)), order,
                                tuple(map(cotangents.get, stats)))

  return value_grads_and_probes


class _Found(NamedTuple):
  """What the first pass finds: zero `stats` inputs of the probes reached, in forward
  order, their `sizes` and `Probes.order`."""

  stats: dict
  sizes: dict
  order: tuple


def _discover_with_fallbacks(fun, args, kwargs) -> tuple[dict, _Found]:
  """`(options, found)`: the measuring pass's options (the adapters' options that the
  first pass works with, `_intercept.first_pass`, and the probes it skipped) and what
  the first pass found."""
  sessions = []

  def attempt(options):
    sessions.append(_Discovery({}, **options._asdict()))
    found = _discover(sessions[-1], fun, args, kwargs)
    return found, _intercept.Found(nested=bool(sessions[-1].nested),
                                   scanned=frozenset(sessions[-1].scanned))

  options, found = _intercept.first_pass(attempt)
  return {**options._asdict(), "skipped": sessions[-1].skipped}, found


def _discover(session: _Discovery, fun, args, kwargs) -> _Found:
  """The probes `fun(*args, **kwargs)` reaches (see `_Found`)."""
  leaves, rebuild = _trees.copier((args, kwargs))
  is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

  def traced(arrays):  # other leaves (functions, strings) are closed over
    a, k = rebuild([a if array else leaf for a, array, leaf in zip(arrays, is_array, leaves,
                                                                   strict=True)])
    fun(*a, **k)

  with _pass(session):
    program = jax.make_jaxpr(traced)([leaf if array else None for leaf, array in zip(
        leaves, is_array, strict=True)])
  # Inside shard_map, each device's own: stats varying over the mesh, as under pmap.
  # Outside, on no mesh: JAX cannot close over an array sharded on a mesh's `Explicit`
  # axes inside a `shard_map` of the loss, and the probes there read the stats so.
  here = jax.sharding.get_abstract_mesh()
  manual = tuple(here.manual_axes)
  zeros = lambda *shape: lax.pcast(jnp.zeros(shape, jnp.float32), manual, to="varying")
  with jax.sharding.use_abstract_mesh(here if manual else jax.sharding.AbstractMesh((), ())):
    stats = {name: zeros(*(() if n is None else (n,)), 2, _stats.WIDTH)
             for name, n in session.lengths.items()}
  order = _order.forward_order(session.lengths, session.hits, _order.loops(program.jaxpr))
  return _Found(stats, session.sizes, order)


def all_reduce_probes(probes: Probes, axis_name: Any) -> Probes:
  """Probes summed over `axis_name`, as if one device had seen every hit.

  For probes taken inside `pmap` or `shard_map`, which are each device's own. (Taken
  outside a `shard_map` in the loss, they are summed over its devices already.)
  """
  return lax.psum(probes, axis_name)
