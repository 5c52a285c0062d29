"""Shared fixtures."""

import jax
import pytest
from helpers import force_branch


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit`."""
  return jax.jit if request.param else (lambda f: f)


@pytest.fixture(params=["cpu", "default"], ids=["cond_branch", "where_branch"])
def branch(request):
  """Traces the step with the CPU (`lax.cond`) or the GPU/TPU (select) branch."""
  with force_branch(request.param):
    yield request.param
