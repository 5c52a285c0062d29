"""Shared fixtures."""

import jax
import pytest
from helpers import force_branch

# The files that take longest (`pytest --durations=0`, summed per file), run first: the two
# workers of `-n 2 --dist loadfile` then end together instead of one waiting on the other.
HEAVIEST_FIRST = ("test_transform.py", "test_transformer_demo.py", "test_notebooks.py",
                  "test_docs.py", "test_probes.py", "test_demo.py", "test_distributed.py",
                  "test_probe_frameworks.py", "test_training_loops.py", "test_autocast.py",
                  "test_probe_equinox.py", "test_benchmarks.py")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(HEAVIEST_FIRST)))


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit`."""
  return jax.jit if request.param else (lambda f: f)


@pytest.fixture(params=["cpu", "default"], ids=["cond_branch", "where_branch"])
def branch(request):
  """Traces the step with the CPU (`lax.cond`) or the GPU/TPU (select) branch."""
  with force_branch(request.param):
    yield request.param
