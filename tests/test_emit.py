"""Specification of how a decided step is emitted on each platform."""

import re

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from helpers import force_branch
from jax.interpreters import mlir

import jax_lossscale as jls
from jax_lossscale import _finite
from jax_lossscale import _transform


def run_fn(finite=None):
  return lambda in_place: ({"w": jnp.ones(2), "name": "mlp"}, {"mu": jnp.full(2, 3.0)}, finite)


SKIPPED, KEPT = {"w": -jnp.zeros(2), "name": "mlp"}, {"mu": jnp.zeros(2)}


def test_each_platform_traces_its_form_and_forcing_a_branch_traces_that_one_anywhere():
  def on_cpu():  # a new function each time: jit caches a trace by function
    return jax.jit(lambda: _finite.by_platform(cpu=lambda: jnp.array(True),
                                               default=lambda: jnp.array(False)))()
  assert bool(on_cpu()) == (jax.default_backend() == "cpu")
  for branch in ["cpu", "cuda", "default"]:
    with force_branch(branch):
      assert bool(on_cpu()) == (branch == "cpu")


def compiled_emit(branch, finite):
  """The compiled program of `emit` over 3 leaves, traced for `branch`."""
  def f(should_apply, w, mu, ok):
    run = lambda in_place: ({"w": w * 2}, {"mu": mu + 1}, None if finite is None else ok)
    return _transform.emit(should_apply, run, {"w": -jnp.zeros_like(w)}, {"mu": mu},
                           checked=finite is not None)
  w = jnp.ones((3, 4))
  with force_branch(branch):
    return jax.jit(f).lower(jnp.array(True), w, w, jnp.array(True)).compile().as_text()


@pytest.mark.parametrize("finite", [None, True], ids=["unchecked", "checked"])
def test_xla_keeps_the_cond_on_cpu_and_the_select_elsewhere(finite):
  cpu, default = compiled_emit("cpu", finite), compiled_emit("default", finite)
  assert "conditional(" in cpu and not re.search(SELECT_ARRAYS, cpu)
  assert "conditional(" not in default and len(re.findall(SELECT_ARRAYS, default)) == 2


SELECT_ARRAYS = r"= f32\[3,4\]\S* select\("


def test_on_cuda_a_step_that_checks_no_update_is_a_cond_and_one_that_does_a_select():
  # Measured on an H200: the cond is faster where no update is checked (the select's
  # alternative takes 1.41x plain Adam's time at 1e8 parameters in 64 leaves, the cond
  # 1.13x); a checked step's select computes the updates once for the check and the write.
  unchecked, checked = compiled_emit("cuda", None), compiled_emit("cuda", True)
  assert "conditional(" in unchecked and not re.search(SELECT_ARRAYS, unchecked)
  assert "conditional(" not in checked and len(re.findall(SELECT_ARRAYS, checked)) == 2


@pytest.mark.parametrize("finite", [None, True], ids=["unchecked", "checked"])
def test_on_cpu_a_skipped_step_is_no_computation_it_passes_its_operands_through(finite):
  def apply_step(should_apply, w, mu, ok):  # as `apply_gradients`: a skipped step keeps `w`
    run = lambda in_place: ({"w": w * 2}, {"mu": mu + 1}, None if finite is None else ok)
    return _transform.emit(should_apply, run, {"w": w}, {"mu": mu}, checked=finite is not None)
  w = jnp.ones((3, 4))
  with force_branch("cpu"):
    program = jax.jit(apply_step).lower(jnp.array(True), w, w, jnp.array(True)).compile()
  program = program.as_text()
  # A check of the updates is taken before the conditional, not in a second one.
  skipping = re.findall(r"conditional\(.*branch_computations=\{(%[\w.]+),", program)
  assert len(skipping) == 1
  for name in skipping:
    body = re.search(re.escape(name) + r" \(.*?\{\n(.*?)\n\}", program, re.S).group(1)
    assert re.fullmatch(r"\s*ROOT %\S+ = .* parameter\(0\).*", body), body


@pytest.mark.parametrize("should_apply", [True, False])
def test_a_program_exported_for_cpu_and_gpu_chooses_when_it_runs(should_apply):
  def step(should_apply, w, mu):
    run = lambda in_place: ({"w": w * 2}, {"mu": mu + 1}, None)
    return _transform.emit(should_apply, run, {"w": -jnp.zeros_like(w)}, {"mu": mu},
                           checked=False)[:3]
  w = jnp.ones(3)
  exported = jax.export.export(jax.jit(step), platforms=("cpu", "cuda"))(
      jnp.array(True), w, w)
  out, state, applied = exported.call(jnp.array(should_apply), w, w)
  chex.assert_trees_all_equal((out["w"], state["mu"], applied),
                              (w * 2, w + 1, jnp.array(True)) if should_apply
                              else (-jnp.zeros(3), w, jnp.array(False)))


@pytest.mark.parametrize("should_apply", [True, False])
@pytest.mark.parametrize("finite", [None, True, False])
def test_both_branches_emit_the_same_results_with_static_leaves(branch, should_apply, finite):
  flag = None if finite is None else jnp.array(finite)
  out, state, applied, updates_finite = _transform.emit(
      jnp.array(should_apply), run_fn(flag), SKIPPED, KEPT, checked=finite is not None)
  expected_applied = should_apply and finite is not False
  assert out["name"] == "mlp" and bool(applied) == expected_applied
  chex.assert_trees_all_equal(out["w"], jnp.ones(2) if expected_applied else -jnp.zeros(2))
  chex.assert_trees_all_equal(state["mu"], jnp.full(2, 3.0 if expected_applied else 0.0))
  # Updates are only checked when the step runs.
  assert bool(updates_finite) == (not (should_apply and finite is False))


# --- the step's form in a program lowered for one platform, read as MLIR operations -------

LEAF = 1 << 18  # large enough for the CPU form to reduce it in rows


def lowered_step_operations(platform: str, fused: bool, dtype=jnp.float32) -> list:
  """The operations of Adam's `loss_scaling` step exported for `platform` alone (every
  function of the module, nested regions included), with 3 leaves of `LEAF` elements of
  `dtype`."""
  params = {f"leaf_{i}": jnp.full((LEAF,), 0.5, dtype) for i in range(3)}
  tx = jls.loss_scaling(optax.adam(1e-3))

  def step(params, state, grads):
    return tx.apply_gradients(grads, state, params) if fused else tx.update(grads, state, params)

  exported = jax.export.export(jax.jit(step), platforms=[platform])(
      params, tx.init(params), params)
  with mlir.make_ir_context():
    module = mlir.ir.Module.parse(exported.mlir_module())
    return [(op.name, decided_when_compiled(op), [str(x.type) for x in op.operands])
            for op in nested_operations(module.operation)]


def nested_operations(op):
  for region in op.regions:
    for block in region.blocks:
      for inner in block.operations:
        yield inner.operation
        yield from nested_operations(inner.operation)


def decided_when_compiled(op) -> bool:
  """Whether a `stablehlo.case` chooses by a constant: a constant index, or the index that
  `lax.platform_dependent` maps by a `case` of constants, both removed by XLA."""
  if op.name != "stablehlo.case":
    return False
  index = op.operands[0].owner
  index = getattr(index, "operation", index)
  if index.name == "stablehlo.constant":
    return True
  return index.name == "stablehlo.case" and all(
      result.owner.operation.name == "stablehlo.constant"
      for region in index.regions for block in region.blocks
      for result in list(block.operations)[-1].operands)


def gradient_reductions(operations) -> list[list[str]]:
  """The operand types of every reduction that reads a leaf-sized array."""
  return [types for name, _, types in operations
          if name == "stablehlo.reduce" and any(str(LEAF // 4) in t or str(LEAF) in t
                                                for t in types)]


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_cuda_program_of_float32_parameters_keeps_the_cond(fused):
  operations = lowered_step_operations("cuda", fused)
  assert any(name == "stablehlo.case" and not decided for name, decided, _ in operations)


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_cuda_program_of_bfloat16_parameters_holds_no_conditional_decided_when_it_runs(fused):
  # Their updates are checked: a select, which computes them once for the check and the write.
  cases = [decided for name, decided, _ in lowered_step_operations("cuda", fused, jnp.bfloat16)
           if name == "stablehlo.case"]
  assert all(cases), cases


@pytest.mark.parametrize("fused", [False, True], ids=["update", "apply_gradients"])
def test_a_cuda_program_checks_each_gradient_leaf_with_one_reduction_as_jmp_does(fused):
  reductions = gradient_reductions(lowered_step_operations("cuda", fused))
  assert reductions == [[f"tensor<{LEAF}xf32>", "tensor<f32>"]] * 3, reductions


def test_a_cpu_program_keeps_the_cond_and_the_reductions_in_rows():
  operations = lowered_step_operations("cpu", fused=True)
  assert any(name == "stablehlo.case" and not decided for name, decided, _ in operations)
  reductions = gradient_reductions(operations)
  assert len(reductions) == 3 and all(t[0] == f"tensor<4x{LEAF // 4}xf32>" for t in reductions)
