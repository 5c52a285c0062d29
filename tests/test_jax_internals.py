"""What the library reads from JAX's internals, pinned on the installed JAX.

Every supported JAX (0.10.2 on Python 3.11, 0.12 on Python 3.12 and newer) runs these; a
JAX that changes one of the facts read fails here, by name, instead of deep in the probes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from jax_lossscale import _finite
from jax_lossscale import _jax_internals as internals


def only(program, name):
  """The one equation of primitive `name` at the top of `program`."""
  [eqn] = [e for e in internals.equations(program) if internals.primitive_name(e) == name]
  return eqn


def test_a_named_vmap_axis_is_in_scope_inside_the_vmap_only():
  seen = []
  jax.vmap(lambda x: seen.append(internals.axis_names_in_scope()) or x, axis_name="b")(
      jnp.ones(2))
  assert seen == [("b",)] and internals.axis_names_in_scope() == ()


def test_the_replica_axes_of_a_vmap_are_its_named_axes():
  seen = []
  jax.vmap(lambda x: seen.append(_finite.manual_axes(x)) or x, axis_name="b")(jnp.ones(2))
  assert seen == [("b",)]


def test_a_value_varies_over_the_shard_map_axes_it_is_split_over():
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  seen = {}

  def body(split, replicated):
    seen["split"] = internals.varying_axes(jax.typeof(split))
    seen["replicated"] = internals.varying_axes(jax.typeof(replicated))
    return split

  P = jax.sharding.PartitionSpec
  split = jax.device_put(jnp.ones(2), jax.sharding.NamedSharding(mesh, P("x")))
  jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))(split, jnp.ones(2))
  assert seen == {"split": frozenset({"x"}), "replicated": frozenset()}
  assert internals.varying_axes(jax.typeof(jnp.ones(2))) == frozenset()


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scan_is_a_loop_with_its_invariant_operands_first(reverse):
  w, v = jnp.ones(3), jnp.full(3, 2.0)

  def f(carry, xs):
    body = lambda c, x: ((c[0] * w + x, c[1] * v), c[0])
    return lax.scan(body, carry, xs, reverse=reverse)

  program = jax.make_jaxpr(f)((jnp.ones(3), jnp.ones(3)), jnp.ones((4, 3)))
  eqn = only(program, "scan")
  loop = internals.loop(eqn)
  assert len(loop.invariant) == 2 and loop.reverse is reverse and loop.carried == 2
  assert loop.invariant == tuple(internals.operands(eqn)[:2])
  assert len(internals.inputs(loop.body)) == 2 + 2 + 1  # invariants, carry, slice


def test_a_while_loop_is_a_loop_with_its_body_invariants():
  def f(x, w):
    return lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] * w), (0, x))

  program = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones(3))
  eqn = only(program, "while")
  loop = internals.loop(eqn)
  assert loop.reverse is False and len(loop.invariant) == 1 and loop.carried == 2
  assert len(internals.inputs(loop.body)) == 1 + 2


def test_a_fori_loop_is_a_loop():
  program = jax.make_jaxpr(lambda x: lax.fori_loop(0, 3, lambda i, c: c * 2, x))(1.0)
  [eqn] = [e for e in internals.equations(program) if internals.loop(e) is not None]
  assert internals.primitive_name(eqn) in ("scan", "while")


def test_other_equations_are_not_loops():
  program = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0)
  assert all(internals.loop(e) is None for e in internals.equations(program))


def test_the_programs_inside_an_equation_are_found():
  def f(x):
    branched = lax.cond(x[0] > 0, lambda y: y * 2, lambda y: y + 1, x)
    return jax.jit(lambda y: jnp.sin(y))(branched) + jax.checkpoint(jnp.cos)(x) + jax.nn.relu(x)

  program = jax.make_jaxpr(f)(jnp.ones(3))
  found = {internals.primitive_name(e): len(list(internals.programs(e)))
           for e in internals.equations(program)}
  assert found["cond"] == 2  # a program per branch
  assert found["remat2"] == 1  # jax.checkpoint's
  assert sum(count for name, count in found.items() if name in ("jit", "pjit")) == 1
  assert found["custom_jvp_call"] >= 1  # relu's rule
  assert found["add"] == 0  # a first-order primitive


def test_a_literal_operand_is_told_from_a_variable_with_its_value():
  program = jax.make_jaxpr(lambda x: lax.optimization_barrier((x, np.int32(7)))[0])(1.0)
  eqn = only(program, "optimization_barrier")
  variable, literal = internals.operands(eqn)
  assert not internals.is_literal(variable) and internals.is_literal(literal)
  assert int(internals.literal_value(literal)) == 7
  assert internals.dtype_of(literal) == np.int32 and internals.dtype_of(variable) == np.float32
  assert len(internals.results(eqn)) == 2


# Running a program with other precisions (autocast).


def as_traced(op, operands):
  return op.bind(operands)


def test_evaluate_binding_each_operation_as_traced_reproduces_the_function():
  def f(x, n):
    h = lax.scan(lambda c, _: (jnp.tanh(c) * 2.0, None), x, None, length=3)[0]
    return lax.cond(n > 0, jnp.sin, jnp.cos, h), n + 1

  args = [jnp.linspace(0.0, 1.0, 4), jnp.int32(2)]
  program, out_tree = internals.trace(f, args)
  outs = jax.tree.unflatten(out_tree, internals.evaluate(program, args, as_traced))
  expected = f(*args)
  np.testing.assert_allclose(outs[0], expected[0], rtol=1e-6)
  assert int(outs[1]) == 3
  assert [t.dtype for t in internals.output_types(program)] == [np.float32, np.int32]


def test_an_operation_tells_its_name_types_and_parameters():
  program, _ = internals.trace(lambda x: (x @ x) * 2.0, [jnp.ones((2, 2))])
  seen = []
  internals.evaluate(program, [jnp.ones((2, 2))], lambda op, xs: seen.append(op) or op.bind(xs))
  dot, mul = seen
  assert (dot.name, mul.name) == ("dot_general", "mul")
  assert dot.inputs[0] == internals.ValueType(np.dtype(np.float32), False, False)
  assert mul.inputs[1].scalar_constant and not mul.inputs[0].scalar_constant
  assert dot.outputs[0].dtype == np.float32 and not dot.multiple_results
  assert dot.param("preferred_element_type") == np.float32
  assert not dot.holds_programs


def test_an_operation_tells_where_its_operands_come_from_through_reshapes():
  table = jnp.arange(8.0).reshape(4, 2)  # closed over: a constant of the program
  program, _ = internals.trace(lambda w, x: (x @ w).T * 1e5 + table, [jnp.ones((3, 4)),
                                                                     jnp.ones((2, 3))])
  seen = {}
  internals.evaluate(program, [jnp.ones((3, 4)), jnp.ones((2, 3))],
                     lambda op, xs: seen.setdefault(op.name, op) and op.bind(xs))
  (product, factor), (scaled, constant) = seen["mul"].origins, seen["add"].origins
  assert (product.primitive, product.constant) == ("dot_general", None)  # through `.T`
  assert (factor.primitive, float(factor.constant)) == (None, 1e5)
  assert (scaled.primitive, constant.primitive) == ("mul", None)
  np.testing.assert_array_equal(constant.constant, table)
  assert seen["dot_general"].origin(0) == internals.Origin()  # an input


def test_an_operation_tells_whether_the_program_computed_an_operand():
  def f(b, keep):  # a cast input, and a value computed from one (a mask)
    return b.astype(jnp.float16)[None, :] + jnp.where(keep, 0.0, -1e9)[None, :]

  args = [jnp.ones(3), jnp.ones(3, bool)]
  program, _ = internals.trace(f, args)
  seen = {}
  internals.evaluate(program, args, lambda op, xs: seen.setdefault(op.name, op) and op.bind(xs))
  cast, mask = seen["add"].origins
  assert (cast.primitive, cast.computed) == ("convert_element_type", False)
  assert mask.computed and not internals.Origin().computed  # an input is not


def test_a_matmuls_result_tells_its_output_feature_axes_wherever_they_move():
  def f(x, w, kernel, image):
    y = jnp.einsum("bqd,bkd->bqk", x, w)  # batch, then the left's free axis, then the right's
    conv = lax.conv_general_dilated(image, kernel, (1, 1), "SAME",
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return (y + 1.0, y.transpose(0, 2, 1) + 1.0, conv + 1.0, conv[0] + 1.0,
            y.reshape(2, 15) + 1.0)  # equinox's convolution squeezes its batch of one

  args = [jnp.ones((2, 3, 4)), jnp.ones((2, 5, 4)), jnp.ones((6, 2, 3, 3)),
          jnp.ones((1, 2, 8, 8))]
  program, _ = internals.trace(f, args)
  adds = []
  internals.evaluate(program, args,
                     lambda op, xs: (op.name == "add" and adds.append(op)) or op.bind(xs))
  assert [op.origin(0).features for op in adds] == [
      ((1,), (2,)), ((2,), (1,)), ((1,),), ((0,),), None]
  assert adds[1].origin(0).primitive == "dot_general"  # through the transpose


def test_an_operation_tells_which_later_operations_read_its_results():
  def f(x):
    s = jnp.sin(x)
    return s * jnp.cos(x) + s

  program, _ = internals.trace(f, [jnp.ones(3)])
  sin, cos, mul, add = internals.operations(program)
  assert [(user.name, i) for user, i in sin.users] == [("mul", 0), ("add", 1)]
  assert [(user.name, i) for user, i in mul.users] == [("add", 0)] and add.users == []


@pytest.mark.parametrize("approximate", [True, False])
def test_a_call_of_jax_nn_gelu_is_one_call_found_by_its_traceback(approximate):
  # `jax.nn.gelu` is traced inline (no named jit): its operations are found by the frame
  # of `gelu` in `jax/_src/nn/functions.py` in their tracebacks, one call per call site.
  fun = lambda x: jnp.sin(jax.nn.gelu(jax.nn.gelu(x, approximate), approximate) +
                          jax.nn.gelu(x, approximate))
  program, _ = internals.trace(fun, [jnp.ones(3)])
  ops = internals.operations(program)
  calls = [op for op in ops if isinstance(op, internals.Call)]
  assert [op.name for op in ops] == ["gelu", "gelu", "add", "sin"]  # the nested call: one
  assert all(call.function == "gelu" and len(call.invars) == len(call.outvars) == 1
             for call in calls)
  outs = internals.evaluate(program, [jnp.linspace(-3.0, 3.0, 3)], lambda op, xs: (
      op.evaluate(xs, lambda o, ys: o.bind(ys)) if isinstance(op, internals.Call)
      else op.bind(xs)))
  np.testing.assert_allclose(outs[0], fun(jnp.linspace(-3.0, 3.0, 3)), rtol=1e-6)


def test_the_activation_functions_autocast_runs_as_one_operation_are_jitted_by_those_names():
  from jax_lossscale import _autocast
  for name in _autocast.ACTIVATIONS - internals.INLINED:
    program, _ = internals.trace(getattr(jax.nn, name), [jnp.ones(3)])
    (op,) = internals.operations(program)
    assert op.retypable and op.param("name") == name


def test_an_operation_tells_its_name_scopes_also_once_differentiated():
  def f(x):
    with jax.named_scope("outer"), jax.named_scope("inner"):
      return jnp.sin(x)

  program, _ = internals.trace(jax.grad(f), [1.0])
  scopes = []
  internals.evaluate(program, [1.0], lambda op, xs: scopes.append(op.scopes) or op.bind(xs))
  assert scopes and set(scopes) == {("outer", "inner")}


def test_an_operation_binds_with_changed_parameters():
  program, _ = internals.trace(lambda x: x @ x, [jnp.ones((2, 2))])
  run = lambda op, xs: op.bind([x.astype(jnp.float16) for x in xs],
                                   preferred_element_type=jnp.float16)
  [out] = internals.evaluate(program, [jnp.ones((2, 2))], run)
  assert out.dtype == jnp.float16


HIGHER_ORDER = {
    "scan": lambda x: lax.scan(lambda c, _: (c * 2, None), x, None, length=2)[0],
    "while": lambda x: lax.fori_loop(0, 2, lambda i, c: c * 2, x),
    "cond": lambda x: lax.cond(x[0] > 0, lambda y: y * 2, lambda y: y * 4, x),
    "jit": lambda x: jax.jit(lambda y: y * 2)(x),
    "remat2": lambda x: jax.checkpoint(lambda y: y * 2)(x),
    "custom_jvp_call": lambda x: jax.nn.relu(x) * 2,
    "custom_vjp_call": lambda x: jax.custom_vjp(lambda y: y * 2, nondiff_argnums=())(x),
}


@pytest.mark.parametrize("name", HIGHER_ORDER)
def test_the_programs_inside_a_known_operation_are_rewritten_keeping_its_type(name):
  fun = HIGHER_ORDER[name]
  if name == "custom_vjp_call":
    fun = jax.custom_vjp(lambda y: y * 2)
    fun.defvjp(lambda y: (y * 2, None), lambda _, g: (g * 2,))
  x = jnp.arange(1.0, 4.0)
  program, _ = internals.trace(fun, [x])
  inner = []

  def interpret(sub, args):
    inner.append(sub)
    return internals.evaluate(sub, args, as_traced)

  def run(op, operands):
    if not op.holds_programs:
      return op.bind(operands)
    assert op.rewritable
    return op.bind_rewritten(operands, interpret)

  rewritten, _ = internals.trace(lambda x: internals.evaluate(program, [x], run), [x])
  np.testing.assert_allclose(internals.evaluate(rewritten, [x], as_traced), [fun(x)])
  assert inner  # each program inside ran through `interpret`
  assert jax.grad(lambda x: jnp.sum(internals.evaluate(program, [x], run)[0]))(x).shape == (3,)


@pytest.mark.parametrize("name", ["jit", "checkpoint"])
def test_a_jitted_function_or_checkpoint_is_rewritten_for_operands_of_other_dtypes(name):
  wrap = {"jit": jax.jit, "checkpoint": jax.checkpoint}[name]
  program, _ = internals.trace(wrap(lambda y: jnp.tanh(y) * y), [jnp.ones(3)])

  def run(op, operands):
    assert op.retypable
    return op.bind_rewritten(operands, lambda sub, args: internals.evaluate(
        sub, args, as_traced), retyped=True)

  [out] = internals.evaluate(program, [jnp.ones(3, jnp.float16)], run)
  assert out.dtype == jnp.float16
  np.testing.assert_allclose(out, np.tanh(1.0), rtol=1e-3)


def test_a_jitted_function_closing_over_an_array_is_rewritten_with_its_constant():
  # Since jax 0.11 a jitted function's program is a `Jaxpr` that holds its constants
  # (`consts`); the re-traced program needs them again (a module-level `jax.jit` using
  # `jnp.array([...])`, `jax.scipy.linalg.expm`).
  weights = jnp.array([0.5, 1.5, 2.5])
  program, _ = internals.trace(jax.jit(lambda y: jnp.tanh(y) * weights), [jnp.ones(3)])

  def run(op, operands):
    outs = op.bind_rewritten(operands, lambda sub, args: internals.evaluate(
        sub, args, as_traced), retyped=True)
    assert outs is not None, "the re-traced program lost its constant"
    return outs

  [out] = internals.evaluate(program, [jnp.full(3, 2.0)], run)
  np.testing.assert_allclose(out, np.tanh(2.0) * np.array([0.5, 1.5, 2.5]), rtol=1e-6)


def test_a_loop_is_not_retypable():
  program, _ = internals.trace(lambda x: lax.fori_loop(0, 2, lambda i, y: y * 2, x),
                               [jnp.ones(3)])
  assert [internals.Operation(e).retypable for e in internals.equations(program)] == [False]


def test_an_operation_holding_an_unknown_program_is_not_rewritable():
  opaque = jax.extend.core.Primitive("opaque_call")
  opaque.def_abstract_eval(lambda x, *, program: x)
  program, _ = internals.trace(
      lambda x: opaque.bind(x, program=jax.make_jaxpr(jnp.sin)(x)), [jnp.ones(2)])
  seen = []
  internals.evaluate(program, [jnp.ones(2)], lambda op, xs: seen.append(op) or [xs[0]])
  assert seen[0].holds_programs and not seen[0].rewritable


def test_a_shard_map_is_rewritten_through_jax_shard_map():
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  P = jax.sharding.PartitionSpec
  fun = jax.shard_map(lambda y: lax.psum(y * 2, "x"), mesh=mesh, in_specs=P("x"),
                      out_specs=P())
  program, _ = internals.trace(fun, [jnp.ones(2)])
  ran = []

  def run(op, operands):
    if op.holds_programs:
      assert op.rewritable
      return op.bind_rewritten(operands, lambda sub, args: ran.append(sub) or
                               internals.evaluate(sub, args, as_traced))
    return op.bind(operands)

  np.testing.assert_allclose(internals.evaluate(program, [jnp.ones(2)], run)[0], [2.0, 2.0])
  assert ran


def test_operations_that_depend_on_the_cotangents_are_the_backward_pass():
  def forward_and_backward(x, cotangent):
    return jax.vjp(lambda x: jnp.sin(x @ x), x)[1](cotangent)

  program, _ = internals.trace(forward_and_backward, [jnp.ones((2, 2)), jnp.ones((2, 2))])
  ran = internals.operations_ran(program, [1])
  assert {r.name for r in ran if not r.backward} >= {"dot_general", "sin", "cos"}
  assert {r.name for r in ran if r.backward} >= {"dot_general", "mul"}
  assert all(r.dtype == np.float32 for r in ran)


def test_operations_that_only_the_backward_outputs_need_are_the_backward_pass():
  def forward_and_backward(x, cotangent):
    out, pullback = jax.vjp(lambda x: jnp.sin(x @ x), x)
    return out, pullback(cotangent)

  program, _ = internals.trace(forward_and_backward, [jnp.ones((2, 2)), jnp.ones((2, 2))])
  ran = internals.operations_ran(program, [1], forward_outputs=1)
  assert {r.name for r in ran if not r.backward} == {"dot_general", "sin"}
  assert {r.name for r in ran if r.backward} >= {"dot_general", "mul", "cos"}


def test_a_tracer_is_reverse_differentiable_where_its_differentiation_encloses_the_code(
    maybe_jit):
  mesh = jax.make_mesh((1,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
  differentiated, seen = [], {}

  def note(where):
    def identity(y):
      seen[where] = internals.reverse_differentiable_here(differentiated[0])
      return y
    return identity

  @jax.custom_vjp
  def custom(y):  # traced apart from the differentiation around it
    return note("custom_vjp")(y)

  custom.defvjp(lambda y: (custom(y), None), lambda _, g: (g,))

  def loss(s, x):
    differentiated.append(s)
    note("loss")(x)
    jax.jit(note("jit"))(x)
    jax.vmap(note("vmap"))(x)
    lax.scan(lambda c, y: (c, note("scan")(y)), 0.0, x)
    jax.shard_map(note("shard_map"), mesh=mesh, in_specs=P(), out_specs=P())(x)
    jax.jvp(note("jvp"), (x,), (x,))  # forward mode, which a custom_vjp cannot enter
    custom(x)
    return jnp.sum(s * x)

  maybe_jit(jax.grad(loss))(jnp.ones(2), jnp.ones(2))
  assert seen == {"loss": True, "jit": True, "vmap": True, "scan": True, "shard_map": True,
                  "jvp": False, "custom_vjp": False}
  assert internals.reverse_differentiable_here(jnp.ones(2))  # no tracer


def test_an_operation_bound_again_keeps_its_name_scope():
  def f(x):
    with jax.named_scope("layer_1"):
      return jnp.tanh(x)

  program, _ = internals.trace(f, [jnp.ones(2)])
  text = jax.jit(lambda x: internals.evaluate(program, [x], as_traced)).lower(
      jnp.ones(2)).as_text(debug_info=True)
  assert "layer_1/tanh" in text


def test_a_traced_value_is_told_from_a_concrete_one():
  seen = []
  jax.jit(lambda x: seen.append(internals.is_tracer(x)) or x)(1.0)
  assert seen == [True] and not internals.is_tracer(jnp.ones(2)) and not internals.is_tracer(1.0)


def test_a_user_context_value_is_part_of_jits_cache_key():
  context, traces = internals.user_context(None), []
  f = jax.jit(lambda x: traces.append(context.value) or x)
  for value in ("a", "a", "b"):
    with context(value):
      f(1.0)
  assert traces == ["a", "b"] and context.value is None


def test_an_operation_tells_the_name_scope_and_user_line_it_was_written_at():
  def f(x):
    with jax.named_scope("layer"):
      return jnp.tanh(x)  # here

  program, _ = internals.trace(f, [jnp.ones(2)])
  seen = []
  internals.evaluate(program, [jnp.ones(2)], lambda op, xs: seen.append(op.source) or op.bind(xs))
  line = f.__code__.co_firstlineno + 2
  assert seen == [internals.Source("layer", __file__, line, f.__qualname__)]


def test_what_run_binds_and_the_operations_inside_a_jitted_function_are_located_at_its_call():
  def f(table):
    with jax.named_scope("embed"):
      return jnp.take(table, jnp.array([1, 0]), axis=0)  # a jitted jnp function

  program, _ = internals.trace(f, [jnp.ones((2, 2))])
  cast = lambda op, xs: op.bind([lax.convert_element_type(x, x.dtype) + 0 for x in xs])
  rerun, _ = internals.trace(lambda t: internals.evaluate(program, [t], cast), [jnp.ones((2, 2))])
  ran = internals.operations_ran(rerun, ())
  line = f.__code__.co_firstlineno + 2
  assert {"add", "gather"} <= {r.name for r in ran}
  assert {(r.source.scope, r.source.file, r.source.line) for r in ran} == {
      ("embed", __file__, line)}


def test_reverse_mode_through_a_while_loop_is_told_apart_from_other_errors():
  loop = lambda x: lax.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] * x), (0, x))[1]
  with pytest.raises(ValueError) as error:
    jax.make_jaxpr(jax.grad(loop))(1.0)
  assert internals.not_reverse_differentiable(error.value)
  assert not internals.not_reverse_differentiable(ValueError("some other failure"))
  assert not internals.not_reverse_differentiable(RuntimeError(str(error.value)))


def test_a_traced_function_is_named_in_tracing_errors_by_the_users_function_and_arguments():
  def user(params, scale):
    return params

  w = jnp.ones(2)
  named = internals.Named("autocast", user, ({"w": w}, 3), {}, (w,))
  with pytest.raises(jax.errors.TracerBoolConversionError,
                     match=r"function user at .* for autocast.* argument params\['w'\]"):
    internals.trace(lambda w: w if w[0] > 0 else -w, [w], named)


def test_a_class_registered_again_under_its_name_replaces_the_first_for_jax_export():
  from jax import export

  def define():
    cls = _box_class()
    internals.register_export_serialization(
        cls, "notebook.Box", serialize_auxdata=lambda aux: b"",
        deserialize_auxdata=lambda data: None)
    return cls

  define()
  latest = define()
  exported = export.export(jax.jit(lambda box: jnp.ones(())))(latest())
  assert export.deserialize(exported.serialize()).in_tree == jax.tree.structure(((latest(),), {}))


def _box_class():
  cls = type("Box", (), {"__module__": "notebook"})
  jax.tree_util.register_pytree_node(cls, lambda b: ((), None), lambda aux, _: cls())
  return cls


def _an_equation():
  return internals.equations(jax.make_jaxpr(jnp.sin)(1.0))[0]


def _register_a_box_twice():
  for _ in range(2):
    internals.register_export_serialization(
        _box_class(), "notebook.FallbackBox", serialize_auxdata=lambda aux: b"",
        deserialize_auxdata=lambda data: None)


@pytest.mark.parametrize("fallback, use, names", [
    ("_unsafe_get_axis_names", internals.axis_names_in_scope,
     ["unsafe_get_axis_names", "named vmap"]),
    ("_current_trace",
     lambda: jax.make_jaxpr(lambda x: internals.reverse_differentiable_here(x) and x)(1.0),
     ["unsafe_get_trace_stack", "custom_vjp"]),
    ("_source_info", lambda: internals._source_of(_an_equation()),
     ["source_info_util", "name scopes"]),
    pytest.param("_source_info", lambda: internals._source(_an_equation()),
                 ["source_info_util", "precision summaries"], id="_source_info-source"),
    pytest.param("_source_info", lambda: internals.Operation(_an_equation()).scopes,
                 ["source_info_util", "float32 scopes"], id="_source_info-scopes"),
    pytest.param("_source_info", lambda: internals.Operation(_an_equation()).name_scope,
                 ["source_info_util", "filter_fn"], id="_source_info-name_scope"),
    ("_save_debug_info",
     lambda: internals.trace(jnp.sin, [1.0], internals.Named("autocast", jnp.sin, (1.0,), {}, ())),
     ["save_wrapped_fun_debug_info", "params['w']"]),
    ("_partial_eval",
     lambda: internals._retrace(jax.make_jaxpr(jnp.sin)(1.0), lambda program, args: args),
     ["trace_to_jaxpr_dynamic", "inside loops"]),
    ("_export_registries", _register_a_box_twice, ["deserialization_registry", "jax.export"]),
], ids=lambda value: value if isinstance(value, str) else None)
def test_a_private_jax_name_that_moved_warns_once_naming_what_stops_working(
    monkeypatch, fallback, use, names):
  monkeypatch.setattr(internals, fallback, None)
  internals.degraded.cache_clear()
  with pytest.warns(RuntimeWarning) as warned:
    use()
    use()
  internals.degraded.cache_clear()
  [warning] = [w for w in warned if w.category is RuntimeWarning]
  assert all(name in str(warning.message) for name in names)


def test_an_operation_run_by_evaluate_tells_its_name_scope_and_what_it_traces_takes_it():
  def f(x):
    with jax.named_scope("layer_1"):
      return jnp.tanh(x)

  program, _ = internals.trace(f, [jnp.ones(2)])
  scopes = []

  def run(op, operands):
    scopes.append(op.name_scope)
    with op.in_scope():
      return [jnp.sin(operands[0])]

  rerun = lambda x: internals.evaluate(program, [x], run)
  text = jax.jit(rerun).lower(jnp.ones(2)).as_text(debug_info=True)
  assert scopes == ["layer_1"]
  assert "layer_1/sin" in text
  differentiated = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(f(x))))(jnp.ones(2))
  seen = []
  record = lambda op, xs: (seen.append((op.name, op.name_scope)), op.bind(xs))[1]
  internals.evaluate(differentiated, [jnp.ones(2)], record)
  assert {scope for name, scope in seen if name == "tanh"} == {"layer_1"}  # not "jvp(layer_1)"


def test_a_backward_matmuls_sharding_is_its_operands_permuted_on_explicit_meshes_only():
  # What the fp8 backward matmuls read (`jax.typeof(x).sharding`, its mesh's axis types,
  # `update`): the operand's spec permuted back through the transpose that follows.
  x = jnp.ones((2, 3, 4))
  assert internals.transposed_sharding(x, (1, 2, 0)) is None  # no mesh: JAX infers it
  explicit = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
  found = []
  with jax.set_mesh(explicit):
    sharded = jax.device_put(x, jax.sharding.PartitionSpec("data"))
    jax.jit(lambda x: found.append(internals.transposed_sharding(x, (1, 2, 0))))(sharded)
  [sharding] = found
  # jnp.transpose(result, (1, 2, 0)) is laid out as x: x's first axis is the result's second.
  assert tuple(sharding.spec) == (None, "data", None)
  auto = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(auto):
    assert internals.transposed_sharding(jax.device_put(x, jax.sharding.PartitionSpec("data")),
                                         (1, 2, 0)) is None
