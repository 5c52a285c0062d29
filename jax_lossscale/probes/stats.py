"""What a probe measures of one tensor and its gradient, and how the sums over its hits
read back.

One hit is encoded in one float32 array that adds up over hits (as cotangents do): per
tensor, the largest magnitude, the zero and subnormal fractions, and a one-hot of the
largest magnitude's float32 exponent, which counts the hits and keeps the top binade.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FLOAT16_MAX = 65504.0
FLOAT16_SMALLEST_NORMAL = 2.0**-14
NUM_BINADES = 256  # float32's biased exponents; 255 holds inf (and NaN, taken as inf)
VALUES = 3  # an encoded row's leading columns: the largest magnitude, zero and subnormal
WIDTH = VALUES + NUM_BINADES  # fractions; then the one-hot of the largest's binade


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


def summary(encoded: jax.Array, size: int | None = None) -> ProbeSummary:
  """A probe's `ProbeSummary` from its encoded sums over hits (`Probes.encoded`) and
  its elements per hit (`Probes.sizes`; None: the sums are of fractions)."""
  return _summary(encoded, np.float32(1 if size is None else max(size, 1)))  # 0 of nothing


# Read eagerly, each operation would compile its own program; jitted, one program per
# shape of `encoded`. The size is an argument, not part of the program: every probe of
# one shape, whatever its tensor's size, is read by the same program.
@jax.jit
def _summary(encoded: jax.Array, size: jax.Array) -> ProbeSummary:
  hits = encoded[..., 0, VALUES:].sum(-1)
  forward, backward = (_summarize(hits, encoded[..., i, :VALUES], encoded[..., i, VALUES:],
                                  size) for i in (0, 1))
  mantissa, exponent = jnp.frexp(backward.max_abs)  # max_abs = mantissa * 2**exponent
  doublings = 16 - exponent - (mantissa > FLOAT16_MAX / 2**16)
  return ProbeSummary(hits, forward, backward, jnp.where(
      backward.max_abs == 0, jnp.inf, jnp.where(backward.finite, doublings, -jnp.inf)))


def largest_gradient(encoded: Sequence[jax.Array]) -> jax.Array:
  """The largest activation gradient in probes' sums over hits (`Probes.encoded`), 0 if
  none: exact for a probe (or row) hit once, else the top of its binade (a bound).

  One computation over every probe, so that a step deciding from them compiles a few
  small kernels, not a few per probe.
  """
  rows = jnp.concatenate([e.reshape(-1, 2, WIDTH) for e in encoded])[:, 1]
  binades = rows[:, VALUES:]
  column = lax.broadcasted_iota(jnp.int32, binades.shape, 1)
  hits, top = lax.reduce((binades, jnp.where(binades > 0, column, 0)),
                         (np.float32(0), np.int32(0)), _hits_and_top, (1,))
  bound = 2 * _power_of_two(top)
  return jnp.max(jnp.where(hits == 1, rows[:, 0], bound))


def _hits_and_top(a, b):
  return lax.add(a[0], b[0]), lax.max(a[1], b[1])


def _summarize(hits, values, binades, size) -> TensorSummary:
  per_hit = jnp.maximum(hits, 1) * size
  mean = lambda total: jnp.where(hits > 0, total / per_hit, 0.0)
  return TensorSummary(jnp.where(hits == 1, values[..., 0], _binade_bottom(binades)),
                       binades[..., NUM_BINADES - 1] == 0, mean(values[..., 1]),
                       mean(values[..., 2]))


def _binade_bottom(binades):
  """The power of two at the bottom of the top binade hit: inf for inf, 0 for none.

  The top binade's index is float32's biased exponent, so its bits shifted into place
  are that power of two (255 gives inf; 0, zero and float32 subnormals, gives 0).
  """
  column = lax.broadcasted_iota(jnp.int32, binades.shape, binades.ndim - 1)
  return _power_of_two(jnp.max(jnp.where(binades > 0, column, 0), axis=-1))


def _power_of_two(binade):
  """The power of two at the bottom of float32's binade `binade` (a biased exponent)."""
  return lax.bitcast_convert_type(binade << 23, jnp.float32)


@functools.partial(jax.jit, static_argnums=1)  # traced once per shape, not once per probe
def values(t: jax.Array, fractions: bool) -> jax.Array:
  """float32 `[VALUES]` of one tensor, read once: its largest magnitude, its zero and
  subnormal counts (as fractions of its size if `fractions`)."""
  return jnp.stack(_reduced(t, fractions))


def _reduced(t: jax.Array, fractions: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """`values(t, fractions)`, unstacked.

  Read as bit patterns: the magnitude's bits are an integer that orders like the
  magnitude (NaN above inf), and integer compares cost XLA:CPU half the float ones on
  this step, whose float16 arithmetic it emulates element by element (benchmarks/
  RESULTS.md, "Probes"). float32 subnormals count as the nonzero numbers they are.

  A large tensor is reduced in rows, then over the rows' partial results (`_kept_axes`):
  XLA:CPU runs a reduction to rows on all its threads, a reduction to one value on one.
  """
  # A gradient known when compiling (the loss a sum of the probed tensor) would otherwise
  # be reduced by XLA's constant folding, element by element, at compile time.
  t = lax.optimization_barrier(t)
  if jnp.dtype(t.dtype).itemsize == 1:
    # 8-bit floats read as float16 (which holds each exactly, e8m0's powers of two as
    # float32): float16's smallest normal is 0 in e4m3, and e4m3fnuz's NaN is the bits
    # of a negative zero, which the sign's mask made a zero.
    wide = jnp.float32 if jnp.finfo(t.dtype).max > jnp.finfo(jnp.float16).max else jnp.float16
    t = t.astype(wide)
  kept, operands = _kept_axes(t.shape), bit_operands(t)
  in_rows = t.size > COUNT_LIMIT  # the whole's int32 counts would wrap: rows' summed in float32
  if in_rows:
    kept = _rows_counted_exactly(t.shape)
  if kept:
    operands = lax.reduce(operands, _bit_init(t), _combine, tuple(range(kept, t.ndim)))
  if in_rows:
    bits, zeros, below_normal = operands
    largest = lax.reduce(bits, _bit_init(t)[0], lax.max, tuple(range(kept)))
    zeros, below_normal = (jnp.sum(c.astype(jnp.float32)) for c in (zeros, below_normal))
  else:
    largest, zeros, below_normal = lax.reduce(operands, _bit_init(t), _combine,
                                              tuple(range(kept or t.ndim)))
  count = lambda c: c.astype(jnp.float32) / (np.float32(max(t.size, 1)) if fractions else 1)
  largest = as_magnitude(largest, t.dtype)
  if jnp.dtype(t.dtype).itemsize > 4:  # float64 (x64): a finite maximum is float32's at most
    largest = jnp.where(jnp.isfinite(largest), jnp.minimum(largest, jnp.finfo(jnp.float32).max),
                        largest)
  return largest.astype(jnp.float32), count(zeros), count(below_normal - zeros)


# A tensor is reduced in rows from this size on: a reduction on all threads, then one of
# the rows' partials, compile to two kernels, not one (benchmarks/RESULTS.md, "Probes").
SPLIT_SIZE = 2**22
ROWS = 16  # at least: enough rows for a CPU's threads
ROW_LENGTH = 64  # at least: so the partial results are a small part of what is read


# The largest count an int32 holds: a tensor of more elements is counted in rows of at
# most this many, the rows' counts summed in float32 (the counts are float32 in the end).
COUNT_LIMIT = 2**31 - 1


def _rows_counted_exactly(shape: tuple[int, ...]) -> int:
  """The fewest leading axes (one at least) that `shape`'s rows of at most `COUNT_LIMIT`
  elements each need; a tensor whose last axis alone is longer is refused."""
  for kept in range(1, len(shape)):
    if math.prod(shape[kept:]) <= COUNT_LIMIT:
      return kept
  raise ValueError(f"a probed tensor of shape {shape} has more than {COUNT_LIMIT} elements "
                   "along its last axis: its counts cannot be taken in rows of int32 counts; "
                   "probe a reshaped tensor.")


def _kept_axes(shape: tuple[int, ...]) -> int:
  """How many leading axes the first of a tensor's two reductions keeps: the fewest
  holding `ROWS` rows (all but the last, at most); 0 for one reduction of the whole (a
  tensor below `SPLIT_SIZE`, one row, or rows shorter than `ROW_LENGTH`).

  Rows of the tensor's own axes, not of its flattened elements as `_finite` splits the
  parameter gradients: a probed tensor is mostly computed inside the reducing kernel,
  and a reshape across its axes made that kernel index every element (two flattened
  halves: 6.9% of the step where one reduction took 3.1%; benchmarks/RESULTS.md,
  "Probes")."""
  kept = 0
  while kept < len(shape) - 1 and math.prod(shape[:kept]) < ROWS:
    kept += 1
  rows, length = math.prod(shape[:kept]), math.prod(shape[kept:])
  return kept if rows * length >= SPLIT_SIZE and rows > 1 and length >= ROW_LENGTH else 0


def _combine(a, b):  # one function, so that lax traces it once per dtype
  return lax.max(a[0], b[0]), lax.add(a[1], b[1]), lax.add(a[2], b[2])


@functools.partial(jax.jit, static_argnums=2)  # traced once per shape, not once per probe
def measurements(forward: jax.Array, g: jax.Array, fractions: bool) -> jax.Array:
  """One hit's `Probes.encoded`: the activation's `values` (taken on the way forward, so
  the activation itself is not kept for the backward pass), then its gradient's, each
  followed by the one-hot of its largest magnitude's binade.

  Concatenated, with no mask and no size in it: XLA compiles one kernel for the
  encodings of all probes alike in dtype and rows, whatever their size (columns chosen
  by masks and fractions divided by sizes made a kernel per size, and the masks were
  hoisted out of loops as kernels of their own).
  """
  binades = lax.iota(jnp.int32, NUM_BINADES)
  top = lambda row: lax.bitcast_convert_type(row[0], jnp.int32) >> 23  # sign bit clear
  rows = (forward, jnp.stack(_reduced(g, fractions)))
  return jnp.concatenate([part for row in rows for part in (
      row, (binades == top(row)).astype(jnp.float32))]).reshape(2, WIDTH)


@functools.partial(jax.jit, static_argnums=2)  # traced once per length
def in_row(measured: jax.Array, index: jax.Array, length: int) -> jax.Array:
  """`measured` in row `index` of `length` rows, zeros elsewhere (everywhere if `index`
  is outside `[0, length)`)."""
  rows = lax.broadcasted_iota(jnp.int32, (length, *measured.shape), 0)
  return jnp.where(rows == index, measured, 0.0)


def _bits(dtype) -> jnp.dtype:
  return jnp.dtype(f"int{8 * jnp.dtype(dtype).itemsize}")


def bit_operands(t):
  """`|t|`'s bit patterns, and int32 flags of its zeros and of its values below float16's
  smallest normal, zeros among them (the subnormals are the difference of the sums: one
  compare less per element). (The same in `lax` calls, with the constants broadcast to
  `t`'s shape, traced faster but made XLA split the step's kernels differently: 10.8%
  more bytes, not 5.1%.)"""
  ints = _bits(t.dtype)
  bits = lax.bitcast_convert_type(t, ints) & jnp.iinfo(ints).max
  normal = np.asarray(FLOAT16_SMALLEST_NORMAL, t.dtype).view(ints)
  return bits, (bits == 0).astype(jnp.int32), (bits < normal).astype(jnp.int32)


def _bit_init(t):
  return np.zeros((), _bits(t.dtype)), np.int32(0), np.int32(0)


def as_magnitude(reduced: jax.Array, dtype) -> jax.Array:
  """A reduced maximum as a magnitude of `dtype` (bits: NaN's become inf's)."""
  if reduced.dtype == dtype:
    return reduced
  inf = lax.bitcast_convert_type(jnp.asarray(jnp.inf, dtype), reduced.dtype)
  return lax.bitcast_convert_type(jnp.minimum(reduced, inf), dtype)
