"""Specification of how a decided step is emitted on each platform."""

import chex
import jax
import jax.numpy as jnp
import pytest
from helpers import force_branch

from jax_lossscale import _emit


def run_fn(finite=None):
  return lambda: ({"w": jnp.ones(2), "name": "mlp"}, {"mu": jnp.full(2, 3.0)}, finite)


SKIPPED, KEPT = {"w": -jnp.zeros(2), "name": "mlp"}, {"mu": jnp.zeros(2)}


@pytest.mark.parametrize("branch", ["cpu", "default"])
def test_forcing_a_branch_traces_only_that_branch(branch):
  traced = []

  @jax.jit
  def f(x):
    return _emit.on_platform(cpu=lambda: traced.append("cpu") or x + 1,
                             default=lambda: traced.append("default") or x + 2, static=None)

  with force_branch(branch):
    out = f(jnp.float32(0))
  assert traced == [branch] and float(out) == (1 if branch == "cpu" else 2)


def test_unforced_platform_code_runs_the_cpu_branch_on_cpu():
  out = jax.jit(lambda x: _emit.on_platform(cpu=lambda: x + 1, default=lambda: x + 2,
                                            static=None))(jnp.float32(0))
  assert float(out) == (1 if jax.default_backend() == "cpu" else 2)


@pytest.mark.parametrize("should_apply", [True, False])
@pytest.mark.parametrize("finite", [None, True, False])
def test_both_branches_emit_the_same_results_with_static_leaves(branch, should_apply, finite):
  flag = None if finite is None else jnp.array(finite)
  out, state, applied, updates_finite = _emit.emit(
      jnp.array(should_apply), run_fn(flag), SKIPPED, KEPT)
  expected_applied = should_apply and finite is not False
  assert out["name"] == "mlp" and bool(applied) == expected_applied
  chex.assert_trees_all_equal(out["w"], jnp.ones(2) if expected_applied else -jnp.zeros(2))
  chex.assert_trees_all_equal(state["mu"], jnp.full(2, 3.0 if expected_applied else 0.0))
  # Updates are only checked when the step runs.
  assert bool(updates_finite) == (not (should_apply and finite is False))
