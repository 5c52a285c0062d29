"""Probes: where inside the backward pass float16 overflows and underflows happen.

`probe(x, name)` is the identity; under `value_and_grad_with_probes` it measures `x`
and its gradient, which leave the backward pass as the cotangent of a zero "stats"
input of the probe (no host callback)::

    loss, grads, probes = value_and_grad_with_probes(jax.value_and_grad, loss_fn)(params, x)
    backward_overflow_origin(probes)  # "layer_2", or None
"""

from __future__ import annotations

import dataclasses
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

from jax_lossscale import _trees

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
NUM_BINADES = 256  # float32's biased exponents; 255 holds inf (and NaN, taken as inf)
LOSS = "<loss>"  # where an overflow after the last probe began


class TensorSummary(NamedTuple):
  """What a probe saw of one tensor, over all its hits.

  Attributes:
    max_abs: the largest magnitude, inf if any element was inf or NaN: exact where the
      probe was hit once, else the power of two at the bottom of its binade.
    finite: whether every element of every hit was finite.
    zero_fraction: the fraction of elements equal to zero, averaged over hits.
    subnormal_fraction: the fraction of elements that are nonzero and below 2**-14 in
      magnitude (float16's subnormal range), averaged over hits.
  """
  max_abs: jax.Array
  finite: jax.Array
  zero_fraction: jax.Array
  subnormal_fraction: jax.Array


class ProbeSummary(NamedTuple):
  """What one probe saw. Leading axes: any `vmap`, then the rows of `length`.

  Attributes:
    hits: how many times the probe was passed through (a module applied twice, each
      example of a `vmap` inside the loss, each device of a `shard_map`: 2, B, D).
    forward: the activation, as it went forward.
    backward: its gradient, as it came back.
    headroom: how many more doublings of the loss scale the gradient takes before it
      overflows float16, `floor(log2(65504 / backward.max_abs))`, exact at binade
      resolution for float16 gradients; inf if all zero, -inf if not finite.
  """
  hits: jax.Array
  forward: TensorSummary
  backward: TensorSummary
  headroom: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Probes(Mapping):
  """Probe name -> `ProbeSummary`, in forward order; a pytree (names, lengths static).

  Each probe's measurements are sums over its hits, kept as two arrays (split into
  fields inside a jitted step, they would cost a copy each) and summarized on access.

  Attributes:
    names: the probe names, in the order the forward pass first reached them.
    lengths: each probe's number of rows (`length` given to `probe`), or None.
    encoded: per probe, float32 `[..., 6]`: the largest magnitude, zero and subnormal
      fractions of the activation, then of the gradient; and float32 `[..., 2, 256]`:
      for each, a one-hot of the largest magnitude's float32 exponent. Summed over
      hits, the one-hots count the hits and keep the largest maximum's binade on top.
  """
  names: tuple[str, ...] = dataclasses.field(metadata={"static": True})
  lengths: tuple[int | None, ...] = dataclasses.field(metadata={"static": True})
  encoded: tuple[tuple[jax.Array, jax.Array], ...]

  def __getitem__(self, name: str) -> ProbeSummary:
    values, binades = self.encoded[self.names.index(name)]
    hits = binades[..., 0, :].sum(-1)
    forward, backward = (_summarize(hits, values[..., 3 * i:3 * i + 3], binades[..., i, :])
                         for i in (0, 1))
    mantissa, exponent = jnp.frexp(backward.max_abs)  # max_abs = mantissa * 2**exponent
    doublings = 16 - exponent - (mantissa > FLOAT16_MAX / 2**16)
    return ProbeSummary(hits, forward, backward, jnp.where(
        backward.max_abs == 0, jnp.inf, jnp.where(backward.finite, doublings, -jnp.inf)))

  def __iter__(self) -> Iterator[str]:
    return iter(self.names)

  def __len__(self) -> int:
    return len(self.names)


def _summarize(hits, values, binades) -> TensorSummary:
  top = NUM_BINADES - 1 - jnp.argmax(binades[..., ::-1] > 0, axis=-1)
  # Binade 0 holds zero and float32 subnormals, below anything float16 holds.
  bottom = jnp.where(top == NUM_BINADES - 1, jnp.inf, jnp.ldexp(1.0, top - 127))
  bottom = jnp.where((hits > 0) & (top > 0), bottom, 0.0)
  mean = lambda total: jnp.where(hits > 0, total / jnp.maximum(hits, 1), 0.0)
  return TensorSummary(jnp.where(hits == 1, values[..., 0], bottom),
                       binades[..., NUM_BINADES - 1] == 0, mean(values[..., 1]),
                       mean(values[..., 2]))

# Part of jit's cache key: a jitted function inside the loss is traced again when
# measurement starts (tests/test_probes.py, inner jit).
_SESSION = jax.make_user_context(None)


@dataclasses.dataclass(frozen=True, eq=False)
class _Discovery:
  """First pass: records each probe's name and length, in forward order."""
  lengths: dict[str, int | None]
  # What probes returned (by id, kept alive): a tensor already probed is not probed again,
  # as a module's output that is its last submodule's.
  returned: dict = dataclasses.field(default_factory=dict, kw_only=True)

  def probe(self, x, name, index, length):
    del index
    if self.lengths.setdefault(name, length) != length:
      raise ValueError(f"probe {name!r} is used with length={length} and with "
                       f"length={self.lengths[name]}; one name, one length.")
    return x


@dataclasses.dataclass(frozen=True, eq=False)
class _Measurement:
  """Second pass: each probe measures into its stats input."""
  stats: Mapping[str, tuple[jax.Array, jax.Array]]
  returned: dict = dataclasses.field(default_factory=dict, kw_only=True)

  def probe(self, x, name, index, length):
    if name not in self.stats:
      raise ValueError(f"probe {name!r} was not reached when the function was first "
                       "traced; a function must reach the same probes on every trace.")
    row = lambda a: a if length is None else lax.dynamic_index_in_dim(a, index, 0, False)
    # Inside shard_map, made to vary like `x`: the transpose then psums the stats.
    return _measure(x, jax.tree.map(lambda a: _trees.varying_like(row(a), x), self.stats[name]))


def probe(x: jax.Array, name: str, *, index: Any = None, length: int | None = None):
  """The identity; measures `x` and its gradient under `value_and_grad_with_probes`.

  Outside it, returns `x` itself and adds nothing to the program. A name reached
  several times (a layer applied twice, a `vmap` or `scan` inside the loss) sums its
  hits; a tensor a probe already returned is not measured again under another name.
  For one row per layer of a `lax.scan`, pass the layer's index and count::

      def body(h, layer):
        i, w = layer
        return probe(jnp.tanh(h @ w), "block", index=i, length=num_layers), None

  Args:
    x: a floating-point array (others are returned as is, unmeasured).
    name: the probe's name; the key of its `ProbeSummary`.
    index: this hit's row, in `[0, length)`; rows are in forward order.
    length: the number of rows.

  Returns:
    `x`.
  """
  if index is not None and length is None:
    raise ValueError(f"probe {name!r}: index={index!r} needs length=, the number of rows.")
  if length is not None and (not isinstance(length, int) or length <= 0):
    raise ValueError(f"probe {name!r}: length={length!r} must be a positive int.")
  if isinstance(index, int) and not 0 <= index < length:
    raise ValueError(f"probe {name!r}: index={index} is not in [0, length={length}).")
  session = _SESSION.value
  if session is None or id(x) in session.returned or not jnp.issubdtype(
      jnp.result_type(x), jnp.floating):
    return x
  out = session.probe(x, name, index, length)
  session.returned.update({id(x): x, id(out): out})  # the same in both passes
  return out


def probing() -> bool:
  """Whether probes are found or measured now (in `value_and_grad_with_probes`)."""
  return _SESSION.value is not None


@jax.custom_vjp
def _measure(x, stats):
  del stats
  return x


_measure.defvjp(lambda x, stats: (x, x),  # the activation, measured with its gradient
                lambda x, g: (g, _measurements(x, g)))


@jax.jit  # traced once per shape, not once per probe
def _measurements(x: jax.Array, g: jax.Array) -> tuple[jax.Array, jax.Array]:
  """One hit's `Probes.encoded`: both tensors' statistics, one variadic reduction.

  Read as bit patterns: the magnitude's bits are an integer that orders like the
  magnitude (NaN above inf), and integer compares cost XLA:CPU half the float ones on
  this step, whose float16 arithmetic it emulates element by element (benchmarks/
  RESULTS.md, "Probes"). float32 subnormals count as the nonzero numbers they are.
  """
  operands, init = _bit_operands, _bit_init
  combine = lambda a, b: tuple(jnp.maximum(p, q) if i % 3 == 0 else p + q
                               for i, (p, q) in enumerate(zip(a, b, strict=True)))
  reduced = lax.reduce(operands(x) + operands(g), init(x) + init(g), combine,
                       tuple(range(x.ndim)))
  maxima = [_as_magnitude(reduced[i], x.dtype).astype(jnp.float32) for i in (0, 3)]
  fractions = [count.astype(jnp.float32) / x.size for count in reduced[1:3] + reduced[4:]]
  values = jnp.stack(maxima[:1] + fractions[:2] + maxima[1:] + fractions[2:])
  binade = lax.bitcast_convert_type(jnp.stack(maxima), jnp.int32) >> 23  # sign bit clear
  return values, jnp.where(jnp.arange(NUM_BINADES) == binade[:, None], 1.0, 0.0)


def _bits(dtype) -> jnp.dtype:
  return jnp.dtype(f"int{8 * jnp.dtype(dtype).itemsize}")


def _bit_operands(t):
  ints = _bits(t.dtype)
  bits = lax.bitcast_convert_type(t, ints) & jnp.iinfo(ints).max  # |t|'s bits
  normal = lax.bitcast_convert_type(jnp.asarray(FLOAT16_SMALLEST_NORMAL, t.dtype), ints)
  return bits, (bits == 0).astype(jnp.int32), ((bits != 0) & (bits < normal)).astype(jnp.int32)


def _bit_init(t):
  return jnp.zeros((), _bits(t.dtype)), jnp.int32(0), jnp.int32(0)


def _as_magnitude(reduced: jax.Array, dtype) -> jax.Array:
  """A reduced maximum as a magnitude of `dtype` (bits: NaN's become inf's)."""
  if reduced.dtype == dtype:
    return reduced
  inf = lax.bitcast_convert_type(jnp.asarray(jnp.inf, dtype), reduced.dtype)
  return lax.bitcast_convert_type(jnp.minimum(reduced, inf), dtype)


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
    stats = _discover(fun, args, kwargs)
    if not stats:
      value, grads = value_and_grad(fun, has_aux=has_aux, **extra)(*args, **kwargs)
      return value, grads, Probes((), (), ())
    first = (argnums if isinstance(argnums, int) else argnums[0]) % len(args)

    def measured(*packed, **kw):
      unpacked = list(packed)
      unpacked[first], stats = packed[first]
      with _SESSION(_Measurement(stats)):
        return fun(*unpacked, **kw)

    packed = list(args)
    packed[first] = (args[first], stats)
    value, grads = value_and_grad(measured, has_aux=has_aux, **extra)(*packed, **kwargs)
    (first_grads, cotangents), *rest = (grads,) if isinstance(argnums, int) else grads
    grads = first_grads if isinstance(argnums, int) else (first_grads, *rest)
    lengths = tuple(v.shape[0] if v.ndim == 2 else None for v, _ in stats.values())
    return value, grads, Probes(tuple(stats), lengths, tuple(map(cotangents.get, stats)))

  return value_grads_and_probes


def _discover(fun, args, kwargs) -> dict[str, tuple[jax.Array, jax.Array]]:
  """Zero stats inputs of the probes `fun(*args, **kwargs)` reaches, in forward order."""
  leaves, treedef = jax.tree.flatten((args, kwargs))
  is_array = [isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves]

  def traced(arrays):  # other leaves (functions, strings) are closed over
    merged = [a if array else leaf for a, array, leaf in zip(arrays, is_array, leaves,
                                                              strict=True)]
    a, k = jax.tree.unflatten(treedef, merged)
    fun(*a, **k)

  session = _Discovery({})
  with _SESSION(session):
    jax.eval_shape(traced, [leaf if array else None for leaf, array in zip(
        leaves, is_array, strict=True)])
  # Inside shard_map, each device's own: stats varying over the mesh, as under pmap.
  manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
  zeros = lambda *shape: lax.pcast(jnp.zeros(shape), manual, to="varying")
  rows = lambda n: () if n is None else (n,)
  return {name: (zeros(*rows(n), 6), zeros(*rows(n), 2, NUM_BINADES))
          for name, n in session.lengths.items()}


def all_reduce_probes(probes: Probes, axis_name: Any) -> Probes:
  """Probes summed over `axis_name`, as if one device had seen every hit.

  For probes taken inside `pmap` or `shard_map`, which are each device's own. (Taken
  outside a `shard_map` in the loss, they are summed over its devices already.)
  """
  return lax.psum(probes, axis_name)
