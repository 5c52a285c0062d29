"""Shared fixtures, the order of the files and one compilation cache for the session."""

import os
import shutil
import tempfile

import jax
import pytest
from helpers import COMPILATION_CACHE_SETTINGS
from helpers import force_branch

# The files that take longest (`pytest --durations=0`, summed per file), run first: the two
# workers of `-n 2 --dist loadfile` then end together instead of one waiting on the other.
HEAVIEST_FIRST = ("test_transformer_demo.py", "test_transform.py", "test_distributed.py",
                  "test_docs.py", "test_demo.py", "test_real_programs.py",
                  "test_probe_frameworks.py", "test_probes.py", "test_probe_equinox.py",
                  "test_benchmarks.py", "test_autocast.py", "test_finite.py")


def pytest_configure(config):
  """A persistent compilation cache for the session, in a new directory, one
  subdirectory per xdist worker, kept by the subprocesses a worker starts (`clean_env`).
  A program compiled once is loaded, not compiled again, by the worker and its
  subprocesses, and by the same process when a new function object traces to the same
  program. The cache maps a program and its compile options to the executable XLA made
  of it, so results are the same; compile events are still reported for a program loaded
  from it (`helpers.count_compiles` counts them alike).

  Each worker has its own directory because JAX writes an entry without a lock: a worker
  must never read an entry the other is still writing (that read warns, and a test that
  turns warnings into errors would fail). A worker's subprocesses run while it waits.
  """
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    path = tempfile.mkdtemp(prefix="jax_lossscale_tests_compilation_cache_")
    config.add_cleanup(lambda: shutil.rmtree(path, ignore_errors=True))
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  worker = os.environ.get("PYTEST_XDIST_WORKER")
  if worker is not None:
    path = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], worker)
    os.makedirs(path, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
  for name, value in COMPILATION_CACHE_SETTINGS.items():
    os.environ.setdefault(name, value)
  # This process imported jax, which read its settings, before this hook ran.
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs",
                    float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
  jax.config.update("jax_persistent_cache_min_entry_size_bytes",
                    int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]))


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(HEAVIEST_FIRST)))


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
  """Runs a function as is, or under `jax.jit`."""
  return jax.jit if request.param else (lambda f: f)


@pytest.fixture(params=["cpu", "cuda", "default"],
                ids=["cond_branch", "cuda_branch", "where_branch"])
def branch(request):
  """Traces the step with the CPU (`lax.cond`), the NVIDIA GPU's (the `lax.cond` around
  the not-in-place step where no update is checked, else the select) or the select
  branch (TPU's)."""
  with force_branch(request.param):
    yield request.param
