"""Helpers shared by the test files."""

import contextlib
import importlib.util
import os
import pathlib
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_lossscale import _finite
from jax_lossscale import _jax_internals
from jax_lossscale import diagnostics
from jax_lossscale import probes as pr

# Applied steps equal an unscaled run to float rounding: the compiler may contract the
# unscaling into the optimizer's multiply-adds (benchmarks/RESULTS.md). Measured leaf by
# leaf, relative to the leaf's largest magnitude: an element of Adam's first moment that
# nearly cancels (1e-4 among entries of 0.3) carries the rounding of its inputs.
RTOL = 1e-6


BENCHMARKS = pathlib.Path(__file__).parent.parent / "benchmarks"


def benchmark_script(name: str):
  """The module of the script `benchmarks/{name}.py`, imported (its `main` not run)."""
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
  module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def dtypes_of(summary, primitive, backward=False):
  """The dtypes `primitive` ran in, in one pass of a `precision_summary`."""
  return {d for p, d, f, b in summary.rows if p == primitive and (b if backward else f)}


def forward_dtypes(fun, *args):
  """Primitive -> the dtypes it ran in, in `fun`'s own program (not differentiated)."""
  found = {}
  for ran in _jax_internals.operations_ran(jax.make_jaxpr(fun)(*args), ()):
    found.setdefault(ran.name, set()).add(ran.dtype)
  return found


@contextlib.contextmanager
def force_branch(name: str):
  """Traces a step as for the platform of branch `name` whatever the platform, so the CPU
  suite compiles and runs every platform's form: "cpu" (the `lax.cond` and the check's
  reductions in chunks and rows), "cuda" (the `lax.cond` where the step checks no
  updates, else the select; one reduction per leaf) or "default" (TPU's and other
  platforms': the select and one reduction per leaf).

  Jitted functions must be traced inside the context.
  """
  def by_platform(*args, cpu, default, cuda=None):
    chosen = {"cpu": cpu, "cuda": cuda or default, "default": default}[name]
    return chosen(*args)

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(_finite, "by_platform", by_platform)
    yield


# The session's persistent compilation cache (tests/conftest.py): every compilation cached,
# however quick or small, since the suite's thousands of programs are mostly small ones.
COMPILATION_CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                              "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def clean_env(**extra: str) -> dict[str, str]:
  """This process's environment without its XLA_ and JAX_ settings, plus `extra`: for a
  subprocess that must start from JAX's defaults (`XLA_FLAGS=...` forces CPU devices).
  The compilation cache's settings stay: a cached program is loaded as compiled, with the
  same results."""
  cache = ("JAX_COMPILATION_CACHE_DIR", *COMPILATION_CACHE_SETTINGS)
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("XLA_", "JAX_")) or k in cache}
  env.update(extra)
  return env


def assert_trees_close(actual, expected, rtol=RTOL):
  """Each leaf within `rtol` of the other, relative to the leaf's largest magnitude."""
  chex.assert_trees_all_equal_shapes_and_dtypes(actual, expected)
  paths_and_leaves = jax.tree_util.tree_leaves_with_path(actual)
  for (path, a), b in zip(paths_and_leaves, jax.tree.leaves(expected), strict=True):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = np.max(np.abs(b), initial=0.0)
    error = np.max(np.abs(a - b), initial=0.0)
    assert error <= rtol * scale + 1e-30, (jax.tree_util.keystr(path), error, scale)


COMPILED = "/jax/core/compile/backend_compile_duration"
TRACED = "/jax/core/compile/jaxpr_trace_duration"  # a function traced to a program


@contextlib.contextmanager
def count_compiles(counted: str = COMPILED):
  """Counts XLA compilations inside the block (`jax.monitoring`'s compile events), or
  the events `counted` names (`TRACED`: functions traced, a miss of a tracing cache)."""
  count = []

  def listen(event, duration, **kwargs):
    del duration, kwargs
    if event == counted:
      count.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield count
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


@jax.custom_vjp
def overflow_in_backward(x, factor):
  """The identity, whose gradient is multiplied by `factor` (inf: a backward overflow)."""
  return x


overflow_in_backward.defvjp(lambda x, factor: (x, factor),
                            lambda factor, g: (g * factor, jnp.zeros_like(factor)))


class Wrapped:
  """A framework's container of one array (as flax NNX's `nnx.Variable`)."""

  def __init__(self, value):
    self.value = value


jax.tree_util.register_pytree_node(Wrapped, lambda w: ((w.value,), None),
                                   lambda _, children: Wrapped(children[0]))

@jax.custom_vjp
def scale_backward(x, factor):
  """The identity, whose gradient is multiplied by `factor` (inf: a backward overflow)."""
  return x


scale_backward.defvjp(lambda x, factor: (x, factor),
                      lambda factor, g: (g * factor.astype(g.dtype), jnp.zeros_like(factor)))


def hits_like_unprobed(value_and_grad, adapter, loss, model, x) -> list[tuple[str, int]]:
  """Each layer's hits, after checking that the probed value and gradients are the
  unprobed ones."""
  value, grads, probes = pr.value_and_grad_with_probes(value_and_grad, adapter(loss))(model, x)
  chex.assert_trees_all_equal((value, grads), value_and_grad(loss)(model, x))
  return [(name, int(s.hits)) for name, s in diagnostics.layers(probes)]


def float16_normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
  """Standard normal samples in float16, from NumPy's generator seeded with `seed`."""
  return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float16)


def mse(prediction, target):
  """The mean squared error, in float32."""
  return jnp.mean((prediction.astype(jnp.float32) - target.astype(jnp.float32)) ** 2)
