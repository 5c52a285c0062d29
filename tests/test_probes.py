"""Specification of probes: activation-gradient measurements out of the backward pass."""

import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import scale_backward
from jax import lax

from jax_lossscale import _jax_internals as internals
from jax_lossscale import diagnostics
from jax_lossscale import probes as pr

F16 = jnp.float16


def mlp(params, x, overflow_at=None, nan_at=None, probed=True):
  """A float16 MLP with a probe after every layer, named layer_0, layer_1, ..."""
  for i, w in enumerate(params):
    x = jnp.tanh(x @ w.astype(F16))
    if i == nan_at:
      x = x.at[0, 0].set(jnp.nan)
    if i == overflow_at:
      x = scale_backward(x, jnp.float32(jnp.inf))
    x = pr.probe(x, f"layer_{i}") if probed else x
  return jnp.mean(x.astype(jnp.float32) ** 2)


PARAMS = [jnp.asarray(np.random.default_rng(i).normal(size=(8, 8)) / 3, jnp.float32)
          for i in range(4)]
X = jnp.asarray(np.random.default_rng(9).normal(size=(4, 8)), F16)


def with_probes(fun, argnums=0, has_aux=False, value_and_grad=jax.value_and_grad):
  return pr.value_and_grad_with_probes(value_and_grad, fun, argnums, has_aux)


# --- identity, zero cost -------------------------------------------------------------


def test_probes_leave_the_value_and_the_gradients_exactly_unchanged(maybe_jit):
  value, grads, probes = maybe_jit(with_probes(mlp))(PARAMS, X)
  # Compiled against compiled: XLA's fusions round float16 differently from one operation
  # at a time on some CPUs.
  ref_value, ref_grads = maybe_jit(jax.value_and_grad(mlp))(PARAMS, X)
  chex.assert_trees_all_equal((value, grads), (ref_value, ref_grads))
  assert list(probes) == ["layer_0", "layer_1", "layer_2", "layer_3"]
  assert diagnostics.backward_overflow_origin(probes) is None
  assert diagnostics.forward_nonfinite_origin(probes) is None


def test_without_measurement_probe_returns_its_input_and_the_program_has_no_probes():
  x = jnp.ones(3)
  assert pr.probe(x, "a") is x
  jaxpr = lambda fun: str(jax.make_jaxpr(jax.value_and_grad(fun))(PARAMS, X))
  assert jaxpr(mlp) == jaxpr(lambda p, x: mlp(p, x, probed=False))
  assert "custom_vjp" not in jaxpr(mlp)


def test_a_probe_of_a_pytree_is_refused_naming_x():
  # It failed inside jnp.result_type ("entry not a 2- or 3- tuple").
  with pytest.raises(TypeError, match=r"'t'.*`x`.*\bdict\b"):
    pr.probe({"a": jnp.ones(2)}, "t")
  assert [pr.probe(x, "t") for x in (1, 2.0, 3j)] == [1, 2.0, 3j]  # numbers pass as they are


def test_measurements_leave_the_device_through_the_backward_pass_not_a_host_callback():
  jaxpr = str(jax.make_jaxpr(with_probes(mlp))(PARAMS, X))
  assert "measurements" in jaxpr and "callback" not in jaxpr  # the jitted reduction


def reductions(fun, *args) -> int:
  """The number of reductions in `fun`'s program, nested jaxprs included."""
  def count(program):
    eqns = internals.equations(program)
    return sum(internals.primitive_name(e).startswith("reduce") for e in eqns) + sum(
        count(sub) for e in eqns for sub in internals.programs(e))
  return count(jax.make_jaxpr(fun)(*args))


def test_each_probe_costs_one_reduction_of_its_activation_and_one_of_its_gradient():
  plain = reductions(jax.value_and_grad(mlp), PARAMS, X)
  assert reductions(with_probes(mlp), PARAMS, X) == plain + 2 * len(PARAMS)


def test_a_gradient_known_when_compiling_is_reduced_when_the_step_runs():
  # The loss is the mean of the probed tensor: its gradient is a constant, which XLA's
  # constant folding would reduce element by element inside the compiler (seconds per
  # million elements). Both of the probe's reductions stay in the compiled program.
  def loss(w, x):
    return jnp.mean(pr.probe(x * w, "last").astype(jnp.float32))

  w, x = jnp.float16(1), jnp.ones((4, 1024), F16)
  compiled = jax.jit(with_probes(loss)).lower(w, x).compile()
  [module] = compiled.runtime_executable().hlo_modules()
  # The probes' reductions: a maximum and two counts each (three inputs and three initial
  # values), for the activation and the gradient.
  assert sum(instruction.opcode.name == "kReduce" and len(instruction.operands()) == 6
             for computation in module.computations()
             for instruction in computation.instructions()) == 2
  assert with_probes(loss)(w, x)[2]["last"].backward.max_abs == np.float16(1 / x.size)


def test_a_probe_keeps_no_activation_for_the_backward_pass():
  # Pre-activations: nothing else in the backward pass needs them. What a probe kept for
  # the backward pass would grow with the number of layers probed.
  x = jnp.ones((256, 512), F16)
  one_activation = x.size * x.itemsize

  def extra_bytes(layers):
    ws = [jnp.full((512, 512), 1e-3, jnp.float32)] * layers

    def loss(ws, x):
      for i, w in enumerate(ws):
        x = jnp.tanh(pr.probe(x @ w.astype(F16), f"pre_{i}"))
      return jnp.mean(x.astype(jnp.float32))

    def temp_bytes(fun):
      return jax.jit(fun).lower(ws, x).compile().memory_analysis().temp_size_in_bytes

    return temp_bytes(with_probes(loss)) - temp_bytes(jax.value_and_grad(loss))

  three, six = extra_bytes(3), extra_bytes(6)
  assert six - three < one_activation
  # From jax 0.11, XLA:CPU writes a float16 dot's output read by the probe and by tanh
  # to memory once in the forward pass: one activation, reused by every layer.
  transient = one_activation if jax.__version_info__ >= (0, 11) else 0
  assert three < transient + one_activation


def test_a_function_without_probes_gets_plain_gradients_and_no_probes():
  value, grads, probes = with_probes(lambda w: jnp.sum(w ** 2))(jnp.arange(3.0))
  assert float(value) == 5.0 and list(grads) == [0.0, 2.0, 4.0] and len(probes) == 0


# --- cotangents add up --------------------------------------------------------------


def test_vmap_inside_the_loss_sums_over_the_examples():
  def loss(w, xs):
    return jnp.sum(jax.vmap(lambda x: pr.probe(x * w, "per_example"))(xs) ** 2)

  xs = jnp.array([[1.0, 0.0], [0.0, 0.0], [2.0, 1.0]])
  summary = diagnostics.summarize(with_probes(loss)(jnp.float32(1.0), xs)[2])["per_example"]
  assert summary.hits == 3 and summary.forward.zero_fraction == 0.5
  assert summary.backward.max_abs == 4.0


def test_vmap_over_the_gradient_computation_gives_per_example_probes():
  xs = jnp.stack([X, 2 * X, 0 * X])
  value, grads, probes = jax.vmap(with_probes(mlp), in_axes=(None, 0))(PARAMS, xs)
  assert value.shape == (3,) and grads[0].shape == (3, 8, 8)
  assert probes["layer_0"].hits.shape == (3,)
  assert list(np.asarray(probes["layer_0"].forward.zero_fraction)) == [0, 0, 1]


def scanned(ws, x, index=True):
  """`mlp` as a scan over its stacked layers."""
  def body(h, layer):
    i, w = layer
    h = jnp.tanh(h @ w.astype(F16))
    return pr.probe(h, "block", index=i, length=len(ws)) if index else pr.probe(h, "block"), None
  h, _ = lax.scan(body, x, (jnp.arange(len(ws)), ws))
  return jnp.mean(h.astype(jnp.float32) ** 2)


def test_a_probe_in_a_scan_over_layers_gives_one_row_per_layer():
  rows = diagnostics.summarize(with_probes(scanned)(jnp.stack(PARAMS), X)[2])["block"]
  unrolled = diagnostics.summarize(with_probes(mlp)(PARAMS, X)[2])
  assert list(rows.hits) == [1, 1, 1, 1]
  for i in range(4):  # each row holds its own layer's measurements
    layer = unrolled[f"layer_{i}"]
    np.testing.assert_allclose(rows.backward.max_abs[i], layer.backward.max_abs, rtol=1e-3)
    assert rows.headroom[i] == layer.headroom


def test_a_probe_in_a_scan_stacks_only_its_activations_three_figures_per_layer():
  # The row index rides along from the scan's inputs; a row selected, or an in-range flag
  # computed, in the forward pass would be one more residual stacked per layer (and one
  # more kernel for XLA to compile).
  def stacked_outputs(program):  # of every scan, inside jitted functions too
    found = []
    for eqn in internals.equations(program):
      loop = internals.loop(eqn)
      if loop is not None and internals.primitive_name(eqn) == "scan":
        found += [(v.aval.dtype, v.aval.shape) for v in internals.results(eqn)[loop.carried:]]
      found += [out for sub in internals.programs(eqn) for out in stacked_outputs(sub)]
    return found

  stacked = lambda fun: stacked_outputs(jax.make_jaxpr(fun)(jnp.stack(PARAMS), X))
  unprobed, probed = stacked(jax.value_and_grad(scanned)), stacked(with_probes(scanned))
  extra = list(probed)
  for residual in unprobed:
    extra.remove(residual)
  assert extra == [(jnp.dtype(jnp.float32), (len(PARAMS), 3))]


def test_a_traced_index_out_of_range_drops_its_hit_instead_of_giving_it_to_an_end_row():
  # Off by one: layer i measured as row i + 1. Clamped, the last layer's hit went to row 3,
  # which then summed two layers; dropped, no row has it and the table shows the miss.
  def off_by_one(ws, x):
    def body(h, layer):
      i, w = layer
      return pr.probe(jnp.tanh(h @ w.astype(F16)), "block", index=i + 1, length=len(ws)), None
    return jnp.mean(lax.scan(body, x, (jnp.arange(len(ws)), ws))[0].astype(jnp.float32) ** 2)

  rows = diagnostics.summarize(with_probes(off_by_one)(jnp.stack(PARAMS), X)[2])["block"]
  assert list(rows.hits) == [0, 1, 1, 1]


def test_rows_and_float64_activations_are_measured_under_x64():
  # The stats inputs were float64 under x64, and a row's float32 cotangent did not fit.
  with jax.enable_x64(True):
    ws = jnp.stack(PARAMS).astype(jnp.float64)
    probes = with_probes(scanned)(ws, X.astype(jnp.float64))[2]
    assert list(probes["block"].hits) == [1, 1, 1, 1]
    assert probes.encoded[0].dtype == jnp.float32


def test_a_probe_in_a_scan_without_an_index_sums_the_layers():
  _, _, probes = with_probes(lambda ws, x: scanned(ws, x, index=False))(jnp.stack(PARAMS), X)
  assert int(probes["block"].hits) == 4 and probes["block"].hits.shape == ()


def test_probes_under_checkpoint_measure_what_they_measure_without_it():
  plain = with_probes(mlp)(PARAMS, X)[2]
  rematted = with_probes(lambda p, x: jax.checkpoint(mlp)(p, x))(PARAMS, X)[2]
  chex.assert_trees_all_equal(plain, rematted)


def test_a_jitted_step_with_donated_parameters_measures_every_step():
  def step(params, x):
    _, grads, probes = with_probes(mlp)(params, x)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), probes

  step = jax.jit(step, donate_argnums=0)
  params = [p + 0 for p in PARAMS]
  for _ in range(3):
    params, probes = step(params, X)
  assert [int(probes[n].hits) for n in probes] == [1, 1, 1, 1]


def test_a_jitted_inner_function_is_retraced_when_measurement_starts():
  inner = jax.jit(lambda x: pr.probe(x * 2, "inner"))
  loss = lambda w: jnp.sum(inner(w))
  jax.grad(loss)(jnp.ones(2))  # cached without probes
  assert int(with_probes(loss)(jnp.ones(2))[2]["inner"].hits) == 1
  assert "custom_vjp" not in str(jax.make_jaxpr(jax.grad(loss))(jnp.ones(2)))


# --- locating -----------------------------------------------------------------------


def test_an_overflow_in_layer_2_backward_pass_is_named_layer_2():
  _, grads, probes = with_probes(lambda p, x: mlp(p, x, overflow_at=2))(PARAMS, X)
  assert not np.isfinite(np.asarray(grads[0])).all()
  # The first non-finite gradient is layer_1's; layer 2's backward computed it.
  assert not diagnostics.summarize(probes)["layer_1"].backward.finite
  assert diagnostics.summarize(probes)["layer_2"].backward.finite
  assert diagnostics.backward_overflow_origin(probes) == "layer_2"
  assert diagnostics.forward_nonfinite_origin(probes) is None


def test_an_overflow_after_the_last_probe_is_named_the_loss():
  def loss(p, x):
    return jnp.sum(scale_backward(mlp(p, x), jnp.float32(jnp.inf)))

  assert diagnostics.backward_overflow_origin(with_probes(loss)(PARAMS, X)[2]) == pr.LOSS


def test_a_nan_produced_in_layer_1_forward_pass_is_the_first_nonfinite_forward_layer():
  _, _, probes = with_probes(lambda p, x: mlp(p, x, nan_at=1))(PARAMS, X)
  assert diagnostics.forward_nonfinite_origin(probes) == "layer_1"


def test_an_overflow_in_the_third_scanned_layer_is_named_by_its_row():
  def loss(ws, x):
    def body(h, layer):
      i, w = layer
      h = jnp.tanh(h @ w.astype(F16))
      h = scale_backward(h, jnp.where(i == 2, jnp.inf, 1.0))
      return pr.probe(h, "block", index=i, length=4), None
    return jnp.sum(lax.scan(body, x, (jnp.arange(4), ws))[0])

  probes = with_probes(loss)(jnp.stack(PARAMS), X)[2]
  assert diagnostics.backward_overflow_origin(probes) == "block[2]"



def test_a_reversed_scan_lists_its_rows_in_the_order_they_ran_and_names_the_culprit():
  # scan(reverse=True) runs layer 3 first: forward order is block[3], ..., block[0], and
  # an overflow in layer 1's backward pass is named block[1], not the row after it.
  def loss(ws, x):
    def body(h, layer):
      i, w = layer
      h = scale_backward(jnp.tanh(h @ w.astype(F16)), jnp.where(i == 1, jnp.inf, 1.0))
      return pr.probe(h, "block", index=i, length=4), None
    return jnp.sum(lax.scan(body, x, (jnp.arange(4), ws), reverse=True)[0])

  probes = with_probes(loss)(jnp.stack(PARAMS), X)[2]
  assert probes.order == (("block", 3), ("block", 2), ("block", 1), ("block", 0))
  assert diagnostics.backward_overflow_origin(probes) == "block[1]"

INNER = {  # a second probe in the decoder's body, after its own
    "none": None,
    "checkpoint": lambda h, i: jax.checkpoint(
        lambda h: pr.probe(jnp.tanh(h), "dec/inner", index=i, length=2))(h),
    "checkpoint_given_the_index": lambda h, i: jax.checkpoint(
        lambda h, i: pr.probe(jnp.tanh(h), "dec/inner", index=i, length=2))(h, i),
    "jit_given_the_index": lambda h, i: jax.jit(
        lambda h, i: pr.probe(jnp.tanh(h), "dec/inner", index=i, length=2))(h, i),
    "without_rows": lambda h, i: pr.probe(jnp.tanh(h), "dec/shared"),
    "without_rows_between": lambda h, i: pr.probe(
        jnp.tanh(pr.probe(h * 0.5, "dec/shared")), "dec/inner", index=i, length=2),
}


def stacks(params, x, inner=None):
  """Two scans of two layers each (an encoder and a decoder of equal depth), probed "enc"
  and "dec"; the decoder's layer 0 overflows in its backward pass."""
  def stack(name, h, ws):
    def body(h, layer):
      i, w = layer
      h = scale_backward(h @ w.astype(F16), jnp.where((i == 0) & (name == "dec"), jnp.inf, 1.0))
      h = pr.probe(h, name, index=i, length=2)
      return (h if inner is None or name == "enc" else inner(h, i)), None
    return lax.scan(body, h, (jnp.arange(2), ws))[0]

  return jnp.sum(stack("dec", stack("enc", x, params[:2]), params[2:]).astype(jnp.float32))


@pytest.mark.parametrize("inner", INNER)
def test_two_scans_of_one_length_are_read_in_forward_order(inner):
  # Consecutive probes of one length were taken for one body: enc[0], dec[0], enc[1],
  # dec[1], and the overflow in dec[0] was named dec[1].
  loss = lambda p, x: stacks(p, x, INNER[inner])
  probes = with_probes(loss)(jnp.stack(PARAMS), X)[2]
  second = {"none": [], "without_rows": []}.get(inner, ["dec/inner[0]", "dec/inner[1]"])
  assert [name for name, _ in diagnostics.layers(probes)] == [
      "enc[0]", "enc[1]", "dec[0]", *second[:1], "dec[1]", *second[1:],
      *(["dec/shared"] if inner.startswith("without_rows") else [])]
  assert diagnostics.backward_overflow_origin(probes) == "dec[0]"


@pytest.mark.parametrize("row", ["concrete_array", "traced"])
def test_rows_known_only_as_arrays_are_in_the_order_they_were_hit(row):
  # `index=jnp.int32(i)`, or an index a transformation made traced (the row of a stack
  # sliced in a Python loop): the rows run attn[0], mlp[0], attn[1], mlp[1].
  def loss(ws, x):
    h = x
    for i in range(2):
      index = jnp.int32(i) if row == "concrete_array" else lax.convert_element_type(
          jnp.argmax(jnp.arange(2) == i), jnp.int32)
      h = scale_backward(h @ ws[i].astype(F16), jnp.float32(jnp.inf if i == 1 else 1))
      h = pr.probe(pr.probe(h, "attn", index=index, length=2) * 2, "mlp", index=index,
                   length=2)
    return jnp.sum(h.astype(jnp.float32))

  probes = with_probes(loss)(PARAMS, X)[2]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      "attn[0]", "mlp[0]", "attn[1]", "mlp[1]"]
  assert diagnostics.backward_overflow_origin(probes) == "attn[1]"  # grouped: "mlp[1]"


def test_a_vmapped_stack_keeps_each_probes_rows_together_even_when_a_cond_hits_it_twice():
  # Under a vmap over the stack each probe is hit once with a batched index; one in both
  # branches of a cond is hit twice: not two rows of three, all three at its first hit.
  def layer(w, i, x):
    h = pr.probe(jnp.tanh(x @ w), "attn", index=i, length=3)
    h = lax.cond(jnp.sum(h) > 0, lambda h: pr.probe(h * 2, "mlp", index=i, length=3),
                 lambda h: pr.probe(h * 3, "mlp", index=i, length=3), h)
    return pr.probe(h + 1, "out", index=i, length=3)

  loss = lambda ws, x: jnp.sum(jax.vmap(layer, in_axes=(0, 0, None))(ws, jnp.arange(3), x))
  probes = with_probes(loss)(jnp.stack(PARAMS[:3]), X)[2]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      f"{probe}[{row}]" for probe in ("attn", "mlp", "out") for row in range(3)]


@pytest.mark.parametrize("integer", [int, np.int64], ids=["int", "numpy_int"])
def test_rows_given_as_python_ints_are_in_the_order_they_were_hit(integer):
  def loss(ws, x):
    h = x
    for i in map(integer, range(2)):  # two unrolled stacks, the second's layer 0 overflowing
      h = pr.probe(jnp.tanh(h @ ws[i].astype(F16)), "enc", index=i, length=2)
    for i in map(integer, range(2)):
      h = scale_backward(h @ ws[2 + i].astype(F16), jnp.float32(jnp.inf if i == 0 else 1))
      h = pr.probe(pr.probe(h, "attn", index=i, length=2) * 2, "mlp", index=i, length=2)
    return jnp.sum(h.astype(jnp.float32))

  probes = with_probes(loss)(PARAMS, X)[2]
  assert [name for name, _ in diagnostics.layers(probes)] == [
      "enc[0]", "enc[1]", "attn[0]", "mlp[0]", "attn[1]", "mlp[1]"]
  assert diagnostics.backward_overflow_origin(probes) == "attn[0]"


def test_a_probe_in_a_branch_not_taken_is_not_named_the_origin():
  def loss(w, x, take_b):
    h = pr.probe(jnp.tanh(x * w), "a")
    h = lax.cond(take_b, lambda h: pr.probe(h * 2, "expert_b"),
                 lambda h: pr.probe(scale_backward(h * 3, jnp.float32(jnp.inf)), "expert_c"), h)
    return jnp.sum(pr.probe(h + 1, "out").astype(jnp.float32))

  probes = with_probes(loss)(jnp.ones(4, F16), jnp.ones(4, F16), False)[2]
  assert int(probes["expert_b"].hits) == 0
  assert diagnostics.backward_overflow_origin(probes) == "expert_c"


# --- threading through the differentiation transforms ---------------------------------


def two_args(a, b):
  return jnp.sum(pr.probe(a * b, "ab")), {"b": b}


@pytest.mark.parametrize("argnums", [0, 1, -1, (0, 1), (1, 0), (-1,)])
def test_gradients_keep_the_structure_of_every_argnums(argnums):
  a, b = jnp.ones(2), jnp.full(2, 3.0)
  (value, aux), grads, probes = with_probes(two_args, argnums, has_aux=True)(a, b)
  (ref_value, ref_aux), ref_grads = jax.value_and_grad(two_args, argnums, has_aux=True)(a, b)
  chex.assert_trees_all_equal((value, aux, grads), (ref_value, ref_aux, ref_grads))
  assert int(probes["ab"].hits) == 1


def test_equinox_and_nnx_transforms_get_the_stats_with_their_first_argument():
  import equinox as eqx
  from flax import nnx

  for transform in (eqx.filter_value_and_grad, nnx.value_and_grad):
    _, grads, probes = with_probes(mlp, value_and_grad=transform)(PARAMS, X)
    chex.assert_trees_all_equal(grads, jax.grad(mlp)(PARAMS, X))
    assert list(probes) == ["layer_0", "layer_1", "layer_2", "layer_3"]


# --- validation ---------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    ({"index": 0}, "index=0.*length=None"),
    ({"length": 3}, "index=None.*length=3"),  # failed on a dtype of None
    ({"index": 0, "length": 0}, "length=0 must be a positive int"),
    ({"index": 0, "length": True}, "length=True must be a positive int"),  # was 1 row
    ({"index": 2, "length": 2}, r"index=2 must be an int in \[0, length=2\)"),
    ({"index": jnp.int32(7), "length": 3}, r"must be an int in \[0, length=3\)")])  # clamped
def test_probe_arguments_are_checked(kwargs, match):
  with pytest.raises(ValueError, match=match):
    with_probes(lambda w: jnp.sum(pr.probe(w, "p", **kwargs)))(jnp.ones(2))


def test_a_probe_named_anew_on_every_trace_is_refused_not_left_unmeasured():
  # Names from a global counter differ between the two passes: the second pass's probes
  # must not pass through unmeasured (an overflow there would be reported nowhere).
  counter = itertools.count()
  loss = lambda w: jnp.sum(pr.probe(jnp.tanh(w), f"dense_{next(counter)}"))
  with pytest.raises(ValueError, match="'dense_1'"):
    with_probes(loss)(jnp.ones(2))


@pytest.mark.parametrize("name", [3, ("a", "b")])
def test_a_probe_name_that_is_not_a_string_is_refused(name):
  # It was accepted, and diagnostics.table failed on it later.
  with pytest.raises(TypeError, match="`name`"):
    with_probes(lambda w: jnp.sum(pr.probe(w, name)))(jnp.ones(2))


def test_arguments_given_by_keyword_only_are_refused_naming_argnums():
  # It failed with ZeroDivisionError.
  loss = lambda w, x: jnp.sum(pr.probe(w * x, "p"))
  with pytest.raises(TypeError, match=r"argnums=0.*\(w, x\)"):
    with_probes(loss)(w=jnp.ones(2), x=jnp.ones(2))


def test_one_name_used_with_two_lengths_is_refused():
  def loss(w):
    return jnp.sum(pr.probe(w, "p") + pr.probe(2 * w, "p", index=0, length=2))

  with pytest.raises(ValueError, match="probe 'p'.*length=2.*length=None"):
    with_probes(loss)(jnp.ones(2))


def test_a_tensor_already_probed_is_not_measured_again():
  # A module whose output is its last submodule's (an attention block returning its
  # output projection) would measure the same tensor twice.
  def loss(x):
    inner = pr.probe(x * 2, "inner")
    return jnp.sum(pr.probe(inner, "outer") ** 2)

  _, _, probes = pr.value_and_grad_with_probes(jax.value_and_grad, loss)(jnp.ones(3))
  assert list(probes) == ["inner"]


def test_a_loss_with_a_gradient_inside_it_is_measured_with_its_gradients_unchanged():
  # A gradient penalty (WGAN-GP, PINNs): jax.grad inside the loss differentiates the
  # probes' own backward pass, and the first pass meets their differentiated markers.
  def critic(w, x):
    return jnp.sum(pr.probe(jnp.tanh(x @ w), "hidden"))

  def loss(w, x):
    return critic(w, x) + jnp.mean(jax.grad(critic, argnums=1)(w, x) ** 2)

  w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
  value, grads, probes = with_probes(loss)(w, X[:, :4])
  chex.assert_trees_all_equal((value, grads), jax.value_and_grad(loss)(w, X[:, :4]))
  assert int(probes["hidden"].hits) == 1


# --- other transformations ----------------------------------------------------------


@jax.custom_vjp
def sin_twice(x):
  """A custom_vjp whose forward rule calls the function itself, as JAX's examples do."""
  return pr.probe(jnp.sin(x), "inside") * 2


sin_twice.defvjp(lambda x: (sin_twice(x), x), lambda x, g: (2 * g * jnp.cos(x),))


@jax.custom_jvp
def sin_once(x):
  return pr.probe(jnp.sin(x), "inside")


sin_once.defjvp(lambda primals, tangents: (sin_once(primals[0]),
                                           jnp.cos(primals[0]) * tangents[0]))


def assert_probed_as_unprobed(transform, loss, *args, measured):
  """`loss` differentiated with probes (under `transform`): the value and gradients it has
  without them, and `measured` the names measured (others reached: 0 hits)."""
  value, grads, probes = transform(with_probes(loss))(*args)
  chex.assert_trees_all_equal((value, grads), transform(jax.value_and_grad(loss))(*args))
  assert {name for name in probes if int(probes[name].hits) > 0} == set(measured)
  for name in set(probes) - set(measured):
    assert "not measured" in diagnostics.table(probes).split(name)[1].splitlines()[0]


@pytest.mark.parametrize("custom", [sin_twice, sin_once], ids=["custom_vjp", "custom_jvp"])
def test_a_probe_inside_a_custom_rule_measures_nothing_and_changes_nothing(custom, maybe_jit):
  loss = lambda x: jnp.sum(pr.probe(custom(x), "outside") ** 2)
  assert_probed_as_unprobed(maybe_jit, loss, jnp.ones(3), measured={"outside"})


def test_forward_mode_inside_a_probed_loss_differentiates_as_without_probes(maybe_jit):
  def critic(w, x):
    return jnp.sum(pr.probe(jnp.tanh(x @ w), "hidden"))

  def penalty(w, x):  # a gradient penalty by forward mode: the probe there is not measured
    _, slope = jax.jvp(lambda x: critic(w, x), (x,), (jnp.ones_like(x),))
    return critic(w, x) + slope**2

  def jacobian(w, x):
    return jnp.sum(jax.jacfwd(lambda x: jnp.tanh(pr.probe(x @ w, "jacobian")))(x[0]))

  w = jnp.asarray(np.random.default_rng(0).normal(size=(4, 4)), jnp.float32)
  x = X[:, :4].astype(jnp.float32)
  assert_probed_as_unprobed(maybe_jit, penalty, w, x, measured={"hidden"})
  assert_probed_as_unprobed(maybe_jit, jacobian, w, x, measured=set())
