"""The forward order of probes' rows, read from the first pass's program.

The first pass marks each hit with an `optimization_barrier` holding `MARK + its number`
(and its row index, when traced). A row given as a loop's index belongs to the loop the
index comes from: found by following the index back through the program to a loop's
carry or sliced inputs (a layer's index, not a recurrence scanned inside the layer).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np
from jax import lax

from jax_lossscale import _jax_internals as _jax

MARK = 1 << 30  # a hit's marker: MARK + its number


def marked(x: Any, hit: int, index: Any) -> Any:
  """`x`, marked in the program as hit number `hit` (with its traced row index)."""
  traced = _jax.is_tracer(index)
  return lax.optimization_barrier((x, np.int32(MARK + hit), *([index] if traced else [])))[0]


def loops(jaxpr: _jax.Program) -> dict[int, tuple[int, bool] | None]:
  """Hit -> the loop, `(id, reverse)`, that its row index comes from (else the innermost
  `scan` or `while` around it, or None): a `scan(..., reverse=True)` runs its rows last to
  first."""
  found: dict[int, Any] = {}
  _walk(jaxpr, {}, (), found)
  return found


def _walk(jaxpr, origin: dict, chain: tuple, found: dict) -> None:
  """Records the hits of `jaxpr`; `origin` maps a variable to `(depth, loop)`, the
  innermost loop whose iterations it changes with; `chain` is the loops around."""
  for eqn in _jax.equations(jaxpr):
    args = _jax.operands(eqn)
    if _jax.primitive_name(eqn) == "optimization_barrier":
      at = next((i for i, v in enumerate(args) if _is_marker(v)), None)
      if at is not None:  # a marker (a `jax.grad` inside the loss adds float0 ones)
        index = args[at + 1:at + 2]  # a traced row index follows its marker
        index = [v for v in index if not _jax.is_literal(v)
                 and np.issubdtype(_jax.dtype_of(v), np.integer)]
        source = _deepest(origin, index)
        hit = int(_jax.literal_value(args[at])) - MARK
        found[hit] = source[1] if source else (chain[-1] if chain else None)
    _enter(eqn, args, origin, chain, found)
    out = _deepest(origin, args)
    origin.update({v: out for v in _jax.results(eqn) if out is not None})


def _deepest(origin: dict, operands) -> tuple[int, Any] | None:
  """The innermost loop, `(depth, loop)`, whose iterations any of `operands` changes
  with, or None."""
  known = [origin[v] for v in operands if not _jax.is_literal(v) and v in origin]
  return max(known, default=None, key=_depth)


def _depth(source: tuple[int, Any]) -> int:
  return source[0]


def _is_marker(operand) -> bool:
  return (_jax.is_literal(operand) and _jax.dtype_of(operand) == np.int32
          and int(_jax.literal_value(operand)) >= MARK)


def _enter(eqn, args, origin, chain, found) -> None:
  """Walks the programs inside `eqn`, their inputs' origins taken from its operands (a
  loop's carry and sliced inputs change with the loop itself)."""
  loop = _jax.loop(eqn)
  if loop is not None:
    key = (id(eqn), loop.reverse)
    own = (len(chain) + 1, key)
    body_inputs = _jax.inputs(loop.body)
    sub = {v: origin[c] for v, c in zip(body_inputs, loop.invariant, strict=False)
           if not _jax.is_literal(c) and c in origin}
    sub.update({v: own for v in body_inputs[len(loop.invariant):]})
    _walk(loop.body, sub, (*chain, key), found)
    return
  for program in _jax.programs(eqn):
    inner = _jax.inputs(program)
    operands = args[len(args) - len(inner):] if len(inner) <= len(args) else []
    if len(operands) == len(inner):  # one to one (a `cond`'s after its predicate)
      sub = {v: origin[c] for v, c in zip(inner, operands, strict=True)
             if not _jax.is_literal(c) and c in origin}
    else:
      every = _deepest(origin, args)
      sub = {v: every for v in inner} if every else {}
    _walk(program, sub, chain, found)


def forward_order(lengths: dict, hits: list, loops_of_hits: dict) -> tuple:
  """`Probes.order`: rows given as Python ints in the order they were hit; rows given as
  a loop's index, of every probe of that loop body (by length) interleaved, last to
  first for a reversed scan. A row known only when the program runs, outside any loop
  (an equinox stack sliced in a Python loop): a probe hit once per row so has its rows in
  the order of its hits, the first hit's row 0; hit another number of times (once under
  a `vmap` over the stack, or in both branches of a `cond`), all its rows at its first
  hit. (A jitted or checkpointed layer called in a Python loop is traced once, its probes
  hit once: their rows are all at their first hit.)"""
  bodies, order, unknown = {}, {}, collections.Counter()
  for k, (name, index) in enumerate(hits):
    if lengths[name] is not None and index is None and loops_of_hits.get(k) is not None:
      members = bodies.setdefault((loops_of_hits[k], lengths[name]), [])
      members += [] if name in members else [name]
    elif lengths[name] is not None and index is None:
      unknown[name] += 1
  rows_hit = collections.Counter()
  for k, (name, index) in enumerate(hits):
    length, loop = lengths[name], loops_of_hits.get(k)
    if length is None or index is not None:
      order.setdefault((name, index), None)
    elif loop is None and unknown[name] == length > 1:
      if rows_hit[name] < length:
        order.setdefault((name, rows_hit[name]), None)
      rows_hit[name] += 1
    else:
      names = bodies.get((loop, length), [name])
      rows = range(length)[::-1] if loop and loop[1] else range(length)
      order.update(dict.fromkeys((n, r) for r in rows for n in names))
  for name, length in lengths.items():  # rows never hit
    order.update(dict.fromkeys((name, r) for r in range(length or 0)))
  return tuple(order)
