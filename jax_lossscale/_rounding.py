"""Writing values narrower than float32: the parameters `apply_gradients` writes and the
inner optimizer state kept in `state_dtype`, rounded to nearest, stochastically, or with
a compensation buffer (Kahan summation).

Stochastic rounding's bits are a hash, not a `jax.random` stream: of a counter in the state
(advanced by applied steps only, so a skipped step leaves it as it was), of the leaf, of
the entry's position in the array the step sees, of the bits of the entry's exact new value
and, inside `shard_map`, of the device's index along the axes the parameter varies over.
Replicas of a replicated parameter (equal values at equal positions, varying over no axis)
draw equal bits. Shards of a sharded one draw other bits: under `jit` their positions
differ, under `shard_map` their axis index, under `pmap` (where nothing says which arrays
are sharded) their values. A few integer operations per entry, fused into the write
(benchmarks/bf16_writes.py).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import _numerics
from jax_lossscale import _policy
from jax_lossscale import _trees

ROUNDINGS = ("nearest", "stochastic", "compensated")
# Salts of the two kinds of leaves written, so a moment and a parameter at the same leaf
# index draw different bits.
_PARAMS, _STATE = 0x5A17, 0x0C7E
_SEEDS_PER_KERNEL = 64  # fewer kernels to compile against larger ones (`seeds`)


def check_rounding(rounding: Any) -> str:
  if not isinstance(rounding, str) or rounding not in ROUNDINGS:
    raise ValueError(f"`rounding` must be one of {', '.join(map(repr, ROUNDINGS))}, got "
                     f"{rounding!r}.")
  return rounding


def check_state_dtype(state_dtype: Any) -> np.dtype | None:
  if state_dtype is None:
    return None
  try:  # read as every dtype argument is: "bf16" is bfloat16, "f16" not NumPy's float128
    dtype = _policy.as_dtype(state_dtype, "state_dtype")
  except ValueError:
    try:
      shown = _policy.as_any_dtype(state_dtype, "state_dtype").name  # int32, not its class
    except ValueError:
      shown = repr(state_dtype)
    raise ValueError("`state_dtype` must be a floating dtype such as jnp.bfloat16 or "
                     "'bf16' (or None to keep the inner optimizer's dtypes), got "
                     f"{shown}.") from None
  if _numerics.has_short_range(dtype):
    raise ValueError(
        "`state_dtype` must have float32's exponent range (jnp.bfloat16, jnp.float32 or "
        f"jnp.float64), got {dtype.name}: {_SHORT_RANGE_STATE}")
  if dtype.itemsize > 4 and not jax.config.jax_enable_x64:
    raise ValueError(
        f"`state_dtype` {dtype.name} needs `jax.config.update('jax_enable_x64', True)`: "
        "with jax_enable_x64 off JAX keeps float32 arrays. Pass jnp.float32 or "
        "jnp.bfloat16, or turn x64 on before building the optimizer.")
  return dtype


# Why optimizer state is never kept in float16 or float8 by this module's writes.
_SHORT_RANGE_STATE = (
    "an optimizer's second moment holds squared gradients, which float16 flushes to zero "
    "below about 2.4e-4 and overflows above 256, float8 sooner (Adam's step then silently "
    "grows about 20x, or the parameter stops moving).")


def check_state_kept(inner_state: Any, rounding: str, state_dtype: np.dtype | None,
                     params: Any = None) -> None:
  """Refuses an inner state of float16 or float8 arrays (the moments of float16
  parameters, 0-d ones included, see `_kept`) where this module would write it: with a
  `rounding` other than "nearest" and no `state_dtype`. Computed in float32 and written
  back, such a moment would fail silently where optax's own float16 arithmetic fails
  loudly (every step skipped)."""
  if rounding == "nearest" or state_dtype is not None:
    return
  moments = scalar_moments(inner_state, params)
  short = sorted({x.dtype.name for path, x in jax.tree_util.tree_leaves_with_path(inner_state)
                  if _kept(path, x, moments) and _numerics.has_short_range(x.dtype)})
  if short:
    raise ValueError(
        f"loss_scaling(..., rounding={rounding!r}): the inner optimizer keeps "
        f"{' and '.join(short)} state (the moments of parameters of that dtype), which "
        f"this rounding would write back in it: {_SHORT_RANGE_STATE} Pass "
        "`state_dtype=jnp.bfloat16` (or jnp.float32) to keep it in a dtype with float32's "
        "range.")


def is_narrow(x: Any) -> bool:
  """Whether `x` is a floating array narrower than float32."""
  return _trees.is_float(x) and _numerics.is_narrow(jnp.result_type(x))


def compensation_buffers(arrays: Any) -> Any:
  """Zeros of each narrow parameter's dtype and shape, `None` for every other leaf."""
  return jax.tree.map(lambda p: jnp.zeros_like(p) if is_narrow(p) else None, arrays,
                      is_leaf=lambda x: x is None)


def write_params(params: Any, updates: Any, rounding: str, compensation: Any,
                 counter: jax.Array | None, in_place: bool = False) -> tuple[Any, Any]:
  """`(new_params, new_compensation)`: `params + updates`, each narrow parameter rounded
  as `rounding` says (`compensation`: the buffers, or None), other leaves as
  `optax.apply_updates` gives them.

  `in_place`: the form whose results replace the donated inputs on CPU. There a
  compensated leaf's new parameter and buffer come out of one loop (`in_one_loop`), and
  the leaves are written one after another (`after`), so that one leaf's outputs at a
  time wait to be copied over the old ones; with jax 0.10.2 a stochastic leaf's too (see
  `stochastic`). Elsewhere XLA fuses the sum into both writes.
  """
  if rounding == "nearest":
    return _trees.apply_updates(params, updates), compensation
  leaves, treedef = jax.tree.flatten(params, is_leaf=lambda x: x is None)
  update_leaves = treedef.flatten_up_to(updates)
  buffers = (treedef.flatten_up_to(compensation) if compensation is not None
             else [None] * len(leaves))
  new, new_buffers, previous = [], [], ()
  leaf_seeds = seeds(counter, _PARAMS, len(leaves)) if rounding == "stochastic" else None
  for index, (p, u, c) in enumerate(zip(leaves, update_leaves, buffers, strict=True)):
    if u is None or not is_narrow(p) or jnp.result_type(u) == jax.dtypes.float0:
      new.append(_trees.apply_updates(p, u))
      new_buffers.append(c)
      continue
    if rounding == "compensated":  # the buffer holds what the last write rounded away
      if in_place and previous:  # one leaf's writes at a time: after the last leaf's
        p, c = after(previous, (p, c))
      exact = p.astype(jnp.float32) + (u.astype(jnp.float32) + c.astype(jnp.float32))
      written, wide = to_nearest(exact, p.dtype)
      # An inf written (a -inf entry of a logit bias) leaves nothing behind: inf - inf is NaN.
      residual = jnp.where(jnp.isfinite(wide), exact - wide, 0).astype(c.dtype)
      if in_place and jnp.finfo(p.dtype).bits == 8 * p.dtype.itemsize:  # not float4's
        written, residual = in_one_loop(written, residual)
      new_buffers.append(residual)
      previous = (written, residual)
    else:
      if in_place and previous and not _jax_internals.BARRIERS_ORDER_IN_PLACE_WRITES:
        p = after(previous, p)
      exact = p.astype(jnp.float32) + u.astype(jnp.float32)
      written = stochastic(exact, p, leaf_seeds[index], read_after=in_place)
      new_buffers.append(c)
      previous = (written,)
    new.append(written)
  compensation = None if compensation is None else treedef.unflatten(new_buffers)
  return treedef.unflatten(new), compensation


def load(grads: Any, inner_state: Any, state_dtype: np.dtype | None,
         rounding: str) -> tuple[Any, Any]:
  """`(grads, inner_state)` as the optimizer computes with them: with a `state_dtype` or a
  rounding other than `"nearest"`, their arrays narrower than float32 widened to float32.
  Else optax would compute bfloat16 moments in bfloat16 (where Adam's 0.999 is 1.0) and
  take a bfloat16 gradient's `(1 - b1) * g` and `g * g` in bfloat16 (a relative error of up
  to 2**-9 in each moment's increment); XLA would also keep `g * g` as a bfloat16 array
  between the loops that read it. Scalars too: a 0-d parameter's moments (a learned
  temperature) are moments. `grads` may be any tree the optimizer reads beside its state
  (the step passes the gradients, the parameters and a line search's `grad=`): widened
  alike, so that what it computes from them agrees in dtype."""
  if state_dtype is None and rounding == "nearest":
    return grads, inner_state
  widened = lambda tree: jax.tree.map(
      lambda x: x.astype(jnp.float32) if _trees.is_array(x) and is_narrow(x) else x, tree)
  return widened(grads), widened(inner_state)


def store_state(inner_state: Any, like: Any, state_dtype: np.dtype | None, rounding: str,
                counter: jax.Array | None, params: Any = None) -> Any:
  """The inner state as it is kept: its real floating arrays of one dimension or more
  (moments, momentum, accumulated gradients) in `state_dtype`, or, without one, in the
  dtypes of `like` (the state before the step) where those are narrower than float32.
  Written stochastically wherever there is a `counter` (every `rounding` but a plain
  "nearest" with no `state_dtype`), whatever the parameters' `rounding`: a compensation
  buffer for the state would cost what wider moments cost, and to nearest a slow moving
  average would stop moving.

  `like=None`: `init`'s state, written to nearest. There the moments of `params`' 0-d
  arrays (a learned temperature) are told from other scalars and kept in `state_dtype`
  too (without `params`, float16 and float8 scalars are: see `_kept`). Every other
  scalar (an injected hyperparameter, a line search's step size) and complex arrays keep
  their dtype; at every step, each scalar keeps the dtype `init` gave it, computed in
  float32 where narrow."""
  if state_dtype is None and (rounding == "nearest" or like is None):
    return inner_state
  # Written to nearest, a moment kept in bfloat16 never moves by less than half a spacing:
  # Adam's nu (b2=0.999, a relative change of 0.001 < 2**-9) would never decay. Every
  # narrow write is stochastic where the state has a counter.
  paths, treedef = jax.tree_util.tree_flatten_with_path(inner_state)
  olds = [None] * len(paths) if like is None else treedef.flatten_up_to(like)
  moments = scalar_moments(inner_state, params) if like is None else set()
  stored = []
  leaf_seeds = None if counter is None else seeds(counter, _STATE, len(paths))
  for index, ((path, x), old) in enumerate(zip(paths, olds, strict=True)):
    if old is not None and _trees.is_array(x) and x.ndim == 0:  # the dtype `init` chose
      dtype = old.dtype if _trees.is_array(old) and _trees.is_float(old) else None
    elif _kept(path, x, moments):
      dtype = state_dtype if state_dtype is not None else (
          old.dtype if old is not None and is_narrow(old) else None)
    else:
      dtype = None
    if _trees.is_array(x) and _trees.is_float(x) and dtype is not None and x.dtype != dtype:
      if counter is not None and _numerics.is_narrow(dtype):
        x = stochastic(x.astype(jnp.float32), x if old is None else old, leaf_seeds[index],
                       dtype)
      else:
        x = x.astype(dtype)
    stored.append(x)
  return treedef.unflatten(stored)


def scalar_moments(inner_state: Any, params: Any) -> set[str] | None:
  """The key paths (`jax.tree_util.keystr`) in `inner_state` of the moments of `params`'
  0-d real floating arrays: in each subtree of `inner_state` whose every leaf sits where
  one of the arrays does (Adam's `mu` and `nu`, momentum's `trace`; `optax.masked`'s
  and `multi_transform`'s, where masked-out places hold no leaf; adafactor's `v`, whose
  factored places hold other shapes), the leaves at the 0-d arrays' places, outside
  injected hyperparameters. None where it cannot tell: without `params`, or for a bare
  0-d array (whose place is everywhere)."""
  if params is None or (_trees.is_array(params) and jnp.ndim(params) == 0):
    return None
  arrays = jax.tree_util.tree_leaves_with_path(_trees.partition(params)[0])
  places = {jax.tree_util.keystr(path) for path, _ in arrays}
  scalars = {jax.tree_util.keystr(path) for path, p in arrays
             if jnp.ndim(p) == 0 and jnp.issubdtype(p.dtype, jnp.floating)}
  if not scalars:
    return set()

  matched = {}  # id of each subtree at the arrays' places: its leaves at the 0-d places

  def at_places(node):
    found = jax.tree_util.tree_leaves_with_path(node)
    keys = [jax.tree_util.keystr(path) for path, _ in found]
    if not found or not all(key in places for key in keys):
      return False
    matched[id(node)] = [place for place, (_, x) in zip(keys, found, strict=True)
                         if place in scalars and jnp.ndim(x) == 0]
    return True

  moments = set()
  for path, node in jax.tree_util.tree_flatten_with_path(inner_state, is_leaf=at_places)[0]:
    if id(node) in matched and jax.tree_util.GetAttrKey("hyperparams") not in path:
      moments.update(jax.tree_util.keystr(path) + place for place in matched[id(node)])
  return moments


def _kept(path: tuple[Any, ...], x: Any, moments: set[str] | None) -> bool:
  """Whether the state's leaf `x` at `path` is kept in `state_dtype`: a real floating
  array of one dimension or more, or a moment of a 0-d parameter (at one of `moments`).
  Where `scalar_moments` cannot tell (`moments=None`, `wrap_state` without the
  parameters), every float16 or float8 scalar outside injected hyperparameters, moment
  or not, which a moment's own dtype would not hold."""
  if not _trees.is_array(x) or not jnp.issubdtype(x.dtype, jnp.floating):
    return False
  if jnp.ndim(x) >= 1:
    return True
  if moments is None:
    return (_numerics.has_short_range(x.dtype)
            and jax.tree_util.GetAttrKey("hyperparams") not in path)
  return jax.tree_util.keystr(path) in moments


def stochastic(exact: jax.Array, old: jax.Array, seed: jax.Array, dtype: Any = None,
               read_after: bool = False) -> jax.Array:
  """`exact` (float32) in `dtype` (by default `old`'s, the value it replaces), rounded up
  or down with probability proportional to the distance, independently per entry: its
  expected value is `exact`. `seed`: the leaf's, one of `seeds`.

  `read_after`: the result is one of the `arrays` that `after` orders other writes after.
  A bfloat16 result is taken as float32's upper half, by integer operations, where XLA:CPU
  would otherwise round it a second time in a convert (a fifth of the time of a step
  written stochastically, at 10**7 entries on a 2-core CPU). Where `after` is a data
  dependency (jax 0.10.2) it reads the result's first entry, and XLA would recompute that
  entry from the inputs (the integer operations are cheap), leaving the writes it orders
  unordered: there the result comes out of `in_one_loop`, whose loop XLA computes once,
  and waits in a temporary of its size to be copied over the old parameter (so
  `write_params` writes such leaves one after another).
  """
  dtype = old.dtype if dtype is None else dtype
  for axis in sorted(_jax_internals.varying_axes(jax.typeof(old)), key=str):
    seed = _mix(seed ^ jax.lax.axis_index(axis).astype(jnp.uint32))  # this shard's bits
  value_bits = jax.lax.bitcast_convert_type(exact, jnp.uint32)
  # The position times an odd multiplier of the seed's, not plus the seed alone: else
  # every leaf at every step would read a window of one sequence, `_mix(0 .. 2**32)`, and
  # two windows that overlap (seeds closer than the leaves' sizes) would draw the same
  # bits, shifted. Then a bijection of uniform bits: still uniform, and other where the
  # values differ.
  bits = _mix(_positions(exact.shape) * (seed | np.uint32(1)) + seed) ^ value_bits
  if jnp.dtype(dtype) == jnp.bfloat16:
    # bfloat16 is float32's upper half: 16 random bits added below it, then cut off,
    # carry into it with probability equal to the distance to the next bfloat16.
    raised = value_bits + (bits >> 16)
    # Above the largest bfloat16 the next one up is inf: a finite value there is rounded
    # to nearest, inf only at or past the half-way point (as float16's writes and the
    # convert do), never by chance.
    magnitude = value_bits & np.uint32(0x7FFFFFFF)
    past = (magnitude > np.uint32(0x7F7F0000)) & (magnitude < np.uint32(0x7F800000))
    raised = jnp.where(past, _carried_to_nearest(value_bits), raised)
    # A NaN stays one: a carry out of its mantissa would make it ±0, and a mantissa that
    # lies in the lower half alone would be cut off, making it ±inf.
    raised = jnp.where(jnp.isnan(exact), np.uint32(0x7FC00000), raised)
    out = jax.lax.bitcast_convert_type((raised >> 16).astype(jnp.uint16), jnp.bfloat16)
    if read_after and not _jax_internals.BARRIERS_ORDER_IN_PLACE_WRITES:
      return in_one_loop(out)[0]
    return out
  near = exact.astype(dtype)
  # The neighbour on `exact`'s side: toward ±inf, or ±max where `dtype` has no inf
  # (float8_e4m3fn's inf would be NaN, and every entry would stay `near`).
  has_inf = np.isinf(np.array(np.inf).astype(dtype).astype(np.float32))
  limit = np.inf if has_inf else float(jnp.finfo(dtype).max)
  toward = jnp.where(near.astype(jnp.float32) < exact, limit, -limit).astype(dtype)
  other = jnp.nextafter(near, toward)
  distance = (exact - near.astype(jnp.float32)) / (other.astype(jnp.float32)
                                                   - near.astype(jnp.float32))
  uniform = (bits >> 8).astype(jnp.float32) * np.float32(2.0**-24)
  return jnp.where(uniform < distance, other, near)


def after(arrays: Any, values: Any) -> Any:
  """`values`, computed after `arrays`: it orders loops that XLA could run in either
  order, so that a loop that reads old values runs before the loop that writes over them
  in place. What the state's stochastic writes hash (the counter) is computed after the
  parameters' writes, which read the old moments too; a compensated leaf's parameter and
  buffer after the last leaf's writes.

  With jax 0.12 by a `lax.optimization_barrier`. jax 0.10.2's XLA copies the buffers
  that pass a barrier, so there by a data dependency that XLA does not see through: each
  value is replaced by zeros where the first entry of one of `arrays` is NaN and infinite
  at once, which no real number is. Each value reads only the arrays that vary over no
  `shard_map` axis it does not vary over (else it would vary over theirs), and none that
  an explicit mesh shards (whose entry JAX would not slice): a value with none to read
  is returned as it is, and the loops are left in XLA's order, the writes copied.
  """
  if _jax_internals.BARRIERS_ORDER_IN_PLACE_WRITES:
    return jax.lax.optimization_barrier((arrays, values))[1]
  firsts = [(jnp.ravel(x)[0], _jax_internals.varying_axes(jax.typeof(x)))
            for x in jax.tree.leaves(arrays)
            if _trees.is_array(x) and jnp.issubdtype(jnp.result_type(x), jnp.floating)
            and jnp.size(x) and not _finite.explicitly_sharded(x)]

  def ordered(value):
    axes = _jax_internals.varying_axes(jax.typeof(value))
    read = [x for x, varying in firsts if varying <= axes]
    if not read:
      return value
    never = functools.reduce(jnp.logical_or, [jnp.isnan(x) & jnp.isinf(x) for x in read])
    return jnp.where(never, jnp.zeros_like(value), value)

  return jax.tree.map(ordered, values)


def in_one_loop(*arrays: jax.Array) -> tuple[jax.Array, ...]:
  """`arrays` (of one shape), computed by one loop.

  XLA:CPU gives a loop one output and computes no divide twice. A compensated leaf's new
  parameter and buffer, both computed from one float32 sum of the optimizer's update (a
  divide for Adam), would take a loop that writes the sum out and two that read it back:
  12 bytes per entry beside the writes. A variadic reduction is the one loop with several
  outputs, so each array's bits are reduced by OR with zeros over a new axis of two (over
  one element XLA would make it a slice), an identity: the arrays come out of the loop
  that computes the sum, and are copied over the donated inputs they replace, 8 bytes per
  entry for two bfloat16 arrays. Their bits, not their values: XLA:CPU widens a bfloat16
  reduction to float32.
  """
  bits = [jax.lax.bitcast_convert_type(x, _unsigned(x.dtype)) for x in arrays]
  padded = tuple(jnp.stack([b, jnp.zeros_like(b)], axis=-1) for b in bits)
  zeros = tuple(np.zeros((), b.dtype) for b in bits)
  either = lambda xs, ys: tuple(map(jnp.bitwise_or, xs, ys))
  reduced = jax.lax.reduce(padded, zeros, either, (arrays[0].ndim,))
  return tuple(jax.lax.bitcast_convert_type(r, x.dtype) for r, x in zip(reduced, arrays,
                                                                        strict=True))


def _unsigned(dtype: Any) -> np.dtype:
  return np.dtype(f"uint{8 * jnp.dtype(dtype).itemsize}")


def seeds(counter: jax.Array, salt: int, count: int) -> list[jax.Array]:
  """`count` uint32 seeds, one per leaf, from the step's rounding counter and `salt` (the
  kind of leaves written).

  Each seed is an array of its own, one output of a variadic reduction that computes up
  to `_SEEDS_PER_KERNEL` of them, and a leaf's write reads it as an operand. Computed
  inside the write, or sliced there out of one array of seeds, it would put the leaf's
  index in the write's loop as a constant. XLA compiles each distinct loop apart (on CPU
  10 to 20 ms each) and equal loops once, so the writes of leaves of one shape compile
  once: 300 bfloat16 leaves of 16x16 written stochastically took 49 s to compile
  with the index in the loop, 14 s without (`benchmarks/bf16_writes.py --params 76800
  --leaves 300`). The reduction's operands are two words each: XLA turns a reduction of a
  single element into a slice.
  """
  base = _mix(jnp.asarray(counter, jnp.uint32) ^ np.uint32(salt))
  out: list[jax.Array] = []
  for start in range(0, count, _SEEDS_PER_KERNEL):
    size = min(_SEEDS_PER_KERNEL, count - start)
    words = _mix(base + jnp.arange(2 * start, 2 * (start + size), dtype=jnp.uint32))
    pairs = tuple(words[2 * i:2 * i + 2] for i in range(size))
    xor = lambda a, b: tuple(map(jnp.bitwise_xor, a, b))
    out += jax.lax.reduce(pairs, (np.uint32(0),) * size, xor, (0,))
  return out


def to_nearest(exact: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
  """`(rounded, wide)`: `exact` (float32) rounded to the nearest `dtype` value (ties to
  even, as `exact.astype(dtype)`), and that value in float32.

  For bfloat16 by integer operations on float32's bits: XLA:CPU counts a float32 to
  bfloat16 convert as expensive and computes no expensive value in two loops, so with a
  convert the parameter and its compensation buffer (both functions of one float32 sum)
  would share a float32 temporary of the parameter's size, written and read back at
  every step (benchmarks/bf16_writes.py). Other dtypes take the convert.
  """
  if jnp.dtype(dtype) != jnp.bfloat16:
    rounded = exact.astype(dtype)
    return rounded, rounded.astype(jnp.float32)
  bits = jax.lax.bitcast_convert_type(exact, jnp.uint32)
  upper = _carried_to_nearest(bits) & np.uint32(0xFFFF0000)
  upper = jnp.where(jnp.isnan(exact), np.uint32(0x7FC00000), upper)  # a NaN stays one
  rounded = jax.lax.bitcast_convert_type((upper >> 16).astype(jnp.uint16), jnp.bfloat16)
  return rounded, jax.lax.bitcast_convert_type(upper, jnp.float32)


def _carried_to_nearest(bits: jax.Array) -> jax.Array:
  """float32 `bits` plus half a bfloat16 spacing less one, plus the kept part's last bit:
  the upper half carries exactly where rounding to the nearest bfloat16, ties to even,
  rounds up (the carry from the largest finite value makes inf, as the convert does)."""
  return bits + (np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1)))


def _positions(shape: tuple[int, ...]) -> jax.Array:
  """Each entry's row-major index in an array of `shape`, uint32 (modulo 2**32)."""
  index = jnp.zeros(shape, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    iota = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    index = index + iota * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return index


def _mix(x: jax.Array) -> jax.Array:
  """A 32-bit integer hash (lowbias32, C. Wellons' hash-prospector): every output bit
  depends on every input bit."""
  x = jnp.asarray(x, jnp.uint32)
  x = x ^ (x >> 16)
  x = x * np.uint32(0x7FEB352D)
  x = x ^ (x >> 15)
  x = x * np.uint32(0x846CA68B)
  return x ^ (x >> 16)
