"""Shared fixtures."""

import jax
import pytest


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit`."""
  return jax.jit if request.param else (lambda f: f)
