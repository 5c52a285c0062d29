"""Specification of which loop a probe's rows follow, and of their forward order.

A row given as a loop's index belongs to the loop that index comes from, followed back
through the first pass's program: not the innermost loop around the hit, nor one that
runs the same number of times.
"""

import jax
import jax.numpy as jnp
import pytest
from helpers import scale_backward
from jax import lax

from jax_lossscale import diagnostics
from jax_lossscale import probes as pr
from jax_lossscale.probes import order as probe_order


def probes_of(loss, *args):
  return pr.value_and_grad_with_probes(jax.value_and_grad, loss)(*args)[2]


@pytest.mark.parametrize("steps", [2, 3], ids=["shorter", "as_long"])
@pytest.mark.parametrize("inner_reverse", [False, True], ids=["forward", "reversed"])
@pytest.mark.parametrize("outer_reverse", [False, True], ids=["layers", "layers_reversed"])
def test_a_recurrence_scanned_inside_a_layer_keeps_its_rows_with_the_layers(
    outer_reverse, inner_reverse, steps):
  # The rows followed the innermost scan (a recurrence), not the layers' scan that slices
  # the index: out of order, reversed with the recurrence, and the overflow made in layer
  # 1 (by what consumes blk[1], the recurrence: named by its probe) was named "<loss>". A
  # rule by length took an inner loop as long as the layers' for theirs.
  def loss(ws, x):
    def layer(h, a):
      i, w = a
      h = scale_backward(pr.probe(h * w, "blk", index=i, length=3), jnp.where(i == 1, jnp.inf, 1))
      step = lambda h, _: (pr.probe(jnp.tanh(h), "sub", index=i, length=3), None)
      return lax.scan(step, h, jnp.arange(steps), reverse=inner_reverse)[0], None
    return jnp.sum(lax.scan(layer, x, (jnp.arange(3), ws), reverse=outer_reverse)[0])

  probes = probes_of(loss, jnp.array([1.0, 0.5, 0.25]), jnp.ones(4))
  rows = [2, 1, 0] if outer_reverse else [0, 1, 2]
  assert probes.order == tuple((name, r) for r in rows for name in ("blk", "sub"))
  assert diagnostics.backward_overflow_origin(probes) == "sub[1]"
  assert [int(h) for h in probes["sub"].hits] == [steps] * 3


def test_layers_scanned_inside_a_reversed_loop_of_the_same_length_keep_their_own_order():
  # Layers 1..3 scanned (index from their own scan), layer 0 before them, all inside a
  # reversed scan of 4 steps over the data: the rows were read from the outer scan.
  ws = jnp.array([1.0, 0.5, 0.25, 0.125])

  def loss(ws, xs):
    def step(total, a):
      t, x = a
      def layer(h, b):
        i, w = b
        h = pr.probe(jnp.tanh(h * w), "blk", index=i, length=4)
        return scale_backward(h, jnp.where((i == 2) & (t == 3), jnp.inf, 1.0)), None
      h = pr.probe(jnp.tanh(x * ws[0]), "blk", index=0, length=4)
      return total + jnp.sum(lax.scan(layer, h, (jnp.arange(1, 4), ws[1:]))[0]), None
    return lax.scan(step, 0.0, (jnp.arange(4), xs), reverse=True)[0]

  probes = probes_of(loss, ws, jnp.ones((4, 3)))
  assert probes.order == tuple(("blk", r) for r in range(4))
  assert diagnostics.backward_overflow_origin(probes) == "blk[3]"


def test_a_fori_loop_with_a_traced_count_gives_the_rows_of_its_while():
  def loss(ws, xs, n):
    def step(total, x):
      def body(i, h):
        h = pr.probe(jnp.tanh(h * ws[i]), "blk", index=i, length=3)
        return scale_backward(h, jnp.where(i == 1, jnp.inf, 1.0))
      return total + jnp.sum(lax.fori_loop(0, n, body, x)), None
    return lax.scan(step, 0.0, xs, reverse=True)[0]

  probes = probes_of(loss, jnp.array([1.0, 0.5, 0.25]), jnp.ones((3, 2)), jnp.int32(3))
  assert probes.order == (("blk", 0), ("blk", 1), ("blk", 2))
  assert diagnostics.backward_overflow_origin(probes) == "blk[2]"


def test_a_hit_is_marked_with_its_traced_index_only():
  program = jax.make_jaxpr(lambda x, i: (probe_order.marked(x, 0, i),
                                         probe_order.marked(x, 1, 2)))(jnp.ones(2), 1)
  barriers = [e for e in program.jaxpr.eqns if e.primitive.name == "optimization_barrier"]
  assert [len(e.invars) for e in barriers] == [3, 2]
