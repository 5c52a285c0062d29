"""Specification of how a decided step is emitted on each platform."""

import re

import chex
import jax
import jax.numpy as jnp
import pytest
from helpers import force_branch

from jax_lossscale import _transform


def run_fn(finite=None):
  return lambda: ({"w": jnp.ones(2), "name": "mlp"}, {"mu": jnp.full(2, 3.0)}, finite)


SKIPPED, KEPT = {"w": -jnp.zeros(2), "name": "mlp"}, {"mu": jnp.zeros(2)}


def test_the_platform_flag_is_true_on_cpu_and_forcing_a_branch_fixes_it():
  assert bool(jax.jit(_transform.on_cpu)()) == (jax.default_backend() == "cpu")
  for branch in ["cpu", "default"]:
    with force_branch(branch):
      assert bool(jax.jit(_transform.on_cpu)()) == (branch == "cpu")


def compiled_emit(branch, finite):
  """The compiled program of `emit` over 3 leaves, traced for `branch`."""
  def f(should_apply, w, mu, ok):
    run = lambda: ({"w": w * 2}, {"mu": mu + 1}, None if finite is None else ok)
    return _transform.emit(should_apply, run, {"w": -jnp.zeros_like(w)}, {"mu": mu})
  w = jnp.ones((3, 4))
  with force_branch(branch):
    return jax.jit(f).lower(jnp.array(True), w, w, jnp.array(True)).compile().as_text()


@pytest.mark.parametrize("finite", [None, True], ids=["unchecked", "checked"])
def test_xla_keeps_the_cond_on_cpu_and_the_select_elsewhere(finite):
  cpu, default = compiled_emit("cpu", finite), compiled_emit("default", finite)
  select_arrays = r"= f32\[3,4\]\S* select\("
  assert "conditional(" in cpu and not re.search(select_arrays, cpu)
  assert "conditional(" not in default and len(re.findall(select_arrays, default)) == 2


@pytest.mark.parametrize("finite", [None, True], ids=["unchecked", "checked"])
def test_on_cpu_a_skipped_step_is_no_computation_it_passes_its_operands_through(finite):
  def apply_step(should_apply, w, mu, ok):  # as `apply_gradients`: a skipped step keeps `w`
    run = lambda: ({"w": w * 2}, {"mu": mu + 1}, None if finite is None else ok)
    return _transform.emit(should_apply, run, {"w": w}, {"mu": mu})
  w = jnp.ones((3, 4))
  with force_branch("cpu"):
    program = jax.jit(apply_step).lower(jnp.array(True), w, w, jnp.array(True)).compile()
  program = program.as_text()
  skipping = re.findall(r"conditional\(.*branch_computations=\{(%[\w.]+),", program)
  assert len(skipping) == (1 if finite is None else 2)
  for name in skipping:
    body = re.search(re.escape(name) + r" \(.*?\{\n(.*?)\n\}", program, re.S).group(1)
    assert re.fullmatch(r"\s*ROOT %\S+ = .* parameter\(0\).*", body), body


@pytest.mark.parametrize("should_apply", [True, False])
def test_a_program_exported_for_cpu_and_gpu_chooses_when_it_runs(should_apply):
  def step(should_apply, w, mu):
    run = lambda: ({"w": w * 2}, {"mu": mu + 1}, None)
    return _transform.emit(should_apply, run, {"w": -jnp.zeros_like(w)}, {"mu": mu})[:3]
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
      jnp.array(should_apply), run_fn(flag), SKIPPED, KEPT)
  expected_applied = should_apply and finite is not False
  assert out["name"] == "mlp" and bool(applied) == expected_applied
  chex.assert_trees_all_equal(out["w"], jnp.ones(2) if expected_applied else -jnp.zeros(2))
  chex.assert_trees_all_equal(state["mu"], jnp.full(2, 3.0 if expected_applied else 0.0))
  # Updates are only checked when the step runs.
  assert bool(updates_finite) == (not (should_apply and finite is False))
